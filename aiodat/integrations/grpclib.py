"""gRPC over RDMA: grpclib's server and channel with aiodat streams underneath (HTTP/2 over RC).

::

    from aiodat.integrations.grpclib import RdmaChannel, RdmaServer

    server = RdmaServer([Greeter()])                  # grpclib.server.Server's arguments
    await server.start("169.254.77.1", 50051)          # listens on the RDMA device's address
    ...
    async with RdmaChannel("169.254.77.1", 50051) as channel:
        reply = await GreeterStub(channel).SayHello(HelloRequest(name="rdma"))

:class:`RdmaServer` is a :class:`grpclib.server.Server` and :class:`RdmaChannel`
a :class:`grpclib.client.Channel`: services, generated stubs, codecs, metadata,
deadlines, status errors, events and health checks all work unchanged.  Only the
connection differs: grpclib's HTTP/2 protocol (``H2Protocol``) runs on an
:class:`aiodat.streams.RdmaTransport`, made by
:func:`aiodat.streams.create_server` / :func:`aiodat.streams.create_connection`
where grpclib would call ``loop.create_server`` / ``loop.create_connection``.

grpclib has no public way to give its server a listener or its channel a
connection of another kind.  So the server side is built from grpclib's
public-named parts (``grpclib.server.Handler`` per connection and
``grpclib.protocol.H2Protocol``, as ``grpclib.server.Server`` assembles them)
and keeps its own listener and connections; the channel overrides the one
private hook grpclib has for it, ``Channel._create_connection``.  Every such
touch point is in the "grpclib's parts" section below, tested with grpclib
0.4.9; ``tests/test_integration_grpclib.py::test_grpclib_parts_we_build_on``
fails, naming the part, when an upgrade moves one.

What differs from TCP: no TLS (``ssl=`` is refused), no Unix sockets, the
server listens on one RDMA address (not every interface), and
:meth:`RdmaServer.wait_closed` also closes the connections clients still hold
once the cancelled handlers have finished (an aiodat server waits for its
connections, as asyncio's does from Python 3.12 on).  A closed
:class:`RdmaChannel` refuses new calls instead of reconnecting.

This module imports grpclib; ``import aiodat`` does not import it.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Collection, Dict, Optional, Set, Tuple

try:
    import grpclib.client
    import grpclib.server
    from grpclib.config import Configuration
    from grpclib.encoding.base import CodecBase, StatusDetailsCodecBase
    from grpclib.encoding.proto import ProtoCodec, ProtoStatusDetailsCodec
    from grpclib.protocol import H2Protocol
    from h2.config import H2Configuration
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("aiodat.integrations.grpclib needs grpclib: pip install 'aiodat[grpclib]'") from exc

from aiodat.cm import check_port, check_timeout
from aiodat.errors import InvalidAddress, ModelNotSupported
from aiodat.streams import ListenSocket, RdmaTransport, Server, create_connection, create_server, split_kwds
from aiodat.streams.pool import check_ia_option

__all__ = ["RdmaServer", "RdmaChannel"]

#: a channel's default ``close_timeout`` stream option: how long its connection's graceful close
#: (EOF, then disconnect), which goes on in the background, waits on a server that makes no progress
#: before it is aborted (a hung server never answers the disconnect)
CLOSE_TIMEOUT = 5.0


def _stream_options(owner: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The validated StreamConfig fields of ``options`` (InvalidParameter / TypeError name the bad one)."""
    cfg, rest = split_kwds(options)
    if rest:
        raise TypeError(f"{owner} got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    return dataclasses.asdict(cfg)


# -- grpclib's parts (tested with grpclib 0.4.9; test_grpclib_parts_we_build_on checks each) -------------
# The public-named classes grpclib's own Server and Channel assemble a connection from, with the
# arguments they pass; and the codec defaults they choose.

def _h2_config(client_side: bool) -> H2Configuration:
    """The h2 settings grpclib's H2Protocol expects (those grpclib's Server and Channel use): str headers."""
    return H2Configuration(client_side=client_side, header_encoding="ascii",
                           validate_inbound_headers=False, validate_outbound_headers=False,
                           normalize_inbound_headers=False, normalize_outbound_headers=False)


def _default_codecs(codec: Optional[CodecBase], status_details_codec: Optional[StatusDetailsCodecBase]
                    ) -> Tuple[CodecBase, Optional[StatusDetailsCodecBase]]:
    """grpclib's defaults: protobuf, and protobuf status details when googleapis-common-protos is there."""
    if codec is None:
        codec = ProtoCodec()
        if status_details_codec is None:
            try:
                import google.rpc.status_pb2  # noqa: F401
            except ImportError:
                pass
            else:
                status_details_codec = ProtoStatusDetailsCodec()
    return codec, status_details_codec


def _server_protocol(handler: grpclib.server.Handler, config: Configuration) -> H2Protocol:
    """One server connection's protocol: grpclib's HTTP/2 protocol around ``handler`` (one per connection)."""
    return H2Protocol(handler, config, _h2_config(client_side=False))


def _client_protocol(config: Configuration) -> H2Protocol:
    """A channel's connection protocol, as grpclib's Channel makes it."""
    return H2Protocol(grpclib.client.Handler(), config, _h2_config(client_side=True))


# -- the server ---------------------------------------------------------------------------------------

class RdmaServer(grpclib.server.Server):
    """A grpclib server whose connections are aiodat RDMA streams.

    Constructed exactly as :class:`grpclib.server.Server` (``handlers``, ``codec``,
    ``status_details_codec``, ``config``); :meth:`start` listens on an RDMA address.
    Events (``grpclib.events.listen(server, ...)``), ``async with`` and
    ``grpclib.utils.graceful_exit`` work as for grpclib's server.
    """

    def __init__(self, handlers: Collection[Any], *, codec: Optional[CodecBase] = None,
                 status_details_codec: Optional[StatusDetailsCodecBase] = None,
                 config: Optional[Configuration] = None) -> None:
        codec, status_details_codec = _default_codecs(codec, status_details_codec)
        super().__init__(handlers, codec=codec, status_details_codec=status_details_codec, config=config)
        mapping: Dict[str, Any] = {}
        for servable in handlers:  # grpclib's service protocol: generated bases define __mapping__
            mapping.update(servable.__mapping__())
        self._rdma_mapping = mapping
        self._rdma_codec = codec
        self._rdma_status_details_codec = status_details_codec
        self._rdma_config = (Configuration() if config is None else config).__for_server__()
        self._rdma_listener: Optional[Server] = None
        self._rdma_close_called: Optional[asyncio.Event] = None
        self._rdma_handlers: Set[grpclib.server.Handler] = set()
        self._rdma_close_timeout: Optional[float] = None  # (start() sets it)

    def _rdma_new_connection(self) -> H2Protocol:
        """The listener's protocol factory: a grpclib Handler (this server's services) per connection."""
        # forget the handlers of connections that are over (their handlers are closed and idle)
        self._rdma_handlers = {h for h in self._rdma_handlers if not (h.closing and h.check_closed())}
        handler = grpclib.server.Handler(self._rdma_mapping, self._rdma_codec, self._rdma_status_details_codec,
                                         self.__dispatch__)
        self._rdma_handlers.add(handler)
        return _server_protocol(handler, self._rdma_config)

    async def start(self, host: Optional[str] = None, port: Optional[int] = None, *,
                    backlog: int = 100, ssl: Any = None, ia: Any = None, close_timeout: Optional[float] = 10.0,
                    accept_timeout: Optional[float] = 30.0, **stream_options: Any) -> None:
        """Listen on ``host:port`` over RDMA (``port`` 0 or None: a free port, see :attr:`sockets`).

        ``host`` is the address of an RDMA device (None: the default device).
        ``ia`` and the stream options (``buffer_size``, ``recv_depth``,
        ``window_size``, ``rdma_threshold``, ``busy_poll_us``) are those of
        :func:`aiodat.streams.create_server`.  ``ssl`` must be None.
        ``close_timeout``: how long :meth:`wait_closed` lets the clients'
        connections send what they hold and close before it drops them
        (None: as long as it takes); it is also each connection's
        ``close_timeout`` stream option.  ``accept_timeout``: how long a
        client's connection may take to be established (None: no bound).
        """
        if ssl is not None:
            raise ModelNotSupported("TLS over an aiodat RDMA stream is not supported: start RdmaServer without ssl")
        if self._rdma_listener is not None:
            raise RuntimeError("Server is already started")
        self._rdma_close_timeout = check_timeout(close_timeout, "close_timeout")
        options = _stream_options("RdmaServer.start()", dict(stream_options, close_timeout=close_timeout))
        self._rdma_listener = await create_server(self._rdma_new_connection, host, port, ia=ia, backlog=backlog,
                                                  accept_timeout=accept_timeout, **options)
        self._rdma_close_called = asyncio.Event()

    @property
    def sockets(self) -> Tuple[ListenSocket, ...]:
        """The listening socket (``sockets[0].getsockname()`` is ``(address, port)``); empty when not listening."""
        if self._rdma_listener is None:
            return ()
        return tuple(self._rdma_listener.sockets or ())

    def close(self) -> None:
        """Stop listening and cancel the running handlers (they may handle CancelledError), as grpclib's."""
        if self._rdma_listener is None or self._rdma_close_called is None:
            raise RuntimeError("Server is not started")
        self._rdma_listener.close()
        self._rdma_close_called.set()
        for handler in self._rdma_handlers:
            handler.close()

    async def wait_closed(self) -> None:
        """After :meth:`close`: wait for the cancelled handlers, then close the clients' connections and wait
        until they are closed; those still open after ``close_timeout`` (see :meth:`start`) are dropped."""
        if self._rdma_listener is None or self._rdma_close_called is None:
            raise RuntimeError("Server is not started")
        await self._rdma_close_called.wait()
        if self._rdma_handlers:
            await asyncio.wait({asyncio.ensure_future(h.wait_closed()) for h in self._rdma_handlers})
        listener = self._rdma_listener
        listener.close_clients()
        # A graceful close sends what the connection holds first; a client that stops reading (and so
        # returns no credits) would hold this wait for ever.
        closed = asyncio.ensure_future(listener.wait_closed())
        await asyncio.wait({closed}, timeout=self._rdma_close_timeout)
        if not closed.done():
            listener.abort_clients()
            await closed

    def __repr__(self) -> str:
        where = self.sockets[0].getsockname() if self.sockets else "not listening"
        return f"<RdmaServer {where}>"


# -- the channel --------------------------------------------------------------------------------------

class RdmaChannel(grpclib.client.Channel):
    """A grpclib channel whose connection is an aiodat RDMA stream to ``host:port``.

    ``codec``, ``status_details_codec`` and ``config`` as for
    :class:`grpclib.client.Channel`; ``ia``, ``connect_timeout`` and the stream
    options as for :func:`aiodat.streams.create_connection`.  The connection is
    made at the first call (as grpclib does).  After :meth:`close` a call raises
    RuntimeError; the connection's graceful close goes on in the background and is
    aborted if the server makes no progress for ``close_timeout`` s (default
    :data:`CLOSE_TIMEOUT`).
    """

    def __init__(self, host: str, port: int, *, codec: Optional[CodecBase] = None,
                 status_details_codec: Optional[StatusDetailsCodecBase] = None,
                 config: Optional[Configuration] = None, ia: Any = None,
                 connect_timeout: Optional[float] = 30.0,
                 **stream_options: Any) -> None:
        if not isinstance(host, str) or not host:
            raise InvalidAddress(f"RdmaChannel needs the server's RDMA address as host, got {host!r}")
        check_port(port, lowest=1)
        if stream_options.get("ssl") not in (None, False):
            raise ModelNotSupported("TLS over an aiodat RDMA stream is not supported: RdmaChannel has no ssl")
        stream_options.setdefault("close_timeout", CLOSE_TIMEOUT)
        self._rdma_options = _stream_options("RdmaChannel()", stream_options)
        check_ia_option(ia)  # (here, not at the first call)
        check_timeout(connect_timeout, "connect_timeout")
        self._rdma_address = (host, port)
        self._rdma_ia = ia
        self._rdma_config = (Configuration() if config is None else config).__for_client__()
        self._rdma_connect_timeout = connect_timeout
        self._rdma_closed = False
        # the connection made last
        self._rdma_transport: Optional[RdmaTransport] = None
        super().__init__(host, port, codec=codec, status_details_codec=status_details_codec, config=config)

    async def _create_connection(self) -> H2Protocol:
        """grpclib's (private) hook for making the connection, grpclib 0.4.9: an aiodat stream instead of
        ``loop.create_connection``.  The one private name this module uses."""
        return await self._rdma_connect()

    async def _rdma_connect(self) -> H2Protocol:
        if self._rdma_closed:
            raise RuntimeError("RdmaChannel is closed: make a new channel")
        host, port = self._rdma_address
        transport, protocol = await create_connection(lambda: _client_protocol(self._rdma_config), host, port,
                                                      ia=self._rdma_ia, connect_timeout=self._rdma_connect_timeout,
                                                      **self._rdma_options)
        if self._rdma_closed:  # closed while connecting: grpclib would keep the connection, and use it
            transport.close()
            raise RuntimeError("RdmaChannel was closed while it connected: make a new channel")
        self._rdma_transport = transport
        return protocol  # type: ignore[return-value]

    def close(self) -> None:
        """Close the connection (without waiting); the channel cannot be used afterwards."""
        self._rdma_closed = True
        super().close()  # (grpclib closes the connection's transport)
        made, self._rdma_transport = self._rdma_transport, None
        if made is not None:
            made.close()

    @property
    def is_closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._rdma_closed

    def __repr__(self) -> str:
        host, port = self._rdma_address
        return f"RdmaChannel({host!r}, {port!r}{', closed' if self._rdma_closed else ''})"

