"""Issue 16 item 3: httpx over RDMA (aiodat.integrations.httpx), against a real aiohttp server.

The client suite runs twice: over TCP (httpx's own transport, aiohttp on
127.0.0.1) and over RDMA (``RdmaHTTPTransport``, the same aiohttp application
served by ``aiodat.streams.create_server``).  The RDMA runs carry the rxe marker;
run the file on both loops (``--aiodat-loop asyncio`` / ``uvloop``).
"""
from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any, AsyncIterator, List, Tuple

import httpcore
import httpx
import pytest

import aiodat
from aiodat import streams as aiodat_streams
from apps.httpx_app import PEERS, make_app, serve
from apps.hung import hung_server
from aiodat.integrations.httpx import RdmaHTTPTransport, RdmaNetworkBackend, _httpx_errors


Setup = Tuple[str, "ClientMaker", Any]  # (base URL, client maker, aiohttp app)


@pytest.fixture(params=["tcp", pytest.param("rdma", marks=pytest.mark.rxe)])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def host(kind: str, request: pytest.FixtureRequest) -> str:
    if kind == "tcp":
        return "127.0.0.1"
    return request.getfixturevalue("rdma_device").address


class ClientMaker:
    """Makes httpx.AsyncClients over TCP, or over RDMA: the only difference is ``transport=``.

    ``transports`` keeps each client's transport (httpx has no public accessor for it).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.transports: List[httpx.AsyncBaseTransport] = []

    def __call__(self, limits: httpx.Limits = httpx.Limits(), **kw: Any) -> httpx.AsyncClient:
        transport: httpx.AsyncBaseTransport
        if self.kind == "rdma":
            transport = RdmaHTTPTransport(limits=limits)
        else:
            transport = httpx.AsyncHTTPTransport(limits=limits)
        self.transports.append(transport)
        return httpx.AsyncClient(transport=transport, **kw)


def client_maker(kind: str) -> ClientMaker:
    return ClientMaker(kind)


@pytest.fixture
async def setup(kind: str, host: str) -> AsyncIterator[Setup]:
    app = make_app()
    async with serve(app, kind, host, keepalive_timeout=75.0) as url:
        yield url, client_maker(kind), app


# -- the same suite over TCP and RDMA -------------------------------------------------------------


async def test_get_post_and_streamed_body(setup: Setup) -> None:
    """GET; a 1 MiB POST echoed byte for byte; a streamed (chunked) response read chunk by chunk."""
    url, make, _ = setup
    payload = random.Random(16).randbytes(1024 * 1024)
    async with make() as client:
        response = await client.get(url + "/hello", params={"n": "7"})
        assert response.status_code == 200 and response.text == "hello 7"
        assert response.http_version == "HTTP/1.1"

        response = await client.post(url + "/echo", content=payload)
        assert response.status_code == 200
        assert response.headers["X-Length"] == str(len(payload))
        assert hashlib.sha256(response.content).digest() == hashlib.sha256(payload).digest()

        digest = hashlib.sha256()
        received = 0
        async with client.stream("GET", url + "/stream", params={"chunks": 40, "size": 10_000}) as streamed:
            assert streamed.headers.get("Transfer-Encoding") == "chunked"
            async for chunk in streamed.aiter_bytes():
                digest.update(chunk)
                received += len(chunk)
        expected = b"".join(bytes([i]) * 10_000 for i in range(40))
        assert received == len(expected) and digest.digest() == hashlib.sha256(expected).digest()


async def test_keepalive_reuses_one_connection(setup: Setup) -> None:
    """20 sequential requests go over one kept-alive connection."""
    url, make, app = setup
    async with make() as client:
        for i in range(20):
            response = await client.get(url + "/hello", params={"n": str(i)})
            assert response.text == f"hello {i}"
        assert len(app[PEERS]) == 1, app[PEERS]
        transport = make.transports[-1]
        if isinstance(transport, RdmaHTTPTransport):
            assert transport.network_backend.connections_opened == 1
            assert len(transport.pool.connections) == 1


async def test_concurrent_requests(setup: Setup) -> None:
    """12 requests at once over a pool of at most 4 connections: all answered, each correctly."""
    url, make, app = setup
    bodies = [random.Random(i).randbytes(1000 + 2000 * i) for i in range(12)]
    # (keep-alive long enough for a loaded host: a connection idle past the default 5 s expires,
    # and the pool rightly opens another, a fifth peer that says nothing about the limit)
    async with make(limits=httpx.Limits(max_connections=4, keepalive_expiry=120)) as client:
        responses = await asyncio.gather(*(client.post(url + "/echo", content=b) for b in bodies))
        assert [r.content for r in responses] == bodies
    assert 1 <= len(app[PEERS]) <= 4


async def test_server_closing_the_connection(setup: Setup) -> None:
    """Connection: close and an idle connection the server dropped: the next request opens a new one;
    a response cut short by the server raises httpx.RemoteProtocolError."""
    url, make, app = setup
    async with make() as client:
        response = await client.get(url + "/close")
        assert response.text == "bye" and response.headers["Connection"] == "close"
        assert (await client.get(url + "/hello")).text == "hello "
        assert len(app[PEERS]) == 2
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url + "/truncated")
        assert (await client.get(url + "/hello", params={"n": "after"})).text == "hello after"


async def test_idle_connection_closed_by_server(kind: str, host: str) -> None:
    """The server's keep-alive timeout closes the idle connection; the client sees it and reconnects."""
    app = make_app()
    async with serve(app, kind, host, keepalive_timeout=0.5) as url:
        async with client_maker(kind)() as client:
            response = await client.get(url + "/hello")
            assert response.status_code == 200
            # httpx's documented "network_stream" extension: the connection the response came on
            stream = response.extensions["network_stream"]
            assert stream.get_extra_info("is_readable") is False  # idle, kept alive
            for _ in range(150):  # the server drops the idle connection after 0.5 s; the client notices
                await asyncio.sleep(0.1)
                if stream.get_extra_info("is_readable"):  # idle and "readable": closed by the server
                    break
            assert stream.get_extra_info("is_readable")
            assert (await client.get(url + "/hello", params={"n": "again"})).text == "hello again"
            assert len(app[PEERS]) == 2


async def test_timeouts_raise_httpx_timeouts(setup: Setup) -> None:
    """A slow handler past the read timeout raises httpx.ReadTimeout; a pool with no free connection
    raises httpx.PoolTimeout; an upload the server does not read raises httpx.WriteTimeout; the
    client still works afterwards."""
    url, make, _ = setup
    async with make(limits=httpx.Limits(max_connections=1)) as client:
        with pytest.raises(httpx.ReadTimeout):  # (the client connects first: that gets a timeout of its own)
            await client.get(url + "/slow", params={"seconds": "1"}, timeout=httpx.Timeout(60.0, read=0.3))
        slow = asyncio.ensure_future(client.get(url + "/slow", params={"seconds": "1"}))
        await asyncio.sleep(0.3)
        with pytest.raises(httpx.PoolTimeout):
            await client.get(url + "/hello", timeout=httpx.Timeout(5.0, pool=0.2))
        assert (await slow).text == "late"
        # the server does not read the body: flow control stops the upload, the write times out
        with pytest.raises(httpx.WriteTimeout):
            await client.post(url + "/slow", params={"seconds": "1"}, content=bytes(32 * 1024 * 1024),
                              timeout=httpx.Timeout(5.0, write=0.5))
        assert (await client.get(url + "/hello")).status_code == 200


async def test_use_after_close(setup: Setup) -> None:
    """A closed client refuses new requests (httpx's RuntimeError)."""
    url, make, _ = setup
    client = make()
    assert (await client.get(url + "/hello")).status_code == 200
    await client.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await client.get(url + "/hello")


# -- RDMA only ------------------------------------------------------------------------------------


@pytest.fixture
async def rdma_url(rdma_device: Any) -> AsyncIterator[str]:
    async with serve(make_app(), "rdma", rdma_device.address) as url:
        yield url


@pytest.mark.rxe
async def test_network_backend_stream(rdma_url: str) -> None:
    """The httpcore backend on its own: a raw HTTP/1.1 exchange, extra info, no TLS, use after close."""
    host, port = rdma_url[len("http://"):].split(":")
    backend = RdmaNetworkBackend(buffer_size=8192)
    stream = await backend.connect_tcp(host, int(port), timeout=30)
    assert stream.get_extra_info("server_addr") == (host, int(port))
    assert stream.get_extra_info("client_addr")[0] == host
    assert stream.get_extra_info("ssl_object") is None and stream.get_extra_info("socket") is None
    assert stream.get_extra_info("aiodat_config").buffer_size == 8192
    assert stream.get_extra_info("is_readable") is False
    await stream.write(b"GET /hello?n=raw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=10)
    data = b""
    while not data.endswith(b"hello raw"):
        chunk = await stream.read(65536, timeout=10)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert await stream.read(65536, timeout=10) == b""  # Connection: close -> EOF
    assert stream.get_extra_info("is_readable") is True
    with pytest.raises(aiodat.ModelNotSupported, match="TLS"):
        await stream.start_tls(None)  # type: ignore[arg-type]
    await stream.aclose()
    await stream.aclose()  # a second close does nothing
    with pytest.raises(httpcore.ReadError, match="closed"):
        await stream.read(10)
    with pytest.raises(httpcore.WriteError, match="closed"):
        await stream.write(b"x")
    with pytest.raises(aiodat.ModelNotSupported):
        await backend.connect_unix_socket("/tmp/x")


@pytest.mark.rxe
async def test_no_connect_timeout_is_no_limit(rdma_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's connect timeout None ("no limit") asks the stream for no limit; it was turned into
    30 s, after which it raised ConnectTimeout "within None s".  A number is passed on as it is."""
    from aiodat.integrations import httpx as integration

    asked = []
    real = integration.open_connection

    async def recording(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["connect_timeout"])
        return await real(*args, **kwargs)

    monkeypatch.setattr(integration, "open_connection", recording)
    for timeout in (httpx.Timeout(None), httpx.Timeout(20.0, connect=7.5)):
        async with httpx.AsyncClient(transport=RdmaHTTPTransport(), timeout=timeout) as client:
            assert (await client.get(rdma_url + "/hello")).status_code == 200
    assert asked == [None, 7.5]


@pytest.mark.rxe
async def test_bytes_sent_to_an_idle_connection_make_it_readable(rdma_device: Any) -> None:
    """A server that writes to an idle keep-alive connection (a 408, say) makes it ``is_readable``,
    so httpcore drops it instead of reading those bytes as the next response's; it used to stay
    "not readable" until the EOF.  A connect that fails with an aiodat error (no such device here)
    is httpcore.ConnectError, as for any failed connect."""
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        sent.set()
        await reader.read()  # keeps the connection open until the client goes
        writer.close()

    server = await aiodat.start_server(handler, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    stream = await RdmaNetworkBackend().connect_tcp(rdma_device.address, port, timeout=30)
    await asyncio.wait_for(sent.wait(), 30)
    for _ in range(100):
        if stream.get_extra_info("is_readable"):
            break
        await asyncio.sleep(0.05)
    assert stream.get_extra_info("is_readable") is True
    assert not stream._reader.at_eof()  # readable for the bytes, not for an EOF
    await stream.aclose()
    server.close()
    await server.wait_closed()
    with pytest.raises(aiodat.ProviderNotFound, match="nosuchdevice"):  # (at construction: httpx would retry it)
        RdmaNetworkBackend(ia="nosuchdevice")


@pytest.mark.rxe
async def test_rdma_transport_errors(rdma_url: str, rdma_device: Any) -> None:
    """https and a closed transport are refused clearly; nothing listening is httpx.ConnectError,
    no answer within the connect timeout httpx.ConnectTimeout."""
    transport = RdmaHTTPTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(aiodat.ModelNotSupported, match="TLS"):
            await client.get(rdma_url.replace("http://", "https://") + "/hello")
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://{rdma_device.address}:1/hello")
        with pytest.raises(httpx.ConnectTimeout):  # nobody has this address: no answer within 0.5 s
            await client.get("http://169.254.77.99:8080/hello", timeout=httpx.Timeout(5.0, connect=0.5))
        assert (await client.get(rdma_url + "/hello")).status_code == 200
    assert transport.is_closed
    with pytest.raises(RuntimeError, match="RdmaHTTPTransport is closed"):
        await transport.handle_async_request(httpx.Request("GET", rdma_url + "/hello"))
    with pytest.raises(aiodat.InvalidParameter, match="buffer_size"):
        RdmaHTTPTransport(buffer_size=1)
    with pytest.raises(TypeError, match="bogus"):
        RdmaHTTPTransport(bogus=1)


@pytest.mark.rxe
async def test_a_hung_server_holds_neither_a_timeout_nor_aclose(rdma_device: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that stops answering: a request's read timeout of 0.5 s raises httpx.ReadTimeout after
    0.5 s, and aclose() returns at once, as over TCP.  Both used to wait CLOSE_TIMEOUT more for the
    graceful close of the connection (httpcore closes it after a timeout), which the hung server never
    answers.  The connections are still aborted after CLOSE_TIMEOUT, so nothing stays open."""
    from aiodat.integrations import httpx as integration

    monkeypatch.setattr(integration, "CLOSE_TIMEOUT", 3.0)
    loop = asyncio.get_running_loop()
    async with hung_server("aiohttp", rdma_device.address) as (port, freeze):
        url = f"http://{rdma_device.address}:{port}"
        timing_out, closing = (httpx.AsyncClient(transport=RdmaHTTPTransport()) for _ in range(2))
        for client in (timing_out, closing):  # one kept-alive connection each
            assert (await client.get(url + "/hello")).text == "hello"
        freeze()
        began = loop.time()
        with pytest.raises(httpx.ReadTimeout):
            await timing_out.get(url + "/hello", timeout=0.5)
        assert loop.time() - began < 2.0
        began = loop.time()
        await closing.aclose()
        assert loop.time() - began < 1.0
        for _ in range(100):  # both connections aborted CLOSE_TIMEOUT s after their close
            if aiodat_streams.shared_ia_count() == 0:
                break
            await asyncio.sleep(0.1)
        assert aiodat_streams.shared_ia_count() == 0
        await timing_out.aclose()


# -- host only: the translation RdmaHTTPTransport does with public API only ------------------------


@pytest.mark.parametrize("name", ["TimeoutException", "ConnectTimeout", "ReadTimeout", "WriteTimeout",
                                  "PoolTimeout", "NetworkError", "ConnectError", "ReadError", "WriteError",
                                  "ProxyError", "UnsupportedProtocol", "ProtocolError", "LocalProtocolError",
                                  "RemoteProtocolError"])
def test_httpcore_errors_become_the_httpx_errors_of_the_same_name(name: str) -> None:
    """Each httpcore exception is raised as the httpx exception of its name (not a base class of it),
    the original chained; anything else passes unchanged."""
    original = getattr(httpcore, name)("boom")
    with pytest.raises(getattr(httpx, name), match="boom") as info:
        with _httpx_errors():
            raise original
    assert type(info.value) is getattr(httpx, name) and info.value.__cause__ is original
    with pytest.raises(KeyError):
        with _httpx_errors():
            raise KeyError("not httpcore's")


def test_transport_uses_public_api_only() -> None:
    """RdmaHTTPTransport is an httpx.AsyncBaseTransport (the documented base for custom transports), not a
    subclass of httpx.AsyncHTTPTransport whose private pool it would have to replace; its pool is a
    public httpcore.AsyncConnectionPool on RdmaNetworkBackend."""
    transport = RdmaHTTPTransport(limits=httpx.Limits(max_connections=3), retries=2)
    assert isinstance(transport, httpx.AsyncBaseTransport)
    assert not isinstance(transport, httpx.AsyncHTTPTransport)
    assert isinstance(transport.pool, httpcore.AsyncConnectionPool)
    assert isinstance(transport.network_backend, RdmaNetworkBackend)
    with pytest.raises(TypeError, match="httpx.Limits"):
        RdmaHTTPTransport(limits=3)  # type: ignore[arg-type]


async def test_https_is_an_httpx_error() -> None:
    """An https:// URL raises httpx.UnsupportedProtocol, what httpx raises for a URL its transport
    cannot serve, so the ``except httpx.HTTPError`` / ``httpx.RequestError`` of httpx code catches
    it; it is aiodat.ModelNotSupported too.  It used to be only the latter, which those clauses let
    through.  (Refused before any connection: no device needed.)"""
    from aiodat.integrations.httpx import TLSNotSupported

    async with httpx.AsyncClient(transport=RdmaHTTPTransport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol, match="no TLS over RDMA") as info:
            await client.get("https://169.254.77.1:8443/hello")
    assert isinstance(info.value, aiodat.ModelNotSupported) and isinstance(info.value, TLSNotSupported)
    assert info.value.request.url == "https://169.254.77.1:8443/hello"  # (httpx attached the request)


@pytest.mark.parametrize("scheme", ["ws", "ftp"])
async def test_another_scheme_is_unsupported_protocol_without_speaking_of_tls(scheme: str) -> None:
    """A URL of a scheme that is not HTTP (a WebSocket's ws://) is httpx.UnsupportedProtocol naming
    it, as httpx's own transport says; it raised TLSNotSupported, whose message spoke of TLS."""
    from aiodat.integrations.httpx import TLSNotSupported

    async with httpx.AsyncClient(transport=RdmaHTTPTransport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol, match=f"http:// URLs only, not {scheme}://") as info:
            await client.get(f"{scheme}://169.254.77.1:8080/hello")
    assert not isinstance(info.value, TLSNotSupported)
