"""Issue 6 items 1-2: asyncio streams over RDMA, and the same service over TCP and RDMA.

The key-value store of examples/kvstore.py runs the same client suite over
asyncio (TCP on 127.0.0.1, host-side and in the guest) and over aiodat (RDMA on
the rxe device).  The stream-specific tests run on rxe only.  Run the file on
both loops (``--aiodat-loop asyncio`` / ``uvloop``).
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, List, Tuple

import pytest

import aiodat
from aiodat import streams as aiodat_streams

ROOT = Path(__file__).resolve().parents[1]


def _load_kvstore() -> Any:
    spec = importlib.util.spec_from_file_location("kvstore_example", ROOT / "examples" / "kvstore.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kvstore = _load_kvstore()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(params=["tcp", pytest.param("rdma", marks=pytest.mark.rxe)])
def transport(request: pytest.FixtureRequest) -> Tuple[Any, str]:
    """(module with open_connection/start_server, host) for TCP and for RDMA."""
    if request.param == "tcp":
        return asyncio, "127.0.0.1"
    device = request.getfixturevalue("rdma_device")
    return aiodat, device.address


@pytest.fixture
def rdma_host(rdma_device: Any) -> str:
    return rdma_device.address


# -- the same client suite over both transports --------------------------------------------------


async def test_kvstore_suite(transport: Tuple[Any, str]) -> None:
    """The example service, unchanged, over asyncio TCP streams and over aiodat RDMA streams."""
    streams, host = transport
    store = kvstore.KVStore()
    server = await streams.start_server(store.handle, host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = await kvstore.KVClient.connect(streams, host, port)
        assert await client.set("a", "1")
        assert await client.set("b", "two words")
        assert await client.get("a") == b"1"
        assert await client.get("b") == b"two words"
        assert await client.get("zzz") is None
        assert await client.keys() == ["a", "b"]
        assert await client.delete("a")
        assert not await client.delete("a")
        assert (await client.command("BOGUS x")).startswith(b"ERR")
        blob = random.Random(6).randbytes(300_001)
        assert await client.put("blob", blob)
        assert await client.fetch("blob") == blob
        # a second client sees the first one's writes
        other = await kvstore.KVClient.connect(streams, host, port)
        assert await other.get("b") == b"two words"
        assert await other.quit() == b"BYE"
        assert await client.quit() == b"BYE"
    assert store.connections == 2


def test_kvstore_example_runs_over_tcp() -> None:
    """The example's demo mode, as a user runs it, over TCP."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "kvstore.py"), "demo", "--transport", "tcp"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "FETCH blob sha256 matches: True" in out.stdout and "QUIT: BYE" in out.stdout


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_kvstore_example_runs_over_rdma(rdma_device: Any) -> None:
    """The same demo, switched to aiodat by --transport rdma only."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "kvstore.py"), "demo", "--transport", "rdma",
                          "--host", rdma_device.address], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "FETCH blob sha256 matches: True" in out.stdout and "over aiodat (RDMA)" in out.stdout


# -- stream semantics on RDMA ----------------------------------------------------------------------


class Sink:
    """A server that records what each connection sent, optionally after a gate opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.results: "asyncio.Queue[Any]" = asyncio.Queue()

    async def read_all(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.gate.wait()
        try:
            data = await reader.read()
            await self.results.put(data)
        except Exception as exc:  # handed to the test
            await self.results.put(exc)
        finally:
            writer.close()


@pytest.mark.rxe
async def test_readexactly_10mib_odd_chunks(rdma_host: str) -> None:
    """10 MiB written in odd-sized chunks arrives intact via readexactly; both the send and RDMA-write paths run."""
    total = 10 * 1024 * 1024
    payload = random.Random(10).randbytes(total)
    digest = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.readexactly(total)
        digest.set_result(hashlib.sha256(data).hexdigest())
        writer.write(b"done\n")
        await writer.drain()
        writer.close()

    server = await aiodat.start_server(handler, rdma_host, 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(rdma_host, port)
    rng = random.Random(1)
    sizes = [1, 3, 17, 4093, 16377, 65537, 100003, 262147, 7]
    writer.write(payload[:7])  # alone in its loop iteration: below rdma_threshold, so a DATA message
    await asyncio.sleep(0)
    offset = 7
    while offset < total:
        n = min(rng.choice(sizes), total - offset)
        writer.write(payload[offset:offset + n])
        offset += n
        await writer.drain()
    assert await asyncio.wait_for(digest, 300) == hashlib.sha256(payload).hexdigest()
    assert await reader.readline() == b"done\n"
    stats = writer.transport.stats
    assert stats["bytes_sent"] == total
    assert stats["data_msgs"] > 0 and stats["window_writes"] > 0, stats
    await _close(writer, server)


@pytest.mark.rxe
async def test_a_slow_reader_has_two_window_writes_in_flight_and_the_ring_wraps(rdma_host: str) -> None:
    """The window is a ring with two writes in flight: a reader that takes its bytes slowly holds one
    window write while the next lands after it, and later ones wrap to offset 0; every byte arrives
    in order."""
    total = 3 * 1024 * 1024
    payload = random.Random(11).randbytes(total)
    digest = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h, got = hashlib.sha256(), 0
        while got < total:
            chunk = await reader.read(50_000)  # a third of what the writer's buffer holds...
            h.update(chunk)
            got += len(chunk)
            await asyncio.sleep(0.002)  # ... and a pause: StreamReader pauses reading, writes are held
        digest.set_result(h.hexdigest())
        writer.close()

    server = await aiodat.start_server(handler, rdma_host, 0, window_size=262144)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(rdma_host, port, window_size=262144)
    for offset in range(0, total, 65536):
        writer.write(payload[offset:offset + 65536])
        await writer.drain()
    assert await asyncio.wait_for(digest, 300) == hashlib.sha256(payload).hexdigest()
    stats = writer.transport.stats
    assert stats["bytes_sent"] == total
    assert stats["window_writes_overlapped"] > 0 and stats["window_wraps"] > 0, stats
    await _close(writer, server)


async def _close(writer: asyncio.StreamWriter, server: Any) -> None:
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_backpressure_slow_reader(rdma_host: str) -> None:
    """A writer that outruns its reader: drain() blocks, then every byte arrives in order."""
    sink = Sink()
    sink.gate.clear()  # the server does not read until the gate opens
    # a 256 KiB window: what the peer can absorb (its reader's buffer, a held window, the credits)
    # stays well below the 3 MiB written, which keeps the test short under emulation
    server = await aiodat.start_server(sink.read_all, rdma_host, 0, window_size=262144)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(rdma_host, port, window_size=262144)
    payload = random.Random(2).randbytes(3 * 1024 * 1024)
    for i in range(0, len(payload), 65536):
        writer.write(payload[i:i + 65536])
    # credits, the window and the peer's StreamReader cannot hold 3 MiB: the rest waits here
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), 1.0)
    previous = -1
    for _ in range(60):  # wait until the writer is stuck (the peer took what its buffers hold)
        size = writer.transport.get_write_buffer_size()
        if size == previous:
            break
        previous = size
        await asyncio.sleep(0.5)
    assert previous == writer.transport.get_write_buffer_size() > 1024 * 1024, previous
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), 0.5)  # still paused: the reader is not reading
    sink.gate.set()
    await asyncio.wait_for(writer.drain(), 120)
    writer.close()
    await writer.wait_closed()
    data = await asyncio.wait_for(sink.results.get(), 120)
    assert data == payload
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_eof_and_half_close(rdma_host: str) -> None:
    """write_eof: the peer reads the data then b"" and at_eof(); it can still answer; close gives EOF back."""
    seen: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read()
        again = await reader.read()
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readexactly(1)
        seen.set_result((first, again, reader.at_eof(), info.value.partial))
        writer.write(b"reply after your EOF\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await aiodat.start_server(handler, rdma_host, 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(rdma_host, port)
    assert writer.can_write_eof()
    writer.write(b"abc")
    writer.write(b"def")
    writer.write_eof()
    with pytest.raises(RuntimeError):
        writer.write(b"after eof")
    assert await asyncio.wait_for(seen, 60) == (b"abcdef", b"", True, b"")
    assert await reader.readline() == b"reply after your EOF\n"
    assert await reader.read() == b""  # the server closed
    assert reader.at_eof()
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_incomplete_read_on_eof_mid_message(rdma_host: str) -> None:
    """readexactly(n) with fewer than n bytes before EOF raises IncompleteReadError carrying them."""
    result: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(100)
        except asyncio.IncompleteReadError as exc:
            result.set_result((exc.partial, exc.expected))
        writer.close()

    server = await aiodat.start_server(handler, rdma_host, 0)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1])
    writer.write(b"x" * 42)
    writer.close()
    await writer.wait_closed()
    assert await asyncio.wait_for(result, 60) == (b"x" * 42, 100)
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_peer_abort_is_connection_reset(rdma_host: str) -> None:
    """transport.abort() (no EOF): the peer's readexactly raises ConnectionResetError; drain() too."""
    result: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()
    writers: List[asyncio.StreamWriter] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            await reader.readexactly(1 << 20)
            result.set_result("no error")
        except Exception as exc:
            result.set_result(exc)

    server = await aiodat.start_server(handler, rdma_host, 0)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1])
    writer.write(b"partial" * 100)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.transport.abort()
    exc = await asyncio.wait_for(result, 60)
    assert isinstance(exc, ConnectionResetError), exc
    server_writer = writers[0]
    with pytest.raises(ConnectionResetError):
        server_writer.write(b"into the void")
        await server_writer.drain()
    with pytest.raises(ConnectionResetError):
        await server_writer.wait_closed()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_a_peer_gone_before_a_closing_writer_sent_everything_is_a_reset(rdma_host: str) -> None:
    """close() with bytes still buffered (the peer is not reading), then the peer aborts: the
    writer's wait_closed() raises ConnectionResetError, as over TCP.  It used to end cleanly,
    the unsent bytes lost without a word, since the writer was closing when the peer went."""
    writers: List[asyncio.StreamWriter] = []
    gate = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await gate.wait()  # never reads

    server = await aiodat.start_server(handler, rdma_host, 0, window_size=262144)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1],
                                                  window_size=262144)
    writer.write(b"w" * (2 * 1024 * 1024))  # far more than the peer's buffers take
    writer.close()
    for _ in range(100):
        if writers and writer.transport.get_write_buffer_size() > 0:
            break
        await asyncio.sleep(0.05)
    assert writers and writer.transport.get_write_buffer_size() > 0
    writers[0].transport.abort()
    with pytest.raises(ConnectionResetError, match="not yet sent"):
        await asyncio.wait_for(writer.wait_closed(), 60)
    gate.set()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_close_gives_up_on_a_peer_that_takes_nothing_for_close_timeout(rdma_host: str) -> None:
    """close() with bytes buffered for a peer that never reads (so returns no credits): after
    ``close_timeout`` s without progress the connection is aborted, and wait_closed() raises saying
    why.  It used to wait for ever, holding the connection (the integrations each bounded it from
    outside with their own abort timer)."""
    gate = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()  # never reads

    server = await aiodat.start_server(handler, rdma_host, 0, window_size=262144)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1],
                                                  window_size=262144, close_timeout=1.0)
    writer.write(b"w" * (2 * 1024 * 1024))  # far more than the peer's buffers take
    loop = asyncio.get_running_loop()
    began = loop.time()
    writer.close()
    with pytest.raises(ConnectionResetError, match=r"no progress for 1.0 s \(close_timeout\) and \d+ bytes"):
        await asyncio.wait_for(writer.wait_closed(), 60)
    assert 1.0 <= loop.time() - began < 10.0
    gate.set()
    server.close()
    await server.wait_closed()
    assert aiodat_streams.shared_ia_count() == 0


@pytest.mark.rxe
async def test_close_waits_on_a_slow_reader_for_longer_than_close_timeout(rdma_host: str) -> None:
    """close_timeout bounds a close without progress, not the close: a peer that keeps taking the
    bytes, slowly (64 KiB every 0.1 s, over 3 s in all), gets every one and the close is clean."""
    payload = os.urandom(2 * 1024 * 1024)
    got: "asyncio.Future[bytes]" = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = bytearray()
        while chunk := await reader.read(65536):
            data += chunk
            await asyncio.sleep(0.1)
        got.set_result(bytes(data))
        writer.close()

    server = await aiodat.start_server(handler, rdma_host, 0, limit=65536, window_size=131072)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1],
                                                  window_size=131072, close_timeout=1.0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    writer.write(payload)
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), 60)  # clean: no ConnectionResetError
    assert await asyncio.wait_for(got, 60) == payload
    assert loop.time() - began > 1.0  # (the close outlasted close_timeout, and still ended cleanly)
    server.close()
    await server.wait_closed()


class _Buffered(asyncio.BufferedProtocol):
    """A BufferedProtocol with a small buffer (so one message fills several), recording calls."""

    def __init__(self) -> None:
        self.buffer = bytearray(1000)
        self.got = bytearray()
        self.sizes: List[int] = []

    def get_buffer(self, sizehint: int) -> memoryview:
        self.sizes.append(sizehint)
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.got += self.buffer[:nbytes]


class _PausesPartWay(_Buffered):
    """A _Buffered that pauses reading after its first buffer of each message it is resumed for."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        self.transport.pause_reading()


class _Plain(asyncio.Protocol):
    def __init__(self) -> None:
        self.got = bytearray()

    def data_received(self, data: bytes) -> None:
        self.got += data


@pytest.mark.rxe
@pytest.mark.parametrize("size", [8000, 300_000], ids=["data", "window"])
async def test_a_buffered_protocol_that_pauses_part_way_gets_the_rest_on_resume(rdma_host: str, size: int) -> None:
    """A BufferedProtocol that pauses reading in buffer_updated is fed no more, not even the rest of
    the message under way (as asyncio's transports feed no more after a pause); resume_reading()
    hands over the rest, then what came after it, in order.  It used to be fed the whole message."""
    first, second = random.Random(7).randbytes(size), b"after it"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(first)
        await writer.drain()
        writer.write(second)
        await writer.drain()
        await reader.read()

    server = await aiodat.start_server(handler, rdma_host, 0)
    transport, proto = await aiodat_streams.create_connection(_PausesPartWay, rdma_host,
                                                             server.sockets[0].getsockname()[1])
    assert isinstance(proto, _PausesPartWay)
    want = first + second
    for _ in range(600):
        if proto.got:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # time for the rest, and the next message, to arrive
    assert bytes(proto.got) == first[:1000] and not transport.is_reading()
    resumes = 1
    while len(proto.got) < len(want) and resumes < 2 * len(want) // 1000:
        got = len(proto.got)
        transport.resume_reading()
        for _ in range(100):
            if len(proto.got) > got:
                break
            await asyncio.sleep(0.01)
        assert len(proto.got) - got <= 1000, "fed past a pause"
        resumes += 1
    assert bytes(proto.got) == want
    transport.close()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_a_buffered_protocol_is_fed_through_its_buffers(rdma_host: str) -> None:
    """An asyncio.BufferedProtocol gets its data through get_buffer()/buffer_updated(), small
    messages and window writes alike, as asyncio's transports feed one; set_protocol() switches
    between the two kinds.  It used to fail at the first message (no data_received)."""
    payloads = [b"small", bytes(range(256)) * 40, random.Random(5).randbytes(300_000)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)  # the client has its protocol in place
        for p in payloads:
            writer.write(p)
            await writer.drain()
        await reader.readexactly(1)  # the client switched to a plain protocol
        writer.write(b"plain again")
        writer.write_eof()
        await writer.drain()

    server = await aiodat.start_server(handler, rdma_host, 0)
    transport, proto = await aiodat_streams.create_connection(_Buffered, rdma_host,
                                                             server.sockets[0].getsockname()[1])
    assert isinstance(proto, _Buffered)
    transport.write(b"1")
    want = b"".join(payloads)
    for _ in range(600):
        if len(proto.got) >= len(want):
            break
        await asyncio.sleep(0.05)
    assert bytes(proto.got) == want
    assert len(proto.sizes) > len(want) // 1000  # every 1000 bytes took a buffer of its own
    plain = _Plain()
    transport.set_protocol(plain)
    transport.write(b"2")
    for _ in range(600):
        if plain.got == b"plain again":
            break
        await asyncio.sleep(0.05)
    assert plain.got == b"plain again" and bytes(proto.got) == want
    transport.close()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_killed_peer_process_is_connection_reset(rdma_host: str) -> None:
    """A client process killed with SIGKILL mid-message: the server's readexactly raises ConnectionResetError."""
    result: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(5)
            result.set_result(("started", head))
            await reader.readexactly(1 << 20)
        except Exception as exc:
            result.set_result(exc) if not result.done() else server_errors.append(exc)

    server_errors: List[BaseException] = []
    server = await aiodat.start_server(handler, rdma_host, 0)
    port = server.sockets[0].getsockname()[1]
    script = textwrap.dedent(f"""
        import asyncio, os, signal, aiodat
        async def main():
            r, w = await aiodat.open_connection({rdma_host!r}, {port})
            w.write(b"hello" + b"x" * 1000)
            await w.drain()
            await asyncio.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
    """)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await asyncio.wait_for(result, 120) == ("started", b"hello")
    await asyncio.wait_for(proc.wait(), 60)
    assert proc.returncode == -9
    for _ in range(600):
        if server_errors:
            break
        await asyncio.sleep(0.1)
    assert server_errors and isinstance(server_errors[0], ConnectionResetError), server_errors
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_server_close_wait_closed_and_refused(rdma_host: str) -> None:
    """close() stops listening (new connects are refused), wait_closed() waits for the connections."""
    handled = asyncio.Event()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        await reader.read()
        writer.close()
        handled.set()

    fds = _open_fds()
    server = await aiodat.start_server(echo, rdma_host, 0)
    assert server.is_serving()
    host, port = server.sockets[0].getsockname()
    assert (host, port) == (rdma_host, port) and port > 0
    reader, writer = await aiodat.open_connection(rdma_host, port)
    writer.write(b"ping\n")
    assert await reader.readline() == b"ping\n"
    server.close()
    assert not server.is_serving() and server.sockets == ()
    with pytest.raises(ConnectionRefusedError):
        await aiodat.open_connection(rdma_host, port)
    waiter = asyncio.ensure_future(server.wait_closed())
    await asyncio.sleep(0.3)
    assert not waiter.done()  # the accepted connection is still open
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(waiter, 30)
    assert handled.is_set()
    assert aiodat_streams.shared_ia_count() == 0
    assert _open_fds() == fds  # no leaked completion channels, cm channels or device fds


@pytest.mark.rxe
async def test_serve_forever_async_with_and_extra_info(rdma_host: str) -> None:
    """serve_forever until cancelled; async with closes; get_extra_info knows peer, sock and the EP."""
    infos: "asyncio.Queue[Any]" = asyncio.Queue()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await infos.put((writer.get_extra_info("peername"), writer.get_extra_info("sockname")))
        await reader.read()
        writer.close()

    async with await aiodat.start_server(handler, rdma_host, 0, start_serving=False) as server:
        assert not server.is_serving()
        forever = asyncio.ensure_future(server.serve_forever())
        await asyncio.sleep(0)
        assert server.is_serving()
        port = server.sockets[0].getsockname()[1]
        reader, writer = await aiodat.open_connection(rdma_host, port)
        peer, sock = await asyncio.wait_for(infos.get(), 30)
        assert writer.get_extra_info("peername") == (rdma_host, port) == sock
        assert writer.get_extra_info("sockname") == peer
        assert writer.get_extra_info("socket") is None
        ep = writer.get_extra_info("aiodat_ep")
        assert isinstance(ep, aiodat.EP) and ep.state is aiodat.EPState.CONNECTED
        assert isinstance(writer.get_extra_info("aiodat_ia"), aiodat.IA)
        assert isinstance(writer, asyncio.StreamWriter) and isinstance(reader, asyncio.StreamReader)
        writer.close()
        await writer.wait_closed()
        assert ep.closed  # the EP (and its PZ, LMRs, EVD) went with the stream
        forever.cancel()
        with pytest.raises(asyncio.CancelledError):
            await forever
        assert not server.is_serving()
    assert aiodat_streams.shared_ia_count() == 0


@pytest.mark.rxe
async def test_many_concurrent_clients(rdma_host: str) -> None:
    """20 clients at once, each echoing its own data through one server: nothing mixed up or lost."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for line in reader:  # async iteration over lines
            writer.write(line)
            await writer.drain()
        writer.close()

    server = await aiodat.start_server(echo, rdma_host, 0)
    port = server.sockets[0].getsockname()[1]

    async def client(i: int) -> bool:
        reader, writer = await aiodat.open_connection(rdma_host, port)
        lines = [f"client {i} line {j} {'y' * (i * 37 % 500)}\n".encode() for j in range(20)]
        for line in lines:
            writer.write(line)
        await writer.drain()
        got = [await reader.readuntil(b"\n") for _ in lines]
        writer.write_eof()
        assert await reader.read() == b""
        writer.close()
        await writer.wait_closed()
        return got == lines

    results = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(20))), 300)
    assert all(results)
    server.close()
    await server.wait_closed()
    assert aiodat_streams.shared_ia_count() == 0


@pytest.mark.rxe
async def test_limit_overrun_and_both_closing(rdma_host: str) -> None:
    """The reader's limit works as in asyncio (LimitOverrunError); both sides closing at once is clean."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"z" * 300 + b"\n")
        await writer.drain()
        writer.close()

    server = await aiodat.start_server(handler, rdma_host, 0)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1], limit=100)
    with pytest.raises(asyncio.LimitOverrunError):
        await reader.readuntil(b"\n")
    assert len(await reader.read(1000)) == 301
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


# -- loops in threads (issue 13 item 5) -----------------------------------------------------------------


def _thread_loop(config: pytest.Config) -> Any:
    """A new loop of the kind --aiodat-loop chose, for a thread of its own."""
    if (config.getoption("--aiodat-loop") or os.environ.get("AIODAT_LOOP")) == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


@pytest.mark.rxe
def test_two_loops_in_two_threads(rdma_host: str, request: pytest.FixtureRequest) -> None:
    """Two threads, each with its own loop, stream to a server (a third loop) at the same time.

    An aiodat object belongs to the loop it first waited on, so each loop must get its own
    shared IA: the three IAs are distinct, both transfers arrive intact, and once the loops are
    closed no shared IA stays open.
    """
    import threading

    payload = {i: random.Random(i).randbytes(300_000 + i * 12_345) for i in (1, 2)}
    ready = threading.Event()
    stop = threading.Event()
    start = threading.Barrier(2, timeout=300)
    server_info: dict = {}
    results: dict = {}

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # everything up to the client's EOF
        writer.write(hashlib.sha256(data).hexdigest().encode())
        await writer.drain()
        writer.close()

    async def serve() -> None:
        server = await aiodat.start_server(sink, rdma_host, 0)
        server_info["port"] = server.sockets[0].getsockname()[1]
        server_info["ia"] = server._iaref.ia
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()
        await server.wait_closed()

    async def client(i: int) -> None:
        start.wait()  # both threads connect at the same moment
        reader, writer = await aiodat.open_connection(rdma_host, server_info["port"])
        results[i, "ia"] = writer.get_extra_info("aiodat_ia")
        writer.write(payload[i])
        writer.write_eof()
        results[i, "digest"] = (await reader.read()).decode()
        writer.close()
        await writer.wait_closed()

    def run(coro_fn: Any, *args: Any) -> None:
        loop = _thread_loop(request.config)
        try:
            loop.run_until_complete(asyncio.wait_for(coro_fn(*args), 300))
        except BaseException as exc:
            results[args or "server", "error"] = exc
            ready.set()
        finally:
            loop.close()

    server_thread = threading.Thread(target=run, args=(serve,), daemon=True)
    server_thread.start()
    assert ready.wait(300)
    clients = [threading.Thread(target=run, args=(client, i), daemon=True) for i in (1, 2)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(360)
    stop.set()
    server_thread.join(60)
    errors = {k: v for k, v in results.items() if k[-1] == "error"}
    assert not errors, errors
    for i in (1, 2):
        assert results[i, "digest"] == hashlib.sha256(payload[i]).hexdigest()
    ias = [results[1, "ia"], results[2, "ia"], server_info["ia"]]
    assert len({id(ia) for ia in ias}) == 3, "each loop must have its own shared IA"
    assert all(ia.closed for ia in ias)
    assert aiodat_streams.shared_ia_count() == 0


# -- asyncio's transport contract, the same test over TCP and over RDMA ---------------------------------


async def _create_connection(streams: Any, factory: Any, host: str, port: int) -> Tuple[Any, Any]:
    if streams is asyncio:
        return await asyncio.get_running_loop().create_connection(factory, host, port)
    return await aiodat_streams.create_connection(factory, host, port)


async def test_loop_sendfile(transport: Tuple[Any, str], tmp_path: Path) -> None:
    """loop.sendfile(transport, file, offset, count) as on asyncio's own transports (RDMA: the fallback
    mode, reading paused meanwhile so bytes the peer sends during it are held, then delivered)."""
    streams, host = transport
    loop = asyncio.get_running_loop()
    content = random.Random(7).randbytes(300_001)
    path = tmp_path / "blob"
    path.write_bytes(content)
    outcome = loop.create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with open(path, "rb") as f:
            try:
                sent = await loop.sendfile(writer.transport, f, 1, 250_000)
                outcome.set_result((sent, f.tell()))
            except NotImplementedError:  # uvloop has no loop.sendfile, for any transport
                outcome.set_result(None)
        line = await reader.readline()  # the client wrote it while the file was going out
        writer.write(b"after " + line)
        await writer.drain()
        writer.close()

    server = await streams.start_server(handler, host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await streams.open_connection(host, port)
        writer.write(b"ping\n")
        result = await asyncio.wait_for(outcome, 120)
        if result is None:
            assert not isinstance(loop, asyncio.BaseEventLoop), "asyncio's loop must implement sendfile"
        else:
            assert result == (250_000, 250_001)
            assert await reader.readexactly(250_000) == content[1:250_001]
        assert await reader.readline() == b"after ping\n"
        assert await reader.read() == b""
        writer.close()
        await writer.wait_closed()


class FlowRecorder(asyncio.Protocol):
    """A raw protocol recording pause_writing/resume_writing with the write buffer size at each."""

    def __init__(self) -> None:
        self.events: List[Tuple[str, int]] = []
        self.transport: Any = None
        self.resumed = asyncio.Event()
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.events.append(("pause", self.transport.get_write_buffer_size()))

    def resume_writing(self) -> None:
        self.events.append(("resume", self.transport.get_write_buffer_size()))
        self.resumed.set()

    def connection_lost(self, exc: Any) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def test_write_flow_control_contract(transport: Tuple[Any, str]) -> None:
    """pause_writing above the high mark, resume_writing at the low mark, get_write_buffer_size,
    writelines and write_eof: what asyncio's selector transports do, on a reader that starts late."""
    streams, host = transport
    gate = asyncio.Event()
    received = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        received.set_result(await reader.read())
        writer.close()

    server = await streams.start_server(handler, host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        tr, proto = await _create_connection(streams, FlowRecorder, host, port)
        tr.set_write_buffer_limits(high=8192, low=2048)
        assert tr.get_write_buffer_limits() == (2048, 8192)
        with pytest.raises(ValueError):
            tr.set_write_buffer_limits(high=1, low=2)
        rng, chunks = random.Random(8), []
        while not proto.events and len(chunks) < 512:  # TCP: until the kernel's socket buffers are full
            chunks.append(rng.randbytes(256 * 1024))
            tr.write(chunks[-1])
        payload = b"".join(chunks)
        # the peer reads nothing yet: more than the high mark stays buffered, and the protocol was told
        assert proto.events and proto.events[0][0] == "pause" and proto.events[0][1] > 8192
        assert tr.get_write_buffer_size() > 8192
        gate.set()
        await asyncio.wait_for(proto.resumed.wait(), 120)
        assert proto.events[1][0] == "resume" and proto.events[1][1] <= 2048, proto.events
        tr.writelines([b"one,", bytearray(b"two,"), memoryview(b"three")])
        tr.write_eof()
        assert tr.can_write_eof()
        data = await asyncio.wait_for(received, 120)
        assert data == payload + b"one,two,three"
        await asyncio.wait_for(proto.lost, 60)


async def _create_server(streams: Any, factory: Any, host: str, port: Any) -> Any:
    if streams is asyncio:
        return await asyncio.get_running_loop().create_server(factory, host, port)
    return await aiodat_streams.create_server(factory, host, port)


async def test_a_port_given_as_a_digit_string(transport: Tuple[Any, str]) -> None:
    """start_server / create_server took no str port ("8888"): InvalidParameter.  asyncio's take one
    (getaddrinfo reads it), and aiodat's open_connection did already."""
    streams, host = transport

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        writer.close()

    server = await streams.start_server(echo, host, "0")
    port = server.sockets[0].getsockname()[1]
    async with server:
        assert isinstance(port, int) and port > 0
        reader, writer = await streams.open_connection(host, str(port))
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 60) == b"ping"
        writer.close()
        await writer.wait_closed()
    other = await _create_server(streams, asyncio.Protocol, host, "0")
    assert other.sockets[0].getsockname()[1] > 0
    other.close()
    await other.wait_closed()


async def test_writelines_takes_any_bytes_like_item(transport: Tuple[Any, str]) -> None:
    """writelines() refused items that are not bytes, bytearray or memoryview (array.array, mmap,
    numpy arrays) with TypeError; asyncio's takes any bytes-like item (it joins them, or takes a
    memoryview of each).  A C-contiguous buffer of any format goes as its bytes."""
    import array
    import mmap

    streams, host = transport
    received = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.set_result(await reader.read())
        writer.close()

    server = await streams.start_server(handler, host, 0)
    async with server:
        reader, writer = await streams.open_connection(host, server.sockets[0].getsockname()[1])
        ints = array.array("i", [1, 2, 3])
        with mmap.mmap(-1, 5) as m:  # (open until sent: a transport may hold a view of it)
            m.write(b"mmap!")
            writer.writelines([b"a", array.array("B", b"bc"), ints, m, memoryview(ints), bytearray(b"z")])
            if streams is aiodat:  # (asyncio's own write() takes bytes, bytearray and memoryview only)
                writer.write(array.array("B", b"-write"))
            writer.write_eof()
            want = b"abc" + ints.tobytes() + b"mmap!" + ints.tobytes() + b"z"
            want += b"-write" if streams is aiodat else b""
            assert await asyncio.wait_for(received, 60) == want
        writer.close()
        await writer.wait_closed()


class _ResizesInBufferUpdated(asyncio.BufferedProtocol):
    """A BufferedProtocol that hands out one bytearray and resizes it in buffer_updated()."""

    def __init__(self) -> None:
        self.buffer = bytearray(1000)
        self.got = bytearray()
        self.lost: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.got += self.buffer[:nbytes]
        self.buffer.clear()  # (a resize: refused while a view of the bytearray is alive)
        self.buffer.extend(bytes(1000))

    def connection_lost(self, exc: Any) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def test_a_buffered_protocol_may_resize_its_buffer_in_buffer_updated(transport: Tuple[Any, str]) -> None:
    """The transport held a view of get_buffer()'s bytearray while buffer_updated() ran, so resizing
    it there raised BufferError and the connection was aborted.  asyncio's own transports hold no
    view then (recv_into has returned): the protocol gets every byte and a clean end.  (uvloop's TCP
    transport does hold one, and aborts as the RDMA transport did: the TCP case is skipped there.)"""
    streams, host = transport
    if streams is asyncio and not isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop):
        pytest.skip("uvloop's TCP transport holds a view of the buffer during buffer_updated()")
    payload = random.Random(4).randbytes(5000)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        writer.close()

    server = await streams.start_server(handler, host, 0)
    async with server:
        tr, proto = await _create_connection(streams, _ResizesInBufferUpdated, host,
                                              server.sockets[0].getsockname()[1])
        assert await asyncio.wait_for(proto.lost, 60) is None
        assert bytes(proto.got) == payload
        tr.close()


class _RaisesInEofReceived(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()

    def eof_received(self) -> None:
        raise ValueError("eof_received failed on purpose")

    def connection_lost(self, exc: Any) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def test_a_raising_eof_received_aborts_with_its_error(transport: Tuple[Any, str],
                                                            loop_errors: List[dict]) -> None:
    """eof_received() that raises: asyncio reports it to the loop's handler and aborts the transport
    (_fatal_error), so connection_lost gets the error.  The RDMA transport used to close gracefully
    after reporting it, and connection_lost got None, as for a clean end."""
    streams, host = transport
    protocols: List[_RaisesInEofReceived] = []

    def factory() -> _RaisesInEofReceived:
        protocols.append(_RaisesInEofReceived())
        return protocols[-1]

    server = await _create_server(streams, factory, host, 0)
    try:
        reader, writer = await streams.open_connection(host, server.sockets[0].getsockname()[1])
        writer.write(b"data, then EOF")
        writer.write_eof()
        for _ in range(600):
            if protocols:
                break
            await asyncio.sleep(0.05)
        exc = await asyncio.wait_for(protocols[0].lost, 60)
        assert isinstance(exc, ValueError) and "on purpose" in str(exc), exc
        assert [type(c.get("exception")) for c in loop_errors] == [ValueError], loop_errors
        loop_errors.clear()
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reply_written_just_before_abort_is_sent(transport: Tuple[Any, str]) -> None:
    """``writer.write(b"503 busy\\r\\n"); writer.transport.abort()`` in one loop iteration: the
    RDMA transport posts writes at the end of the iteration, and abort() dropped them, so the peer
    got nothing.  asyncio's write() sends at once, so the reply leaves before the abort; so it does
    now (abort() posts what the iteration gathered, then drops the connection)."""
    streams, host = transport

    async def busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(2)
        writer.write(b"503 busy\r\n")
        writer.transport.abort()

    server = await streams.start_server(busy, host, 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        for _ in range(3):
            reader, writer = await streams.open_connection(host, port)
            writer.write(b"hi")  # (the reader waits below before the server can answer)
            assert await asyncio.wait_for(reader.readexactly(10), 60) == b"503 busy\r\n"
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:  # (RDMA: the abort is a reset; TCP: an EOF, or a reset)
                pass


@pytest.mark.rxe
async def test_writes_of_one_iteration_are_one_message(rdma_host: str) -> None:
    """Small writes made in one loop iteration leave as one DATA message (aiohttp writes headers,
    chunk markers and bodies separately)."""
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(220))
        await writer.drain()
        writer.close()

    server = await aiodat.start_server(echo, rdma_host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await aiodat.open_connection(rdma_host, port)
        # completions reach the transport through its EVD's callback (no task waits on the EVD)
        with pytest.raises(aiodat.InvalidState, match="callback"):
            await writer.get_extra_info("aiodat_ep").recv_evd.wait(1, timeout=0)
        before = writer.transport.stats["data_msgs"]
        for i in range(50):
            writer.write(b"%03d," % i)
        writer.writelines([b"x" * 10, b"y" * 10])
        assert writer.transport.get_write_buffer_size() == 220  # nothing posted before the iteration ends
        await writer.drain()
        expected = b"".join(b"%03d," % i for i in range(50)) + b"x" * 10 + b"y" * 10
        assert await reader.readexactly(220) == expected
        assert writer.transport.stats["data_msgs"] - before == 1
        writer.close()
        await writer.wait_closed()


@pytest.mark.rxe
async def test_busy_polling_streams(rdma_host: str) -> None:
    """``busy_poll_us`` makes both ends' EVDs busy-poll (as rsockets' polling_time), and the stream
    works as ever; without it they sleep at once."""
    served: List[Any] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(writer.get_extra_info("aiodat_ep"))
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await aiodat.start_server(echo, rdma_host, 0, busy_poll_us=700)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await aiodat.open_connection(rdma_host, port, busy_poll_us=300)
        plain_reader, plain_writer = await aiodat.open_connection(rdma_host, port)
        for i in range(20):
            message = b"%04d" % i * (i + 1)
            writer.write(message)
            assert await reader.readexactly(len(message)) == message
        plain_writer.write(b"x")
        assert await plain_reader.readexactly(1) == b"x"  # (both handlers have started)
        assert writer.get_extra_info("aiodat_config").busy_poll_us == 300
        assert writer.get_extra_info("aiodat_ep").recv_evd.busy_poll_us == 300
        assert plain_writer.get_extra_info("aiodat_ep").recv_evd.busy_poll_us == 0
        assert [ep.recv_evd.busy_poll_us for ep in served] == [700, 700]
        for w in (writer, plain_writer):
            w.close()
            await w.wait_closed()


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.rxe
async def test_bad_arguments(rdma_host: str) -> None:
    """Unsupported options and bad sizes raise clear DAT errors; nothing stays open."""
    with pytest.raises(aiodat.ModelNotSupported, match="ssl"):
        await aiodat.open_connection(rdma_host, 1, ssl=True)
    with pytest.raises(aiodat.InvalidParameter, match="buffer_size"):
        await aiodat.open_connection(rdma_host, 1, buffer_size=3)
    with pytest.raises(aiodat.InvalidParameter, match="recv_depth"):
        await aiodat.start_server(lambda r, w: None, rdma_host, 0, recv_depth=0)
    with pytest.raises(aiodat.InvalidParameter, match="busy_poll_us"):
        await aiodat.open_connection(rdma_host, 1, busy_poll_us=-1)
    with pytest.raises(aiodat.InvalidAddress, match="cannot listen on 10.9.8.7"):
        await aiodat.start_server(lambda r, w: None, "10.9.8.7", 0)
    with pytest.raises(TypeError):
        await aiodat.open_connection(rdma_host, 1, nonsense=1)
    assert aiodat_streams.shared_ia_count() == 0


def test_config_validation_host() -> None:
    """StreamConfig checks its values without a device."""
    assert aiodat_streams.StreamConfig().validate().extra_slots >= 2
    with pytest.raises(aiodat.InvalidParameter, match="window_size"):
        aiodat_streams.StreamConfig(window_size=100).validate()
    for bad in (-1, 1_000_001, 1.5, True):
        with pytest.raises(aiodat.InvalidParameter, match="busy_poll_us"):
            aiodat_streams.StreamConfig(busy_poll_us=bad).validate()
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(aiodat.InvalidParameter, match="close_timeout"):
            aiodat_streams.StreamConfig(close_timeout=bad).validate()
    assert aiodat_streams.StreamConfig(close_timeout=None).validate().close_timeout is None
    assert aiodat_streams.HEADER.size == 8


@pytest.mark.rxe
async def test_a_failing_completion_queue_ends_the_stream_with_its_cause(rdma_host: str, loop_errors: List[dict]) -> None:
    """The CQ under a stream fails (a failed poll, from the shim's fault switch, as a device
    failure would): the EVD reports it to the transport (set_callback's on_error), which ends
    the connection with the cause instead of leaving both sides waiting for bytes that cannot
    come; nothing reaches the loop's exception handler."""
    from aiodat._lib import lib

    outcomes: List[Any] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(5) == b"hello"
        writer.write(b"ready")
        try:
            outcomes.append(await reader.read(100))
        except ConnectionResetError as exc:
            outcomes.append(exc)
        writer.close()

    server = await aiodat.start_server(handler, rdma_host, 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(rdma_host, port)
    try:
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 30) == b"ready"
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 1)  # the next poll of a CQ fails
        writer.write(b"x")
        try:
            outcomes.append(await asyncio.wait_for(reader.read(100), 60))
        except ConnectionResetError as exc:
            outcomes.append(exc)
        for _ in range(600):
            if len(outcomes) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 0)
        writer.close()
        server.close()
        await server.wait_closed()
    assert len(outcomes) == 2, f"a side was left waiting: {outcomes}"
    failures = [o for o in outcomes if isinstance(o, ConnectionResetError)]
    assert any("completion queue failed" in str(o) for o in failures), outcomes
    assert all(o in (b"", b"x") or isinstance(o, ConnectionResetError) for o in outcomes), outcomes


@pytest.mark.rxe
async def test_small_messages_take_the_c_steps_both_ways(rdma_host: str) -> None:
    """A request/response stream's DATA messages are received by the C Receiver and sent by the core's C
    take_data (aiodat/_shim/streamcore.c): the transport's Python path sees none of them.  Counted on the
    client's transport; fails if either C step stops taking the common case."""
    from aiodat.streams.transport import RdmaTransport

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):
            writer.write(data)
        writer.close()

    server = await aiodat.start_server(echo, rdma_host, 0)
    reader, writer = await aiodat.open_connection(rdma_host, server.sockets[0].getsockname()[1])
    transport = writer.transport
    python_receives: List[Any] = []
    python_sends: List[Any] = []
    completion, next_send = RdmaTransport._completion, transport._core.next_send

    def counting_completion(event: Any) -> None:
        if isinstance(event.cookie, tuple) and event.cookie[0] == "r":
            python_receives.append(event.cookie)
        completion(transport, event)

    def counting_next_send() -> Any:
        send = next_send()
        if send is not None and send.type == 1:  # a DATA message the C step did not take
            python_sends.append(send)
        return send

    transport._completion = counting_completion  # type: ignore[method-assign]
    transport._core.next_send = counting_next_send  # type: ignore[method-assign]
    for i in range(50):
        writer.write(b"ping %d" % i)
        assert await asyncio.wait_for(reader.read(100), 30) == b"ping %d" % i
    assert python_receives == [] and python_sends == []
    assert transport.stats["data_msgs"] >= 50 and transport.stats["bytes_received"] >= 50 * 6
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


@pytest.mark.rxe
async def test_an_environment_device_that_matches_no_port_stops_a_stream(
        rdma_host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """open_connection and start_server with $AIODAT_RXE_DEVICE naming no port: ProviderNotFound
    naming the variable, and no IA left open (the stream used the device it found instead)."""
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "rxe9")
    fds = _open_fds()
    with pytest.raises(aiodat.ProviderNotFound, match="AIODAT_RXE_DEVICE=rxe9"):
        await aiodat.open_connection("10.255.255.1", 7471)
    with pytest.raises(aiodat.ProviderNotFound, match="AIODAT_RXE_DEVICE=rxe9"):
        await aiodat.start_server(lambda r, w: None, None, 7471)
    assert aiodat_streams.shared_ia_count() == 0 and _open_fds() == fds
