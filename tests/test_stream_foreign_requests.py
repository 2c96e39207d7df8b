"""The "foreign requests" contract of aiodat streams (docs/streams.md): RDMA writes of your own on a stream's EP.

The Dask backend (aiodat.integrations.dask) RDMA-writes large frames on the queue pair of the stream
that carries its control messages.  What it relies on is a contract of the stream, tested here on its
own: completions with a cookie the stream does not own are dropped, bytes of a write posted before
``writer.write()`` are in place when the peer reads those stream bytes, one such write may be
outstanding while the stream's own sends fill its send queue, and a failed one breaks the stream
with a clear ConnectionResetError.  Run on both loops (``--aiodat-loop asyncio`` / ``uvloop``).
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Any, AsyncIterator, List, Tuple

import pytest

import aiodat
from aiodat.memory import Privileges, RemoteRegion

pytestmark = pytest.mark.rxe

REGION = 64 * 1024  # the server's window for our writes
#: cookies the stream does not own: anything but a pair whose first item is "s", "w" or "r"
FOREIGN_COOKIES = [("dask", 0), ("app", 7), "mine", 12345, None, object(), ("s", 1, "x"), ()]
#: large enough for the stream's own RDMA window writes (cookie ("w", 0)) to run next to ours
STREAM_BULK = 512 * 1024

Conn = Tuple[asyncio.StreamReader, asyncio.StreamWriter, RemoteRegion, bytearray]


async def _server(host: str) -> Any:
    """A stream server: grants each client a REMOTE_WRITE region on its own EP's PZ, then answers
    ``check N LEN\\n`` with the sha256 of the first LEN bytes written there, and ``bulk LEN\\n`` with
    the sha256 of the next LEN stream bytes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ep = writer.get_extra_info("aiodat_ep")
        target = bytearray(REGION)
        lmr = ep.pz.register(target, Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE)
        try:
            writer.write(lmr.remote().to_bytes())
            async for line in reader:
                verb, *args = line.split()
                if verb == b"check":
                    length = int(args[1])
                    writer.write(hashlib.sha256(target[:length]).hexdigest().encode() + b"\n")
                elif verb == b"bulk":
                    data = await reader.readexactly(int(args[0]))
                    writer.write(hashlib.sha256(data).hexdigest().encode() + b"\n")
                await writer.drain()
        except ConnectionError:
            pass  # the failure test breaks the connection on purpose
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass
            lmr.close()  # after the EP is gone: nothing can write into it any more (idempotent)

    return await aiodat.start_server(handle, host, 0)


@pytest.fixture
async def conn(rdma_device: Any) -> AsyncIterator[Conn]:
    server = await _server(rdma_device.address)
    reader, writer = await aiodat.open_connection(rdma_device.address, server.sockets[0].getsockname()[1])
    region = RemoteRegion.from_bytes(await asyncio.wait_for(reader.readexactly(20), 30))
    source = bytearray(REGION)
    try:
        yield reader, writer, region, source
    finally:
        writer.transport.abort()
        server.close()
        await asyncio.wait_for(server.wait_closed(), 30)


async def test_foreign_writes_share_the_stream(conn: Conn) -> None:
    """Writes with foreign cookies land before the stream bytes written after them, are never mistaken for
    the stream's own completions (its bulk transfer, window writes included, stays intact), and one may be
    posted while the stream's sends are in flight."""
    reader, writer, region, source = conn
    ep = writer.get_extra_info("aiodat_ep")
    lmr = ep.pz.register(source, Privileges.LOCAL_READ)
    try:
        bulk = bytes(range(256)) * (STREAM_BULK // 256)
        for n, cookie in enumerate(FOREIGN_COOKIES):
            length = 4096 * (n + 1)
            source[:length] = bytes([n + 1]) * length
            # the stream's own traffic in flight first: a bulk transfer posted at this iteration's end
            writer.write(b"bulk %d\n" % len(bulk) + bulk)
            await asyncio.sleep(0)
            ep.post_rdma_write(lmr[0:length], region[0:length], cookie)  # the one outstanding foreign request
            writer.write(b"check %d %d\n" % (n, length))
            assert (await asyncio.wait_for(reader.readline(), 60)).strip() == hashlib.sha256(bulk).hexdigest().encode()
            got = (await asyncio.wait_for(reader.readline(), 60)).strip()
            assert got == hashlib.sha256(source[:length]).hexdigest().encode(), f"write with cookie {cookie!r}"
        assert not writer.transport.is_closing()
        assert writer.transport.stats["window_writes"] > 0  # the stream's own RDMA writes ran alongside
    finally:
        writer.transport.abort()
        await asyncio.sleep(0)
        lmr.close()


async def test_a_failed_foreign_write_breaks_the_stream(conn: Conn) -> None:
    """A foreign write the peer refuses (a wrong rkey) fails the queue pair: the stream's reader gets a
    ConnectionResetError naming the failed RDMA write, as for a failed send of the stream's own."""
    reader, writer, region, source = conn
    ep = writer.get_extra_info("aiodat_ep")
    lmr = ep.pz.register(source, Privileges.LOCAL_READ)
    try:
        bad = RemoteRegion(region.address, region.length, region.rmr_context ^ 0x5A5A00)
        ep.post_rdma_write(lmr[0:4096], bad[0:4096], ("app", 1))
        with pytest.raises(ConnectionResetError, match="RDMA rdma_write failed"):
            await asyncio.wait_for(reader.read(100), 60)
        assert writer.transport.is_closing()
    finally:
        writer.transport.abort()
        await asyncio.sleep(0)
        lmr.close()
