"""Issue 5: Shared Receive Queues on real rxe (seed 001): posting, counters, watermark, resize, free, PZs."""
from __future__ import annotations

import asyncio
import time
import struct
from typing import Any, Dict, List, Tuple

import pytest

import aiodat
from aiodat import EPState, EventType, EvdFlags

pytestmark = pytest.mark.rxe

T = 30.0  # bound for every wait: the QEMU guest runs under TCG
MSG = struct.Struct("!II")  # (connection number, sequence number)


def listen(ia: Any) -> Tuple[Any, Any]:
    cr_evd = ia.create_evd(64, EvdFlags.CR)
    return ia.create_psp_any(cr_evd), cr_evd


async def connect(ia: Any, psp: Any, cr_evd: Any, client: Any, server: Any) -> None:
    """Connect ``client`` to ``psp`` and accept the request on ``server``."""

    async def accept() -> None:
        event = await cr_evd.wait_one(timeout=T)
        await event.cr.accept(server, timeout=T)

    acceptor = asyncio.ensure_future(accept())
    await client.connect(ia.address, psp.port, timeout=T)
    await acceptor
    assert client.state is EPState.CONNECTED and server.state is EPState.CONNECTED


async def send(ep: Any, lmr: Any, payload: bytes, offset: int = 0) -> Any:
    """Send ``payload`` from ``lmr[offset:]`` and return the send's completion event."""
    lmr.memoryview()[offset:offset + len(payload)] = payload
    ep.post_send(lmr[offset:offset + len(payload)], cookie=("send", offset))
    event = await ep.request_evd.wait_one(timeout=T)
    return event.raise_for_status()


def async_events(ia: Any, etype: EventType) -> List[Any]:
    """Every event of type ``etype`` now queued on the IA's async EVD (dequeued)."""
    out = []
    while True:
        event = ia.async_evd.dequeue()
        if event is None:
            return out
        if event.type is etype:
            out.append(event)


async def test_create_validation_and_close(ia: Any) -> None:
    pz = ia.create_pz()
    limits = ia.query().ia_attr
    with pytest.raises(aiodat.InvalidParameter, match="max_recv_dtos"):
        ia.create_srq(pz, 0)
    with pytest.raises(aiodat.InvalidParameter, match="max_recv_dtos"):
        ia.create_srq(pz, limits.max_recv_per_srq + 1)
    with pytest.raises(aiodat.InvalidParameter, match="max_recv_iov"):
        ia.create_srq(pz, 8, max_recv_iov=0)
    with pytest.raises(aiodat.InvalidParameter, match="low_watermark"):
        ia.create_srq(pz, 8, low_watermark=9)
    with pytest.raises(aiodat.InvalidParameter, match="pz"):
        ia.create_srq("pz", 8)
    srq = ia.create_srq(pz, 8, max_recv_iov=2)
    param = srq.query()
    assert param.ia is ia and param.pz is pz and param.state is aiodat.SRQState.OPERATIONAL
    assert param.max_recv_dtos >= 8 and param.max_recv_iov >= 2
    assert param.low_watermark is None  # DAT_SRQ_LW_DEFAULT
    assert (param.available_dto_count, param.outstanding_dto_count) == (0, 0)
    lmr = pz.register(bytearray(256))
    with pytest.raises(aiodat.InvalidParameter, match="max_recv_iov"):
        srq.post_recv([lmr[0:8]] * (param.max_recv_iov + 1))
    with pytest.raises(aiodat.InvalidParameter, match="Segment"):
        srq.post_recv(b"not registered")
    other = ia.create_pz().register(bytearray(64))
    with pytest.raises(aiodat.ProtectionViolation):
        srq.post_recv(other[0:64])
    srq.post_recv(lmr[0:64], cookie="a")
    assert srq.query().outstanding_dto_count == 1
    with pytest.raises(aiodat.InvalidState):
        lmr.free()  # a posted buffer pins its LMR
    srq.free()
    assert srq.closed
    with pytest.raises(aiodat.InvalidHandle):
        srq.query()
    with pytest.raises(aiodat.InvalidHandle):
        srq.post_recv(lmr[0:64])
    lmr.free()  # the SRQ's buffers were released with it


async def test_seed_001_worked_example(ia: Any) -> None:
    """10 entries, 1 EP, 3 posted; one Send arrives; the consumer dequeues its completion."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 10)
    device_size = srq.query().max_recv_dtos
    assert device_size >= 10  # "at least max_recv_dtos": rxe rounds 10 up to 15
    server = ia.create_ep(pz, srq=srq)
    client = ia.create_ep(pz)
    assert srq.eps == (server,) and server.srq is srq
    buffers = pz.register(bytearray(3 * 64))
    for i in range(3):
        srq.post_recv(buffers[i * 64:(i + 1) * 64], cookie=i)
    param = srq.query()
    # nothing can have taken a buffer yet, so even the available count is known
    assert (param.max_recv_dtos, param.available_dto_count, param.outstanding_dto_count) == (device_size, 3, 3)

    psp, cr_evd = listen(ia)
    await connect(ia, psp, cr_evd, client, server)
    send_lmr = pz.register(bytearray(64))
    await send(client, send_lmr, b"one message")  # acked: the server's completion exists now
    param = srq.query()
    # available (2) cannot be known while an EP is connected: DAT_VALUE_UNKNOWN
    assert (param.max_recv_dtos, param.available_dto_count, param.outstanding_dto_count) == (device_size, None, 3)

    event = await server.recv_evd.wait_one(timeout=T)
    assert event.ok and event.ep is server and event.cookie in (0, 1, 2)
    assert event.transferred_length == len(b"one message")
    assert bytes(buffers.memoryview()[event.cookie * 64:event.cookie * 64 + 11]) == b"one message"
    param = srq.query()
    assert (param.max_recv_dtos, param.available_dto_count, param.outstanding_dto_count) == (device_size, None, 2)

    await client.disconnect()
    server.free()
    assert srq.eps == ()
    param = srq.query()  # no EP attached: the available count is exact again
    assert (param.available_dto_count, param.outstanding_dto_count) == (2, 2)


async def test_twenty_eps_share_one_srq(ia: Any) -> None:
    """Messages from 20 connections through one SRQ: none lost, each connection's order kept."""
    n_eps, per_ep, size = 20, 8, 64
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 48)
    recv_evd = ia.create_evd(n_eps * per_ep + 16, EvdFlags.DTO)  # room for every completion
    pool = pz.register(bytearray(48 * size))
    srq.post_recv_batch((pool[i * size:(i + 1) * size], i) for i in range(48))
    psp, cr_evd = listen(ia)
    servers, clients = [], []
    for _ in range(n_eps):
        server = ia.create_ep(pz, recv_evd=recv_evd, srq=srq)
        client = ia.create_ep(pz)
        await connect(ia, psp, cr_evd, client, server)
        servers.append(server)
        clients.append(client)
    assert len(srq.eps) == n_eps

    send_lmr = pz.register(bytearray(n_eps * per_ep * MSG.size))
    view = send_lmr.memoryview()
    for conn, client in enumerate(clients):
        for seq in range(per_ep):
            off = (conn * per_ep + seq) * MSG.size
            view[off:off + MSG.size] = MSG.pack(conn, seq)
            client.post_send(send_lmr[off:off + MSG.size], cookie=(conn, seq))

    index = {server: conn for conn, server in enumerate(servers)}
    seen: Dict[int, List[int]] = {conn: [] for conn in range(n_eps)}
    total = 0
    while total < n_eps * per_ep:
        for event in await recv_evd.wait(1, timeout=T):
            assert event.ok, event
            slot = event.cookie
            conn, seq = MSG.unpack(bytes(pool.memoryview()[slot * size:slot * size + MSG.size]))
            assert event.ep is servers[conn], "the completion came on another connection's EP"
            assert index[event.ep] == conn
            seen[conn].append(seq)
            total += 1
            srq.post_recv(pool[slot * size:(slot + 1) * size], slot)  # give the buffer back
    for conn in range(n_eps):
        assert seen[conn] == list(range(per_ep)), f"connection {conn} received {seen[conn]}"
    for client in clients:  # every send completed successfully
        events = []
        while len(events) < per_ep:
            events += await client.request_evd.wait(1, timeout=T)
        assert all(e.ok for e in events)
    param = srq.query()
    assert param.outstanding_dto_count == 48 and param.available_dto_count is None


async def test_low_watermark_once_per_arming_never_at_creation(ia: Any) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)  # default watermark
    armed = ia.create_srq(pz, 16, low_watermark=4)  # armed, but empty: still no event at creation
    assert armed.query().low_watermark == 4
    pool = pz.register(bytearray(16 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(8))
    with pytest.raises(aiodat.InvalidState, match="set_lw"):
        await srq.low_watermark(timeout=1)  # not armed: nothing could ever wake it
    server = ia.create_ep(pz, srq=srq)
    client = ia.create_ep(pz)
    psp, cr_evd = listen(ia)
    await connect(ia, psp, cr_evd, client, server)
    send_lmr = pz.register(bytearray(64))

    async def message(i: int) -> None:
        await send(client, send_lmr, b"m%d" % i)
        event = await server.recv_evd.wait_one(timeout=T)
        assert event.ok

    await message(0)  # 7 left
    assert async_events(ia, EventType.ASYNC_SRQ_LOW_WATERMARK) == []  # none at creation, none unarmed
    with pytest.raises(aiodat.InvalidParameter, match="low_watermark"):
        srq.set_lw(srq.query().max_recv_dtos + 1)
    srq.set_lw(5)
    assert srq.query().low_watermark == 5
    waiter = asyncio.ensure_future(srq.low_watermark(timeout=T))
    await message(1)  # 6 left
    await message(2)  # 5 left: not below 5 yet
    assert async_events(ia, EventType.ASYNC_SRQ_LOW_WATERMARK) == [] and not waiter.done()
    await message(3)  # 4 left: below the watermark
    await waiter
    events = async_events(ia, EventType.ASYNC_SRQ_LOW_WATERMARK)
    assert len(events) == 1 and events[0].obj is srq and events[0].evd is ia.async_evd
    assert srq.query().low_watermark is None  # the device disarmed: fired once for this arming
    assert srq.low_watermark_events == 1
    await message(4)
    await message(5)  # 2 left: still below, but no second event without re-arming
    assert async_events(ia, EventType.ASYNC_SRQ_LOW_WATERMARK) == []
    with pytest.raises(aiodat.InvalidState):
        await srq.low_watermark(timeout=1)

    # refill, re-arm: the next crossing gives the next event, and it waits for a late waiter
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(8, 14))  # 8 left
    srq.set_lw(7)
    await message(6)  # 7 left
    assert async_events(ia, EventType.ASYNC_SRQ_LOW_WATERMARK) == []
    await message(7)  # 6 left: fires with nobody waiting
    events = async_events(ia, EventType.ASYNC_SRQ_LOW_WATERMARK)
    assert len(events) == 1 and events[0].obj is srq
    await asyncio.wait_for(srq.low_watermark(), T)  # the event of this arming was kept for us
    assert srq.low_watermark_events == 2
    assert armed.low_watermark_events == 0
    # a cancelled wait loses nothing and leaves no waiter behind
    srq.set_lw(3)
    task = asyncio.ensure_future(srq.low_watermark())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(aiodat.TimeoutExpired):
        await srq.low_watermark(timeout=0.2)
    srq.set_lw(None)
    assert srq.query().low_watermark is None


async def _srq_pair(ia: Any, buffers: int) -> Tuple[Any, Any, Any, Any, Any]:
    """An SRQ of 16 with a pool of ``buffers`` 64-byte buffers, the first 4 posted; a connected
    client and server (on the SRQ); a send buffer: (srq, pool, client, server, send_lmr)."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    pool = pz.register(bytearray(buffers * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(4))
    server = ia.create_ep(pz, srq=srq)
    client = ia.create_ep(pz)
    psp, cr_evd = listen(ia)
    await connect(ia, psp, cr_evd, client, server)
    return srq, pool, client, server, pz.register(bytearray(64))


async def test_low_watermark_that_fired_is_kept_when_its_wait_is_cancelled(ia: Any) -> None:
    """Issue 13: the event fires for a waiting low_watermark() whose task is cancelled before it
    runs again (or whose timeout expires at that moment): the next call gets it."""
    srq, pool, client, server, send_lmr = await _srq_pair(ia, 4)
    srq.set_lw(3)
    waiter = asyncio.ensure_future(srq.low_watermark(timeout=T))
    await asyncio.sleep(0)  # it waits now
    for i in range(2):  # 4 -> 2 receives left: below 3, the device raises the event
        client.post_send(send_lmr[0:8], cookie=i)
    # Without yielding to the loop: see both sends complete, then let a dequeue read the device's
    # async fd, which wakes the waiter's future; cancel the task before it can run again.
    done, deadline = 0, asyncio.get_running_loop().time() + T
    while done < 2 or srq.low_watermark_events < 1:
        assert asyncio.get_running_loop().time() < deadline, (done, srq.low_watermark_events)
        if client.request_evd.dequeue() is not None:
            done += 1
        else:
            time.sleep(0.005)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(srq.low_watermark(timeout=1), T)  # the event was kept for this call
    assert srq.low_watermark_events == 1


async def test_resize_up_and_refused_down(ia: Any) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    before = srq.query().max_recv_dtos
    pool = pz.register(bytearray(64 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(before))
    with pytest.raises(aiodat.QueueFull):
        srq.post_recv(pool[0:64])  # full at the size the device gave
    srq.resize(40)
    grown = srq.query().max_recv_dtos
    assert grown >= 40
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(before, 40))  # the room is real
    assert srq.query().outstanding_dto_count == 40
    with pytest.raises(aiodat.InvalidState, match="40 buffers are outstanding"):
        srq.resize(39)
    assert srq.query().max_recv_dtos == grown  # unchanged by the refused resize
    with pytest.raises(aiodat.InvalidParameter):
        srq.resize(0)
    srq.set_lw(45)
    with pytest.raises(aiodat.InvalidState, match="low watermark"):
        srq.resize(44)
    srq.set_lw(None)
    srq.resize(44)  # shrinking above what is outstanding is allowed
    shrunk = srq.query().max_recv_dtos
    assert 44 <= shrunk <= grown


async def test_free_refused_while_eps_use_it(ia: Any) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    ep = ia.create_ep(pz, srq=srq)
    with pytest.raises(aiodat.InvalidState, match="endpoint"):
        srq.free()
    assert not srq.closed and srq.query().max_recv_dtos >= 8 and not ep.closed
    with pytest.raises(aiodat.InvalidState, match="SRQ"):
        ep.post_recv(pz.register(bytearray(8)))  # an SRQ endpoint receives through the SRQ
    ep.free()
    srq.free()
    assert srq.closed
    with pytest.raises(aiodat.InvalidHandle):
        ia.create_ep(pz, srq=srq)
    # close() always succeeds: it closes the EPs still attached first
    srq3 = ia.create_srq(pz, 8)
    attached = ia.create_ep(pz, srq=srq3)
    srq3.close()
    assert srq3.closed and attached.closed
    srq3.close()  # idempotent
    # closing the IA destroys EPs before their SRQ, and the SRQ before its PZ
    srq2 = ia.create_srq(pz, 8)
    ia.create_ep(pz, srq=srq2)
    srq2.post_recv(pz.register(bytearray(64)))
    ia.close()
    assert srq2.closed and pz.closed


async def test_ep_pz_must_match_srq_pz(ia: Any) -> None:
    supported = ia.query().provider_attr.srq_ep_pz_difference_supported
    pz, other = ia.create_pz(), ia.create_pz()
    srq = ia.create_srq(pz, 8)
    if supported:
        ep = ia.create_ep(other, srq=srq)
        assert ep.srq is srq
    else:
        with pytest.raises(aiodat.ModelNotSupported, match="srq_ep_pz_difference_supported"):
            ia.create_ep(other, srq=srq)
        assert srq.eps == ()
    ep = ia.create_ep(pz, srq=srq)
    assert srq.eps[-1] is ep
    with pytest.raises(aiodat.InvalidParameter, match="SRQ"):
        ia.create_ep(pz, srq="srq")


async def test_recv_query_and_set_watermark(ia: Any) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    on_srq = ia.create_ep(pz, srq=srq)
    own = ia.create_ep(pz)
    lmr = pz.register(bytearray(256))
    for i in range(3):
        own.post_recv(lmr[i * 64:(i + 1) * 64], cookie=i)
    assert own.recv_query() == (3, None)
    assert own.recv_query().nbufs_allocated == 3
    assert on_srq.recv_query() == aiodat.EPRecvInfo(None, None)  # the device does not tell
    own.set_watermark(None, None)  # DAT_WATERMARK_INFINITE is always fine
    with pytest.raises(aiodat.ModelNotSupported):
        on_srq.set_watermark(soft_high_watermark=4)
    with pytest.raises(aiodat.ModelNotSupported):
        own.set_watermark(hard_high_watermark=4)
    with pytest.raises(aiodat.InvalidParameter):
        own.set_watermark(-1)
    own.free()
    with pytest.raises(aiodat.InvalidHandle):
        own.recv_query()


async def test_srq_buffers_survive_a_broken_ep(ia: Any) -> None:
    """A QP that goes to error does not flush the SRQ's buffers: the other EPs keep using them."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    recv_evd = ia.create_evd(64, EvdFlags.DTO)
    pool = pz.register(bytearray(8 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(8))
    psp, cr_evd = listen(ia)
    pairs = []
    for _ in range(2):
        server, client = ia.create_ep(pz, recv_evd=recv_evd, srq=srq), ia.create_ep(pz)
        await connect(ia, psp, cr_evd, client, server)
        pairs.append((client, server))
    await pairs[0][1].disconnect(graceful=False)  # the first server's QP to ERR at once
    await asyncio.sleep(0.2)
    assert recv_evd.dequeue() is None  # nothing flushed: the buffers belong to the SRQ
    assert srq.query().outstanding_dto_count == 8
    client, server = pairs[1]
    send_lmr = pz.register(bytearray(64))
    got = []
    for i in range(8):
        await send(client, send_lmr, b"%d" % i)
        got += await recv_evd.wait(1, timeout=T)
    assert sorted(e.cookie for e in got) == list(range(8)) and all(e.ok and e.ep is server for e in got)


async def test_arming_again_forgets_an_event_still_unread_on_the_async_fd(ia: Any) -> None:
    """The previous arming's event fired but still waits, unread, on the async fd when set_lw arms
    again: it counts as the previous arming's, so a wait for the new arming does not return at once.
    It used to be read later and taken as the new arming's."""
    srq, pool, client, server, send_lmr = await _srq_pair(ia, 16)
    srq.set_lw(4)
    client.post_send(send_lmr[0:8], cookie="crossing")  # 3 left: below the mark
    time.sleep(1.0)  # (no loop turn) rxe takes the receive and raises the event; nobody reads the fd
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(4, 8))  # 7 left
    srq.set_lw(2)
    assert srq.low_watermark_events == 1  # the old arming's event, read by set_lw
    with pytest.raises(aiodat.TimeoutExpired):
        await srq.low_watermark(timeout=1)
    assert (await client.request_evd.wait_one(timeout=T)).ok
    assert (await server.recv_evd.wait_one(timeout=T)).ok
    srq.set_lw(None)


async def test_a_failed_destroy_keeps_the_buffers_counted_until_the_srq_goes(ia: Any) -> None:
    """ibv_destroy_srq failing for real (EBUSY: the kernel still has a QP on the SRQ, made here with
    verbs directly, which aiodat does not know of): the SRQ's handle is closed and the error raised;
    the receives still posted are the device's, so their LMR stays counted (lmr.free() refused).
    Once that QP is gone, the next destruction of anything retries the SRQ's, and that releases the
    count: the LMR can be freed.  It used to stay counted for good (nothing could release it)."""
    from aiodat._lib import ffi, lib

    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    lmr = pz.register(bytearray(1024))
    srq.post_recv(lmr[0:64], cookie="one")  # (a single post: Python's records)
    srq.post_recv_batch([(lmr[64 * i:64 * i + 64], i) for i in range(1, 5)])  # (a batch: C's records)
    assert lmr._inflight == 5
    evd = ia.create_evd(8)
    init = ffi.new("struct ibv_qp_init_attr *")
    init.send_cq = init.recv_cq = evd._cq
    init.srq = srq._srq
    init.qp_type = lib.IBV_QPT_RC
    init.cap.max_send_wr, init.cap.max_send_sge = 1, 1
    qp = lib.ibv_create_qp(pz._pd, init)
    assert qp != ffi.NULL, ffi.errno
    try:
        with pytest.raises(aiodat.DATError, match="ibv_destroy_srq") as caught:
            srq.free()
        assert caught.value.errno == 16  # EBUSY, from the kernel
        assert srq.closed
        with pytest.raises(aiodat.InvalidState, match="5 posted request"):
            lmr.free()  # the device still holds the SRQ and its five receives
    finally:
        assert lib.ibv_destroy_qp(qp) == 0
    ia.create_pz().free()  # a destruction that works retries the ones that failed: the SRQ's goes now
    assert lmr._inflight == 0
    lmr.free()
    pz.free()  # (nothing is left in it: the SRQ's PD reference went with the SRQ)
    evd.free()


async def test_an_srq_dropped_with_buffers_posted_releases_them(ia: Any) -> None:
    """An SRQ dropped without close() goes with its Raw holder, and so do the receives posted on it:
    their LMR can be freed then (it stayed counted for good, as lmr.free() refused for ever)."""
    import gc
    import warnings

    pz = ia.create_pz()
    lmr = pz.register(bytearray(256))
    srq = ia.create_srq(pz, 8)
    srq.post_recv(lmr[0:64])
    srq.post_recv_batch([(lmr[64:128], 1), (lmr[128:192], 2)])
    with pytest.raises(aiodat.InvalidState, match="3 posted request"):
        lmr.free()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # (unclosed SRQ: meant here)
        del srq
        gc.collect()
    assert lmr._inflight == 0
    lmr.free()
    pz.free()
