"""Where does the time of one small aiodat stream round trip go?  A developer's tool, run where rxe is::

    aiodat rxe run -- .venv/bin/python bench/streams_timeline.py [--loop uvloop] [--iters 300] [--size 64]

Everything runs in one process on one loop, as ``aiodat bench streams`` does
(its own echo server and its client code: ``write``, ``drain``,
``readexactly``).  Four parts, in one run:

* **floors**: the raw loop of ``bench/latency_floor.py`` (shim posts,
  ``add_reader`` and a Future, no aiodat code) and aiodat's EVD ping-pong
  (``await`` and ``callback``), as full round trips;
* **round trips**: the streams echo with nothing instrumented, and the same
  echo with both ends as plain ``asyncio.Protocol`` objects on
  ``aiodat.streams.create_connection`` (the server answers inside
  ``data_received``): the transport without StreamReader and task hops;
* **timeline**: the streams echo again with timestamps
  (``time.perf_counter_ns``, monkeypatched here, nothing in aiodat changes) at
  the client's ``write``, each side's post of a DATA/WINDOW/CREDIT/EOF send,
  its receive re-posts, its completion-channel wake-ups (and the batch they
  deliver), ``data_received``, the server's ``write`` and the moment the
  client's ``readexactly`` returns; the median of every step, and what each
  side posts and wakes for per round trip.

With ``PYTHONPATH`` pointing at another checkout the same script measures that code.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

clock = time.perf_counter_ns
EVENTS: List[Tuple[int, str, str]] = []  # (ns, side, what)
SIDES: Dict[int, str] = {}  # id(transport / core / evd / resources) -> "C" or "S"
COUNTS: Counter = Counter()
ON = [False]


def _side(obj: Any) -> str:
    return SIDES.get(id(obj), "?")


def _note(side: str, what: str) -> None:
    if ON[0]:
        EVENTS.append((clock(), side, what))
        COUNTS[side + ":" + what] += 1


class _TimedLib:
    """Stands in for the cffi ``lib`` of one aiodat module: adds up the time spent in the C calls that enter
    the kernel or the CQ (posts, CQ drain/poll), per round trip."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if not name.startswith(("aiodat_post", "aiodat_cq")) or not callable(fn):
            return fn
        key = "us in " + name

        def timed(*args: Any) -> Any:
            t = clock()
            try:
                return fn(*args)
            finally:
                if ON[0]:
                    COUNTS[key] += (clock() - t) / 1000
                    COUNTS["calls " + name] += 1
        return timed


def instrument() -> None:
    """Timestamps on the process's aiodat classes (before any EVD exists: FdWatch binds the function)."""
    import aiodat.evd as evd_mod
    import aiodat.post as post_mod

    for mod in (evd_mod, post_mod):
        mod.lib = _TimedLib(mod.lib)
    from aiodat.streams import protocol as proto_mod
    from aiodat.streams import transport as transport_mod

    T = transport_mod.RdmaTransport
    names = {proto_mod.MSG_DATA: "post DATA", proto_mod.MSG_WINDOW: "post WINDOW",
             proto_mod.MSG_CREDIT: "post CREDIT", proto_mod.MSG_EOF: "post EOF"}

    start = T._start

    def _start(self: Any) -> None:
        # the client's transport is made by create_connection, the server's by the server: the
        # test below tells them apart by who registered first (see register())
        PENDING.append(self)
        # the Receiver (C) calls the protocol's data_received, looked up per message
        protocol, data_received = self._protocol, self._protocol.data_received

        def noted(data: Any) -> None:
            _note(_side(self), "data_received")
            data_received(data)
        protocol.data_received = noted
        start(self)
    T._start = _start

    real_sender = transport_mod.Sender

    def sender(core: Any, arena: Any, base: int, size: int, post_send: Any, *rest: Any) -> Any:
        # the Sender (C) posts a small write's DATA message with the post_send it is given
        def noted(seg: Any, cookie: Any, flags: Any) -> Any:
            _note(_side(core), "post DATA")
            return post_send(seg, cookie, flags)
        return real_sender(core, arena, base, size, noted, *rest)
    transport_mod.Sender = sender

    def note_each_call(method: str, label: str) -> None:
        orig = getattr(T, method)

        def wrapped(self: Any, *args: Any) -> Any:
            _note(_side(self), label)
            return orig(self, *args)
        setattr(T, method, wrapped)

    # (flush: its Python path only; a small write's is the Sender's C, noted as its post above)
    for method, label in (("write", "write"), ("_flush", "flush")):
        note_each_call(method, label)

    # a batch is a call of the stream's EVD callback (the transport's Receiver, in C)
    set_callback = evd_mod.EVD.set_callback

    def _set_callback(self: Any, fn: Any, **kw: Any) -> None:
        if fn is None:
            return set_callback(self, fn, **kw)

        def noted(events: List[Any]) -> None:
            kinds = [c[0] if type(c) is tuple and c else None for c in (getattr(e, "cookie", None) for e in events)]
            recvs, sends = kinds.count("r"), kinds.count("s") + kinds.count("w")
            _note(_side(self), f"batch r{recvs} s{sends}")
            fn(events)
        return set_callback(self, noted, **kw)
    evd_mod.EVD.set_callback = _set_callback

    for name in ("pause_reading", "resume_reading", "pause_writing", "resume_writing"):
        if hasattr(T, name):
            note_each_call(name, name)

    Core = proto_mod.StreamCore
    sent = Core.sent

    def _sent(self: Any, send: Any) -> None:
        side = _side(self)
        _note(side, names.get(send.type, "post ?"))
        if send.signalled:
            _note(side, "signalled")
        if send.credits:
            COUNTS[side + ":credits returned"] += send.credits
        sent(self, send)
    Core.sent = _sent

    R = transport_mod.Resources
    post_recv = R.post_recv

    def _post_recv(self: Any, i: int) -> None:
        _note(_side(self), "post recv")
        post_recv(self, i)
    R.post_recv = _post_recv

    EVD = evd_mod.EVD
    on_readable = EVD._on_readable

    def _on_readable(self: Any) -> None:
        side = _side(self)
        _note(side, "wake")
        n = len(EVENTS)
        on_readable(self)
        if ON[0] and not any(e[2].startswith("batch") for e in EVENTS[n:]):
            _note(side, "wake empty")
    EVD._on_readable = _on_readable


PENDING: List[Any] = []


def register(client_transport: Any) -> None:
    """Name the sides: the client's transport is ``client_transport``, the other one the server's."""
    for t in PENDING:
        side = "C" if t is client_transport else "S"
        for obj in (t, t._core, t._res, t._res.evd):
            SIDES[id(obj)] = side
    PENDING.clear()


# -- the echo of aiodat bench streams, with the client's two stamps ---------------------------------

async def streams_echo(host: str, size: int, iters: int, timeline: bool) -> List[float]:
    """Round trips (us) of ``aiodat bench streams``' echo, server in this process; with ``timeline`` stamped."""
    import aiodat
    from aiodat.bench.streams_vs_tcp import _ECHO, _HEAD, start_stream_server

    PENDING.clear()
    server = await start_stream_server(aiodat, host)
    port = server.sockets[0].getsockname()[1]
    samples: List[float] = []
    async with server:
        reader, writer = await aiodat.open_connection(host, port)
        writer.write(_HEAD.pack(_ECHO, size))
        request = bytes(i & 0xFF for i in range(size))
        await asyncio.sleep(0.2)  # the server's handler is running: both transports exist
        register(writer.transport)
        warmup = max(10, iters // 10)
        for i in range(warmup + iters):
            if i == warmup and timeline:
                EVENTS.clear()
                COUNTS.clear()
                ON[0] = True
            t0 = clock()
            _note("C", "client write")
            writer.write(request)
            await writer.drain()
            reply = await reader.readexactly(size)
            _note("C", "read returns")
            if i >= warmup:
                samples.append((clock() - t0) / 1000)
            if reply != request:
                raise AssertionError("the echo came back different")
        ON[0] = False
        writer.close()
        await writer.wait_closed()
    return samples


class _Echo(asyncio.Protocol):
    """Both ends of the Protocol-level echo: the server answers in data_received, the client resolves a Future."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.transport: Any = None
        self.fut: Optional[asyncio.Future[None]] = None
        self.got = 0
        self.size = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: Any) -> None:
        if self.answer:
            self.transport.write(data)
            return
        self.got += len(data)
        if self.got >= self.size and self.fut is not None and not self.fut.done():
            self.fut.set_result(None)


async def protocol_echo(host: str, size: int, iters: int) -> List[float]:
    """Round trips (us) of an echo whose two ends are asyncio Protocols on aiodat.streams transports."""
    from aiodat import streams

    loop = asyncio.get_running_loop()
    server = await streams.create_server(lambda: _Echo(True), host, 0)
    port = server.sockets[0].getsockname()[1]
    samples: List[float] = []
    async with server:
        transport, client = await streams.create_connection(lambda: _Echo(False), host, port)
        client.size = size
        request = bytes(size)
        warmup = max(10, iters // 10)
        for i in range(warmup + iters):
            client.got = 0
            client.fut = loop.create_future()
            t0 = clock()
            transport.write(request)
            await client.fut
            if i >= warmup:
                samples.append((clock() - t0) / 1000)
        transport.close()
        await asyncio.sleep(0.1)
    return samples


# -- the timeline ----------------------------------------------------------------------------------

STEPS = [  # (from, to): each found as the first event of its kind after the previous step
    (("C", "client write"), ("C", "post DATA")),
    (("C", "post DATA"), ("S", "batch r1 s0")),  # (in one process the poller finds it: no wake-up)
    (("S", "batch r1 s0"), ("S", "data_received")),
    (("S", "data_received"), ("S", "write")),
    (("S", "write"), ("S", "post DATA")),
    (("S", "post DATA"), ("C", "batch r1 s0")),
    (("C", "batch r1 s0"), ("C", "data_received")),
    (("C", "data_received"), ("C", "read returns")),
]


def analyse(iters: int) -> None:
    """Cut EVENTS into round trips at each client write and print the median of each step."""
    starts = [i for i, e in enumerate(EVENTS) if e[1:] == ("C", "client write")]
    deltas: Dict[str, List[float]] = {}
    totals: List[float] = []
    missing = 0
    for k, first in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(EVENTS)
        rt = EVENTS[first:end]
        pos, stamps = 0, []
        for a, b in STEPS:
            while pos < len(rt) and rt[pos][1:] != b:
                pos += 1
            if pos == len(rt):
                break
            stamps.append(rt[pos][0])
        if len(stamps) != len(STEPS):
            missing += 1
            continue
        prev = rt[0][0]
        for (a, b), t in zip(STEPS, stamps):
            deltas.setdefault(f"{a[0]} {a[1]:>14s} -> {b[0]} {b[1]}", []).append((t - prev) / 1000)
            prev = t
        totals.append((stamps[-1] - rt[0][0]) / 1000)
    n = len(starts)
    print(f"  timeline over {n} round trips ({missing} did not follow the expected order)")
    for name, values in deltas.items():
        print(f"    {name:46s} median {statistics.median(values):8.1f} us  p90 {_p(values, 90):8.1f}")
    if totals:
        print(f"    {'whole round trip (instrumented)':46s} median {statistics.median(totals):8.1f} us")
    print("  per round trip:")
    for key in sorted(COUNTS):
        print(f"    {key:30s} {COUNTS[key] / max(n, 1):6.3f}")


def _p(values: List[float], q: int) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, len(s) * q // 100)]


async def floors(device: str, address: str, iters: int, loop_name: str) -> Dict[str, float]:
    """Full round trips (us, p50) of the raw loop and aiodat's EVD ping-pong, one process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import latency_floor
    from aiodat.bench import latency_pingpong

    out = {"raw loop": 2 * await latency_floor.run_raw(device, address, iters + iters // 10, 1, False, loop_name)}
    for mode in ("await", "callback"):
        sample = await latency_pingpong(device, address, 64, iters, loop_name=loop_name, mode=mode)
        out[f"aiodat EVD {mode}"] = 2 * sample.p50
    return out


async def throughput_counted(host: str, write_size: int, total: int) -> Tuple[float, Dict[str, int]]:
    """``aiodat bench streams``' throughput (sink server in this process), instrumented: MB/s and the client's stats."""
    import aiodat
    from aiodat.bench.streams_vs_tcp import _HEAD, _SINK, start_stream_server

    PENDING.clear()
    server = await start_stream_server(aiodat, host)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await aiodat.open_connection(host, port)
        register(writer.transport)
        block = bytes(write_size)
        count = total // write_size
        EVENTS.clear()
        COUNTS.clear()
        ON[0] = True
        start = time.perf_counter()
        writer.write(_HEAD.pack(_SINK, count * write_size))
        for _ in range(count):
            writer.write(block)
            await writer.drain()
        await reader.readexactly(8)
        elapsed = time.perf_counter() - start
        ON[0] = False
        stats = dict(writer.transport.stats)
        writer.close()
        await writer.wait_closed()
    return count * write_size / elapsed / 1e6, stats


FUNCS: Counter = Counter()


def _func_tracer(frame: Any, event: str, arg: Any) -> Any:
    """sys.settrace's function for ``--functions``: bytecodes per function of aiodat's and asyncio's code."""
    path = frame.f_code.co_filename
    if "/aiodat/" not in path and "/asyncio/" not in path:
        return None
    frame.f_trace_opcodes = True
    key = f"{path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            FUNCS[key] += 1
        return local
    return local


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", default="uvloop", choices=("asyncio", "uvloop"))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-floors", action="store_true")
    ap.add_argument("--functions", action="store_true", help="only: bytecodes per function per round trip")
    ap.add_argument("--throughput", action="store_true", help="only: the 64 KiB-write throughput, what it posts")
    args = ap.parse_args()
    from aiodat.bench import device_and_address, run_on_loop

    device, address = device_and_address()
    if args.functions:
        sys.settrace(_func_tracer)
        import threading
        threading.settrace(_func_tracer)
        run_on_loop(args.loop, lambda: streams_echo(address, args.size, args.iters, False))
        sys.settrace(None)
        total = args.iters + max(10, args.iters // 10)
        for key, n in FUNCS.most_common(45):
            print(f"  {key:60s} {n / total:8.1f}")
        return
    instrument()
    if args.throughput:
        total = 8 << 20
        mb_s, stats = run_on_loop(args.loop, lambda: throughput_counted(address, 65536, total))
        print(f"throughput {mb_s:.1f} MB/s ({args.loop}, 8 MiB in 64 KiB writes + drain), client stats {stats}")
        mib = total / (1 << 20)
        for key in sorted(COUNTS):
            print(f"    {key:30s} {COUNTS[key] / mib:10.2f} per MiB")
        return
    for rnd in range(1, args.rounds + 1):
        print(f"round {rnd} ({args.loop}, {args.size}-byte echo, {args.iters} round trips, one process)", flush=True)
        if not args.no_floors:
            for name, us in run_on_loop(args.loop, lambda: floors(device, address, args.iters, args.loop)).items():
                print(f"  {name:34s} round trip p50 {us:8.1f} us", flush=True)
        rtts = run_on_loop(args.loop, lambda: protocol_echo(address, args.size, args.iters))
        print(f"  {'streams, Protocol echo':34s} round trip p50 {statistics.median(rtts):8.1f} us", flush=True)
        rtts = run_on_loop(args.loop, lambda: streams_echo(address, args.size, args.iters, False))
        print(f"  {'streams, bench echo':34s} round trip p50 {statistics.median(rtts):8.1f} us", flush=True)
        gc.disable()
        try:
            rtts = run_on_loop(args.loop, lambda: streams_echo(address, args.size, args.iters, False))
        finally:
            gc.enable()
        print(f"  {'streams, bench echo, gc disabled':34s} round trip p50 {statistics.median(rtts):8.1f} us", flush=True)
        rtts = run_on_loop(args.loop, lambda: streams_echo(address, args.size, args.iters, True))
        print(f"  {'streams, bench echo, stamped':34s} round trip p50 {statistics.median(rtts):8.1f} us", flush=True)
        analyse(args.iters)


if __name__ == "__main__":
    main()
