"""What one stream connection costs to set up, aiodat beside asyncio TCP, in the same run.  Run where rxe is:

    aiodat rxe run -- .venv/bin/python bench/stream_setup.py [--conns 20] [--repeats 5] [--loop asyncio|uvloop]

For each transport (aiodat streams on the device's address, asyncio streams
on 127.0.0.1) a server runs in a child process (the same script with
``--serve``) and this process opens ``--conns`` connections one after the
other; each connection sends one byte, reads the echo, and is closed (EOF,
then the handshake that ends it) before the next starts.  Figures, each the
median over ``--repeats`` repeats of the per-connection mean of one repeat:

* ``open``: the time ``open_connection`` takes to return (client wall time);
* ``total``: open, one-byte echo, close and ``wait_closed`` (client wall time);
* ``server cpu``: the server process's CPU time (user + system, getrusage)
  per accepted connection: what accepting, serving and tearing down one
  connection costs the server;
* ``client cpu``: the same for this process.

aiodat's client is measured twice: ``cold`` (no other stream of this loop is
open, so the shared IA is opened and closed with every connection, the
pattern of a one-shot client) and ``warm`` (one idle stream stays open, so
the IA is shared and each connection only pays for its own resources).
``resources`` is the part of an aiodat connection that is not the rdma_cm
handshake: its PZ, two registrations (1.1 MiB with the defaults), its EVD,
the EP and the posted receives, made and freed ``--conns`` times.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _device_address() -> Tuple[str, str]:
    import aiodat

    env = os.environ.get("AIODAT_RXE_DEVICE")
    ports = [p for p in aiodat.list_providers() if p.state == "PORT_ACTIVE" and p.addresses]
    ports.sort(key=lambda p: p.name != env)
    for p in ports:
        for addr in p.addresses:
            if ":" not in addr:
                return p.name, addr
    sys.exit("stream_setup: no active RDMA device with an IPv4 address (run under `aiodat rxe run -- ...`)")


# -- the server child ----------------------------------------------------------------------------------


async def _serve(transport: str, host: str) -> None:
    if transport == "aiodat":
        import aiodat as streams
    else:
        streams = asyncio  # type: ignore[assignment]
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.write(await reader.readexactly(1))
        await writer.drain()
        await reader.read()  # the client's EOF
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass

    server = await streams.start_server(handler, host, 0)
    print("PORT", server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    start_cpu = _cpu()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "begin":
            accepted, start_cpu = 0, _cpu()
        elif line == "end":
            await asyncio.sleep(0.2)  # let the last connection's teardown finish
            print("CPU", _cpu() - start_cpu, accepted, flush=True)
        else:
            break
    server.close()
    await server.wait_closed()


# -- the client ------------------------------------------------------------------------------------------


class _Child:
    """The server process: start it, ask it for its CPU time between begin and end."""

    def __init__(self, transport: str, host: str, loop_name: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", transport, "--host", host,
                                      "--loop", loop_name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"server child said {line!r}")
        self.port = int(line.split()[1])

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server child ended (rc {self.proc.wait()})")
        return line.strip()

    def say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def cpu(self) -> Tuple[float, int]:
        self.say("end")
        _, cpu, count = self._readline().split()
        return float(cpu), int(count)

    def close(self) -> None:
        try:
            self.say("quit")
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _connections(open_connection: Callable[..., Any], host: str, port: int, n: int) -> Dict[str, float]:
    """``n`` sequential connections: mean open time, mean total time, client CPU per connection."""
    opens, totals = [], []
    cpu0 = _cpu()
    for _ in range(n):
        t0 = time.perf_counter()
        reader, writer = await open_connection(host, port)
        t1 = time.perf_counter()
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        writer.write_eof()
        assert await reader.read() == b""
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
        t2 = time.perf_counter()
        opens.append(t1 - t0)
        totals.append(t2 - t0)
    return {"open": statistics.mean(opens), "total": statistics.mean(totals), "client_cpu": (_cpu() - cpu0) / n}


async def _resources(n: int) -> float:
    """Mean time to make and free one connection's RDMA resources (no handshake), on a held IA."""
    from aiodat.streams.pool import IARef
    from aiodat.streams.protocol import StreamConfig
    from aiodat.streams.transport import Resources

    ref = IARef(None, _device_address()[1])
    try:
        cfg = StreamConfig()
        t0 = time.perf_counter()
        for _ in range(n):
            Resources(ref.ia, cfg).close()
        return (time.perf_counter() - t0) / n
    finally:
        ref.release()


def _measure(transport: str, host: str, args: argparse.Namespace, warm: bool = False) -> Dict[str, float]:
    child = _Child(transport, host, args.loop)
    rows: List[Dict[str, float]] = []
    try:
        for _ in range(args.repeats):
            loop = _new_loop(args.loop)
            try:
                async def one() -> Dict[str, float]:
                    if transport == "aiodat":
                        import aiodat as streams
                    else:
                        streams = asyncio  # type: ignore[assignment]
                    keeper = None
                    if warm:  # one idle stream keeps the loop's shared IA open
                        keeper = await streams.open_connection(host, child.port)
                    child.say("begin")
                    row = await _connections(streams.open_connection, host, child.port, args.conns)
                    cpu, count = child.cpu()
                    row["server_cpu"] = cpu / max(1, count)
                    if keeper is not None:
                        keeper[1].write(b"k")
                        await keeper[0].readexactly(1)
                        keeper[1].close()
                        try:
                            await keeper[1].wait_closed()
                        except ConnectionError:
                            pass
                    return row

                rows.append(loop.run_until_complete(one()))
            finally:
                loop.close()
    finally:
        child.close()
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conns", type=int, default=20, help="sequential connections per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; figures are the median")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--serve", choices=("aiodat", "tcp"), help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        loop = _new_loop(args.loop)
        try:
            loop.run_until_complete(_serve(args.serve, args.host))
        finally:
            loop.close()
        return 0

    device, address = _device_address()
    print(f"stream_setup: loop={args.loop} device={device} ({address}) conns={args.conns} repeats={args.repeats} "
          f"cpus={os.cpu_count()}", flush=True)
    results = {
        "tcp": _measure("tcp", "127.0.0.1", args),
        "aiodat cold": _measure("aiodat", address, args),
        "aiodat warm": _measure("aiodat", address, args, warm=True),
    }
    loop = _new_loop(args.loop)
    try:
        res = statistics.median(loop.run_until_complete(_resources(args.conns)) for _ in range(args.repeats))
    finally:
        loop.close()
    ms = 1e3
    print(f"{'per connection (ms)':<22}{'open':>10}{'total':>10}{'server cpu':>12}{'client cpu':>12}")
    for name, r in results.items():
        print(f"{name:<22}{r['open'] * ms:>10.2f}{r['total'] * ms:>10.2f}{r['server_cpu'] * ms:>12.2f}"
              f"{r['client_cpu'] * ms:>12.2f}")
    tcp = results["tcp"]
    for name in ("aiodat cold", "aiodat warm"):
        r = results[name]
        print(f"{name} / tcp: open x{r['open'] / tcp['open']:.1f}, total x{r['total'] / tcp['total']:.1f}, "
              f"server cpu x{r['server_cpu'] / tcp['server_cpu']:.1f}, client cpu x{r['client_cpu'] / tcp['client_cpu']:.1f}")
    print(f"aiodat resources only (PZ, 2 registrations, EVD, EP, receives; made and freed): {res * ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
