"""Issue 12: addresses from the port's netdevs (IPv6, several per netdev, VLANs), librdmacm's
QP-less flow, and the transport settings that are EPAttr fields.

The device tests change the rxe netdev (an IPv6 address, a second IPv4 address, a VLAN on
top of it) inside the test bed's guest, where they run as root, and undo it afterwards.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import Any, Iterator, Tuple

import pytest

import aiodat
from aiodat import EPAttr, EPState, EvdFlags
from aiodat.netdev import order_addresses, port_netdevs, same_address

T = 30.0
IPV6 = "fd00:77::1"
SECOND_V4 = "169.254.78.1"
VLAN_V4 = "169.254.79.1"


# -- pure: the address rules -------------------------------------------------------------


def test_order_puts_ipv4_then_global_then_link_local_ipv6() -> None:
    got = order_addresses(["fe80::1%eth0", "fd00::5", "10.0.0.1", "2001:db8::1", "10.0.0.2", "10.0.0.1"])
    assert got == ["10.0.0.1", "10.0.0.2", "fd00::5", "2001:db8::1", "fe80::1%eth0"]


def test_same_address_compares_addresses_not_text() -> None:
    assert same_address("fd00:0::1", "fd00::1")
    assert same_address("fe80::1%ib0", "fe80::1")  # a scope left out matches
    assert not same_address("fe80::1%ib0", "fe80::1%ib1")
    assert not same_address("10.0.0.1", "10.0.0.2")
    assert not same_address("not-an-address", "10.0.0.1")


def test_port_netdevs_reads_roce_gid_attrs_and_ipoib(tmp_path: Any) -> None:
    ndevs = tmp_path / "class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs"
    ndevs.mkdir(parents=True)
    for index, name in ((0, "eth0"), (1, "eth0"), (2, "eth0.7"), (3, "")):
        (ndevs / str(index)).write_text(name + "\n")
    assert port_netdevs("mlx5_0", 1, str(tmp_path)) == ["eth0", "eth0.7"]
    # InfiniBand: no netdev per GID; the IPoIB netdevs of the port (dev_port is 0-based)
    for name, dev_port in (("ib0", "0"), ("ib1", "1"), ("ib0.8001", "0")):
        net = tmp_path / "class/net" / name
        (net / "device/infiniband/mlx4_0").mkdir(parents=True)
        (net / "dev_port").write_text(dev_port + "\n")
    assert port_netdevs("mlx4_0", 1, str(tmp_path)) == ["ib0", "ib0.8001"]
    assert port_netdevs("mlx4_0", 2, str(tmp_path)) == ["ib1"]
    assert port_netdevs("nosuch", 1, str(tmp_path)) == []


def test_scoped_ipv6_sockaddr_round_trips() -> None:
    from aiodat._lib import ffi, lib
    from aiodat.cm import _address

    sa = ffi.new("struct sockaddr_storage *")
    assert lib.aiodat_sockaddr(b"fe80::1%lo", 7, sa) == 0
    assert _address(ffi.cast("struct sockaddr *", sa)) == ("fe80::1%lo", 7)
    assert lib.aiodat_sockaddr(b"fe80::1%no-such-netdev", 7, sa) != 0
    assert lib.aiodat_sockaddr(b"10.1.2.3", 7, sa) == 0
    assert _address(ffi.cast("struct sockaddr *", sa)) == ("10.1.2.3", 7)


def test_an_unknown_ipv6_scope_is_named() -> None:
    """A numeric IPv6 address whose scope names no interface here is InvalidAddress naming the
    interface, in a loop or out of one; it used to be taken for a host name (in a running loop:
    "not a numeric address ... use the awaitable call", the call being made)."""
    import asyncio

    import aiodat
    from aiodat.cm import _sockaddr

    async def in_a_loop() -> None:
        with pytest.raises(aiodat.InvalidAddress, match="no network interface 'no-such-netdev' here"):
            _sockaddr("fe80::1%no-such-netdev", 7)

    with pytest.raises(aiodat.InvalidAddress, match="no network interface 'no-such-netdev' here"):
        _sockaddr("fe80::1%no-such-netdev", 7)
    asyncio.run(in_a_loop())
    assert _sockaddr("fe80::1%lo", 7) is not None


def test_a_name_looked_up_outside_a_loop_prefers_the_ias_family() -> None:
    """connect_nowait outside a loop looks a name up itself (nothing to block): of a dual-stack
    name's addresses it takes one of the IA's family, as the awaitable calls do.  It took the
    first, so an IPv4 IA could be handed an IPv6 peer, which rdma_cm then refused unclearly."""
    import socket

    from aiodat._lib import ffi
    from aiodat.cm import _address, _family, _sockaddr

    families = {info[0] for info in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)}
    for family in (socket.AF_INET, socket.AF_INET6):
        host, port = _address(ffi.cast("struct sockaddr *", _sockaddr("localhost", 7, family)))
        assert port == 7 and _family(host) == (family if family in families else next(iter(families))), host


# -- on rxe ---------------------------------------------------------------------------------


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def wait_for_address(device: str, address: str) -> None:
    """rxe adds a GID for a new address from a netdev notifier: wait until the port lists it."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for p in aiodat.list_providers():
            if p.device == device and any(same_address(a, address) for a in p.addresses):
                gids_ok = address.count(".") != 3 or any(g.endswith(address) for g in p.gids)
                if gids_ok:
                    return
        time.sleep(0.2)
    raise AssertionError(f"{address} never appeared among {device}'s addresses")


@pytest.fixture
def netdev(rdma_device: Any) -> str:
    name = rdma_device.netdev or port_netdevs(rdma_device.name, 1)[0]
    if os.geteuid() != 0:
        pytest.skip("changing the rxe netdev needs root (run under `aiodat rxe run`)")
    return name


@pytest.fixture
def extra_addresses(rdma_device: Any, netdev: str) -> Iterator[Tuple[str, str]]:
    """An IPv6 and a second IPv4 address on the rxe netdev, removed afterwards."""
    ip("-6", "addr", "add", f"{IPV6}/64", "dev", netdev, "nodad")
    ip("addr", "add", f"{SECOND_V4}/24", "dev", netdev)
    try:
        wait_for_address(rdma_device.name, IPV6)
        wait_for_address(rdma_device.name, SECOND_V4)
        yield IPV6, SECOND_V4
    finally:
        subprocess.run(["ip", "-6", "addr", "del", f"{IPV6}/64", "dev", netdev], capture_output=True)
        subprocess.run(["ip", "addr", "del", f"{SECOND_V4}/24", "dev", netdev], capture_output=True)


async def exchange(ia: Any, host: str) -> Tuple[Any, Any, Any]:
    """Connect two EPs of ``ia`` through a PSP on its address, reached as ``host``; move 5 bytes."""
    pz = ia.create_pz()
    cr_evd = ia.create_evd(4, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    client, server = ia.create_ep(pz), ia.create_ep(pz)
    buf_c, buf_s = pz.register(bytearray(64)), pz.register(bytearray(64))
    server.post_recv(buf_s[0:64], cookie="in")
    connecting = asyncio.ensure_future(client.connect(host, psp.port, b"v6?", timeout=T))
    request = await cr_evd.wait_one(timeout=T)
    await request.cr.accept(server, b"yes", timeout=T)
    assert (await asyncio.wait_for(connecting, T))[:3] == b"yes"
    buf_c.memoryview()[0:5] = b"hello"
    client.post_send(buf_c[0:5], cookie="out")
    (await client.request_evd.wait_one(timeout=T)).raise_for_status()
    got = (await server.recv_evd.wait_one(timeout=T)).raise_for_status()
    assert bytes(buf_s.memoryview()[0:got.transferred_length]) == b"hello"
    return request.cr, client, psp


@pytest.mark.rxe
async def test_ipv6_connection_and_second_ipv4_address(rdma_device: Any, extra_addresses: Tuple[str, str]) -> None:
    v6, second = extra_addresses
    provider = next(p for p in aiodat.list_providers() if p.name == rdma_device.name)
    assert provider.address == rdma_device.address  # IPv4 first: the default stays the same
    assert any(same_address(a, v6) for a in provider.addresses) and second in provider.addresses

    with aiodat.open_ia(rdma_device.name, address=v6) as ia:
        assert same_address(ia.address, v6) and rdma_device.address in ia.addresses
        cr, client, psp = await exchange(ia, v6)
        assert same_address(psp.address, v6)
        assert same_address(cr.remote_address[0], v6) and same_address(client.query().local_address[0], v6)
        with pytest.raises(aiodat.InvalidAddress, match="IPv4"):
            await ia.create_ep(ia.create_pz()).connect(rdma_device.address, psp.port, timeout=T)

    with aiodat.open_ia(rdma_device.name, address=second) as ia:
        cr, _, psp = await exchange(ia, second)
        assert psp.address == second and cr.local_address == (second, psp.port)
        # the PSP listens on its IA's address only, not on every address of every device: rdma_cm
        # refuses a request for the same port on another address (no CR reaches the PSP)
        stray = ia.create_ep(ia.create_pz())
        with pytest.raises(ConnectionRefusedError):
            await stray.connect(rdma_device.address, psp.port, timeout=T)
        assert psp.cr_evd.dequeue() is None


@pytest.mark.rxe
async def test_streams_over_ipv6(rdma_device: Any, extra_addresses: Tuple[str, str]) -> None:
    v6, _ = extra_addresses

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await aiodat.start_server(echo, v6, 0)
    try:
        sock = server.sockets[0]
        assert same_address(sock.getsockname()[0], v6) and sock.family == 10  # AF_INET6
        reader, writer = await aiodat.open_connection(v6, sock.getsockname()[1])
        writer.write(b"six!")
        assert await asyncio.wait_for(reader.readexactly(4), T) == b"six!"
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(aiodat.InvalidAddress, match="no RDMA device has that address"):
        await aiodat.start_server(echo, "fd00:99::9", 0)


@pytest.mark.rxe
async def test_rxe_on_a_vlan_netdev(rdma_device: Any, netdev: str) -> None:
    vlan = f"{netdev[:10]}.7"
    subprocess.run(["modprobe", "8021q"], capture_output=True)
    ip("link", "add", "link", netdev, "name", vlan, "type", "vlan", "id", "7")
    try:
        ip("addr", "add", f"{VLAN_V4}/24", "dev", vlan)
        ip("link", "set", vlan, "up")
        wait_for_address(rdma_device.name, VLAN_V4)
        assert vlan in port_netdevs(rdma_device.name, 1)  # the GID table names the VLAN netdev
        with aiodat.open_ia(rdma_device.name, address=VLAN_V4) as ia:
            cr, _, psp = await exchange(ia, VLAN_V4)
            assert cr.remote_address[0] == VLAN_V4 and psp.address == VLAN_V4
    finally:
        subprocess.run(["ip", "link", "del", vlan], capture_output=True)


@pytest.mark.rxe
def test_unknown_address_names_the_ports_addresses(rdma_device: Any) -> None:
    with pytest.raises(aiodat.InvalidParameter) as info:
        aiodat.open_ia(rdma_device.name, address="192.0.2.99")
    assert "192.0.2.99" in str(info.value) and rdma_device.address in str(info.value)


# -- librdmacm's QP contract and the transport settings ---------------------------------


def qp_attr(ep: Any, mask: int) -> Any:
    from aiodat._lib import ffi, lib

    attr, init = ffi.new("struct ibv_qp_attr *"), ffi.new("struct ibv_qp_init_attr *")
    assert lib.ibv_query_qp(ep._qp, attr, mask, init) == 0
    return attr


@pytest.mark.rxe
async def test_qp_less_flow_with_the_eps_transport_settings(ia: Any) -> None:
    """aiodat never hands its QP to librdmacm (cm_id->qp stays NULL); the QP still gets the
    EP's RNR timer, RNR retry, retry count and ACK timeout, and small sends go inline."""
    from aiodat._lib import ffi, lib
    from aiodat.testing.plugin import make_ep_pair

    pair = await make_ep_pair(ia, attrs=EPAttr(min_rnr_timer=3, rnr_retry=5, retry_count=4, ack_timeout=16))
    client, server = pair.client, pair.server
    for ep in (client, server):
        assert ep.state is EPState.CONNECTED and ep._cm_id.qp == ffi.NULL
        assert qp_attr(ep, lib.IBV_QP_MIN_RNR_TIMER).min_rnr_timer == 3
        assert qp_attr(ep, lib.IBV_QP_TIMEOUT).timeout == 16
    # the connecting side's counts are the ones the CM gives both QPs
    assert qp_attr(client, lib.IBV_QP_RETRY_CNT).retry_cnt == 4
    assert qp_attr(server, lib.IBV_QP_RNR_RETRY).rnr_retry == 5
    assert client.query().retry_count == 4 and client.query().ack_timeout == 16

    # inline: the device copies the bytes at post time, so the buffer may change right after
    assert client.max_inline >= 64
    src, dst = pair.client_lmr, pair.server_lmr
    server.post_recv(dst[0:64], cookie="in")
    src.memoryview()[0:6] = b"inline"
    client.post_send(src[0:6], cookie="out")
    src.memoryview()[0:6] = b"CHANGE"
    (await client.request_evd.wait_one(timeout=T)).raise_for_status()
    got = (await server.recv_evd.wait_one(timeout=T)).raise_for_status()
    assert bytes(dst.memoryview()[0:got.transferred_length]) == b"inline"

    await client.disconnect(timeout=T)
    assert qp_attr(client, lib.IBV_QP_STATE).qp_state == lib.IBV_QPS_ERR  # aiodat moved it, not librdmacm
    event = await server.connect_evd.wait_one(timeout=T)
    assert event.type is aiodat.EventType.CONNECTION_EVENT_DISCONNECTED
    assert qp_attr(server, lib.IBV_QP_STATE).qp_state == lib.IBV_QPS_ERR


@pytest.mark.rxe
def test_transport_settings_are_checked(ia: Any) -> None:
    pz = ia.create_pz()
    for bad in (EPAttr(rnr_retry=8), EPAttr(min_rnr_timer=32), EPAttr(max_inline_data=-1),
                EPAttr(comp_vector=ia._context.num_comp_vectors)):
        with pytest.raises(aiodat.InvalidParameter, match="EPAttr"):
            ia.create_ep(pz, attrs=bad)
    with pytest.raises(aiodat.InvalidParameter, match="completion vectors"):
        ia.create_evd(4, comp_vector=ia._context.num_comp_vectors)
    ep = ia.create_ep(pz, attrs=EPAttr(max_inline_data=0, comp_vector=0))
    assert ep.max_inline == 0 and ep.recv_evd.comp_vector == 0
    evds = [ia.create_evd(4) for _ in range(2 * ia._context.num_comp_vectors)]
    used = {evd.comp_vector for evd in evds}
    assert used == set(range(ia._context.num_comp_vectors))  # spread over every vector
