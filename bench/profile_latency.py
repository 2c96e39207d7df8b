"""Where does a ping-pong message's time go?  A developer's tool, run in the rxe guest:

    aiodat rxe run -- .venv/bin/python bench/profile_latency.py [--loop uvloop] [--iters 2000]
    aiodat rxe run -- .venv/bin/python bench/profile_latency.py --bytecodes [--iters 200]

It runs the one-process send/recv ping-pong of ``aiodat bench latency`` with a
clock around each step (the clock itself costs a little; compare the steps with
each other), then times the loop's and cffi's own costs on their own.  Figures
are mean microseconds per call.  With ``--bytecodes`` it instead counts the
bytecodes each function executes per round trip (``sys.settrace`` opcode
events): a measure of the Python on the path that the host's load cannot blur.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Dict, List, Tuple

from aiodat import CompletionFlags, DTOOp, open_ia
from aiodat.bench import SIGNAL_EVERY, device_and_address, run_on_loop
from aiodat.bench.latency import endpoint
from aiodat.cm import connect_pair
from aiodat.evd import EVD

TOTALS: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
clock = time.perf_counter_ns


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its time added to TOTALS[name]."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            cell = TOTALS[name]
            cell[0] += clock() - t0
            cell[1] += 1
    return wrapper


async def side(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int, client: bool) -> None:
    wait, post_recv, post_send = evd.wait, timed("post_recv", ep.post_recv), timed("post_send", ep.post_send)
    suppress, signal, recv_op = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT, DTOOp.RECV
    for i in range(total):
        if client:
            post_recv(recv_seg)
            post_send(send_seg, None, signal if i % SIGNAL_EVERY == 0 else suppress)
        got = False
        while not got:
            t0 = clock()
            events = await wait()
            cell = TOTALS["await evd.wait() (incl. sleep)"]
            cell[0] += clock() - t0
            cell[1] += 1
            for ev in events:
                if ev.operation is recv_op:
                    got = True
        if not client:
            if i + 1 < total:
                post_recv(recv_seg)
            post_send(send_seg, None, signal if i % SIGNAL_EVERY == 0 else suppress)


class TimedLib:
    """The cffi lib with its hot C calls timed (a module's ``lib`` global is swapped for this)."""

    def __init__(self, lib: Any, names: List[str]) -> None:
        self._lib = lib
        for name in names:
            setattr(self, name, timed("C " + name, getattr(lib, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)


@asynccontextmanager
async def connected_pair() -> AsyncIterator[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]:
    """One IA with two connected EPs as ``aiodat.bench.latency.endpoint`` makes them (client, server),
    the server's first receive posted; disconnected at the end."""
    device, _ = device_and_address()
    with open_ia(device) as ia:
        pz = ia.create_pz()
        client, server = endpoint(ia, pz, 2, True), endpoint(ia, pz, 2, False)
        server[0].post_recv(server[3])
        await connect_pair(client[0], server[0])
        yield client, server
        await client[0].disconnect()


async def pingpong(iters: int) -> float:
    import aiodat.evd
    import aiodat.post

    # posting lives in post.py (ep.py was split, issue 14)
    # one-segment posts are the C hot paths (_shim/posts.c)
    aiodat.post._c_post_send = timed("C post_send (posts.c)", aiodat.post._c_post_send)  # type: ignore
    aiodat.post._c_post_recv = timed("C post_recv (posts.c)", aiodat.post._c_post_recv)  # type: ignore
    aiodat.evd.lib = TimedLib(aiodat.evd.lib, ["aiodat_cq_drain"])  # type: ignore
    EVD._on_readable = timed("EVD._on_readable (reader callback)", EVD._on_readable)  # type: ignore
    EVD._drain_cq = timed("EVD._drain_cq", EVD._drain_cq)  # type: ignore
    async with connected_pair() as ((client, c_evd, c_send, c_recv, _b1), (server, s_evd, s_send, s_recv, _b2)):
        TOTALS.clear()
        t0 = clock()
        await asyncio.gather(side(server, s_evd, s_send, s_recv, iters, False),
                             side(client, c_evd, c_send, c_recv, iters, True))
        elapsed = clock() - t0
    return elapsed / iters / 2000.0


async def loop_costs(n: int) -> Dict[str, float]:
    loop = asyncio.get_running_loop()
    out = {}
    t0 = clock()
    for _ in range(n):
        fut = loop.create_future()
        loop.call_soon(fut.set_result, None)
        await fut
    out["future round trip (create, call_soon set_result, await)"] = (clock() - t0) / n / 1000
    t0 = clock()
    for _ in range(n):
        await asyncio.sleep(0)
    out["asyncio.sleep(0)"] = (clock() - t0) / n / 1000
    from aiodat._lib import ffi, lib
    wcs = ffi.new("struct aiodat_wc[64]")
    nev = ffi.new("int[3]")  # (aiodat_cq_drain's status)
    device, _ = device_and_address()
    with open_ia(device) as ia:
        evd = ia.create_evd(64, __import__("aiodat").EvdFlags.DTO)
        cq = evd._cq
        t0 = clock()
        for _ in range(n):
            lib.aiodat_cq_drain(ffi.NULL, cq, -1, wcs, 64, nev)
        out["lib.aiodat_cq_drain, empty CQ, no channel, no arm (cffi call)"] = (clock() - t0) / n / 1000
        t0 = clock()
        for _ in range(n):
            evd._drain_cq(rearm=False)
        out["EVD._drain_cq(rearm=False), empty"] = (clock() - t0) / n / 1000
        t0 = clock()
        for _ in range(n):
            evd.dequeue()
        out["EVD.dequeue(), empty (pumps the IA)"] = (clock() - t0) / n / 1000
    t0 = clock()
    for _ in range(n):
        pass
    out["empty loop iteration"] = (clock() - t0) / n / 1000

    def f() -> None:
        pass
    t0 = clock()
    for _ in range(n):
        f()
    out["Python call of an empty function"] = (clock() - t0) / n / 1000
    return out


async def count_bytecodes(iters: int, mode: str = "await") -> Dict[str, int]:
    """Bytecodes executed per function during ``iters`` round trips of the ping-pong (``mode``:
    await or callback, as ``aiodat bench latency`` runs them)."""
    import sys

    from aiodat.bench.latency import ping, ping_callback, pong, pong_callback

    counts: Dict[str, int] = defaultdict(int)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        return tracer

    async with connected_pair() as ((client, c_evd, c_send, c_recv, _b1), (server, s_evd, s_send, s_recv, _b2)):
        for total, traced in ((20, False), (iters, True)):  # a warm-up round, then the counted one
            if traced:
                server.post_recv(s_recv)
            if mode == "callback":
                served = pong_callback(server, s_evd, s_send, s_recv, total)
            else:
                served = asyncio.ensure_future(pong(server, s_evd, s_send, s_recv, total))
            if traced:
                sys.settrace(tracer)
            try:
                if mode == "callback":
                    await ping_callback(client, c_evd, c_send, c_recv, total)
                else:
                    await ping(client, c_evd, c_send, c_recv, total)
                await served
            finally:
                sys.settrace(None)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", default="uvloop", choices=["asyncio", "uvloop"])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--bytecodes", action="store_true", help="count bytecodes per function instead of timing")
    ap.add_argument("--mode", default="await", choices=["await", "callback"], help="with --bytecodes: which path")
    args = ap.parse_args()
    if args.bytecodes:
        counts = run_on_loop(args.loop, lambda: count_bytecodes(args.iters, args.mode))
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            if n >= args.iters:
                print(f"  {n / args.iters:8.1f}  {name}")
        print(f"  {sum(counts.values()) / args.iters:8.1f}  in all, per round trip ({args.loop}, {args.mode})")
        return
    half = run_on_loop(args.loop, lambda: pingpong(args.iters))
    print(f"loop={args.loop} iters={args.iters}: mean half round trip {half:.1f} us (clocks included)")
    for name, (ns, count) in sorted(TOTALS.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:45s} {ns / max(count, 1) / 1000:9.1f} us x {count / args.iters:5.2f} per message")
    for name, us in run_on_loop(args.loop, lambda: loop_costs(2000)).items():
        print(f"  {name:60s} {us:8.2f} us")


if __name__ == "__main__":
    main()
