"""The aiodat stream server against what asyncio's Server and start_server do (Python 3.12+ semantics
on every version): handlers cancelled, clients that give up, closing with handshakes in flight, the
port after close, and one shared IA for a server and the clients of its loop.
Device tests: run on both loops (``--aiodat-loop asyncio`` / ``uvloop``)."""
from __future__ import annotations

import asyncio
import os
from typing import Any, List

import pytest

import aiodat
from aiodat import streams as aiodat_streams

pytestmark = pytest.mark.rxe

T = 60.0  # bound for every wait: the guest runs under TCG, maybe beside other guests


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_cancelled_handler_closes_its_connection(rdma_device: Any) -> None:
    """A client_connected_cb task that is cancelled closes its connection, as Python 3.12's
    StreamReaderProtocol does: the client reads EOF, and the server's wait_closed() (which waits
    for every connection) returns.  On Python 3.11 the connection stayed open for ever: the
    client never heard of the end, and wait_closed() never returned."""
    loop = asyncio.get_running_loop()
    # (Python 3.11's own StreamReaderProtocol reports the cancelled task as an error: not ours)
    reported: List[dict] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    handlers: "asyncio.Queue[asyncio.Task[Any]]" = asyncio.Queue()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        await handlers.put(task)
        await reader.read()  # until cancelled

    try:
        server = await aiodat.start_server(handler, rdma_device.address, 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await aiodat.open_connection(rdma_device.address, port)
        (await asyncio.wait_for(handlers.get(), T)).cancel()
        assert await asyncio.wait_for(reader.read(), T) == b""  # the server's side closed
        server.close()
        await asyncio.wait_for(server.wait_closed(), T)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), T)
    finally:
        loop.set_exception_handler(old_handler)
    assert aiodat_streams.shared_ia_count() == 0


async def test_a_client_that_gives_up_is_no_server_error(rdma_device: Any, loop_errors: List[dict]) -> None:
    """A client whose connect is cancelled (or times out) before the server accepts it is an
    everyday event: asyncio's accept reports such a failure only in debug mode.  It used to go to
    the loop's exception handler as "accepting a connection failed" for every such client.
    The server frees what it made for it and accepts the next client."""
    addr = rdma_device.address

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        writer.close()

    server = await aiodat.start_server(echo, addr, 0, start_serving=False)
    port = server.sockets[0].getsockname()[1]
    quitter = asyncio.ensure_future(aiodat.open_connection(addr, port, connect_timeout=30))
    await asyncio.sleep(0.5)  # its request waits in the server's queue
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await asyncio.sleep(0.5)
    fds = _open_fds()
    await server.start_serving()  # and the server takes up the abandoned request
    for _ in range(int(T * 10)):
        await asyncio.sleep(0.1)
        if not server._pending:
            break
    assert not server._pending
    assert _open_fds() == fds  # nothing of the abandoned accept stays
    reader, writer = await aiodat.open_connection(addr, port)
    writer.write(b"next\n")
    assert await asyncio.wait_for(reader.read(), T) == b"next\n"
    writer.close()
    await writer.wait_closed()
    server.close()
    await asyncio.wait_for(server.wait_closed(), T)
    assert aiodat_streams.shared_ia_count() == 0


async def test_the_port_is_free_again_after_close(rdma_device: Any) -> None:
    """A second server on a port in use gets an OSError (EADDRINUSE-like, as bind()); once the first
    is closed the port takes a new server at once."""
    addr = rdma_device.address

    async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        writer.close()

    first = await aiodat.start_server(hello, addr, 0)
    port = first.sockets[0].getsockname()[1]
    with pytest.raises(OSError):
        await aiodat.start_server(hello, addr, port)
    first.close()
    await asyncio.wait_for(first.wait_closed(), T)
    async with await aiodat.start_server(hello, addr, port) as second:
        assert second.is_serving() and second.sockets[0].getsockname() == (addr, port)
        reader, writer = await aiodat.open_connection(addr, port)
        assert await asyncio.wait_for(reader.read(), T) == b"hello"
        writer.close()
        await writer.wait_closed()
    assert aiodat_streams.shared_ia_count() == 0


async def test_closing_with_handshakes_in_flight_leaks_nothing(rdma_device: Any) -> None:
    """close() while clients are being accepted: every client ends (connected, then closed; or
    refused), none waits for its timeout, and no EP, registration, fd or IA of the server stays."""
    addr = rdma_device.address
    fds = _open_fds()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await aiodat.start_server(handler, addr, 0)
    port = server.sockets[0].getsockname()[1]

    async def client() -> Any:
        try:
            reader, writer = await aiodat.open_connection(addr, port, connect_timeout=T)
        except ConnectionError as exc:
            return exc
        try:
            await reader.read()
        except ConnectionError:
            pass
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
        return None

    clients = [asyncio.ensure_future(client()) for _ in range(6)]
    await asyncio.sleep(0.05)
    server.close()
    server.close_clients()
    done, _ = await asyncio.wait(clients, timeout=T / 2)  # (their connect_timeout is T)
    assert len(done) == len(clients)
    await asyncio.wait_for(server.wait_closed(), T)
    await asyncio.sleep(0.3)
    assert aiodat_streams.shared_ia_count() == 0
    assert _open_fds() == fds


async def test_a_server_and_the_clients_of_its_loop_share_one_ia(rdma_device: Any) -> None:
    """A server listening on the device's default address (host None, or that address) and a
    client connecting to it use one shared IA: the pool named the same address two ways (None
    and the address itself) and opened the device twice."""
    addr = rdma_device.address

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    for host in (None, addr):
        server = await aiodat.start_server(handler, host, 0)
        assert aiodat_streams.shared_ia_count() == 1
        reader, writer = await aiodat.open_connection(addr, server.sockets[0].getsockname()[1])
        assert aiodat_streams.shared_ia_count() == 1
        assert writer.get_extra_info("aiodat_ia").address == addr
        writer.close()
        await writer.wait_closed()
        server.close()
        await asyncio.wait_for(server.wait_closed(), T)
        assert aiodat_streams.shared_ia_count() == 0


async def test_wait_closed_returns_even_if_releasing_the_shared_ia_raises(rdma_device: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The last step of a server's close gives its shared IA back; when that raised (closing an IA
    can fail, e.g. from another thread than its loop's), the error went to close() and every
    wait_closed() waiter stayed asleep for ever.  The release is made to raise here by wrapping the
    server's own reference; the IA is given back for real afterwards."""
    server = await aiodat.start_server(lambda r, w: None, rdma_device.address, 0)
    waiter = asyncio.ensure_future(server.wait_closed())
    await asyncio.sleep(0)
    iaref = server._iaref  # (the server's reference to the loop's shared IA)
    real_release = iaref.release

    def failing_release() -> None:
        raise RuntimeError("release failed")

    monkeypatch.setattr(iaref, "release", failing_release)
    with pytest.raises(RuntimeError, match="release failed"):
        server.close()
    await asyncio.wait_for(waiter, T)
    real_release()
    assert aiodat_streams.shared_ia_count() == 0
