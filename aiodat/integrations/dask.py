"""Dask distributed over RDMA: the ``rdma://`` comm backend (``pip install aiodat[dask]``).

distributed finds :class:`RDMABackend` through the ``distributed.comm.backends`` entry point
aiodat declares, so ``LocalCluster(protocol="rdma", host=ADDRESS)``, ``dask scheduler
--protocol rdma --host ADDRESS`` and ``dask worker rdma://ADDRESS:PORT`` work with no import.

How a comm moves a message (docs/integrations.md has the picture):

* Control messages go over one aiodat stream (:mod:`aiodat.streams`, an RC connection with
  credits, EOF and close semantics of TCP).  Frames smaller than :data:`ZERO_COPY_THRESHOLD`
  travel inline in the message that announces the frames.
* Larger frames move without a copy: the sender registers the frame's own buffer
  (``PZ.register``/``register_async``, read-only buffers included); the receiver allocates the
  destination (distributed's ``host_array``), registers it with remote-write access and grants
  it (GRANT); the sender RDMA-writes the frame straight into it, on the stream's own queue pair,
  and announces it with WRITTEN (the queue pair's ordering puts the bytes in place before that
  message arrives); the receiver answers ACK, and both sides deregister.

The RDMA writes are posted on the stream's EP (``transport.get_extra_info("aiodat_ep")``) with
a cookie the stream ignores; one at a time per comm, so the stream's send-queue budget holds.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
import weakref
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import dask.config
import dask.utils
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, ensure_memoryview, get_ip

from aiodat.errors import DATError, InvalidParameter, ModelNotSupported, ProviderNotFound
from aiodat.memory import Privileges, RemoteRegion
from aiodat.streams import open_connection, start_server

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener", "ZERO_COPY_THRESHOLD", "PREFIX"]

logger = logging.getLogger(__name__)

PREFIX = "rdma://"
#: Frames of at least this many bytes move by RDMA write from and into registered memory;
#: smaller ones travel inline over the stream.  ``distributed.comm.rdma.zero-copy-threshold``
#: in dask's config overrides it.  Below it, the three control messages and two registrations
#: of the zero-copy path cost more than the stream's copies.
ZERO_COPY_THRESHOLD = 256 * 1024
#: Buffers at least this large are registered in an executor thread (pinning is slow).
ASYNC_REGISTER_FROM = 4 << 20
#: One RDMA write moves at most this many bytes (within every device's max_msg_sz of 2 GiB).
MAX_WRITE = 1 << 30
#: Bytes of large frames a comm takes in ahead of ``read()``: past them, the next message is granted
#: once ``read()`` takes one (its writer waits, as a ``tcp://`` writer waits on full kernel
#: buffers).  A message is always granted when nothing waits to be read, whatever its size.
#: ``distributed.comm.rdma.receive-ahead`` in dask's config overrides it.
RECEIVE_AHEAD = 256 << 20

# control messages: type, message id, count
_HEAD = struct.Struct("!BQI")
_MSG, _GRANT, _WRITTEN, _ACK = 1, 2, 3, 4
_NAMES = {_MSG: "MSG", _GRANT: "GRANT", _WRITTEN: "WRITTEN", _ACK: "ACK"}
_REGION = 20  # RemoteRegion.to_bytes()
_INLINE, _REMOTE = 0, 1
#: the cookie of our RDMA writes: the stream's completion handler ignores kinds it does not own
_WRITE_COOKIE = ("dask", 0)


def zero_copy_threshold() -> int:
    """The frame size from which frames move by RDMA write (dask config, else the default)."""
    return int(dask.config.get("distributed.comm.rdma.zero-copy-threshold", ZERO_COPY_THRESHOLD))


def receive_ahead() -> int:
    """The bytes of large frames a comm takes in ahead of ``read()`` (dask config, else the default;
    a size such as "64 MiB" is taken too).  InvalidParameter names the key if it is no size."""
    value = dask.config.get("distributed.comm.rdma.receive-ahead", RECEIVE_AHEAD)
    try:
        limit = dask.utils.parse_bytes(value)
    except (ValueError, TypeError, AttributeError):  # (parse_bytes of None: AttributeError)
        limit = -1
    if isinstance(value, bool) or limit < 0:
        raise InvalidParameter(f"distributed.comm.rdma.receive-ahead must be a size in bytes, got {value!r}")
    return limit


class _Closed:
    """Queued into an inbox when the connection ends: getters raise CommClosedError."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Inbox:
    """Reads the stream in a task of its own and sorts what arrives.

    MSG go to ``messages`` for ``read()``: their frames when all came inline, else the task that
    receives the others (:meth:`_receive`) and their size, which ``limit`` bounds; GRANT and ACK
    answer our own write (``for_writer``); WRITTEN belongs to the message being received
    (``for_reader``).  It holds no reference to the comm, so a comm the program drops can be
    collected (its finalizer aborts the stream).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self.reader = reader
        self.writer = writer
        self.name = name
        self.messages: "asyncio.Queue[Any]" = asyncio.Queue()
        self.for_writer: "asyncio.Queue[Any]" = asyncio.Queue()
        self.for_reader: "asyncio.Queue[Any]" = asyncio.Queue()
        self.closed: Optional[_Closed] = None
        #: bytes of large frames granted (or being granted) and not yet taken by read(), and their bound
        self.ahead, self.limit = 0, receive_ahead()
        self._room = asyncio.Event()  # set when read() takes such a message, or the comm ends
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        reader = self.reader
        try:
            while True:
                try:
                    head = await reader.readexactly(_HEAD.size)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise ConnectionError(f"the peer closed in the middle of a message header "
                                              f"({len(exc.partial)} of {_HEAD.size} bytes)") from None
                    self.end("the peer closed the connection")
                    return
                kind, ident, count = _HEAD.unpack(head)
                if kind == _MSG:
                    lengths, modes, inline = await self._read_msg(count)
                    if _REMOTE in modes:
                        # received now, not when read() reaches it: the peer's write() waits for
                        # the GRANT, and a peer that writes before it reads would wait for ever
                        # (tcp://'s write() returns once the bytes are buffered)
                        size = sum(n for n, m in zip(lengths, modes) if m == _REMOTE)
                        task = asyncio.get_running_loop().create_task(
                            self._receive(ident, lengths, modes, inline, size))
                        task.add_done_callback(_retrieve)  # (read() raises its error, if one comes)
                        self.messages.put_nowait((task, size))
                    else:
                        self.messages.put_nowait(inline)
                elif kind == _GRANT:
                    regions = await reader.readexactly(_REGION * count)
                    self.for_writer.put_nowait((kind, ident, [RemoteRegion.from_bytes(regions[i:i + _REGION])
                                                              for i in range(0, len(regions), _REGION)]))
                elif kind == _ACK:
                    self.for_writer.put_nowait((kind, ident, count))
                elif kind == _WRITTEN:
                    self.for_reader.put_nowait((kind, ident, count))
                else:
                    raise ConnectionError(f"unknown control message type {kind} from the peer")
        except asyncio.CancelledError:
            self.end("the comm was closed")
            raise
        except (ConnectionError, asyncio.IncompleteReadError, DATError) as exc:
            self.end(f"the connection was lost: {exc}")
        except Exception as exc:  # a protocol error: nothing more on this stream can be trusted
            self.end(f"the control stream failed: {exc!r}")

    async def _read_msg(self, count: int) -> Tuple[List[int], bytes, List[bytearray]]:
        reader = self.reader
        lengths = list(struct.unpack(f"!{count}Q", await reader.readexactly(8 * count))) if count else []
        modes = await reader.readexactly(count)
        # Frames must be writable for distributed, and each inline frame is a bytearray of its own:
        # an array deserialized over one must not keep the whole message's inline bytes alive
        # (distributed's tcp comm reads such buffers into arrays of their own for the same reason).
        inline = [bytearray(await reader.readexactly(n)) if n else bytearray()
                  for n, m in zip(lengths, modes) if m == _INLINE]
        return lengths, modes, inline

    async def _receive(self, ident: int, lengths: Sequence[int], modes: bytes,
                       inline: List[bytearray], size: int) -> List[Union[memoryview, bytearray]]:
        """The frames of message ``ident``: the inline ones, and the others (``size`` bytes) granted
        to the peer's RDMA writes once there is room ahead of read().  A failure aborts the stream:
        the peer would wait for our GRANT or ACK for ever."""
        inline_frames = iter(inline)
        frames: List[Any] = []
        remote: List[memoryview] = []
        transport = self.writer.transport
        ep = transport.get_extra_info("aiodat_ep")
        lmrs = []
        try:
            await self._make_room(size)
            for n, mode in zip(lengths, modes):  # (inside: a length no memory holds fails here, and aborts)
                if mode == _INLINE:
                    frames.append(next(inline_frames))
                else:
                    buf = host_array(n)
                    frames.append(buf)
                    remote.append(buf)
            for buf in remote:
                lmrs.append(await _register(ep.pz, buf, Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE))
            _send(self.writer, self.name, _GRANT, ident, len(lmrs), b"".join(lmr.remote().to_bytes() for lmr in lmrs))
            # the sender writes, then says WRITTEN; we answer each one (one write in flight at a time)
            while True:
                kind, got, last = await self.get(self.for_reader)
                if got != ident:
                    raise CommClosedError(f"{self.name}: protocol error: WRITTEN for message {got} "
                                          f"while receiving message {ident}")
                _send(self.writer, self.name, _ACK, ident, 0)
                if last:
                    break
        except DATError as exc:
            ended = ep.closed or transport.is_closing()  # the connection ended: its teardown closed the PZ
            _abort_unless_closing(transport)
            if ended:
                raise CommClosedError(f"{self.name}: receiving the frames of message {ident} failed: {exc}") from exc
            raise  # (not the connection's doing, say the memlock limit: distributed must not retry it elsewhere)
        except BaseException:
            _abort_unless_closing(transport)
            raise
        finally:
            for lmr in lmrs:
                _close_quietly(lmr)
        return frames

    async def _make_room(self, size: int) -> None:
        """Wait until ``size`` more bytes fit within ``limit`` of what read() has not taken
        (at once when it has taken everything), then count them."""
        while self.ahead and self.ahead + size > self.limit:
            if self.closed is not None:
                raise CommClosedError(f"{self.name}: {self.closed.reason}")
            self._room.clear()
            await self._room.wait()
        self.ahead += size

    def taken(self, size: int) -> None:
        """read() took a message whose large frames (``size`` bytes) were received ahead."""
        self.ahead -= size
        self._room.set()

    def end(self, reason: str) -> None:
        """The connection is over: wake every waiter with CommClosedError (once: each getter puts
        the one marker back for the next)."""
        if self.closed is not None:
            return
        self.closed = _Closed(reason)
        for queue in (self.messages, self.for_writer, self.for_reader):
            queue.put_nowait(self.closed)
        self._room.set()

    async def get(self, queue: "asyncio.Queue[Any]") -> Any:
        item = await queue.get()
        if isinstance(item, _Closed):
            queue.put_nowait(item)  # for the next getter too
            raise CommClosedError(f"{self.name}: {item.reason}")
        return item


def _abort_transport(loop: asyncio.AbstractEventLoop, transport: asyncio.BaseTransport, inbox: _Inbox) -> None:
    """Finalizer of a comm dropped unclosed: abort its stream on its own loop (any thread may collect it)."""
    def abort() -> None:
        inbox.task.cancel()
        transport.abort()  # type: ignore[attr-defined]
    try:
        loop.call_soon_threadsafe(abort)
    except RuntimeError:  # the loop is closed: the stream went with it
        pass


@contextlib.contextmanager
def _abort_on_failure(comm: "RDMAComm") -> Iterator[None]:
    """Around one read or write of a comm: any exception ends the comm before it propagates.

    A lost connection (CommClosedError), a cancellation or a failure may leave part of a message
    consumed or sent, so the stream's state is unknown and the only safe thing is to abort, as
    distributed's tcp comm does (distributed requires a cancelled read to abort the comm).
    """
    try:
        yield
    except BaseException:
        comm.abort()
        raise


class RDMAComm(Comm):
    """One distributed comm over one aiodat stream; large frames move by RDMA write (module docstring)."""

    #: frames and bytes this process sent by RDMA write and inline, over all comms (tests, benchmarks)
    totals: Dict[str, int] = {"rdma_frames": 0, "rdma_bytes": 0, "inline_frames": 0, "inline_bytes": 0}
    #: frames larger than this are split by distributed's serialization (as on tcp://)
    max_shard_size: ClassVar[int] = dask.utils.parse_bytes(dask.config.get("distributed.comm.shard"))

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, local_addr: str,
                 peer_addr: str, deserialize: bool = True) -> None:
        super().__init__(deserialize=deserialize)
        self._writer = writer
        self._transport = writer.transport
        self._ep = self._transport.get_extra_info("aiodat_ep")
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._closed = False
        self._closing: "Optional[asyncio.Future[None]]" = None  # done when a graceful close() ends
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._inbox = _Inbox(reader, writer, f"{PREFIX} comm {local_addr} -> {peer_addr}")
        self._finalizer = weakref.finalize(self, _abort_transport, asyncio.get_running_loop(), self._transport,
                                           self._inbox)
        self._finalizer.atexit = False
        self._extra = {"aiodat_ep": self._ep}

    # -- addresses and state --------------------------------------------------------------
    @property
    def local_address(self) -> str:
        """``rdma://ip:port`` of our end."""
        return self._local_addr

    @property
    def peer_address(self) -> str:
        """``rdma://ip:port`` of the peer's end."""
        return self._peer_addr

    @property
    def extra_info(self) -> Dict[str, Any]:
        """``aiodat_ep``: the connected :class:`aiodat.EP` under the comm."""
        return self._extra

    def closed(self) -> bool:
        """True once closed, aborted, or the connection was lost."""
        # the connection ended and nothing is left to read: the only item queued is the end's marker
        if not self._closed and self._inbox.closed is not None and self._inbox.messages.qsize() <= 1:
            return True
        return self._closed

    # -- reading --------------------------------------------------------------------------
    async def read(self, deserializers: Any = None) -> Any:
        """The next message; a cancelled or failed read aborts the comm (the stream's state is unknown)."""
        if self._closed:
            raise CommClosedError(f"{self!r}: read on a closed comm")
        with _abort_on_failure(self):
            frames = await self._inbox.get(self._inbox.messages)
            if isinstance(frames, tuple):  # (its large frames' reception, and their size)
                reception, size = frames
                frames = await reception
                self._inbox.taken(size)
        try:
            return await from_frames(frames, deserialize=self.deserialize, deserializers=deserializers,
                                     allow_offload=self.allow_offload)
        except EOFError:
            self.abort()
            raise CommClosedError(f"{self!r}: aborted on truncated data")

    # -- writing --------------------------------------------------------------------------
    async def write(self, msg: Any, serializers: Any = None, on_error: str = "message") -> int:
        """Send one message; returns the bytes of its frames.  A failed write aborts the comm."""
        if self._closed:
            raise CommClosedError(f"{self!r}: write on a closed comm")
        frames = await to_frames(
            msg, allow_offload=self.allow_offload, serializers=serializers, on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
            frame_split_size=self.max_shard_size)
        # (flat bytes, as tcp:// sends them: a strided frame, from a custom serializer, is copied)
        views = [ensure_memoryview(f) for f in frames]
        threshold = max(1, zero_copy_threshold())
        modes = bytes(_REMOTE if v.nbytes >= threshold else _INLINE for v in views)
        totals = RDMAComm.totals
        for v, m in zip(views, modes):
            kind = "rdma" if m == _REMOTE else "inline"
            totals[kind + "_frames"] += 1
            totals[kind + "_bytes"] += v.nbytes
        with _abort_on_failure(self):
            async with self._write_lock:
                if self._closed or self._inbox.closed is not None:
                    raise CommClosedError(f"{self!r}: {self._inbox.closed.reason if self._inbox.closed else 'closed'}")
                await self._send_frames(next(self._ids), views, modes)
        return sum(v.nbytes for v in views)

    async def _send_frames(self, ident: int, views: List[memoryview], modes: bytes) -> None:
        remote = [v for v, m in zip(views, modes) if m == _REMOTE]
        pz = self._ep.pz
        # pin our frames while the announcement makes its round trip
        pinning = [asyncio.ensure_future(_register(pz, v, Privileges.LOCAL_READ)) for v in remote]
        lmrs = []
        try:
            header = struct.pack(f"!{len(views)}Q", *(v.nbytes for v in views)) + modes
            self._send(_MSG, ident, len(views), header, *(v for v, m in zip(views, modes) if m == _INLINE))
            await self._writer.drain()
            if not remote:
                return
            for task in pinning:
                lmrs.append(await task)
            kind, got, regions = await self._inbox.get(self._inbox.for_writer)
            if kind != _GRANT or got != ident or len(regions) != len(lmrs):
                raise CommClosedError(f"{self!r}: protocol error: expected GRANT of {len(lmrs)} regions for "
                                      f"message {ident}, got {_NAMES.get(kind, kind)} for {got}")
            pieces = [(lmr, region, off, min(MAX_WRITE, lmr.length - off))
                      for lmr, region in zip(lmrs, regions) for off in range(0, lmr.length, MAX_WRITE)]
            for i, (lmr, region, off, n) in enumerate(pieces):
                if region.length != lmr.length:
                    raise CommClosedError(f"{self!r}: protocol error: granted {region.length} bytes "
                                          f"for a frame of {lmr.length}")
                self._ep.post_rdma_write(lmr[off:off + n], region[off:off + n], _WRITE_COOKIE)
                self._send(_WRITTEN, ident, int(i == len(pieces) - 1))
                kind, got, _ = await self._inbox.get(self._inbox.for_writer)
                if kind != _ACK or got != ident:
                    raise CommClosedError(f"{self!r}: protocol error: expected ACK for message {ident}, "
                                          f"got {_NAMES.get(kind, kind)} for {got}")
        except DATError as exc:
            raise CommClosedError(f"{self!r}: RDMA write failed: {exc}") from exc
        except BaseException:
            if lmrs and self._inbox.closed is None:
                # (cancelled, say, while a write was in flight: the queue pair may still read these
                # LMRs, so it goes first; the comm is aborted anyway, see _abort_on_failure)
                self._transport.abort()
            raise
        finally:
            for task in pinning:
                if not task.done():
                    task.cancel()
            if self._inbox.closed is None:
                for lmr in lmrs:
                    _close_quietly(lmr)
            # else: the stream's teardown closes its PZ, EP first, then these LMRs: never
            # deregister memory a queue pair might still read

    def _send(self, kind: int, ident: int, count: int, *payload: Any) -> None:
        _send(self._writer, self, kind, ident, count, *payload)

    # -- the end --------------------------------------------------------------------------
    async def close(self) -> None:
        """Close gracefully: what was written is delivered, then the peer sees the comm closed."""
        if self._closed:
            if self._closing is not None and not self._closing.done():
                # a graceful close is under way (distributed may close a comm from two tasks):
                # wait for it, rather than abort what it is still delivering
                await asyncio.shield(self._closing)
            else:
                self._teardown()
            return
        self._closed = True
        self._closing = asyncio.get_running_loop().create_future()
        self._finalizer.detach()
        writer = self._writer
        try:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 10.0)
        except (ConnectionError, DATError, asyncio.TimeoutError, OSError):
            self._transport.abort()
        finally:
            self._inbox.task.cancel()
            self._closing.set_result(None)

    def abort(self) -> None:
        """Close at once, without flushing: the peer sees the connection reset."""
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._finalizer.detach()
        self._inbox.task.cancel()
        self._inbox.end("the comm was aborted")
        self._transport.abort()


def _send(writer: asyncio.StreamWriter, who: object, kind: int, ident: int, count: int, *payload: Any) -> None:
    """Write one control message; CommClosedError naming ``who`` (the comm) once the stream is closing."""
    if writer.transport.is_closing():
        raise CommClosedError(f"{who}: the connection is closing")
    writer.writelines([_HEAD.pack(kind, ident, count), *payload])


def _abort_unless_closing(transport: asyncio.WriteTransport) -> None:
    """End the stream of a failed reception, so the peer does not wait for its GRANT or ACK for
    ever; unless it is closing already (the peer's end, or our own graceful close, whose last
    writes an abort would throw away: the peer learns of the end from it)."""
    if not transport.is_closing():
        transport.abort()


def _retrieve(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()


async def _register(pz: Any, buffer: Any, privileges: Privileges) -> Any:
    if memoryview(buffer).nbytes >= ASYNC_REGISTER_FROM:
        return await pz.register_async(buffer, privileges)
    return pz.register(buffer, privileges)


def _close_quietly(lmr: Any) -> None:
    try:
        lmr.close()
    except DATError as exc:  # the device still holds it: its Raw holder frees it later
        logger.debug("deregistering %r failed: %s", lmr, exc)


def _address(host_port: Tuple[Any, ...]) -> str:
    return PREFIX + unparse_host_port(host_port[0], host_port[1])


def _refuse_required_encryption(address: str, connection_args: Dict[str, Any]) -> None:
    """rdma:// carries no TLS: refuse it when the Security config requires encryption, as
    distributed's tcp:// does when it is not tls:// (rather than sending in clear text)."""
    if connection_args.get("require_encryption"):
        raise RuntimeError(f"encryption required by Dask configuration, refusing communication from/to "
                           f"{PREFIX}{address!r}: rdma:// is not encrypted")


class RDMAConnector(Connector):
    """Opens ``rdma://host:port`` comms (an aiodat stream to the listener there)."""

    async def connect(self, address: str, deserialize: bool = True, **connection_args: Any) -> RDMAComm:
        """Connect; failures raise CommClosedError naming the address (distributed retries those
        until its connect timeout), or FatalCommClosedError when retrying cannot help (no RDMA
        device, a bad option, what aiodat does not support)."""
        _refuse_required_encryption(address, connection_args)
        host, port = parse_host_port(address)
        try:
            reader, writer = await open_connection(host, port)
        except (ProviderNotFound, InvalidParameter, ModelNotSupported) as exc:
            raise FatalCommClosedError(f"cannot connect to {PREFIX}{address}: {exc}") from exc
        except (DATError, OSError) as exc:
            raise CommClosedError(f"cannot connect to {PREFIX}{address}: {exc}") from exc
        transport = writer.transport
        return RDMAComm(reader, writer, _address(transport.get_extra_info("sockname")), PREFIX + address,
                        deserialize)


class RDMAListener(BaseListener):
    """Listens on ``rdma://host:port`` (host: an RDMA device's address; empty: the default device)."""

    prefix = PREFIX

    def __init__(self, address: str, comm_handler: Any, deserialize: bool = True, allow_offload: bool = True,
                 default_host: Optional[str] = None, default_port: int = 0, **connection_args: Any) -> None:
        super().__init__()
        _refuse_required_encryption(address, connection_args)
        self.ip, self.port = parse_host_port(address, default_port)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._server: Any = None

    async def start(self) -> None:
        """Start listening (raises aiodat's InvalidAddress when no RDMA device has the host's address)."""
        # (the backlog of distributed's tcp listener: a worker may get a connection from every peer at once)
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        self._server = await start_server(self._on_stream, self.ip or None, self.port, backlog=backlog)

    def stop(self) -> None:
        """Stop listening; comms already accepted stay open."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self.abort_handshaking_comms()

    def get_host_port(self) -> Tuple[str, int]:
        """The (address, port) the listener is bound to."""
        if self._server is None or not self._server.sockets:
            raise ValueError("invalid operation on a non-started RDMAListener")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    @property
    def listen_address(self) -> str:
        """``rdma://address:port`` of the listening point."""
        return _address(self.get_host_port())

    @property
    def contact_address(self) -> str:
        """The address peers connect to (the device's concrete address)."""
        host, port = self.get_host_port()
        return PREFIX + unparse_host_port(ensure_concrete_host(host, default_host=self.default_host), port)

    async def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        if self._server is None:
            transport.abort()
            return
        comm = RDMAComm(reader, writer, _address(transport.get_extra_info("sockname")),
                        _address(transport.get_extra_info("peername")), self.deserialize)
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("Connection from %s closed before the handshake completed", comm.peer_address)
            return
        await self.comm_handler(comm)


class RDMABackend(Backend):
    """distributed's backend for the ``rdma`` scheme (found through the entry point)."""

    def get_connector(self) -> RDMAConnector:
        """A connector for ``rdma://`` addresses."""
        return RDMAConnector()

    def get_listener(self, loc: str, handle_comm: Any, deserialize: bool, **connection_args: Any) -> RDMAListener:
        """A listener on the scheme-less ``loc`` (``host:port``)."""
        return RDMAListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        """The host part of ``host:port``."""
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> Tuple[str, int]:
        """(host, port) of ``host:port``."""
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        """``host:port`` with the host resolved to an IP address."""
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc: str) -> str:
        """The local address (no port) from which ``loc`` is reached."""
        host = ensure_ip(parse_host_port(loc)[0])
        return unparse_host_port(get_ip(host), None)
