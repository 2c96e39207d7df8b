"""The asyncio side of one aiodat stream connection: :class:`RdmaTransport`, ``create_connection``, ``open_connection``.

The transport owns the RDMA resources of the connection and does the posting
and the waiting; every protocol decision (what to send, which slot, whether a
credit allows it, what a received header means) is the
:class:`~aiodat.streams.protocol.StreamCore`'s.
"""
from __future__ import annotations

import asyncio
import warnings
import weakref
from asyncio import constants as _asyncio_constants
from asyncio import transports as _asyncio_transports
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from aiodat._shim._posts import post_recv as _hot_post_recv
from aiodat._shim._posts import post_send as _hot_post_send
from aiodat._shim._streamcore import Receiver, Sender
from aiodat.cm import check_port, check_timeout, loopback_kind, refuse_loopback, resolve_within
from aiodat.errors import ConnectionBroken, DATError, InvalidAddress, InvalidParameter
from aiodat.evd import EVD, ConnectionEvent, DTOCompletionEvent, EventType
from aiodat.streams.pool import IARef, device_addresses
from aiodat.streams.protocol import (
    DEFAULT_LIMIT,
    HEADER,
    MAX_WINDOWS,
    MSG_DATA,
    MSG_EOF,
    MSG_WINDOW,
    WRITE_COOKIE,
    Message,
    PeerParams,
    StreamConfig,
    StreamCore,
    StreamProtocolError,
    WindowDesc,
    encode_params,
    parse_params,
    split_kwds,
)

__all__ = ["RdmaTransport", "create_connection", "open_connection"]

_HEADER_SIZE = HEADER.size


class Resources:
    """PZ, registered buffers, one EVD (DTO + connection events) and the EP of one stream."""

    def __init__(self, ia: Any, cfg: StreamConfig) -> None:
        from aiodat.ep import EPAttr
        from aiodat.evd import EvdFlags
        from aiodat.memory import Privileges, Segment

        self.cfg = cfg
        self.nrecv = self.nsend = cfg.slots
        size = cfg.buffer_size
        self.pz = ia.create_pz()
        self.evd: Optional[EVD] = None  # (None only until made: close() after a failed __init__)
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
            self.evd = ia.create_evd(self.nrecv + self.nsend + 16, EvdFlags.DTO | EvdFlags.CONNECTION,
                                     busy_poll_us=cfg.busy_poll_us)
            # the send slots, the window writes in flight, and one spare (a foreign write, docs/streams.md)
            attrs = EPAttr(max_recv_dtos=self.nrecv, max_request_dtos=self.nsend + MAX_WINDOWS + 1)
            self.ep = ia.create_ep(self.pz, recv_evd=self.evd, request_evd=self.evd, connect_evd=self.evd,
                                   attrs=attrs)
            self.recv_segs = [Segment(self.lmr, i * size, size) for i in range(self.nrecv)]
            self.recv_cookies = [("r", i) for i in range(self.nrecv)]  # made once, not per re-post
            self.send_cookies = [("s", i) for i in range(self.nsend)]  # StreamCore's send cookies, made once
            # the last Segment each send slot was posted with: a request/response stream sends the
            # same length again and again, and a Segment (a frozen dataclass) is costly to make
            self.send_segs = [Segment(self.lmr, self.send_base + i * size, HEADER.size) for i in range(self.nsend)]
            self._Segment = Segment
            for i in range(self.nrecv):
                self.post_recv(i)
        except BaseException:
            self.close()
            raise

    def post_recv(self, i: int) -> None:
        self.ep.post_recv(self.recv_segs[i], self.recv_cookies[i])

    def slot_segment(self, slot: int, wire: int) -> Any:
        """The Segment of send slot ``slot`` for ``wire`` bytes: the one it was last posted with when
        the length is the same (see send_segs), else a new one, kept for the next time."""
        seg = self.send_segs[slot]
        if seg.length != wire:
            seg = self.send_segs[slot] = self._Segment(self.lmr, self.send_base + slot * self.cfg.buffer_size, wire)
        return seg

    def params(self) -> bytes:
        """Our private data: the config and the window's descriptor."""
        window = None
        if self.window_lmr is not None:
            r = self.window_lmr.remote()
            window = WindowDesc(r.address, r.length, r.rmr_context)
        return encode_params(self.cfg, window)

    def close(self) -> None:
        for handle in (self.pz, self.evd):
            if handle is not None:
                try:
                    handle.close()
                except DATError:
                    pass


def _feed_buffered(protocol: asyncio.BufferedProtocol, data: memoryview, transport: asyncio.ReadTransport,
                   force: bool) -> int:
    """Copy ``data`` into the buffers ``protocol.get_buffer()`` hands out, calling
    ``buffer_updated()`` for each, as asyncio's own transports feed a BufferedProtocol.  Returns how
    many bytes are left because the protocol paused reading part way (unless ``force``: the
    connection is ending), as asyncio feeds no more after a pause; the rest is dropped, and 0
    returned, once it closed the transport (no data after close())."""
    while data and not transport.is_closing():
        # the views are released before buffer_updated(): a protocol may resize its bytearray there
        with memoryview(protocol.get_buffer(len(data))) as given, given.cast("B") as buffer:
            n = min(len(buffer), len(data))
            if not n:
                raise RuntimeError("protocol.get_buffer() returned an empty buffer")
            buffer[:n] = data[:n]
        protocol.buffer_updated(n)
        data = data[n:]
        if data and not force and not transport.is_reading() and not transport.is_closing():
            return len(data)
    return 0


def _takes_views(protocol: asyncio.BaseProtocol) -> bool:
    """Whether ``data_received`` may get a view of the receive slot, which is posted again once it
    returns: only asyncio's own StreamReaderProtocol's feeding asyncio's own StreamReader, which copies
    the bytes into its buffer.  A subclass's data_received, one rebound on the instance, or a reader
    whose feed_data is not StreamReader's (it may keep the chunk) gets bytes, as from asyncio's
    transports.  Checked per connection and set_protocol(): a data_received or feed_data rebound
    later is not seen (call set_protocol() again after rebinding)."""
    if (getattr(type(protocol), "data_received", None) is not asyncio.StreamReaderProtocol.data_received
            or "data_received" in getattr(protocol, "__dict__", ())):
        return False
    reader = getattr(protocol, "_stream_reader", _NO_READER)  # (a weakly held reader: None once gone)
    if reader is None:
        return True  # asyncio's data_received drops the bytes
    return (reader is not _NO_READER
            and getattr(type(reader), "feed_data", None) is asyncio.StreamReader.feed_data
            and "feed_data" not in getattr(reader, "__dict__", ()))


_NO_READER = object()


def stream_port(port: Any, lowest: int) -> int:
    """A stream's port as asyncio takes it (getaddrinfo reads it): an int or its digits as a str,
    not a float, which int() would cut; checked as cm.check_port checks it (create_connection and
    create_server)."""
    if isinstance(port, str) and port.isascii() and port.isdigit():
        port = int(port)
    return check_port(port, lowest)


def _byte_view(data: Any) -> memoryview:
    """A flat byte view of any C-contiguous bytes-like object, else TypeError (not bytes-like) or
    BufferError (not C-contiguous), as write() and writelines() raise before buffering anything."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__!r}") from None
    if not view.c_contiguous:
        raise BufferError("data is not a C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class RdmaTransport(_asyncio_transports._FlowControlMixin):
    """An :class:`asyncio.Transport` over one RDMA RC connection (docs/streams.md has the protocol).

    It keeps asyncio's transport contract as the selector transports do:
    asyncio's own write flow control (``pause_writing()`` above the high-water
    mark, ``resume_writing()`` at the low one, ``get_write_buffer_size()``),
    ``writelines``, ``write_eof``, and ``loop.sendfile(transport, file)`` in
    asyncio's fallback mode (there is no socket for ``os.sendfile``: asyncio
    reads the file and calls ``write``).  Writes made in one loop iteration go
    out together, in as few sends as their size allows.

    ``get_extra_info`` knows ``peername``, ``sockname``, ``socket`` (None),
    ``aiodat_ep`` (the :class:`aiodat.EP`), ``aiodat_ia`` and
    ``aiodat_config`` (the :class:`StreamConfig`).
    """

    # asyncio's loop.sendfile() reads this: no native sendfile, use the read-and-write() fallback
    _sendfile_compatible = _asyncio_constants._SendfileMode.FALLBACK

    if TYPE_CHECKING:
        # set and defined at runtime by asyncio's BaseTransport and _FlowControlMixin, whose stubs
        # list them only in __slots__ (or not at all)
        _extra: Mapping[str, Any]
        _loop: asyncio.AbstractEventLoop
        _protocol_paused: bool
        _high_water: int
        _low_water: int

        def _maybe_pause_protocol(self) -> None: ...
        def _maybe_resume_protocol(self) -> None: ...
        def _set_write_buffer_limits(self, high: Optional[int] = None, low: Optional[int] = None) -> None: ...

    def __init__(self, loop: asyncio.AbstractEventLoop, res: Resources, iaref: IARef, peer: PeerParams,
                 protocol: asyncio.BaseProtocol,
                 on_lost: Optional[Callable[["RdmaTransport"], None]] = None) -> None:
        from aiodat.ep import CompletionFlags
        from aiodat.memory import RemoteRegion

        ep = res.ep
        param = ep.query()
        super().__init__({
            "peername": param.remote_address, "sockname": param.local_address, "socket": None,
            "aiodat_ep": ep, "aiodat_ia": iaref.ia, "aiodat_config": res.cfg,
        }, loop)
        self._res = res
        self._iaref = iaref
        self._protocol = protocol
        self._on_lost = on_lost
        self._core = StreamCore(res.cfg, peer)
        self._size = res.cfg.buffer_size
        self._peer_window: Optional[RemoteRegion] = None
        if self._core.window_length and peer.window is not None:
            self._peer_window = RemoteRegion(peer.window.address, self._core.window_length, peer.window.rkey)
        if self._core.window_length >= res.cfg.rdma_threshold:
            # Bulk bytes leave in window writes of up to a window each: the writer may buffer half
            # a window while the last write is in flight.  asyncio's 64 KiB mark would cut every
            # write to about 128 KiB, and a write costs rxe about as much per call as per 16 KiB.
            self._set_write_buffer_limits(high=max(self._core.window_length // 2, self._high_water))
        self._SIGNALLED, self._SUPPRESS = CompletionFlags.DEFAULT, CompletionFlags.SUPPRESS
        self._eof_delivered = False
        self._closing = False
        self._lost = False
        self._conn_lost_writes = 0
        self._idle: Optional[asyncio.Future[None]] = None
        self._close_task: Optional[asyncio.Task[None]] = None
        self._close_watch: Optional[asyncio.TimerHandle] = None
        self._stream_protocol = _takes_views(protocol)
        #: an asyncio.BufferedProtocol: fed through get_buffer()/buffer_updated() by the Python path
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        # The common case in C (_shim/streamcore.c): the Receiver is the EVD's callback and takes a
        # received DATA message from its completion to data_received and the re-post; the Sender
        # takes a small write to its post, and schedules the flush.  Each reaches this transport
        # through a weak reference, for every other case (_on_events, _flush...).  The Receiver's
        # ``delivered`` tells _handle the batch gave the protocol data; its ``open`` is False from
        # close() on and its ``alive`` once the connection is lost: then the Python path
        # (_completion) takes every completion.
        owner = weakref.ref(self)
        # (their posts call the EP's C hot paths as post.py does, and its methods for anything else)
        self._sender = Sender(self._core, res.arena, res.send_base, self._size, res.ep, _hot_post_send,
                              res.send_segs, res.send_cookies, res.slot_segment, self._SIGNALLED, self._SUPPRESS,
                              owner, loop.call_soon, DATError)
        self._receiver = Receiver(self._core, res.arena, res.view, self._size, owner, self._stream_protocol,
                                  res.ep, _hot_post_recv, res.recv_segs, res.recv_cookies, DTOCompletionEvent,
                                  DATError, self._sender)
        self._receiver.open = not self._buffered  # (the C path calls data_received only)
        #: messages and bytes moved, for tests and benchmarks: sends, window writes, credit messages
        self.stats = self._core.stats

    def _start(self) -> None:
        try:
            self._protocol.connection_made(self)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # (CancelledError too, as asyncio's transports take it)
            # as a data_received error (and uvloop's TCP transport): reported, and the connection
            # dropped; left as it was, no completion would ever reach it (the EVD's callback is set
            # below), so neither side's reads, nor a server's wait_closed(), would ever end
            self._loop.call_exception_handler({"message": "protocol.connection_made() failed",
                                               "exception": exc, "transport": self, "protocol": self._protocol})
            self.abort()
        if not self._lost:
            # connection_made (a start_server callback in it) may have rebound data_received
            if self._stream_protocol:
                self._stream_protocol = self._receiver.as_view = _takes_views(self._protocol)
            # completions come to the Receiver from inside the loop's reader callback, as a socket's
            # bytes come to data_received: no task, no Future per wake-up.  This transport is held
            # weakly there, so a stream the program drops unclosed is collected (see __del__), as it
            # is with a socket.
            ref = weakref.ref(self)

            def on_error(exc: BaseException) -> None:
                transport = ref()
                if transport is not None and not transport._lost:
                    # the EVD under the connection failed (its CQ could not be polled or armed), or
                    # was freed (the IA closed under the stream): nothing more would arrive, so the
                    # connection ends now, with the cause
                    evd = transport._res.evd
                    assert evd is not None  # (a transport's Resources are complete)
                    if evd.closed:
                        transport._finish(ConnectionBroken(f"the RDMA stream's EVD was freed under it (was its IA "
                                                           f"closed while the stream was open?): {exc!r}"))
                    else:
                        transport._finish(ConnectionBroken(f"the RDMA stream's completion queue failed: {exc!r}"))

            evd = self._res.evd
            assert evd is not None  # (a transport's Resources are complete)
            evd.set_callback(self._receiver.on_events, on_error=on_error)

    def __del__(self) -> None:
        # Only the warning: the EP, EVD, LMRs and PZ of the stream are freed by their Raw holders
        # as they are collected (finalizers never call into the loop).  The shared IA stays in
        # the loop's pool.
        if not getattr(self, "_lost", True):
            warnings.warn(f"unclosed RDMA stream transport {self!r}", ResourceWarning)

    # -- asyncio.BaseTransport -------------------------------------------------------------
    def is_closing(self) -> bool:
        """True once close() or abort() was called or the connection was lost."""
        return self._closing

    def close(self) -> None:
        """Send what is buffered, then EOF, then disconnect; ``connection_lost(None)`` follows.

        A peer that makes no progress (takes no data, returns no credits, answers no disconnect)
        for the ``close_timeout`` stream option's seconds has the connection aborted instead:
        ``connection_lost`` then gets a ConnectionBroken saying what was not sent."""
        if self._closing:
            return
        self._closing = True
        self._receiver.open = False  # (no data_received after close(): the Python path knows)
        if self._lost:
            return
        self._core.write_eof()
        self._flush()
        self._close_task = self._loop.create_task(self._close_when_flushed())

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the connection to another protocol."""
        self._protocol = protocol  # (the Receiver reads it per message)
        self._stream_protocol = self._receiver.as_view = _takes_views(protocol)
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        if not self._closing:
            self._receiver.open = not self._buffered

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The protocol the transport delivers to."""
        return self._protocol

    # -- asyncio.ReadTransport ---------------------------------------------------------------
    def is_reading(self) -> bool:
        """False while paused by pause_reading()."""
        return self._core.reading and not self._closing

    def pause_reading(self) -> None:
        """Stop delivering data; received messages are held and their credits not returned."""
        self._core.pause_reading()

    def resume_reading(self) -> None:
        """Deliver what was held (on the next loop iteration) and return its credits."""
        if not self._core.reading:
            self._core.resume_reading()
            self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self._lost:
            return
        self._deliver_held()
        self._flush()

    # -- asyncio.WriteTransport --------------------------------------------------------------
    def set_write_buffer_limits(self, high: Optional[int] = None, low: Optional[int] = None) -> None:
        """Set the high- and low-water marks of the write buffer (asyncio's defaults: 64 KiB / 16 KiB).

        ``pause_writing()`` is called on the protocol when the buffer grows above ``high``,
        ``resume_writing()`` when it falls to ``low``; ValueError unless ``high >= low >= 0``.
        """
        super().set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> Tuple[int, int]:
        """(low, high) water marks."""
        return self._low_water, self._high_water

    def get_write_buffer_size(self) -> int:
        """Bytes written but not yet handed to the RDMA device (waiting for the end of the loop
        iteration, for the peer's credits or for a free send slot)."""
        return self._core.buffered

    def write(self, data: Union[bytes, bytearray, memoryview]) -> None:
        """Buffer ``data``; it is sent, as far as the peer's credits allow, at the end of this loop
        iteration, together with every other write of the iteration.  Never blocks."""
        if type(data) is bytes and data and not (self._closing or self._core.eof_requested):
            # the common case in as few steps as it takes (every small write passes here): the
            # checks below, then buffer and schedule the flush (in C), and pause past the mark
            if self._sender.write(data) > self._high_water:
                self._maybe_pause_protocol()
            return
        if not isinstance(data, (bytes, bytearray)) and (type(data) is not memoryview or not data.c_contiguous):
            # any other C-contiguous buffer (array.array, mmap, numpy...: as uvloop's write takes
            # them, and asyncio's writelines); TypeError or BufferError otherwise
            data = _byte_view(data)
        if self._core.eof_requested and not self._closing:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if self._lost or self._closing:
            self._conn_lost_writes += 1
            return
        self._core.write(data)
        self._schedule_flush()
        self._maybe_pause_protocol()

    def writelines(self, list_of_data: Iterable[Union[bytes, bytearray, memoryview]]) -> None:
        """Write each buffer in turn (they go out together, as every write of one iteration)."""
        if self._core.eof_requested and not self._closing:
            raise RuntimeError("Cannot call writelines() after write_eof()")
        # any C-contiguous bytes-like item, as asyncio's (which joins them, or takes a memoryview of
        # each); all or nothing: a bad item raises before any of the others is buffered (else the
        # caller, told the call failed, would not know which bytes went out)
        items = [data if isinstance(data, (bytes, bytearray)) else _byte_view(data) for data in list_of_data]
        for data in items:
            self.write(data)

    def write_eof(self) -> None:
        """Close the write side after the buffered data: the peer's reader sees EOF; we can still read."""
        if self._closing or self._core.eof_requested:
            return
        self._core.write_eof()
        self._schedule_flush()

    def can_write_eof(self) -> bool:
        """True: aiodat streams support half-close."""
        return True

    def abort(self) -> None:
        """Drop the connection at once, without EOF: the peer sees ConnectionResetError.  What this
        loop iteration's writes gathered is posted first, as far as the peer's credits allow (asyncio's
        write() has sent it already); anything else written and not sent is dropped."""
        self._abort(None)

    def _abort(self, exc: Optional[BaseException]) -> None:
        """abort(), with ``exc`` for connection_lost."""
        if self._lost:
            return
        self._closing = True
        self._receiver.open = False
        if self._core.buffered:
            from aiodat.ep import EPState

            ep = self._res.ep
            if not ep.closed and ep.state is EPState.CONNECTED:
                # asyncio's write() sends at once, so a reply written just before abort() leaves:
                # post what this iteration's writes gathered (one flush, as far as credits allow),
                # while the QP is still ours; the rest is dropped
                self._flush()
                if self._lost:
                    return
        self._core.discard()
        self._finish(exc)

    # -- sending: post what the core says ----------------------------------------------------------
    def _schedule_flush(self) -> None:
        # Writes of one loop iteration are gathered and posted once, when the iteration's other
        # callbacks have run: several small writes become one DATA message, not one send each.
        # The Sender's scheduled_flush runs then: a small write's post in C, anything else _flush.
        self._sender.schedule()

    def _flush(self) -> None:
        """Post every send the core allows now (data, window writes, EOF, CREDIT)."""
        if self._lost:
            return
        res, core = self._res, self._core
        try:
            posted = self._sender.flush()  # a small write's DATA send: take_data and the post
        except DATError as exc:
            self._post_failed(exc)
            return
        # (take_data leaves next_send nothing: no bytes pending, no EOF, credit or release due)
        send = None if posted else core.next_send()
        if send is not None:
            view, size, send_base, cookies = res.view, self._size, res.send_base, res.send_cookies
            post_send, signalled, suppress = res.ep.post_send, self._SIGNALLED, self._SUPPRESS
            try:
                while send is not None:
                    n, slot = send.length, send.slot
                    base = send_base + slot * size
                    view[base:base + _HEADER_SIZE] = send.header
                    if send.type == MSG_DATA:
                        core.copy_pending(view[base + _HEADER_SIZE:base + _HEADER_SIZE + n], n)
                        wire = _HEADER_SIZE + n
                    else:
                        if send.type == MSG_WINDOW:
                            at = send.offset  # the staging buffer mirrors the peer's window
                            # (the core plans window writes only with a window: window_length > 0)
                            assert self._peer_window is not None
                            staging = res.staging_base + at
                            if not core.copy_pending_into(res.arena, staging, n):  # (in C: bytes chunks)
                                core.copy_pending(view[staging:staging + n], n)
                            # unsignalled: the WINDOW send after it is signalled and covers it; one
                            # request, by the batch's C path (post_rdma_write's Python costs more than
                            # the rest of the window's steps together)
                            res.ep.post_rdma_write_batch(((res.lmr[staging:staging + n], self._peer_window[at:at + n],
                                                           WRITE_COOKIE),), suppress)
                        wire = _HEADER_SIZE
                    post_send(res.slot_segment(slot, wire), cookies[slot],
                              signalled if send.signalled else suppress)
                    core.sent(send)
                    send = core.next_send()
            except (DATError, ValueError) as exc:  # ValueError: the arena's view, released with its LMR
                self._post_failed(exc)
                return
        self._after_flush()

    def _after_flush(self) -> None:
        """What follows a flush: resume a paused protocol, and wake close() once every send is done."""
        if self._protocol_paused:
            self._maybe_resume_protocol()
        if self._idle is not None:
            self._check_idle()

    def _post_failed(self, exc: Exception) -> None:
        """A post on the stream's EP failed: when the EP left CONNECTED under us (the peer went away)
        the connection event follows and ends the stream; otherwise (the EP or its LMR was freed
        under the stream too: no event will come) it ends now."""
        from aiodat.ep import EPState

        res = self._res
        if res.ep.closed or res.lmr.closed:
            self._finish(ConnectionBroken(f"sending on the RDMA stream failed: its EP or buffers were freed "
                                          f"under it (was its IA closed while the stream was open?): {exc!r}"))
            return
        if res.ep.state is not EPState.CONNECTED:
            return
        self._finish(ConnectionBroken(f"sending on the RDMA stream failed: {exc}"))

    def _check_idle(self) -> None:
        idle = self._idle
        if idle is not None and not idle.done() and self._core.is_flushed():
            idle.set_result(None)

    def _close_progress(self) -> Tuple[int, int, int, bool]:
        """What changes while the peer takes the close's data: bytes not yet sent, free send slots
        (a send completed), window writes in flight, the EOF sent."""
        core = self._core
        return core.buffered, core.free_send_slots, core.windows_in_flight, core.eof_sent

    def _unsent(self) -> str:
        """What a close that ends now leaves undone, for connection_lost's error."""
        core = self._core
        return (f"{core.buffered} bytes written were not sent" if core.buffered
                else "its EOF was not sent" if not core.eof_sent
                else "its last sends had not completed")

    def _watch_close(self, before: Tuple[int, int, int, bool], timeout: float) -> None:
        """close()'s bound: a peer that took nothing for ``timeout`` s (hung, or not reading) has the
        connection aborted, as it would hold it, and the close, for ever; one that moves is waited on."""
        if self._lost or self._core.is_flushed():
            return
        now = self._close_progress()
        if now != before:
            self._close_watch = self._loop.call_later(timeout, self._watch_close, now, timeout)
            return
        self._abort(ConnectionBroken(f"close() gave up: the peer made no progress for {timeout} s "
                                     f"(close_timeout) and {self._unsent()}"))

    async def _close_when_flushed(self) -> None:
        timeout = self._res.cfg.close_timeout
        try:
            if not self._core.is_flushed() and not self._lost:
                self._idle = self._loop.create_future()
                if timeout is not None:
                    self._close_watch = self._loop.call_later(timeout, self._watch_close,
                                                              self._close_progress(), timeout)
                await self._idle
            if self._lost:
                return
            try:
                await self._res.ep.disconnect(graceful=True, timeout=timeout)
            except DATError:
                pass
            self._finish(None)
        except asyncio.CancelledError:
            # cancelled from outside (a shutdown cancelling every task): what is not sent yet is
            # dropped, so the protocol hears of it, not of a clean close
            exc = None
            if not self._lost and not self._core.is_flushed():
                exc = ConnectionBroken(f"close() was cancelled before the stream was flushed: {self._unsent()}")
            self._finish(exc)
            raise

    # -- receiving: what the EVD's callback (the Receiver) leaves, then let the core decide ----------
    def _on_events(self, events: List[Any], start: int = 0) -> None:
        """The rest of a batch of completions and events from ``events[start]`` on: the first one
        the Receiver's on_events (the connection EVD's callback) did not take, and those after it."""
        if self._lost:
            return
        try:
            self._handle(events[start:] if start else events)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._batch_failed(exc)

    def _batch_failed(self, exc: BaseException) -> None:
        """Taking a batch raised ``exc`` (here or in the Receiver's C)."""
        if self._receiver.protocol_failed:  # (the Receiver's data_received raised)
            self._data_received_failed(exc)
        elif not self._lost:  # the connection is unusable; the loop's handler is not the place
            self._finish(ConnectionBroken(f"the RDMA stream failed: {exc!r}"))

    def _handle(self, events: Sequence[Any]) -> None:
        # (the Receiver reset its ``delivered`` when the batch began, and set it for what it took)
        lost_event = None
        receiver = self._receiver
        receive = receiver.receive
        for event in events:
            if receive(event):  # a DATA message, handed over and its slot re-posted, in C
                continue
            if self._lost:
                return
            if isinstance(event, ConnectionEvent):
                if event.type in (EventType.CONNECTION_EVENT_DISCONNECTED, EventType.CONNECTION_EVENT_BROKEN):
                    lost_event = event
                continue
            self._completion(event)
            if self._lost:
                return
        if lost_event is not None:
            # take every completion still in the CQ first: data the peer sent before leaving
            evd = self._res.evd
            assert evd is not None  # (a transport's Resources are complete)
            evd.set_callback(None)  # (dequeue refuses while a callback is set)
            while True:
                more = evd.dequeue()
                if more is None:
                    break
                if not isinstance(more, ConnectionEvent):
                    self._completion(more)
                    if self._lost:
                        return
            self._peer_lost(lost_event.type is EventType.CONNECTION_EVENT_BROKEN)
            return
        if receiver.delivered:
            # The protocol was handed data, and data_received has just queued the wake-up of
            # whoever reads it (the StreamReader's waiter).  A flush queued now runs right after
            # that reader, in the same loop iteration: a reply it writes is posted there, not one
            # iteration later, as a TCP transport's write() sends at once.  That flush also takes
            # the credits just owed, so flushing here as well would only look for nothing to send
            # (once per message), unless the protocol wrote from data_received itself.
            if self._core.buffered:
                self._flush()
            self._schedule_flush()
        else:
            self._flush()

    def _completion(self, event: Any) -> None:
        cookie = event.cookie  # the stream's own are pairs; anything else is foreign (docs/streams.md)
        kind, slot = cookie if type(cookie) is tuple and len(cookie) == 2 else (None, None)
        if not event.ok:
            if event.flushed or self._closing:
                return  # the QP left CONNECTED: the connection event tells the rest
            self._finish(ConnectionBroken(f"RDMA {event.operation.value if event.operation else 'op'} "
                                          f"failed: {event.status}"))
            return
        if kind in ("s", "w"):
            assert slot is not None  # (a stream cookie: a pair)
            self._core.on_send_complete((kind, slot))
            self._check_idle()
        elif kind == "r":
            assert slot is not None  # (a stream cookie: a pair)
            base = slot * self._size
            res, core = self._res, self._core
            n = core.on_data(slot, res.arena, base, event.transferred_length)
            if n >= 0:  # the common case: a DATA message, handed over now
                base += _HEADER_SIZE
                left = self._data(res.view[base:base + n])
                if left:  # (a BufferedProtocol paused part way: the rest waits for resume_reading)
                    core.hold_rest(Message(MSG_DATA, slot, n, 0, n - left))
                elif self._repost(slot):
                    core.data_consumed(slot, n)
                return
            try:
                message = core.on_received(slot, res.view[base:base + HEADER.size], event.transferred_length)
            except StreamProtocolError as exc:
                self._finish(exc)
                return
            if message is not None:
                self._deliver(message)

    def _deliver_held(self, force: bool = False) -> None:
        while not self._res.ep.closed:
            message = self._core.next_held(force)
            if message is None:
                return
            self._deliver(message, force)

    def _deliver(self, message: Message, force: bool = False) -> None:
        res = self._res
        left = 0
        if message.type == MSG_DATA:
            base = message.slot * self._size + _HEADER_SIZE
            left = self._data(res.view[base + message.fed:base + message.length], force)
        elif message.type == MSG_WINDOW:
            left = self._data(res.window_view[message.offset + message.fed:message.offset + message.length], force)
        elif message.type == MSG_EOF:
            self._eof()
        if left:  # (a BufferedProtocol paused part way: the rest waits for resume_reading)
            self._core.hold_rest(message._replace(fed=message.length - left))
        elif self._repost(message.slot):
            self._core.consumed(message)

    def _repost(self, slot: int) -> bool:
        """Post receive slot ``slot`` again after its message was handed over; False when the stream
        ended meanwhile or the EP is disconnected (nothing more will arrive)."""
        res = self._res
        if self._lost or res.ep.closed:
            return False
        try:
            res.ep.post_recv(res.recv_segs[slot], res.recv_cookies[slot])
        except DATError:
            return False
        return True

    def _data(self, view: memoryview, force: bool = False) -> int:
        """Hand ``view`` to the protocol; the count of its bytes left because a BufferedProtocol
        paused reading part way (not with ``force``: the connection is ending), else 0."""
        if self._closing and not self._lost:
            return 0  # as asyncio: no data_received after close()
        self._receiver.delivered = True
        try:
            if self._buffered:  # as asyncio's transports feed one (get_buffer, copy, buffer_updated)
                return _feed_buffered(self._protocol, view, self, force)  # type: ignore[arg-type]
            self._protocol.data_received(view if self._stream_protocol else bytes(view))  # type: ignore[attr-defined]
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # (a CancelledError too: asyncio's transports take any)
            self._data_received_failed(exc)
        return 0

    def _data_received_failed(self, exc: BaseException) -> None:
        """As asyncio's transports: reported, and the connection dropped, lost with ``exc`` (a reader
        sees the error, not an EOF that would pass for the end of the data)."""
        self._loop.call_exception_handler({"message": "protocol.data_received() failed",
                                           "exception": exc, "transport": self, "protocol": self._protocol})
        self._abort(exc)

    def _eof(self) -> None:
        if self._eof_delivered:
            return
        self._eof_delivered = True
        if self._closing:
            return
        keep_open = False
        try:
            keep_open = bool(self._protocol.eof_received())  # type: ignore[attr-defined]
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # as asyncio's _fatal_error: reported, and aborted with it
            self._loop.call_exception_handler({"message": "protocol.eof_received() failed",
                                               "exception": exc, "transport": self, "protocol": self._protocol})
            self._abort(exc)
            return
        if not keep_open:
            self.close()

    # -- the end -------------------------------------------------------------------------------
    def _peer_lost(self, broken: bool) -> None:
        """The peer disconnected (or the connection broke): EOF if it said EOF first, else reset."""
        self._deliver_held(force=True)
        reason = self._core.disconnect_error(broken, self._closing)
        self._finish(None if reason is None else ConnectionBroken(reason))

    def _finish(self, exc: Optional[BaseException]) -> None:
        """Tear down: cancel the tasks, free EP/PZ/LMRs/EVD, release the IA, tell the protocol."""
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self._receiver.open = self._receiver.alive = False
        current = asyncio.current_task(self._loop) if self._loop.is_running() else None
        task = self._close_task
        if task is not None and task is not current and not task.done():
            task.cancel()
        if self._close_watch is not None:
            self._close_watch.cancel()
        evd = self._res.evd
        assert evd is not None  # (a transport's Resources are complete)
        if not evd.closed:
            evd.set_callback(None)
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)
        self._core.drop_held()
        self._core.discard()  # (as asyncio's _force_close: what was written and not sent is dropped, not kept)
        self._res.close()
        self._iaref.release()
        if self._protocol_paused:
            self._protocol_paused = False
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: Optional[BaseException]) -> None:
        try:
            # (typeshed says Exception; asyncio's transports pass a protocol's CancelledError on as well)
            self._protocol.connection_lost(exc)  # type: ignore[arg-type]
        finally:
            on_lost, self._on_lost = self._on_lost, None
            if on_lost is not None:
                on_lost(self)

    def __repr__(self) -> str:
        state = "lost" if self._lost else "closing" if self._closing else "open"
        return f"<aiodat.RdmaTransport {state} peer={self._extra.get('peername')}>"


async def create_connection(protocol_factory: Callable[[], asyncio.BaseProtocol], host: Optional[str] = None,
                            port: Optional[int] = None, *, ia: Any = None, connect_timeout: Optional[float] = 30.0,
                            **kwds: Any) -> Tuple[RdmaTransport, asyncio.BaseProtocol]:
    """``loop.create_connection`` over RDMA: connect to an aiodat stream server at ``host:port``.

    ``ia`` is a device name, an open :class:`aiodat.IA` or None (the device
    whose address is ``host``, else ``$AIODAT_RXE_DEVICE``, else the first
    active one; IAs opened here are shared per event loop, see
    :mod:`aiodat.streams.pool`).  ``buffer_size``, ``recv_depth``,
    ``window_size``, ``rdma_threshold`` and ``busy_poll_us`` set the
    :class:`StreamConfig`.
    Raises ConnectionRefusedError (:class:`aiodat.ConnectionRejected`) when
    nothing listens there, TimeoutError after ``connect_timeout`` seconds.
    """
    cfg, rest = split_kwds(kwds)
    if rest:
        raise TypeError(f"create_connection() got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    if host is None or port is None:
        raise InvalidAddress("aiodat streams need both host and port (there is no sock= form)")
    port = stream_port(port, lowest=1)
    timeout = check_timeout(connect_timeout, "connect_timeout")
    loop = asyncio.get_running_loop()
    host, timeout = await resolve_within(host, 0, timeout)  # (the lookup counts against the timeout)
    if loopback_kind(host):  # (before an IA is opened for it: no device may have an address of that family)
        refuse_loopback(host, device_addresses(), "an RDMA device's own address")
    iaref = IARef(ia, host)
    res = None
    try:
        res = Resources(iaref.ia, cfg)
        reply = await res.ep.connect(host, port, res.params(), timeout=timeout)
        peer = parse_params(reply)
        protocol = protocol_factory()  # (a factory that raises must not leave the connection behind)
        transport = RdmaTransport(loop, res, iaref, peer, protocol)
    except BaseException:
        if res is not None:
            res.close()
        iaref.release()
        raise
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


_Resources = Resources  # the name streams.py had
