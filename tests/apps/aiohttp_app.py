"""A small aiohttp application that exercises what real services use, for tests over TCP and RDMA.

Routes: ``GET /hello`` (text), ``GET /json?n=`` (JSON), ``POST /echo`` (the body
back), ``POST /digest`` (sha256 and length of a streamed body), ``GET /file``
(a ``web.FileResponse``), ``GET /stream?chunks=&size=`` (a chunked
``StreamResponse``), ``GET /peer`` (the connection's peer address: the same
on every request of a keep-alive connection) and ``GET /ws`` (a WebSocket
that echoes text and binary messages until the client closes).

:func:`serve` starts it on a ``web.TCPSite`` or an aiodat ``RdmaSite`` and
yields the base URL and a ``ClientSession`` for the same transport: that pair
is the only thing that differs between the two runs of the suite.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
from pathlib import Path
from typing import AsyncIterator, Tuple

from aiohttp import WSMsgType, web
import aiohttp

FILE_SIZE = 300_000


def file_bytes() -> bytes:
    """The content /file serves: deterministic, not repetitive at any short period."""
    return hashlib.shake_256(b"aiodat file response").digest(FILE_SIZE)


def stream_chunk(i: int, size: int) -> bytes:
    """Chunk ``i`` of /stream."""
    return bytes([(i * 7 + 1) % 256]) * size


def make_app(static_dir: Path) -> web.Application:
    """The application; ``static_dir`` receives the file /file serves."""
    path = static_dir / "blob.bin"
    path.write_bytes(file_bytes())

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def json_handler(request: web.Request) -> web.Response:
        n = int(request.query.get("n", "0"))
        return web.json_response({"n": n, "square": n * n})

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read(), content_type="application/octet-stream")

    async def digest(request: web.Request) -> web.Response:
        h, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_any():
            h.update(chunk)
            size += len(chunk)
        return web.json_response({"sha256": h.hexdigest(), "size": size, "chunked": request.headers.get(
            "Transfer-Encoding", "") == "chunked"})

    async def file_handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path)

    async def stream(request: web.Request) -> web.StreamResponse:
        chunks, size = int(request.query["chunks"]), int(request.query["size"])
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(chunks):
            await response.write(stream_chunk(i, size))
        await response.write_eof()
        return response

    async def peer(request: web.Request) -> web.Response:
        host, port = request.transport.get_extra_info("peername")[:2]  # type: ignore[union-attr]
        return web.json_response({"host": host, "port": port})

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            if msg.type == WSMsgType.TEXT:
                await sock.send_str(msg.data.upper())
            elif msg.type == WSMsgType.BINARY:
                await sock.send_bytes(msg.data[::-1])
        return sock

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.add_routes([web.get("/hello", hello), web.get("/json", json_handler), web.post("/echo", echo),
                    web.post("/digest", digest), web.get("/file", file_handler), web.get("/stream", stream),
                    web.get("/peer", peer), web.get("/ws", ws)])
    return app


@contextlib.asynccontextmanager
async def serve(transport: str, host: str, static_dir: Path, *, shutdown_timeout: float = 5.0
                ) -> AsyncIterator[Tuple[str, aiohttp.ClientSession]]:
    """Run the app on ``transport`` ("tcp" or "rdma") at ``host``; yield (base URL, session)."""
    runner = web.AppRunner(make_app(static_dir), shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        if transport == "tcp":
            site: web.BaseSite = web.TCPSite(runner, host, 0)
            connector: aiohttp.BaseConnector = aiohttp.TCPConnector()
        else:
            from aiodat.integrations.aiohttp import RdmaConnector, RdmaSite

            site = RdmaSite(runner, host, 0)
            connector = RdmaConnector()
        await site.start()
        port = site.port  # type: ignore[attr-defined]
        async with aiohttp.ClientSession(connector=connector) as session:
            yield f"http://{host}:{port}", session
    finally:
        await runner.cleanup()
    await asyncio.sleep(0)
