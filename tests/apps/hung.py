"""A server of an integration in a process of its own, which a test can freeze (SIGSTOP) into a
hung server: the kernel still takes what is sent, and nothing answers.

``python -m apps.hung aiohttp|grpclib ADDRESS`` (from tests/) serves on a free port, prints it,
and serves for an hour; :func:`hung_server` runs it.

Starting it is slow under TCG: a new interpreter imports the framework, protobuf and aiodat again,
each file read over the guest's 9p root, and with three guests and a host suite on two CPUs that
once took more than the 60 s :func:`hung_server` used to give.  It now waits for the port as long
as the process is alive, up to :data:`START_TIMEOUT`, and a failure names the last step the server
reported (``step NAME SECONDS`` lines before ``port N``).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import AsyncIterator, Callable, List, Tuple

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: how long :func:`hung_server` waits for the server's port: only there so that a server that never
#: serves fails the test instead of hanging it.  Under TCG a start took 7-23 s in an idle guest and
#: 100 s with 4 CPU hogs in it and two other guests on the host; this stays under the 300 s after
#: which the device run dumps every thread's stack, so the failure's message comes first.
START_TIMEOUT = 270.0


def _step(name: str, began: float) -> None:
    print(f"step {name} {time.monotonic() - began:.2f}", flush=True)


async def _serve_aiohttp(address: str) -> int:
    began = time.monotonic()
    from aiohttp import web

    from aiodat.integrations.aiohttp import RdmaSite

    _step("imported", began)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = RdmaSite(runner, address, 0)
    began = time.monotonic()
    await site.start()
    _step("listening", began)
    return int(site.port)


async def _serve_grpclib(address: str) -> int:
    began = time.monotonic()
    from aiodat.integrations.grpclib import RdmaServer
    from apps.grpc_echo import EchoService

    _step("imported", began)
    server = RdmaServer([EchoService()])
    began = time.monotonic()
    await server.start(address, 0)
    _step("listening", began)
    return int(server.sockets[0].getsockname()[1])


async def _main(kind: str, address: str) -> None:
    port = await (_serve_aiohttp if kind == "aiohttp" else _serve_grpclib)(address)
    print(f"port {port}", flush=True)
    await asyncio.sleep(3600)


@contextlib.asynccontextmanager
async def hung_server(kind: str, address: str) -> AsyncIterator[Tuple[int, Callable[[], None]]]:
    """(port, freeze) of a ``kind`` server ("aiohttp": GET /hello; "grpclib": the Echo service) in
    another process; ``freeze()`` stops that process (SIGSTOP).

    Waits for the server's port until the process exits or :data:`START_TIMEOUT` passes; either
    raises an AssertionError naming the steps the server got through (its stderr goes to the
    test's captured output)."""
    import aiodat

    # the server runs the aiodat the test imported: from tests/, `-m` finds the installed one, which for
    # an editable install in a clone of the repository is the other tree's
    root = os.path.dirname(os.path.dirname(os.path.abspath(aiodat.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "apps.hung", kind, address, cwd=TESTS,
                                                stdout=asyncio.subprocess.PIPE, env=env)
    try:
        port = await _port(proc, kind, began)
        yield port, lambda: proc.send_signal(signal.SIGSTOP)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (gone already when it failed to start)
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()


async def _port(proc: "asyncio.subprocess.Process", kind: str, began: float) -> int:
    steps: List[str] = []

    async def read() -> int:
        assert proc.stdout is not None
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"apps.hung {kind} exited ({await proc.wait()}) before it served, "
                                     f"{time.monotonic() - began:.1f} s after it started; steps: {steps}")
            word, _, rest = line.strip().partition(" ")
            if word == "port":
                return int(rest)
            steps.append(line.strip())

    try:
        return await asyncio.wait_for(read(), START_TIMEOUT)
    except asyncio.TimeoutError:
        done = steps or "none (still starting Python)"
        raise AssertionError(f"apps.hung {kind} did not serve within {START_TIMEOUT:.0f} s; "
                             f"steps it got through (seconds each): {done}") from None


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
