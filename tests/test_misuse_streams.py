"""Misuse of aiodat streams (transport, server, entry points): each misuse gets a clear error or
asyncio's own behaviour, and leaves no waiter hanging and no IA, registration or fd behind.
Device tests: run on both loops (``--aiodat-loop asyncio`` / ``uvloop``)."""
from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
from typing import Any, Dict, List, Optional, Tuple

import pytest

import aiodat
from aiodat import streams as aiodat_streams

pytestmark = pytest.mark.rxe

T = 60.0  # bound for every wait: the guest runs under TCG, maybe beside other guests


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Recorder(asyncio.Protocol):
    """A client protocol that records what it got and when it was lost."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lost: "asyncio.Future[Optional[BaseException]]" = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class RaisesInConnectionMade(Recorder):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        raise ValueError("connection_made failed on purpose")


async def _server_of(protocol_class: Any, address: str) -> Tuple[Any, int, List[Any]]:
    """A stream server making ``protocol_class()`` per connection: (server, its port, the protocols made)."""
    protocols: List[Any] = []

    def factory() -> Any:
        protocols.append(protocol_class())
        return protocols[-1]

    server = await aiodat_streams.create_server(factory, address, 0)
    return server, server.sockets[0].getsockname()[1], protocols


async def _settle() -> None:
    for _ in range(2):
        gc.collect()
        await asyncio.sleep(0.3)


async def test_server_protocol_whose_connection_made_raises(rdma_device: Any, loop_errors: List[dict]) -> None:
    """asyncio (both loops) reports the error to the loop's handler and the connection still ends:
    the client's close reaches the server's protocol, and wait_closed() returns."""
    server, port, protocols = await _server_of(RaisesInConnectionMade, rdma_device.address)
    tr, proto = await aiodat_streams.create_connection(Recorder, rdma_device.address, port)
    for _ in range(int(T * 10)):
        if loop_errors:
            break
        await asyncio.sleep(0.1)
    assert any(isinstance(c.get("exception"), ValueError) for c in loop_errors), loop_errors
    loop_errors.clear()
    tr.write(b"hello")
    tr.close()
    await asyncio.wait_for(proto.lost, T)
    await asyncio.wait_for(protocols[0].lost, T)  # the server's side ended too
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


async def test_server_protocol_factory_raises(rdma_device: Any, loop_errors: List[dict]) -> None:
    """A protocol factory that raises: the error goes to the loop's handler, the accepted connection is
    dropped (the client sees it end, as over TCP), and nothing of it stays (the shared IA is closed)."""
    def factory() -> asyncio.Protocol:
        raise KeyError("factory failed on purpose")

    server = await aiodat_streams.create_server(factory, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    tr, proto = await aiodat_streams.create_connection(Recorder, rdma_device.address, port)
    await asyncio.wait_for(proto.lost, T)  # the server dropped it
    assert any(isinstance(c.get("exception"), KeyError) for c in loop_errors), loop_errors
    loop_errors.clear()
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


async def test_client_protocol_whose_connection_made_raises(rdma_device: Any, loop_errors: List[dict]) -> None:
    """create_connection with a protocol whose connection_made raises: as asyncio's create_connection,
    it returns and the error goes to the loop's handler; the connection is dropped (as uvloop drops
    it), the server's side ends, and the shared IA is released."""
    ended: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ended.set_result(await reader.read())
        except ConnectionError as exc:
            ended.set_result(exc)
        writer.close()

    server = await aiodat.start_server(handler, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    tr, proto = await aiodat_streams.create_connection(RaisesInConnectionMade, rdma_device.address, port)
    assert any(isinstance(c.get("exception"), ValueError) for c in loop_errors), loop_errors
    loop_errors.clear()
    assert tr.is_closing()
    await asyncio.wait_for(proto.lost, T)
    await asyncio.wait_for(ended, T)
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


async def test_the_ia_closed_under_a_stream(rdma_device: Any, loop_errors: List[dict]) -> None:
    """The program closes the IA it passed as ia= while its stream is open: reading ends with an
    error instead of waiting for ever, and close()/wait_closed() finish."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()
        except ConnectionError:
            pass
        writer.close()

    server = await aiodat.start_server(handler, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    ia = aiodat.open_ia(rdma_device.name)
    try:
        reader, writer = await aiodat.open_connection(rdma_device.address, port, ia=ia)
        writer.write(b"x")
        await writer.drain()
        ia.close()
        writer.write(b"after the IA closed")
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.read(), T)
        writer.close()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), T)
    finally:
        ia.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


def _kernel_counts(device: str) -> Dict[str, int]:
    out = subprocess.run(["rdma", "resource", "show", device], stdout=subprocess.PIPE, text=True,
                         check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(pd|cq|qp|cm_id|mr|srq)\s+(\d+)", out)}


async def test_cancelled_open_connection_leaves_nothing(rdma_device: Any) -> None:
    """Cancelling open_connection while it connects (to an address nobody answers), its timeout, and a
    refused connect free its EP, registrations, EVD and IA reference: no fd, qp, cm_id or mr stays."""
    with pytest.raises(ConnectionRefusedError):  # (librdmacm's first connect opens an fd it keeps)
        await aiodat.open_connection(rdma_device.address, 1)
    await _settle()
    fds, counts = _open_fds(), _kernel_counts(rdma_device.name)
    for delay in (0.0, 0.01, 0.05, 0.2, 1.0):
        task = asyncio.ensure_future(aiodat.open_connection("10.254.254.254", 7471, connect_timeout=30))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises((TimeoutError, asyncio.TimeoutError, OSError, aiodat.DATError)):
        await aiodat.open_connection("10.254.254.254", 7471, connect_timeout=0.5)
    with pytest.raises(ConnectionRefusedError):
        await aiodat.open_connection(rdma_device.address, 1)
    assert aiodat_streams.shared_ia_count() == 0
    await _settle()
    assert (_open_fds(), _kernel_counts(rdma_device.name)) == (fds, counts)


async def test_misuse_of_a_live_transport(rdma_device: Any, loop_errors: List[dict]) -> None:
    got: "asyncio.Future[bytes]" = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.set_result(await reader.read())
        writer.close()

    server = await aiodat.start_server(handler, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(rdma_device.address, port)
    tr = writer.transport
    import array
    for bad in ("str", 1, None, 1.5, [b"x"]):
        with pytest.raises(TypeError, match="bytes-like"):
            writer.write(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):  # all or nothing, as asyncio's writelines
        writer.writelines([b"lost?", "str"])  # type: ignore[list-item]
    with pytest.raises(BufferError):
        writer.writelines([b"lost?", memoryview(b"abcdef")[::2]])
    assert tr.get_write_buffer_size() == 0
    with pytest.raises((BufferError, TypeError, ValueError)):
        writer.write(memoryview(b"abcdef")[::2])
    writer.write(memoryview(array.array("i", [1, 2])))
    with pytest.raises(ValueError):
        tr.set_write_buffer_limits(high=1, low=2)
    with pytest.raises(ValueError):
        tr.set_write_buffer_limits(low=-1)
    assert tr.get_extra_info("nonsense", 7) == 7
    writer.write_eof()
    writer.write_eof()
    with pytest.raises(RuntimeError):
        writer.write(b"after eof")
    with pytest.raises(RuntimeError):
        writer.writelines([b"after eof"])
    writer.close()
    writer.close()
    writer.write(b"after close")  # a no-op, as asyncio's
    await asyncio.wait_for(writer.wait_closed(), T)
    tr.abort()
    tr.pause_reading()
    tr.resume_reading()
    assert await asyncio.wait_for(got, T) == bytes(memoryview(array.array("i", [1, 2])))
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)


async def test_the_ways_a_stream_ends_under_misuse(rdma_device: Any, loop_errors: List[dict]) -> None:
    """Probes that pass: abort during a blocked drain, a cancelled drain, close with held messages
    while reading is paused, a cancelled readexactly, server.close() with live connections then
    abort_clients, data_received raising; every waiter ends."""
    loop = asyncio.get_running_loop()
    handlers: List[Any] = []
    gate = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append((reader, writer))
        await gate.wait()
        try:
            while await reader.read(1 << 16):
                pass
        except ConnectionError:
            pass
        writer.close()

    server = await aiodat.start_server(handler, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    # abort while drain() is blocked (the server does not read)
    reader, writer = await aiodat.open_connection(rdma_device.address, port, window_size=0)
    blob = b"z" * (1 << 20)
    drain = None
    for _ in range(64):
        writer.write(blob)
        drain = asyncio.ensure_future(writer.drain())
        await asyncio.sleep(0.05)
        if not drain.done():
            break
        await drain
    assert drain is not None and not drain.done(), "drain never blocked"
    writer.transport.abort()
    await asyncio.wait_for(drain, T)  # (asyncio's drain: None when lost without an exception)
    await asyncio.wait_for(writer.wait_closed(), T)
    # cancelled drain, then more writes: nothing lost or reordered
    reader2, writer2 = await aiodat.open_connection(rdma_device.address, port, window_size=0)
    sent = bytearray()
    for i in range(20):
        chunk = bytes([i]) * (300 * 1024)
        writer2.write(chunk)
        sent += chunk
        d = asyncio.ensure_future(writer2.drain())
        await asyncio.sleep(0)
        d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await d
    gate.set()
    writer2.transport.pause_reading()  # held messages, then close
    writer2.close()
    await asyncio.wait_for(writer2.wait_closed(), T)
    server.close()
    waiter = asyncio.ensure_future(server.wait_closed())
    await asyncio.sleep(0.5)
    server.abort_clients()
    await asyncio.wait_for(waiter, T)
    assert aiodat_streams.shared_ia_count() == 0


class RaisesInDataReceived(Recorder):
    def data_received(self, data: bytes) -> None:
        raise ValueError("data_received failed on purpose")

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        super().connection_lost(exc)
        raise KeyError("connection_lost failed on purpose")


async def test_data_received_and_connection_lost_raising(rdma_device: Any, loop_errors: List[dict]) -> None:
    server, port, protocols = await _server_of(RaisesInDataReceived, rdma_device.address)
    reader, writer = await aiodat.open_connection(rdma_device.address, port)
    writer.write(b"boom")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), T)
    await asyncio.wait_for(protocols[0].lost, T)
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    writer.close()
    await asyncio.sleep(0.2)
    kinds = sorted(type(c.get("exception")).__name__ for c in loop_errors)
    loop_errors.clear()
    assert kinds == ["KeyError", "ValueError"], kinds
    assert aiodat_streams.shared_ia_count() == 0


async def test_a_host_name_that_does_not_resolve_is_oserror_as_in_asyncio(rdma_device: Any) -> None:
    """asyncio's open_connection / start_server raise socket.gaierror (an OSError) for a name that does
    not resolve; code written for them catches OSError. aiodat raises an InvalidAddress that is one too."""
    import socket

    for call in (lambda: aiodat.open_connection("no-such-host.invalid", 7471),
                 lambda: aiodat.start_server(lambda r, w: None, "no-such-host.invalid", 0)):
        with pytest.raises(socket.gaierror, match="no-such-host.invalid") as info:
            await call()
        assert isinstance(info.value, aiodat.InvalidAddress)
    assert aiodat_streams.shared_ia_count() == 0


@pytest.mark.parametrize("bad", ["x", -1, 0, float("nan"), True])
async def test_a_bad_accept_or_connect_timeout_is_refused_at_the_call(rdma_device: Any, bad: Any) -> None:
    """start_server(accept_timeout=bad) raised nothing: each connection then failed at its accept, into
    the loop's handler with an error not naming the argument ("'<' not supported...", "cannot convert
    float NaN to integer", or with -1 an accept that timed out at once), and the client saw
    Unreachable or an immediate EOF. open_connection(connect_timeout=nan) raised "cannot convert
    float NaN to integer". Both now raise InvalidParameter naming the argument, and open nothing."""
    with pytest.raises(aiodat.InvalidParameter, match="accept_timeout"):
        await aiodat.start_server(lambda r, w: None, rdma_device.address, 0, accept_timeout=bad)
    with pytest.raises(aiodat.InvalidParameter, match="connect_timeout"):
        await aiodat.open_connection(rdma_device.address, 1, connect_timeout=bad)
    assert aiodat_streams.shared_ia_count() == 0


async def test_a_server_whose_ia_is_closed_closes(rdma_device: Any, loop_errors: List[dict]) -> None:
    """start_server on an IA the caller then closes: the server's listener is gone, so the server
    closes (is_serving() False, wait_closed() and serve_forever() return) and the loop's handler
    is told why, instead of the server staying "serving" with its accept task dead."""
    ia = aiodat.open_ia(rdma_device.name)
    try:
        server = await aiodat.start_server(lambda r, w: None, rdma_device.address, 0, ia=ia)
        forever = asyncio.ensure_future(server.serve_forever())
        await asyncio.sleep(0.1)
        assert server.is_serving()
        ia.close()
        await asyncio.wait_for(server.wait_closed(), T)
        assert not server.is_serving()
        with pytest.raises(asyncio.CancelledError):  # as asyncio's serve_forever when its server closes
            await asyncio.wait_for(forever, T)
        assert [e["message"] for e in loop_errors] == ["aiodat stream server: listening failed; the server is closed"]
        assert isinstance(loop_errors[0]["exception"], aiodat.DATError)
        loop_errors.clear()
    finally:
        ia.close()


class CancelledInDataReceived(Recorder):
    def data_received(self, data: bytes) -> None:
        raise asyncio.CancelledError()  # (as fut.result() of a cancelled future would)


class CancelledInConnectionMade(Recorder):
    def connection_made(self, transport: Any) -> None:
        raise asyncio.CancelledError()


async def test_a_cancelled_error_from_a_protocol_callback_ends_the_stream(rdma_device: Any,
                                                                          loop_errors: List[dict]) -> None:
    """A protocol callback that raises CancelledError (a BaseException) ends the stream as any other
    error does in asyncio's transports: reported, the connection dropped and lost with the error.  It
    used to be taken for nobody's: the batch's other events were lost, the stream stayed open and
    unread, and a server's wait_closed() never returned."""
    server, port, protocols = await _server_of(CancelledInDataReceived, rdma_device.address)
    reader, writer = await aiodat.open_connection(rdma_device.address, port)
    writer.write(b"boom")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), T)
    assert isinstance(await asyncio.wait_for(protocols[0].lost, T), asyncio.CancelledError)
    writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert [type(c.get("exception")) for c in loop_errors] == [asyncio.CancelledError], loop_errors
    loop_errors.clear()

    server, port, protocols = await _server_of(CancelledInConnectionMade, rdma_device.address)
    tr, proto = await aiodat_streams.create_connection(Recorder, rdma_device.address, port)
    await asyncio.wait_for(proto.lost, T)  # the server dropped it
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert [type(c.get("exception")) for c in loop_errors] == [asyncio.CancelledError], loop_errors
    loop_errors.clear()
    assert aiodat_streams.shared_ia_count() == 0


async def test_a_server_cancelled_while_it_starts_is_closed(rdma_device: Any) -> None:
    """create_server / start_server cancelled at their last step (the loop turn after listening)
    close the server they made: nothing listens and the shared IA is released.  The server used to
    go on listening and accepting with nobody able to close it."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    for start in (lambda: aiodat.start_server(handler, rdma_device.address, 0),
                  lambda: aiodat_streams.create_server(Recorder, rdma_device.address, 0)):
        task = asyncio.ensure_future(start())
        for _ in range(100):  # up to its last step (a numeric host: no lookup before it)
            await asyncio.sleep(0)
            if aiodat_streams.shared_ia_count():
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert aiodat_streams.shared_ia_count() == 0


class ChunkKeeper(asyncio.StreamReaderProtocol):
    """A StreamReaderProtocol subclass with a data_received of its own, which keeps what it gets."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()  # (the protocol holds it weakly)
        super().__init__(self.reader)
        self.seen: List[Any] = []

    def data_received(self, data: bytes) -> None:
        self.seen.append(data)
        super().data_received(data)


async def test_a_stream_reader_protocol_subclass_gets_bytes(rdma_device: Any) -> None:
    """Only asyncio's own StreamReaderProtocol.data_received (which copies into its reader) gets a view
    of the receive slot; a subclass's gets bytes, which stay its own once the slot is reused."""
    server, port, protocols = await _server_of(ChunkKeeper, rdma_device.address)
    reader, writer = await aiodat.open_connection(rdma_device.address, port)
    writer.write(b"a" * 100)
    await writer.drain()
    for _ in range(int(T * 10)):
        if protocols and protocols[0].seen:
            break
        await asyncio.sleep(0.1)
    writer.write(b"b" * 100)
    writer.write_eof()
    await asyncio.wait_for(protocols[0].reader.read(), T)
    assert all(type(chunk) is bytes for chunk in protocols[0].seen), [type(c) for c in protocols[0].seen]
    assert b"".join(protocols[0].seen) == b"a" * 100 + b"b" * 100
    assert protocols[0].seen[0] == b"a" * 100
    writer.close()
    server.close()
    server.close_clients()
    await asyncio.wait_for(server.wait_closed(), T)


class TapReader(asyncio.StreamReader):
    """A StreamReader subclass that keeps every chunk it is fed (a log, a tap)."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: List[Any] = []
        self.fed = asyncio.Event()

    def feed_data(self, data: bytes) -> None:
        self.chunks.append(data)
        self.fed.set()
        super().feed_data(data)


async def test_a_stream_reader_subclass_that_keeps_its_chunks_gets_bytes(rdma_device: Any) -> None:
    """asyncio's own StreamReaderProtocol over a StreamReader subclass whose feed_data keeps the chunks:
    it used to be fed memoryviews of the receive slots, so what it kept changed as the slots were
    reused (and bytes' methods failed on them).  asyncio hands it bytes, which stay as they were;
    so does the RDMA transport, which keeps views for asyncio's own StreamReader."""
    readers: List[TapReader] = []

    def factory() -> asyncio.StreamReaderProtocol:
        readers.append(TapReader())  # (held here: the protocol holds its reader weakly)
        return asyncio.StreamReaderProtocol(readers[-1])

    server = await aiodat_streams.create_server(factory, rdma_device.address, 0, recv_depth=4)
    reader, writer = await aiodat.open_connection(rdma_device.address, server.sockets[0].getsockname()[1])
    for _ in range(int(T * 10)):
        if readers:
            break
        await asyncio.sleep(0.1)
    sent = [bytes([i]) * 100 for i in range(24)]  # more messages than the server's receive slots
    for chunk in sent:
        readers[0].fed.clear()
        writer.write(chunk)
        await asyncio.wait_for(readers[0].fed.wait(), T)
    assert [type(c) for c in readers[0].chunks] == [bytes] * len(sent)
    assert readers[0].chunks == sent
    writer.close()
    server.close()
    server.close_clients()
    await asyncio.wait_for(server.wait_closed(), T)


async def _stuck_for_credits(rdma_device: Any) -> Tuple[Any, List[Any], Any, Any, Any]:
    """A client transport with 1 MiB written and stuck for credits: the server's side (paused) returns none.
    Returns (server, the server's protocols, the client's transport and protocol, the server's transport)."""
    server, port, protocols = await _server_of(Recorder, rdma_device.address)
    tr, proto = await aiodat_streams.create_connection(Recorder, rdma_device.address, port, window_size=0,
                                                       recv_depth=4)
    while not server._transports:
        await asyncio.sleep(0.05)
    (server_side,) = server._transports
    server_side.pause_reading()  # the server's side returns no credit
    tr.write(b"y" * (1 << 20))
    await asyncio.sleep(0.5)
    assert tr.get_write_buffer_size() > 0  # stuck for credits
    return server, protocols, tr, proto, server_side


async def test_close_cancelled_with_bytes_unsent_is_lost_with_an_error(rdma_device: Any) -> None:
    """close() finishes in a task of the transport's.  A shutdown that cancels every task ("for t in
    asyncio.all_tasks(): t.cancel()") cancelled it while bytes were still buffered (the peer gave no
    credits): they were dropped and connection_lost(None) reported a clean close.  Now connection_lost
    gets a ConnectionResetError saying how many bytes were not sent."""
    server, protocols, tr, proto, server_side = await _stuck_for_credits(rdma_device)
    before = asyncio.all_tasks()
    tr.close()
    await asyncio.sleep(0.1)
    for task in asyncio.all_tasks() - before:  # the shutdown idiom, on the tasks made since (close()'s)
        task.cancel()
    exc = await asyncio.wait_for(proto.lost, T)
    assert isinstance(exc, ConnectionResetError) and re.search(r"\d+ bytes written were not sent", str(exc)), exc
    assert tr.get_write_buffer_size() == 0
    await asyncio.wait_for(protocols_lost(protocols), T)  # the server's side ended too
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


async def test_a_server_whose_accept_task_is_cancelled_closes(rdma_device: Any) -> None:
    """The server accepts in a task.  Cancelled from outside (a shutdown cancelling every task), it
    used to leave the server "serving" with nothing accepting: clients waited for their connect
    timeout.  The server now closes: is_serving() is False, clients are refused, wait_closed() and
    serve_forever() end (as when it is closed)."""
    before = asyncio.all_tasks()
    server = await aiodat.start_server(lambda r, w: None, rdma_device.address, 0)
    port = server.sockets[0].getsockname()[1]
    forever = asyncio.ensure_future(server.serve_forever())
    await asyncio.sleep(0.1)
    assert server.is_serving()
    for task in asyncio.all_tasks() - before - {forever}:  # the shutdown idiom: the server's accept task
        task.cancel()
    await asyncio.sleep(0.1)
    assert not server.is_serving() and not server.sockets
    with pytest.raises(ConnectionRefusedError):
        await aiodat.open_connection(rdma_device.address, port, connect_timeout=20)
    await asyncio.wait_for(server.wait_closed(), T)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(forever, T)
    assert aiodat_streams.shared_ia_count() == 0


async def test_bad_server_arguments_are_refused_at_the_call(rdma_device: Any) -> None:
    """limit and backlog are checked when the server starts, naming them (asyncio's StreamReader refuses
    a bad limit only at each connection); a backlog above what the device's EVDs hold is clamped, as
    the kernel clamps a socket's to somaxconn."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    for limit in (0, -1, "x", 1.5):
        with pytest.raises(aiodat.InvalidParameter, match="limit"):
            await aiodat.start_server(handler, rdma_device.address, 0, limit=limit)
    for backlog in ("x", 1.5, None):
        with pytest.raises(aiodat.InvalidParameter, match="backlog"):
            await aiodat.start_server(handler, rdma_device.address, 0, backlog=backlog)
    assert aiodat_streams.shared_ia_count() == 0
    server = await aiodat.start_server(handler, rdma_device.address, 0, backlog=10**9)
    reader, writer = await aiodat.open_connection(rdma_device.address, server.sockets[0].getsockname()[1])
    assert await asyncio.wait_for(reader.read(), T) == b""
    writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


class ClosesInBufferUpdated(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.updates = 0
        self.buffer = bytearray(4096)
        self.lost: "asyncio.Future[Optional[BaseException]]" = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.updates += 1
        self.transport.close()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def test_a_buffered_protocol_that_closes_gets_no_more_of_the_message(rdma_device: Any) -> None:
    """A BufferedProtocol that closes its transport in buffer_updated is fed no more, even of the
    message under way (asyncio: no data after close()); it used to be fed to the message's end."""
    server, port, protocols = await _server_of(ClosesInBufferUpdated, rdma_device.address)
    reader, writer = await aiodat.open_connection(rdma_device.address, port, window_size=0)
    writer.write(b"x" * 16000)  # one message, four of the protocol's buffers
    await asyncio.wait_for(protocols_lost(protocols), T)
    assert protocols[0].updates == 1
    writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)


async def protocols_lost(protocols: List[Any]) -> None:
    while not protocols:
        await asyncio.sleep(0.05)
    await protocols[0].lost


async def test_a_lost_connection_holds_no_written_bytes(rdma_device: Any) -> None:
    """When the connection is lost, what was written and not sent is dropped (as asyncio's
    _force_close clears its buffer): get_write_buffer_size() is 0 and the chunks are not kept."""
    server, protocols, tr, proto, server_side = await _stuck_for_credits(rdma_device)
    server_side.abort()
    assert await asyncio.wait_for(proto.lost, T) is not None  # reset, with bytes unsent
    assert tr.get_write_buffer_size() == 0
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
