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
"""
from __future__ import annotations

import asyncio
import collections
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from aiodat.errors import (
    ConnectionBroken,
    DATError,
    InvalidAddress,
    InvalidParameter,
    ModelNotSupported,
    ProviderNotFound,
)
from aiodat.cm import resolve_host
from aiodat.netdev import same_address

__all__ = [
    "open_connection", "start_server", "create_connection", "create_server", "StreamConfig",
    "RdmaTransport", "Server", "ListenSocket", "HEADER", "PARAMS",
]

#: asyncio's default StreamReader limit
DEFAULT_LIMIT = 2 ** 16

#: message header, network order: type (B), flags (B), credits returned (H), payload length (I)
HEADER = struct.Struct("!BBHI")
#: connection parameters in the connect/accept private data: magic, version, flags, recv credits,
#: slot size; followed by the window's RemoteRegion (20 bytes) when flags has PARAM_WINDOW
PARAMS = struct.Struct("!2sBBHI")
MAGIC = b"AS"
VERSION = 1
PARAM_WINDOW = 0x01

MSG_DATA = 1  #: payload follows the header in the same send
MSG_WINDOW = 2  #: ``length`` bytes were RDMA-written at the start of the receiver's window
MSG_CREDIT = 3  #: credits (and/or the RELEASE flag) only; consumes no credit
MSG_EOF = 4  #: the sender will send no more data (write_eof / close)
FLAG_RELEASE = 0x01  #: the sender has consumed the receiver's last WINDOW write: the window is free again


@dataclass(frozen=True)
class StreamConfig:
    """Per-connection buffer sizes of an aiodat stream (keyword arguments of open_connection/start_server).

    ``buffer_size``: bytes per send/receive slot (header included), so the
    largest DATA message; ``recv_depth``: receive slots posted for data, i.e.
    the credits granted to the peer; ``window_size``: the registered receive
    window for RDMA writes (0 disables the large-message path);
    ``rdma_threshold``: pending bytes from which the writer uses the window
    instead of sends.
    """

    buffer_size: int = 16384
    recv_depth: int = 16
    window_size: int = 262144
    rdma_threshold: int = 65536

    def validate(self) -> "StreamConfig":
        """Return self, or raise InvalidParameter naming the bad value."""
        checks = (("buffer_size", 64, 1 << 20), ("recv_depth", 4, 4096), ("rdma_threshold", 1, 1 << 40))
        for name, low, high in checks:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidParameter(f"{name} must be an int between {low} and {high}, got {value!r}")
        w = self.window_size
        if not isinstance(w, int) or isinstance(w, bool) or not (w == 0 or 4096 <= w <= 1 << 30):
            raise InvalidParameter(f"window_size must be 0 or an int between 4096 and 2**30, got {w!r}")
        return self

    @property
    def credit_threshold(self) -> int:
        """Owed credits that trigger a CREDIT message when there is no data to carry them."""
        return max(2, self.recv_depth // 2)

    @property
    def extra_slots(self) -> int:
        """Receive slots beyond the credits, for CREDIT messages (which need no credit)."""
        return self.recv_depth // self.credit_threshold + 2


_CONFIG_KEYS = ("buffer_size", "recv_depth", "window_size", "rdma_threshold")
# keyword arguments of loop.create_connection / create_server that have no meaning here: accepted when
# left at their "off" value, refused otherwise
_IGNORABLE = {"ssl": (None, False), "sock": (None,), "local_addr": (None,), "server_hostname": (None,),
              "ssl_handshake_timeout": (None,), "ssl_shutdown_timeout": (None,), "happy_eyeballs_delay": (None,),
              "interleave": (None,), "family": (0, socket.AF_INET, socket.AF_INET6, socket.AF_UNSPEC), "proto": (0,),
              "flags": (0, socket.AI_PASSIVE), "reuse_address": (None, True, False), "reuse_port": (None, False),
              "all_errors": (False,)}


def _split_kwds(kwds: Dict[str, Any]) -> Tuple[StreamConfig, Dict[str, Any]]:
    cfg = {k: kwds.pop(k) for k in _CONFIG_KEYS if k in kwds}
    for name, value in list(kwds.items()):
        if name in _IGNORABLE:
            if value not in _IGNORABLE[name]:
                raise ModelNotSupported(f"aiodat streams do not support {name}={value!r} "
                                        f"(RDMA connections have no sockets, TLS or address families)")
            del kwds[name]
    return StreamConfig(**cfg).validate(), kwds


# --------------------------------------------------------------------------------------------
# The IA of a device is shared by every stream of the process


class _IAPool:
    """One IA per device and address per process, shared by all streams and closed with the last of them."""

    def __init__(self) -> None:
        self._entries: Dict[Tuple[str, Optional[str]], List[Any]] = {}

    def acquire(self, name: str, address: Optional[str] = None) -> Any:
        from aiodat.ia import open_ia

        entry = self._entries.get((name, address))
        if entry is None or entry[0].closed:
            entry = self._entries[(name, address)] = [open_ia(name, address=address), 0]
        entry[1] += 1
        return entry[0]

    def addref(self, ia: Any) -> None:
        for entry in self._entries.values():
            if entry[0] is ia:
                entry[1] += 1

    def release(self, ia: Any) -> None:
        for name, entry in list(self._entries.items()):
            if entry[0] is ia:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._entries[name]
                    ia.close()
                return

    def open_count(self) -> int:
        """How many shared IAs are open (0 once every stream and server is closed)."""
        return sum(1 for entry in self._entries.values() if not entry[0].closed)


_POOL = _IAPool()


def shared_ia_count() -> int:
    """How many per-device IAs the streams of this process hold open now (for leak checks)."""
    return _POOL.open_count()


#: how long the device and address list is reused before it is read again (a host that no
#: device has also reads it again at once)
PROVIDER_CACHE_SECONDS = 5.0
_providers_cache: Tuple[float, List[Any]] = (-PROVIDER_CACHE_SECONDS, [])


def _active_providers(refresh: bool = False) -> List[Any]:
    """The active device ports with addresses, cached: reading them opens every device."""
    global _providers_cache
    from aiodat.ia import list_providers

    now = time.monotonic()
    if refresh or now - _providers_cache[0] > PROVIDER_CACHE_SECONDS:
        _providers_cache = (now, [p for p in list_providers() if p.state == "PORT_ACTIVE" and p.addresses])
    return list(_providers_cache[1])


def _device_for(host: Optional[str], listening: bool = False) -> Tuple[str, Optional[str]]:
    """(device, address) for ``host``: the device that has that address, else one with an address of
    the same family ($AIODAT_RXE_DEVICE first).  A server (``listening``) must name a device's own address."""
    candidates = _active_providers()
    if host and not any(same_address(a, host) for p in candidates for a in p.addresses):
        candidates = _active_providers(refresh=True)  # an address may have been added since
    for p in candidates:
        for addr in p.addresses:
            if host and same_address(addr, host):
                return p.name, addr
    if listening and host:
        known = ", ".join(a for p in candidates for a in p.addresses) or "none"
        raise InvalidAddress(f"cannot listen on {host}: no RDMA device has that address (an aiodat server "
                             f"listens on a device's address; the devices have: {known})")
    family6 = bool(host) and ":" in str(host)
    env = os.environ.get("AIODAT_RXE_DEVICE")
    candidates.sort(key=lambda p: p.name != env)
    for p in candidates:
        for addr in p.addresses:
            if (":" in addr) == family6:
                return p.name, (None if addr == p.addresses[0] else addr)
    if env:
        return env, None
    raise ProviderNotFound("no active RDMA device with an IP address%s; aiodat streams need one "
                           "(run under `aiodat rxe run -- ...` for Soft-RoCE)" % (" of that family" if candidates else ""))


class _IARef:
    """The IA a connection or server uses: pooled (by device name) or the caller's own IA object."""

    def __init__(self, ia: Any, host: Optional[str], listening: bool = False) -> None:
        from aiodat.ia import IA

        if isinstance(ia, IA):
            ia._check()
            self.ia, self._pooled = ia, False
        else:
            if ia is not None and not isinstance(ia, str):
                raise InvalidParameter(f"ia must be None, a device name or an aiodat.IA, not {type(ia).__name__}")
            if ia is None:
                self.ia = _POOL.acquire(*_device_for(host, listening))
            else:
                self.ia = _POOL.acquire(ia, host if listening else None)
            self._pooled = True
        self._released = False

    def share(self) -> "_IARef":
        """Another reference to the same IA (pooled IAs count it)."""
        ref = _IARef.__new__(_IARef)
        ref.ia, ref._pooled, ref._released = self.ia, self._pooled, False
        if self._pooled:
            _POOL.addref(self.ia)
        return ref

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._pooled:
                _POOL.release(self.ia)


# --------------------------------------------------------------------------------------------
# The RDMA resources of one connection


class _Resources:
    """PZ, registered buffers, one EVD (DTO + connection events) and the EP of one stream."""

    def __init__(self, ia: Any, cfg: StreamConfig) -> None:
        from aiodat.ep import EPAttr
        from aiodat.evd import EvdFlags
        from aiodat.memory import Privileges

        self.cfg = cfg
        self.nrecv = cfg.recv_depth + cfg.extra_slots
        self.nsend = cfg.recv_depth + cfg.extra_slots
        size = cfg.buffer_size
        self.pz = ia.create_pz()
        self.evd = None
        try:
            # one arena: receive slots, then send slots, then the staging buffer for RDMA writes
            self.arena = bytearray(size * (self.nrecv + self.nsend) + cfg.window_size)
            self.lmr = self.pz.register(self.arena, Privileges.LOCAL_READ | Privileges.LOCAL_WRITE)
            self.view = self.lmr.memoryview()
            self.send_base = size * self.nrecv
            self.staging_base = size * (self.nrecv + self.nsend)
            self.window_lmr = None
            if cfg.window_size:
                self.window = bytearray(cfg.window_size)
                self.window_lmr = self.pz.register(
                    self.window, Privileges.LOCAL_READ | Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE)
                self.window_view = self.window_lmr.memoryview()
            self.evd = ia.create_evd(self.nrecv + self.nsend + 16, EvdFlags.DTO | EvdFlags.CONNECTION)
            attrs = EPAttr(max_recv_dtos=self.nrecv, max_request_dtos=self.nsend + 2)
            self.ep = ia.create_ep(self.pz, recv_evd=self.evd, request_evd=self.evd, connect_evd=self.evd,
                                   attrs=attrs)
            from aiodat.memory import Segment

            self.recv_segs = [Segment(self.lmr, i * size, size) for i in range(self.nrecv)]
            for i in range(self.nrecv):
                self.post_recv(i)
        except BaseException:
            self.close()
            raise

    def post_recv(self, i: int) -> None:
        self.ep.post_recv(self.recv_segs[i], ("r", i))

    def params(self) -> bytes:
        flags = PARAM_WINDOW if self.window_lmr is not None else 0
        out = PARAMS.pack(MAGIC, VERSION, flags, self.cfg.recv_depth, self.cfg.buffer_size)
        if self.window_lmr is not None:
            out += self.window_lmr.remote().to_bytes()
        return out

    def close(self) -> None:
        for handle in (self.pz, self.evd):
            if handle is not None:
                try:
                    handle.close()
                except DATError:
                    pass


@dataclass(frozen=True)
class _PeerParams:
    credits: int
    buffer_size: int
    window: Any  # RemoteRegion or None


def _parse_params(data: bytes) -> _PeerParams:
    from aiodat.memory import RemoteRegion

    if len(data) < PARAMS.size:
        raise InvalidParameter(f"the peer's stream parameters are {len(data)} bytes, expected {PARAMS.size}+ "
                               f"(is the peer an aiodat stream?)")
    magic, version, flags, credits, bufsize = PARAMS.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise InvalidParameter(f"the peer is not an aiodat stream of protocol version {VERSION} "
                               f"(magic {magic!r}, version {version})")
    if credits < 1 or bufsize <= HEADER.size:
        raise InvalidParameter(f"the peer's stream parameters are invalid (credits {credits}, slot {bufsize})")
    window = RemoteRegion.from_bytes(data[PARAMS.size:]) if flags & PARAM_WINDOW else None
    return _PeerParams(credits, bufsize, window)


# --------------------------------------------------------------------------------------------
# The transport


class RdmaTransport(asyncio.Transport):
    """An :class:`asyncio.Transport` over one RDMA RC connection (see the module docstring for the protocol).

    ``get_extra_info`` knows ``peername``, ``sockname``, ``socket`` (None),
    ``aiodat_ep`` (the :class:`aiodat.EP`), ``aiodat_ia`` and
    ``aiodat_config`` (the :class:`StreamConfig`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, res: _Resources, iaref: _IARef, peer: _PeerParams,
                 protocol: asyncio.BaseProtocol, server: Optional["Server"] = None) -> None:
        ep = res.ep
        param = ep.query()
        super().__init__({
            "peername": param.remote_address, "sockname": param.local_address, "socket": None,
            "aiodat_ep": ep, "aiodat_ia": iaref.ia, "aiodat_config": res.cfg,
        })
        self._loop = loop
        self._res = res
        self._iaref = iaref
        self._protocol = protocol
        self._server = server
        cfg = res.cfg
        self._size = cfg.buffer_size
        self._payload_max = min(cfg.buffer_size, peer.buffer_size) - HEADER.size
        self._credits = peer.credits
        self._threshold = cfg.credit_threshold
        self._peer_window = peer.window if cfg.window_size else None
        if self._peer_window is not None:
            self._peer_window = self._peer_window[0:min(peer.window.length, cfg.window_size)]
        self._rdma_threshold = cfg.rdma_threshold
        self._window_free = True  # may we RDMA-write into the peer's window?
        self._staging_busy = False
        self._owed = 0  # credits to return to the peer
        self._release_pending = False  # tell the peer its window write has been consumed
        self._free_slots: List[int] = list(range(res.nsend - 1, -1, -1))
        # Requests on the send queue in posting order: ("s", slot) or ("w", 0).  Most sends are posted
        # without a completion (SUPPRESS); one completion frees everything posted before it.
        self._posted: Deque[Tuple[str, int]] = collections.deque()
        self._signal_every = max(1, res.nsend // 4)
        self._unsignalled = 0
        self._send_buf = bytearray()
        self._eof_requested = False  # write_eof() or close(): send EOF once the buffer is empty
        self._eof_sent = False
        self._eof_received = False
        self._closing = False
        self._lost = False
        self._conn_lost_writes = 0
        self._reading = True
        self._held: Deque[Tuple[int, int, int]] = collections.deque()  # (slot, type, length) while paused
        self._protocol_paused = False
        self._high_water = 64 * 1024
        self._low_water = 16 * 1024
        self._idle: Optional[asyncio.Future[None]] = None
        self._close_task: Optional[asyncio.Task[None]] = None
        self._stream_protocol = isinstance(protocol, asyncio.StreamReaderProtocol)
        self._pump_task: Optional[asyncio.Task[None]] = None
        #: messages and bytes moved, for tests and benchmarks: sends, window writes, credit messages
        self.stats = {"data_msgs": 0, "window_writes": 0, "credit_msgs": 0, "bytes_sent": 0, "bytes_received": 0}

    def _start(self) -> None:
        self._protocol.connection_made(self)
        if not self._lost:
            self._pump_task = self._loop.create_task(self._pump())

    # -- asyncio.BaseTransport -------------------------------------------------------------
    def is_closing(self) -> bool:
        """True once close() or abort() was called or the connection was lost."""
        return self._closing

    def close(self) -> None:
        """Send what is buffered, then EOF, then disconnect; ``connection_lost(None)`` follows."""
        if self._closing:
            return
        self._closing = True
        if self._lost:
            return
        self._eof_requested = True
        self._flush()
        self._close_task = self._loop.create_task(self._close_when_flushed())

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the connection to another protocol."""
        self._protocol = protocol
        self._stream_protocol = isinstance(protocol, asyncio.StreamReaderProtocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The protocol the transport delivers to."""
        return self._protocol

    # -- asyncio.ReadTransport ---------------------------------------------------------------
    def is_reading(self) -> bool:
        """False while paused by pause_reading()."""
        return self._reading and not self._closing

    def pause_reading(self) -> None:
        """Stop delivering data; received messages are held and their credits not returned."""
        self._reading = False

    def resume_reading(self) -> None:
        """Deliver what was held (on the next loop iteration) and return its credits."""
        if not self._reading:
            self._reading = True
            self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self._lost:
            return
        self._deliver_held()
        self._flush()

    # -- asyncio.WriteTransport --------------------------------------------------------------
    def set_write_buffer_limits(self, high: Optional[int] = None, low: Optional[int] = None) -> None:
        """Set the high- and low-water marks of the write buffer (asyncio's defaults: 64 KiB / 16 KiB)."""
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high_water, self._low_water = high, low
        self._maybe_pause_protocol()

    def get_write_buffer_limits(self) -> Tuple[int, int]:
        """(low, high) water marks."""
        return self._low_water, self._high_water

    def get_write_buffer_size(self) -> int:
        """Bytes written but not yet handed to the RDMA device."""
        return len(self._send_buf)

    def write(self, data: Union[bytes, bytearray, memoryview]) -> None:
        """Buffer ``data`` and send as much as the peer's credits allow; never blocks."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__!r}")
        if self._eof_requested and not self._closing:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if self._lost or self._closing:
            self._conn_lost_writes += 1
            return
        self._send_buf += data
        self._flush()
        self._maybe_pause_protocol()

    def writelines(self, list_of_data: Iterable[Union[bytes, bytearray, memoryview]]) -> None:
        """Write each buffer in turn."""
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        """Close the write side after the buffered data: the peer's reader sees EOF; we can still read."""
        if self._closing or self._eof_requested:
            return
        self._eof_requested = True
        self._flush()

    def can_write_eof(self) -> bool:
        """True: aiodat streams support half-close."""
        return True

    def abort(self) -> None:
        """Drop the connection at once, without EOF: the peer sees ConnectionResetError."""
        if self._lost:
            return
        self._closing = True
        self._send_buf.clear()
        self._finish(None)

    # -- flow control towards the protocol ------------------------------------------------------
    def _maybe_pause_protocol(self) -> None:
        if not self._protocol_paused and len(self._send_buf) > self._high_water:
            self._protocol_paused = True
            try:
                self._protocol.pause_writing()  # type: ignore[union-attr]
            except Exception as exc:  # as asyncio does: report, do not raise into write()
                self._loop.call_exception_handler({"message": "protocol.pause_writing() failed",
                                                   "exception": exc, "transport": self, "protocol": self._protocol})

    def _maybe_resume_protocol(self) -> None:
        if self._protocol_paused and len(self._send_buf) <= self._low_water:
            self._protocol_paused = False
            try:
                self._protocol.resume_writing()  # type: ignore[union-attr]
            except Exception as exc:
                self._loop.call_exception_handler({"message": "protocol.resume_writing() failed",
                                                   "exception": exc, "transport": self, "protocol": self._protocol})

    # -- sending ----------------------------------------------------------------------------
    def _post_message(self, mtype: int, payload_len: int, take_credit: bool) -> int:
        """Fill a send slot (header + ``payload_len`` bytes from the buffer) and post it; returns the slot."""
        res = self._res
        slot = self._free_slots.pop()
        base = res.send_base + slot * self._size
        flags = FLAG_RELEASE if self._release_pending else 0
        owed = min(self._owed, 0xFFFF)
        HEADER.pack_into(res.view, base, mtype, flags, owed, payload_len)
        if mtype == MSG_DATA and payload_len:
            with memoryview(self._send_buf) as mv:
                res.view[base + HEADER.size:base + HEADER.size + payload_len] = mv[:payload_len]
        from aiodat.ep import CompletionFlags
        from aiodat.memory import Segment

        # signal one send in every few, whenever slots run short, and everything from EOF on (so the
        # last sends before a close complete)
        signal = (self._unsignalled >= self._signal_every or len(self._free_slots) < self._signal_every
                  or mtype == MSG_EOF or self._eof_sent)
        flags = CompletionFlags.DEFAULT if signal else CompletionFlags.SUPPRESS
        try:
            res.ep.post_send(Segment(res.lmr, base, HEADER.size + (payload_len if mtype == MSG_DATA else 0)),
                             ("s", slot), flags)
        except BaseException:
            self._free_slots.append(slot)
            raise
        self._posted.append(("s", slot))
        self._unsignalled = 0 if signal else self._unsignalled + 1
        self._owed -= owed
        self._release_pending = False
        if take_credit:
            self._credits -= 1
        return slot

    def _flush(self) -> None:
        """Send what credits, slots and the window allow; then CREDIT if credits are owed."""
        if self._lost:
            return
        res = self._res
        try:
            while self._free_slots:
                pending = len(self._send_buf)
                if pending and self._credits > 0:
                    win = self._peer_window
                    if (win is not None and pending >= self._rdma_threshold and self._window_free
                            and not self._staging_busy and len(self._free_slots) >= 1):
                        n = min(pending, win.length)
                        staging = res.staging_base
                        with memoryview(self._send_buf) as mv:
                            res.view[staging:staging + n] = mv[:n]
                        res.ep.post_rdma_write(res.lmr[staging:staging + n], win[0:n], ("w", 0))
                        self._posted.append(("w", 0))
                        self._staging_busy = True
                        self._window_free = False
                        self._post_message(MSG_WINDOW, n, True)
                        self.stats["window_writes"] += 1
                    else:
                        n = min(pending, self._payload_max)
                        self._post_message(MSG_DATA, n, True)
                        self.stats["data_msgs"] += 1
                    del self._send_buf[:n]
                    self.stats["bytes_sent"] += n
                    continue
                if not pending and self._eof_requested and not self._eof_sent and self._credits > 0:
                    self._post_message(MSG_EOF, 0, True)
                    self._eof_sent = True
                    continue
                if self._release_pending or self._owed >= self._threshold:
                    self._post_message(MSG_CREDIT, 0, False)
                    self.stats["credit_msgs"] += 1
                    continue
                break
        except DATError as exc:
            # the EP left CONNECTED under us (the peer went away): the connection event will follow
            from aiodat.ep import EPState

            if res.ep.closed or res.ep.state is not EPState.CONNECTED:
                return
            self._finish(ConnectionBroken(f"sending on the RDMA stream failed: {exc}"))
            return
        self._maybe_resume_protocol()
        self._check_idle()

    def _check_idle(self) -> None:
        idle = self._idle
        if idle is not None and not idle.done() and self._is_flushed():
            idle.set_result(None)

    def _is_flushed(self) -> bool:
        return not self._send_buf and self._eof_sent and not self._posted

    async def _close_when_flushed(self) -> None:
        try:
            if not self._is_flushed() and not self._lost:
                self._idle = self._loop.create_future()
                await self._idle
            if self._lost:
                return
            try:
                await self._res.ep.disconnect(graceful=True, timeout=10.0)
            except DATError:
                pass
            self._finish(None)
        except asyncio.CancelledError:
            self._finish(None)
            raise

    # -- receiving --------------------------------------------------------------------------------
    async def _pump(self) -> None:
        evd = self._res.evd
        try:
            while not self._lost:
                events = await evd.wait(1)
                self._handle(events)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed wait: the connection is unusable
            if not self._lost:
                self._finish(ConnectionBroken(f"the RDMA stream failed: {exc!r}"))

    def _handle(self, events: Sequence[Any]) -> None:
        from aiodat.evd import ConnectionEvent, EventType

        lost_event = None
        for event in events:
            if isinstance(event, ConnectionEvent):
                if event.type in (EventType.CONNECTION_EVENT_DISCONNECTED, EventType.CONNECTION_EVENT_BROKEN):
                    lost_event = event
                continue
            self._completion(event)
            if self._lost:
                return
        if lost_event is not None:
            # take every completion still in the CQ first: data the peer sent before leaving
            while True:
                more = self._res.evd.dequeue()
                if more is None:
                    break
                if not isinstance(more, ConnectionEvent):
                    self._completion(more)
                    if self._lost:
                        return
            self._peer_lost(lost_event.type is EventType.CONNECTION_EVENT_BROKEN)
            return
        self._flush()

    def _completion(self, event: Any) -> None:
        kind, slot = event.cookie if isinstance(event.cookie, tuple) else (None, None)
        if not event.ok:
            if event.flushed or self._closing:
                return  # the QP left CONNECTED: the connection event tells the rest
            self._finish(ConnectionBroken(f"RDMA {event.operation.value if event.operation else 'op'} "
                                          f"failed: {event.status}"))
            return
        if kind in ("s", "w"):
            posted = self._posted
            while posted:  # the send queue completes in order: everything before this is done too
                done = posted.popleft()
                if done[0] == "s":
                    self._free_slots.append(done[1])
                else:
                    self._staging_busy = False
                if done == (kind, slot):
                    break
        elif kind == "r":
            self._received(slot, event.transferred_length)
        if kind in ("s", "w"):
            self._check_idle()

    def _received(self, slot: int, length: int) -> None:
        res = self._res
        base = slot * self._size
        mtype, flags, credits, plen = HEADER.unpack_from(res.view, base)
        self._credits += credits
        if flags & FLAG_RELEASE:
            self._window_free = True
        if mtype == MSG_CREDIT:
            self._repost(slot, owe=False)
            return
        if mtype not in (MSG_DATA, MSG_WINDOW, MSG_EOF) or (mtype == MSG_DATA and plen > length - HEADER.size):
            self._finish(ConnectionBroken(f"protocol error: message type {mtype}, length {plen} in a "
                                          f"{length}-byte receive"))
            return
        if self._held or not self._reading:
            self._held.append((slot, mtype, plen))
        else:
            self._deliver(slot, mtype, plen)

    def _deliver_held(self) -> None:
        while self._held and (self._reading or self._lost) and not self._closing_hard():
            slot, mtype, plen = self._held.popleft()
            self._deliver(slot, mtype, plen)

    def _closing_hard(self) -> bool:
        return self._res.ep.closed

    def _deliver(self, slot: int, mtype: int, plen: int) -> None:
        res = self._res
        if mtype == MSG_DATA:
            base = slot * self._size + HEADER.size
            self._data(res.view[base:base + plen])
        elif mtype == MSG_WINDOW:
            self._data(res.window_view[0:plen])
            self._release_pending = True
        else:
            self._eof()
        self._repost(slot, owe=True)

    def _data(self, view: memoryview) -> None:
        self.stats["bytes_received"] += len(view)
        if self._closing and not self._lost:
            return  # as asyncio: no data_received after close()
        try:
            self._protocol.data_received(view if self._stream_protocol else bytes(view))  # type: ignore
        except Exception as exc:
            self._loop.call_exception_handler({"message": "protocol.data_received() failed",
                                               "exception": exc, "transport": self, "protocol": self._protocol})
            self.abort()

    def _eof(self) -> None:
        if self._eof_received:
            return
        self._eof_received = True
        if self._closing:
            return
        keep_open = False
        try:
            keep_open = bool(self._protocol.eof_received())  # type: ignore[union-attr]
        except Exception as exc:
            self._loop.call_exception_handler({"message": "protocol.eof_received() failed",
                                               "exception": exc, "transport": self, "protocol": self._protocol})
        if not keep_open:
            self.close()

    def _repost(self, slot: int, owe: bool) -> None:
        if self._lost or self._res.ep.closed:
            return
        try:
            self._res.post_recv(slot)
        except DATError:
            return  # disconnected: nothing more will arrive
        if owe:
            self._owed += 1

    # -- the end -------------------------------------------------------------------------------
    def _peer_lost(self, broken: bool) -> None:
        """The peer disconnected (or the connection broke): EOF if it said EOF first, else reset."""
        self._reading = True
        self._deliver_held()
        if self._eof_received and not broken:
            self._finish(None)
        elif self._closing and not broken:
            self._finish(None)  # we closed first and the peer answered our DREQ's crossing DREQ
        else:
            reason = "broke" if broken else "was closed by the peer without EOF"
            self._finish(ConnectionBroken(f"Connection reset by peer (the RDMA connection {reason})"))

    def _finish(self, exc: Optional[BaseException]) -> None:
        """Tear down: cancel the tasks, free EP/PZ/LMRs/EVD, release the IA, tell the protocol."""
        if self._lost:
            return
        self._lost = True
        self._closing = True
        current = asyncio.current_task(self._loop) if self._loop.is_running() else None
        for task in (self._pump_task, self._close_task):
            if task is not None and task is not current and not task.done():
                task.cancel()
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)
        self._held.clear()
        self._res.close()
        self._iaref.release()
        if self._protocol_paused:
            self._protocol_paused = False
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: Optional[BaseException]) -> None:
        try:
            self._protocol.connection_lost(exc)
        finally:
            server, self._server = self._server, None
            if server is not None:
                server._detach(self)

    def __repr__(self) -> str:
        state = "lost" if self._lost else "closing" if self._closing else "open"
        return f"<aiodat.RdmaTransport {state} peer={self._extra.get('peername')}>"


# --------------------------------------------------------------------------------------------
# Client side


async def create_connection(protocol_factory: Callable[[], asyncio.BaseProtocol], host: Optional[str] = None,
                            port: Optional[int] = None, *, ia: Any = None, connect_timeout: float = 30.0,
                            **kwds: Any) -> Tuple[RdmaTransport, asyncio.BaseProtocol]:
    """``loop.create_connection`` over RDMA: connect to an aiodat stream server at ``host:port``.

    ``ia`` is a device name, an open :class:`aiodat.IA` or None (the device
    whose address is ``host``, else ``$AIODAT_RXE_DEVICE``, else the first
    active one).  ``buffer_size``, ``recv_depth``, ``window_size`` and
    ``rdma_threshold`` set the :class:`StreamConfig`.  Raises
    ConnectionRefusedError (:class:`aiodat.ConnectionRejected`) when nothing
    listens there, TimeoutError after ``connect_timeout`` seconds.
    """
    cfg, rest = _split_kwds(dict(kwds))
    if rest:
        raise TypeError(f"create_connection() got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    if host is None or port is None:
        raise InvalidAddress("aiodat streams need both host and port (there is no sock= form)")
    loop = asyncio.get_running_loop()
    host = await resolve_host(host)
    iaref = _IARef(ia, host)
    res = None
    try:
        res = _Resources(iaref.ia, cfg)
        reply = await res.ep.connect(host, int(port), res.params(), timeout=connect_timeout)
        peer = _parse_params(reply)
    except BaseException:
        if res is not None:
            res.close()
        iaref.release()
        raise
    protocol = protocol_factory()
    transport = RdmaTransport(loop, res, iaref, peer, protocol)
    transport._start()
    return transport, protocol


async def open_connection(host: Optional[str] = None, port: Optional[int] = None, *, limit: int = DEFAULT_LIMIT,
                          **kwds: Any) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to an aiodat stream server: the RDMA twin of :func:`asyncio.open_connection`.

    Returns asyncio's own ``(StreamReader, StreamWriter)``.  Keyword arguments
    as :func:`create_connection` (``ia``, ``connect_timeout``, the
    :class:`StreamConfig` fields).
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await create_connection(lambda: protocol, host, port, **kwds)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return reader, writer


# --------------------------------------------------------------------------------------------
# Server side


class ListenSocket:
    """What ``Server.sockets`` lists: the listening address, socket-like (``getsockname()``)."""

    family = socket.AF_INET
    type = socket.SOCK_STREAM
    proto = 0

    def __init__(self, address: str, port: int, psp: Any) -> None:
        self._address, self._port = address, port
        self.family = socket.AF_INET6 if ":" in address else socket.AF_INET
        #: the :class:`aiodat.PSP` listening
        self.psp = psp

    def getsockname(self) -> Tuple[str, int]:
        """(address, port) listened on."""
        return self._address, self._port

    def getpeername(self) -> Tuple[str, int]:
        """A listening point has no peer: raises OSError(ENOTCONN) as a socket does."""
        import errno

        raise OSError(errno.ENOTCONN, "a listening aiodat stream server has no peer")

    def fileno(self) -> int:
        """-1: there is no socket file descriptor."""
        return -1

    def __repr__(self) -> str:
        return f"<aiodat.streams.ListenSocket {self._address}:{self._port}>"


class Server:
    """A listening aiodat stream server, with the methods of :class:`asyncio.Server`.

    ``close()`` stops listening (existing connections stay; ``close_clients()``
    closes them); ``wait_closed()`` waits until the server is closed and every
    connection it accepted is gone (asyncio 3.12+ semantics).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol_factory: Callable[[], asyncio.BaseProtocol],
                 iaref: _IARef, psp: Any, cr_evd: Any, cfg: StreamConfig, accept_timeout: float) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._iaref = iaref
        self._psp = psp
        self._cr_evd = cr_evd
        self._cfg = cfg
        self._accept_timeout = accept_timeout
        self._sockets: Optional[List[ListenSocket]] = [ListenSocket(psp.address, psp.port, psp)]
        self._transports: Dict[RdmaTransport, None] = {}
        self._pending: Dict["asyncio.Task[None]", None] = {}
        self._serving = False
        self._accept_task: Optional[asyncio.Task[None]] = None
        self._serving_forever_fut: Optional[asyncio.Future[None]] = None
        self._waiters: Optional[List[asyncio.Future[None]]] = []

    # -- asyncio.Server API ----------------------------------------------------------------------
    @property
    def sockets(self) -> Tuple[ListenSocket, ...]:
        """The listening points (one): ``server.sockets[0].getsockname()`` is (address, port)."""
        return tuple(self._sockets or ())

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the server runs on."""
        return self._loop

    def is_serving(self) -> bool:
        """True while accepting connections."""
        return self._serving

    async def start_serving(self) -> None:
        """Start accepting (requests that came before wait in the PSP's queue)."""
        self._start_serving()
        await asyncio.sleep(0)

    def _start_serving(self) -> None:
        if self._sockets is None:
            raise RuntimeError(f"server {self!r} is closed")
        if self._serving:
            return
        self._serving = True
        self._accept_task = self._loop.create_task(self._accept_loop())

    async def serve_forever(self) -> None:
        """Accept until cancelled; then close and wait_closed()."""
        if self._serving_forever_fut is not None:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        if self._sockets is None:
            raise RuntimeError(f"server {self!r} is closed")
        self._start_serving()
        self._serving_forever_fut = self._loop.create_future()
        try:
            await self._serving_forever_fut
        except asyncio.CancelledError:
            try:
                self.close()
                await self.wait_closed()
            finally:
                raise
        finally:
            self._serving_forever_fut = None

    def close(self) -> None:
        """Stop listening (the PSP is freed; connections already made stay open)."""
        if self._sockets is None:
            return
        self._sockets = None
        self._serving = False
        for task in [self._accept_task, *self._pending]:
            if task is not None and not task.done():
                task.cancel()
        for handle in (self._psp, self._cr_evd):
            try:
                handle.close()
            except DATError:
                pass
        if self._serving_forever_fut is not None and not self._serving_forever_fut.done():
            self._serving_forever_fut.cancel()
            self._serving_forever_fut = None
        self._maybe_done()

    def close_clients(self) -> None:
        """Close every connection this server accepted (gracefully: EOF, then disconnect)."""
        for transport in list(self._transports):
            transport.close()

    def abort_clients(self) -> None:
        """Drop every connection this server accepted at once."""
        for transport in list(self._transports):
            transport.abort()

    async def wait_closed(self) -> None:
        """Wait until close() was called and every accepted connection is closed."""
        if self._waiters is None:
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

    async def __aenter__(self) -> "Server":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()

    def __repr__(self) -> str:
        where = self.sockets[0].getsockname() if self.sockets else "closed"
        return f"<aiodat.streams.Server {where} connections={len(self._transports)}>"

    # -- internals -------------------------------------------------------------------------------
    def _maybe_done(self) -> None:
        if self._sockets is not None or self._transports or self._pending:
            return
        self._iaref.release()
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def _detach(self, transport: RdmaTransport) -> None:
        self._transports.pop(transport, None)
        self._maybe_done()

    async def _accept_loop(self) -> None:
        while self._serving:
            try:
                event = await self._cr_evd.wait_one()
            except asyncio.CancelledError:
                raise
            except DATError:
                if self._sockets is None:
                    return
                raise
            cr = getattr(event, "cr", None)
            if cr is None:
                continue
            task = self._loop.create_task(self._accept_one(cr))
            self._pending[task] = None
            task.add_done_callback(self._accepted)

    def _accepted(self, task: "asyncio.Task[None]") -> None:
        self._pending.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self._loop.call_exception_handler({"message": "aiodat stream server: accepting a connection failed",
                                               "exception": task.exception(), "server": self})
        self._maybe_done()

    async def _accept_one(self, cr: Any) -> None:
        try:
            peer = _parse_params(cr.private_data)
        except DATError:
            cr.reject(b"not an aiodat stream")
            return
        ia = self._iaref.ia
        iaref = self._iaref.share()  # each connection holds the IA too (it may outlive the server)
        res = None
        try:
            res = _Resources(ia, self._cfg)
            await cr.accept(res.ep, res.params(), timeout=self._accept_timeout)
        except BaseException:
            if res is not None:
                res.close()
            else:
                try:
                    cr.reject()
                except DATError:
                    pass
            iaref.release()
            raise
        transport = RdmaTransport(self._loop, res, iaref, peer, self._factory(), server=self)
        self._transports[transport] = None
        transport._start()


async def create_server(protocol_factory: Callable[[], asyncio.BaseProtocol], host: Any = None,
                        port: Optional[int] = None, *, ia: Any = None, backlog: int = 100,
                        start_serving: bool = True, accept_timeout: float = 30.0, **kwds: Any) -> Server:
    """``loop.create_server`` over RDMA: listen on ``host:port`` (port 0 or None: any free port).

    ``host`` must be the IPv4 address of an RDMA device (or None / "" /
    "0.0.0.0" for the default device; the server listens on that device's
    address).  ``ia``, ``buffer_size``, ``recv_depth``, ``window_size`` and
    ``rdma_threshold`` as for :func:`create_connection`.
    """
    cfg, rest = _split_kwds(dict(kwds))
    if rest:
        raise TypeError(f"create_server() got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    if isinstance(host, (list, tuple)):
        if len(host) != 1:
            raise ModelNotSupported("an aiodat stream server listens on one address; pass one host")
        host = host[0]
    if host in ("", "0.0.0.0"):
        host = None
    if host is not None and not isinstance(host, str):
        raise InvalidAddress(f"host must be an IPv4 address string or None, not {type(host).__name__}")
    if port is None:
        port = 0
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 0xFFFF:
        raise InvalidParameter(f"port must be an int between 0 and 65535, got {port!r}")
    loop = asyncio.get_running_loop()
    if host is not None:
        host = await resolve_host(host)
    iaref = _IARef(ia, host, listening=True)
    try:
        if host is not None and not same_address(iaref.ia.address or "", host):
            raise InvalidAddress(f"cannot listen on {host}: the IA {iaref.ia.name} has address "
                                 f"{iaref.ia.address} (an aiodat server listens on its IA's address)")
        from aiodat.evd import EvdFlags

        cr_evd = iaref.ia.create_evd(max(8, backlog), EvdFlags.CR)
        try:
            psp = iaref.ia.create_psp(port, cr_evd, backlog) if port else iaref.ia.create_psp_any(cr_evd, backlog)
        except BaseException:
            cr_evd.close()
            raise
    except BaseException:
        iaref.release()
        raise
    server = Server(loop, protocol_factory, iaref, psp, cr_evd, cfg, accept_timeout)
    if start_serving:
        server._start_serving()
        await asyncio.sleep(0)
    return server


async def start_server(client_connected_cb: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any],
                       host: Any = None, port: Optional[int] = None, *, limit: int = DEFAULT_LIMIT,
                       **kwds: Any) -> Server:
    """Start an aiodat stream server: the RDMA twin of :func:`asyncio.start_server`.

    ``client_connected_cb(reader, writer)`` is called (a coroutine function is
    run as a task) with asyncio's own StreamReader and StreamWriter for each
    connection.  Keyword arguments as :func:`create_server` (``backlog``,
    ``start_serving``, ``ia``, the :class:`StreamConfig` fields).
    """
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.StreamReaderProtocol:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        return asyncio.StreamReaderProtocol(reader, client_connected_cb, loop=loop)

    return await create_server(factory, host, port, **kwds)
