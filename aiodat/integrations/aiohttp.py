"""aiohttp over RDMA: :class:`RdmaSite` (server side) and :class:`RdmaConnector` (client side).

An aiohttp application and a ``ClientSession`` speak HTTP/1.1 (and WebSockets)
over aiodat streams with no other change.  The server side is a
``web.BaseSite`` that listens with :func:`aiodat.streams.create_server`; the
client side is an ``aiohttp.BaseConnector`` whose connections are
:func:`aiodat.streams.create_connection`.  URLs stay ``http://host:port/``:
the connector opens an RDMA stream to ``host:port``, where ``host`` is the
address of the server's RDMA device.

    runner = web.AppRunner(app)
    await runner.setup()
    site = RdmaSite(runner, "169.254.77.1", 8080)
    await site.start()

    async with aiohttp.ClientSession(connector=RdmaConnector()) as session:
        async with session.get("http://169.254.77.1:8080/") as resp:
            print(await resp.text())

aiohttp has no public hook for a site's listener or a connector's connections:
the two aiohttp internals this module relies on (a site's ``_server`` slot,
which ``BaseSite.stop()`` closes and ``runner.addresses`` reads; a connector's
``_create_connection`` hook) are used in one small place each, marked, and
checked by ``tests/test_integration_aiohttp.py::test_aiohttp_parts_we_build_on``
(tested with aiohttp 3.14.5).

aiohttp is imported by this module only (``pip install aiodat[aiohttp]``);
``import aiodat`` never needs it.  Keyword arguments the two classes do not
take themselves are aiodat stream options (``ia``, ``buffer_size``,
``recv_depth``, ``window_size``, ``rdma_threshold``, ``busy_poll_us``,
``close_timeout``, see docs/streams.md),
checked when the site or connector is made.
"""
from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional

try:
    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectorDNSError, ClientConnectorError
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.connector import BaseConnector
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("aiodat.integrations.aiohttp needs aiohttp: pip install 'aiodat[aiohttp]'") from exc

from aiodat.cm import check_port, check_timeout
from aiodat.errors import DATError, HostNotFound, InvalidParameter
from aiodat.streams import create_connection, create_server
from aiodat.streams.pool import check_ia_option
from aiodat.streams.protocol import CONFIG_KEYS, split_kwds

__all__ = ["RdmaSite", "RdmaConnector"]

#: the connector's default ``close_timeout`` stream option: how long a client connection's graceful
#: close waits on a server that makes no progress before it is aborted.  ``await session.close()``
#: waits for its connections to close, and a live server answers in milliseconds (a TCP socket's
#: close does not wait on the peer at all)
CLOSE_TIMEOUT = 1.0

# the stream options that are not StreamConfig fields but create_connection/create_server take
_CONNECT_OPTIONS = ("ia", "connect_timeout")
_SERVER_OPTIONS = ("ia", "accept_timeout")


def _stream_options(options: Dict[str, Any], own: tuple, who: str) -> Dict[str, Any]:
    """Check ``options`` now (bad sizes, unknown names) rather than at the first connection."""
    rest = {k: v for k, v in options.items() if k not in own}
    _, unknown = split_kwds(rest)
    if unknown:
        raise TypeError(f"{who} got unexpected keyword argument(s): {', '.join(sorted(unknown))} "
                        f"(aiodat stream options are {', '.join(own + CONFIG_KEYS)})")
    # (here, not at each request: there aiohttp would report them as a connection error, and retry)
    check_ia_option(options.get("ia"))
    for name in own:
        if name.endswith("_timeout"):
            check_timeout(options.get(name), name)
    return dict(options)


# -- aiohttp's internals (tested with aiohttp 3.14.5; test_aiohttp_parts_we_build_on checks them) ---------

def _set_site_server(site: "web.BaseSite", server: Any) -> None:
    """Give aiohttp the site's listener: ``BaseSite.stop()`` closes ``site._server`` and
    ``BaseRunner.addresses`` lists its sockets (aiohttp's own sites set this slot in ``start()``)."""
    site._server = server


def _site_server(site: "web.BaseSite") -> Any:
    """The listener :func:`_set_site_server` gave the site (None before ``start()``)."""
    return site._server


class RdmaSite(web.BaseSite):
    """A ``web.BaseSite`` serving an ``AppRunner``'s application over aiodat RDMA streams.

    ``host`` is the address of an RDMA device (None: the default device);
    ``port`` 0 asks for a free port (read it back from :attr:`port` or
    ``runner.addresses`` after ``start()``).  ``**options`` are aiodat stream
    options (``ia``, ``accept_timeout``, ``buffer_size``, ``recv_depth``,
    ``window_size``, ``rdma_threshold``, ``busy_poll_us``,
    ``close_timeout``).
    """

    __slots__ = ("_host", "_port", "_bound_port", "_options", "_rdma_runner", "_rdma_backlog")

    def __init__(self, runner: "web.BaseRunner", host: Optional[str] = None, port: int = 8080, *,
                 backlog: int = 128, **options: Any) -> None:
        check_port(port)
        checked = _stream_options(options, _SERVER_OPTIONS, "RdmaSite()")
        super().__init__(runner, backlog=backlog)
        self._rdma_runner = runner
        self._rdma_backlog = backlog
        self._host = host
        self._port = port
        self._bound_port: Optional[int] = None
        self._options = checked

    @property
    def port(self) -> int:
        """The port listened on once started (the requested one before)."""
        return self._bound_port if self._bound_port is not None else self._port

    @property
    def name(self) -> str:
        """``http://host:port`` (the scheme aiohttp prints; the transport is RDMA)."""
        server = _site_server(self)
        host = self._host or (server.sockets[0].getsockname()[0] if server is not None and server.sockets
                              else "0.0.0.0")  # (no sockets once stopped)
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Listen: the runner's server becomes the protocol factory of an aiodat stream server."""
        await super().start()
        factory = self._rdma_runner.server
        if factory is None:
            raise RuntimeError("the runner is not set up (or was cleaned up): call runner.setup() first")
        server = await create_server(factory, self._host, self._port, backlog=self._rdma_backlog,
                                     **self._options)
        _set_site_server(self, server)
        self._bound_port = server.sockets[0].getsockname()[1]


class RdmaConnector(BaseConnector):
    """An ``aiohttp.BaseConnector`` whose connections are aiodat RDMA streams to the URL's ``host:port``.

    ``http://`` URLs only (there is no TLS over aiodat streams; ``https://``
    raises ``ClientConnectorError``).  ``limit``, ``limit_per_host``,
    ``keepalive_timeout`` and ``force_close`` are BaseConnector's; ``**options``
    are aiodat stream options (``ia``, ``connect_timeout``, ``buffer_size``,
    ``recv_depth``, ``window_size``, ``rdma_threshold``, ``busy_poll_us``,
    ``close_timeout``).  A connection that
    cannot be made raises ``aiohttp.ClientConnectorError`` wrapping the aiodat
    error (``ConnectionRefusedError`` when nothing listens), as TCP's does; a host
    name that does not resolve raises ``aiohttp.ClientConnectorDNSError``.  A
    connection whose graceful close waits more than ``close_timeout`` s (default
    :data:`CLOSE_TIMEOUT`) on a server that makes no progress (a hung server) is aborted.
    """

    def __init__(self, *, limit: int = 100, limit_per_host: int = 0, keepalive_timeout: Any = None,
                 force_close: bool = False, **options: Any) -> None:
        kwargs: Dict[str, Any] = {"limit": limit, "limit_per_host": limit_per_host, "force_close": force_close}
        if keepalive_timeout is not None:
            kwargs["keepalive_timeout"] = keepalive_timeout
        self._options = _stream_options(options, _CONNECT_OPTIONS, "RdmaConnector()")
        super().__init__(**kwargs)

    async def _create_connection(self, req: Any, traces: List[Any], timeout: Any) -> Any:
        """aiohttp's (private) hook for a new connection, aiohttp 3.14.5: an aiodat stream to the URL's host."""
        return await self._rdma_connect(req, timeout)

    async def _rdma_connect(self, req: Any, timeout: Any) -> Any:
        # (OSError(None, message): ClientConnectorError shows the strerror, which a bare OSError lacks)
        if req.is_ssl():
            raise ClientConnectorError(req.connection_key, OSError(
                None, "aiodat streams carry plain HTTP only: use an http:// URL with RdmaConnector"))
        if req.proxy is not None:  # (not ignored: the request, and any Proxy-Authorization, would go to the origin)
            raise ClientConnectorError(req.connection_key, OSError(
                None, f"RdmaConnector connects to the URL's host itself and cannot go through a proxy ({req.proxy})"))
        options = dict(self._options)
        options.setdefault("close_timeout", CLOSE_TIMEOUT)
        # (aiohttp reads sock_connect 0 or None as no limit: so does the stream's connect_timeout None)
        options.setdefault("connect_timeout", timeout.sock_connect or None)
        try:
            loop = asyncio.get_running_loop()
            _, proto = await create_connection(lambda: ResponseHandler(loop), req.host, req.port, **options)
        except asyncio.TimeoutError:
            raise  # the session turns it into ConnectionTimeoutError, as for TCP
        except HostNotFound as exc:  # (a failed lookup: what TCPConnector raises for one)
            raise ClientConnectorDNSError(req.connection_key, _as_os_error(exc)) from exc
        except (OSError, DATError) as exc:
            raise ClientConnectorError(req.connection_key, _as_os_error(exc)) from exc
        return proto


def _as_os_error(exc: BaseException) -> OSError:
    """ClientConnectorError formats ``os_error.strerror``: give aiodat's errors one (a message, not None)."""
    if not isinstance(exc, OSError):
        wrapped = OSError(None, str(exc))
        wrapped.__cause__ = exc
        return wrapped
    if exc.strerror is None or isinstance(exc, DATError):  # (a DATError's strerror may be "Unknown error -2")
        exc.strerror = str(exc)
    return exc
