"""Fixtures shared by aiodat's own tests (the user-facing ones live in aiodat.testing.plugin)."""
from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, List

import pytest


@pytest.fixture
async def loop_errors() -> AsyncIterator[List[dict]]:
    """Records anything that escapes into the loop's exception handler; the test fails if something did."""
    loop = asyncio.get_running_loop()
    errors: List[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    loop.set_exception_handler(old)
    assert not errors, f"exceptions escaped into the event loop: {errors}"


@pytest.fixture
def general_path_calls(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Counts post.py's general-path steps (every one of its batch paths turns segments with
    as_segments): ``[0]`` stays 0 while every post takes C's batch paths (aiodat/_shim/posts.c)."""
    import aiodat.post

    calls = [0]
    real = aiodat.post.as_segments

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(aiodat.post, "as_segments", counted)
    return calls


@pytest.fixture
def two_hosts(request: pytest.FixtureRequest) -> None:
    """For the ``hosts2`` tests: skip outside a two-host test bed (fail there under
    AIODAT_REQUIRE_DEVICE=1: rxe or host B's agent not up is then a failure), and export the
    loop chosen with --aiodat-loop as AIODAT_LOOP for the programs the test starts on either host."""
    from aiodat.testbed import hosts

    required = os.environ.get("AIODAT_REQUIRE_DEVICE") == "1" and os.environ.get("AIODAT_HOSTS") == "2"
    problem = None
    if not hosts.available():
        problem = (f"needs two hosts: run under `aiodat rxe run --hosts 2 -- python -m pytest -m hosts2 "
                   f"tests/{request.path.name}` (two QEMU guests joined by a virtio link)")
    elif not os.environ.get("AIODAT_RXE_DEVICE"):
        problem = "AIODAT_HOSTS=2 but no AIODAT_RXE_DEVICE (did rxe fail to come up?)"
    elif not os.path.exists(os.path.join(os.environ["AIODAT_HOSTS_DIR"], "ready-1")):
        problem = "the agent of host B is not up"
    if problem:
        if required:
            pytest.fail(problem)
        pytest.skip(problem)
    os.environ["AIODAT_LOOP"] = request.config.getoption("--aiodat-loop") or os.environ.get("AIODAT_LOOP", "asyncio")
