"""``aiodat bench latency``: aiodat's send/recv ping-pong in three modes beside its Python peer (pyverbs,
event and poll mode) and its C peer (``ib_send_lat -R -e`` and ``ib_send_lat -R``), in the same run.

aiodat's modes (``--mode``):

* ``await``: each side ``await evd.wait()``;
* ``callback``: ``evd.set_callback(fn)``; ``fn(events)`` runs in the loop's
  reader callback and posts the next receive and the reply from there;
* ``busypoll``: EVDs made with ``ia.create_evd(qlen, busy_poll_us=N)``, then
  ``await evd.wait()``.

Every figure is a round-trip median (us); perftest's ``_lat`` tools print
*half* round trips, so their typical is doubled.  With ``repeat`` rounds, every
figure is taken once per round and each ratio (aiodat / peer) is the median of
the rounds' ratios (see :mod:`aiodat.bench.rounds`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .harness import device_and_address, run_on_loop
from .peer import accept_one, finish_child, kill_child, start_child
from .perftest import PerftestResult, run_perftest_pair
from .pyverbs_peer import run_pyverbs_pingpong
from .rounds import Comparison
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

    @property
    def rtt_p50(self) -> float:
        """Median round trip (us)."""
        return 2 * self.p50


#: aiodat's ways to wait for a completion (``--mode``)
MODES = ("await", "callback", "busypoll")
#: the default busy-polling window of ``--mode busypoll`` (us)
BUSY_POLL_US = 50
#: how many sends are posted per signalled one
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


def pong_callback(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> "asyncio.Future[None]":
    """The server side in callback mode: ``evd.set_callback`` answers each message from the reader callback.

    Returns a future resolved after the ``total``-th reply (or failed with the
    first error); the callback is removed then.
    """
    from aiodat import CompletionFlags, DTOOp

    suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
    post_recv, post_send, recv_op = ep.post_recv, ep.post_send, DTOOp.RECV
    done: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
    count = [0]

    def on_events(events: Sequence[Any]) -> None:
        try:
            for ev in events:
                if ev.status != "IBV_WC_SUCCESS":
                    ev.raise_for_status()
                if ev.operation is recv_op:
                    i = count[0]
                    count[0] = i + 1
                    if i + 1 < total:
                        post_recv(recv_seg)
                    post_send(send_seg, None, signal if i % SIGNAL_EVERY == 0 else suppress)
                    if i + 1 == total and not done.done():
                        done.set_result(None)
        except BaseException as exc:  # the loop's reader callback must not die silently
            if not done.done():
                done.set_exception(exc)

    evd.set_callback(on_events)
    done.add_done_callback(lambda _f: evd.set_callback(None))
    return done


def ping_callback(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> "asyncio.Future[List[int]]":
    """The client side in callback mode: the first send is posted here, every later one from the callback
    that sees the previous reply.  Returns a future of the ``total + 1`` time stamps (ns)."""
    from aiodat import CompletionFlags, DTOOp

    suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
    post_recv, post_send, recv_op = ep.post_recv, ep.post_send, DTOOp.RECV
    done: "asyncio.Future[List[int]]" = asyncio.get_running_loop().create_future()
    stamps = [0] * (total + 1)
    clock = time.perf_counter_ns
    count = [0]

    def on_events(events: Sequence[Any]) -> None:
        try:
            for ev in events:
                if ev.status != "IBV_WC_SUCCESS":
                    ev.raise_for_status()
                if ev.operation is recv_op:
                    i = count[0] + 1
                    count[0] = i
                    stamps[i] = clock()
                    if i == total:
                        if not done.done():
                            done.set_result(stamps)
                        return
                    post_recv(recv_seg)
                    post_send(send_seg, None, signal if i % SIGNAL_EVERY == 0 else suppress)
        except BaseException as exc:
            if not done.done():
                done.set_exception(exc)

    evd.set_callback(on_events)
    done.add_done_callback(lambda _f: evd.set_callback(None))
    post_recv(recv_seg)
    stamps[0] = clock()
    post_send(send_seg, None, signal)
    return done


def endpoint(ia: Any, pz: Any, size: int, fill: bool,
             busy_poll_us: Optional[int] = None) -> Tuple[Any, Any, Any, Any, List[bytearray]]:
    """An EP whose receive and send completions share one DTO-only EVD, with a send and a receive buffer.

    ``busy_poll_us``: make the EVD with ``ia.create_evd(..., busy_poll_us=N)``.
    """
    from aiodat import EPAttr, EvdFlags, Privileges

    send_buf, recv_buf = bytearray(size), bytearray(size)
    if fill:
        send_buf[:] = bytes(i & 0xFF for i in range(size))
    send_seg = pz.register(send_buf, Privileges.DEFAULT)[0:size]
    recv_seg = pz.register(recv_buf, Privileges.DEFAULT)[0:size]
    if busy_poll_us is None:
        evd = ia.create_evd(2 * _DEPTH, EvdFlags.DTO)
    else:
        evd = ia.create_evd(2 * _DEPTH, EvdFlags.DTO, busy_poll_us=busy_poll_us)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd,
                      attrs=EPAttr(max_recv_dtos=_DEPTH, max_request_dtos=_DEPTH, min_rnr_timer=1))
    return ep, evd, send_seg, recv_seg, [send_buf, recv_buf]


def _check_sizes(size: int, iters: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")


def _check_mode(mode: str, busy_poll_us: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(busy_poll_us, int) or busy_poll_us < 0:
        raise ValueError(f"busy_poll_us must be an int >= 0, got {busy_poll_us!r}")


def _warmup(iters: int) -> int:
    return min(100, max(2, iters // 10))


def _serve(mode: str, ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> "asyncio.Future[Any]":
    if mode == "callback":
        return pong_callback(ep, evd, send_seg, recv_seg, total)
    return asyncio.ensure_future(pong(ep, evd, send_seg, recv_seg, total))


async def latency_pingpong(device: str, address: str, size: int = 64, iters: int = 1000,
                           warmup: Optional[int] = None, processes: int = 1,
                           loop_name: str = "asyncio", mode: str = "await",
                           busy_poll_us: int = BUSY_POLL_US) -> LatencySample:
    """A send/recv ping-pong over rdma_cm; returns the half round-trip times.

    ``processes=1``: client and server are two EPs of one IA in this process,
    on the running loop.  ``processes=2``: the server runs in a child process
    (``python -m aiodat.bench pong``, same loop kind and mode), as perftest
    runs its two sides.  Each side's EVD takes both the receive and the send
    completions of its EP, so a round trip costs each side one wake-up.  Each
    side posts its next receive before it sends, with bare segments; sends are
    posted with ``CompletionFlags.SUPPRESS`` except every
    :data:`SIGNAL_EVERY`-th (whose completion retires the suppressed ones and
    is skipped when it turns up).  ``mode`` is how a side learns of its
    completions (:data:`MODES`): ``await evd.wait()``, ``evd.set_callback``, or
    ``await evd.wait()`` on EVDs made with ``busy_poll_us``.  Like perftest,
    the time of an iteration runs from one send to the next; the first
    ``warmup`` iterations are not counted.
    """
    from aiodat import open_ia
    from aiodat.cm import connect_pair

    _check_sizes(size, iters)
    _check_mode(mode, busy_poll_us)
    if processes not in (1, 2):
        raise ValueError(f"processes must be 1 or 2, got {processes!r}")
    warmup = _warmup(iters) if warmup is None else warmup
    total = warmup + iters
    busy = busy_poll_us if mode == "busypoll" else None
    with open_ia(device) as ia:
        pz = ia.create_pz()
        client, c_evd, c_send, c_recv, c_bufs = endpoint(ia, pz, size, True, busy)
        child = None
        served: Optional["asyncio.Future[Any]"] = None
        try:
            if processes == 1:
                server, s_evd, s_send, s_recv, s_bufs = endpoint(ia, pz, size, False, busy)
                server.post_recv(s_recv)
                await connect_pair(client, server)
                served = _serve(mode, server, s_evd, s_send, s_recv, total)
            else:
                child, port = await start_child(["pong", device, address, str(size), str(total), mode,
                                                 str(busy_poll_us)], loop_name)
                await client.connect(address, port, timeout=30)
            if mode == "callback":
                stamps = await ping_callback(client, c_evd, c_send, c_recv, total)
            else:
                stamps = await ping(client, c_evd, c_send, c_recv, total)
            if served is not None:
                await served
                if s_bufs[1] != c_bufs[0]:
                    raise AssertionError("the server received other bytes than the client sent")
            await client.disconnect()
        except BaseException:  # (a failure or Ctrl-C: the child would wait for messages that never come)
            if child is not None:
                await kill_child(child)
            raise
        finally:
            if served is not None and not served.done():
                served.cancel()
            if child is not None:
                await finish_child(child)
        if child is not None and child.returncode != 0:
            raise RuntimeError(f"the pong process failed (exit status {child.returncode})")
    half = sorted((stamps[i + 1] - stamps[i]) / 2000.0 for i in range(warmup, total))
    return LatencySample(half)


async def pong_process(device: str, address: str, size: int, total: int, mode: str = "await",
                       busy_poll_us: int = BUSY_POLL_US) -> None:
    """The child of ``processes=2``: listen on a free port, print it, echo ``total`` messages."""
    from aiodat import open_ia

    _check_mode(mode, busy_poll_us)
    with open_ia(device) as ia:
        pz = ia.create_pz()
        server, s_evd, s_send, s_recv, s_bufs = endpoint(ia, pz, size, False,
                                                         busy_poll_us if mode == "busypoll" else None)
        server.post_recv(s_recv)
        await accept_one(ia, server)
        await _serve(mode, server, s_evd, s_send, s_recv, total)
        if s_bufs[1] != bytes(i & 0xFF for i in range(size)):
            raise AssertionError("the server received other bytes than the client sent")
        await asyncio.sleep(0.2)  # let the last reply leave before the client disconnects


#: how ``ib_send_lat -R`` (busy polling) is run: both of its processes spin, and with both in one guest of
#: two vCPUs they starve rxe's own kernel work; at SCHED_IDLE the kernel preempts them when it has work
POLL_PREFIX: Tuple[str, ...] = ("chrt", "--idle", "0")

_MODE_LABELS = {"await": "aiodat await (evd.wait)", "callback": "aiodat callback (set_callback)",
                "busypoll": "aiodat busypoll (busy_poll_us={us})"}
_PEERS = (("pyverbs_event", "pyverbs event (comp channel)"), ("pyverbs_poll", "pyverbs poll (busy polling)"),
          ("ib_send_lat_e", "ib_send_lat -R -e (x2)"), ("ib_send_lat", "ib_send_lat -R (x2)"))
_SHORT = {"pyverbs_event": "pyverbs event", "pyverbs_poll": "pyverbs poll", "ib_send_lat_e": "ib_send_lat -e",
          "ib_send_lat": "ib_send_lat"}


def perftest_rtt(res: PerftestResult) -> Tuple[Optional[float], Optional[str]]:
    """A ``_lat`` result as a round trip (2 x typical, us), or None and why it is unusable."""
    if not res.ok:
        return None, res.error
    typical = res.value("t_typical[usec]")
    if typical is None or not typical > 0 or typical == float("inf"):
        return None, f"{res.tool} printed t_typical[usec] = {typical} (its cycle counter failed)"
    return 2 * typical, None


def bench_latency(size: int = 64, iters: int = 1000, loop: str = "asyncio", *, repeat: int = 3,
                  modes: Sequence[str] = MODES, busy_poll_us: int = BUSY_POLL_US, perftest: bool = True,
                  pyverbs: bool = True, processes: int = 1, device: Optional[str] = None,
                  address: Optional[str] = None, timeout: float = 300.0,
                  progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """``aiodat bench latency``: ``repeat`` rounds of aiodat's ping-pong in each of ``modes``, then the
    pyverbs ping-pong (event, poll), ``ib_send_lat -R -e`` and ``ib_send_lat -R``.

    Everything runs one after the other (never at the same time) on the same
    device with the same size and iteration count.  The report's figures are
    round-trip medians in us; its ratios are aiodat / peer per round and their
    median.  A mode or peer that cannot run (e.g. this aiodat has no
    ``set_callback``) is reported as not measured, with the reason.
    """
    from aiodat import DATError

    _check_sizes(size, iters)
    for mode in modes:
        _check_mode(mode, busy_poll_us)
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    device, address = device_and_address(device, address)
    report = Comparison("aiodat bench latency", {"device": device, "address": address, "loop": loop,
                                                 "size": size, "iters": iters, "processes": processes},
                        repeat, title="round trip p50 in us (perftest prints half round trips: doubled here)")
    keys = [f"aiodat_{m}" for m in modes]
    for m in modes:
        report.figure(f"aiodat_{m}", _MODE_LABELS[m].format(us=busy_poll_us), "us")
    peers = [p for p in _PEERS if (pyverbs or not p[0].startswith("pyverbs"))
             and (perftest or not p[0].startswith("ib_"))]
    for key, label in peers:
        report.figure(key, label, "us")
    for ours in keys:
        for key, _label in peers:
            report.compare(ours, key, f"{ours[len('aiodat_'):]} / {_SHORT[key]}")
    for r in range(repeat):
        for mode in modes:
            if progress:
                progress(f"round {r + 1}: aiodat {mode}")
            try:
                sample = run_on_loop(loop, lambda: latency_pingpong(
                    device, address, size, iters, processes=processes, loop_name=loop, mode=mode,
                    busy_poll_us=busy_poll_us))
                report.figures[f"aiodat_{mode}"].record(sample.rtt_p50)
            except (AttributeError, TypeError, NotImplementedError) as exc:  # an aiodat without the mode
                report.figures[f"aiodat_{mode}"].record(None, f"{type(exc).__name__}: {exc}")
            except (DATError, RuntimeError, AssertionError) as exc:
                report.figures[f"aiodat_{mode}"].record(None, f"{type(exc).__name__}: {exc}")
        for key, _label in peers:
            if progress:
                progress(f"round {r + 1}: {key}")
            fig = report.figures[key]
            if key.startswith("pyverbs"):
                res = run_pyverbs_pingpong(device, address, size, iters, key.split("_")[1], SIGNAL_EVERY,
                                           timeout)
                fig.record(res.p50, res.error or None)
            else:
                args = ["-s", str(size), "-n", str(iters)] + (["-e"] if key == "ib_send_lat_e" else [])
                prefix = POLL_PREFIX if key == "ib_send_lat" else ()
                value, err = perftest_rtt(run_perftest_pair("ib_send_lat", args, device=device, address=address,
                                                            timeout=timeout, prefix=prefix,
                                                            figure="t_typical[usec]"))
                fig.record(value, err)
    if perftest:
        report.notes.append("ib_send_lat -R runs under `chrt --idle 0`: two spinning processes on the "
                            "guest's vCPUs otherwise starve rxe's kernel work (typical in ms, min in us)")
    return report
