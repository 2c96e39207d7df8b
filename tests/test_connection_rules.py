"""Issue 13, items 2, 7 and 8 on real rxe: cancelling accept, CQ sizing of shared EVDs, graceful disconnect."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any, List

import pytest

import aiodat
from aiodat import CompletionFlags, EPAttr, EPState, EventType, EvdFlags, Privileges
from aiodat.cm import connect_pair
from aiodat.cqsize import cq_entries
from aiodat.testing.plugin import make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # generous bound for every wait: the QEMU guest runs under TCG


# -- item 2: cancelling accept ----------------------------------------------------


async def test_cancelled_accept_before_and_after_established(ia: Any, loop_errors: List[dict]) -> None:
    """Before ESTABLISHED: the attempt is dropped (the EP ends DISCONNECTED).  After ESTABLISHED
    reached the accept's future but before the task resumed: the EP stays CONNECTED and the
    ESTABLISHED event goes to its connect EVD (docs/connections.md, "Cancellation")."""
    pz = ia.create_pz()
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)

    client, server = ia.create_ep(pz), ia.create_ep(pz)
    client.connect_nowait(ia.address, psp.port, timeout=T)
    request = (await cr_evd.wait_one(timeout=T)).cr
    # The loop must not read the RTU before the cancellation reaches the task (uvloop may read it
    # in the turn between the cancel and the task's wake-up, and then the outcome came first):
    # stop it watching the rdma_cm channel for that long.  Nothing is mocked: the RTU waits
    # in the channel.
    ia._cm.watch.detach()
    task = asyncio.ensure_future(request.accept(server, timeout=T))
    await asyncio.sleep(0)  # the task's first step: the REP has gone
    assert server.state is EPState.PASSIVE_CONNECTION_PENDING
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ia._attach_loop()
    assert server.state is EPState.DISCONNECTED  # abandoned
    assert server.connect_evd.dequeue() is None  # nothing was established: no event

    hit = 0
    for _ in range(5):
        client, server = ia.create_ep(pz), ia.create_ep(pz)
        client.connect_nowait(ia.address, psp.port, timeout=T)
        request = (await cr_evd.wait_one(timeout=T)).cr
        task = asyncio.ensure_future(request.accept(server, timeout=T))
        deadline = time.monotonic() + T
        # this coroutine runs before the accept task in every loop turn (it queued itself
        # first), so it sees the state change that ESTABLISHED makes before the task wakes up
        while server.state is not EPState.CONNECTED and not task.done():
            assert time.monotonic() < deadline, "the connection was never established"
            await asyncio.sleep(0)
        if task.done():
            await task
            continue
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert server.state is EPState.CONNECTED
        event = server.connect_evd.dequeue()
        assert event is not None and event.type is EventType.CONNECTION_EVENT_ESTABLISHED and event.ep is server
        # the caller can see it and disconnect; the peer sees DISCONNECTED
        await server.disconnect(timeout=T)
        assert (await client.connect_evd.wait_one(timeout=T)).type in (
            EventType.CONNECTION_EVENT_ESTABLISHED, EventType.CONNECTION_EVENT_DISCONNECTED)
        hit += 1
    assert hit, "never caught the accept between its outcome and the task's wake-up"


# -- item 7: EPs sharing an EVD never overrun its CQ ------------------------------------


async def test_shared_evd_grows_to_hold_every_queue(ia: Any, loop_errors: List[dict]) -> None:
    """The CQ under a shared EVD grows to hold every queue feeding it; the EVD's qlen stays."""
    pz = ia.create_pz()
    evd = ia.create_evd(8, EvdFlags.DTO)
    assert cq_entries(evd) < 32  # rxe gives 15 entries for 8
    attrs = EPAttr(max_recv_dtos=16, max_request_dtos=16)
    first = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=attrs)
    assert cq_entries(evd) >= 32  # 16 sends + 16 receives may complete at once
    second = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=attrs)
    assert cq_entries(evd) >= 64
    assert evd.qlen == 8  # the EVD still queues 8 events; completions beyond wait in the CQ
    grown = cq_entries(evd)
    second.free()  # gives its share back: a third EP fits without growing the CQ again
    third = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=attrs)
    assert cq_entries(evd) == grown
    # a fitting EVD is left alone
    roomy = ia.create_evd(100, EvdFlags.DTO)
    before = cq_entries(roomy)
    ia.create_ep(pz, recv_evd=roomy, request_evd=roomy, attrs=attrs)
    assert cq_entries(roomy) == before
    first.free()
    third.free()


async def test_shared_evd_takes_every_completion(ia: Any, loop_errors: List[dict]) -> None:
    """Two EPs of 16 + 16 on an EVD of qlen 8: 32 completions arrive, none lost, no CQ error."""
    pz = ia.create_pz()
    evd = ia.create_evd(8, EvdFlags.DTO)
    attrs = EPAttr(max_recv_dtos=16, max_request_dtos=16)
    lmr = pz.register(bytearray(4096), Privileges.ALL)
    peer_lmr = pz.register(bytearray(4096), Privileges.ALL)
    pairs = []
    for _ in range(2):
        client = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=attrs)
        server = ia.create_ep(pz, attrs=attrs)
        psp = await connect_pair(client, server, timeout=T)
        pairs.append((client, server, psp))
    for client, server, _ in pairs:
        for i in range(16):
            server.post_recv(peer_lmr[i * 64:(i + 1) * 64])
    for n, (client, _, _) in enumerate(pairs):
        for i in range(16):
            client.post_send(lmr[i * 8:(i + 1) * 8], cookie=(n, i))
    events: List[Any] = []
    deadline = time.monotonic() + T
    while len(events) < 32:
        assert time.monotonic() < deadline, f"{len(events)} of 32 completions arrived"
        events += await evd.wait(timeout=T)
    assert sorted(e.cookie for e in events) == [(n, i) for n in range(2) for i in range(16)]
    assert all(e.ok for e in events), [e.status for e in events if not e.ok]
    assert ia.async_evd.dequeue() is None  # no IBV_EVENT_CQ_ERR
    for client, server, psp in pairs:
        assert client.state is EPState.CONNECTED
        psp.free()
        psp.cr_evd.free()


async def test_evd_too_small_for_the_device_names_both_numbers(ia: Any, loop_errors: List[dict]) -> None:
    dev = ia._device_attr
    depth = min(dev.max_qp_wr, dev.max_cqe // 2 + 1)
    if 2 * depth <= dev.max_cqe:
        pytest.skip("this device's CQs hold any two of its queues")
    pz = ia.create_pz()
    evd = ia.create_evd(8, EvdFlags.DTO)
    with pytest.raises(aiodat.InvalidParameter) as info:
        ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=EPAttr(max_recv_dtos=depth, max_request_dtos=depth))
    message = str(info.value)
    assert str(2 * depth) in message and str(dev.max_cqe) in message and "qlen is 8" in message and "EVD" in message
    assert evd.qlen == 8 and cq_entries(evd) < 2 * depth and not pz._children  # nothing half-made is left


async def test_srq_counts_once_per_shared_evd(ia: Any, loop_errors: List[dict]) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 40)
    recv_evd = ia.create_evd(8, EvdFlags.DTO)
    attrs = EPAttr(max_request_dtos=4)
    eps = [ia.create_ep(pz, recv_evd=recv_evd, srq=srq, attrs=attrs) for _ in range(3)]
    need = srq.query().max_recv_dtos
    assert need <= cq_entries(recv_evd) < 2 * need  # the SRQ's buffers, once, not once per EP
    for ep in eps:
        ep.free()


# -- item 8: graceful and abrupt disconnect with sends in flight -------------------------

N, SIZE = 16, 64 * 1024


async def _sends_in_flight(ia: Any, flags: CompletionFlags) -> Any:
    """A pair whose client has N sends of SIZE posted that cannot complete yet: the server has
    no receive posted, so they wait in receiver-not-ready retries (rnr_retry 7: for ever)."""
    pair = await make_ep_pair(ia, buffer_size=N * SIZE)
    pair.client_lmr.memoryview()[:] = os.urandom(N * SIZE)
    for i in range(N):
        pair.client.post_send(pair.client_lmr[i * SIZE:(i + 1) * SIZE], cookie=i, flags=flags)
    return pair


def _post_server_receives(pair: Any) -> None:
    for i in range(N):
        pair.server.post_recv(pair.server_lmr[i * SIZE:(i + 1) * SIZE], cookie=i)


@pytest.mark.parametrize("flags", [CompletionFlags.DEFAULT, CompletionFlags.SUPPRESS])
async def test_graceful_disconnect_lets_posted_sends_complete(ia: Any, loop_errors: List[dict],
                                                              flags: CompletionFlags) -> None:
    pair = await _sends_in_flight(ia, flags)
    disconnecting = asyncio.ensure_future(pair.client.disconnect(graceful=True, timeout=T))
    await asyncio.sleep(0.3)
    assert pair.client.state is EPState.DISCONNECT_PENDING and not disconnecting.done()  # draining
    _post_server_receives(pair)  # now the sends can complete; only then does the DREQ go
    await asyncio.wait_for(disconnecting, T)
    assert pair.client.state is EPState.DISCONNECTED
    if flags is CompletionFlags.DEFAULT:
        sent = await pair.client.request_evd.wait(threshold=N, timeout=T)
        assert [e.cookie for e in sent] == list(range(N))
        assert all(e.ok for e in sent), [e.status for e in sent]
    else:
        assert pair.client.request_evd.dequeue() is None  # suppressed, and none failed
    got: List[Any] = []
    while len(got) < N:
        got += await pair.server.recv_evd.wait(timeout=T)
    assert [e.cookie for e in got] == list(range(N))
    assert all(e.ok and e.transferred_length == SIZE for e in got), [e.status for e in got]
    assert bytes(pair.server_lmr.memoryview()) == bytes(pair.client_lmr.memoryview())
    event = await pair.server.connect_evd.wait_one(timeout=T)
    assert event.type is EventType.CONNECTION_EVENT_DISCONNECTED
    pair.close()


async def test_graceful_disconnect_refuses_new_posts(ia: Any, loop_errors: List[dict]) -> None:
    pair = await _sends_in_flight(ia, CompletionFlags.DEFAULT)
    pair.client.disconnect_nowait(graceful=True)
    assert pair.client.state is EPState.DISCONNECT_PENDING
    with pytest.raises(aiodat.InvalidState):
        pair.client.post_send(pair.client_lmr[0:8])
    _post_server_receives(pair)
    event = await pair.client.connect_evd.wait_one(timeout=T)
    assert event.type is EventType.CONNECTION_EVENT_DISCONNECTED
    sent = await pair.client.request_evd.wait(threshold=N, timeout=T)
    assert all(e.ok for e in sent), [e.status for e in sent]
    pair.close()


async def test_abrupt_disconnect_flushes_sends_in_flight(ia: Any, loop_errors: List[dict]) -> None:
    pair = await _sends_in_flight(ia, CompletionFlags.DEFAULT)
    await asyncio.sleep(0.1)
    await pair.client.disconnect(graceful=False, timeout=T)
    assert pair.client.state is EPState.DISCONNECTED
    sent = await pair.client.request_evd.wait(threshold=N, timeout=T)
    assert [e.cookie for e in sent] == list(range(N))
    statuses = [e.status for e in sent]
    # none could complete (no receive at the peer): every one is flushed
    assert statuses == ["IBV_WC_WR_FLUSH_ERR"] * N, statuses
    assert all(e.flushed for e in sent)
    pair.close()
