"""Closing, resetting and resizing objects that something still waits on or uses (real rxe).

Each test is a misuse the audit of 2026-11-28 found unhandled: a close that left a task waiting
for ever, a close that left a C call a freed or NULL pointer (a crashed interpreter), or a close
that stopped half-way.  The rule: the waiter learns at once, with an aiodat error naming what
happened, and nothing is left behind."""
from __future__ import annotations

import asyncio
import gc
import os
from typing import Any, List

import pytest

import aiodat
import aiodat._handle as handle
from aiodat import EPAttr, EPState, EvdFlags, Privileges, ServiceType
from aiodat.testing.plugin import make_ep_pair
from turns import until

pytestmark = pytest.mark.rxe

T = 30.0
UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2, max_request_iov=2)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_closing_an_evd_closes_the_endpoints_and_psps_that_use_it(ia: Any, loop_errors: List[dict]) -> None:
    """``evd.close()`` on an EVD an EP completes on closes that EP first (a QP cannot outlive its
    CQ), as pyverbs closes a CQ's QPs; ``free()`` still refuses.  It used to destroy nothing but
    mark the CQ gone: the EP lived on, and ``ep.reset()`` then made a QP on a NULL CQ, which
    crashed the interpreter."""
    pz = ia.create_pz()
    evd = ia.create_evd(16, EvdFlags.DTO)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd)
    cr_evd = ia.create_evd(4, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    other = ia.create_ep(pz)  # an EP with its own EVDs stays
    with pytest.raises(aiodat.InvalidState, match="1 endpoint"):
        evd.free()
    with pytest.raises(aiodat.InvalidState, match="1 PSP"):
        cr_evd.free()
    before = list(handle._deferred)
    evd.close()
    cr_evd.close()
    assert evd.closed and ep.closed and cr_evd.closed and psp.closed and not other.closed
    with pytest.raises(aiodat.InvalidHandle, match="ep is closed"):
        ep.reset()
    with pytest.raises(aiodat.InvalidHandle):
        ep.post_recv(pz.register(bytearray(64))[0:64])
    assert [raw.what for raw in handle._deferred if raw not in before] == []  # every verbs object went
    # the PZ and its surviving EP work on: a fresh pair connects through them
    pair = await make_ep_pair(ia)
    pair.close()
    other.close()
    pz.free()


async def test_closing_the_pz_under_a_datagram_resolution_fails_it(ia: Any, loop_errors: List[dict]) -> None:
    """A ``resolve_datagram`` under way when its EP's PZ closes raises InvalidHandle at once, and
    its rdma_cm id goes.  The answer used to arrive afterwards and make an address handle on the
    closed PD (NULL): the interpreter crashed."""
    pz = ia.create_pz()
    server = ia.create_ep(pz, attrs=UD)
    psp = server.serve_datagram(0)
    client_pz = ia.create_pz()
    client = ia.create_ep(client_pz, attrs=UD)
    routes = len(ia._cm._routes)
    task = asyncio.ensure_future(client.resolve_datagram(ia.address, psp.port, timeout=T))
    await until(lambda: len(ia._cm._routes) > routes, "the resolution started")
    client_pz.close()
    with pytest.raises(aiodat.InvalidHandle, match="datagram resolution"):
        await asyncio.wait_for(task, 5)
    await asyncio.sleep(0.5)  # an answer still on its way would arrive now
    assert len(ia._cm._routes) == routes and client.closed
    # the server answers the next one as before
    again = ia.create_ep(pz, attrs=UD)
    ah = await again.resolve_datagram(ia.address, psp.port, timeout=T)
    assert ah.remote_qpn == server.qp_num


async def test_closing_the_ia_under_a_datagram_resolution_fails_it(rdma_device: Any, loop_errors: List[dict]) -> None:
    """The same when the whole IA closes: the resolution raises InvalidHandle at once.  It used to
    wait out its timeout (for ever with ``timeout=None``), and then destroy its rdma_cm id on the
    channel the IA had already freed."""
    fds = _fds()
    ia = aiodat.open_ia(rdma_device.name)
    pz = ia.create_pz()
    server = ia.create_ep(pz, attrs=UD)
    psp = server.serve_datagram(0)
    client = ia.create_ep(pz, attrs=UD)
    routes = len(ia._cm._routes)
    task = asyncio.ensure_future(client.resolve_datagram(ia.address, psp.port, timeout=None))
    await until(lambda: len(ia._cm._routes) > routes, "the resolution started")
    ia.close()
    with pytest.raises(aiodat.InvalidHandle):
        await asyncio.wait_for(task, 5)
    del task, client, server, psp, pz, ia
    gc.collect()
    assert _fds() == fds


async def test_a_join_under_way_fails_when_its_ep_closes(ia: Any, loop_errors: List[dict]) -> None:
    """``join_multicast`` under way when its EP closes raises InvalidHandle at once; it used to
    wait for ever with ``timeout=None`` (its group was left, its future never told)."""
    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    routes = len(ia._cm._routes)
    task = asyncio.ensure_future(ep.join_multicast("239.1.2.9", timeout=None))
    await until(lambda: len(ia._cm._routes) > routes, "the join started")
    ep.close()
    with pytest.raises(aiodat.InvalidHandle, match="239.1.2.9"):
        await asyncio.wait_for(task, 5)
    await asyncio.sleep(0.2)
    assert len(ia._cm._routes) == routes and not list(ep._children)


def test_closing_after_the_loop_ended_frees_everything(rdma_device: Any) -> None:
    """Objects waited on in a loop that has since closed (its tasks never cancelled) are closed
    afterwards: the close frees everything and raises nothing.  It used to raise "Event loop is
    closed" from failing the first waiter's future, half-way through, leaving the QP, the cm_id
    and the CQ behind (and the channel freed under them)."""
    fds = _fds()
    ia = aiodat.open_ia(rdma_device.name)
    loop = asyncio.new_event_loop()
    pz = ia.create_pz()
    evd = ia.create_evd(8, EvdFlags.DTO)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd)
    cr_evd = ia.create_evd(4, EvdFlags.CR)  # nobody takes the request: the connect waits
    srq = ia.create_srq(pz, 8)
    pool = pz.register(bytearray(4 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(4))
    srq.set_lw(2)  # armed: its wait is one more waiter to fail

    async def start() -> List[Any]:
        psp = ia.create_psp_any(cr_evd)
        waits = [asyncio.ensure_future(evd.wait(timeout=None)),
                 asyncio.ensure_future(ep.connect(ia.address, psp.port, timeout=None)),
                 asyncio.ensure_future(srq.low_watermark(timeout=None))]
        await asyncio.sleep(0.5)  # the connect request reaches the PSP
        return waits

    try:
        waits = loop.run_until_complete(start())
        assert not any(w.done() for w in waits)
        assert ep.state is EPState.ACTIVE_CONNECTION_PENDING
    finally:
        loop.close()
    before = list(handle._deferred)
    ia.close()  # used to raise RuntimeError: Event loop is closed
    assert ia.closed and ep.closed and evd.closed and srq.closed
    assert [raw.what for raw in handle._deferred if raw not in before] == []
    for w in waits:  # (their coroutines are closed with the tasks: nothing left to say)
        w._log_destroy_pending = False
    del waits, ep, evd, cr_evd, srq, pool, pz, ia
    gc.collect()
    assert _fds() == fds


async def test_resizing_below_what_a_task_waits_for_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """``evd.resize`` to fewer entries than a waiting task's threshold raises InvalidState: the
    queue stops filling at its length, so the wait would never end (it used to be accepted)."""
    evd = ia.create_evd(16, EvdFlags.SOFTWARE)
    task = asyncio.ensure_future(evd.wait(threshold=8, timeout=T))
    await until(lambda: evd._waiter is not None, "the wait started")
    with pytest.raises(aiodat.InvalidState, match="a task waits for 8 events"):
        evd.resize(4)
    evd.resize(8)  # as many as it waits for: fine
    for n in range(8):
        evd.post_se(n)
    events = await asyncio.wait_for(task, T)
    assert [e.payload for e in events] == list(range(8))


async def test_reset_under_an_awaited_disconnect_fails_it(ia: Any, loop_errors: List[dict]) -> None:
    """An awaited graceful disconnect whose QP the device reports broken (the EP goes to ERROR,
    which reset allows) fails with InvalidState when the EP is reset; it used to wait for ever.
    ``cm.broken`` stands in for the device's fatal QP event, which rxe cannot be made to raise."""
    from aiodat import cm

    pair = await make_ep_pair(ia)
    try:
        # a send the peer never receives keeps the graceful drain waiting
        pair.client.post_send(pair.client_lmr[0:64], cookie="stuck")
        task = asyncio.ensure_future(pair.client.disconnect(timeout=None))
        await until(lambda: pair.client.state is EPState.DISCONNECT_PENDING, "the drain started")
        cm.broken(pair.client, "test: the QP broke")
        assert pair.client.state is EPState.ERROR
        pair.client.reset()
        with pytest.raises(aiodat.InvalidState, match="reset while a connection call waited"):
            await asyncio.wait_for(task, 5)
        assert pair.client.state is EPState.UNCONNECTED
    finally:
        pair.close()


async def test_closing_the_pz_under_register_async_loses_nothing(ia: Any, loop_errors: List[dict]) -> None:
    """A PZ closed while ``register_async`` pins a buffer in the executor: the registration fails
    with InvalidHandle, nothing stays registered, and no thread registers on the freed PD.  The
    thread used to read the PZ's PD after the close had freed it (or set it to NULL: a crash)."""
    buffer = bytearray(8 << 20)
    for delay in (0.0, 0.0005, 0.002, 0.01, 0.05):
        before = list(handle._deferred)
        pz = ia.create_pz()
        task = asyncio.ensure_future(pz.register_async(buffer, Privileges.ALL))
        await asyncio.sleep(delay)
        pz.close()
        try:
            lmr = await asyncio.wait_for(task, T)
        except aiodat.InvalidHandle as exc:
            assert "pz is closed" in str(exc)
        else:  # it ended before the close: the close freed it
            assert lmr.closed
        assert not pz._pins and [raw.what for raw in handle._deferred if raw not in before] == []
    # the buffer was let go each time: it can be resized again
    buffer.extend(b"x")
