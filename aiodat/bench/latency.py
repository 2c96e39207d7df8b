"""``aiodat bench latency``: a send/recv ping-pong awaiting ``evd.wait()`` on both sides, beside
``ib_send_lat -R -e`` (sleeps on CQ events) and ``ib_send_lat -R`` (busy polling).

perftest's ``_lat`` tools print *half* the round trip, so aiodat's figures are
half the measured round trip too (see docs/performance.md).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .harness import device_and_address, run_on_loop
from .peer import accept_one, finish_child, start_child
from .perftest import PerftestResult, run_perftest_pair
from . import stats
from .stats import percentile


@dataclass
class LatencySample:
    """aiodat's ping-pong: half round-trip times in microseconds, sorted."""

    half_rtt_us: List[float]

    @property
    def p50(self) -> float:
        """Median half round trip (us)."""
        return percentile(self.half_rtt_us, 50)

    @property
    def p99(self) -> float:
        """99th percentile half round trip (us)."""
        return percentile(self.half_rtt_us, 99)


@dataclass
class LatencyReport:
    """What :func:`bench_latency` measured: aiodat beside ``ib_send_lat -R -e`` and ``ib_send_lat -R``."""

    device: str
    address: str
    loop: str
    size: int
    iters: int
    aiodat: LatencySample
    send_lat_events: Optional[PerftestResult] = None
    send_lat_poll: Optional[PerftestResult] = None
    processes: int = 1

    def ratio_events(self) -> Optional[float]:
        """aiodat p50 / ``ib_send_lat -R -e`` typical, or None when perftest did not run."""
        return _ratio(self.aiodat.p50, self.send_lat_events)

    def ratio_poll(self) -> Optional[float]:
        """aiodat p50 / ``ib_send_lat -R`` typical, or None when perftest did not run."""
        return _ratio(self.aiodat.p50, self.send_lat_poll)

    def as_dict(self) -> Dict[str, Any]:
        """The figures as a JSON-serialisable dict (``aiodat bench latency --json``)."""
        def tool(res: Optional[PerftestResult]) -> Optional[Dict[str, Any]]:
            if res is None:
                return None
            return {"ok": res.ok, "error": res.error or None, "typical_us": res.value("t_typical[usec]"),
                    "p99_us": res.value("99%_percentile[usec]"), "row": res.rows[-1] if res.rows else None}

        return {"device": self.device, "address": self.address, "loop": self.loop, "size": self.size,
                "iters": self.iters, "processes": self.processes,
                "aiodat": {"p50_us": self.aiodat.p50, "p99_us": self.aiodat.p99},
                "ib_send_lat_events": tool(self.send_lat_events), "ib_send_lat_poll": tool(self.send_lat_poll),
                "ratio_events": self.ratio_events(), "ratio_poll": self.ratio_poll()}

    def format(self) -> str:
        """The human-readable report ``aiodat bench latency`` prints."""
        lines = [
            f"aiodat bench latency: {self.device} ({self.address}), loop={self.loop}, "
            f"size={self.size} B, iters={self.iters}, {self.processes} process(es); "
            f"half round trip in us (perftest _lat convention)",
            f"  {'what':<34}{'p50/typical':>12}{'p99':>10}",
            f"  {'aiodat send/recv, evd.wait()':<34}{self.aiodat.p50:>12.1f}{self.aiodat.p99:>10.1f}",
        ]
        for label, res in (("ib_send_lat -R -e (CQ events)", self.send_lat_events),
                           ("ib_send_lat -R (busy polling)", self.send_lat_poll)):
            if res is None:
                continue
            if res.ok:
                lines.append(f"  {label:<34}{res.value('t_typical[usec]') or 0:>12.1f}"
                             f"{res.value('99%_percentile[usec]') or 0:>10.1f}")
            else:
                lines.append(f"  {label:<34}  not measured: {res.error}")
        if self.send_lat_events is not None or self.send_lat_poll is not None:
            parts = []
            for label, ratio in (("vs ib_send_lat -e", self.ratio_events()), ("vs ib_send_lat", self.ratio_poll())):
                parts.append(f"{ratio:.2f}x {label}" if ratio is not None else f"n/a {label}")
            lines.append("ratio (aiodat p50 / perftest typical): " + ", ".join(parts))
        return "\n".join(lines)


def _ratio(value: float, res: Optional[PerftestResult]) -> Optional[float]:
    if res is None or not res.ok:
        return None
    return stats.ratio(value, res.value("t_typical[usec]"))


SIGNAL_EVERY = 16
_DEPTH = 4 * SIGNAL_EVERY


async def pong(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> None:
    """The server side: ``total`` times, await a message, post the next receive, send the reply."""
    from aiodat import CompletionFlags, DTOOp

    suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
    wait, post_recv, post_send, recv_op = evd.wait, ep.post_recv, ep.post_send, DTOOp.RECV
    for i in range(total):
        got = False
        while not got:  # _await_recv, inlined: one coroutine less per message
            for ev in await wait():
                if ev.status != "IBV_WC_SUCCESS":
                    ev.raise_for_status()
                if ev.operation is recv_op:
                    got = True
        if i + 1 < total:
            post_recv(recv_seg)
        post_send(send_seg, None, signal if i % SIGNAL_EVERY == 0 else suppress)


async def ping(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> List[int]:
    """The client side: ``total`` times, post the receive for the reply, send, await the reply.

    Returns ``total + 1`` time stamps (ns): one at each send and one at the end.
    """
    from aiodat import CompletionFlags, DTOOp

    suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
    wait, post_recv, post_send, recv_op = evd.wait, ep.post_recv, ep.post_send, DTOOp.RECV
    stamps = [0] * (total + 1)
    clock = time.perf_counter_ns
    for i in range(total):
        post_recv(recv_seg)
        stamps[i] = clock()
        post_send(send_seg, None, signal if i % SIGNAL_EVERY == 0 else suppress)
        got = False
        while not got:  # _await_recv, inlined
            for ev in await wait():
                if ev.status != "IBV_WC_SUCCESS":
                    ev.raise_for_status()
                if ev.operation is recv_op:
                    got = True
    stamps[total] = clock()
    return stamps


def endpoint(ia: Any, pz: Any, size: int, fill: bool) -> Tuple[Any, Any, Any, Any, List[bytearray]]:
    """An EP whose receive and send completions share one DTO-only EVD, with a send and a receive buffer."""
    from aiodat import EPAttr, EvdFlags, Privileges

    send_buf, recv_buf = bytearray(size), bytearray(size)
    if fill:
        send_buf[:] = bytes(i & 0xFF for i in range(size))
    send_seg = pz.register(send_buf, Privileges.DEFAULT)[0:size]
    recv_seg = pz.register(recv_buf, Privileges.DEFAULT)[0:size]
    evd = ia.create_evd(2 * _DEPTH, EvdFlags.DTO)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd,
                      attrs=EPAttr(max_recv_dtos=_DEPTH, max_request_dtos=_DEPTH, min_rnr_timer=1))
    return ep, evd, send_seg, recv_seg, [send_buf, recv_buf]


def _check_sizes(size: int, iters: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")


def _warmup(iters: int) -> int:
    return min(100, max(2, iters // 10))


async def latency_pingpong(device: str, address: str, size: int = 2, iters: int = 1000,
                           warmup: Optional[int] = None, processes: int = 1,
                           loop_name: str = "asyncio") -> LatencySample:
    """A send/recv ping-pong over rdma_cm; returns the half round-trip times.

    ``processes=1``: client and server are two EPs of one IA in this process,
    two tasks on the running loop.  ``processes=2``: the server runs in a
    child process (``python -m aiodat.bench pong``, same loop kind), as
    perftest runs its two sides.  Either way each side awaits ``evd.wait()``
    on its own EVD, which takes both the receive and the send completions of
    its EP, so a round trip costs each side one wake-up.  Each side posts its
    next receive before it sends; sends are posted with
    ``CompletionFlags.SUPPRESS`` except every :data:`SIGNAL_EVERY`-th (whose
    completion retires the suppressed ones and is skipped when it turns up).
    Buffers, segments and flags are made once.  Like perftest, the time of an
    iteration runs from one send to the next; the first ``warmup`` iterations
    are not counted.
    """
    from aiodat import open_ia
    from aiodat.cm import connect_pair

    _check_sizes(size, iters)
    if processes not in (1, 2):
        raise ValueError(f"processes must be 1 or 2, got {processes!r}")
    warmup = _warmup(iters) if warmup is None else warmup
    total = warmup + iters
    with open_ia(device) as ia:
        pz = ia.create_pz()
        client, c_evd, c_send, c_recv, c_bufs = endpoint(ia, pz, size, True)
        child = None
        server_task = None
        try:
            if processes == 1:
                server, s_evd, s_send, s_recv, s_bufs = endpoint(ia, pz, size, False)
                server.post_recv(s_recv)
                await connect_pair(client, server)
                server_task = asyncio.ensure_future(pong(server, s_evd, s_send, s_recv, total))
            else:
                child, port = await start_child(["pong", device, address, str(size), str(total)], loop_name)
                await client.connect(address, port, timeout=30)
            stamps = await ping(client, c_evd, c_send, c_recv, total)
            if server_task is not None:
                await server_task
                if s_bufs[1] != c_bufs[0]:
                    raise AssertionError("the server received other bytes than the client sent")
            await client.disconnect()
        finally:
            if server_task is not None and not server_task.done():
                server_task.cancel()
            if child is not None:
                await finish_child(child)
        if child is not None and child.returncode != 0:
            raise RuntimeError(f"the pong process failed (exit status {child.returncode})")
    half = sorted((stamps[i + 1] - stamps[i]) / 2000.0 for i in range(warmup, total))
    return LatencySample(half)


async def pong_process(device: str, address: str, size: int, total: int) -> None:
    """The child of ``processes=2``: listen on a free port, print it, echo ``total`` messages."""
    from aiodat import open_ia

    with open_ia(device) as ia:
        pz = ia.create_pz()
        server, s_evd, s_send, s_recv, s_bufs = endpoint(ia, pz, size, False)
        server.post_recv(s_recv)
        await accept_one(ia, server)
        await pong(server, s_evd, s_send, s_recv, total)
        if s_bufs[1] != bytes(i & 0xFF for i in range(size)):
            raise AssertionError("the server received other bytes than the client sent")
        await asyncio.sleep(0.2)  # let the last reply leave before the client disconnects


def bench_latency(size: int = 2, iters: int = 1000, loop: str = "asyncio", *, perftest: bool = True,
                  processes: int = 1, device: Optional[str] = None, address: Optional[str] = None,
                  timeout: float = 300.0) -> LatencyReport:
    """``aiodat bench latency``: aiodat's ping-pong, then ``ib_send_lat -R -e`` and ``ib_send_lat -R``.

    All three run one after the other (never at the same time) on the same
    device with the same size and iteration count.
    """
    _check_sizes(size, iters)
    device, address = device_and_address(device, address)
    sample = run_on_loop(loop, lambda: latency_pingpong(device, address, size, iters, processes=processes,
                                                        loop_name=loop))
    report = LatencyReport(device, address, loop, size, iters, sample, processes=processes)
    if perftest:
        args = ["-s", str(size), "-n", str(iters)]
        report.send_lat_events = run_perftest_pair("ib_send_lat", [*args, "-e"], device=device, address=address,
                                                   timeout=timeout)
        report.send_lat_poll = run_perftest_pair("ib_send_lat", args, device=device, address=address,
                                                 timeout=timeout)
    return report
