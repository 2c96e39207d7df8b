"""A server of an integration in a process of its own, which a test can freeze (SIGSTOP) into a
hung server: the kernel still takes what is sent, and nothing answers.

``python -m apps.hung aiohttp|grpclib ADDRESS`` (from tests/) serves on a free port, prints it,
and serves for an hour; :func:`hung_server` runs it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import AsyncIterator, Callable, Tuple

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _serve_aiohttp(address: str) -> int:
    from aiohttp import web

    from aiodat.integrations.aiohttp import RdmaSite

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = RdmaSite(runner, address, 0)
    await site.start()
    return int(site.port)


async def _serve_grpclib(address: str) -> int:
    from aiodat.integrations.grpclib import RdmaServer
    from apps.grpc_echo import EchoService

    server = RdmaServer([EchoService()])
    await server.start(address, 0)
    return int(server.sockets[0].getsockname()[1])


async def _main(kind: str, address: str) -> None:
    port = await (_serve_aiohttp if kind == "aiohttp" else _serve_grpclib)(address)
    print(port, flush=True)
    await asyncio.sleep(3600)


@contextlib.asynccontextmanager
async def hung_server(kind: str, address: str) -> AsyncIterator[Tuple[int, Callable[[], None]]]:
    """(port, freeze) of a ``kind`` server ("aiohttp": GET /hello; "grpclib": the Echo service) in
    another process; ``freeze()`` stops that process (SIGSTOP)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "apps.hung", kind, address, cwd=TESTS,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
        yield port, lambda: proc.send_signal(signal.SIGSTOP)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        await proc.wait()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
