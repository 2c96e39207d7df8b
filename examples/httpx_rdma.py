"""httpx speaking HTTP/1.1 over RDMA to an aiohttp application served on aiodat streams.

The server is an ordinary aiohttp application; the only RDMA-specific line is
where it listens (``aiodat.streams.create_server(runner.server, host, port)``
instead of ``loop.create_server``).  The client is an ordinary
``httpx.AsyncClient``; the only RDMA-specific part is its transport
(``RdmaHTTPTransport()``).  ``--transport tcp`` runs the very same code over TCP,
which is how the figures in docs/integrations.md were measured::

    aiodat rxe run -- python examples/httpx_rdma.py                    # RDMA on the rxe device
    python examples/httpx_rdma.py --transport tcp                      # the same over TCP loopback
    python examples/httpx_rdma.py --requests 500 --repeats 3 --loop uvloop
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import time

import httpx
from aiohttp import web

import aiodat.streams
from aiodat.integrations.httpx import RdmaHTTPTransport


def make_app() -> web.Application:
    """A tiny aiohttp service: GET /hello and POST /echo."""
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.add_routes([web.get("/hello", hello), web.post("/echo", echo)])
    return app


async def main(transport: str, host: str, requests: int, repeats: int) -> None:
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    assert runner.server is not None
    server: aiodat.streams.Server | asyncio.Server  # (the same methods: aiodat's is a drop-in)
    if transport == "rdma":
        server = await aiodat.streams.create_server(runner.server, host, 0)   # <- RDMA
        client = httpx.AsyncClient(transport=RdmaHTTPTransport())            # <- RDMA
    else:
        server = await asyncio.get_running_loop().create_server(runner.server, host, 0)
        client = httpx.AsyncClient()
    port = server.sockets[0].getsockname()[1]
    url = f"http://{host}:{port}"
    label = "RDMA" if transport == "rdma" else "TCP"
    try:
        async with client:
            response = await client.get(url + "/hello")
            print(f"GET /hello -> {response.status_code} {response.text!r} ({response.http_version} over {label})")
            payload = os.urandom(1024 * 1024)
            response = await client.post(url + "/echo", content=payload)
            same = hashlib.sha256(response.content).digest() == hashlib.sha256(payload).digest()
            if not same:
                raise SystemExit("the 1 MiB echo came back different")
            print("1 MiB echo verified")
            rates = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(requests):
                    response = await client.get(url + "/hello")
                    assert response.status_code == 200
                rates.append(requests / (time.perf_counter() - start))
            print(f"{requests} GET round trips on one kept-alive connection over {label}: "
                  f"median {statistics.median(rates):.0f} req/s of {repeats} ({', '.join(f'{r:.0f}' for r in rates)})")
    finally:
        server.close()
        await runner.cleanup()
        await server.wait_closed()


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    parser.add_argument("--host", default=None, help="default: 127.0.0.1 for tcp, $AIODAT_RXE_ADDR for rdma")
    parser.add_argument("--requests", type=int, default=200, help="GET round trips per repeat")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args()
    host = args.host or ("127.0.0.1" if args.transport == "tcp" else os.environ.get("AIODAT_RXE_ADDR"))
    if host is None:
        parser.error("--host is needed for rdma (or run under `aiodat rxe run`, which sets AIODAT_RXE_ADDR)")
    coro = main(args.transport, host, args.requests, args.repeats)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
