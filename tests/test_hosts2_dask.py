"""Issue 16 item 5: Dask over ``rdma://`` between two real hosts (two QEMU guests, each with its own rxe).

Run with ``aiodat rxe run --hosts 2 -- env AIODAT_REQUIRE_DEVICE=1 python -m pytest -m hosts2
tests/test_hosts2_dask.py``; CI runs it in the two-host boot of tests/test_faults.py, once.

Both kinds of loop in one run (marked ``both_loops``): the test's own process (host A's worker
and the client) runs the loop ``--aiodat-loop`` chooses, the two command lines run the other.  So
with asyncio chosen, as in CI's asyncio pass, the 64 MiB leave host B from a uvloop worker and
arrive on an asyncio one, and the scheduler runs uvloop; the uvloop pass leaves the test out,
as it would only swap the two (each start-up costs about two minutes under TCG).

The real command lines: ``dask scheduler --protocol rdma --host A`` on host A (where the test runs)
and ``dask worker rdma://A:PORT`` on host B (through :mod:`aiodat.testbed.hosts`).  Their start-up
is mostly importing distributed (about a minute each under TCG), so both start first, at once,
and the test imports distributed only then, on A's other vCPU (the worker retries until the
scheduler listens).  Host A's worker is a :class:`distributed.Worker` in the test's own process
and loop, which saves a third start-up.  The CLIs run distributed's event loop of the other kind
(``distributed.admin.event-loop``).

What crossing means here: 64 MiB made on B's worker (who_has: only B holds them) are compared
byte for byte with the expected pattern by a task that ran on A's worker; A's worker logged
fetching that key from B's worker, and B's process sent at least 64 MiB by RDMA write (its
``RDMAComm.totals``, read on B with ``client.run``).  distributed keeps only the consumer's replica
afterwards, so ``who_has`` is asked before the transfer, not after.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from typing import Any, AsyncIterator, Dict, List

import pytest

from aiodat.testbed import hosts

# found, not imported: importing distributed costs about a minute under TCG, paid in the test
# while the command lines start, not at collection
for _needed in ("numpy", "distributed"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"needs {_needed} (pip install aiodat[dask])", allow_module_level=True)

# two_hosts (tests/conftest.py): skipped outside a two-host test bed, AIODAT_LOOP set
pytestmark = [pytest.mark.hosts2, pytest.mark.both_loops, pytest.mark.usefixtures("two_hosts")]

SIZE = 64 << 20
START_TIMEOUT = 150.0


def other_loop(loop: str) -> str:
    """The kind of loop the command lines run: not the test's own."""
    return "asyncio" if loop == "uvloop" else "uvloop"


def _env(loop: str) -> Dict[str, str]:
    """What the dask command lines need on either host: our package first, their loop."""
    env = {"DASK_DISTRIBUTED__ADMIN__EVENT_LOOP": loop, "AIODAT_LOOP": loop, "PYTHONUNBUFFERED": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


@pytest.fixture
async def started(aiodat_loop: str) -> AsyncIterator[List[hosts.RemoteProcess]]:
    """The dask command lines of the test, on either host; killed afterwards."""
    procs: List[hosts.RemoteProcess] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            await p.wait_async(30)
        except TimeoutError:
            pass


def _output(proc: hosts.RemoteProcess) -> str:
    return f"{proc.argv} on host {'AB'[proc.host]}:\n{proc.stderr()[-3000:]}{proc.stdout()[-1000:]}"


async def _wait_logged(proc: hosts.RemoteProcess, text: str, timeout: float) -> None:
    """Wait until ``text`` shows in the process's output (distributed logs to stderr)."""
    end = time.monotonic() + timeout
    while text not in proc.stderr() and text not in proc.stdout():
        assert proc.poll() is None, f"exited with {proc.poll()}: {_output(proc)}"
        assert time.monotonic() < end, f"did not log {text!r} within {timeout} s: {_output(proc)}"
        await asyncio.sleep(0.1)


async def test_scheduler_and_workers_on_two_hosts_move_64_mib(aiodat_loop: str, started: List[hosts.RemoteProcess],
                                                              tmp_path: Any) -> None:
    a, b = hosts.address(0), hosts.address(1)
    port = 18786 + os.getpid() % 1000
    scheduler_addr = f"rdma://{a}:{port}"
    dask_cli = [sys.executable, "-m", "dask"]
    cli_loop = other_loop(aiodat_loop)
    phases: Dict[str, float] = {}
    t0 = t = time.monotonic()
    # both command lines at once, one on each host
    sched = hosts.start_on(0, dask_cli + ["scheduler", "--protocol", "rdma", "--host", a, "--port", str(port),
                                          "--no-dashboard", "--no-show"], env=_env(cli_loop))
    started.append(sched)
    remote = hosts.start_on(1, dask_cli + ["worker", scheduler_addr, "--name", "host-b", "--nthreads", "1",
                                           "--no-nanny", "--no-dashboard"], env=_env(cli_loop))
    started.append(remote)
    from distributed import Client, Worker  # meanwhile (blocks this loop, which has nothing else to do)

    make, verify_where, rdma_totals, loop_kind = _task_functions()
    phases["import"] = time.monotonic() - t
    await _wait_logged(sched, "Scheduler at:", START_TIMEOUT)
    phases["scheduler up"] = time.monotonic() - t

    async with Worker(scheduler_addr, name="host-a", nthreads=1, dashboard=False, memory_limit=0,
                      local_directory=str(tmp_path)) as worker_a, \
            Client(scheduler_addr, asynchronous=True, timeout=START_TIMEOUT) as client:
        try:
            await client.wait_for_workers(2, timeout=START_TIMEOUT)
        except TimeoutError:
            raise AssertionError(f"host B's worker did not join: {_output(remote)}") from None
        phases["workers joined"] = time.monotonic() - t
        info = (await client.scheduler.identity(n_workers=-1))["workers"]
        by_name = {w["name"]: addr for addr, w in info.items()}
        assert by_name == {"host-a": worker_a.address, "host-b": by_name["host-b"]}, by_name
        on_a, on_b = by_name["host-a"], by_name["host-b"]
        assert on_a.startswith(f"rdma://{a}:") and on_b.startswith(f"rdma://{b}:"), by_name
        # each side on its own kind of loop, as the docstring says
        assert loop_kind() == aiodat_loop
        assert await client.run(loop_kind, workers=[on_b]) == {on_b: cli_loop}
        assert await client.run_on_scheduler(loop_kind) == cli_loop

        # 64 MiB made on B: only B holds them
        t = time.monotonic()
        made = client.submit(make, SIZE, workers=[on_b], pure=False)
        await made
        assert (await client.who_has([made]))[made.key] == (on_b,)
        before = (await client.run(rdma_totals, workers=[on_b]))[on_b]
        phases["make on B"] = time.monotonic() - t

        # checked on A: the array crosses from B's worker to A's
        t = time.monotonic()
        intact, nbytes, ran_on = await client.submit(verify_where, made, workers=[on_a], pure=False)
        phases["move B->A + check"] = time.monotonic() - t
        assert ran_on == on_a and nbytes == SIZE, (ran_on, nbytes)
        assert intact, "the 64 MiB arrived on host A different from what host B made"
        fetched = [e for e in worker_a.transfer_incoming_log if made.key in e["keys"]]
        assert [e["who"] for e in fetched] == [on_b] and fetched[0]["total"] >= SIZE, fetched
        after = (await client.run(rdma_totals, workers=[on_b]))[on_b]
        sent = after["rdma_bytes"] - before["rdma_bytes"]
        assert sent >= SIZE, f"host B's worker sent {sent} bytes by RDMA write, not the {SIZE} of the array"

        # a computation spread over both hosts, checked
        t = time.monotonic()
        assert await client.submit(sum, client.map(lambda x: x * x, range(10))) == sum(x * x for x in range(10))
        phases["map"] = time.monotonic() - t
        t = time.monotonic()
    phases["close"] = time.monotonic() - t
    mib_s = SIZE / (1 << 20) / fetched[0]["duration"]
    print(f"\ndask on two hosts over rdma:// [test {aiodat_loop}, command lines {cli_loop}]: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
          + f"; total {time.monotonic() - t0:.1f} s; B->A transfer {fetched[0]['duration']:.2f} s ({mib_s:.0f} MiB/s)")


def _task_functions() -> Any:
    """The tasks, made here so that cloudpickle ships them by value (host B cannot import this module)."""
    def fill(size: int) -> Any:
        """``size`` bytes in which every 8-byte word differs (a bijection of its index): cheap under
        TCG, unlike a random generator or a hash, and any lost, moved or repeated piece shows."""
        import numpy

        words = numpy.arange(size // 8, dtype=numpy.uint64)
        words *= numpy.uint64(0x9E3779B97F4A7C15)
        return words.view(numpy.uint8)

    def make(size: int) -> Any:
        return fill(size)

    def verify_where(array: Any) -> Any:
        """Whether the array is the one :func:`make` made, its size, and the worker that checked."""
        import numpy
        from distributed import get_worker

        return bool(numpy.array_equal(array, fill(array.nbytes))), array.nbytes, get_worker().address

    def rdma_totals() -> Dict[str, int]:
        """What this worker's process sent over rdma:// so far (runs on the worker)."""
        from aiodat.integrations.dask import RDMAComm

        return dict(RDMAComm.totals)

    def loop_kind() -> str:
        """The kind of the running loop ("asyncio" or "uvloop"; runs on a worker or the scheduler)."""
        import asyncio

        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    return make, verify_where, rdma_totals, loop_kind
