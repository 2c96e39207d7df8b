"""The aiohttp application the httpx tests talk to, and how to serve it over TCP or over aiodat streams.

Served over RDMA with aiohttp's own runner and nothing else: ``runner.server``
(aiohttp's protocol factory) is handed to :func:`aiodat.streams.create_server`
exactly as it would be to ``loop.create_server``.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Set, Tuple

from aiohttp import web

import aiodat.streams


#: the client (address, port) of every connection a request came in on
PEERS = web.AppKey("peers", Set[Tuple[str, int]])


def make_app() -> web.Application:
    """Routes: /hello, /echo (POST), /stream, /slow (GET or POST: the body is not read), /close (Connection: close), /truncated, /peers."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    peers: Set[Tuple[str, int]] = set()
    app[PEERS] = peers

    @web.middleware
    async def record_peer(request: web.Request, handler):  # type: ignore[no-untyped-def]
        transport = request.transport
        if transport is not None:
            peers.add(tuple(transport.get_extra_info("peername")))
        return await handler(request)

    app.middlewares.append(record_peer)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello " + request.query.get("n", ""))

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(body=body, headers={"X-Length": str(len(body))})

    async def stream(request: web.Request) -> web.StreamResponse:
        chunks, size = int(request.query["chunks"]), int(request.query["size"])
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(chunks):
            await response.write(bytes([i % 256]) * size)
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query["seconds"]))
        return web.Response(text="late")

    async def close(request: web.Request) -> web.Response:
        response = web.Response(text="bye")
        response.force_close()  # "Connection: close", then aiohttp closes the connection
        return response

    async def truncated(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 100_000
        await response.prepare(request)
        await response.write(b"x" * 1000)
        assert request.transport is not None
        request.transport.close()  # the server goes away mid-body
        return response

    async def peer_count(request: web.Request) -> web.Response:
        return web.Response(text=str(len(peers)))

    app.add_routes([web.get("/hello", hello), web.post("/echo", echo), web.get("/stream", stream),
                    web.get("/slow", slow), web.post("/slow", slow), web.get("/close", close), web.get("/truncated", truncated),
                    web.get("/peers", peer_count)])
    return app


@contextlib.asynccontextmanager
async def serve(app: web.Application, transport: str, host: str,
                keepalive_timeout: float = 75.0) -> AsyncIterator[str]:
    """Serve ``app`` on ``host`` over "tcp" (asyncio) or "rdma" (aiodat streams); yields the base URL."""
    runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout, access_log=None)
    await runner.setup()
    assert runner.server is not None
    if transport == "rdma":
        server = await aiodat.streams.create_server(runner.server, host, 0)
    else:
        server = await asyncio.get_running_loop().create_server(runner.server, host, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.close()
        await runner.cleanup()  # closes aiohttp's connections
        await asyncio.wait_for(server.wait_closed(), 30)
