"""UD endpoints under misuse and faults, on real rxe: a receive that cannot hold the GRH, a
datagram larger than its receive (which breaks the QP), requests that need a connection, a join
that fails before it starts, and UD receives through an SRQ."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiodat
from aiodat import EPAttr, EPState, EventType, Privileges, ServiceType
from aiodat.datagram import GRH_SIZE, max_message_size

pytestmark = pytest.mark.rxe

T = 30.0
UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2, max_request_iov=2)


async def _one(evd: Any) -> Any:
    event = await evd.wait_one(timeout=T)
    assert event.type is EventType.DTO_COMPLETION, event
    return event


async def test_a_ud_receive_that_cannot_hold_the_grh_is_refused(ia: Any) -> None:
    """The device writes the 40-byte GRH first: a smaller receive completes in error and breaks the
    QP, so every post path refuses it with nothing posted.  An RC EP takes small receives."""
    pz = ia.create_pz()
    lmr = pz.register(bytearray(4096), Privileges.LOCAL_WRITE)
    ud, rc = ia.create_ep(pz, attrs=UD), ia.create_ep(pz)
    too_small = [
        lambda: ud.post_recv(lmr[0:GRH_SIZE - 1]),  # one segment: the C fast path's case
        lambda: ud.post_recv([lmr[0:20], lmr[20:GRH_SIZE - 1]]),
        lambda: ud.post_recv(None),
        lambda: ud.post_recv_batch([(lmr[0:8], "a")]),
        lambda: ud.post_recv_batch([(lmr[0:1024], "fits"), (lmr[1024:1032], "does not")]),
        lambda: ud.post_recv_batch([(lmr[0:8], "a"), (lmr[0:8], "b")]),  # the very same segment
    ]
    for post in too_small:
        with pytest.raises(aiodat.InvalidParameter, match=f"{GRH_SIZE}-byte GRH"):
            post()
    assert not ud._recv_q and lmr._inflight == 0
    ud.post_recv(lmr[0:GRH_SIZE], "just the GRH")  # (a zero-byte datagram fits it)
    assert ud.post_recv_batch([(lmr[64:128], 1), (lmr[128:192], 2)]) == 2
    rc.post_recv(lmr[0:8], "an RC receive may be small")
    assert len(ud._recv_q) == 3 and len(rc._recv_q) == 1
    pz.close()


async def test_a_datagram_larger_than_its_receive_breaks_the_ud_ep_until_reset(ia: Any) -> None:
    """A datagram longer than the receive it lands in completes that receive in error, and the
    device puts the QP in ERR: the other receives are flushed, and nothing more would arrive.  The
    EP says so (ERROR, CONNECTION_EVENT_BROKEN naming the receive) and refuses posts, instead of
    taking receives that never complete, until ``reset()``, after which it works again."""
    pz = ia.create_pz()
    lmr = pz.register(bytearray(8192), Privileges.LOCAL_WRITE)
    server, client = ia.create_ep(pz, attrs=UD), ia.create_ep(pz, attrs=UD)
    psp = server.serve_datagram(0)
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)
    server.post_recv_datagram(lmr[0:16], "small")
    for i in range(3):
        server.post_recv_datagram(lmr[1024 * (i + 1):1024 * (i + 2)], f"big{i}")
    client.post_send_to(lmr[4096:4196], ah, "100 bytes")
    (await _one(client.request_evd)).raise_for_status()
    events = [await _one(server.recv_evd) for _ in range(4)]
    assert [e.cookie for e in events] == ["small", "big0", "big1", "big2"]
    assert events[0].status in ("IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR") and not events[0].flushed
    assert all(e.flushed for e in events[1:])
    assert server.state is EPState.ERROR
    broken = await server.connect_evd.wait_one(timeout=T)
    assert broken.type is EventType.CONNECTION_EVENT_BROKEN and "'small'" in broken.reason
    with pytest.raises(aiodat.InvalidState, match="ERROR"):
        server.post_recv(lmr[0:1024], "after")
    with pytest.raises(aiodat.InvalidState, match="ERROR"):
        server.post_recv_datagram(lmr[0:1024], "after")
    with pytest.raises(aiodat.InvalidState, match=r"reset\(\) it"):
        server.post_send_to(lmr[0:8], ah, "after")
    assert not server._recv_q and not server._send_q and lmr._inflight == 0
    assert client.state is EPState.UNCONNECTED  # (the sender's QP is fine: UD has no acknowledgement)
    # its PSP hands out no QP that drops everything (a SIDR reject: rdma_cm says UNREACHABLE, status 2)
    with pytest.raises((aiodat.ConnectionRejected, aiodat.Unreachable)):
        await client.resolve_datagram(ia.address, psp.port, timeout=T)

    server.reset()
    assert server.state is EPState.UNCONNECTED
    ah.free()
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)  # (the PSP answers with the new QP)
    server.post_recv_datagram(lmr[0:1024], "after reset")
    client.post_send_to(lmr[4096:4196], ah, "again")
    (await _one(client.request_evd)).raise_for_status()
    got = (await _one(server.recv_evd)).raise_for_status()
    assert got.cookie == "after reset" and got.transferred_length == GRH_SIZE + 100
    psp.free()
    pz.close()


async def test_connected_requests_on_a_ud_ep_name_what_to_use(ia: Any) -> None:
    """Batches of sends and RDMA on a UD EP, and disconnects, say why they cannot be (a UD EP has
    no connection), not "connect it first"."""
    pz = ia.create_pz()
    lmr = pz.register(bytearray(4096), Privileges.LOCAL_WRITE)
    ud = ia.create_ep(pz, attrs=UD)
    with pytest.raises(aiodat.InvalidParameter, match="post_send_to"):
        ud.post_send_batch([(lmr[0:8], 1), (lmr[8:16], 2)])
    region = aiodat.RemoteRegion(lmr.address, lmr.length, lmr.rmr_context)  # (no remote privilege: remote() refuses)
    for batch in (ud.post_rdma_write_batch, ud.post_rdma_read_batch):
        with pytest.raises(aiodat.InvalidParameter, match="need a connected"):
            batch([(lmr[0:8], region[0:8], 1)])
    with pytest.raises(aiodat.InvalidParameter, match="only RC endpoints disconnect"):
        await ud.disconnect()
    with pytest.raises(aiodat.InvalidParameter, match="only RC endpoints disconnect"):
        ud.disconnect_nowait()
    assert not ud._send_q and ud.state is EPState.UNCONNECTED
    for not_an_ep in (None, "rxe0", 5, pz):
        with pytest.raises(aiodat.InvalidParameter, match="max_message_size needs an EP"):
            max_message_size(not_an_ep)
    pz.close()


async def test_a_join_that_fails_before_it_starts_leaves_no_group(ia: Any, monkeypatch: Any) -> None:
    """rdma_create_id failing (its errors reach the join as they would from librdmacm) must not
    leave a group "joining" in the EP, which refused every later join of that group."""
    pz = ia.create_pz()
    ud = ia.create_ep(pz, attrs=UD)

    def no_id(owner: Any, port_space: Any) -> Any:
        raise aiodat.InsufficientResources("rdma_create_id failed: Cannot allocate memory (ENOMEM)")

    with monkeypatch.context() as patch:
        patch.setattr(ia._cm, "create_id", no_id)
        with pytest.raises(aiodat.InsufficientResources):
            await ud.join_multicast("239.1.4.2", timeout=T)
    assert not [child for child in ud._children if isinstance(child, aiodat.datagram.MulticastGroup)]
    group = await ud.join_multicast("239.1.4.2", timeout=T)
    assert group.joined
    await group.leave()
    pz.close()


async def test_ud_receives_through_an_srq(ia: Any) -> None:
    """A UD EP on an SRQ takes its datagrams from the SRQ's buffers, GRH first, with the sender."""
    pz = ia.create_pz()
    lmr = pz.register(bytearray(8192), Privileges.LOCAL_WRITE)
    srq = ia.create_srq(pz, 8, 1)
    server = ia.create_ep(pz, attrs=UD, srq=srq)
    client = ia.create_ep(pz, attrs=UD)
    psp = server.serve_datagram(0)
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)
    srq.post_recv(lmr[0:1024], "from the srq")
    lmr.memoryview()[4096:4101] = b"hello"
    client.post_send_to(lmr[4096:4101], ah, "sent")
    (await _one(client.request_evd)).raise_for_status()
    got = (await _one(server.recv_evd)).raise_for_status()
    assert got.cookie == "from the srq" and got.ep is server and got.src_qp == client.qp_num
    assert got.transferred_length == GRH_SIZE + 5 and bytes(lmr.memoryview()[GRH_SIZE:GRH_SIZE + 5]) == b"hello"
    psp.free()
    ah.free()
    pz.close()


async def test_a_failed_receive_met_by_a_reset_or_a_close_breaks_nothing(ia: Any) -> None:
    """A receive's error still in the CQ when the program resets or frees the EP is polled on the
    way: its event keeps its cookie, but it breaks nothing, as the QP is going (a BROKEN after a
    reset would name the new QP; on a freed EP it made the poll fail and an SRQ kept the buffer)."""
    pz = ia.create_pz()
    lmr = pz.register(bytearray(8192), Privileges.LOCAL_WRITE)
    client = ia.create_ep(pz, attrs=UD)
    recv_evd = ia.create_evd(16)
    server = ia.create_ep(pz, recv_evd=recv_evd, attrs=UD)
    psp = server.serve_datagram(0)
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)
    server.post_recv_datagram(lmr[0:16], "small")
    client.post_send_to(lmr[4096:4196], ah, "100 bytes")
    (await _one(client.request_evd)).raise_for_status()
    await asyncio.sleep(0.5)  # (arrived: its error completion waits in the CQ, not polled)
    server.reset()
    assert server.state is EPState.UNCONNECTED and server.connect_evd.dequeue() is None
    failed = recv_evd.dequeue()
    assert failed.cookie == "small" and not failed.ok and not failed.flushed
    psp.free()
    ah.free()

    srq = ia.create_srq(pz, 8, 1)  # (an SRQ does not know its EPs are UD: a buffer short of the GRH goes)
    on_srq = ia.create_ep(pz, recv_evd=recv_evd, attrs=UD, srq=srq)
    psp = on_srq.serve_datagram(0)
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)
    srq.post_recv(lmr[0:16], "short")
    client.post_send_to(lmr[4096:4196], ah, "100 bytes")
    (await _one(client.request_evd)).raise_for_status()
    await asyncio.sleep(0.5)
    psp.free()
    on_srq.free()
    failed = recv_evd.dequeue()
    assert failed is not None and failed.cookie == "short" and not failed.ok
    assert not srq._posted and lmr._inflight == 0  # the SRQ has its buffer back
    ah.free()
    pz.close()
