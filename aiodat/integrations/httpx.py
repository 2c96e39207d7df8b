"""httpx over RDMA: an httpcore network backend on aiodat streams and an httpx transport built on it.

::

    import httpx
    from aiodat.integrations.httpx import RdmaHTTPTransport

    async with httpx.AsyncClient(transport=RdmaHTTPTransport()) as client:
        response = await client.get("http://169.254.77.1:8080/")

The client speaks HTTP/1.1 to any HTTP server that listens on an aiodat stream
server (:func:`aiodat.streams.create_server`), e.g. aiohttp's.  The URL's host
and port are the server's RDMA address and its aiodat port.  Everything httpx
does above the connection is unchanged: connection pooling and keep-alive,
streamed bodies, timeouts (``httpx.ConnectTimeout``/``ReadTimeout``/...), limits.

What differs from TCP: there is no TLS (an ``https://`` URL raises
:class:`TLSNotSupported`, an ``httpx.UnsupportedProtocol`` and an
:class:`aiodat.ModelNotSupported`), no HTTP/2 (httpcore negotiates it through
TLS ALPN only; use :mod:`aiodat.integrations.grpclib` for HTTP/2), no proxies,
no Unix sockets and no socket options.

This module imports httpx and httpcore; ``import aiodat`` does not import it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Dict, Iterable, Iterator, Optional, TypeVar

try:
    import httpcore
    import httpx
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("aiodat.integrations.httpx needs httpx and httpcore: pip install 'aiodat[httpx]'") from exc

from aiodat.errors import DATError, ModelNotSupported
from aiodat.streams import open_connection, split_kwds
from aiodat.streams.pool import check_ia_option

__all__ = ["RdmaNetworkBackend", "RdmaNetworkStream", "RdmaHTTPTransport", "TLSNotSupported"]

T = TypeVar("T")

#: the backend's default ``close_timeout`` stream option: how long a closed connection's graceful
#: close (EOF sent, disconnect), which goes on in the background, waits on a server that makes no
#: progress before it is aborted (a hung server never completes it)
CLOSE_TIMEOUT = 5.0


async def _within(awaitable: Awaitable[T], timeout: Optional[float]) -> T:
    """``await awaitable``, raising TimeoutError after ``timeout`` s (None: no limit).

    asyncio.timeout (3.11+) where there is one: wait_for would make a task for every read and write.
    """
    if timeout is None:
        return await awaitable
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)


class TLSNotSupported(httpx.UnsupportedProtocol, ModelNotSupported):
    """An ``https://`` URL given to :class:`RdmaHTTPTransport`: there is no TLS over aiodat streams.

    Both the httpx error httpx raises for a URL scheme its transport cannot serve (so
    ``except httpx.HTTPError`` / ``httpx.RequestError`` catch it, as they catch every failed
    request) and :class:`aiodat.ModelNotSupported`.
    """


class RdmaNetworkStream(httpcore.AsyncNetworkStream):
    """One aiodat stream connection, as httpcore's :class:`httpcore.AsyncNetworkStream`.

    Built by :meth:`RdmaNetworkBackend.connect_tcp`.  ``read``/``write`` map a
    timeout to ``httpcore.ReadTimeout``/``WriteTimeout`` and a lost connection to
    ``ReadError``/``WriteError`` (httpx turns them into its own exceptions).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._closed = False

    async def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` once the server has closed its side."""
        if self._closed:
            raise httpcore.ReadError("read() on a closed RDMA stream")
        try:
            return await _within(self._reader.read(max_bytes), timeout)
        except asyncio.TimeoutError as exc:
            raise httpcore.ReadTimeout(f"no data from the server within {timeout} s") from exc
        except (ConnectionError, OSError) as exc:
            raise httpcore.ReadError(f"RDMA stream lost: {exc}") from exc

    async def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        """Send ``buffer``; waits (at most ``timeout`` s) while the transport's buffer is above its high-water mark."""
        if self._closed:
            raise httpcore.WriteError("write() on a closed RDMA stream")
        if not buffer:
            return
        try:
            if self._writer.transport.is_closing():
                raise ConnectionResetError("the connection is closed")
            self._writer.write(buffer)
            await _within(self._writer.drain(), timeout)
        except asyncio.TimeoutError as exc:
            raise httpcore.WriteTimeout(f"the server did not take the request within {timeout} s") from exc
        except (ConnectionError, OSError) as exc:
            raise httpcore.WriteError(f"RDMA stream lost: {exc}") from exc

    async def aclose(self) -> None:
        """Close the connection without waiting for the server; a second call does nothing.

        Graceful (EOF, then disconnect) when everything written has been sent, completed in the
        background and aborted if the server makes no progress for ``close_timeout`` s (default
        :data:`CLOSE_TIMEOUT`); when bytes are still waiting for the peer (httpcore gave up on a
        request, e.g. after a write timeout), the connection is aborted at once instead of waiting
        for a peer that is not reading.
        """
        if self._closed:
            return
        self._closed = True
        transport = self._writer.transport
        if transport.get_write_buffer_size() > 0:
            transport.abort()
            return
        # Not awaited, as a TCP socket's close is not: httpcore closes a connection when a request
        # times out or is cancelled, and a hung server (which never answers the disconnect) would hold
        # that timeout or cancellation, and the pool's aclose() as long per connection.
        transport.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: Optional[str] = None,
                        timeout: Optional[float] = None) -> httpcore.AsyncNetworkStream:
        """Always raises :class:`aiodat.ModelNotSupported`: aiodat streams carry no TLS."""
        raise ModelNotSupported("TLS over an aiodat RDMA stream is not supported: use an http:// URL "
                                "(and no HTTPS proxy) with RdmaHTTPTransport")

    def get_extra_info(self, info: str) -> Any:
        """httpcore's keys: ``is_readable`` (the server closed or sent data while idle), ``server_addr``,
        ``client_addr``; ``ssl_object`` and ``socket`` are None; other keys go to the transport
        (``aiodat_ep``, ``aiodat_config``, ...)."""
        transport = self._writer.transport
        if info == "is_readable":
            # httpcore asks this of an idle keep-alive connection: readable (EOF, an error, or bytes the
            # server sent unasked, a 408 say) means it must not be used again, as its socket backends say
            return (self._closed or transport.is_closing() or self._reader.at_eof()
                    or self._reader.exception() is not None or len(getattr(self._reader, "_buffer", b"")) > 0)
        if info == "server_addr":
            return transport.get_extra_info("peername")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info in ("ssl_object", "socket"):
            return None
        return transport.get_extra_info(info)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<RdmaNetworkStream {state} {self._writer.transport!r}>"


class RdmaNetworkBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend whose ``connect_tcp`` opens an aiodat stream (RC over RDMA).

    ``ia`` and ``stream_options`` (``buffer_size``, ``recv_depth``,
    ``window_size``, ``rdma_threshold``, ``busy_poll_us``,
    ``close_timeout``) are passed to
    :func:`aiodat.streams.open_connection` for every connection; they are
    checked here, so a bad value fails at construction.
    ``connections_opened`` counts the connections made.
    """

    def __init__(self, *, ia: Any = None, **stream_options: Any) -> None:
        stream_options.setdefault("close_timeout", CLOSE_TIMEOUT)
        cfg, rest = split_kwds(stream_options)
        if "connect_timeout" in rest:  # (a stream option elsewhere: named, as RdmaHTTPTransport passes it on)
            raise TypeError("connect_timeout is httpx's here: each connect takes httpx's connect timeout "
                            "(httpx.Timeout(..., connect=SECONDS))")
        if rest:
            raise TypeError(f"RdmaNetworkBackend() got unexpected keyword argument(s): {', '.join(sorted(rest))}")
        check_ia_option(ia)  # (here: at a connect, httpcore would take it for a connection error, and retry)
        self._ia = ia
        self._options: Dict[str, Any] = dataclasses.asdict(cfg)
        self.connections_opened = 0

    async def connect_tcp(self, host: str, port: int, timeout: Optional[float] = None,
                          local_address: Optional[str] = None,
                          socket_options: Optional[Iterable[Any]] = None) -> RdmaNetworkStream:
        """Connect to the aiodat stream server at ``host:port`` (``timeout``: httpx's connect timeout).

        Raises ``httpcore.ConnectTimeout`` or ``httpcore.ConnectError`` (nothing listens,
        no route); ``local_address`` and ``socket_options`` are refused (an RDMA connection has no socket).
        """
        if local_address is not None:
            raise ModelNotSupported("local_address has no meaning for an RDMA connection (the IA decides)")
        if socket_options:
            raise ModelNotSupported("socket_options have no meaning for an RDMA connection (there is no socket)")
        try:  # (timeout None: httpx's "no limit", and the stream's)
            reader, writer = await asyncio.wait_for(
                open_connection(host, port, ia=self._ia, connect_timeout=timeout, **self._options), timeout)
        except asyncio.TimeoutError as exc:  # asyncio's own, and aiodat's TimeoutExpired
            raise httpcore.ConnectTimeout(f"no RDMA connection to {host}:{port} within {timeout} s") from exc
        except (ConnectionError, OSError, DATError) as exc:  # (DATError: no device, no resources...)
            raise httpcore.ConnectError(f"RDMA connection to {host}:{port} failed: {exc}") from exc
        self.connections_opened += 1
        return RdmaNetworkStream(reader, writer)

    async def connect_unix_socket(self, path: str, timeout: Optional[float] = None,
                                  socket_options: Optional[Iterable[Any]] = None) -> httpcore.AsyncNetworkStream:
        """Always raises :class:`aiodat.ModelNotSupported`: an RDMA backend has no Unix sockets."""
        raise ModelNotSupported("RdmaNetworkBackend connects over RDMA only, not to Unix sockets")

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep`` (httpcore sleeps between connect retries)."""
        await asyncio.sleep(seconds)


#: httpcore's exceptions and the httpx exceptions of the same names a request raises instead
_ERROR_NAMES = ("TimeoutException", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout",
                "NetworkError", "ConnectError", "ReadError", "WriteError", "ProxyError",
                "UnsupportedProtocol", "ProtocolError", "LocalProtocolError", "RemoteProtocolError")
_HTTPX_ERRORS: Dict[type, type] = {getattr(httpcore, name): getattr(httpx, name) for name in _ERROR_NAMES}


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    """Raise httpcore's exceptions as httpx's of the same name (the most specific one: the MRO decides).

    httpx's own transport does the same privately; this one uses only the two libraries' public
    exception classes.  Other exceptions pass through unchanged.
    """
    try:
        yield
    except Exception as exc:
        for cls in type(exc).__mro__:
            mapped = _HTTPX_ERRORS.get(cls)
            if mapped is not None:
                raise mapped(str(exc)) from exc
        raise


class _ResponseBody(httpx.AsyncByteStream):
    """httpcore's response body as httpx's ``AsyncByteStream``, its errors raised as httpx's."""

    def __init__(self, body: AsyncIterable[bytes]) -> None:
        self._body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for chunk in self._body:
                yield chunk

    async def aclose(self) -> None:
        """Release the connection back to the pool (httpcore's body knows how)."""
        aclose = getattr(self._body, "aclose", None)
        if aclose is not None:
            with _httpx_errors():
                await aclose()


class RdmaHTTPTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends HTTP/1.1 over aiodat RDMA streams.

    ``httpx.AsyncClient(transport=RdmaHTTPTransport())``: every request of the
    client goes over RDMA to the URL's host and port (an aiodat stream server).
    ``limits`` and ``retries`` mean what they mean for
    :class:`httpx.AsyncHTTPTransport`; ``ia`` and the stream options
    (``buffer_size``, ``recv_depth``, ``window_size``, ``rdma_threshold``, ``busy_poll_us``,
    ``close_timeout``) are
    passed to every connection (see :class:`RdmaNetworkBackend`).  After
    :meth:`aclose` a request raises RuntimeError.

    Built on public API only: an :class:`httpx.AsyncBaseTransport` (httpx's
    documented base for custom transports) around an
    :class:`httpcore.AsyncConnectionPool` whose ``network_backend`` is
    :class:`RdmaNetworkBackend`; requests, responses and exceptions are
    translated between the two libraries as httpx's own transport does.
    """

    def __init__(self, *, limits: Optional[httpx.Limits] = None, retries: int = 0, ia: Any = None,
                 **stream_options: Any) -> None:
        if limits is None:
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)  # httpx's defaults
        if not isinstance(limits, httpx.Limits):
            raise TypeError(f"limits must be an httpx.Limits, got {type(limits).__name__}")
        #: the :class:`RdmaNetworkBackend` every connection of the pool is opened with
        self.network_backend = RdmaNetworkBackend(ia=ia, **stream_options)
        self._connections = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True, http2=False, retries=retries,
            network_backend=self.network_backend,
        )
        self._closed = False

    @property
    def pool(self) -> httpcore.AsyncConnectionPool:
        """The httpcore connection pool (``pool.connections`` lists its connections)."""
        return self._connections

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` over an RDMA connection of the pool (httpx calls this)."""
        if self._closed:
            raise RuntimeError("RdmaHTTPTransport is closed: make a new one (or a new AsyncClient)")
        scheme = request.url.scheme
        if scheme in ("https", "wss"):
            raise TLSNotSupported(f"RdmaHTTPTransport speaks plain HTTP only (no TLS over RDMA), "
                                  f"not {scheme}://: use an http:// URL")
        if scheme != "http":  # (as httpx's own transport refuses a scheme it does not serve)
            raise httpx.UnsupportedProtocol(f"RdmaHTTPTransport serves http:// URLs only, not {scheme}://")
        if not isinstance(request.stream, httpx.AsyncByteStream):
            raise TypeError("RdmaHTTPTransport needs an async request body (use httpx.AsyncClient)")
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                             port=request.url.port, target=request.url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors():
            response = await self._connections.handle_async_request(core_request)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_ResponseBody(response.stream),  # type: ignore[arg-type]
                              extensions=response.extensions)

    async def aclose(self) -> None:
        """Close every pooled connection; the transport cannot be used afterwards."""
        self._closed = True
        with _httpx_errors():
            await self._connections.aclose()

    async def __aexit__(self, exc_type: Any = None, exc_value: Any = None, traceback: Any = None) -> None:
        """Leaving ``async with`` (the transport's or its AsyncClient's) closes it, as :meth:`aclose`."""
        await self.aclose()

    @property
    def is_closed(self) -> bool:
        """True once :meth:`aclose` was called (directly, or by leaving ``async with``)."""
        return self._closed

    def __repr__(self) -> str:
        return f"<RdmaHTTPTransport {'closed' if self._closed else 'open'} {self._connections!r}>"
