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
from typing import Any, Collection, Dict, Optional, Tuple

import grpclib.client
import grpclib.server
from grpclib.config import Configuration
from grpclib.encoding.base import CodecBase, StatusDetailsCodecBase
from grpclib.protocol import H2Protocol

from aiodat.errors import InvalidAddress, ModelNotSupported
from aiodat.streams import ListenSocket, create_connection, create_server, split_kwds

__all__ = ["RdmaServer", "RdmaChannel"]


def _stream_options(owner: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The validated StreamConfig fields of ``options`` (InvalidParameter / TypeError name the bad one)."""
    cfg, rest = split_kwds(options)
    if rest:
        raise TypeError(f"{owner} got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    return dataclasses.asdict(cfg)


class RdmaServer(grpclib.server.Server):
    """A grpclib server whose connections are aiodat RDMA streams.

    Constructed exactly as :class:`grpclib.server.Server` (``handlers``, ``codec``,
    ``status_details_codec``, ``config``); :meth:`start` listens on an RDMA address.
    """

    def __init__(self, handlers: Collection[Any], *, codec: Optional[CodecBase] = None,
                 status_details_codec: Optional[StatusDetailsCodecBase] = None,
                 config: Optional[Configuration] = None) -> None:
        super().__init__(handlers, codec=codec, status_details_codec=status_details_codec, config=config)

    async def start(self, host: Optional[str] = None, port: Optional[int] = None, *,  # type: ignore[override]
                    backlog: int = 100, ssl: Any = None, ia: Any = None, **stream_options: Any) -> None:
        """Listen on ``host:port`` over RDMA (``port`` 0 or None: a free port, see :attr:`sockets`).

        ``host`` is the address of an RDMA device (None: the default device).
        ``ia`` and the stream options (``buffer_size``, ``recv_depth``,
        ``window_size``, ``rdma_threshold``) are those of
        :func:`aiodat.streams.create_server`.  ``ssl`` must be None.
        """
        if ssl is not None:
            raise ModelNotSupported("TLS over an aiodat RDMA stream is not supported: start RdmaServer without ssl")
        if self._server is not None:
            raise RuntimeError("Server is already started")
        options = _stream_options("RdmaServer.start()", stream_options)
        self._server = await create_server(self._protocol_factory, host, port, ia=ia,  # type: ignore[assignment]
                                           backlog=backlog, **options)
        self._server_closed_fut = self._loop.create_future()

    @property
    def sockets(self) -> Tuple[ListenSocket, ...]:
        """The listening socket (``sockets[0].getsockname()`` is ``(address, port)``); empty when not listening."""
        if self._server is None:
            return ()
        return tuple(self._server.sockets or ())

    async def wait_closed(self) -> None:
        """After :meth:`close`: wait for the cancelled handlers, then close the clients' connections and wait
        until they are closed."""
        if self._server is None or self._server_closed_fut is None:
            raise RuntimeError("Server is not started")
        await self._server_closed_fut
        if self._handlers:
            await asyncio.wait({self._loop.create_task(h.wait_closed()) for h in self._handlers})
        self._server.close_clients()  # type: ignore[attr-defined]
        await self._server.wait_closed()

    def __repr__(self) -> str:
        where = self.sockets[0].getsockname() if self.sockets else "not listening"
        return f"<RdmaServer {where}>"


class RdmaChannel(grpclib.client.Channel):
    """A grpclib channel whose connection is an aiodat RDMA stream to ``host:port``.

    ``codec``, ``status_details_codec`` and ``config`` as for
    :class:`grpclib.client.Channel`; ``ia``, ``connect_timeout`` and the stream
    options as for :func:`aiodat.streams.create_connection`.  The connection is
    made at the first call (as grpclib does).  After :meth:`close` a call raises
    RuntimeError.
    """

    def __init__(self, host: str, port: int, *, codec: Optional[CodecBase] = None,
                 status_details_codec: Optional[StatusDetailsCodecBase] = None,
                 config: Optional[Configuration] = None, ia: Any = None, connect_timeout: float = 30.0,
                 **stream_options: Any) -> None:
        if not isinstance(host, str) or not host:
            raise InvalidAddress(f"RdmaChannel needs the server's RDMA address as host, got {host!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 0xFFFF:
            raise InvalidAddress(f"RdmaChannel needs a port between 1 and 65535, got {port!r}")
        if stream_options.get("ssl") not in (None, False):
            raise ModelNotSupported("TLS over an aiodat RDMA stream is not supported: RdmaChannel has no ssl")
        self._rdma_options = _stream_options("RdmaChannel()", stream_options)
        self._rdma_ia = ia
        self._connect_timeout = connect_timeout
        self._closed = False
        super().__init__(host, port, codec=codec, status_details_codec=status_details_codec, config=config)

    async def _create_connection(self) -> H2Protocol:
        """grpclib's hook for making the connection: an aiodat stream instead of ``loop.create_connection``."""
        if self._closed:
            raise RuntimeError("RdmaChannel is closed: make a new channel")
        _, protocol = await create_connection(self._protocol_factory, self._host, self._port, ia=self._rdma_ia,
                                              connect_timeout=self._connect_timeout, **self._rdma_options)
        return protocol  # type: ignore[return-value]

    def close(self) -> None:
        """Close the connection; the channel cannot be used afterwards."""
        self._closed = True
        super().close()

    @property
    def is_closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def __repr__(self) -> str:
        return f"RdmaChannel({self._host!r}, {self._port!r}{', closed' if self._closed else ''})"
