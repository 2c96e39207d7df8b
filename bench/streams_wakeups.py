"""What does one small request/response cost an aiodat stream, in wake-ups, loop iterations and calls?

A developer's tool, run where rxe is::

    aiodat rxe run -- .venv/bin/python bench/streams_wakeups.py [--loop uvloop] [--messages 200] [--rounds 3]
    aiodat rxe run -- .venv/bin/python bench/streams_wakeups.py --http [--loop uvloop]   # aiohttp GETs too

A server runs in a child process (an echo of ``--size``-byte messages on
``aiodat.start_server`` / ``asyncio.start_server``; with ``--http`` also
aiohttp's app of ``examples/aiohttp_rdma.py``), and the client sends
``--messages`` sequential requests on one connection, each waiting for its
reply, over aiodat (the device's address) and over TCP loopback (127.0.0.1).

Two parts, in one run:

* **time**: rounds alternating RDMA and TCP, nothing instrumented; round trips
  per second, the median of ``--rounds``;
* **counts**: client and server instrumented (monkeypatched here, nothing in
  aiodat changes), one more run per transport, every count divided by the
  round trips, for each side.  ``wakeups``: the loop called the completion
  channel's reader (``EVD._on_readable``); ``empty``: of these, the ones that
  found no completion; ``fd_events``: file descriptors the selector reported
  ready (asyncio only: TCP's one socket-readable per direction is the mark);
  ``iterations``: ``_run_once`` calls, ``handles``: callbacks the loop ran
  (asyncio only); ``cq_calls``: C calls that poll the CQ (drain/poll/spin);
  ``post_send``/``post_recv``/``post_write``: requests posted; ``send_cqes``:
  send completions the transport saw (each a signalled send); ``recv_msgs``:
  messages received; ``credit_msgs``: standalone CREDIT messages sent;
* **bytecodes** (``--bytecodes``): the Python bytecodes each side executes per
  round trip (``sys.settrace`` opcode events, frames the loop starts), a
  measure of the Python on the path that the host's load cannot blur.

With ``PYTHONPATH`` pointing at another checkout the same script measures that
code (before/after comparisons in one guest boot).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

COUNTS: Counter = Counter()
TRACE = False  # the --bytecodes pass: count bytecodes instead of calls
CQ_CALLS = ("aiodat_cq_drain", "aiodat_cq_poll", "aiodat_cq_spin")
POST_CALLS = {"aiodat_post_send": "post_send", "aiodat_post_recv": "post_recv", "aiodat_post_recv1": "post_recv",
              "aiodat_post_send1": "post_send"}


# -- instrumentation (monkeypatching; only the counting run installs it) ---------------------------

class _CountingLib:
    """Stands in for the cffi ``lib`` of one aiodat module: counts the CQ polls and posts it makes."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        key = "cq_calls" if name in CQ_CALLS else POST_CALLS.get(name)
        if key is None or not callable(fn):
            return fn

        def counted(*args: Any) -> Any:
            COUNTS[key] += 1
            if key == "post_send" and name == "aiodat_post_send":
                COUNTS["post_send"] += args[2] - 1  # a batch of n
            return fn(*args)
        return counted


def instrument() -> None:
    """Count what a stream does, on the process's aiodat classes (and asyncio's loop, per loop later)."""
    import aiodat.evd as evd_mod
    import aiodat.post as post_mod
    from aiodat.streams import protocol as proto_mod
    from aiodat.streams import transport as transport_mod

    for mod in (evd_mod, post_mod, transport_mod, proto_mod):
        if hasattr(mod, "lib") and not isinstance(mod.lib, _CountingLib):
            mod.lib = _CountingLib(mod.lib)
    # one-segment posts go through the C hot paths (_shim/posts.c), not the cffi lib
    for name, key in (("_c_post_recv", "post_recv"), ("_c_post_send", "post_send")):
        hot = getattr(post_mod, name)
        if getattr(hot, "counted", False):
            continue

        def counted(*args: Any, _hot: Any = hot, _key: str = key) -> Any:
            err = _hot(*args)
            if err == 0:
                COUNTS[_key] += 1
            return err
        counted.counted = True  # type: ignore[attr-defined]
        setattr(post_mod, name, counted)
    EVD = evd_mod.EVD
    on_readable = EVD._on_readable

    def _on_readable(self: Any) -> None:
        if self._callback is not None:
            COUNTS["wakeups"] += 1
            before = COUNTS["deliveries"]
            on_readable(self)
            if COUNTS["deliveries"] == before:
                COUNTS["empty"] += 1
            return
        on_readable(self)
    EVD._on_readable = _on_readable

    post_write = post_mod.Posting.post_rdma_write

    def _post_rdma_write(self: Any, *args: Any, **kw: Any) -> Any:
        COUNTS["post_write"] += 1
        return post_write(self, *args, **kw)
    post_mod.Posting.post_rdma_write = _post_rdma_write

    # a delivery is a call of the stream's EVD callback (the transport's Receiver, in C)
    set_callback = EVD.set_callback

    def _set_callback(self: Any, fn: Any, **kw: Any) -> None:
        if fn is None:
            return set_callback(self, fn, **kw)

        def counted(events: List[Any]) -> None:
            COUNTS["deliveries"] += 1
            fn(events)
        return set_callback(self, counted, **kw)
    EVD.set_callback = _set_callback

    Core = proto_mod.StreamCore
    on_send_complete, on_received, sent = Core.on_send_complete, Core.on_received, Core.sent

    def _on_send_complete(self: Any, cookie: Any) -> None:
        COUNTS["send_cqes"] += 1
        return on_send_complete(self, cookie)

    def _on_received(self: Any, *args: Any) -> Any:
        COUNTS["recv_msgs"] += 1
        return on_received(self, *args)

    def _sent(self: Any, send: Any) -> None:
        if send.type == proto_mod.MSG_CREDIT:
            COUNTS["credit_msgs"] += 1
        return sent(self, send)
    Core.on_send_complete, Core.on_received, Core.sent = _on_send_complete, _on_received, _sent

    handle_run = asyncio.events.Handle._run

    def _run(self: Any) -> None:
        COUNTS["handles"] += 1
        return handle_run(self)
    asyncio.events.Handle._run = _run  # asyncio's loop only (uvloop has its own handles)


def _opcode_tracer(frame: Any, event: str, arg: Any) -> Any:
    """sys.settrace's function for ``--bytecodes``: count every bytecode executed (new frames only)."""
    frame.f_trace_opcodes = True

    code = frame.f_code
    where = "bc:" + _area(code.co_filename)
    name = getattr(code, "co_qualname", code.co_name)  # (3.11: the class too)
    function = f"fn:{os.path.basename(code.co_filename)}:{name}"

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            COUNTS["bytecodes"] += 1
            COUNTS[where] += 1
            COUNTS[function] += 1
        return local
    return local


def _area(filename: str) -> str:
    """Which part of the stack a frame's code belongs to (for the bytecode split)."""
    path = filename.replace(os.sep, "/")
    for marker, name in (("/aiodat/streams/", "streams"), ("/aiodat/evd.py", "evd"), ("/aiodat/post.py", "post"),
                         ("/aiodat/", "aiodat-other"), ("/asyncio/", "asyncio"), ("/aiohttp/", "aiohttp"),
                         ("/uvloop/", "uvloop")):
        if marker in path:
            return name
    return "other"


def instrument_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Count the iterations and ready file descriptors of an asyncio loop (uvloop: not available)."""
    run_once = getattr(loop, "_run_once", None)
    selector = getattr(loop, "_selector", None)
    if run_once is None or selector is None:
        return

    def _run_once() -> None:
        COUNTS["iterations"] += 1
        run_once()
    loop._run_once = _run_once  # type: ignore[attr-defined]
    select = selector.select

    def _select(timeout: Optional[float] = None) -> Any:
        ready = select(timeout)
        COUNTS["fd_events"] += len(ready)
        return ready
    selector.select = _select  # type: ignore[method-assign]


# -- the two sides ---------------------------------------------------------------------------------

def streams_api(transport: str) -> Any:
    if transport == "rdma":
        import aiodat

        return aiodat
    return asyncio


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo every message of ``size`` bytes (the first byte says the size: a 2-byte length prefix)."""
    try:
        while True:
            head = await reader.readexactly(2)
            body = await reader.readexactly(int.from_bytes(head, "big"))
            writer.write(head + body)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


def load_aiohttp_example() -> Any:
    path = Path(__file__).resolve().parent.parent / "examples" / "aiohttp_rdma.py"
    spec = importlib.util.spec_from_file_location("aiohttp_rdma_example", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


async def serve(kind: str, transport: str, host: str, count: bool) -> None:
    """The child: serve, print ``PORT n``, then obey stdin (``reset``, ``report``, EOF ends)."""
    loop = asyncio.get_running_loop()
    if count:
        instrument_loop(loop)
    if kind == "echo":
        server = await streams_api(transport).start_server(echo, host, 0)
        port = server.sockets[0].getsockname()[1]
        closer = server
    else:
        import tempfile
        from aiohttp import web

        example = load_aiohttp_example()
        tmp = tempfile.mkdtemp()
        app = example.make_app(Path(tmp))
        app["transport"] = transport
        runner = web.AppRunner(app)
        await runner.setup()
        if transport == "rdma":
            from aiodat.integrations.aiohttp import RdmaSite

            site: Any = RdmaSite(runner, host, 0)
        else:
            site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
        closer = None
    print(f"PORT {port}", flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        if line.strip() in ("reset", "trace"):
            COUNTS.clear()
            if line.strip() == "trace":
                sys.settrace(_opcode_tracer)
            print("OK", flush=True)
        elif line.strip() == "report":
            sys.settrace(None)
            print("COUNTS " + json.dumps(dict(COUNTS)), flush=True)
    if closer is not None:
        closer.close()
    else:
        await runner.cleanup()


class Child:
    """A server child process and its stdin/stdout conversation."""

    def __init__(self, kind: str, transport: str, host: str, loop_name: str, count: bool) -> None:
        cmd = [sys.executable, __file__, "--child", kind, "--transport", transport, "--host", host,
               "--loop", loop_name] + (["--count"] if count else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._line()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the {kind}/{transport} server did not start: {line!r}")
        self.port = int(line.split()[1])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, what: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(120)


def begin_measuring(child: Optional[Child]) -> float:
    """After the warm-up: zero both sides' counts (and start tracing bytecodes if asked); the start time."""
    if child is not None:
        child.ask("trace" if TRACE else "reset")
    COUNTS.clear()
    if TRACE:
        sys.settrace(_opcode_tracer)
    return time.perf_counter()


async def echo_client(transport: str, host: str, port: int, messages: int, size: int, count: bool,
                      child: Optional[Child]) -> Tuple[float, Dict[str, int]]:
    """Round trips per second of ``messages`` sequential echoes, and the client's counts."""
    if count:
        instrument_loop(asyncio.get_running_loop())
    reader, writer = await streams_api(transport).open_connection(host, port)
    payload = (size - 2).to_bytes(2, "big") + b"x" * (size - 2)
    for _ in range(20):  # warm up
        writer.write(payload)
        await reader.readexactly(size)
    start = begin_measuring(child)
    for _ in range(messages):
        writer.write(payload)
        await reader.readexactly(size)
    elapsed = time.perf_counter() - start
    sys.settrace(None)
    counts = dict(COUNTS)
    writer.close()
    await writer.wait_closed()
    return messages / elapsed, counts


async def http_client(transport: str, host: str, port: int, messages: int, count: bool,
                      child: Optional[Child]) -> Tuple[float, Dict[str, int]]:
    """Requests per second of ``messages`` sequential aiohttp GETs of /hello, and the client's counts."""
    import aiohttp

    if count:
        instrument_loop(asyncio.get_running_loop())
    if transport == "rdma":
        from aiodat.integrations.aiohttp import RdmaConnector

        connector: Any = RdmaConnector()
    else:
        connector = aiohttp.TCPConnector()
    url = f"http://{host}:{port}/hello"
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):
            async with session.get(url) as resp:
                await resp.read()
        start = begin_measuring(child)
        for _ in range(messages):
            async with session.get(url) as resp:
                await resp.read()
        elapsed = time.perf_counter() - start
        sys.settrace(None)
        counts = dict(COUNTS)
    return messages / elapsed, counts


def run(coro: Any, loop_name: str) -> Any:
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


KEYS = ("wakeups", "empty", "fd_events", "iterations", "handles", "cq_calls", "post_send", "post_recv",
        "post_write", "send_cqes", "recv_msgs", "credit_msgs")


def per_rt(counts: Dict[str, int], n: int, loop_name: str) -> str:
    out = []
    for key in KEYS:
        if key in ("fd_events", "iterations", "handles") and loop_name == "uvloop":
            out.append(f"{key}=n/a")
            continue
        out.append(f"{key}={counts.get(key, 0) / n:.2f}")
    return " ".join(out)


def measure(kind: str, host: str, args: argparse.Namespace) -> None:
    where = {"rdma": host, "tcp": "127.0.0.1"}
    label = "echo %d B" % args.size if kind == "echo" else "aiohttp GET /hello"
    n = args.messages

    def client(transport: str, child: Child, count: bool) -> Tuple[float, Dict[str, int]]:
        if kind == "echo":
            coro = echo_client(transport, where[transport], child.port, n, args.size, count, child if count or TRACE else None)
        else:
            coro = http_client(transport, where[transport], child.port, n, count, child if count or TRACE else None)
        return run(coro, args.loop)  # type: ignore[no-any-return]

    def run_counted(transport: str, counting: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """One counted run against a fresh server child: (the client's counts, the server's)."""
        child = Child(kind, transport, where[transport], args.loop, counting)
        try:
            _, counts = client(transport, child, counting)
            line = child.ask("report")
            server = json.loads(line.split(" ", 1)[1]) if line.startswith("COUNTS ") else {}
        finally:
            child.close()
        return counts, server

    if args.rounds:
        rates: Dict[str, List[float]] = {"rdma": [], "tcp": []}
        children = {t: Child(kind, t, where[t], args.loop, False) for t in ("rdma", "tcp")}
        try:
            for _ in range(args.rounds):
                for transport in ("rdma", "tcp"):
                    rate, _ = client(transport, children[transport], False)
                    rates[transport].append(rate)
        finally:
            for child in children.values():
                child.close()
        rdma, tcp = statistics.median(rates["rdma"]), statistics.median(rates["tcp"])
        print(f"[time] {label}, loop {args.loop}, {n} sequential round trips x {args.rounds} rounds: "
              f"RDMA {rdma:.1f}/s {[round(r, 1) for r in rates['rdma']]}, "
              f"TCP {tcp:.1f}/s {[round(r, 1) for r in rates['tcp']]}, RDMA/TCP {rdma / tcp:.2f}x", flush=True)
    if args.bytecodes:  # before instrument(): its wrappers would be counted too
        global TRACE
        TRACE = True
        for transport in ("rdma", "tcp"):
            counts, server = run_counted(transport, False)
            split = {side: ", ".join(f"{k[3:]} {v / n:.0f}" for k, v in sorted(c.items()) if k.startswith("bc:"))
                     for side, c in (("client", counts), ("server", server))}
            print(f"[bytecodes] {label}, {transport}, loop {args.loop}, per round trip: "
                  f"client {counts.get('bytecodes', 0) / n:.0f} ({split['client']}), "
                  f"server {server.get('bytecodes', 0) / n:.0f} ({split['server']})", flush=True)
            for side, c in (("client", counts), ("server", server)):
                top = sorted(((v, k[3:]) for k, v in c.items() if k.startswith("fn:")), reverse=True)[:args.functions]
                if top:
                    print(f"  {side}'s top functions: " + ", ".join(f"{k} {v / n:.0f}" for v, k in top), flush=True)
        TRACE = False
    if args.counts:
        instrument()
        for transport in ("rdma", "tcp"):
            counts, server = run_counted(transport, True)
            print(f"[counts] {label}, {transport}, loop {args.loop}, per round trip:\n"
                  f"  client: {per_rt(counts, n, args.loop)}\n  server: {per_rt(server, n, args.loop)}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--messages", type=int, default=200, help="round trips per round")
    parser.add_argument("--size", type=int, default=100, help="bytes per echo message")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per transport (0: none)")
    parser.add_argument("--no-counts", dest="counts", action="store_false", help="skip the instrumented run")
    parser.add_argument("--bytecodes", action="store_true",
                        help="also count the bytecodes each side executes per round trip (sys.settrace)")
    parser.add_argument("--functions", type=int, default=0, metavar="N",
                        help="with --bytecodes: also the N functions with the most bytecodes, per side")
    parser.add_argument("--http", action="store_true", help="also aiohttp GETs")
    parser.add_argument("--only-http", action="store_true", help="aiohttp GETs only")
    parser.add_argument("--host", default=None, help="the RDMA address (default: $AIODAT_RXE_ADDR)")
    parser.add_argument("--child", choices=("echo", "http"), help=argparse.SUPPRESS)
    parser.add_argument("--transport", choices=("rdma", "tcp"), help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    host = args.host or os.environ.get("AIODAT_RXE_ADDR")
    if args.child:
        if args.count:
            instrument()
        run(serve(args.child, args.transport, host, args.count), args.loop)
        return 0
    if not host:
        parser.error("no RDMA address: pass --host or run under `aiodat rxe run`")
    if args.size < 3 or args.size > 65537:
        parser.error("--size must be between 3 and 65537")
    if not args.only_http:
        measure("echo", host, args)
    if args.http or args.only_http:
        measure("http", host, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
