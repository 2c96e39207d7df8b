"""Benchmarks: aiodat measured beside perftest on the same device, in the same run.

One function per benchmark (``bench_latency`` now; ``bench_bandwidth``,
``bench_rate`` and ``bench_streams`` follow the same shape), each returning a
report object with a ``format()`` method, plus the shared helpers they use:

* :func:`device_and_address` picks the device and its IPv4 address
  (``$AIODAT_RXE_DEVICE`` / ``$AIODAT_RXE_ADDR``, else the first active port);
* :func:`run_perftest_pair` runs one perftest tool as server and client on
  the same address over rdma_cm (``-R``) and returns the parsed result table
  (:func:`parse_perftest`);
* :func:`run_on_loop` runs a coroutine on a fresh asyncio or uvloop loop;
* :func:`percentile`.

What is compared with what (see docs/performance.md): perftest's ``_lat``
tools print *half* the round trip, so aiodat's latency figures are half the
measured round trip too.  ``ib_send_lat -R -e`` sleeps on CQ events (the
analogue of awaiting ``evd.wait()``), ``ib_send_lat -R`` busy-polls.
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")

#: event loops the benchmarks can run on
LOOPS = ("asyncio", "uvloop")


# --------------------------------------------------------------------------
# shared helpers


def device_and_address(device: Optional[str] = None, address: Optional[str] = None) -> Tuple[str, str]:
    """The IA name and IPv4 address to benchmark on.

    Defaults: ``$AIODAT_RXE_DEVICE`` / ``$AIODAT_RXE_ADDR`` (set by ``aiodat rxe
    run``), else the first active port with an IPv4 GID.  Raises
    :class:`aiodat.ProviderNotFound` when there is none.
    """
    from aiodat.errors import ProviderNotFound
    from aiodat.testing.plugin import find_device

    if device and address:
        return device, address
    found = find_device()
    if device and not address:
        from aiodat import open_ia

        with open_ia(device) as ia:
            address = ia.address
        if not address:
            raise ProviderNotFound(f"{device} has no IPv4 address (GID) for rdma_cm")
        return device, address
    if found is None:
        raise ProviderNotFound(
            "no RDMA device with an IPv4 address here; run the benchmark where rxe is up: "
            "`aiodat rxe run -- aiodat bench ...`"
        )
    return found.name, address or found.address


def run_on_loop(loop_name: str, factory: Callable[[], Awaitable[T]]) -> T:
    """Run ``factory()`` to completion on a new ``asyncio`` or ``uvloop`` event loop, then close it."""
    if loop_name == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    elif loop_name == "asyncio":
        loop = asyncio.new_event_loop()
    else:
        raise ValueError(f"loop must be one of {LOOPS}, not {loop_name!r}")
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(factory())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, nearest-rank."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


@dataclass
class PerftestResult:
    """One perftest run: the command lines, exit status, output and parsed result rows."""

    tool: str
    args: Tuple[str, ...]
    returncode: Optional[int]
    output: str
    rows: List[Dict[str, float]] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the client ran to the end and printed a result row."""
        return not self.error and bool(self.rows)

    def value(self, column: str) -> Optional[float]:
        """The figure in ``column`` of the last result row (e.g. "t_typical[usec]"), or None."""
        return self.rows[-1].get(column) if self.rows else None


def parse_perftest(output: str) -> List[Dict[str, float]]:
    """The result rows perftest printed: one dict per row, keyed by its header's column names.

    Column names are perftest's, with ``99% percentile[usec]`` written
    ``99%_percentile[usec]`` (e.g. ``t_typical[usec]``, ``BW average[MB/sec]``
    becomes ``BW_average[MB/sec]``).
    """
    rows: List[Dict[str, float]] = []
    header: Optional[List[str]] = None
    for line in output.splitlines():
        text = line.strip()
        if text.startswith("#bytes"):
            text = re.sub(r"(\S) (percentile|average|peak)\b", r"\1_\2", text)
            text = re.sub(r"\bBW (peak|average)", r"BW_\1", text)
            text = re.sub(r"\bMsgRate\[Mpps\]", "MsgRate[Mpps]", text)
            header = text.split()
            continue
        if header is None:
            continue
        parts = text.split()
        if not parts or not re.fullmatch(r"\d+", parts[0]):
            if text.startswith("-"):
                header = header  # a separator line: the table may go on
            continue
        try:
            values = [float(p) for p in parts]
        except ValueError:
            continue
        rows.append(dict(zip(header, values)))
    return rows


def _perftest_port() -> int:
    return random.randint(20000, 29999)


def run_perftest_pair(tool: str, args: Sequence[str], *, device: str, address: str,
                      timeout: float = 300.0, start_delay: float = 1.0) -> PerftestResult:
    """Run perftest ``tool`` as a server and a client on ``address`` over rdma_cm (``-R``).

    Both processes get ``-d device -R -F -p PORT`` plus ``args``; the client
    connects to ``address`` and is retried while the server is not yet
    listening.  Returns the client's parsed output (the server's when the
    client printed no table).  Never raises for a failed tool: the result's
    ``error`` says what went wrong (tool missing, timeout, exit status).
    """
    path = shutil.which(tool)
    if path is None:
        return PerftestResult(tool, tuple(args), None, "",
                              error=f"{tool} not found (install the Debian package perftest)")
    port = str(_perftest_port())
    common = [path, "-d", device, "-R", "-F", "-p", port, *args]
    deadline = time.monotonic() + timeout
    server = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True)
    client_out = ""
    client_rc: Optional[int] = None
    error = ""
    try:
        time.sleep(start_delay)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"{tool} did not finish within {timeout:g} s"
                break
            try:
                client = subprocess.run([*common, address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, timeout=left)
            except subprocess.TimeoutExpired as exc:
                client_out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                    else (exc.stdout or "")
                error = f"{tool} client did not finish within {timeout:g} s"
                break
            client_out, client_rc = client.stdout, client.returncode
            if client_rc == 0 or server.poll() is not None:
                break
            time.sleep(start_delay)  # the server may not be listening yet
    finally:
        try:
            server_out, _ = server.communicate(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.kill()
            server_out, _ = server.communicate()
    output = client_out
    rows = parse_perftest(client_out) or parse_perftest(server_out or "")
    if not error and client_rc != 0:
        error = f"{tool} client exited with status {client_rc}"
        output = client_out + "\n--- server ---\n" + (server_out or "")
    elif not error and not rows:
        error = f"{tool} printed no result table"
    return PerftestResult(tool, tuple(args), client_rc, output, rows, error)


# --------------------------------------------------------------------------
# latency


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
    typical = res.value("t_typical[usec]")
    # perftest prints "inf" when its cycle counter misbehaves (seen under a loaded TCG guest)
    return value / typical if typical and math.isfinite(typical) else None


#: every how many sends the ping-pong asks for a completion (the rest are suppressed)
SIGNAL_EVERY = 16
_DEPTH = 4 * SIGNAL_EVERY


async def _pong(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> None:
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


async def _ping(ep: Any, evd: Any, send_seg: Any, recv_seg: Any, total: int) -> List[int]:
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


def _endpoint(ia: Any, pz: Any, size: int, fill: bool) -> Tuple[Any, Any, Any, Any, List[bytearray]]:
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
        client, c_evd, c_send, c_recv, c_bufs = _endpoint(ia, pz, size, True)
        child = None
        server_task = None
        try:
            if processes == 1:
                server, s_evd, s_send, s_recv, s_bufs = _endpoint(ia, pz, size, False)
                server.post_recv(s_recv)
                await connect_pair(client, server)
                server_task = asyncio.ensure_future(_pong(server, s_evd, s_send, s_recv, total))
            else:
                child, port = await _start_child(["pong", device, address, str(size), str(total)], loop_name)
                await client.connect(address, port, timeout=30)
            stamps = await _ping(client, c_evd, c_send, c_recv, total)
            if server_task is not None:
                await server_task
                if s_bufs[1] != c_bufs[0]:
                    raise AssertionError("the server received other bytes than the client sent")
            await client.disconnect()
        finally:
            if server_task is not None and not server_task.done():
                server_task.cancel()
            if child is not None:
                await _finish_child(child)
        if child is not None and child.returncode != 0:
            raise RuntimeError(f"the pong process failed (exit status {child.returncode})")
    half = sorted((stamps[i + 1] - stamps[i]) / 2000.0 for i in range(warmup, total))
    return LatencySample(half)


async def _start_child(args: List[str], loop_name: str) -> Tuple[Any, int]:
    """Start ``python -m aiodat.bench ARGS... LOOP`` and read the port it listens on."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodat.bench", *args, loop_name,
        stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if not line.startswith(b"port "):
        await _finish_child(proc)
        raise RuntimeError(f"the {args[0]} process did not start (said {line!r})")
    return proc, int(line.split()[1])


async def _finish_child(proc: Any) -> None:
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


async def _accept_one(ia: Any, ep: Any, private_data: bytes = b"") -> None:
    """A benchmark's child process: listen on a free port, tell the parent which (one line,
    ``port N``, on stdout, as :func:`_start_child` reads it) and accept one connection onto ``ep``."""
    import sys

    from aiodat import EvdFlags

    cr_evd = ia.create_evd(4, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    sys.stdout.write(f"port {psp.port}\n")
    sys.stdout.flush()
    event = await cr_evd.wait_one(timeout=60)
    await event.cr.accept(ep, private_data=private_data)


async def _pong_process(device: str, address: str, size: int, total: int) -> None:
    """The child of ``processes=2``: listen on a free port, print it, echo ``total`` messages."""
    from aiodat import open_ia

    with open_ia(device) as ia:
        pz = ia.create_pz()
        server, s_evd, s_send, s_recv, s_bufs = _endpoint(ia, pz, size, False)
        server.post_recv(s_recv)
        await _accept_one(ia, server)
        await _pong(server, s_evd, s_send, s_recv, total)
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


def streams(write_size: int = 65536, total: int = 8 << 20, size: int = 64, iters: int = 1000,
            loop: str = "asyncio", *, device: Optional[str] = None, address: Optional[str] = None,
            perftest: bool = True) -> Any:
    """``aiodat bench streams``: aiodat streams beside asyncio TCP streams, same code, same loop, same machine.

    Throughput of ``total`` bytes in ``write_size``-byte ``write`` + ``drain``
    calls, and ``iters`` round trips of ``size``-byte request/response
    (median and p99), over aiodat on the device's address and over asyncio
    TCP on 127.0.0.1; with ``perftest``, ``ib_write_bw``/``ib_send_bw -R`` and
    ``ib_send_lat -R -e`` afterwards as the device's ceiling.  Returns an
    :class:`aiodat.bench_streams.StreamsReport` (``format()``, ``as_dict()``).
    """
    from aiodat.bench_streams import run

    return run(write_size, total, size, iters, loop, device, address, perftest=perftest)


def _main(argv: Sequence[str]) -> int:
    """The child of a two-process benchmark (started by ``aiodat bench``):

    ``python -m aiodat.bench pong DEVICE ADDRESS SIZE TOTAL LOOP``: the server of a ping-pong;
    ``python -m aiodat.bench sink DEVICE OP SIZE DEPTH TOTAL LOOP``: the receiving side of a bandwidth run.
    """
    if len(argv) == 6 and argv[0] == "pong":
        _, device, address, size, total, loop_name = argv
        run_on_loop(loop_name, lambda: _pong_process(device, address, int(size), int(total)))
        return 0
    if len(argv) == 7 and argv[0] == "sink":
        _, device, op, size, depth, total, loop_name = argv
        run_on_loop(loop_name, lambda: _sink_process(device, op, int(size), int(depth), int(total)))
        return 0
    print("usage: python -m aiodat.bench pong DEVICE ADDRESS SIZE TOTAL LOOP\n"
          "       python -m aiodat.bench sink DEVICE OP SIZE DEPTH TOTAL LOOP  (children of aiodat bench)")
    return 2


# --------------------------------------------------------------------------
# soak: many connections, mixed operations, for a while; nothing may grow


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
                report: SoakReport) -> None:
    from aiodat import EvdFlags, Privileges, open_ia
    from aiodat.errors import DATError

    ia = open_ia(device)
    try:
        pz = ia.create_pz()
        cr_evd = ia.create_evd(max(8, connections * 2), EvdFlags.CR)
        psp = ia.create_psp_any(cr_evd)
        pending: Dict[int, "asyncio.Future[Any]"] = {}

        async def acceptor() -> None:
            while True:
                ev = await cr_evd.wait_one()
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
            server.post_recv(lmr_s[0:64], "r")
            client.post_recv(lmr_c[0:64], "r")
            key = next(keys)
            fut = asyncio.get_running_loop().create_future()
            pending[key] = fut
            connecting = asyncio.ensure_future(client.connect(address, psp.port, key.to_bytes(4, "big"), timeout=30))
            cr = await asyncio.wait_for(fut, 30)
            await cr.accept(server, timeout=30)
            await connecting
            return client, server

        async def worker(n: int) -> None:
            lmr_c = pz.register(bytearray(16384), Privileges.ALL)
            lmr_s = pz.register(bytearray(16384), Privileges.ALL)
            client, server = await connect_pair(lmr_c, lmr_s)
            remote = lmr_s.remote()
            i = 0
            try:
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
                        (await server.recv_evd.wait_one(timeout=30)).raise_for_status()
                        server.post_recv(lmr_s[0:64], "r")
                        server.post_send(lmr_s[64:128], "s")
                        (await client.recv_evd.wait_one(timeout=30)).raise_for_status()
                        client.post_recv(lmr_c[0:64], "r")
                        for ep in (client, server):
                            (await ep.request_evd.wait_one(timeout=30)).raise_for_status()
                    elif kind == 1:  # RDMA write 4 KiB, then read it back and compare
                        stamp = i.to_bytes(8, "big") * 512
                        lmr_c.memoryview()[4096:8192] = stamp
                        client.post_rdma_write(lmr_c[4096:8192], remote[4096:8192], "w")
                        (await client.request_evd.wait_one(timeout=30)).raise_for_status()
                        client.post_rdma_read(lmr_c[8192:12288], remote[4096:8192], "rd")
                        (await client.request_evd.wait_one(timeout=30)).raise_for_status()
                        if bytes(lmr_c.memoryview()[8192:12288]) != stamp:
                            report.errors.append(f"connection {n}: RDMA read returned other data")
                    elif kind == 2:  # fetch-add
                        client.post_fetch_add(lmr_c[12288:12296], remote[12288:12296], 1, "fa")
                        (await client.request_evd.wait_one(timeout=30)).raise_for_status()
                    else:  # one of the connections reconnects now and then
                        if i % (64 * connections) == 3 + 4 * n:
                            await client.disconnect(timeout=30)
                            await server.connect_evd.wait_one(timeout=30)
                            client.free()
                            server.free()
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
                    obj.free()

        acc = asyncio.ensure_future(acceptor())
        workers = [asyncio.ensure_future(worker(n)) for n in range(connections)]
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
        await asyncio.gather(*workers, return_exceptions=True)
        acc.cancel()
        await asyncio.gather(acc, return_exceptions=True)
    finally:
        ia.close()
    measured = report.intervals[1:] if len(report.intervals) > 2 else report.intervals  # first: warm-up
    if measured:
        report.growth = {"fds": measured[-1].fds - measured[0].fds,
                         "rss_kib": measured[-1].rss_kib - measured[0].rss_kib}


def soak(seconds: float = 60.0, connections: int = 16, loop: str = "uvloop", *, interval: float = 5.0,
         device: Optional[str] = None, address: Optional[str] = None) -> SoakReport:
    """``aiodat bench soak``: ``connections`` connections on one device doing mixed operations
    (send/recv ping-pong, 4 KiB RDMA write then read-back compare, fetch-add, and now and then a
    disconnect/reconnect) for ``seconds``; every ``interval`` seconds the throughput, p50/p99
    latency per operation, open fds and RSS.  The report's ``ok`` is False if an operation failed
    or fds/RSS grew from the first measured interval (the first is warm-up) to the last.
    """
    if seconds <= 0 or connections < 1 or interval <= 0:
        raise ValueError("seconds and interval must be > 0, connections >= 1")
    device, address = device_and_address(device, address)
    report = SoakReport(seconds, connections, loop)
    run_on_loop(loop, lambda: _soak(device, address, seconds, connections, interval, report))
    return report


# --------------------------------------------------------------------------
# bandwidth and message rate (issue 4)

#: perftest's tool for each operation
BW_TOOLS = {"write": "ib_write_bw", "read": "ib_read_bw", "send": "ib_send_bw"}


@dataclass
class BandwidthSample:
    """aiodat's streaming run: how many ``size``-byte operations, how long."""

    op: str
    size: int
    iters: int
    seconds: float

    @property
    def mib_per_s(self) -> float:
        """Bandwidth in MiB/s (perftest's "MB/sec" are 2**20 bytes)."""
        return self.size * self.iters / self.seconds / (1 << 20)

    @property
    def mpps(self) -> float:
        """Operations per second, in millions (perftest's MsgRate[Mpps])."""
        return self.iters / self.seconds / 1e6


@dataclass
class BandwidthReport:
    """What :func:`bandwidth` and :func:`rate` measured: aiodat beside perftest's ``_bw`` tool."""

    device: str
    address: str
    loop: str
    op: str
    size: int
    depth: int
    batch: int
    aiodat: BandwidthSample
    perftest: Optional[PerftestResult] = None
    kind: str = "bandwidth"
    processes: int = 1

    def ratio(self) -> Optional[float]:
        """aiodat / perftest: bandwidth (MB/sec average) or, for ``rate``, message rate (Mpps)."""
        res = self.perftest
        if res is None or not res.ok:
            return None
        if self.kind == "rate":
            theirs = res.value("MsgRate[Mpps]")
            return self.aiodat.mpps / theirs if theirs else None
        theirs = res.value("BW_average[MB/sec]")
        return self.aiodat.mib_per_s / theirs if theirs else None

    def as_dict(self) -> Dict[str, Any]:
        """The figures as a JSON-serialisable dict (``--json``)."""
        res = self.perftest
        return {"kind": self.kind, "device": self.device, "address": self.address, "loop": self.loop,
                "op": self.op, "size": self.size, "depth": self.depth, "batch": self.batch,
                "iters": self.aiodat.iters, "processes": self.processes,
                "aiodat": {"MB_per_s": self.aiodat.mib_per_s, "Mpps": self.aiodat.mpps,
                           "seconds": self.aiodat.seconds},
                "perftest": None if res is None else {
                    "tool": res.tool, "args": list(res.args), "ok": res.ok, "error": res.error or None,
                    "MB_per_s": res.value("BW_average[MB/sec]"), "Mpps": res.value("MsgRate[Mpps]")},
                "ratio": self.ratio()}

    def format(self) -> str:
        """The human-readable report ``aiodat bench bandwidth`` / ``rate`` prints."""
        tool = BW_TOOLS[self.op]
        lines = [
            f"aiodat bench {self.kind}: {self.device} ({self.address}), loop={self.loop}, op={self.op}, "
            f"size={self.size} B, iters={self.aiodat.iters}, depth={self.depth}, batch={self.batch}, "
            f"{self.processes} process(es)",
            f"  {'what':<36}{'MB/s':>10}{'Mpps':>10}",
            f"  {'aiodat (batched posts, evd.wait)':<36}{self.aiodat.mib_per_s:>10.2f}{self.aiodat.mpps:>10.4f}",
        ]
        res = self.perftest
        if res is not None:
            label = f"{tool} -R"
            if res.ok:
                lines.append(f"  {label:<36}{res.value('BW_average[MB/sec]') or 0:>10.2f}"
                             f"{res.value('MsgRate[Mpps]') or 0:>10.4f}")
            else:
                lines.append(f"  {label:<36}  not measured: {res.error}")
            ratio = self.ratio()
            what = "message rate" if self.kind == "rate" else "bandwidth"
            lines.append(f"ratio (aiodat / {tool} {what}): " + (f"{ratio:.2f}" if ratio is not None else "n/a"))
        return "\n".join(lines)


def _check_bw(op: str, size: int, depth: int, iters: int, batch: int) -> None:
    if op not in BW_TOOLS:
        raise ValueError(f"op must be one of {sorted(BW_TOOLS)}, got {op!r}")
    for name, value in (("size", size), ("depth", depth), ("iters", iters), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if batch > depth:
        raise ValueError(f"batch ({batch}) cannot exceed depth ({depth})")


def _bw_setup(ia: Any, op: str, size: int, depth: int, server: bool) -> Tuple[Any, Any, Any, Any]:
    """One side of a bandwidth run: its EP (on one DTO EVD), the EVD, the buffer and a segment of it."""
    from aiodat import EPAttr, EvdFlags, Privileges

    pz = ia.create_pz()
    dev = ia._device_attr
    reads = min(16, dev.max_qp_init_rd_atom, dev.max_qp_rd_atom)
    recv_depth = 2 * depth if op == "send" else 1
    # min_rnr_timer 1 (0.01 ms): a Python receiver reposts more slowly than rxe delivers, and
    # perftest's own QPs are set up the same way (docs/performance.md, "The RNR timer")
    attrs = EPAttr(max_request_dtos=depth, max_recv_dtos=recv_depth, max_rdma_read_in=reads,
                   max_rdma_read_out=reads, min_rnr_timer=1)
    evd = ia.create_evd((recv_depth if server else depth) + 8, EvdFlags.DTO)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=attrs)
    buf = bytearray(size)
    if (op == "read") == server:  # the side whose bytes travel holds the pattern
        buf[:] = bytes(i & 0xFF for i in range(size))
    seg = pz.register(buf, Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE | Privileges.REMOTE_READ)[0:size]
    if server and op == "send":
        ep.post_recv_batch([(seg, None)] * recv_depth)
    return ep, evd, buf, seg


async def _bw_receive(ep: Any, evd: Any, seg: Any, total: int) -> float:
    """Receive ``total`` messages, reposting each receive as it completes; the time of the last."""
    got = 0
    while got < total:
        events = await evd.wait(1, timeout=120)
        for ev in events:
            if ev.status != "IBV_WC_SUCCESS":
                raise RuntimeError(f"a receive failed: {ev.status}")
        got += len(events)
        ep.post_recv_batch([(seg, None)] * len(events))
    return time.perf_counter()


async def _sink_process(device: str, op: str, size: int, depth: int, total: int) -> None:
    """The child of a two-process bandwidth run: accept one connection (handing the client its
    buffer in the accept private data), receive ``total`` messages if ``op`` is send, wait for the
    disconnect and check the bytes that landed."""
    from aiodat import EventType, open_ia

    with open_ia(device) as ia:
        server, evd, buf, seg = _bw_setup(ia, op, size, depth, server=True)
        await _accept_one(ia, server, seg.remote().to_bytes())
        if op == "send":
            await _bw_receive(server, evd, seg, total)
        while (await server.connect_evd.wait_one(timeout=600)).type is not EventType.CONNECTION_EVENT_DISCONNECTED:
            pass
        if op != "read" and bytes(buf) != bytes(i & 0xFF for i in range(size)):
            raise AssertionError(f"the {op} bandwidth run moved other bytes than it should have")


async def bandwidth_stream(device: str, address: str, op: str = "write", size: int = 65536, depth: int = 64,
                           iters: int = 1000, batch: int = 16, warmup: Optional[int] = None,
                           processes: int = 1, loop_name: str = "asyncio") -> BandwidthSample:
    """Stream ``iters`` ``size``-byte operations from a client EP to a server EP of one IA.

    Up to ``depth`` requests are in flight.  They are posted ``batch`` at a
    time in one crossing into C (``post_rdma_write_batch`` / ``_read_batch`` /
    ``post_send_batch``), all but the last of each batch with
    ``CompletionFlags.SUPPRESS``, so each batch costs one completion and one
    wake-up.  For ``send`` the server keeps ``2 * depth`` receives posted and
    reposts them in batches (``post_recv_batch``) as they complete.  The data
    is checked at the end.

    ``processes=1``: both EPs in this process, on one loop; for ``send`` the
    time runs until the server has received the last message.
    ``processes=2``: the server is a child process (``python -m aiodat.bench
    sink``, same loop kind), as perftest runs its two sides, so receiving and
    sending each have a CPU; the time runs until the last request completes
    (for a send, the peer has acknowledged it: it is in its receive queue).
    """
    from aiodat import CompletionFlags, RemoteRegion, open_ia
    from aiodat.cm import connect_pair

    _check_bw(op, size, depth, iters, batch)
    if processes not in (1, 2):
        raise ValueError(f"processes must be 1 or 2, got {processes!r}")
    warmup = min(depth * 2, iters) if warmup is None else warmup
    with open_ia(device) as ia:
        client, c_evd, c_buf, c_seg = _bw_setup(ia, op, size, depth, server=False)
        child = None
        if processes == 1:
            server, s_evd, s_buf, s_seg = _bw_setup(ia, op, size, depth, server=True)
            await connect_pair(client, server)  # cm.py shortens the RNR timer of every new connection
            remote = s_seg.remote()
        else:
            child, port = await _start_child(["sink", device, op, str(size), str(depth), str(warmup + iters)],
                                             loop_name)
            try:
                remote = RemoteRegion.from_bytes(await client.connect(address, port, timeout=30))
            except BaseException:
                child.kill()
                await _finish_child(child)
                raise

        # n requests in one call, only the last signalled: its cookie says how many it completes
        suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
        if op == "write":
            def post(n: int) -> int:
                return client.post_rdma_write_batch([(c_seg, remote, None)] * (n - 1) + [(c_seg, remote, n)],
                                                    suppress, signal)
        elif op == "read":
            def post(n: int) -> int:
                return client.post_rdma_read_batch([(c_seg, remote, None)] * (n - 1) + [(c_seg, remote, n)],
                                                   suppress, signal)
        else:
            def post(n: int) -> int:
                return client.post_send_batch([(c_seg, None)] * (n - 1) + [(c_seg, n)], suppress, signal)

        async def stream(total: int) -> Tuple[float, float]:
            recv_task = None
            if op == "send" and child is None:
                recv_task = asyncio.ensure_future(_bw_receive(server, s_evd, s_seg, total))
            start = time.perf_counter()
            posted = completed = 0
            while completed < total:
                while posted < total and posted - completed < depth:
                    n = min(batch, total - posted, depth - (posted - completed))
                    post(n)
                    posted += n
                for ev in await c_evd.wait(1, timeout=120):
                    if not ev.ok:
                        raise RuntimeError(f"{op} failed: {ev.status}")
                    completed += ev.cookie
            end = time.perf_counter()
            if recv_task is not None:
                end = await recv_task
            return start, end

        try:
            if warmup:
                await stream(warmup)
            start, end = await stream(iters)
            expected = bytes(i & 0xFF for i in range(size))
            if (op == "read" or child is None) and bytes(c_buf if op == "read" else s_buf) != expected:
                raise AssertionError(f"the {op} bandwidth run moved other bytes than it should have")
            await client.disconnect()
        finally:
            if child is not None:
                await _finish_child(child)
        if child is not None and child.returncode != 0:
            raise RuntimeError(f"the receiving process failed (exit status {child.returncode})")
    return BandwidthSample(op, size, iters, end - start)


def _bw_perftest(op: str, size: int, depth: int, iters: int, device: str, address: str,
                 timeout: float) -> PerftestResult:
    return run_perftest_pair(BW_TOOLS[op], ["-s", str(size), "-n", str(iters), "-t", str(depth)],
                             device=device, address=address, timeout=timeout)


def bandwidth(op: str = "write", size: int = 65536, depth: int = 64, iters: int = 1000, loop: str = "asyncio",
              *, batch: int = 16, perftest: bool = True, device: Optional[str] = None,
              address: Optional[str] = None, timeout: float = 300.0, processes: int = 2) -> BandwidthReport:
    """``aiodat bench bandwidth``: aiodat's streaming ``op`` (write, read, send), then ``ib_<op>_bw -R``.

    Same device, size, depth and iteration count, one after the other.  The
    report's ``ratio()`` is aiodat's MB/s over perftest's average MB/s.
    """
    _check_bw(op, size, depth, iters, batch)
    device, address = device_and_address(device, address)
    sample = run_on_loop(loop, lambda: bandwidth_stream(device, address, op, size, depth, iters, batch,
                                                        processes=processes, loop_name=loop))
    report = BandwidthReport(device, address, loop, op, size, depth, batch, sample, processes=processes)
    if perftest:
        report.perftest = _bw_perftest(op, size, depth, iters, device, address, timeout)
    return report


def rate(size: int = 64, depth: int = 128, iters: int = 20000, loop: str = "asyncio", *, batch: int = 32,
         perftest: bool = True, device: Optional[str] = None, address: Optional[str] = None,
         timeout: float = 300.0, processes: int = 2) -> BandwidthReport:
    """``aiodat bench rate``: small-message send rate beside ``ib_send_bw -R`` (ratio of Mpps)."""
    _check_bw("send", size, depth, iters, batch)
    device, address = device_and_address(device, address)
    sample = run_on_loop(loop, lambda: bandwidth_stream(device, address, "send", size, depth, iters, batch,
                                                        processes=processes, loop_name=loop))
    report = BandwidthReport(device, address, loop, "send", size, depth, batch, sample, kind="rate",
                             processes=processes)
    if perftest:
        report.perftest = _bw_perftest("send", size, depth, iters, device, address, timeout)
    return report


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
