"""Issue 4: UD datagrams over rdma_cm's UDP port space and multicast, on real rxe."""
from __future__ import annotations

import asyncio
import gc
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
    # a UD request without an address handle: the device would read the RDMA fields as one and
    # crash the process (a segfault in the provider); refused before anything is posted
    with pytest.raises(aiodat.InvalidParameter, match="post_send_to"):
        client.post_send(clmr[0:5], cookie="no destination")
    region = aiodat.RemoteRegion(clmr.address, clmr.length, clmr.rmr_context)  # (no remote privilege: remote() refuses)
    for post in (lambda: client.post_rdma_write(clmr[0:8], region), lambda: client.post_rdma_read(clmr[0:8], region),
                 lambda: client.post_fetch_add(clmr[0:8], region, 1)):
        with pytest.raises(aiodat.InvalidParameter, match="need a connected"):
            post()
    assert client.request_evd.dequeue() is None and not client._send_q
    # ... and the C floor under it: aiodat_post_send refuses a UD request with no address handle
    import errno

    from aiodat._lib import ffi, lib

    wr, sges, posted = ffi.new("struct aiodat_send_wr *"), ffi.new("struct aiodat_sge[1]"), ffi.new("int *")
    wr.opcode, wr.num_sge = 0, 0  # an RDMA write, its fields where a UD request's address handle goes
    wr.remote_addr = 0xDEAD0000
    assert lib.aiodat_post_send(client._qp, wr, 1, sges, posted) == errno.EINVAL and posted[0] == 0
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
    with pytest.raises(aiodat.InvalidParameter, match="port must be an int between 1 and 65535, got 0"):
        await client.resolve_datagram(ia.address, 0, timeout=T)  # (0 is a listener's "pick one")


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


async def test_a_pz_closed_during_the_name_lookup_fails_the_resolution(ia: Any, monkeypatch: Any) -> None:
    """The EP is checked again after resolve_datagram's name lookup: its PZ closed meanwhile is
    InvalidHandle.  It used to go on, and the SIDR answer made an address handle on a NULL PD,
    which crashed the interpreter."""
    import aiodat.datagram

    pz = ia.create_pz()
    server, _ = ud_ep(ia, pz)
    psp = server.serve_datagram(0)
    client_pz = ia.create_pz()
    client = ia.create_ep(client_pz, attrs=UD)
    looked_up = asyncio.Event()
    release = asyncio.Event()
    lookup = aiodat.datagram.resolve_within

    async def slow_lookup(*args: Any) -> Any:
        looked_up.set()
        await release.wait()
        return await lookup(*args)

    monkeypatch.setattr(aiodat.datagram, "resolve_within", slow_lookup)
    resolving = asyncio.ensure_future(client.resolve_datagram(ia.address, psp.port, timeout=T))
    await asyncio.wait_for(looked_up.wait(), T)
    client_pz.close()
    release.set()
    with pytest.raises(aiodat.InvalidHandle):
        await asyncio.wait_for(resolving, T)
    psp.free()


async def test_an_address_handle_is_not_freed_under_a_posted_send(ia: Any) -> None:
    """The device reads an address handle when it sends: free() and a group's leave() are refused
    (InvalidState) until the completions of the sends to it have been taken."""
    pz = ia.create_pz()
    server, slmr = ud_ep(ia, pz)
    client, clmr = ud_ep(ia, pz)
    psp = server.serve_datagram(0)
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)
    server.post_recv_datagram(slmr[0:512], cookie="r")
    client.post_send_to(clmr[0:16], ah, cookie="s")
    with pytest.raises(aiodat.InvalidState, match="sends to it are still posted"):
        ah.free()
    assert not ah.closed
    (await one(client.request_evd)).raise_for_status()
    (await one(server.recv_evd)).raise_for_status()
    ah.free()
    assert ah.closed

    group = await client.join_multicast("239.1.1.8", timeout=T)
    client.post_send_to(clmr[0:16], group, cookie="g")
    with pytest.raises(aiodat.InvalidState, match="sends to it are still posted"):
        await group.leave()
    assert group.joined
    (await one(client.request_evd)).raise_for_status()
    await group.leave()
    assert group.closed
    psp.free()


async def test_one_membership_per_group_and_ep(ia: Any, loop_errors: Any) -> None:
    """A second join of a group the EP is in is refused: the device attaches a QP to a group once,
    so the first membership's leave silently deafened the second.  A group of the other address
    family is refused before anything is sent, and leaves nothing in the loop's handler."""
    pz = ia.create_pz()
    receiver, rlmr = ud_ep(ia, pz)
    sender, slmr = ud_ep(ia, pz)
    first = await receiver.join_multicast("239.1.1.9", timeout=T)
    with pytest.raises(aiodat.InvalidState, match="joined .* already"):
        await receiver.join_multicast("239.1.1.9", timeout=T)
    assert first.joined
    receiver.post_recv_datagram(rlmr[0:512], cookie="still")
    to_group = await sender.join_multicast("239.1.1.9", timeout=T)
    sender.post_send_to(slmr[0:4], to_group)
    (await one(sender.request_evd)).raise_for_status()
    assert (await one(receiver.recv_evd)).cookie == "still"
    await first.leave()
    again = await receiver.join_multicast("239.1.1.9", timeout=T)  # once left, it may join again
    await again.leave()
    await to_group.leave()
    other = "ff0e::101" if ":" not in ia.address else "239.1.1.10"
    with pytest.raises(aiodat.InvalidAddress):
        await receiver.join_multicast(other, timeout=T)
    gc.collect()  # (a failed join's future, had it failed unretrieved, is reported now)
    await asyncio.sleep(0)


async def test_a_datagram_larger_than_the_mtu_is_refused(ia: Any) -> None:
    """The device drops a datagram larger than the MTU with a successful completion: it is
    refused at the post, naming the MTU, and nothing is posted."""
    pz = ia.create_pz()
    server, slmr = ud_ep(ia, pz)
    client, clmr = ud_ep(ia, pz)
    psp = server.serve_datagram(0)
    ah = await client.resolve_datagram(ia.address, psp.port, timeout=T)
    mtu = max_message_size(client)
    with pytest.raises(aiodat.InvalidParameter, match=f"MTU of {mtu} bytes"):
        client.post_send_to(clmr[0:mtu + 1], ah)
    with pytest.raises(aiodat.InvalidParameter, match="MTU"):
        client.post_send_to([clmr[0:mtu], clmr[mtu:mtu + 1]], ah)
    assert client._sends_outstanding() == 0
    ah.free()  # (nothing was posted to it)
    psp.free()


async def test_a_datagram_psp_keeps_its_latest_peers(ia: Any, monkeypatch: Any) -> None:
    """``peers`` keeps the latest PEERS_KEPT requests, so a long-lived service does not grow."""
    from aiodat.datagram import DatagramPSP

    monkeypatch.setattr(DatagramPSP, "PEERS_KEPT", 2)
    pz = ia.create_pz()
    server, _ = ud_ep(ia, pz)
    client, _ = ud_ep(ia, pz)
    psp = server.serve_datagram(0)
    for text in (b"one", b"two", b"three"):
        (await client.resolve_datagram(ia.address, psp.port, private_data=text, timeout=T)).free()
    assert psp.requests == 3
    assert [pdata.rstrip(b"\0") for _, pdata in psp.peers] == [b"two", b"three"]
    psp.free()
