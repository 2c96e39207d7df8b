"""asyncio streams over RDMA: ``open_connection`` / ``start_server`` with asyncio's own objects.

``reader, writer = await aiodat.open_connection(host, port)`` and ``server =
await aiodat.start_server(cb, host, port)`` have the signatures of their
asyncio namesakes and return the very same classes: :class:`asyncio.StreamReader`,
:class:`asyncio.StreamWriter` and a :class:`Server` with asyncio.Server's
methods.  Only the transport underneath differs: :class:`RdmaTransport`, an
:class:`asyncio.Transport` that carries the byte stream over one RC endpoint.
:func:`create_connection` / :func:`create_server` are the protocol-level forms
(``loop.create_connection`` / ``loop.create_server``), for code written
against :class:`asyncio.Protocol`.

The wire protocol (docs/streams.md has the full description):

* each side registers, per connection, ``recv_depth + extra`` receive slots and
  as many send slots of ``buffer_size`` bytes, a receive *window* of
  ``window_size`` bytes the peer may RDMA-write into, and a staging buffer of
  the same size for its own large writes;
* the connect / accept private data carries the parameters
  (:data:`PARAMS`: magic, version, flags, receive credits, slot size, window);
* every message is one send of an 8-byte header (:data:`HEADER`: type, flags,
  credits returned, payload length) and, for DATA, the payload;
* a side may send DATA, WINDOW or EOF only while it holds a credit (one per
  receive slot the peer has posted); receivers return credits in the header
  of every message, or in a CREDIT message once ``recv_depth // 2`` are owed;
  CREDIT messages use the ``extra`` reserved slots, so they never need credits
  and the two sides cannot deadlock;
* when at least ``rdma_threshold`` bytes are pending and the peer's window is
  free, the bytes are RDMA-written into the window and a WINDOW message says
  how many; the peer copies them out and hands the window back with the
  RELEASE flag.  The QP keeps everything in order.
* A slow reader stops returning credits (the StreamReader pauses the transport
  past twice its limit), so the writer's buffer grows and ``drain()`` blocks
  past the high-water mark: nothing is lost or reordered.

The package, top down (imports point down only):

* :mod:`aiodat.streams.server`: :class:`Server`, :class:`ListenSocket`, ``create_server``, ``start_server``;
* :mod:`aiodat.streams.transport`: :class:`RdmaTransport` (the posting and the waiting),
  ``create_connection``, ``open_connection``;
* :mod:`aiodat.streams.pool`: the IAs streams share, one per (event loop, device, address), and
  which device serves a host;
* :mod:`aiodat.streams.protocol`: the wire protocol as a sans-IO state machine
  (:class:`~aiodat.streams.protocol.StreamCore`): credits, slots, the window, headers, the
  connection parameters.  No asyncio, no device.
"""
from __future__ import annotations

from aiodat.streams.pool import (
    PROVIDER_CACHE_SECONDS,
    IAPool,
    IARef,
    _IAPool,
    _IARef,
    _POOL,
    _active_providers,
    _device_for,
    device_for,
    shared_ia_count,
)
from aiodat.streams.protocol import (
    DEFAULT_LIMIT,
    FLAG_RELEASE,
    FLAG_WRAP,
    HEADER,
    MAGIC,
    MAX_WINDOWS,
    MSG_CREDIT,
    MSG_DATA,
    MSG_EOF,
    MSG_WINDOW,
    PARAM_WINDOW,
    PARAMS,
    RELEASE_MASK,
    VERSION,
    PeerParams,
    StreamConfig,
    StreamCore,
    StreamProtocolError,
    parse_params,
    split_kwds,
)
from aiodat.streams.server import ListenSocket, Server, create_server, start_server
from aiodat.streams.transport import RdmaTransport, Resources, create_connection, open_connection

# private names streams.py had, kept importable for code that used them
_split_kwds = split_kwds
_parse_params = parse_params
_PeerParams = PeerParams
_Resources = Resources

__all__ = [
    "open_connection", "start_server", "create_connection", "create_server", "StreamConfig",
    "RdmaTransport", "Server", "ListenSocket", "HEADER", "PARAMS", "shared_ia_count", "StreamCore",
    "StreamProtocolError",
]
