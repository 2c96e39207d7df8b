"""``aiodat bench streams``: aiodat streams beside librdmacm's ``rstream`` (rsockets) and asyncio TCP streams.

Two figures, each taken per round for every transport, one after the other:

* throughput: one client writes ``total`` bytes in ``write_size`` writes
  (``write`` + ``await drain()``) to a server that reads them and answers with
  an 8-byte count; MB/s (10**6 bytes) from the first write to the answer, on a
  connection opened after an untimed warm-up connection of up to 1 MiB;
* round trip: ``iters`` round trips of a ``size``-byte request and a
  ``size``-byte response (``write``, ``drain``, ``readexactly``); the median in us.

aiodat and asyncio run the same code (only ``open_connection`` /
``start_server`` differ).  In one guest (the default), aiodat runs on the
device's address, TCP on 127.0.0.1 and rstream on the device's address
(``-S write_size -C total/write_size -I 1`` and ``-S size -C 1 -I iters``).
rstream's server and client are two processes, so by default (``processes=2``)
the aiodat and TCP servers are a child process too (``python -m aiodat.bench
stream-server``); ``processes=1`` runs client and server on one loop.
With ``two_hosts`` (inside ``aiodat rxe run --hosts 2``), the server of aiodat
and of asyncio TCP runs on host B (``python -m aiodat.bench stream-server``,
started through :mod:`aiodat.testbed.hosts`) and the client on host A, over
the same virtio link (aiodat on B's rxe address, TCP on the same address);
so does rstream's server, which gives what RDMA streams over that link reach
in C (rsockets) beside TCP.
"""
from __future__ import annotations

import asyncio
import os
import random
import struct
import sys
import time
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from .harness import device_and_address, run_on_loop
from .peer import start_child
from .rounds import Comparison
from .rstream import run_rstream_pair
from .stats import percentile

_SINK, _ECHO = b"S", b"E"
_HEAD = struct.Struct("!cQ")  # kind, then the total bytes (sink) or the message size (echo)


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One benchmark connection: a sink (read N bytes, answer N) or an echo of fixed-size messages."""
    try:
        kind, n = _HEAD.unpack(await reader.readexactly(_HEAD.size))
        if kind == _SINK:
            got = 0
            while got < n:
                chunk = await reader.read(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
            writer.write(struct.pack("!Q", got))
            await writer.drain()
        else:
            while True:
                writer.write(await reader.readexactly(n))
                await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def start_stream_server(streams: ModuleType, host: str, port: int = 0, **options: Any) -> Any:
    """Start the benchmark server (sink and echo) with ``streams.start_server(..., **options)``."""
    return await streams.start_server(_serve_one, host, port, **options)


async def throughput(streams: ModuleType, host: str, port: int, write_size: int, total: int,
                     **options: Any) -> float:
    """MB/s of ``total`` bytes written in ``write_size`` writes + drain, until the server's count arrives."""
    reader, writer = await streams.open_connection(host, port, **options)
    block = (bytes(range(256)) * (write_size // 256 + 1))[:write_size]
    count = total // write_size
    try:
        start = time.perf_counter()
        writer.write(_HEAD.pack(_SINK, count * write_size))
        for _ in range(count):
            writer.write(block)
            await writer.drain()
        (got,) = struct.unpack("!Q", await reader.readexactly(8))
        elapsed = time.perf_counter() - start
    finally:
        writer.close()
        await writer.wait_closed()
    if got != count * write_size:
        raise AssertionError(f"the server received {got} bytes of {count * write_size}")
    return got / elapsed / 1e6


async def warm_throughput(streams: ModuleType, host: str, port: int, write_size: int, total: int,
                          **options: Any) -> float:
    """:func:`throughput` on a new connection after an untimed one of up to 1 MiB to the same server:
    a stream's steady rate, not its process's first connection (whose first run through the code,
    on both sides, costs a Python process about a tenth of an 8 MiB run), as rstream times its
    transfer after its set-up and a first exchange."""
    await throughput(streams, host, port, write_size, min(total, max(write_size, 1 << 20)), **options)
    return await throughput(streams, host, port, write_size, total, **options)


async def round_trips(streams: ModuleType, host: str, port: int, size: int, iters: int,
                      **options: Any) -> List[float]:
    """The sorted round trips (us) of ``iters`` ``size``-byte requests echoed back (after a warm-up)."""
    reader, writer = await streams.open_connection(host, port, **options)
    request = bytes(i & 0xFF for i in range(size))
    samples: List[float] = []
    try:
        writer.write(_HEAD.pack(_ECHO, size))
        warmup = max(10, iters // 10)
        clock = time.perf_counter
        for i in range(warmup + iters):
            start = clock()
            writer.write(request)
            await writer.drain()
            reply = await reader.readexactly(size)
            if i >= warmup:
                samples.append((clock() - start) * 1e6)
            if reply != request:
                raise AssertionError("the echo came back different")
    finally:
        writer.close()
        await writer.wait_closed()
    return sorted(samples)


def _options(busy_poll_us: int) -> Dict[str, Any]:
    """The stream options of a measurement: busy polling for aiodat when asked, none for TCP."""
    return {"busy_poll_us": busy_poll_us} if busy_poll_us else {}


async def _figures(streams: ModuleType, host: str, port: int, write_size: int, total: int, size: int,
                   iters: int, busy_poll_us: int) -> tuple:
    """Both figures against a server listening on ``host:port``: (MB/s, round-trip median us)."""
    options = _options(busy_poll_us)
    mb_s = await warm_throughput(streams, host, port, write_size, total, **options)
    rtts = await round_trips(streams, host, port, size, iters, **options)
    return mb_s, percentile(rtts, 50)


async def measure_local(streams: ModuleType, host: str, write_size: int, total: int, size: int,
                        iters: int, busy_poll_us: int = 0) -> tuple:
    """Both figures for one transport with the server in this process: (MB/s, round-trip median us)."""
    server = await start_stream_server(streams, host, **_options(busy_poll_us))
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await _figures(streams, host, port, write_size, total, size, iters, busy_poll_us)


async def measure_child(streams: ModuleType, transport: str, host: str, write_size: int, total: int,
                        size: int, iters: int, loop_name: str, busy_poll_us: int = 0) -> tuple:
    """Both figures for one transport with the server in a child process of this guest, as rstream runs."""
    proc, port = await start_child(["stream-server", transport, host, "0", str(busy_poll_us)], loop_name)
    try:
        return await _figures(streams, host, port, write_size, total, size, iters, busy_poll_us)
    finally:
        proc.kill()
        await proc.wait()


async def measure_remote(streams: ModuleType, transport: str, host: str, write_size: int, total: int,
                         size: int, iters: int, loop_name: str, busy_poll_us: int = 0) -> tuple:
    """Both figures for one transport with the server on the peer host of a two-host test bed."""
    from aiodat.testbed import hosts

    port = random.randint(40000, 49999)
    proc = hosts.start_on(hosts.peer(), [sys.executable, "-m", "aiodat.bench", "stream-server", transport, host,
                                         str(port), str(busy_poll_us), loop_name],
                          env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 120
        while "listening" not in proc.stdout():  # the server says so once it accepts
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {transport} stream server on host {hosts.peer()} did not start: "
                                   f"{proc.stderr()[-2000:]}")
            await asyncio.sleep(0.1)
        return await _figures(streams, host, port, write_size, total, size, iters, busy_poll_us)
    finally:
        proc.kill()


async def stream_server_process(transport: str, host: str, port: int, busy_poll_us: int = 0) -> None:
    """``python -m aiodat.bench stream-server TRANSPORT HOST PORT [BUSY_POLL_US] LOOP``: serve until killed."""
    import aiodat

    server = await start_stream_server(aiodat if transport == "rdma" else asyncio, host, port,
                                       **_options(busy_poll_us))
    print(f"port {server.sockets[0].getsockname()[1]} listening", flush=True)  # (read by peer.start_child)
    async with server:
        await server.serve_forever()


def streams(write_size: int = 65536, total: int = 8 << 20, size: int = 64, iters: int = 1000,
            loop: str = "asyncio", *, repeat: int = 3, device: Optional[str] = None,
            address: Optional[str] = None, tcp_host: str = "127.0.0.1", rstream: bool = True,
            two_hosts: bool = False, processes: int = 2, busy_poll_us: int = 1000, timeout: float = 300.0,
            progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """``aiodat bench streams``: aiodat streams beside rstream and asyncio TCP, in one guest or between the
    two hosts of ``aiodat rxe run --hosts 2`` (``two_hosts``: every server on host B).

    Each of ``repeat`` rounds takes throughput and the round-trip median of
    every transport; ratios are aiodat / peer within a round, and their median.
    In one guest the servers are a child process (``processes=2``, as rstream's
    two processes) or share the client's loop (``processes=1``).  With
    ``busy_poll_us`` (0: not run) aiodat is measured a second time with that
    ``busy_poll_us`` stream option on both sides, as rstream spins on its CQ
    (rsockets' ``polling_time``) before it sleeps.
    """
    from aiodat import InvalidParameter

    if processes not in (1, 2):
        raise InvalidParameter(f"processes must be 1 or 2, got {processes!r}")
    for name, value, low in (("write_size", write_size, 1), ("total", total, write_size), ("size", size, 1),
                             ("iters", iters, 1), ("repeat", repeat, 1), ("busy_poll_us", busy_poll_us, 0)):
        if not isinstance(value, int) or value < low:
            raise InvalidParameter(f"{name} must be an int >= {low}, got {value!r}")
    device, address = device_and_address(device, address)
    setup = {"device": device, "address": address, "loop": loop, "write_size": write_size, "total": total,
             "size": size, "iters": iters, "busy_poll_us": busy_poll_us}
    # where rstream's server runs: between two hosts on host B, as aiodat's and TCP's do
    rstream_addr, rstream_host = address, None
    if two_hosts:
        from aiodat.testbed import hosts

        peer_addr = hosts.address(hosts.peer())
        rstream_addr, rstream_host = peer_addr, hosts.peer()
        setup.update(hosts="2", server=peer_addr)
    else:
        setup.update(processes=processes)
    report = Comparison("aiodat bench streams", setup, repeat,
                        title=f"throughput: {total // 1024} KiB in {write_size}-byte writes; round trip: "
                              f"{size}-byte request and response, median")
    where = " 2 hosts" if two_hosts else ""
    # (figure key prefix, transport, label, busy_poll_us), in the order each round measures them
    runs = [("aiodat", "rdma", "aiodat streams", 0), ("tcp", "tcp", "asyncio TCP", 0)]
    if busy_poll_us:
        runs.insert(1, ("aiodat_busy", "rdma", f"aiodat streams, busy poll {busy_poll_us} us,", busy_poll_us))
    tput = {key: report.figure(f"{key}_mb_s", f"{label}{where} throughput", "MB/s") for key, _, label, _ in runs}
    rtt = {key: report.figure(f"{key}_rtt", f"{label}{where} round trip", "us") for key, _, label, _ in runs}
    if rstream:
        tput["rstream"] = report.figure("rstream_mb_s", f"rstream{where} throughput", "MB/s")
        rtt["rstream"] = report.figure("rstream_rtt", f"rstream{where} round trip (2 x usec/xfer)", "us")
    for peer, peer_label in (("rstream", f"rstream{where}"), ("tcp", f"TCP{where}")):
        if peer not in tput:
            continue
        for mine, mine_label in (("aiodat", "aiodat"), ("aiodat_busy", "aiodat busy poll")):
            if mine in tput:
                report.compare(f"{mine}_mb_s", f"{peer}_mb_s", f"{mine_label} / {peer_label} throughput")
                report.compare(f"{mine}_rtt", f"{peer}_rtt", f"{mine_label} / {peer_label} round trip")
    if "rstream" in tput:
        # in one guest, what asyncio's own streams cost against rstream: a reference for any asyncio
        # stream's round trip; between two hosts, also what RDMA over this link gives in C against TCP
        report.compare("tcp_mb_s", "rstream_mb_s", f"asyncio TCP / rstream{where} throughput (reference)")
        report.compare("tcp_rtt", "rstream_rtt", f"asyncio TCP / rstream{where} round trip (reference)")

    import aiodat

    for r in range(repeat):
        for key, transport, _label, busy in runs:
            module = aiodat if transport == "rdma" else asyncio
            if progress:
                progress(f"round {r + 1}: {key}{where}")
            try:
                if two_hosts:
                    figures = run_on_loop(loop, lambda: measure_remote(
                        module, transport, peer_addr, write_size, total, size, iters, loop, busy))
                elif processes == 2:
                    host = address if transport == "rdma" else tcp_host
                    figures = run_on_loop(loop, lambda: measure_child(
                        module, transport, host, write_size, total, size, iters, loop, busy))
                else:
                    host = address if transport == "rdma" else tcp_host
                    figures = run_on_loop(loop, lambda: measure_local(
                        module, host, write_size, total, size, iters, busy))
            except (OSError, RuntimeError, AssertionError, asyncio.TimeoutError) as exc:
                tput[key].record(None, f"{type(exc).__name__}: {exc}")
                rtt[key].record(None, f"{type(exc).__name__}: {exc}")
                continue
            tput[key].record(figures[0])
            rtt[key].record(figures[1])
        if "rstream" in tput:
            if progress:
                progress(f"round {r + 1}: rstream")
            count = max(1, total // write_size)
            res = run_rstream_pair(rstream_addr, ["-S", str(write_size), "-C", str(count), "-I", "1"],
                                   timeout=timeout, server_host=rstream_host)
            tput["rstream"].record(res.mb_s, res.error or None)
            res = run_rstream_pair(rstream_addr, ["-S", str(size), "-C", "1", "-I", str(iters)], timeout=timeout,
                                   server_host=rstream_host)
            rtt["rstream"].record(res.rtt_us, res.error or None)
    return report
