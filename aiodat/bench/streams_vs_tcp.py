"""``aiodat bench streams``: aiodat streams beside asyncio TCP streams, on loopback in the same machine.

Two figures, each taken for both transports one after the other on the same
event loop, with the same code (only ``open_connection`` / ``start_server``
differ, as in examples/kvstore.py):

* throughput: one client writes ``total`` bytes in ``write_size`` writes
  (``write`` + ``await drain()``), a server reads until EOF; MB/s from the first
  write to the server seeing EOF;
* latency: ``iters`` round trips of a ``size``-byte request and a ``size``-byte
  response (``write``, ``drain``, ``readexactly``); median and 99th percentile
  of the full round trip in microseconds.

TCP runs on 127.0.0.1, RDMA on the device's address (rxe runs over the
guest's own network stack, so both are "loopback" in the same guest).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Dict, List, Optional

from .harness import device_and_address, run_on_loop
from .perftest import run_perftest_pair
from .stats import percentile


@dataclass
class StreamsFigures:
    """One transport's figures."""

    transport: str
    throughput_mb_s: float
    rtt_median_us: float
    rtt_p99_us: float
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamsReport:
    """What ``aiodat bench streams`` measured: aiodat (RDMA) and asyncio (TCP) figures side by side."""

    loop: str
    device: str
    address: str
    write_size: int
    total: int
    size: int
    iters: int
    rdma: StreamsFigures
    tcp: StreamsFigures
    #: the device's own ceiling in the same run (perftest, C, no Python): MB/s and round-trip us
    perftest: Dict[str, Optional[float]] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """The report as plain data (for --json)."""
        return asdict(self)

    def format(self) -> str:
        """A small table, RDMA beside TCP, with the ratio."""
        r, t = self.rdma, self.tcp

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b else "-"

        lines = [
            f"aiodat bench streams  loop={self.loop}  device={self.device} ({self.address})",
            f"  throughput: {self.total // 1024} KiB in {self.write_size}-byte writes + drain();"
            f" latency: {self.iters} round trips of {self.size} bytes each way",
            "",
            f"  {'':<28} {'aiodat (RDMA)':>14} {'asyncio (TCP)':>14} {'RDMA/TCP':>9}",
            f"  {'throughput MB/s':<28} {r.throughput_mb_s:>14.1f} {t.throughput_mb_s:>14.1f}"
            f" {ratio(r.throughput_mb_s, t.throughput_mb_s):>9}",
            f"  {'round trip median us':<28} {r.rtt_median_us:>14.1f} {t.rtt_median_us:>14.1f}"
            f" {ratio(r.rtt_median_us, t.rtt_median_us):>9}",
            f"  {'round trip p99 us':<28} {r.rtt_p99_us:>14.1f} {t.rtt_p99_us:>14.1f}"
            f" {ratio(r.rtt_p99_us, t.rtt_p99_us):>9}",
        ]
        labels = {"ib_write_bw_mb_s": "ib_write_bw -R MB/s", "ib_send_bw_mb_s": "ib_send_bw -R MB/s",
                  "ib_send_lat_e_rtt_us": "ib_send_lat -R -e round trip us"}
        for key, label in labels.items():
            if key in self.perftest:
                value = self.perftest[key]
                lines.append(f"  {label:<34} {'-' if value is None else f'{value:.1f}':>8}   (device ceiling, same run)")
        if r.extra:
            lines.append(f"  RDMA path: {r.extra}")
        return "\n".join(lines)


async def _throughput(streams: ModuleType, host: str, write_size: int, total: int) -> Dict[str, Any]:
    done: "asyncio.Future[int]" = asyncio.get_running_loop().create_future()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while True:
            chunk = await reader.read(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        if not done.done():
            done.set_result(got)
        writer.close()

    server = await streams.start_server(sink, host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await streams.open_connection(host, port)
        block = bytes(range(256)) * (write_size // 256 + 1)
        block = block[:write_size]
        count = total // write_size
        start = time.perf_counter()
        for _ in range(count):
            writer.write(block)
            await writer.drain()
        writer.write_eof()
        got = await done
        elapsed = time.perf_counter() - start
        stats = dict(getattr(writer.transport, "stats", {}))
        writer.close()
        await writer.wait_closed()
    if got != count * write_size:
        raise AssertionError(f"the server received {got} bytes of {count * write_size}")
    return {"mb_s": got / elapsed / 1e6, "stats": stats}


async def _latency(streams: ModuleType, host: str, size: int, iters: int) -> List[float]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readexactly(size)
                writer.write(request)
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await streams.start_server(echo, host, 0)
    port = server.sockets[0].getsockname()[1]
    samples: List[float] = []
    async with server:
        reader, writer = await streams.open_connection(host, port)
        request = bytes(i & 0xFF for i in range(size))
        warmup = max(10, iters // 10)
        for i in range(warmup + iters):
            start = time.perf_counter()
            writer.write(request)
            await writer.drain()
            reply = await reader.readexactly(size)
            if i >= warmup:
                samples.append((time.perf_counter() - start) * 1e6)
            if reply != request:
                raise AssertionError("the echo came back different")
        writer.close()
        await writer.wait_closed()
    return sorted(samples)


async def measure(transport: str, streams: ModuleType, host: str, write_size: int, total: int, size: int,
                  iters: int) -> StreamsFigures:
    """Both figures for one transport."""
    tput = await _throughput(streams, host, write_size, total)
    rtts = await _latency(streams, host, size, iters)
    return StreamsFigures(transport, tput["mb_s"], percentile(rtts, 50), percentile(rtts, 99), tput["stats"])


def _perftest(device: str, address: str, write_size: int, total: int, size: int,
              iters: int) -> Dict[str, Optional[float]]:
    n = str(max(5, total // write_size))
    out: Dict[str, Optional[float]] = {}
    for key, tool in (("ib_write_bw_mb_s", "ib_write_bw"), ("ib_send_bw_mb_s", "ib_send_bw")):
        res = run_perftest_pair(tool, ["-s", str(write_size), "-n", n], device=device, address=address)
        out[key] = res.value("BW_average[MB/sec]") if res.ok else None
    res = run_perftest_pair("ib_send_lat", ["-s", str(size), "-n", str(iters), "-e"], device=device,
                            address=address)
    typical = res.value("t_typical[usec]") if res.ok else None
    out["ib_send_lat_e_rtt_us"] = None if typical is None else 2 * typical  # perftest prints half round trips
    return out


def streams(write_size: int = 65536, total: int = 8 << 20, size: int = 64, iters: int = 1000,
            loop: str = "asyncio", *, device: Optional[str] = None, address: Optional[str] = None,
            tcp_host: str = "127.0.0.1", perftest: bool = True) -> StreamsReport:
    """``aiodat bench streams``: aiodat streams beside asyncio TCP streams, same code, same loop, same machine.

    Throughput of ``total`` bytes in ``write_size``-byte ``write`` + ``drain``
    calls, and ``iters`` round trips of ``size``-byte request/response
    (median and p99), over aiodat on the device's address and over asyncio
    TCP on ``tcp_host``; with ``perftest``, ``ib_write_bw``/``ib_send_bw -R`` and
    ``ib_send_lat -R -e`` afterwards as the device's ceiling.
    """
    from aiodat import InvalidParameter

    for name, value, low in (("write_size", write_size, 1), ("total", total, write_size), ("size", size, 1),
                             ("iters", iters, 1)):
        if not isinstance(value, int) or value < low:
            raise InvalidParameter(f"{name} must be an int >= {low}, got {value!r}")
    device, address = device_and_address(device, address)

    async def both() -> StreamsReport:
        import aiodat

        rdma = await measure("rdma", aiodat, address, write_size, total, size, iters)
        tcp = await measure("tcp", asyncio, tcp_host, write_size, total, size, iters)
        return StreamsReport(loop, device, address, write_size, total, size, iters, rdma, tcp)

    report = run_on_loop(loop, both)
    if perftest:
        report.perftest = _perftest(device, address, write_size, total, size, iters)
    return report
