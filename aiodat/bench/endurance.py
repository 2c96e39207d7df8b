"""``aiodat bench soak``: many connections doing mixed operations for a while; nothing may grow."""
from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .harness import device_and_address, run_on_loop
from .stats import percentile


@dataclass
class SoakInterval:
    """One reporting interval of :func:`soak`."""

    t: float                 # seconds since the start (end of the interval)
    ops: int                 # operations completed in the interval
    ops_per_s: float
    p50_us: float
    p99_us: float
    fds: int                 # open fds at the end of the interval
    rss_kib: int             # VmRSS at the end of the interval
    reconnects: int          # connections torn down and made again in the interval


@dataclass
class SoakReport:
    """What :func:`soak` measured; ``ok`` is False when fds or RSS grew or an operation failed."""

    seconds: float
    connections: int
    loop: str
    intervals: List[SoakInterval] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    growth: Dict[str, float] = field(default_factory=dict)
    rss_slack_kib: int = 16384

    @property
    def ok(self) -> bool:
        """No errors, no fd growth, RSS within the slack (first measured interval to the last)."""
        return (not self.errors and self.growth.get("fds", 0) <= 0
                and self.growth.get("rss_kib", 0) <= self.rss_slack_kib)

    def as_dict(self) -> Dict[str, Any]:
        """The report as plain data (for --json)."""
        from dataclasses import asdict

        return {"seconds": self.seconds, "connections": self.connections, "loop": self.loop,
                "intervals": [asdict(i) for i in self.intervals], "errors": self.errors,
                "growth": self.growth, "rss_slack_kib": self.rss_slack_kib, "ok": self.ok}

    def format(self) -> str:
        """A table, one row per interval, and the verdict."""
        lines = [f"aiodat soak: {self.connections} connections, mixed send/recv, RDMA write+read, "
                 f"fetch-add, reconnects; loop {self.loop}",
                 f"{'t[s]':>7} {'ops':>8} {'ops/s':>9} {'p50[us]':>9} {'p99[us]':>9} {'fds':>5} "
                 f"{'rss[KiB]':>9} {'reconn':>6}"]
        for i in self.intervals:
            lines.append(f"{i.t:7.1f} {i.ops:8d} {i.ops_per_s:9.1f} {i.p50_us:9.1f} {i.p99_us:9.1f} "
                         f"{i.fds:5d} {i.rss_kib:9d} {i.reconnects:6d}")
        g = self.growth
        lines.append(f"growth from the first to the last interval: fds {g.get('fds', 0):+.0f}, "
                     f"RSS {g.get('rss_kib', 0):+.0f} KiB (allowed {self.rss_slack_kib} KiB)")
        for e in self.errors[:10]:
            lines.append("error: " + e)
        lines.append("verdict: " + ("OK, nothing grew" if self.ok else "FAILED"))
        return "\n".join(lines)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _soak(device: str, address: str, seconds: float, connections: int, interval: float,
                timeout: float, report: SoakReport) -> None:
    from aiodat import ConnectionRequestEvent, DATError, EvdFlags, Privileges, open_ia

    ia = open_ia(device)
    try:
        pz = ia.create_pz()
        cr_evd = ia.create_evd(max(8, connections * 2), EvdFlags.CR)
        psp = ia.create_psp_any(cr_evd)
        pending: Dict[int, "asyncio.Future[Any]"] = {}

        async def acceptor() -> None:
            while True:
                ev = await cr_evd.wait_one()
                assert isinstance(ev, ConnectionRequestEvent)  # (a CR EVD takes nothing else)
                key = int.from_bytes(ev.cr.private_data[:4], "big")
                fut = pending.pop(key, None)
                if fut is None:
                    ev.cr.reject()
                else:
                    fut.set_result(ev.cr)

        lat: List[float] = []
        counters = {"ops": 0, "reconnects": 0}
        stop = asyncio.Event()
        keys = iter(range(1, 1 << 30))

        async def connect_pair(lmr_c: Any, lmr_s: Any) -> Tuple[Any, Any]:
            client, server = ia.create_ep(pz), ia.create_ep(pz)
            key = next(keys)
            fut = asyncio.get_running_loop().create_future()
            connecting: "Optional[asyncio.Future[Any]]" = None
            try:
                server.post_recv(lmr_s[0:64], "r")
                client.post_recv(lmr_c[0:64], "r")
                pending[key] = fut
                connecting = asyncio.ensure_future(
                    client.connect(address, psp.port, key.to_bytes(4, "big"), timeout=timeout))
                # a connect that fails says why at once, not as a missing request `timeout` later
                await asyncio.wait({fut, connecting}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not fut.done():
                    if connecting.done():
                        connecting.result()  # (raises the connect's error)
                    raise asyncio.TimeoutError(f"no connection request arrived within {timeout:g} s")
                cr = fut.result()
                await cr.accept(server, timeout=timeout)
                await connecting
            except BaseException:
                pending.pop(key, None)
                if connecting is not None and not connecting.done():
                    connecting.cancel()
                    await asyncio.gather(connecting, return_exceptions=True)
                client.close()  # (close: never refused, so the error that got here goes on)
                server.close()
                raise
            return client, server

        async def worker(n: int) -> None:
            lmr_c = pz.register(bytearray(16384), Privileges.ALL)
            lmr_s = pz.register(bytearray(16384), Privileges.ALL)
            client: Any = None
            server: Any = None
            remote = lmr_s.remote()
            i = 0
            try:
                # (inside the try: a first connect that fails is an error of the report)
                client, server = await connect_pair(lmr_c, lmr_s)
                while not stop.is_set():
                    # An await whose events are already queued returns without yielding (rxe on
                    # one device often completes inline), so yield once per operation: fairness
                    # between the connections, and the reporting timer fires on time.
                    await asyncio.sleep(0)
                    i += 1
                    t0 = time.perf_counter()
                    kind = i % 4
                    if kind == 0:  # send/recv ping-pong (64 B each way)
                        client.post_send(lmr_c[64:128], "s")
                        (await server.recv_evd.wait_one(timeout=timeout)).raise_for_status()
                        server.post_recv(lmr_s[0:64], "r")
                        server.post_send(lmr_s[64:128], "s")
                        (await client.recv_evd.wait_one(timeout=timeout)).raise_for_status()
                        client.post_recv(lmr_c[0:64], "r")
                        for ep in (client, server):
                            (await ep.request_evd.wait_one(timeout=timeout)).raise_for_status()
                    elif kind == 1:  # RDMA write 4 KiB, then read it back and compare
                        stamp = i.to_bytes(8, "big") * 512
                        lmr_c.memoryview()[4096:8192] = stamp
                        client.post_rdma_write(lmr_c[4096:8192], remote[4096:8192], "w")
                        (await client.request_evd.wait_one(timeout=timeout)).raise_for_status()
                        client.post_rdma_read(lmr_c[8192:12288], remote[4096:8192], "rd")
                        (await client.request_evd.wait_one(timeout=timeout)).raise_for_status()
                        if bytes(lmr_c.memoryview()[8192:12288]) != stamp:
                            report.errors.append(f"connection {n}: RDMA read returned other data")
                    elif kind == 2:  # fetch-add
                        client.post_fetch_add(lmr_c[12288:12296], remote[12288:12296], 1, "fa")
                        (await client.request_evd.wait_one(timeout=timeout)).raise_for_status()
                    else:  # one of the connections reconnects now and then
                        if i % (64 * connections) == 3 + 4 * n:
                            await client.disconnect(timeout=timeout)
                            await server.connect_evd.wait_one(timeout=timeout)
                            client.free()
                            server.free()
                            client = server = None  # (freed: not again below if the reconnect fails)
                            client, server = await connect_pair(lmr_c, lmr_s)
                            counters["reconnects"] += 1
                        else:
                            continue
                    lat.append(time.perf_counter() - t0)
                    counters["ops"] += 1
            except (DATError, asyncio.TimeoutError) as exc:
                report.errors.append(f"connection {n}: {exc!r}")
                stop.set()
            finally:
                for obj in (client, server, lmr_c, lmr_s):
                    if obj is not None:
                        obj.free()

        acc = asyncio.ensure_future(acceptor())
        workers = [asyncio.ensure_future(worker(n)) for n in range(connections)]
        for task in (acc, *workers):  # one of them ending early (failed) ends the soak now
            task.add_done_callback(lambda _t: stop.set())
        start = time.monotonic()
        end = start + seconds
        while not stop.is_set() and time.monotonic() < end:
            t_int = time.monotonic()
            counters["ops"] = counters["reconnects"] = 0
            lat.clear()
            try:
                await asyncio.wait_for(stop.wait(), min(interval, end - t_int))
            except asyncio.TimeoutError:
                pass
            dt = time.monotonic() - t_int
            s = sorted(lat)
            report.intervals.append(SoakInterval(
                round(time.monotonic() - start, 1), counters["ops"], counters["ops"] / dt if dt else 0.0,
                percentile(s, 50) * 1e6 if s else 0.0, percentile(s, 99) * 1e6 if s else 0.0,
                _fd_count(), _rss_kib(), counters["reconnects"]))
        stop.set()
        await record_ended(report, {f"connection {n}": w for n, w in enumerate(workers)})
        acc.cancel()
        await record_ended(report, {"acceptor": acc})
    finally:
        ia.close()
    measured = report.intervals[1:] if len(report.intervals) > 2 else report.intervals  # first: warm-up
    if measured:
        report.growth = {"fds": measured[-1].fds - measured[0].fds,
                         "rss_kib": measured[-1].rss_kib - measured[0].rss_kib}


async def record_ended(report: SoakReport, tasks: Dict[str, "asyncio.Future[Any]"]) -> None:
    """Wait for ``tasks`` (by name) and add to ``report.errors`` what each ended with, if it
    raised: a worker that died (say in its first connect) must fail the soak, and
    ``gather(return_exceptions=True)`` alone hides it.  Cancellation is no error."""
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    for name, res in zip(tasks, results):
        if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
            report.errors.append(f"{name}: {res!r}")


def soak(seconds: float = 60.0, connections: int = 16, loop: str = "uvloop", *, interval: float = 5.0,
         device: Optional[str] = None, address: Optional[str] = None, timeout: float = 30.0) -> SoakReport:
    """``aiodat bench soak``: ``connections`` connections on one device doing mixed operations
    (send/recv ping-pong, 4 KiB RDMA write then read-back compare, fetch-add, and now and then a
    disconnect/reconnect) for ``seconds``; every ``interval`` seconds the throughput, p50/p99
    latency per operation, open fds and RSS.  The report's ``ok`` is False if an operation failed
    or fds/RSS grew from the first measured interval (the first is warm-up) to the last.
    ``timeout`` bounds each connect, accept, disconnect and wait for a completion, in seconds.
    """
    if not all(math.isfinite(v) and v > 0 for v in (seconds, interval, timeout)) \
            or connections < 1:  # (a NaN deadline runs nothing and would say OK)
        raise ValueError("seconds, interval and timeout must be finite and > 0, connections >= 1")
    device, address = device_and_address(device, address)
    report = SoakReport(seconds, connections, loop)
    run_on_loop(loop, lambda: _soak(device, address, seconds, connections, interval, timeout, report))
    return report
