"""Issue 16 item 5: Dask distributed over ``rdma://`` (aiodat.integrations.dask), one guest, real rxe.

The comm-level tests drive distributed's own ``listen``/``connect`` (handshake included); the
cluster test runs a real ``LocalCluster(protocol="rdma")`` with two workers in the test's own
loop (``asynchronous=True``, so the plugin's --aiodat-loop choice holds for the scheduler,
the workers and the client alike) and moves a 64 MiB array from one worker to the other.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import Any, AsyncIterator, List, Tuple

import pytest

np = pytest.importorskip("numpy")
distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")

from distributed.comm import CommClosedError, connect, listen  # noqa: E402
from distributed.protocol import dask_deserialize, dask_serialize, to_serialize  # noqa: E402

from aiodat.integrations import dask as rdma_dask  # noqa: E402

pytestmark = pytest.mark.rxe

SIZES = [0, 1, 4095, 65536, rdma_dask.ZERO_COPY_THRESHOLD - 1, rdma_dask.ZERO_COPY_THRESHOLD,
         (1 << 20) + 7, (5 << 20) + 3]  # 5 MiB: registered in an executor (ASYNC_REGISTER_FROM)


@pytest.fixture
def address(rdma_device: Any) -> str:
    return rdma_device.address


@pytest.fixture
async def echo(address: str) -> AsyncIterator[Tuple[Any, List[Any]]]:
    """A real distributed listener on rdma:// whose handler echoes every message back."""
    accepted: List[Any] = []

    async def handle(comm: Any) -> None:
        accepted.append(comm)
        try:
            while True:
                msg = await comm.read()
                if msg == "close":
                    await comm.close()
                    return
                await comm.write(msg)
        except CommClosedError:
            pass

    listener = await listen(f"rdma://{address}:0", handle)
    yield listener, accepted
    listener.stop()
    for comm in accepted:
        comm.abort()


def _array(n: int, seed: int) -> Any:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_backend_found_through_the_entry_point_and_addresses(address: str) -> None:
    from distributed.comm import registry
    from distributed.comm.addressing import get_address_host, get_local_address_for, resolve_address

    registry.backends.pop("rdma", None)  # found again through package metadata, as a fresh process does
    backend = registry.get_backend("rdma")
    assert isinstance(backend, rdma_dask.RDMABackend)
    assert get_address_host(f"rdma://{address}:8786") == address
    assert resolve_address(f"rdma://{address}:8786") == f"rdma://{address}:8786"
    assert get_local_address_for(f"rdma://{address}:8786") == f"rdma://{address}"


async def test_frames_of_every_size_round_trip(echo: Tuple[Any, List[Any]], address: str) -> None:
    listener, _ = echo
    assert listener.contact_address.startswith(f"rdma://{address}:")
    comm = await connect(listener.contact_address)
    try:
        assert comm.peer_address == listener.contact_address
        assert comm.local_address.startswith(f"rdma://{address}:")
        assert comm.same_host and comm.remote_info["python"] == comm.local_info["python"]
        before = dict(rdma_dask.RDMAComm.totals)
        for i, n in enumerate(SIZES):
            data = _array(n, i)
            await comm.write({"i": i, "data": to_serialize(data)})
            reply = await comm.read()
            assert reply["i"] == i
            got = reply["data"]
            assert got.nbytes == n and np.array_equal(got, data), f"frame of {n} bytes came back different"
            assert got.flags.writeable, "frames must arrive as writable buffers"
        totals = rdma_dask.RDMAComm.totals
        big = [n for n in SIZES if n >= rdma_dask.ZERO_COPY_THRESHOLD]
        # each big frame went by RDMA write twice (there and back)
        assert totals["rdma_frames"] - before["rdma_frames"] == 2 * len(big)
        assert totals["rdma_bytes"] - before["rdma_bytes"] == 2 * sum(big)
    finally:
        await comm.close()
    assert comm.closed()


async def test_many_messages_in_flight_keep_their_order(echo: Tuple[Any, List[Any]]) -> None:
    listener, _ = echo
    comm = await connect(listener.contact_address)
    big = _array(1 << 20, 7)
    try:
        sends = [comm.write({"n": i, "big": to_serialize(big) if i % 50 == 0 else None}) for i in range(200)]
        results = []

        async def reader() -> None:
            for _ in range(200):
                results.append(await comm.read())

        await asyncio.gather(reader(), *sends)
        assert [r["n"] for r in results] == list(range(200))
        assert all(np.array_equal(r["big"], big) for r in results if r["n"] % 50 == 0)
    finally:
        await comm.close()


async def test_close_and_abort_are_seen_by_the_peer(echo: Tuple[Any, List[Any]]) -> None:
    listener, accepted = echo
    comm = await connect(listener.contact_address)
    await comm.write("close")  # the peer closes its end gracefully
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(comm.read(), 30)
    assert comm.closed()
    with pytest.raises(CommClosedError, match="closed comm"):
        await comm.write("more")
    await comm.close()  # closing twice is fine

    comm2 = await connect(listener.contact_address)
    await comm2.write("ping")
    assert await comm2.read() == "ping"
    server_side = accepted[-1]
    comm2.abort()
    assert comm2.closed()
    with pytest.raises(CommClosedError):
        await comm2.read()
    end = time.monotonic() + 30
    while not server_side.closed():
        assert time.monotonic() < end, "the listener's comm never saw the abort"
        await asyncio.sleep(0.05)


async def test_a_comm_whose_peer_closed_says_closed_without_a_read(echo: Tuple[Any, List[Any]]) -> None:
    """distributed's connection pool asks ``closed()`` before it reuses a comm; once the peer has
    closed and nothing is left to read, it must say so without a read first (it used to stay
    False: the end's own marker sat in the message queue)."""
    listener, _ = echo
    comm = await connect(listener.contact_address)
    await comm.write("close")
    end = time.monotonic() + 30
    while not comm.closed():
        assert time.monotonic() < end, "closed() never became True after the peer closed"
        await asyncio.sleep(0.05)
    with pytest.raises(CommClosedError):
        await comm.read()
    await comm.close()


async def test_two_closes_at_once_deliver_what_was_written(address: str) -> None:
    """distributed may close one comm from two tasks at once; the second close waits for the
    first's graceful close instead of aborting it, so the peer still gets every message (the
    second used to abort the stream, dropping what the first was still delivering).  The server
    stops reading until both closes are under way, so what was written is still buffered then."""
    got: "asyncio.Queue[Any]" = asyncio.Queue()
    paused, resume = asyncio.Event(), asyncio.Event()

    async def handle(comm: Any) -> None:
        comm._transport.pause_reading()  # no credit goes back: the client's writes stay buffered
        paused.set()
        await resume.wait()
        comm._transport.resume_reading()
        try:
            while True:
                await got.put(await comm.read())
        except CommClosedError:
            await got.put("closed")

    listener = await listen(f"rdma://{address}:0", handle)
    try:
        comm = await connect(listener.contact_address)
        await asyncio.wait_for(paused.wait(), 30)
        data = b"x" * 6000
        sent = 0
        while not comm._transport.get_write_buffer_size():  # until the server's credits and window are used
            await asyncio.wait_for(comm.write({"i": sent, "data": data}), 30)
            sent += 1
            assert sent < 2000
        closing = asyncio.gather(comm.close(), comm.close())
        await asyncio.sleep(0.5)
        resume.set()
        await asyncio.wait_for(closing, 30)
        received = [await asyncio.wait_for(got.get(), 30) for _ in range(sent + 1)]
        assert [m["i"] for m in received[:sent]] == list(range(sent)) and received[sent] == "closed"
    finally:
        listener.stop()


async def test_a_cancelled_read_aborts_the_comm(echo: Tuple[Any, List[Any]]) -> None:
    listener, accepted = echo
    comm = await connect(listener.contact_address)
    await comm.write("ping")
    assert await comm.read() == "ping"
    task = asyncio.ensure_future(comm.read())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert comm.closed(), "distributed requires a cancelled read to abort the comm"
    with pytest.raises(CommClosedError):
        await comm.write("after")
    server_side = accepted[-1]
    end = time.monotonic() + 30
    while not server_side.closed():
        assert time.monotonic() < end, "the peer never saw the aborted comm"
        await asyncio.sleep(0.05)


async def test_a_write_cancelled_mid_rdma_write_frees_the_queue_pair_before_the_memory(
        echo: Tuple[Any, List[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A comm.write cancelled while its RDMA write is in flight aborts the comm with the queue pair
    destroyed before the frames' LMRs are deregistered (it may still read them).  The LMRs used to
    be closed first, the queue pair still alive."""
    listener, _ = echo
    comm = await connect(listener.contact_address)
    ep = comm._ep
    task: "asyncio.Future[Any]"
    real_write = ep.post_rdma_write

    def write_then_cancel(*args: Any, **kwargs: Any) -> Any:
        real_write(*args, **kwargs)
        task.cancel()  # lands at the write's next await: the ACK

    closed_with_ep_open: List[Any] = []
    real_close = rdma_dask._close_quietly

    def close_quietly(handle: Any) -> None:
        if not ep.closed:
            closed_with_ep_open.append(handle)
        real_close(handle)

    monkeypatch.setattr(ep, "post_rdma_write", write_then_cancel)
    monkeypatch.setattr(rdma_dask, "_close_quietly", close_quietly)
    task = asyncio.ensure_future(comm.write(to_serialize(_array(1 << 20, 7))))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert comm.closed() and ep.closed
    assert closed_with_ep_open == []


async def test_a_read_whose_connection_ended_is_comm_closed(echo: Tuple[Any, List[Any]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A message announced just before the connection ended: its frames' registration on the
    stream's (now closed) PZ fails, and the read raises CommClosedError, which distributed takes
    for a lost connection (it retries elsewhere).  It raised aiodat's InvalidHandle, which
    distributed's gather_dep takes for a failed task."""
    listener, _ = echo
    comm = await connect(listener.contact_address)
    real_register = rdma_dask._register

    async def register_once_lost(pz: Any, buffer: Any, privileges: Any) -> Any:
        if pz is comm._ep.pz and privileges & rdma_dask.Privileges.REMOTE_WRITE:  # the echo announced it
            comm._transport.abort()  # the connection ends, as on a DISCONNECTED: its PZ is closed
        return await real_register(pz, buffer, privileges)

    monkeypatch.setattr(rdma_dask, "_register", register_once_lost)
    await comm.write({"data": to_serialize(_array(1 << 20, 3))})  # echoed: announced, its frame granted
    with pytest.raises(CommClosedError, match="receiving the frames"):
        await comm.read()
    assert comm.closed()


async def test_both_ends_may_write_a_large_message_before_they_read(address: str) -> None:
    """Each end writes a message with a zero-copy frame, then reads it, as over tcp://, whose
    write() returns once the bytes are buffered.  The receiver granted a frame only when its
    read() reached the message, so each write() waited for the other's read() for ever."""
    mine, theirs = _array(1 << 20, 11), _array(1 << 20, 12)
    got: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()
    accepted: List[Any] = []

    async def handle(comm: Any) -> None:
        accepted.append(comm)
        try:
            await comm.write({"data": to_serialize(theirs)})
            got.set_result(await comm.read())
        except BaseException as exc:
            if not got.done():
                got.set_exception(exc)
            raise

    listener = await listen(f"rdma://{address}:0", handle)
    comm = await connect(listener.contact_address)
    try:
        await asyncio.wait_for(comm.write({"data": to_serialize(mine)}), 10)
        reply = await asyncio.wait_for(comm.read(), 10)
        assert np.array_equal(reply["data"], theirs)
        assert np.array_equal((await asyncio.wait_for(got, 10))["data"], mine)
    finally:
        comm.abort()
        listener.stop()
        for other in accepted:
            other.abort()


async def test_a_comm_nobody_reads_takes_in_no_more_than_receive_ahead(address: str) -> None:
    """With receive-ahead at 1 MiB, a writer's messages of 600 KiB frames: the first is granted at
    once (nothing waits to be read), the second waits until the reader's read() takes the first,
    so its write() waits too, as a tcp:// writer waits on full buffers.  Before, every message was
    received ahead at once, without bound.  Then everything arrives, in order."""
    n, sent = 600 << 10, [_array(600 << 10, i) for i in range(3)]
    accepted: "asyncio.Queue[Any]" = asyncio.Queue()

    async def handle(comm: Any) -> None:
        await accepted.put(comm)

    with dask.config.set({"distributed.comm.rdma.receive-ahead": "1 MiB"}):
        listener = await listen(f"rdma://{address}:0", handle)
        comm = await connect(listener.contact_address)
        server = await asyncio.wait_for(accepted.get(), 10)
        try:
            await asyncio.wait_for(comm.write({"data": to_serialize(sent[0])}), 10)
            second = asyncio.ensure_future(comm.write({"data": to_serialize(sent[1])}))
            await asyncio.sleep(1.0)
            assert not second.done(), "the second message was taken in beyond receive-ahead"
            assert server._inbox.ahead == n
            got = [await asyncio.wait_for(server.read(), 10)]
            await asyncio.wait_for(second, 10)  # granted once the first was read
            third = asyncio.ensure_future(comm.write({"data": to_serialize(sent[2])}))
            got += [await asyncio.wait_for(server.read(), 10), await asyncio.wait_for(server.read(), 10)]
            await asyncio.wait_for(third, 10)
            assert all(np.array_equal(g["data"], s) for g, s in zip(got, sent))
            assert server._inbox.ahead == 0
        finally:
            comm.abort()
            server.abort()
            listener.stop()


class _Strided:
    """A type whose custom serializer hands distributed a strided (non-contiguous) frame."""

    def __init__(self, data: bytes) -> None:
        self.data = data


@dask_serialize.register(_Strided)
def _serialize_strided(obj: _Strided) -> Tuple[dict, List[memoryview]]:
    doubled = bytearray(2 * len(obj.data))
    doubled[::2] = obj.data
    return {}, [memoryview(doubled)[::2]]


@dask_deserialize.register(_Strided)
def _deserialize_strided(header: dict, frames: List[Any]) -> _Strided:
    return _Strided(bytes(frames[0]))


@pytest.mark.parametrize("n", [1000, rdma_dask.ZERO_COPY_THRESHOLD + 1])
async def test_a_strided_frame_from_a_custom_serializer_is_sent_as_its_bytes(
        echo: Tuple[Any, List[Any]], n: int) -> None:
    """A custom serializer's non-contiguous frame, inline or large, arrives as its bytes, as over
    tcp:// (which copies it).  Its write used to fail, aborting the comm."""
    listener, _ = echo
    comm = await connect(listener.contact_address)
    try:
        data = bytes(_array(n, 5))
        await asyncio.wait_for(comm.write({"x": to_serialize(_Strided(data))}), 10)
        reply = await asyncio.wait_for(comm.read(), 10)
        assert reply["x"].data == data
    finally:
        await comm.close()


async def test_inline_frames_arrive_in_buffers_of_their_own(echo: Tuple[Any, List[Any]]) -> None:
    """Two arrays sent inline (under ZERO_COPY_THRESHOLD) come back over buffers of their own, so
    keeping one does not keep the other's bytes (they shared one bytearray: the whole message)."""
    listener, _ = echo
    comm = await connect(listener.contact_address)
    try:
        first, second = _array(100_000, 1), _array(100_000, 2)
        await comm.write({"a": to_serialize(first), "b": to_serialize(second)})
        reply = await comm.read()
        assert np.array_equal(reply["a"], first) and np.array_equal(reply["b"], second)

        def owner(array: Any) -> Any:
            while isinstance(getattr(array, "base", None), (np.ndarray, memoryview)):
                array = array.base
            return array.obj if isinstance(array, memoryview) else array.base

        assert owner(reply["a"]) is not owner(reply["b"])
        assert len(owner(reply["a"])) == 100_000
    finally:
        await comm.close()


async def test_rdma_refuses_required_encryption_and_takes_the_configured_backlog(address: str) -> None:
    """``Security(require_encryption=True)`` refuses rdma:// (no TLS) with distributed's own error,
    as tcp:// is refused, instead of sending in clear text; the listener's backlog is
    ``distributed.comm.socket-backlog``, as the tcp listener's (it was aiodat's default, 100)."""
    import dask

    with pytest.raises(RuntimeError, match="encryption required"):
        await listen(f"rdma://{address}:0", lambda comm: None, require_encryption=True).start()
    with pytest.raises(RuntimeError, match="encryption required"):
        await connect(f"rdma://{address}:1", require_encryption=True)
    with dask.config.set({"distributed.comm.socket-backlog": 37}):
        listener = await listen(f"rdma://{address}:0", lambda comm: None)
    try:
        assert listener._server._cr_evd.qlen == 37
    finally:
        listener.stop()


async def test_errors_name_what_was_wrong(address: str) -> None:
    # nothing listens on that port: distributed retries, then times out naming the address and aiodat's error
    with pytest.raises(OSError, match=rf"rdma://{address}:1\b"):
        await connect(f"rdma://{address}:1", timeout=2)
    # no RDMA device has this address
    with pytest.raises(Exception, match="192.0.2.1"):
        await listen("rdma://192.0.2.1:0", lambda comm: None).start()


async def test_local_cluster_moves_64_mib_between_workers(address: str) -> None:
    from distributed import Client, LocalCluster

    size = 64 << 20
    t0 = time.monotonic()
    async with LocalCluster(protocol="rdma", host=address, n_workers=2, threads_per_worker=1, processes=False,
                            asynchronous=True, dashboard_address=None) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            started = time.monotonic() - t0
            assert cluster.scheduler_address.startswith(f"rdma://{address}:")
            await client.wait_for_workers(2)
            # an asynchronous client's scheduler_info() is a cache: ask the scheduler
            workers = sorted((await client.scheduler.identity(n_workers=-1))["workers"])
            assert len(workers) == 2 and all(w.startswith(f"rdma://{address}:") for w in workers)
            a, b = workers
            # 64 MiB made on worker A, consumed on worker B: the array must cross between them
            before = dict(rdma_dask.RDMAComm.totals)
            made = client.submit(_make, size, 16, workers=[a], pure=False)
            digest = client.submit(_digest_where, made, workers=[b], pure=False)
            t1 = time.monotonic()
            got, where = await digest
            moved = time.monotonic() - t1
            assert got == hashlib.sha256(_make(size, 16).tobytes()).hexdigest()
            assert where == b  # the digest ran on B, so the array crossed from A (counted below)
            assert rdma_dask.RDMAComm.totals["rdma_bytes"] - before["rdma_bytes"] >= size
            # a computation whose result is checked, spread over both workers
            total = await client.submit(sum, client.map(lambda x: x * x, range(100)))
            assert total == sum(x * x for x in range(100))
    print(f"\ndask LocalCluster on rdma://: start {started:.1f} s, 64 MiB make+move+digest {moved:.1f} s "
          f"[{os.environ.get('AIODAT_LOOP', '')}]")


def _make(size: int, seed: int) -> Any:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _digest(array: Any) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def _digest_where(array: Any) -> Any:
    """The array's digest and the address of the worker that computed it."""
    from distributed import get_worker

    return _digest(array), get_worker().address
