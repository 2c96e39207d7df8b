"""Issue 4: UD datagrams over rdma_cm's UDP port space and multicast, on real rxe."""
from __future__ import annotations

from typing import Any, Tuple

import pytest

import aiodat
from aiodat import EPAttr, EventType, Privileges, ServiceType
from aiodat.datagram import GRH_SIZE, MULTICAST_QPN, AddressHandle, max_message_size

pytestmark = pytest.mark.rxe

T = 30.0
UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2, max_request_iov=2)


def ud_ep(ia: Any, pz: Any) -> Tuple[Any, Any]:
    ep = ia.create_ep(pz, attrs=UD)
    lmr = pz.register(bytearray(8192), Privileges.LOCAL_WRITE)
    return ep, lmr


async def one(evd: Any) -> Any:
    event = await evd.wait_one(timeout=T)
    assert event.type is EventType.DTO_COMPLETION, event
    return event


async def test_resolve_send_receive_with_sender(ia: Any) -> None:
    pz = ia.create_pz()
    server, slmr = ud_ep(ia, pz)
    client, clmr = ud_ep(ia, pz)
    psp = server.serve_datagram(0, private_data=b"ud-welcome")
    assert psp.port > 0
    ah = await client.resolve_datagram(ia.address, psp.port, private_data=b"hi", timeout=T)
    assert isinstance(ah, AddressHandle)
    assert ah.remote_qpn == server.qp_num and ah.private_data == b"ud-welcome".ljust(136, b"\0")
    assert psp.requests == 1 and psp.peers[0][1] == b"hi".ljust(180, b"\0")
    assert psp.peers[0][0] is not None and psp.peers[0][0][0] == ia.address  # the requester's (host, port)

    # a receive with the GRH in front of the payload
    server.post_recv(slmr[0:1024], cookie="grh")
    msg = bytes(range(200))
    clmr.memoryview()[0:200] = msg
    client.post_send_to(clmr[0:200], ah, cookie="d1")
    (await one(client.request_evd)).raise_for_status()
    rx = (await one(server.recv_evd)).raise_for_status()
    assert rx.cookie == "grh" and rx.transferred_length == GRH_SIZE + 200
    assert rx.src_qp == client.qp_num
    assert bytes(slmr.memoryview()[GRH_SIZE:GRH_SIZE + 200]) == msg

    # post_recv_datagram keeps the GRH out of the caller's segment; with immediate data
    server.post_recv_datagram(slmr[2048:2048 + 512], cookie="payload")
    clmr.memoryview()[0:5] = b"howdy"
    client.post_send_to(clmr[0:5], ah, cookie="d2", imm_data=42)
    (await one(client.request_evd)).raise_for_status()
    rx = (await one(server.recv_evd)).raise_for_status()
    assert (rx.cookie, rx.imm_data, rx.src_qp) == ("payload", 42, client.qp_num)
    assert rx.transferred_length - GRH_SIZE == 5
    assert bytes(slmr.memoryview()[2048:2053]) == b"howdy"
    # a message of one full MTU goes through; the MTU is the datagram limit
    mtu = max_message_size(client)
    assert mtu in (256, 512, 1024, 2048, 4096)
    server.post_recv_datagram(slmr[4096:4096 + mtu], cookie="mtu")
    clmr.memoryview()[0:mtu] = bytes(i % 251 for i in range(mtu))
    client.post_send_to(clmr[0:mtu], ah)
    (await one(client.request_evd)).raise_for_status()
    rx = (await one(server.recv_evd)).raise_for_status()
    assert bytes(slmr.memoryview()[4096:4096 + mtu]) == bytes(i % 251 for i in range(mtu))
    psp.free()
    ah.free()
    with pytest.raises(aiodat.InvalidHandle):
        client.post_send_to(clmr[0:5], ah)


async def test_datagram_errors(ia: Any) -> None:
    pz = ia.create_pz()
    client, clmr = ud_ep(ia, pz)
    rc = ia.create_ep(pz)
    with pytest.raises(aiodat.InvalidParameter, match="UD endpoint"):
        await rc.resolve_datagram(ia.address, 1)
    with pytest.raises(aiodat.InvalidParameter, match="UD endpoint"):
        rc.serve_datagram(0)
    with pytest.raises(aiodat.InvalidParameter, match="only RC endpoints connect"):
        await client.connect(ia.address, 1)
    with pytest.raises(aiodat.InvalidParameter, match="AddressHandle"):
        client.post_send_to(clmr[0:5], ("1.2.3.4", 5))
    with pytest.raises(aiodat.InvalidParameter, match="max_recv_iov >= 4"):
        client.post_recv_datagram([clmr[0:1], clmr[1:2], clmr[2:3]])
    # nothing serves the port: the resolution is refused (no SIDR REP), never hangs
    unused = client.serve_datagram(0)
    port = unused.port
    unused.free()
    with pytest.raises((aiodat.ConnectionRejected, aiodat.Unreachable, aiodat.TimeoutExpired)) as info:
        await client.resolve_datagram(ia.address, port, timeout=T)
    assert str(port) in str(info.value)
    with pytest.raises(aiodat.InvalidParameter, match="not a multicast address"):
        await client.join_multicast("10.1.2.3")


async def test_multicast_join_send_receive_leave(ia: Any) -> None:
    pz = ia.create_pz()
    receiver, rlmr = ud_ep(ia, pz)
    sender, slmr = ud_ep(ia, pz)
    group = "239.1.1.7"
    rg = await receiver.join_multicast(group, timeout=T)
    sg = await sender.join_multicast(group, timeout=T)
    assert rg.joined and sg.joined
    assert sg.address_handle.remote_qpn == MULTICAST_QPN
    for i in range(2):
        receiver.post_recv_datagram(rlmr[i * 1024:(i + 1) * 1024], cookie=f"m{i}")
    slmr.memoryview()[0:11] = b"to everyone"
    sender.post_send_to(slmr[0:11], sg, cookie="mc")
    (await one(sender.request_evd)).raise_for_status()
    rx = (await one(receiver.recv_evd)).raise_for_status()
    assert rx.cookie == "m0" and rx.src_qp == sender.qp_num
    assert rx.transferred_length - GRH_SIZE == 11
    assert bytes(rlmr.memoryview()[0:11]) == b"to everyone"

    await receiver.leave_multicast(rg)
    assert rg.closed and not rg.joined
    slmr.memoryview()[0:5] = b"again"
    sender.post_send_to(slmr[0:5], sg, cookie="mc2")
    (await one(sender.request_evd)).raise_for_status()  # the send itself succeeds
    with pytest.raises(aiodat.TimeoutExpired):
        await receiver.recv_evd.wait(1, timeout=2.0)  # but the receiver left: nothing arrives
    assert bytes(rlmr.memoryview()[1024:1029]) == bytes(5)
    await sg.leave()
