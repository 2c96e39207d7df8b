"""Issue 16 item 4: gRPC over RDMA with grpclib (aiodat.integrations.grpclib), real protobuf messages.

The same suite runs over TCP (grpclib's own Server and Channel on 127.0.0.1) and
over RDMA (``RdmaServer`` / ``RdmaChannel`` on the rxe device): unary, server-,
client- and bidirectional streaming calls, a 1 MiB message, status errors,
deadlines and cancellation.  The RDMA runs carry the rxe marker; run the file
on both loops (``--aiodat-loop asyncio`` / ``uvloop``).
"""
from __future__ import annotations

import asyncio
import inspect
import random
import socket
from typing import Any, AsyncIterator, List, Tuple

import grpclib
import grpclib.client
import grpclib.config
import grpclib.events
import grpclib.protocol
import grpclib.server
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

import aiodat
import aiodat.integrations.grpclib as integration
from aiodat.integrations.grpclib import RdmaChannel, RdmaServer
from apps.grpc_echo import EchoReply, EchoRequest, EchoService, EchoStub
from apps.hung import hung_server

Setup = Tuple[EchoStub, EchoService, Any]  # (stub on the channel, the service, the channel)


@pytest.fixture(params=["tcp", pytest.param("rdma", marks=pytest.mark.rxe)])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def setup(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    """A started server with the Echo service and a channel to it: grpclib's own, or the RDMA ones."""
    service = EchoService()
    if kind == "rdma":
        host = request.getfixturevalue("rdma_device").address
        server: grpclib.server.Server = RdmaServer([service])
        await server.start(host, 0)
        port = server.sockets[0].getsockname()[1]
        channel: grpclib.client.Channel = RdmaChannel(host, port)
    else:
        host = "127.0.0.1"
        server = grpclib.server.Server([service])
        sock = socket.socket()  # grpclib's start(sock=...): the free port is known without its internals
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        await server.start(sock=sock)
        channel = grpclib.client.Channel(host, port)
    try:
        yield EchoStub(channel), service, channel
    finally:
        channel.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), 30)


async def test_unary_and_a_large_message(setup: Setup) -> None:
    """Unary calls, one of them carrying 1 MiB each way; concurrent calls share one HTTP/2 connection."""
    stub, service, _ = setup
    reply = await stub.Unary(EchoRequest(text="hello"))
    assert isinstance(reply, EchoReply) and reply.text == "hello"
    payload = random.Random(4).randbytes(1024 * 1024)
    reply = await stub.Unary(EchoRequest(text="big", payload=payload))
    assert reply.text == "big" and reply.payload == payload
    replies = await asyncio.gather(*(stub.Unary(EchoRequest(text=str(i))) for i in range(10)))
    assert [r.text for r in replies] == [str(i) for i in range(10)]
    assert len(set(service.peers)) == 1  # multiplexed over the one connection


async def test_server_streaming(setup: Setup) -> None:
    stub, _, _ = setup
    replies = await stub.ServerStream(EchoRequest(text="s", payload=b"p" * 3000, count=40))
    assert [r.index for r in replies] == list(range(40))
    assert all(r.payload == b"p" * 3000 and r.text == "s" for r in replies)


async def test_client_streaming(setup: Setup) -> None:
    stub, _, _ = setup
    async with stub.ClientStream.open() as stream:
        for i in range(25):
            await stream.send_message(EchoRequest(text=str(i), payload=bytes(i * 100)))
        await stream.end()
        reply = await stream.recv_message()
    assert reply.text == ",".join(str(i) for i in range(25))
    assert reply.index == sum(i * 100 for i in range(25))


async def test_bidirectional_streaming(setup: Setup) -> None:
    """Request and reply interleaved one by one (each waits for the other), then the client ends."""
    stub, _, _ = setup
    async with stub.Bidi.open() as stream:
        for i in range(20):
            await stream.send_message(EchoRequest(text=f"m{i}", payload=bytes([i]) * (i * 1000)))
            reply = await stream.recv_message()
            assert (reply.text, reply.index, reply.payload) == (f"M{i}", i, bytes([i]) * (i * 1000))
        await stream.end()
        assert await stream.recv_message() is None


async def test_error_status_propagates(setup: Setup) -> None:
    """A GRPCError raised by the handler reaches the client with its status and message."""
    stub, _, _ = setup
    for status in (Status.NOT_FOUND, Status.PERMISSION_DENIED):
        with pytest.raises(GRPCError) as caught:
            await stub.Unary(EchoRequest(text=status.name, status=status.value))
        assert caught.value.status is status
        assert caught.value.message == f"asked to fail: {status.name}"
    assert (await stub.Unary(EchoRequest(text="still fine"))).text == "still fine"


DEADLINE = 3.0  # s: the call's deadline in test_deadline, on a connected channel
HANDLER_SECONDS = 120.0  # what its handler would take: the deadline must end the call long before


async def test_deadline(setup: Setup) -> None:
    """A call past its deadline fails with the deadline's error after about the deadline, long before
    the handler would have answered, and cancels the handler; the connection stays usable.

    The channel connects first, so that the deadline covers only the call.  It used to cover
    connecting too, with a deadline of 0.5 s: under TCG on a loaded host, connecting and sending took
    longer, so the call timed out before the handler began to sleep and no handler was cancelled."""
    stub, service, _ = setup
    assert (await stub.Unary(EchoRequest(text="before"), timeout=60)).text == "before"
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises((asyncio.TimeoutError, GRPCError)) as caught:
        await stub.Unary(EchoRequest(text="slow", seconds=HANDLER_SECONDS), timeout=DEADLINE)
    took = loop.time() - began
    # grpclib's client raises asyncio.TimeoutError at its deadline; the server's copy of the deadline
    # (the grpc-timeout header, a little shorter) may answer DEADLINE_EXCEEDED first
    assert isinstance(caught.value, asyncio.TimeoutError) or caught.value.status is Status.DEADLINE_EXCEEDED, \
        caught.value
    assert DEADLINE - 0.1 < took < HANDLER_SECONDS / 4, took
    assert await asyncio.wait_for(service.cancelled.get(), 30) == "Unary"
    assert (await stub.Unary(EchoRequest(text="after"), timeout=60)).text == "after"


async def test_cancellation(setup: Setup) -> None:
    """Cancelling the client's task mid-stream resets the stream: the server handler is cancelled,
    the connection stays usable."""
    stub, service, _ = setup
    got = asyncio.Queue()  # type: asyncio.Queue[int]

    async def consume() -> None:
        async with stub.ServerStream.open() as stream:
            await stream.send_message(EchoRequest(text="x", count=100_000, seconds=0.01), end=True)
            async for reply in stream:
                got.put_nowait(reply.index)

    task = asyncio.ensure_future(consume())
    for expected in range(3):
        assert await asyncio.wait_for(got.get(), 30) == expected
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.wait_for(service.cancelled.get(), 10) == "ServerStream"
    assert (await stub.Unary(EchoRequest(text="next"))).text == "next"


# -- RDMA only ------------------------------------------------------------------------------------


@pytest.mark.rxe
async def test_rdma_server_and_channel_lifecycle(rdma_device: Any) -> None:
    """Misuse is refused clearly; closing the server closes the clients' connections; a closed
    channel refuses calls; nothing listening is ConnectionRefusedError."""
    host = rdma_device.address
    with pytest.raises(aiodat.ModelNotSupported, match="TLS"):
        RdmaChannel(host, 50051, ssl=True)
    with pytest.raises(aiodat.InvalidAddress):
        RdmaChannel(None, 50051)  # type: ignore[arg-type]
    with pytest.raises(aiodat.InvalidParameter, match="recv_depth"):
        RdmaChannel(host, 50051, recv_depth=1)
    service = EchoService()
    server = RdmaServer([service])
    with pytest.raises(RuntimeError, match="not started"):
        await server.wait_closed()
    with pytest.raises(aiodat.ModelNotSupported, match="TLS"):
        await server.start(host, 0, ssl=object())
    await server.start(host, 0, buffer_size=8192)
    with pytest.raises(RuntimeError, match="already started"):
        await server.start(host, 0)
    port = server.sockets[0].getsockname()[1]
    requests: List[str] = []

    async def on_request(event: grpclib.events.RecvRequest) -> None:
        requests.append(event.method_name)

    grpclib.events.listen(server, grpclib.events.RecvRequest, on_request)  # grpclib's events reach RdmaServer's
    channel = RdmaChannel(host, port, buffer_size=8192)
    stub = EchoStub(channel)
    assert (await stub.Unary(EchoRequest(text="a"))).text == "a"
    assert requests == ["/aiodat.echo.Echo/Unary"]
    server.close()
    await asyncio.wait_for(server.wait_closed(), 30)  # returns: the client's connection was closed too
    assert server.sockets == ()
    with pytest.raises((ConnectionError, grpclib.exceptions.StreamTerminatedError)):
        await stub.Unary(EchoRequest(text="b"))  # reconnects, but nothing listens any more
    channel.close()
    assert channel.is_closed
    with pytest.raises(RuntimeError, match="RdmaChannel is closed"):
        await stub.Unary(EchoRequest(text="c"))


@pytest.mark.rxe
async def test_a_channel_closed_while_it_connects_keeps_no_connection(rdma_device: Any) -> None:
    """``channel.close()`` while a call is still connecting: the call fails with the channel's
    RuntimeError and the new connection is closed.  grpclib used to store it anyway, so the call
    went through on the closed channel and the stream stayed open until garbage collection."""
    from aiodat import streams as aiodat_streams

    server = RdmaServer([EchoService()])
    await server.start(rdma_device.address, 0)
    try:
        channel = RdmaChannel(rdma_device.address, server.sockets[0].getsockname()[1])
        call = asyncio.ensure_future(EchoStub(channel).Unary(EchoRequest(text="late")))
        await asyncio.sleep(0)  # the call starts connecting
        assert not call.done()
        channel.close()
        with pytest.raises(RuntimeError, match="closed while it connected"):
            await asyncio.wait_for(call, 30)
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 30)
    assert aiodat_streams.shared_ia_count() == 0


@pytest.mark.rxe
async def test_wait_closed_drops_a_client_that_stopped_reading_after_close_timeout(rdma_device: Any,
                                                                                  monkeypatch: Any) -> None:
    """A client that stops reading returns no credits, so its connection's graceful close never gets
    its last bytes out.  ``wait_closed()`` gives it ``close_timeout`` seconds, then drops it; it used
    to wait for ever."""
    transports: List[Any] = []
    make_protocol = integration._client_protocol

    def recording(config: Any) -> Any:  # the channel's connection, to stop its reading
        protocol = make_protocol(config)
        made = protocol.connection_made
        protocol.connection_made = lambda transport: (transports.append(transport), made(transport))[1]
        return protocol

    monkeypatch.setattr(integration, "_client_protocol", recording)
    host = rdma_device.address
    server = RdmaServer([EchoService()])
    with pytest.raises(aiodat.InvalidParameter, match="close_timeout"):
        await server.start(host, 0, close_timeout=0)
    await server.start(host, 0, close_timeout=1.0)
    channel = RdmaChannel(host, server.sockets[0].getsockname()[1], buffer_size=4096, recv_depth=4)
    try:
        async with EchoStub(channel).ServerStream.open() as stream:
            await stream.send_message(EchoRequest(text="flood", payload=b"x" * 65536, count=1000), end=True)
            assert (await asyncio.wait_for(stream.recv_message(), 30)).index == 0
            transports[0].pause_reading()  # from here on the client holds its receives and returns no credit
            await asyncio.sleep(0.5)  # the server's replies fill what it may send
            server.close()
            began = asyncio.get_running_loop().time()
            await asyncio.wait_for(server.wait_closed(), 20)
            assert asyncio.get_running_loop().time() - began < 10
            assert server.sockets == ()
            await asyncio.wait_for(_until(lambda: transports[0].is_closing()), 10)  # the client was dropped
            transports[0].resume_reading()
            with pytest.raises((ConnectionError, grpclib.exceptions.StreamTerminatedError)):
                for _ in range(1000):  # (what the client held may come first)
                    await asyncio.wait_for(stream.recv_message(), 10)
    finally:
        channel.close()


@pytest.mark.rxe
async def test_a_channel_closed_on_a_hung_server_lets_its_connection_go(rdma_device: Any,
                                                                      monkeypatch: Any) -> None:
    """``channel.close()`` on a server that stopped answering: the connection is aborted CLOSE_TIMEOUT s
    later.  Its graceful close waited for the server's answer to the disconnect, so the connection (EP,
    buffers, the shared IA) stayed for the stream's disconnect timeout of 10 s, or for ever when its EOF
    could not be sent."""
    from aiodat import streams as aiodat_streams

    monkeypatch.setattr(integration, "CLOSE_TIMEOUT", 1.0)
    loop = asyncio.get_running_loop()
    async with hung_server("grpclib", rdma_device.address) as (port, freeze):
        channel = RdmaChannel(rdma_device.address, port)
        assert (await EchoStub(channel).Unary(EchoRequest(text="a"))).text == "a"
        freeze()
        channel.close()
        began = loop.time()
        await asyncio.wait_for(_until(lambda: aiodat_streams.shared_ia_count() == 0), 30)
        assert loop.time() - began < 5.0


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


# -- host only: the grpclib parts the integration builds on ---------------------------------------

TESTED = "grpclib 0.4.9"


def _params(func: Any) -> List[str]:
    return list(inspect.signature(func).parameters)


async def test_grpclib_parts_we_build_on() -> None:
    """grpclib has no public hook for another kind of listener or connection, so aiodat.integrations.grpclib
    assembles grpclib's public-named parts itself and overrides one private hook of Channel.  Each part is
    checked here, so that an upgrade that moves one fails with its name instead of breaking calls."""
    where = f"(aiodat.integrations.grpclib was tested with {TESTED}; this is grpclib {grpclib.__version__})"
    assert _params(grpclib.server.Handler.__init__) == ["self", "mapping", "codec", "status_details_codec",
                                                        "dispatch"], \
        f"grpclib.server.Handler(mapping, codec, status_details_codec, dispatch) changed {where}"
    for name in ("close", "wait_closed", "check_closed", "closing"):
        assert hasattr(grpclib.server.Handler, name), f"grpclib.server.Handler.{name} is gone {where}"
    assert _params(grpclib.protocol.H2Protocol.__init__) == ["self", "handler", "config", "h2_config"], \
        f"grpclib.protocol.H2Protocol(handler, config, h2_config) changed {where}"
    assert hasattr(grpclib.client.Handler(), "connection_lost"), \
        f"grpclib.client.Handler() (no arguments, .connection_lost) changed {where}"
    for name in ("__for_server__", "__for_client__"):
        assert callable(getattr(grpclib.config.Configuration(), name, None)), \
            f"grpclib.config.Configuration.{name}() is gone {where}"
    assert "_create_connection" in vars(grpclib.client.Channel), \
        f"grpclib.client.Channel._create_connection, the hook RdmaChannel overrides, is gone {where}"
    assert "self._create_connection()" in inspect.getsource(grpclib.client.Channel.__connect__), \
        f"grpclib.client.Channel.__connect__ no longer calls _create_connection() {where}"

    # the settings aiodat copies must still be grpclib's own (read from grpclib's objects: a drift check)
    server, channel = grpclib.server.Server([EchoService()]), grpclib.client.Channel("127.0.0.1", 1)
    rdma_server, rdma_channel = RdmaServer([EchoService()]), RdmaChannel("127.0.0.1", 1)
    try:
        assert hasattr(server, "__dispatch__"), f"grpclib.server.Server().__dispatch__ (events) is gone {where}"
        for theirs, ours in ((getattr(server, "_h2_config", None), integration._h2_config(False)),
                             (getattr(channel, "_h2_config", None), integration._h2_config(True))):
            assert theirs is not None, f"cannot compare h2 settings: grpclib keeps no _h2_config {where}"
            for attr in ("client_side", "header_encoding", "validate_inbound_headers",
                         "validate_outbound_headers", "normalize_inbound_headers", "normalize_outbound_headers"):
                assert getattr(ours, attr) == getattr(theirs, attr), f"grpclib's h2 setting {attr} changed {where}"
        codec, details = integration._default_codecs(None, None)
        assert (type(codec), type(details)) == (type(getattr(server, "_codec", None)),
                                                type(getattr(server, "_status_details_codec", None))), \
            f"grpclib's default codecs changed {where}"
        assert isinstance(rdma_server, grpclib.server.Server) and isinstance(rdma_channel, grpclib.client.Channel)
        with pytest.raises(RuntimeError, match="not started"):
            rdma_server.close()
    finally:
        channel.close()
        rdma_channel.close()
