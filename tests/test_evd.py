"""Issue 3: EVDs (wait, dequeue, async for, threshold, one waiter, cancellation, overflow, merging),
LMRs, use after free of every object, and closing an IA with everything still alive."""
from __future__ import annotations

import array
import asyncio
import gc
import mmap
import os
import time
from typing import Any, List

import pytest

import aiodat
from aiodat import EPState, EventType, EvdFlags, Privileges
from aiodat.testing.plugin import make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # bound for every wait: the QEMU guest runs under TCG


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- waiting ---------------------------------------------------------------------------


async def test_wait_timeout_raises_timeout_expired(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(4)
    started = time.monotonic()
    with pytest.raises(aiodat.TimeoutExpired) as info:
        await evd.wait(timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - started >= 0.19
    assert evd.query().waiting is False  # the timed-out waiter is gone: another may wait
    evd.post_se("after")
    assert (await evd.wait(timeout=T))[0].payload == "after"


async def test_wait_timeouts_hold_after_the_timer_is_reused(ia: Any, loop_errors: List[dict]) -> None:
    """One timer serves an EVD's waits: a long timeout's timer never cuts a later wait short, a
    shorter timeout still fires on time, and a wait without a timeout is never expired by it."""
    evd = ia.create_evd(4)

    async def post_later(delay: float, payload: Any) -> None:
        await asyncio.sleep(delay)
        evd.post_se(payload)

    for i in range(50):  # many waits with a long timeout, each woken by an event
        asyncio.get_running_loop().call_soon(evd.post_se, i)
        assert (await evd.wait(timeout=60))[0].payload == i
    started = time.monotonic()
    with pytest.raises(aiodat.TimeoutExpired, match="after 0.3s"):
        await evd.wait(timeout=0.3)  # a nearer deadline than the pending 60 s timer
    assert 0.29 <= time.monotonic() - started < 20
    # a short wait leaves its timer behind; a later, longer wait outlives that timer
    asyncio.get_running_loop().call_soon(evd.post_se, "quick")
    assert (await evd.wait(timeout=0.2))[0].payload == "quick"
    poster = asyncio.ensure_future(post_later(0.6, "late"))
    assert (await evd.wait(timeout=T))[0].payload == "late"
    await poster
    # and a wait with no timeout at all, after another short one
    asyncio.get_running_loop().call_soon(evd.post_se, "quick2")
    assert (await evd.wait(timeout=0.2))[0].payload == "quick2"
    poster = asyncio.ensure_future(post_later(0.6, "untimed"))
    assert (await evd.wait())[0].payload == "untimed"
    await poster
    started = time.monotonic()
    with pytest.raises(aiodat.TimeoutExpired):
        await evd.wait(timeout=0.25)  # after all that, a timeout still fires on time
    assert 0.24 <= time.monotonic() - started < 20
    evd.close()
    assert not loop_errors


async def test_dequeue_returns_none_when_empty(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(4)
    assert evd.dequeue() is None
    evd.post_se(1)
    event = evd.dequeue()
    assert event is not None and event.type is EventType.SOFTWARE_EVENT and event.payload == 1
    assert event.evd is evd
    assert evd.dequeue() is None


async def test_async_for_over_an_evd(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(8)

    async def produce() -> None:
        for i in range(5):
            await asyncio.sleep(0.01)
            evd.post_se(i)

    producer = asyncio.ensure_future(produce())
    seen = []
    async for event in evd:
        seen.append(event.payload)
        if len(seen) == 5:
            break
    await producer
    assert seen == [0, 1, 2, 3, 4]


async def test_threshold(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(8)
    waiter = asyncio.ensure_future(evd.wait(threshold=3, timeout=T))
    for i in range(2):
        evd.post_se(i)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # below the threshold: keep waiting
    evd.post_se(2)
    events = await waiter
    assert [e.payload for e in events] == [0, 1, 2]
    with pytest.raises(aiodat.InvalidParameter):
        await evd.wait(threshold=9)  # more than qlen can never be satisfied
    with pytest.raises(aiodat.InvalidParameter):
        await evd.wait(threshold=0)
    for i in range(4):
        evd.post_se(i)
    assert len(await evd.wait(max_events=3)) == 3
    assert evd.query().queued == 1


async def test_only_one_waiter(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(4)
    first = asyncio.ensure_future(evd.wait(timeout=T))
    await asyncio.sleep(0)
    assert evd.query().waiting
    with pytest.raises(aiodat.InvalidState):
        await evd.wait(timeout=T)
    evd.post_se("x")
    assert [e.payload for e in await first] == ["x"]


async def test_cancelled_waiter_loses_no_completion(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    recv_evd = pair.server.recv_evd
    pair.server.post_recv(pair.server_lmr[0:64], cookie="in flight")
    waiter = asyncio.ensure_future(recv_evd.wait(timeout=T))
    await asyncio.sleep(0)
    pair.client_lmr.memoryview()[0:5] = b"hello"
    pair.client.post_send(pair.client_lmr[0:5])  # the completion is on its way while we cancel
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not recv_evd.query().waiting
    (event,) = await recv_evd.wait(timeout=T)
    assert event.cookie == "in flight" and event.ok and event.transferred_length == 5
    assert bytes(pair.server_lmr.memoryview()[0:5]) == b"hello"


async def test_cancelled_wait_frees_the_evd_at_once(ia: Any, loop_errors: List[dict]) -> None:
    """Issue 13: after task.cancel() another task may wait on the EVD at once, even before the
    cancelled task has run again; the cancelled task's clean-up leaves the new wait alone."""
    evd = ia.create_evd(4)
    first = asyncio.ensure_future(evd.wait(timeout=T))
    await asyncio.sleep(0)
    assert evd.query().waiting
    second = asyncio.ensure_future(evd.wait(timeout=T))  # its first step is queued now ...
    first.cancel()  # ... ahead of the cancelled task's wake-up
    assert not evd.query().waiting
    await asyncio.sleep(0)  # second starts waiting; then the cancelled one runs its clean-up
    await asyncio.sleep(0)
    assert evd.query().waiting and not second.done()
    evd.post_se("x")
    assert [e.payload for e in await asyncio.wait_for(second, T)] == ["x"]
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_cancelled_waiter_after_wakeup_keeps_events(ia: Any, loop_errors: List[dict]) -> None:
    """The waiter's future is already resolved when the task is cancelled: the events stay queued."""
    evd = ia.create_evd(4)
    waiter = asyncio.ensure_future(evd.wait(timeout=T))
    await asyncio.sleep(0)
    evd.post_se("a")  # resolves the waiter's future now
    evd.post_se("b")
    waiter.cancel()  # ... but the task is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert [e.payload for e in await evd.wait(timeout=T)] == ["a", "b"]


# -- capacity ---------------------------------------------------------------------------


async def test_post_se_on_full_evd_raises_queue_full(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(2)
    evd.post_se(1)
    evd.post_se(2)
    with pytest.raises(aiodat.QueueFull):
        evd.post_se(3)
    assert [e.payload for e in await evd.wait(timeout=T)] == [1, 2]
    evd.post_se(3)  # room again
    no_se = ia.create_evd(2, EvdFlags.DTO)
    with pytest.raises(aiodat.InvalidParameter):
        no_se.post_se(1)


async def test_overflow_of_connection_events(ia: Any, loop_errors: List[dict]) -> None:
    """More CR and connection events than qlen: ASYNC_ERROR_EVD_OVERFLOW on the async EVD, none dropped."""
    n = 4
    pz = ia.create_pz()
    cr_evd = ia.create_evd(1, EvdFlags.CR)
    conn_evd = ia.create_evd(2, EvdFlags.CONNECTION)
    psp = ia.create_psp_any(cr_evd)
    clients = [ia.create_ep(pz, connect_evd=conn_evd) for _ in range(n)]
    for i, client in enumerate(clients):
        client.connect_nowait(ia.address, psp.port, b"%d" % i, timeout=T)
    deadline = time.monotonic() + T
    while cr_evd.query().queued < n:  # let every request arrive without taking any
        assert time.monotonic() < deadline, "connection requests did not arrive"
        await asyncio.sleep(0.05)
    overflow = await ia.async_evd.wait_one(timeout=T)
    assert overflow.type is EventType.ASYNC_ERROR_EVD_OVERFLOW and overflow.obj is cr_evd
    requests = await cr_evd.wait(timeout=T)
    assert sorted(e.cr.private_data for e in requests) == [(b"%d" % i).ljust(56, b"\0") for i in range(n)]
    servers = []
    for event in requests:
        server = ia.create_ep(pz)
        servers.append(server)
        event.cr.accept_nowait(server)
    # n ESTABLISHED events on a connect EVD of qlen 2
    deadline = time.monotonic() + T
    while not all(c.state is EPState.CONNECTED for c in clients):
        assert time.monotonic() < deadline, "connections did not establish"
        await asyncio.sleep(0.05)
    overflow = await ia.async_evd.wait_one(timeout=T)
    assert overflow.type is EventType.ASYNC_ERROR_EVD_OVERFLOW and overflow.obj is conn_evd
    established = await conn_evd.wait(timeout=T)
    assert len(established) == n
    assert {e.ep for e in established} == set(clients)
    assert all(e.type is EventType.CONNECTION_EVENT_ESTABLISHED for e in established)
    assert conn_evd.overflow_count >= n - 2


async def test_completions_wait_in_cq_while_evd_is_full(ia: Any, loop_errors: List[dict]) -> None:
    """DTO completions beyond qlen stay in the CQ and come out as room appears: none lost, in order.

    (The CQ is sized qlen too, so at most qlen completions may wait there: more would overrun it.)
    """
    pair = await make_ep_pair(ia)
    recv_evd = ia.create_evd(4, EvdFlags.DTO)
    server = ia.create_ep(pair.pz, recv_evd=recv_evd)
    client = ia.create_ep(pair.pz)
    cr_evd = ia.create_evd(2, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    for i in range(7):
        server.post_recv(pair.server_lmr[i * 8:(i + 1) * 8], cookie=i)
    connecting = asyncio.ensure_future(client.connect(ia.address, psp.port, timeout=T))
    await (await cr_evd.wait_one(timeout=T)).cr.accept(server, timeout=T)
    await connecting
    with pytest.raises(aiodat.TimeoutExpired):
        await recv_evd.wait(timeout=0.01)  # the EVD now watches its channel: completions flow in unasked

    async def send(cookies: range) -> None:
        for i in cookies:
            client.post_send(pair.client_lmr[0:8], cookie=i)
        sent: List[Any] = []
        while len(sent) < len(cookies):
            sent += await client.request_evd.wait(timeout=T)
        assert all(e.ok for e in sent)

    await send(range(4))
    deadline = time.monotonic() + T
    while recv_evd.query().queued < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await send(range(4, 7))  # delivered: their completions wait in the CQ, the EVD being full
    await asyncio.sleep(0.2)
    assert recv_evd.query().queued == 4  # never more than qlen queued
    first = await recv_evd.wait(timeout=T)
    assert [e.cookie for e in first] == [0, 1, 2, 3]
    rest: List[Any] = []
    while len(rest) < 3:
        rest += await recv_evd.wait(timeout=T)
    assert [e.cookie for e in rest] == [4, 5, 6] and all(e.ok for e in first + rest)


async def test_software_and_dto_events_merge(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    merged = ia.create_evd(8, EvdFlags.DTO | EvdFlags.SOFTWARE | EvdFlags.CONNECTION)
    client = ia.create_ep(pair.pz, recv_evd=merged, request_evd=merged, connect_evd=merged)
    server = ia.create_ep(pair.pz)
    cr_evd = ia.create_evd(2, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    client.connect_nowait(ia.address, psp.port, timeout=T)
    (await cr_evd.wait_one(timeout=T)).cr.accept_nowait(server)
    assert (await merged.wait_one(timeout=T)).type is EventType.CONNECTION_EVENT_ESTABLISHED
    client.post_recv(pair.client_lmr[0:64], cookie="r")
    server.post_recv(pair.server_lmr[64:128])  # a send with no receive posted would retry for ever (RNR)
    merged.post_se("software")
    await server.connect_evd.wait_one(timeout=T)
    server.post_send(pair.server_lmr[0:10], cookie="s")
    client.post_send(pair.client_lmr[64:74], cookie="c")
    events: List[Any] = []
    while len(events) < 3:
        events += await merged.wait(timeout=T)
    kinds = {(e.type, getattr(e, "cookie", None) or getattr(e, "payload", None)) for e in events}
    assert kinds == {(EventType.SOFTWARE_EVENT, "software"), (EventType.DTO_COMPLETION, "r"),
                     (EventType.DTO_COMPLETION, "c")}
    assert events[0].type is EventType.SOFTWARE_EVENT  # posted before any completion existed


async def test_a_broken_connection_comes_after_the_completion_that_broke_it(ia: Any, loop_errors: List[dict]) -> None:
    """On an EVD that merges DTO and connection events, the error completion comes first and the
    CONNECTION_EVENT_BROKEN it causes after it.  BROKEN was pushed while the completion was still
    being turned into its event, and came out first."""
    from aiodat.cm import connect_pair
    from aiodat.memory import RemoteRegion

    pz = ia.create_pz()
    merged = ia.create_evd(8, EvdFlags.DTO | EvdFlags.CONNECTION)
    client = ia.create_ep(pz, request_evd=merged, connect_evd=merged)
    server = ia.create_ep(pz)
    clmr, slmr = pz.register(bytearray(64), Privileges.ALL), pz.register(bytearray(64), Privileges.ALL)
    await connect_pair(client, server)  # (awaited: ESTABLISHED goes to the connect call, not the EVD)
    good = slmr.remote()
    client.post_rdma_write(clmr[0:8], RemoteRegion(good.address, 8, good.rmr_context ^ 0x5A5A5A00), cookie="w")
    events: List[Any] = []
    while not any(e.type is EventType.CONNECTION_EVENT_BROKEN for e in events):
        events += await merged.wait(timeout=T)
    assert [e.type for e in events] == [EventType.DTO_COMPLETION, EventType.CONNECTION_EVENT_BROKEN]
    assert events[0].cookie == "w" and not events[0].ok


async def test_evd_query_and_resize(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(4, EvdFlags.DTO | EvdFlags.SOFTWARE)
    q = evd.query()
    assert q.qlen == 4 and q.queued == 0 and q.ia is ia and not q.is_async
    assert q.streams == EvdFlags.DTO | EvdFlags.SOFTWARE
    for i in range(3):
        evd.post_se(i)
    with pytest.raises(aiodat.InvalidState):
        evd.resize(2)
    evd.resize(16)
    assert evd.qlen == 16 and evd.query().queued == 3
    with pytest.raises(aiodat.InvalidParameter):
        ia.create_evd(0)
    with pytest.raises(aiodat.InvalidParameter):
        ia.create_evd(10**9)  # beyond max_evd_qlen
    # resize takes the same checks as create_evd: True was taken as a qlen, a qlen beyond the
    # device's went on, and one beyond a C int raised cffi's OverflowError
    for bad in (True, 0, 2**31, 10**9, 4.0):
        with pytest.raises(aiodat.InvalidParameter, match="qlen"):
            evd.resize(bad)
    assert evd.qlen == 16 and evd.query().queued == 3
    # streams: an int with no known stream, or with unknown bits, took nothing, every stream (-1)
    # or kept the unknown bit
    for bad in (0, -1, 1 << 20, EvdFlags.DTO | 0x2):
        with pytest.raises(aiodat.InvalidParameter, match="streams must be one or more EvdFlags"):
            ia.create_evd(4, bad)
    assert ia.async_evd.query().is_async


async def test_evd_free_refused_while_in_use(ia: Any, loop_errors: List[dict]) -> None:
    pz = ia.create_pz()
    dto, conn, cr = ia.create_evd(4, EvdFlags.DTO), ia.create_evd(4, EvdFlags.CONNECTION), ia.create_evd(4, EvdFlags.CR)
    ep = ia.create_ep(pz, recv_evd=dto, request_evd=dto, connect_evd=conn)
    psp = ia.create_psp_any(cr)
    for evd in (dto, conn, cr):
        with pytest.raises(aiodat.InvalidState):
            evd.free()
        assert not evd.closed
    private = ia.create_ep(pz)
    with pytest.raises(aiodat.InvalidState):
        private.recv_evd.free()  # an EP's own EVD goes with the EP
    ep.free()
    psp.free()
    for evd in (dto, conn, cr):
        evd.free()
        assert evd.closed
    own = private.recv_evd, private.request_evd, private.connect_evd
    private.free()
    assert all(evd.closed for evd in own)


async def test_evd_free_wakes_waiter_with_invalid_handle(ia: Any, loop_errors: List[dict]) -> None:
    evd = ia.create_evd(4)
    waiter = asyncio.ensure_future(evd.wait(timeout=T))
    await asyncio.sleep(0)
    evd.free()
    with pytest.raises(aiodat.InvalidHandle):
        await waiter


# -- lifetimes ----------------------------------------------------------------------------


async def test_use_after_free_raises_invalid_handle(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    # CR after accept/reject
    cr_evd = ia.create_evd(2, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    ep = ia.create_ep(pair.pz)
    client = ia.create_ep(pair.pz)
    client.connect_nowait(ia.address, psp.port, timeout=T)
    cr = (await cr_evd.wait_one(timeout=T)).cr
    await cr.accept(ep, timeout=T)
    for call in (lambda: cr.reject(), lambda: cr.accept_nowait(ep)):
        with pytest.raises(aiodat.InvalidHandle):
            call()
    # PSP
    psp.free()
    with pytest.raises(aiodat.InvalidHandle):
        psp.query()
    with pytest.raises(aiodat.InvalidHandle):
        psp.free()
    # EP
    ep.free()
    for call in (ep.query, lambda: ep.post_recv(pair.server_lmr[0:8]), lambda: ep.post_send(pair.server_lmr[0:8]),
                 lambda: ep.connect_nowait(ia.address, 1), ep.disconnect_nowait, ep.reset, ep.free):
        with pytest.raises(aiodat.InvalidHandle):
            call()
    with pytest.raises(aiodat.InvalidHandle):
        await ep.connect(ia.address, 1)
    with pytest.raises(aiodat.InvalidHandle):
        await ep.disconnect()
    # LMR
    lmr = pair.pz.register(bytearray(64))
    lmr.free()
    for call in (lmr.query, lambda: lmr[0:8], lmr.segment, lmr.memoryview, lmr.remote, lmr.free):
        with pytest.raises(aiodat.InvalidHandle):
            call()
    seg = pair.client_lmr[0:8]
    pair.client.free()
    pair.client_lmr.free()
    with pytest.raises(aiodat.InvalidHandle):
        pair.server.post_send(seg)  # a segment of a freed LMR
    with pytest.raises(aiodat.InvalidHandle):
        seg.remote()  # (it gave a region naming the freed registration's rkey)
    # EVD
    evd = ia.create_evd(2)
    evd.free()
    for call in (evd.dequeue, lambda: evd.post_se(1), evd.query, lambda: evd.resize(4), evd.free,
                 lambda: setattr(evd, "busy_poll_us", 50)):  # (the setter took it silently)
        with pytest.raises(aiodat.InvalidHandle):
            call()
    with pytest.raises(aiodat.InvalidHandle):
        await evd.wait(timeout=1)
    # PZ: refused while in use, then freed
    pz = ia.create_pz()
    in_pz = pz.register(bytearray(8))
    with pytest.raises(aiodat.InvalidState):
        pz.free()
    in_pz.free()
    pz.free()
    for call in (lambda: pz.register(bytearray(8)), pz.create_rmr, pz.free, lambda: ia.create_ep(pz)):
        with pytest.raises(aiodat.InvalidHandle):
            call()
    # IA
    ia.close()
    for call in (ia.query, ia.create_pz, lambda: ia.create_evd(2), ia.async_evd.dequeue,
                 lambda: pair.server.post_recv(None)):
        with pytest.raises(aiodat.InvalidHandle):
            call()


async def _busy_ia(name: str) -> Any:
    """An IA with a connected pair, a PSP, LMRs, posted receives and a waiting task."""
    ia = aiodat.open_ia(name)
    pair = await make_ep_pair(ia)
    pair.client.post_recv(pair.client_lmr[0:64], cookie="pending")
    pair.pz.register(bytearray(4096))
    ia.create_evd(4).post_se("unread")
    return ia, pair


async def test_closing_ia_closes_everything_without_fd_leak(rdma_device: Any, loop_errors: List[dict]) -> None:
    ia, _ = await _busy_ia(rdma_device.name)  # the first IA of the process sets librdmacm up for good
    ia.close()
    gc.collect()
    before = open_fds()
    ia, pair = await _busy_ia(rdma_device.name)
    waiter = asyncio.ensure_future(pair.server.recv_evd.wait(timeout=T))
    await asyncio.sleep(0)
    assert open_fds() > before
    objects = [pair.client, pair.server, pair.psp, pair.client_lmr, pair.server_lmr, pair.pz,
               pair.client.recv_evd, pair.server.connect_evd, ia.async_evd]
    ia.close()  # no error
    assert all(obj.closed for obj in objects)
    with pytest.raises(aiodat.InvalidHandle):
        await waiter
    await asyncio.sleep(0.05)  # nothing fires on the loop for the destroyed fds
    gc.collect()
    assert open_fds() == before


# -- LMRs ---------------------------------------------------------------------------------


def _buffers() -> List[Any]:
    buffers: List[Any] = [bytearray(4096), memoryview(bytearray(4096)), mmap.mmap(-1, 4096),
                          array.array("d", [0.0] * 512)]
    try:
        import numpy  # not a dependency: only when it is installed
    except ImportError:
        pass
    else:
        buffers.append(numpy.zeros(512, dtype=numpy.float64))
    return buffers


async def test_lmr_over_buffer_types_carries_data(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    for buffer in _buffers():
        lmr = pair.pz.register(buffer, Privileges.LOCAL_WRITE)
        assert lmr.length == 4096 and lmr.address and lmr.lmr_context
        payload = os.urandom(4096)
        pair.client_lmr.memoryview()[0:4096] = payload
        pair.server.post_recv(lmr[0:4096], cookie=type(buffer).__name__)
        pair.client.post_send(pair.client_lmr[0:4096])
        (event,) = await pair.server.recv_evd.wait(timeout=T)
        event.raise_for_status()
        await pair.client.request_evd.wait(timeout=T)
        assert bytes(memoryview(buffer).cast("B")) == payload, type(buffer).__name__
        lmr.free()


def test_numpy_lmr(ia: Any) -> None:
    numpy = pytest.importorskip("numpy")
    arr = numpy.arange(1024, dtype=numpy.uint32)
    with ia.create_pz() as pz:
        lmr = pz.register(arr)
        assert lmr.length == arr.nbytes
        assert bytes(lmr.memoryview()[0:8]) == arr[0:2].tobytes()
        with pytest.raises(aiodat.InvalidParameter):
            pz.register(arr[::2])  # not contiguous


def test_registered_bytearray_cannot_resize(ia: Any) -> None:
    buf = bytearray(b"x" * 128)
    pz = ia.create_pz()
    lmr = pz.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"more")
    with pytest.raises(BufferError):
        del buf[0:10]
    assert len(buf) == 128
    lmr.free()
    buf.extend(b"more")  # the export ended with the registration
    assert len(buf) == 132


def test_lmr_segments_and_query(ia: Any) -> None:
    pz = ia.create_pz()
    buf = bytearray(256)
    lmr = pz.register(buf, Privileges.LOCAL_WRITE | Privileges.REMOTE_READ | Privileges.REMOTE_WRITE)
    seg = lmr[0:64]
    assert (seg.lmr, seg.offset, seg.length) == (lmr, 0, 64)
    assert seg.address == lmr.address and seg.lmr_context == lmr.lmr_context
    tail = lmr[200:]
    assert (tail.offset, tail.length, tail.address) == (200, 56, lmr.address + 200)
    tail.memoryview()[:] = b"t" * 56
    assert buf[200:] == b"t" * 56
    with pytest.raises(TypeError):
        lmr[3]  # type: ignore[index]
    with pytest.raises(aiodat.LengthError):
        lmr.segment(200, 100)
    q = lmr.query()
    assert (q.pz, q.address, q.length, q.lmr_context, q.rmr_context) == (
        pz, lmr.address, 256, lmr.lmr_context, lmr.rmr_context)
    assert q.privileges == lmr.privileges and q.registered_size == 256 and q.registered_address == lmr.address
    region = lmr.remote()
    assert aiodat.RemoteRegion.from_bytes(region.to_bytes()) == region
    with pytest.raises(aiodat.InvalidParameter):
        pz.register(b"read only bytes", Privileges.LOCAL_WRITE)
    with pytest.raises(aiodat.InvalidParameter):
        pz.register(12345)  # type: ignore[arg-type]
    with pytest.raises(aiodat.LengthError):
        pz.register(bytearray(0))
    ro = pz.register(b"read only is fine without write", Privileges.LOCAL_READ)
    assert ro.length == len(b"read only is fine without write")


async def test_lmr_free_refused_while_receive_posted(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    lmr = pair.pz.register(bytearray(64))
    pair.server.post_recv(lmr[0:64], cookie="uses lmr")
    with pytest.raises(aiodat.InvalidState):
        lmr.free()
    assert not lmr.closed
    pair.client.post_send(pair.client_lmr[0:8])
    (event,) = await pair.server.recv_evd.wait(timeout=T)
    assert event.cookie == "uses lmr" and event.ok
    lmr.free()  # the receive completed: the memory is no longer in use
    assert lmr.closed
    # a receive on an EP that is freed is retired with it
    other = pair.pz.register(bytearray(64))
    ep = ia.create_ep(pair.pz)
    ep.post_recv(other[0:64])
    with pytest.raises(aiodat.InvalidState):
        other.free()
    ep.free()
    other.free()


def test_ep_whose_own_evd_cannot_be_made(ia: Any) -> None:
    """An EP whose own EVD would exceed max_evd_qlen raises, leaving nothing half-made behind."""
    pz = ia.create_pz()
    limit = ia.query().ia_attr.max_evd_qlen
    if limit >= ia.query().ia_attr.transport_attr.max_qp_wr:
        pytest.skip("this device's CQs are as deep as its QPs")
    evds_before = sum(isinstance(c, aiodat.EVD) for c in ia._children)
    with pytest.raises(aiodat.InvalidParameter) as info:
        ia.create_ep(pz, attrs=aiodat.EPAttr(max_recv_dtos=limit + 1))
    assert "recv_evd" in str(info.value) and str(limit) in str(info.value)
    assert sum(isinstance(c, aiodat.EVD) for c in ia._children) == evds_before
    pz.free()  # no half-made EP holds the PZ
    ia.close()  # and closing raises nothing
