"""The aiodat stream wire protocol as a sans-IO state machine (no asyncio, no device objects, no I/O).

:class:`StreamCore` holds one side of one connection: the send credits the
peer granted, the send slots, the peer's receive window, the bytes waiting to
be sent, the credits owed to the peer and the received messages held while
reading is paused.  The transport (:mod:`aiodat.streams.transport`) feeds it
what happened and asks it what to post next:

* ``core.write(data)`` / ``core.write_eof()`` buffer outgoing bytes and the EOF;
* ``core.next_send()`` says what to post now (a :class:`Send`: which slot, the
  8-byte header, how many pending bytes go with it, whether they go by RDMA
  write into the peer's window, whether the send is signalled), or None when
  credits, slots or the window forbid it; ``core.copy_pending(dest, n)`` copies
  the bytes into registered memory and ``core.sent(send)`` commits the send
  once it was posted;
* ``core.on_send_complete(cookie)`` frees the slots a send completion covers;
* ``core.on_received(slot, header, length)`` decodes a received message,
  takes the credits it returns and says whether to hand it over now (a
  :class:`Message`) or hold it (reading paused); ``core.next_held()`` gives held
  messages back; ``core.consumed(message)`` records that the slot is re-posted
  and one credit is owed to the peer.

Wire format and the reasoning behind the numbers: docs/streams.md.  The
connection parameters of the connect/accept private data are built and
parsed by :func:`encode_params` / :func:`parse_params`.
"""
from __future__ import annotations

import collections
import dataclasses
import socket
import struct
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, NamedTuple, Optional, Tuple

from aiodat._shim._streamcore import StreamState
from aiodat.cm import check_timeout
from aiodat.errors import ConnectionBroken, InvalidParameter, ModelNotSupported
from aiodat.poller import MAX_BUSY_POLL_US

__all__ = [
    "HEADER", "PARAMS", "WINDOW_DESC", "MAGIC", "VERSION", "PARAM_WINDOW", "MSG_DATA", "MSG_WINDOW", "MSG_CREDIT",
    "MSG_EOF", "FLAG_RELEASE", "RELEASE_MASK", "FLAG_WRAP", "MAX_WINDOWS", "DEFAULT_LIMIT", "MAX_CONNECTION_MEMORY",
    "StreamConfig",
    "PeerParams", "WindowDesc", "StreamProtocolError", "Header", "Send", "Message", "StreamCore", "encode_params",
    "parse_params", "encode_header", "decode_header", "split_kwds", "CONFIG_KEYS",
]

#: asyncio's default StreamReader limit
DEFAULT_LIMIT = 2 ** 16

#: message header, network order: type (B), flags (B), credits returned (H), payload length (I)
HEADER = struct.Struct("!BBHI")
#: connection parameters in the connect/accept private data: magic, version, flags, recv credits,
#: slot size; followed by the window descriptor (:data:`WINDOW_DESC`) when flags has PARAM_WINDOW
PARAMS = struct.Struct("!2sBBHI")
#: the receive window: address (Q), length (Q), rkey (I) -- the layout of aiodat.RemoteRegion.to_bytes()
WINDOW_DESC = struct.Struct("!QQI")
_HEADER_SIZE = HEADER.size
_unpack_header = HEADER.unpack_from
MAGIC = b"AS"
VERSION = 2  # 2: up to MAX_WINDOWS window writes in flight, placed in the window as a ring
PARAM_WINDOW = 0x01

MSG_DATA = 1  #: payload follows the header in the same send
MSG_WINDOW = 2  #: ``length`` bytes were RDMA-written into the receiver's window (where: FLAG_WRAP)
MSG_CREDIT = 3  #: credits (and/or a RELEASE count) only; consumes no credit
MSG_EOF = 4  #: the sender will send no more data (write_eof / close)
#: flags bits 0-1: how many of the receiver's WINDOW writes, oldest first, the sender has consumed
#: (their part of the window may be written again); FLAG_RELEASE is one
RELEASE_MASK = 0x03
FLAG_RELEASE = 0x01
#: on a WINDOW: its bytes start at offset 0 of the window; without it they follow the previous WINDOW's
FLAG_WRAP = 0x04
#: window writes a sender may have in flight (written and not yet both released and completed): two
#: let the receiver copy one out while the next is written, as a socket's buffer does
MAX_WINDOWS = 2
_MSG_NAMES = {MSG_DATA: "DATA", MSG_WINDOW: "WINDOW", MSG_CREDIT: "CREDIT", MSG_EOF: "EOF"}
_KNOWN_FLAGS = RELEASE_MASK | FLAG_WRAP

#: bytes objects written whole from this size on are kept by reference until sent, not copied
#: (StreamState.write_bytes does it, in C: streamcore.c's KEEP_FROM is this number)
_KEEP_FROM = 16384

#: send-queue cookies: a send slot is ("s", slot); the RDMA write into the peer's window is WRITE_COOKIE
WRITE_COOKIE = ("w", 0)


class StreamProtocolError(ConnectionBroken):
    """The peer broke the stream protocol (bad header, credits it never had...): the connection is unusable.

    A :class:`aiodat.ConnectionBroken`, hence a ConnectionResetError, as the stream's reader sees it.
    """


#: the most memory one connection may register (StreamConfig.memory), 4 GiB: what any sane set of
#: sizes stays far below, and what would take seconds to zero on the loop before registration failed
MAX_CONNECTION_MEMORY = 1 << 32


@dataclass(frozen=True)
class StreamConfig:
    """Per-connection settings of an aiodat stream (keyword arguments of open_connection/start_server).

    ``buffer_size``: bytes per send/receive slot (header included), so the
    largest DATA message; ``recv_depth``: receive slots posted for data, i.e.
    the credits granted to the peer; ``window_size``: the registered receive
    window for RDMA writes (0 disables the large-message path);
    ``rdma_threshold``: pending bytes from which the writer uses the window
    instead of sends; ``busy_poll_us``: how long the connection's EVD keeps
    polling its CQ after its last completion before it sleeps (0: it sleeps at
    once; see ``ia.create_evd``), as rsockets' ``polling_time``: it saves the
    sleep and the wake-up when the peer answers within that time, and burns a
    CPU while it spins.  ``close_timeout``: how long ``close()`` waits on a
    peer that makes no progress (takes no data, returns no credits, answers no
    disconnect) before it aborts the connection; None waits for ever.
    """

    buffer_size: int = 16384
    recv_depth: int = 16
    window_size: int = 1 << 20
    rdma_threshold: int = 65536
    busy_poll_us: int = 0
    close_timeout: Optional[float] = 10.0

    def validate(self) -> "StreamConfig":
        """Return self, or raise InvalidParameter naming the bad value."""
        checks = (("buffer_size", 64, 1 << 20), ("recv_depth", 4, 4096), ("rdma_threshold", 1, 1 << 40),
                  ("busy_poll_us", 0, MAX_BUSY_POLL_US))
        for name, low, high in checks:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidParameter(f"{name} must be an int between {low} and {high}, got {value!r}")
        w = self.window_size
        if not isinstance(w, int) or isinstance(w, bool) or not (w == 0 or 4096 <= w <= 1 << 30):
            raise InvalidParameter(f"window_size must be 0 or an int between 4096 and 2**30, got {w!r}")
        check_timeout(self.close_timeout, "close_timeout")  # (NaN, 0 and non-numbers: refused naming the field)
        if self.memory > MAX_CONNECTION_MEMORY:  # each field may be in range and the sum still absurd
            raise InvalidParameter(
                f"a connection with buffer_size={self.buffer_size}, recv_depth={self.recv_depth} and "
                f"window_size={w} would register {self.memory} bytes, more than {MAX_CONNECTION_MEMORY} "
                "(2**32): lower recv_depth or buffer_size")
        return self

    @property
    def memory(self) -> int:
        """Bytes a connection registers: its send and receive slots, the staging buffer and the window."""
        return 2 * self.slots * self.buffer_size + 2 * self.window_size

    @property
    def credit_threshold(self) -> int:
        """Owed credits that trigger a CREDIT message when there is no data to carry them."""
        return max(2, self.recv_depth // 2)

    @property
    def extra_slots(self) -> int:
        """Receive slots beyond the credits, for CREDIT messages (which need no credit): those the owed
        credits trigger, one per window write in flight for its release, and one spare."""
        return self.recv_depth // self.credit_threshold + MAX_WINDOWS + 1

    @property
    def slots(self) -> int:
        """Receive slots (and as many send slots) per connection: ``recv_depth + extra_slots``."""
        return self.recv_depth + self.extra_slots


#: the keyword arguments that are StreamConfig fields (split_kwds takes them; the integrations name them)
CONFIG_KEYS = tuple(field.name for field in dataclasses.fields(StreamConfig))
# keyword arguments of loop.create_connection / create_server that have no meaning here: accepted when
# left at their "off" value, refused otherwise
_IGNORABLE = {"ssl": (None, False), "sock": (None,), "local_addr": (None,), "server_hostname": (None,),
              "ssl_handshake_timeout": (None,), "ssl_shutdown_timeout": (None,), "happy_eyeballs_delay": (None,),
              "interleave": (None,), "family": (0, socket.AF_INET, socket.AF_INET6, socket.AF_UNSPEC), "proto": (0,),
              "flags": (0, socket.AI_PASSIVE), "reuse_address": (None, True, False), "reuse_port": (None, False),
              "all_errors": (False,)}


def split_kwds(kwds: Dict[str, Any]) -> Tuple[StreamConfig, Dict[str, Any]]:
    """Take the StreamConfig fields and asyncio's meaningless-here keywords out of ``kwds``.

    Returns the validated config and what is left (unknown keywords, for the caller's TypeError).
    """
    kwds = dict(kwds)
    cfg = {k: kwds.pop(k) for k in CONFIG_KEYS if k in kwds}
    for name, value in list(kwds.items()):
        if name in _IGNORABLE:
            if value not in _IGNORABLE[name]:
                raise ModelNotSupported(f"aiodat streams do not support {name}={value!r} "
                                        f"(RDMA connections have no sockets, TLS or address families)")
            del kwds[name]
    return StreamConfig(**cfg).validate(), kwds


# -- connection parameters (private data) ------------------------------------------------------


@dataclass(frozen=True)
class WindowDesc:
    """A receive window the peer may RDMA-write into (the fields of an aiodat.RemoteRegion)."""

    address: int
    length: int
    rkey: int


@dataclass(frozen=True)
class PeerParams:
    """What the other side announced in its private data."""

    credits: int  #: its recv_depth: the credits we start with
    buffer_size: int  #: its slot size: the largest message it can receive
    window: Optional[WindowDesc] = None  #: its receive window, None when it has none


def encode_params(cfg: StreamConfig, window: Optional[WindowDesc] = None) -> bytes:
    """The private data announcing ``cfg`` (and our receive window) to the peer: 10 or 30 bytes."""
    flags = PARAM_WINDOW if window is not None else 0
    out = PARAMS.pack(MAGIC, VERSION, flags, cfg.recv_depth, cfg.buffer_size)
    if window is not None:
        out += WINDOW_DESC.pack(window.address, window.length, window.rkey)
    return out


def parse_params(data: bytes) -> PeerParams:
    """Parse the peer's private data (zero padding after the fields is ignored); InvalidParameter if it is not ours."""
    data = bytes(data)
    if len(data) < PARAMS.size:
        raise InvalidParameter(f"the peer's stream parameters are {len(data)} bytes, expected {PARAMS.size}+ "
                               f"(is the peer an aiodat stream?)")
    magic, version, flags, credits, bufsize = PARAMS.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise InvalidParameter(f"the peer is not an aiodat stream of protocol version {VERSION} "
                               f"(magic {magic!r}, version {version})")
    if credits < 1 or bufsize <= HEADER.size:
        raise InvalidParameter(f"the peer's stream parameters are invalid (credits {credits}, slot {bufsize})")
    window = None
    if flags & PARAM_WINDOW:
        if len(data) < PARAMS.size + WINDOW_DESC.size:
            raise InvalidParameter(f"the peer's stream parameters announce a window but are only {len(data)} bytes "
                                   f"(expected {PARAMS.size + WINDOW_DESC.size})")
        window = WindowDesc(*WINDOW_DESC.unpack_from(data, PARAMS.size))
    return PeerParams(credits, bufsize, window)


# -- message headers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """A decoded message header."""

    type: int
    flags: int
    credits: int  #: credits returned to the receiver of the message
    length: int  #: payload bytes (DATA: in the send; WINDOW: in the receiver's window)


def encode_header(mtype: int, flags: int, credits: int, length: int) -> bytes:
    """The 8 header bytes."""
    return HEADER.pack(mtype, flags, credits, length)


def decode_header(data: Any, received: Optional[int] = None) -> Header:
    """Decode and check a header; ``received`` is the byte count of the receive it came in (DATA's bound).

    Raises :class:`StreamProtocolError` for a short receive, an unknown type or
    flag, or a payload longer than what arrived.
    """
    size = len(data) if received is None else received
    if size < HEADER.size or len(data) < HEADER.size:
        raise StreamProtocolError(f"stream protocol error: a {size}-byte message is shorter than the "
                                  f"{HEADER.size}-byte header")
    mtype, flags, credits, length = HEADER.unpack_from(data)
    if mtype not in _MSG_NAMES:
        raise StreamProtocolError(f"stream protocol error: unknown message type {mtype} (protocol version "
                                  f"{VERSION} knows {', '.join(f'{k} {v}' for k, v in _MSG_NAMES.items())})")
    if flags & ~_KNOWN_FLAGS:
        raise StreamProtocolError(f"stream protocol error: unknown flags {flags:#04x} on a "
                                  f"{_MSG_NAMES[mtype]} message")
    if flags & FLAG_WRAP and mtype != MSG_WINDOW:
        raise StreamProtocolError(f"stream protocol error: the WRAP flag on a {_MSG_NAMES[mtype]} message")
    if mtype == MSG_DATA and length > size - HEADER.size:
        raise StreamProtocolError(f"stream protocol error: DATA says {length} payload bytes but the "
                                  f"message is {size} bytes")
    if mtype in (MSG_CREDIT, MSG_EOF) and length:
        raise StreamProtocolError(f"stream protocol error: {_MSG_NAMES[mtype]} with a payload length of {length}")
    return Header(mtype, flags, credits, length)


# -- the state machine ---------------------------------------------------------------------------------


class Send(NamedTuple):
    """One send to post now (from :meth:`StreamCore.next_send`).

    Fill send slot ``slot`` with ``header`` and, for DATA, the first ``length``
    pending bytes (:meth:`StreamCore.copy_pending`); for WINDOW, first copy the
    first ``length`` pending bytes to ``offset`` in the staging buffer and
    RDMA-write them to ``offset`` in the peer's window (cookie
    :data:`WRITE_COOKIE`, unsignalled: a WINDOW send is always signalled, and
    its completion covers the write).  Post ``wire_length`` bytes of the slot with
    ``cookie``, signalled or not, then call :meth:`StreamCore.sent`.
    (A NamedTuple, not a dataclass: one is made per message, and a tuple is the
    cheapest immutable record Python has.)
    """

    type: int
    slot: int
    header: bytes
    length: int
    credits: int  #: credits returned to the peer in this header
    release: int  #: the peer's window writes this header releases (0 to 3)
    signalled: bool
    takes_credit: bool
    offset: int = 0  #: WINDOW: where in the peer's window (and in our staging buffer) the bytes go

    @property
    def cookie(self) -> Tuple[str, int]:
        """The send's cookie (comes back in its completion)."""
        return ("s", self.slot)

    @property
    def window_write(self) -> bool:
        """True when the payload goes by RDMA write into the peer's window."""
        return self.type == MSG_WINDOW

    @property
    def wire_length(self) -> int:
        """Bytes of the slot to send: the header, plus the payload for DATA."""
        return HEADER.size + (self.length if self.type == MSG_DATA else 0)


class Message(NamedTuple):
    """A received message (from :meth:`StreamCore.on_received` / :meth:`StreamCore.next_held`).

    DATA: the payload is the ``length`` bytes after the header in receive slot
    ``slot``; WINDOW: the ``length`` bytes at ``offset`` in our window; EOF: the end of
    the peer's data; CREDIT: nothing to hand over.  In every case the slot is
    re-posted afterwards and :meth:`StreamCore.consumed` called.
    """

    type: int
    slot: int
    length: int
    offset: int = 0  #: WINDOW: where in our window the bytes are
    #: DATA, WINDOW: how many of its bytes were handed over already (a BufferedProtocol paused part way)
    fed: int = 0


class StreamCore(StreamState):
    """One side of an aiodat stream connection, sans IO: every decision of the protocol, none of the posting.

    ``cfg`` is our own configuration, ``peer`` what the peer announced.
    Receive slots ``0 .. cfg.slots-1`` are assumed posted when the core is
    created (the transport posts them before connecting).

    The state a message touches lives in C (:class:`aiodat._shim._streamcore.StreamState`, the
    base class), and so do a small message's common steps, which every round trip of a
    request/response stream takes: ``write_bytes`` (:meth:`write` of a bytes object),
    ``take_data`` (one small write into one DATA send, copied into its send slot), ``on_data``
    and ``data_consumed`` (a DATA message received and handed over).  Each changes nothing
    when the case is not its own, and the Python here takes it: the protocol's rules are
    these methods, the C steps their common case.
    """

    def __init__(self, cfg: StreamConfig, peer: PeerParams) -> None:
        self.cfg = cfg
        self.peer = peer
        self.nslots = cfg.slots
        self._payload_max = min(cfg.buffer_size, peer.buffer_size) - HEADER.size
        self._credits = self._peer_credits = peer.credits
        self._threshold = cfg.credit_threshold
        # the staging buffer is our own window_size: we write at most that much at once
        self.window_length = min(peer.window.length, cfg.window_size) if peer.window is not None else 0
        # pending bytes from which they go by window write (_bulk), as one number for take_data
        self._bulk_from = cfg.rdma_threshold if self.window_length >= cfg.rdma_threshold else 1 << 62
        # The offsets of our window writes in flight, oldest first: the peer's window is a ring,
        # and our staging buffer mirrors it (a write is staged at the offset it lands at).  One is
        # retired, its part free again, once the peer released it (it copied the bytes out) and its
        # WINDOW send completed (the device no longer reads the staged bytes); both come in order.
        self._windows: Deque[int] = collections.deque()
        self._windows_released = 0  # of the oldest in flight, how many the peer released
        self._windows_completed = 0  # ... and how many completed
        self._window_head = 0  # where the next window write goes when it fits before the end
        self._owed = 0  # credits to return to the peer
        self._release_pending = 0  # the peer's window writes we consumed and have not yet released
        self._window_next = 0  # where the peer's next window write lands unless it says FLAG_WRAP
        self._free_slots: List[int] = list(range(self.nslots - 1, -1, -1))
        self._send_cookies = [("s", i) for i in range(self.nslots)]  # made once, not per send
        # requests on the send queue in posting order; most sends are unsignalled, and one
        # completion frees everything posted before it (the send queue completes in order)
        self._posted: List[Tuple[str, int]] = []
        # Signal a send only when the free slots run low (fewer than a quarter left): a signalled
        # send's completion wakes the loop, so a request/response exchange should see it once in
        # many round trips, not every few (docs/streams.md, "Event-loop plumbing").
        self._low_slots = max(1, self.nslots // 4)
        self._signal_every = max(1, self.nslots - self._low_slots)
        self._unsignalled = 0
        # Pending bytes, in order: bytes objects of at least _KEEP_FROM bytes are kept by reference
        # (immutable: no copy until the one into registered memory), smaller or mutable writes are
        # copied into a bytearray of ours, several small writes into one.  _head is how much of the
        # first chunk is already sent (only ever non-zero for a kept bytes object).
        self._chunks: List[Any] = []
        self._head = 0
        self._pending = 0
        self.eof_requested = False  #: write_eof() or close(): send EOF once the buffer is empty
        self.eof_sent = False
        self.eof_received = False
        self._reading = True
        self._held: Deque[Message] = collections.deque()
        self._recv_posted = [True] * self.nslots
        #: messages and bytes moved (the transport's ``stats``): sends, window writes (and of them, those
        #: made while another was in flight, and those that wrapped to offset 0 before one), credit messages
        self.stats: Dict[str, int] = {"data_msgs": 0, "window_writes": 0, "window_writes_overlapped": 0,
                                      "window_wraps": 0, "credit_msgs": 0, "bytes_sent": 0, "bytes_received": 0}

    # -- introspection -----------------------------------------------------------------------
    @property
    def credits(self) -> int:
        """Send credits held: DATA, WINDOW or EOF messages we may send before the peer returns some."""
        return self._credits

    @property
    def owed(self) -> int:
        """Credits we owe the peer (returned in the next header, or a CREDIT message past the threshold)."""
        return self._owed

    @property
    def buffered(self) -> int:
        """Bytes written but not yet handed to a send or RDMA write."""
        return self._pending

    @property
    def free_send_slots(self) -> int:
        """Send slots not in use by a posted send."""
        return len(self._free_slots)

    @property
    def window_free(self) -> bool:
        """Whether the peer's window is all free (no window write of ours is in flight)."""
        return not self._windows

    @property
    def windows_in_flight(self) -> int:
        """Our window writes not yet both released by the peer and completed (at most MAX_WINDOWS)."""
        return len(self._windows)

    @property
    def reading(self) -> bool:
        """False while paused: received messages are held."""
        return self._reading

    @property
    def held(self) -> Tuple[Message, ...]:
        """Received messages held while reading is paused (each keeps its receive slot)."""
        return tuple(self._held)

    def is_flushed(self) -> bool:
        """Everything written, and the EOF, is sent and every send has completed."""
        return not self._pending and self.eof_sent and not self._posted

    # -- the writer's side -------------------------------------------------------------------
    def write(self, data: Any) -> None:
        """Buffer bytes to send; RuntimeError after :meth:`write_eof`."""
        if type(data) is bytes:
            self.write_bytes(data)  # (in C: kept by reference from _KEEP_FROM bytes on, else copied)
            return
        if self.eof_requested:
            raise RuntimeError("Cannot write after write_eof()")
        chunks = self._chunks
        # a buffer the caller may change after write() returns: copied now (len() of a memoryview
        # counts its items, so the bytes are counted by what the copy grew by)
        if chunks and type(chunks[-1]) is bytearray:
            tail = chunks[-1]
        else:
            tail = bytearray()
            chunks.append(tail)
        before = len(tail)
        tail += data
        self._pending += len(tail) - before

    def write_eof(self) -> None:
        """Send EOF after the buffered bytes (idempotent)."""
        self.eof_requested = True

    def discard(self) -> None:
        """Drop the bytes not yet sent (abort)."""
        self._chunks.clear()
        self._head = self._pending = 0

    def next_send(self) -> Optional[Send]:
        """What to post now, or None.  Nothing changes until :meth:`sent` commits it.

        Order of preference: pending bytes (needs a credit; by window write
        when at least ``rdma_threshold`` bytes are pending and the peer's
        window is at least that large -- waiting while fewer than that many
        bytes of the window are free in one piece, or MAX_WINDOWS writes are in
        flight -- else by DATA), then EOF once the buffer is
        empty (needs a credit), then a CREDIT message when a RELEASE is due or
        ``credit_threshold`` credits are owed (needs no credit).
        """
        if not self._free_slots:
            return None
        pending = self._pending
        if pending and self._credits > 0:
            if not self._bulk(pending):
                return self._plan(MSG_DATA, min(pending, self._payload_max), True)
            place = self._window_place(pending)
            if place is not None:
                return self._plan(MSG_WINDOW, place[1], True, place[0])
            # Bulk bytes wait for the window rather than leave in slot-sized DATA sends: one large
            # RDMA write costs the device far less per byte than many sends, and the writer fills
            # the buffer again meanwhile (docs/streams.md, "Large writes").
        if not pending and self.eof_requested and not self.eof_sent and self._credits > 0:
            return self._plan(MSG_EOF, 0, True)
        if self._release_pending or self._owed >= self._threshold:
            return self._plan(MSG_CREDIT, 0, False)
        return None

    def _bulk(self, pending: int) -> bool:
        """Whether ``pending`` bytes go by window write: at least the threshold, with a window at least
        that large (a smaller one would only slow them down)."""
        return pending >= self._bulk_from

    def _window_place(self, pending: int) -> Optional[Tuple[int, int]]:
        """(offset, length) of the next window write of ``pending`` bytes, or None while it must wait.

        The free part of the ring is after the newest write in flight up to the window's end, then
        from offset 0 up to the oldest; a write takes one of them whole or in part, when at least
        ``rdma_threshold`` bytes (or all pending ones) fit, the end first.
        """
        windows = self._windows
        length = self.window_length
        if not windows:
            return 0, min(pending, length)  # all free: start over at 0, where the most fits
        if len(windows) >= MAX_WINDOWS:
            return None
        least = min(pending, self.cfg.rdma_threshold)
        head, tail = self._window_head, windows[0]
        if head > tail:  # in use: [tail, head)
            if length - head >= least:
                return head, min(pending, length - head)
            if tail >= least:
                return 0, min(pending, tail)
        elif tail - head >= least:  # wrapped, in use: [tail, end) and [0, head)
            return head, min(pending, tail - head)
        return None

    def _plan(self, mtype: int, length: int, takes_credit: bool, offset: int = 0) -> Send:
        slot = self._free_slots[-1]
        credits = min(self._owed, 0xFFFF)
        release = min(self._release_pending, RELEASE_MASK)
        # signal when the free slots run short (one send in nslots - nslots//4 when they go one by
        # one), every WINDOW (its completion, which covers the unsignalled RDMA write before it,
        # frees that write's part of the staging buffer), and everything from EOF on (so the last sends
        # before a close complete)
        signalled = (self._unsignalled >= self._signal_every or len(self._free_slots) - 1 < self._low_slots
                     or mtype == MSG_WINDOW or mtype == MSG_EOF or self.eof_sent)
        flags = release | FLAG_WRAP if mtype == MSG_WINDOW and offset == 0 else release
        header = HEADER.pack(mtype, flags, credits, length)
        return Send(mtype, slot, header, length, credits, release, signalled, takes_credit, offset)

    def copy_pending(self, dest: memoryview, length: int) -> None:
        """Copy the first ``length`` pending bytes into ``dest`` (registered memory)."""
        chunks, head = self._chunks, self._head
        first = chunks[0]
        if not head and len(first) == length:  # the whole first chunk (a small write): no view to make
            dest[:length] = first
            return
        done = 0
        for chunk in chunks:
            with memoryview(chunk) as mv:
                piece = mv[head:head + length - done]
                dest[done:done + len(piece)] = piece
                done += len(piece)
                piece.release()
            if done == length:
                return
            head = 0

    def sent(self, send: Send) -> None:
        """Commit ``send`` (from :meth:`next_send`): it, and its window write, were posted."""
        slot = self._free_slots.pop()
        if slot != send.slot:  # a Send is valid only until the next commit
            self._free_slots.append(slot)
            raise RuntimeError(f"stale Send for slot {send.slot} (slot {slot} is next)")
        mtype = send.type
        if mtype == MSG_DATA:  # the common case first
            self.stats["data_msgs"] += 1
        elif mtype == MSG_WINDOW:
            self._posted.append(WRITE_COOKIE)
            if self._windows:
                self.stats["window_writes_overlapped"] += 1
                if not send.offset:
                    self.stats["window_wraps"] += 1
            self._windows.append(send.offset)
            self._window_head = send.offset + send.length
            self.stats["window_writes"] += 1
        elif mtype == MSG_CREDIT:
            self.stats["credit_msgs"] += 1
        elif mtype == MSG_EOF:
            self.eof_sent = True
        self._posted.append(self._send_cookies[slot])
        self._unsignalled = 0 if send.signalled else self._unsignalled + 1
        self._owed -= send.credits
        self._release_pending -= send.release
        if send.takes_credit:
            self._credits -= 1
        if mtype == MSG_DATA or mtype == MSG_WINDOW:
            n = send.length
            if n == self._pending:  # everything (a small write): nothing to walk
                self._chunks.clear()
                self._head = self._pending = 0
            else:
                self._consume(n)
            self.stats["bytes_sent"] += n

    def _consume(self, n: int) -> None:
        """Drop the first ``n`` pending bytes (they were copied into registered memory and posted)."""
        self._pending -= n
        chunks, head = self._chunks, self._head
        while n:
            first = chunks[0]
            left = len(first) - head
            if n < left:
                if type(first) is bytearray:
                    del first[:head + n]  # cheap at the front of a bytearray; frees what was sent
                    head = 0
                else:
                    head += n
                break
            del chunks[0]
            n -= left
            head = 0
        self._head = head

    def on_send_complete(self, cookie: Tuple[str, int]) -> None:
        """A send or window write completed: it and everything posted before it are done."""
        posted = self._posted
        try:
            last = posted.index(cookie)
        except ValueError:
            return  # an unsignalled request's completion never comes; a stray one changes nothing
        done = posted[:last + 1]
        del posted[:last + 1]
        for request in done:
            if request == WRITE_COOKIE:
                self._windows_completed += 1
                self._retire_windows()
            else:
                self._free_slots.append(request[1])

    def _retire_windows(self) -> None:
        """Free the oldest window writes that are both released and completed."""
        while self._windows_released and self._windows_completed:
            self._windows.popleft()
            self._windows_released -= 1
            self._windows_completed -= 1

    # -- the reader's side ---------------------------------------------------------------------
    def on_received(self, slot: int, header: Any, length: int) -> Optional[Message]:
        """A receive completed in ``slot`` with ``length`` bytes; ``header`` holds (at least) its first 8 bytes.

        Takes the credits and RELEASE it carries.  Returns the message to hand
        over now (CREDIT messages too: their slot is re-posted at once), or None
        when it is held because reading is paused (or earlier ones are held).
        Raises :class:`StreamProtocolError` when the peer broke the protocol.
        """
        if not 0 <= slot < self.nslots or not self._recv_posted[slot]:
            raise StreamProtocolError(f"stream protocol error: a message arrived in receive slot {slot}, "
                                      f"which is not posted")
        mtype = 0
        if length >= _HEADER_SIZE and len(header) >= _HEADER_SIZE:
            # the common case, a well-formed DATA message, checked here without building a Header
            mtype, flags, credits, plen = _unpack_header(header)
        if mtype != MSG_DATA or flags or plen > length - _HEADER_SIZE:
            hdr = decode_header(header, length)  # every check, and the error that names what is wrong
            mtype, flags, credits, plen = hdr.type, hdr.flags, hdr.credits, hdr.length
        if self._credits + credits > self._peer_credits:
            raise StreamProtocolError(f"stream protocol error: the peer returned {credits} credits while we "
                                      f"hold {self._credits} of the {self.peer.credits} it granted")
        offset = released = 0
        if mtype != MSG_DATA or flags:  # (a DATA message mostly carries neither)
            if mtype == MSG_WINDOW:
                offset = 0 if flags & FLAG_WRAP else self._window_next
                if not self.cfg.window_size or offset + plen > self.cfg.window_size:
                    raise StreamProtocolError(f"stream protocol error: WINDOW of {plen} bytes at offset {offset} "
                                              f"into a window of {self.cfg.window_size}")
            released = flags & RELEASE_MASK
            unreleased = len(self._windows) - self._windows_released
            if released > unreleased:
                raise StreamProtocolError(f"stream protocol error: the peer released {released} window writes "
                                          f"while {unreleased} were unreleased")
        if self.eof_received and mtype != MSG_CREDIT:
            raise StreamProtocolError(f"stream protocol error: {_MSG_NAMES[mtype]} after EOF")
        self._recv_posted[slot] = False
        self._credits += credits
        if released:
            self._windows_released += released
            self._retire_windows()
        if mtype == MSG_WINDOW:
            self._window_next = offset + plen
        message = Message(mtype, slot, plen, offset)
        if mtype == MSG_EOF:
            self.eof_received = True  # even when held: nothing may follow it on the wire
        if mtype == MSG_CREDIT:
            return message
        if self._held or not self._reading:
            self._held.append(message)
            return None
        return message

    def consumed(self, message: Message) -> int:
        """``message`` was handed over and its slot is being re-posted: owe the peer its credit.

        Returns the slot to re-post.  For a WINDOW message the window is
        released to the peer with the next message.
        """
        if self._recv_posted[message.slot]:
            raise RuntimeError(f"receive slot {message.slot} consumed twice")
        self._recv_posted[message.slot] = True
        if message.type != MSG_CREDIT:
            self._owed += 1
        if message.type == MSG_WINDOW:
            self._release_pending += 1
        if message.type in (MSG_DATA, MSG_WINDOW):
            self.stats["bytes_received"] += message.length
        return message.slot

    def pause_reading(self) -> None:
        """Hold received messages (their slots stay used, so their credits are not returned)."""
        self._reading = False

    def resume_reading(self) -> None:
        """Hand over messages again; :meth:`next_held` gives the held ones in order."""
        self._reading = True

    def hold_rest(self, message: Message) -> None:
        """Hold the rest of ``message`` (its ``fed`` bytes handed over) first of all: the protocol paused
        reading part way through it; its slot stays used until the rest went too."""
        self._held.appendleft(message)

    def next_held(self, force: bool = False) -> Optional[Message]:
        """The oldest held message if reading (or ``force``: the connection is ending), else None."""
        if self._held and (self._reading or force):
            return self._held.popleft()
        return None

    def drop_held(self) -> None:
        """Forget held messages (the connection is gone)."""
        self._held.clear()

    def disconnect_error(self, broken: bool, closing: bool) -> Optional[str]:
        """The peer disconnected: None if that is a clean end (its EOF came first, or we were closing and it
        answered, and nothing written here is left unsent), else why the reader and writer see a reset."""
        if not broken and (self.eof_received or closing) and not self._pending:
            return None
        if broken:
            reason = "broke"
        elif self._pending:  # (as TCP resets a connection whose peer goes with data unread)
            reason = f"was closed by the peer with {self._pending} bytes written here not yet sent"
        else:
            reason = "was closed by the peer without EOF"
        return f"Connection reset by peer (the RDMA connection {reason})"

    def __repr__(self) -> str:
        return (f"<StreamCore credits={self._credits} owed={self._owed} buffered={self._pending} "
                f"free_slots={len(self._free_slots)} windows_in_flight={len(self._windows)}>")

