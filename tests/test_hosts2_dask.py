"""Issue 16 item 5: Dask over ``rdma://`` between two real hosts (two QEMU guests, each with its own rxe).

Run with ``aiodat rxe run --hosts 2 -- env AIODAT_REQUIRE_DEVICE=1 python -m pytest -m hosts2
tests/test_hosts2_dask.py`` (once per loop: ``--aiodat-loop asyncio`` / ``uvloop``).  The real
command lines do the work: ``dask scheduler --protocol rdma --host A`` and ``dask worker
rdma://A:PORT`` on host A (where the test runs), ``dask worker rdma://A:PORT`` on host B through
:mod:`aiodat.testbed.hosts`.  The scheduler and workers run distributed's event loop of the
chosen kind (``distributed.admin.event-loop``), the client runs in the test's loop.  64 MiB made
on B's worker are consumed on A's worker and the checksum is compared.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from typing import Any, AsyncIterator, Dict, List

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("distributed")

from aiodat.testbed import hosts  # noqa: E402

pytestmark = pytest.mark.hosts2

HOW_TO = ("needs two hosts: run under `aiodat rxe run --hosts 2 -- python -m pytest -m hosts2 "
          "tests/test_hosts2_dask.py` (two QEMU guests joined by a virtio link)")
SIZE = 64 << 20
START_TIMEOUT = 150.0


@pytest.fixture(autouse=True)
def _two_hosts(request: pytest.FixtureRequest) -> None:
    required = os.environ.get("AIODAT_REQUIRE_DEVICE") == "1" and os.environ.get("AIODAT_HOSTS") == "2"
    problem = None
    if not hosts.available():
        problem = HOW_TO
    elif not os.environ.get("AIODAT_RXE_DEVICE"):
        problem = "AIODAT_HOSTS=2 but no AIODAT_RXE_DEVICE (did rxe fail to come up?)"
    elif not os.path.exists(os.path.join(os.environ["AIODAT_HOSTS_DIR"], "ready-1")):
        problem = "the agent of host B is not up"
    if problem:
        if required:
            pytest.fail(problem)
        pytest.skip(problem)


def _env(loop: str) -> Dict[str, str]:
    """What the dask command lines need on either host: our package first, the chosen loop, no dashboard noise."""
    env = {"DASK_DISTRIBUTED__ADMIN__EVENT_LOOP": "uvloop" if loop == "uvloop" else "asyncio",
           "AIODAT_LOOP": loop, "PYTHONUNBUFFERED": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


@pytest.fixture
async def started(aiodat_loop: str) -> AsyncIterator[List[Any]]:
    """Processes of the test, on either host; killed afterwards."""
    procs: List[Any] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            if isinstance(p, subprocess.Popen):
                p.wait(30)
            else:
                await p.wait_async(30)
        except (TimeoutError, subprocess.TimeoutExpired):
            pass


async def _wait_line(proc: subprocess.Popen, log: str, text: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(log) as f:
            if text in f.read():
                return
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}:\n{open(log).read()[-3000:]}"
        await asyncio.sleep(0.2)
    raise AssertionError(f"{proc.args} did not print {text!r} within {timeout} s:\n{open(log).read()[-3000:]}")


async def test_scheduler_and_workers_on_two_hosts_move_64_mib(aiodat_loop: str, started: List[Any],
                                                              tmp_path: Any) -> None:
    from distributed import Client

    _make, _digest = _task_functions()
    a, b = hosts.address(0), hosts.address(1)
    port = 18786 + os.getpid() % 1000
    scheduler_addr = f"rdma://{a}:{port}"
    env = {**os.environ, **_env(aiodat_loop)}
    dask_cli = [sys.executable, "-m", "dask"]
    t0 = time.monotonic()
    log = str(tmp_path / "scheduler.log")
    with open(log, "w") as out:
        sched = subprocess.Popen(dask_cli + ["scheduler", "--protocol", "rdma", "--host", a, "--port", str(port),
                                             "--no-dashboard", "--no-show"], stdout=out, stderr=subprocess.STDOUT,
                                 env=env)
    started.append(sched)
    await _wait_line(sched, log, "Scheduler at:", START_TIMEOUT)
    worker_args = ["worker", scheduler_addr, "--nthreads", "1", "--no-nanny", "--no-dashboard"]
    remote = hosts.start_on(1, dask_cli + worker_args + ["--name", "host-b"], env=_env(aiodat_loop))
    started.append(remote)
    wlog = str(tmp_path / "worker-a.log")
    with open(wlog, "w") as out:
        local = subprocess.Popen(dask_cli + worker_args + ["--name", "host-a"], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
    started.append(local)

    async with Client(scheduler_addr, asynchronous=True, timeout=START_TIMEOUT) as client:
        try:
            await client.wait_for_workers(2, timeout=START_TIMEOUT)
        except TimeoutError:
            raise AssertionError(f"workers did not join: host A:\n{open(wlog).read()[-3000:]}\n"
                                 f"host B:\n{remote.stderr()[-3000:]}{remote.stdout()[-2000:]}") from None
        startup = time.monotonic() - t0
        info = (await client.scheduler.identity(n_workers=-1))["workers"]
        by_name = {w["name"]: addr for addr, w in info.items()}
        assert by_name["host-a"].startswith(f"rdma://{a}:"), by_name
        assert by_name["host-b"].startswith(f"rdma://{b}:"), by_name
        # 64 MiB made on host B, consumed on host A: the array crosses the link by RDMA
        made = client.submit(_make, SIZE, 5, workers=[by_name["host-b"]], pure=False)
        await made
        t1 = time.monotonic()
        digest = await client.submit(_digest, made, workers=[by_name["host-a"]], pure=False)
        moved = time.monotonic() - t1
        assert digest == hashlib.sha256(_make(SIZE, 5).tobytes()).hexdigest()
        assert (await client.who_has([made]))[made.key] == (by_name["host-b"],) or \
            by_name["host-b"] in (await client.who_has([made]))[made.key]
        total = await client.submit(sum, client.map(lambda x: x + 1, range(50)))
        assert total == sum(range(1, 51))
    print(f"\ndask on two hosts over rdma://: start {startup:.1f} s, 64 MiB B->A + digest {moved:.1f} s "
          f"[{aiodat_loop}]")


def _task_functions() -> Any:
    """The tasks, made here so that cloudpickle ships them by value (the workers cannot import this module)."""
    def make(size: int, seed: int) -> Any:
        import numpy

        return numpy.random.default_rng(seed).integers(0, 256, size, dtype=numpy.uint8)

    def digest(array: Any) -> str:
        import hashlib

        return hashlib.sha256(array.tobytes()).hexdigest()

    return make, digest
