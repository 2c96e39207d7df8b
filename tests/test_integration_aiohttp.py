"""Issue 16 item 2: one aiohttp application suite, the same test bodies over TCP and over RDMA.

The ``web`` fixture serves tests/apps/aiohttp_app.py on a ``web.TCPSite`` with
aiohttp's own ``TCPConnector`` (127.0.0.1), or on aiodat's ``RdmaSite`` with
``RdmaConnector`` (the rxe device's address, ``rxe`` marker): nothing else
differs.  Run on both loops (``--aiodat-loop asyncio`` / ``uvloop``).
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Tuple

import pytest

aiohttp = pytest.importorskip("aiohttp")

from apps import aiohttp_app  # noqa: E402  (tests/ is on sys.path, as for every test module)
from apps.hung import hung_server  # noqa: E402

import aiodat  # noqa: E402
from aiodat import streams as aiodat_streams  # noqa: E402

Web = Tuple[str, Any]


@pytest.fixture(params=["tcp", pytest.param("rdma", marks=pytest.mark.rxe)])
async def web(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Web]:
    """(base URL, ClientSession) of the app served over TCP or over RDMA."""
    if request.param == "tcp":
        host = "127.0.0.1"
    else:
        host = request.getfixturevalue("rdma_device").address
    async with aiohttp_app.serve(request.param, host, tmp_path) as pair:
        yield pair
    if request.param == "rdma":
        assert aiodat_streams.shared_ia_count() == 0, "a connection or the site outlived the runner"


async def test_get_text_and_json(web: Web) -> None:
    base, session = web
    async with session.get(f"{base}/hello") as resp:
        assert resp.status == 200
        assert await resp.text() == "hello"
    async with session.get(f"{base}/json", params={"n": 12}) as resp:
        assert await resp.json() == {"n": 12, "square": 144}
    async with session.get(f"{base}/missing") as resp:
        assert resp.status == 404


async def test_post_echo_1mib(web: Web) -> None:
    base, session = web
    body = random.Random(16).randbytes(1024 * 1024)
    async with session.post(f"{base}/echo", data=body) as resp:
        assert resp.status == 200
        assert await resp.read() == body


async def test_file_response(web: Web) -> None:
    """web.FileResponse: loop.sendfile's fallback on asyncio, aiohttp's own fallback on uvloop."""
    base, session = web
    async with session.get(f"{base}/file") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Length"] == str(aiohttp_app.FILE_SIZE)
        assert await resp.read() == aiohttp_app.file_bytes()
    # a range request (sendfile with an offset and a count), on the same keep-alive connection
    async with session.get(f"{base}/file", headers={"Range": "bytes=1000-70999"}) as resp:
        assert resp.status == 206
        assert await resp.read() == aiohttp_app.file_bytes()[1000:71000]


async def test_chunked_response_streamed(web: Web) -> None:
    base, session = web
    chunks, size = 40, 5000
    expected = b"".join(aiohttp_app.stream_chunk(i, size) for i in range(chunks))
    async with session.get(f"{base}/stream", params={"chunks": chunks, "size": size}) as resp:
        assert resp.headers["Transfer-Encoding"] == "chunked"
        got = bytearray()
        async for piece in resp.content.iter_any():
            got += piece
    assert bytes(got) == expected


async def test_chunked_request_streamed(web: Web) -> None:
    """A request body from an async generator goes out chunked and is read as a stream."""
    base, session = web
    parts = [random.Random(i).randbytes(3000 + i * 977) for i in range(30)]

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part
            await asyncio.sleep(0)

    async with session.post(f"{base}/digest", data=body()) as resp:
        result = await resp.json()
    joined = b"".join(parts)
    assert result == {"sha256": hashlib.sha256(joined).hexdigest(), "size": len(joined), "chunked": True}


async def test_keep_alive_many_sequential_requests(web: Web) -> None:
    base, session = web
    peers = set()
    for n in range(60):
        async with session.get(f"{base}/json", params={"n": n}) as resp:
            assert (await resp.json())["square"] == n * n
        async with session.get(f"{base}/peer") as resp:
            peers.add(tuple((await resp.json()).values()))
    assert len(peers) == 1, f"keep-alive should reuse one connection, the server saw {peers}"


async def test_concurrent_requests(web: Web) -> None:
    base, session = web

    async def one(n: int) -> int:
        async with session.get(f"{base}/json", params={"n": n}) as resp:
            return (await resp.json())["square"]

    async def echo(n: int) -> bool:
        body = random.Random(n).randbytes(20_000 + n)
        async with session.post(f"{base}/echo", data=body) as resp:
            return await resp.read() == body

    squares = await asyncio.gather(*(one(n) for n in range(24)))
    assert squares == [n * n for n in range(24)]
    assert all(await asyncio.gather(*(echo(n) for n in range(8))))


async def test_websocket_echo(web: Web) -> None:
    base, session = web
    async with session.ws_connect(f"{base}/ws") as ws:
        for i in range(20):
            await ws.send_str(f"message {i}")
            assert await ws.receive_str() == f"MESSAGE {i}"
        big = random.Random(5).randbytes(200_000)
        await ws.send_bytes(big)
        assert await ws.receive_bytes() == big[::-1]
        await ws.close()
    assert ws.closed and ws.close_code == 1000


async def test_a_zero_connect_timeout_means_no_limit(web: Web, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp reads ``sock_connect`` 0 or None as no limit, as it does for TCP; the connector used to
    pass 0 on as a 0 s connect timeout, which every request failed, and then left both to the
    stream's default of 30 s.  Over RDMA the stream is asked for no limit (connect_timeout None)."""
    from aiodat.integrations import aiohttp as integration

    base, session = web
    asked = []
    real = integration.create_connection

    async def recording(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("connect_timeout", "the default"))
        return await real(*args, **kwargs)

    monkeypatch.setattr(integration, "create_connection", recording)
    for sock_connect in (0, None, 7.5):
        timeout = aiohttp.ClientTimeout(total=60, sock_connect=sock_connect)
        async with aiohttp.ClientSession(connector=type(session.connector)(), timeout=timeout) as fresh:
            async with fresh.get(f"{base}/hello") as resp:
                assert resp.status == 200
    if isinstance(session.connector, integration.RdmaConnector):
        assert asked == [None, None, 7.5]


async def test_connection_refused_is_client_connector_error(web: Web, tmp_path: Path) -> None:
    """Nothing listening: ClientConnectorError around a ConnectionRefusedError, as over TCP."""
    base, session = web
    host = base.split("//")[1].rsplit(":", 1)[0]
    (tmp_path / "other").mkdir()
    async with aiohttp_app.serve("tcp" if host == "127.0.0.1" else "rdma", host, tmp_path / "other") as (other, _):
        dead = other
    with pytest.raises(aiohttp.ClientConnectorError) as info:
        async with session.get(f"{dead}/hello"):
            pass
    assert isinstance(info.value.os_error, ConnectionRefusedError)


# -- host only: the aiohttp internals the integration relies on ------------------------------------

TESTED = "aiohttp 3.14.5"


def test_aiohttp_parts_we_build_on() -> None:
    """aiohttp has no public hook for a site's listener or a connector's connections, so
    aiodat.integrations.aiohttp uses two internals (each in one marked place): checked here, so that an
    upgrade that moves one fails with its name instead of breaking sites or sessions."""
    import inspect

    from aiohttp import web
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.connector import BaseConnector

    where = f"(aiodat.integrations.aiohttp was tested with {TESTED}; this is aiohttp {aiohttp.__version__})"
    assert "_server" in web.BaseSite.__slots__, f"aiohttp's BaseSite has no _server slot any more {where}"
    assert "self._server.close()" in inspect.getsource(web.BaseSite.stop), \
        f"aiohttp's BaseSite.stop() no longer closes site._server {where}"
    assert "site._server" in inspect.getsource(web.BaseRunner.addresses.fget), \
        f"aiohttp's BaseRunner.addresses no longer reads site._server {where}"
    assert "_create_connection" in vars(BaseConnector), \
        f"aiohttp's BaseConnector._create_connection, the hook RdmaConnector overrides, is gone {where}"
    assert list(inspect.signature(BaseConnector._create_connection).parameters) == \
        ["self", "req", "traces", "timeout"], f"BaseConnector._create_connection(req, traces, timeout) changed {where}"
    assert "self._create_connection(" in inspect.getsource(BaseConnector), \
        f"aiohttp's BaseConnector no longer calls _create_connection {where}"
    assert list(inspect.signature(ResponseHandler.__init__).parameters) == ["self", "loop"], \
        f"aiohttp.client_proto.ResponseHandler(loop) changed {where}"


@pytest.mark.parametrize("kind", ["tcp", "rdma"])
async def test_a_host_name_that_does_not_resolve_is_client_connector_dns_error(kind: str) -> None:
    """A host name that does not resolve raises aiohttp.ClientConnectorDNSError, as TCPConnector's does,
    naming the lookup's failure; RdmaConnector raised the base ClientConnectorError, with
    "[Unknown error -2]" as its reason.  (The lookup comes before any connection: no device needed.)"""
    from aiodat.integrations.aiohttp import RdmaConnector

    connector = aiohttp.TCPConnector() if kind == "tcp" else RdmaConnector()
    async with aiohttp.ClientSession(connector=connector) as session:
        with pytest.raises(aiohttp.ClientConnectorDNSError, match="no-such-host.invalid") as info:
            await session.get("http://no-such-host.invalid:8080/")
    assert isinstance(info.value.os_error, OSError) and "Unknown error" not in str(info.value)


@pytest.mark.rxe
async def test_rdma_site_is_listed_and_stopped_by_its_runner(rdma_device: Any) -> None:
    """runner.addresses lists an RdmaSite's address, and runner.cleanup() stops it (aiohttp's own
    bookkeeping of sites, which the integration plugs into)."""
    from aiohttp import web

    from aiodat.integrations.aiohttp import RdmaSite

    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = RdmaSite(runner, rdma_device.address, 0)
    assert site.name == f"http://{rdma_device.address}:0" and runner.addresses == []
    await site.start()
    assert site.port != 0
    assert runner.addresses == [(rdma_device.address, site.port)]
    assert site.name == f"http://{rdma_device.address}:{site.port}"
    unnamed = RdmaSite(runner, None, 0)  # (the default device's address, from its listener)
    await unnamed.start()
    await unnamed.stop()
    assert unnamed.name == f"http://0.0.0.0:{unnamed.port}"  # (it raised IndexError once stopped)
    await runner.cleanup()
    assert runner.addresses == [] and aiodat_streams.shared_ia_count() == 0


@pytest.mark.rxe
async def test_a_proxy_is_refused_not_ignored(rdma_device: Any, tmp_path: Path) -> None:
    """A request through a proxy raises ClientConnectorError naming it: the connector used to go
    to the origin anyway, sending it the proxy's request line and Proxy-Authorization."""
    async with aiohttp_app.serve("rdma", rdma_device.address, tmp_path) as (base, session):
        with pytest.raises(aiohttp.ClientConnectorError, match="proxy"):
            secret = {"Proxy-Authorization": aiohttp.encode_basic_auth("user", "secret")}
            async with session.get(f"{base}/hello", proxy="http://127.0.0.1:3128", proxy_headers=secret):
                pass
        async with session.get(f"{base}/hello") as resp:  # the session goes on without one
            assert resp.status == 200
    assert aiodat_streams.shared_ia_count() == 0


@pytest.mark.rxe
async def test_closing_a_session_does_not_wait_on_a_hung_server(rdma_device: Any) -> None:
    """``await session.close()`` waits for its connections to close; a hung server never answers an RDMA
    connection's disconnect, which held the close for the stream's disconnect timeout (10 s; for ever
    when the EOF could not be sent).  The connector's connections have close_timeout CLOSE_TIMEOUT."""
    from aiodat.integrations.aiohttp import CLOSE_TIMEOUT, RdmaConnector

    loop = asyncio.get_running_loop()
    async with hung_server("aiohttp", rdma_device.address) as (port, freeze):
        session = aiohttp.ClientSession(connector=RdmaConnector())
        async with session.get(f"http://{rdma_device.address}:{port}/hello") as resp:  # the connection stays in the pool
            assert await resp.text() == "hello"
        freeze()
        began = loop.time()
        await session.close()
        assert loop.time() - began < CLOSE_TIMEOUT + 2.0
        assert aiodat_streams.shared_ia_count() == 0
