"""``aiodat bench soak``: argument checks and how a dead connection is reported on the host; on rxe, a
connection that cannot be made fails the soak."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from aiodat import bench
from aiodat.cli import main


@pytest.mark.parametrize("argv, said", [
    (["--seconds", "nan"], "argument --seconds: must be finite and > 0, got nan"),
    (["--seconds", "inf"], "argument --seconds: must be finite and > 0"),
    (["--seconds", "0"], "argument --seconds: must be finite and > 0, got 0"),
    (["--interval", "nan"], "argument --interval: must be finite and > 0"),
    (["--interval=-inf"], "argument --interval: must be finite and > 0"),
    (["--timeout", "0"], "argument --timeout: must be finite and > 0, got 0"),
    (["--connections", "0"], "argument --connections/-c: must be >= 1, got 0")])
def test_bad_arguments_are_refused(argv: Any, said: str, capsys: Any) -> None:
    assert main(["bench", "soak", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "usage:" in err


@pytest.mark.parametrize("kwargs", [{"seconds": float("nan")}, {"interval": float("nan")},
                                    {"seconds": float("inf")}, {"timeout": float("nan")}, {"timeout": 0.0}])
def test_soak_refuses_non_finite_times(kwargs: Any) -> None:
    with pytest.raises(ValueError, match="finite"):
        bench.soak(**kwargs)


async def test_a_task_that_died_is_an_error() -> None:
    """What each worker (and the acceptor) ended with goes into the report: a worker that died in its
    first connect is an error, not a silent OK; a cancelled task is not."""
    from aiodat.bench.endurance import record_ended

    async def dies() -> None:
        raise asyncio.TimeoutError()

    async def fine() -> None:
        pass

    async def hangs() -> None:
        await asyncio.sleep(60)

    report = bench.SoakReport(1.0, 2, "asyncio")
    tasks = [asyncio.ensure_future(c) for c in (fine(), dies(), hangs())]
    await asyncio.sleep(0)
    tasks[2].cancel()
    await record_ended(report, {"connection 0": tasks[0], "connection 1": tasks[1], "acceptor": tasks[2]})
    assert report.errors == ["connection 1: TimeoutError()"]
    assert not report.ok and "verdict: FAILED" in report.format()


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_a_connection_never_made_fails_the_soak(rdma_device: Any) -> None:
    """Every connect goes to an address no device here reaches (TEST-NET-1): each worker dies in its
    first connect, and that is an error, within the soak's ``timeout`` (the default's 30 s would
    cost the suite 30 s)."""
    t0 = time.monotonic()
    report = bench.soak(3.0, 2, "asyncio", interval=1.0, device=rdma_device.name, address="192.0.2.1", timeout=3.0)
    assert time.monotonic() - t0 < 20, "the connect's timeout was not the soak's"
    assert not report.ok and report.errors, report.format()
    assert all(e.startswith("connection ") for e in report.errors), report.errors
