"""The floor of a Python callback per message: what any design that calls Python for each completion
can reach in this guest, whatever aiodat does around it.  A developer's tool, run in the rxe guest:

    aiodat rxe run -- .venv/bin/python bench/callback_floor.py [uvloop|asyncio] [ROUND_TRIPS] [MODES]

It sets up the one-process 64-byte ping-pong of ``bench/modes_pingpong.py`` with aiodat (two
connected EPs, each with one EVD), takes the CQs away from aiodat (its reader callbacks detached),
and then runs it with nothing but the shim's cffi calls (``aiodat_post_recv1``,
``aiodat_post_send1``, ``aiodat_cq_poll``) and no events, no request tracking and no checks:

* ``plain``: a Python loop, both sides in turn, spinning on the CQ;
* ``callback``: through the event loop, a ``call_soon`` poller that polls both CQs (again while
  completions keep coming, up to 16 times a turn, as aiodat's poller does) and calls a Python
  function per completion, which posts the next receive and the reply;
* ``await``: the floor of a wait per message: two tasks, each awaiting a bare Future that the
  same kind of ``call_soon`` poller completes when a receive arrives on its CQ, and then posting
  the next receive and the reply, as ``await evd.wait()`` does with none of aiodat around it.

MODES (comma-separated, default all three) picks some, e.g. one alone under a profiler.  It
prints the p50 round trip (us) of each; compare with pyverbs' event mode in the same boot
(``aiodat/bench/pyverbs_pingpong.py --mode event``).  See docs/performance.md, "The floor of a
Python callback".
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any, Callable, List, Tuple

import aiodat
from aiodat import EPAttr, EvdFlags
from aiodat._lib import ffi, lib
from aiodat.bench.harness import device_and_address, run_on_loop
from aiodat.cm import connect_pair

SIZE, SIGNAL_EVERY = 64, 16
WR_SEND, SEND_SIGNALED, SEND_INLINE = 2, 2, 8


def endpoint(ia: Any, pz: Any) -> Tuple[Any, Any, Any, Any]:
    send_seg = pz.register(bytearray(SIZE))[0:SIZE]
    recv_seg = pz.register(bytearray(SIZE))[0:SIZE]
    evd = ia.create_evd(256, EvdFlags.DTO)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=EPAttr(max_recv_dtos=64, max_request_dtos=64))
    return ep, evd, send_seg, recv_seg


def raw(seg: Any) -> Tuple[int, int, int]:
    return seg.lmr.address + seg.offset, seg.length, seg.lmr.lmr_context


async def run(mode: str, n: int) -> float:
    device, _ = device_and_address(None, None)
    with aiodat.open_ia(device) as ia:
        pz = ia.create_pz()
        a, a_evd, a_send, a_recv = endpoint(ia, pz)
        b, b_evd, b_send, b_recv = endpoint(ia, pz)
        b.post_recv(b_recv)
        await connect_pair(a, b)
        # from here on nothing of aiodat runs: its callbacks take nothing, its reader callbacks go
        a_evd.set_callback(lambda events: None)
        b_evd.set_callback(lambda events: None)
        await asyncio.sleep(0.05)  # (the poller arms the CQs and lets them go)
        a_evd._watch.detach()
        b_evd._watch.detach()
        qa, qb, cqa, cqb = a._qp, b._qp, a_evd._cq, b_evd._cq
        sa, ra, sb, rb = raw(a_send), raw(a_recv), raw(b_send), raw(b_recv)
        wcs = ffi.new("struct aiodat_wc[]", 8)
        post_recv1, post_send1, poll = lib.aiodat_post_recv1, lib.aiodat_post_send1, lib.aiodat_cq_poll
        clock = time.perf_counter_ns
        stamps: List[int] = []

        def flags(i: int) -> int:
            return (SEND_SIGNALED if i % SIGNAL_EVERY == 0 else 0) | SEND_INLINE

        def spin_for_recv(cq: Any) -> None:
            while True:
                got = poll(cq, wcs, 8)
                if any(wcs[k].wr_id & 1 for k in range(got)):
                    return

        if mode == "plain":
            for i in range(n):
                post_recv1(qa, 1, *ra)
                stamps.append(clock())
                post_send1(qa, 2, WR_SEND, flags(i), 0, *sa, 0, 0)
                spin_for_recv(cqb)
                post_recv1(qb, 1, *rb)
                post_send1(qb, 2, WR_SEND, flags(i), 0, *sb, 0, 0)
                spin_for_recv(cqa)
            stamps.append(clock())
        elif mode == "await":
            loop = asyncio.get_running_loop()
            waiters: List[Any] = [None, None]  # the future each side's task awaits

            def poll_turn() -> None:
                for side, cq in ((0, cqa), (1, cqb)):
                    fut = waiters[side]
                    got = poll(cq, wcs, 8)
                    if fut is not None and any(wcs[k].wr_id & 1 for k in range(got)):
                        waiters[side] = None
                        fut.set_result(None)
                if waiters[0] is not None or waiters[1] is not None:
                    loop.call_soon(poll_turn)

            def sleep(side: int) -> "asyncio.Future[None]":
                fut = waiters[side] = loop.create_future()
                if waiters[1 - side] is None:  # (otherwise the poller is already scheduled)
                    loop.call_soon(poll_turn)
                return fut

            async def pong() -> None:
                for i in range(n):
                    await sleep(1)
                    post_recv1(qb, 1, *rb)
                    post_send1(qb, 2, WR_SEND, flags(i), 0, *sb, 0, 0)

            server = asyncio.ensure_future(pong())
            await asyncio.sleep(0)
            for i in range(n):
                post_recv1(qa, 1, *ra)
                stamps.append(clock())
                post_send1(qa, 2, WR_SEND, flags(i), 0, *sa, 0, 0)
                await sleep(0)
            stamps.append(clock())
            await server
        else:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            count = [0, 0]

            def on_b(wc: Any) -> None:
                if wc.wr_id & 1:
                    count[1] += 1
                    post_recv1(qb, 1, *rb)
                    post_send1(qb, 2, WR_SEND, flags(count[1]), 0, *sb, 0, 0)

            def on_a(wc: Any) -> None:
                if wc.wr_id & 1:
                    count[0] += 1
                    stamps.append(clock())
                    if count[0] == n:
                        done.set_result(None)
                        return
                    post_recv1(qa, 1, *ra)
                    post_send1(qa, 2, WR_SEND, flags(count[0]), 0, *sa, 0, 0)

            pairs: Tuple[Tuple[Any, Callable[[Any], None]], ...] = ((cqa, on_a), (cqb, on_b))

            def turn() -> None:
                for _ in range(16):
                    again = False
                    for cq, fn in pairs:
                        for k in range(poll(cq, wcs, 8)):
                            again = True
                            fn(wcs[k])
                    if not again:
                        break
                if not done.done():
                    loop.call_soon(turn)

            post_recv1(qa, 1, *ra)
            stamps.append(clock())
            post_send1(qa, 2, WR_SEND, flags(0), 0, *sa, 0, 0)
            loop.call_soon(turn)
            await done
        a_evd.set_callback(None)
        b_evd.set_callback(None)
    rtt = sorted((stamps[i + 1] - stamps[i]) / 1000 for i in range(n // 10, len(stamps) - 1))
    return statistics.median(rtt)


def main() -> None:
    loop = sys.argv[1] if len(sys.argv) > 1 else "uvloop"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ("plain", "callback", "await")
    for mode in modes:
        print(f"{loop} {mode}: p50 round trip {run_on_loop(loop, lambda: run(mode, n)):.1f} us", flush=True)


if __name__ == "__main__":
    main()
