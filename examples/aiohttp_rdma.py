"""An aiohttp application and an aiohttp client over RDMA, and the same over TCP for comparison.

The application is plain aiohttp; only the site (``RdmaSite`` instead of
``web.TCPSite``) and the client's connector (``RdmaConnector`` instead of the
default ``TCPConnector``) come from aiodat.  URLs stay ``http://host:port/``,
with ``host`` the address of the server's RDMA device.

Run it::

    aiodat rxe run -- python examples/aiohttp_rdma.py demo
    python examples/aiohttp_rdma.py serve --host 169.254.77.1 --port 8080
    python examples/aiohttp_rdma.py get http://169.254.77.1:8080/hello
    aiodat rxe run -- python examples/aiohttp_rdma.py bench --requests 500 --rounds 3 [--loop uvloop]

``bench`` runs the server in a child process and times sequential small GETs
on one keep-alive connection, alternating rounds over RDMA and over TCP
loopback (127.0.0.1) in the same machine, and prints requests per second.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import aiohttp
from aiohttp import web

from aiodat.integrations.aiohttp import RdmaConnector, RdmaSite


def make_app(static_dir: Path) -> web.Application:
    """An ordinary aiohttp application: text, an echo, a file and a WebSocket."""
    (static_dir / "data.bin").write_bytes(bytes(range(256)) * 1200)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello over " + request.app["transport"])

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def data(request: web.Request) -> web.FileResponse:
        return web.FileResponse(static_dir / "data.bin")

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await sock.send_str(msg.data[::-1])
        return sock

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.add_routes([web.get("/hello", hello), web.post("/echo", echo), web.get("/data", data),
                    web.get("/ws", ws)])
    return app


async def start(transport: str, host: str, port: int, static_dir: Path) -> web.AppRunner:
    """Serve the app on RDMA (``RdmaSite``) or TCP (``web.TCPSite``); returns the runner."""
    app = make_app(static_dir)
    app["transport"] = transport
    runner = web.AppRunner(app)
    await runner.setup()
    site = RdmaSite(runner, host, port) if transport == "rdma" else web.TCPSite(runner, host, port)
    await site.start()
    print(f"serving on {site.name} over {transport}", flush=True)
    return runner


def connector(transport: str) -> aiohttp.BaseConnector:
    """The client side: aiodat streams for RDMA, aiohttp's own for TCP."""
    return RdmaConnector() if transport == "rdma" else aiohttp.TCPConnector()


async def demo(host: str) -> int:
    """Server and client in one process over RDMA: a GET, a 1 MiB POST, a file and a WebSocket."""
    checks: List[bool] = []
    with tempfile.TemporaryDirectory() as tmp:
        runner = await start("rdma", host, 0, Path(tmp))
        port = runner.addresses[0][1]
        base = f"http://{host}:{port}"
        try:
            async with aiohttp.ClientSession(connector=RdmaConnector()) as session:
                async with session.get(f"{base}/hello") as resp:
                    text = await resp.text()
                    checks.append(text == "hello over rdma")
                    print(f"GET /hello -> {resp.status} {text!r}")
                body = os.urandom(1 << 20)
                async with session.post(f"{base}/echo", data=body) as resp:
                    checks.append(await resp.read() == body)
                    print(f"POST /echo 1 MiB -> {resp.status}, echoed intact: {checks[-1]}")
                async with session.get(f"{base}/data") as resp:
                    checks.append(await resp.read() == bytes(range(256)) * 1200)
                    print(f"GET /data (FileResponse) -> {resp.status}, {resp.content_length} bytes, "
                          f"intact: {checks[-1]}")
                async with session.ws_connect(f"{base}/ws") as sock:
                    await sock.send_str("stressed")
                    reply = await sock.receive_str()
                    checks.append(reply == "desserts")
                    print(f"WebSocket: sent 'stressed', got {reply!r}")
        finally:
            await runner.cleanup()
    if not all(checks):
        print("aiohttp over RDMA: FAILED")
        return 1
    print("aiohttp over RDMA: ok")
    return 0


async def serve(transport: str, host: str, port: int) -> int:
    """Serve until interrupted (or until stdin closes: the bench's child)."""
    with tempfile.TemporaryDirectory() as tmp:
        runner = await start(transport, host, port, Path(tmp))
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, sys.stdin.read)
        finally:
            await runner.cleanup()
    return 0


async def get(url: str, transport: str) -> int:
    """One GET, printed."""
    async with aiohttp.ClientSession(connector=connector(transport)) as session:
        async with session.get(url) as resp:
            print(resp.status, await resp.text())
    return 0


async def timed_gets(transport: str, url: str, requests: int) -> float:
    """Requests per second of ``requests`` sequential GETs on one keep-alive connection."""
    async with aiohttp.ClientSession(connector=connector(transport)) as session:
        for _ in range(20):  # warm up: connection, caches
            async with session.get(url) as resp:
                await resp.read()
        start_time = time.perf_counter()
        for _ in range(requests):
            async with session.get(url) as resp:
                await resp.read()
        return requests / (time.perf_counter() - start_time)


def bench(host: str, requests: int, rounds: int, loop_name: str) -> int:
    """Alternate RDMA and TCP rounds against a server in a child process; print the medians."""
    results: Dict[str, List[float]] = {"rdma": [], "tcp": []}
    for _ in range(rounds):
        for transport in ("rdma", "tcp"):
            where = host if transport == "rdma" else "127.0.0.1"
            child = subprocess.Popen([sys.executable, __file__, "serve", "--transport", transport, "--host", where,
                                      "--port", "0", "--loop", loop_name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            try:
                line = child.stdout.readline() if child.stdout else ""
                if "serving on" not in line:
                    raise RuntimeError(f"the {transport} server did not start: {line!r}")
                url = line.split()[2] + "/hello"
                rate = run(timed_gets(transport, url, requests), loop_name)
                results[transport].append(rate)
                print(f"{transport}: {rate:.1f} req/s", flush=True)
            finally:
                if child.stdin:
                    child.stdin.close()
                child.wait(60)
    rdma, tcp = statistics.median(results["rdma"]), statistics.median(results["tcp"])
    print(f"loop {loop_name}, {requests} sequential GETs x {rounds} rounds, medians: "
          f"RDMA {rdma:.1f} req/s, TCP loopback {tcp:.1f} req/s, RDMA/TCP {rdma / tcp:.2f}x")
    return 0


def run(coro: Any, loop_name: str) -> Any:
    """Run ``coro`` on asyncio's loop or on uvloop."""
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("demo", "serve", "get", "bench"))
    parser.add_argument("url", nargs="?", help="get: the URL")
    parser.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    parser.add_argument("--host", default=None, help="the RDMA device's address (default: $AIODAT_RXE_ADDR)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args(argv)
    host = args.host or os.environ.get("AIODAT_RXE_ADDR")
    if args.mode == "get":
        if not args.url:
            parser.error("get needs a URL")
        return run(get(args.url, args.transport), args.loop)
    if host is None:
        parser.error("--host is needed (or run under `aiodat rxe run`, which sets AIODAT_RXE_ADDR)")
    if args.mode == "demo":
        return run(demo(host), args.loop)
    if args.mode == "serve":
        return run(serve(args.transport, host, args.port), args.loop)
    return bench(host, args.requests, args.rounds, args.loop)


if __name__ == "__main__":
    sys.exit(main())
