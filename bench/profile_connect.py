"""Where does a connection's set-up time go?  A developer's tool, run in the rxe guest:

    aiodat rxe run -- .venv/bin/python bench/profile_connect.py [--loop uvloop] [-n 100] [--cprofile]

It runs ``aiodat bench connect``'s cycle (N connections at once through one
PSP, then disconnect and free) and reports:

* wall time and this process's CPU time (user + system) per connection, for
  the connect phase and the whole cycle: CPU close to wall means the loop
  thread is the bottleneck, much less means it waits on the kernel;
* the loop's idle time (asyncio only: the selector's wait);
* every rdma_cm/verbs C call cm.py and ep.py make, timed (count, mean us);
* a per-connection timeline: each rdma_cm event's arrival relative to the
  start, and the spread of each step over the N connections (do they overlap?);
* with ``--cprofile``: the top functions by own time (asyncio loop).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any, Dict, List

from aiodat import cm, ep as ep_mod
from aiodat.bench import device_and_address, run_on_loop
from aiodat.bench.connect import connect_cycle

from profile_latency import TOTALS, clock, timed  # (the script's folder is on sys.path)

MARKS: Dict[str, List[float]] = defaultdict(list)


class TimedLib:
    """A module's cffi ``lib`` with every rdma_/ibv_/aiodat_ call timed."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if callable(value) and name.startswith(("rdma_", "ibv_", "aiodat_")):
            value = timed("C " + name, value)
        setattr(self, name, value)
        return value


def instrument() -> None:
    for mod in (cm, ep_mod):
        mod.lib = TimedLib(mod.lib)  # type: ignore[attr-defined]
    names = {v: k for k, v in vars(cm).items() if isinstance(v, int) and k.isupper() and k.endswith(
        ("RESOLVED", "RESPONSE", "ESTABLISHED", "DISCONNECTED", "EXIT", "REQUEST", "ERROR", "REJECTED"))}
    start = [0.0]
    orig_ep_event = cm._ep_event

    def ep_event(ep: Any, kind: int, status: int, pdata: bytes) -> None:
        MARKS["ev " + names.get(kind, str(kind))].append(time.perf_counter())
        t0 = clock()
        orig_ep_event(ep, kind, status, pdata)
        cell = TOTALS["py _ep_event " + names.get(kind, str(kind))]
        cell[0] += clock() - t0
        cell[1] += 1

    cm._ep_event = ep_event  # type: ignore[assignment]
    orig_request = cm.PSP._on_request

    def on_request(self: Any, *args: Any) -> None:
        MARKS["ev CONNECT_REQUEST"].append(time.perf_counter())
        t0 = clock()
        orig_request(self, *args)
        cell = TOTALS["py PSP._on_request"]
        cell[0] += clock() - t0
        cell[1] += 1

    cm.PSP._on_request = on_request  # type: ignore[method-assign]
    cm.CMChannel.dispatch = timed("py CMChannel.dispatch (all)", cm.CMChannel.dispatch)  # type: ignore
    cm.CMChannel.drain = timed("py CMChannel.drain (per wake-up)", cm.CMChannel.drain)  # type: ignore
    cm.start_connect = timed("py start_connect", cm.start_connect)  # type: ignore
    cm.CR._accept = timed("py CR._accept", cm.CR._accept)  # type: ignore
    ep_mod.EP.__init__ = timed("py EP.__init__ (create_ep)", ep_mod.EP.__init__)  # type: ignore
    ep_mod.EP.free = timed("py EP.free", ep_mod.EP.free)  # type: ignore
    orig_notify = cm._notify

    def notify(ep: Any, etype: Any, *args: Any, **kwargs: Any) -> None:
        MARKS["deliver " + etype.name].append(time.perf_counter())
        orig_notify(ep, etype, *args, **kwargs)

    cm._notify = notify  # type: ignore[assignment]


async def cycle_with_idle(device: str, n: int, loop_name: str) -> Dict[str, float]:
    loop = asyncio.get_running_loop()
    idle = [0.0]
    sel = getattr(loop, "_selector", None)
    if sel is not None:  # asyncio: time the selector's wait
        orig = sel.select

        def select(timeout: Any = None) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(timeout)
            finally:
                idle[0] += time.perf_counter() - t0
        sel.select = select
    c0, w0 = time.process_time(), time.perf_counter()
    MARKS["start"].append(w0)
    conn_s, cycle_s = await connect_cycle(device, n)
    return {"connect_s": conn_s, "cycle_s": cycle_s, "cpu_s": time.process_time() - c0,
            "wall_s": time.perf_counter() - w0, "idle_s": idle[0] if sel is not None else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", default="uvloop", choices=("asyncio", "uvloop"))
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--no-instrument", action="store_true")
    args = parser.parse_args()
    device, _address = device_and_address()
    n = args.n
    for r in range(args.rounds):  # plain rounds first (the first one warms up)
        res = run_on_loop(args.loop, lambda: cycle_with_idle(device, n, args.loop))
        print(f"plain {args.loop} round {r + 1}: connect {res['connect_s'] * 1e6 / n:.0f} us/conn, cycle "
              f"{res['cycle_s'] * 1e6 / n:.0f} us/conn, cpu {res['cpu_s'] * 1e6 / n:.0f} us/conn of wall "
              f"{res['wall_s'] * 1e6 / n:.0f}, loop idle {res['idle_s'] * 1e6 / n:.0f} us/conn", flush=True)
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        run_on_loop("asyncio", lambda: connect_cycle(device, n))
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        print(out.getvalue())

    if not args.no_instrument:
        instrument()
        MARKS.clear()
        res = run_on_loop(args.loop, lambda: cycle_with_idle(device, n, args.loop))
        print(f"instrumented: connect {res['connect_s'] * 1e6 / n:.0f} us/conn, cycle "
              f"{res['cycle_s'] * 1e6 / n:.0f} us/conn, cpu {res['cpu_s'] * 1e6 / n:.0f}, idle "
              f"{res['idle_s'] * 1e6 / n:.0f}")
        print("calls (total ms over the run, count, mean us):")
        for name, (ns, count) in sorted(TOTALS.items(), key=lambda kv: -kv[1][0]):
            print(f"  {name:45s} {ns / 1e6:9.1f} ms {count:6d} {ns / 1e3 / max(count, 1):9.1f} us")
        t0 = MARKS["start"][0]
        print("timeline (ms from start: first, median, last) per mark:")
        for name, stamps in sorted(MARKS.items(), key=lambda kv: min(kv[1])):
            rel = sorted((s - t0) * 1e3 for s in stamps)
            print(f"  {name:40s} n={len(rel):4d} {rel[0]:9.1f} {statistics.median(rel):9.1f} {rel[-1]:9.1f}")

if __name__ == "__main__":
    main()
