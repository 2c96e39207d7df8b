"""Issue 5: the asynchronous EVD on real rxe (seed 002): port events, sharing, overflow, flushes."""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import Any, Iterator, List, Tuple

import pytest

import aiodat
from aiodat import EPState, EventType
from aiodat.testing.plugin import RdmaDevice, make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # bound for every wait: the QEMU guest runs under TCG


@pytest.fixture
def netdev(rdma_device: RdmaDevice) -> Iterator[str]:
    """The test bed's own netdev under the rxe device; restored (up, port ACTIVE) after the test."""
    name = rdma_device.netdev or os.environ.get("AIODAT_RXE_NETDEV")
    if not name:
        pytest.skip("no netdev of the test bed's own (AIODAT_RXE_NETDEV): will not flap a real link")
    try:
        yield name
    finally:
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        wait_port_active(rdma_device.name)


def wait_port_active(name: str, timeout: float = T) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name == name and p.state == "PORT_ACTIVE" for p in aiodat.list_providers()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} did not come back to PORT_ACTIVE within {timeout}s")


def link(netdev: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", netdev, state], check=True)


async def collect(evd: Any, want: List[EventType], count: int) -> List[Any]:
    """Wait until ``count`` events of the types in ``want`` arrived on ``evd``; return every event seen."""
    seen: List[Any] = []
    deadline = time.monotonic() + T
    while sum(e.type in want for e in seen) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only got {[e.type.name for e in seen]}"
        seen += await evd.wait(1, timeout=left)
    return seen


async def test_port_down_and_up_on_async_evd(ia: Any, netdev: str) -> None:
    assert ia.async_evd.query().is_async
    assert ia.async_evd.dequeue() is None
    link(netdev, "down")
    events = await collect(ia.async_evd, [EventType.ASYNC_PORT_ERROR], 1)
    link(netdev, "up")
    events += await collect(ia.async_evd, [EventType.ASYNC_PORT_ACTIVE], 1)
    port_events = [e for e in events if e.type in (EventType.ASYNC_PORT_ERROR, EventType.ASYNC_PORT_ACTIVE)]
    assert [e.type for e in port_events] == [EventType.ASYNC_PORT_ERROR, EventType.ASYNC_PORT_ACTIVE]
    for event in port_events:
        assert event.port == ia.port and event.obj is ia and event.evd is ia.async_evd
    assert port_events[0].reason == "IBV_EVENT_PORT_ERR" and port_events[1].reason == "IBV_EVENT_PORT_ACTIVE"
    wait_port_active(ia.name)
    # the device works again: a fresh connection carries data
    pair = await make_ep_pair(ia)
    pair.server.post_recv(pair.server_lmr[0:16], cookie="r")
    pair.client.post_send(pair.client_lmr[0:16], cookie="s")
    assert (await pair.server.recv_evd.wait_one(timeout=T)).ok
    assert (await pair.client.request_evd.wait_one(timeout=T)).ok


async def test_shared_async_evd_gets_both_ias_and_overflows_without_loss(
        rdma_device: RdmaDevice, netdev: str) -> None:
    first = aiodat.open_ia(rdma_device.name, async_evd_qlen=1)
    try:
        with pytest.raises(aiodat.InvalidHandle):
            aiodat.open_ia(rdma_device.name, async_evd=first.create_evd(4))  # not an async EVD
        second = aiodat.open_ia(rdma_device.name, async_evd=first.async_evd)
        assert second.async_evd is first.async_evd
        shared = first.async_evd
        assert shared.query().qlen == 1
        # flap the link while nobody waits: all four events reach the 1-entry queue together
        link(netdev, "down")
        link(netdev, "up")
        await asyncio.sleep(0.5)
        events = await collect(shared, [EventType.ASYNC_PORT_ERROR, EventType.ASYNC_PORT_ACTIVE], 4)
        for etype in (EventType.ASYNC_PORT_ERROR, EventType.ASYNC_PORT_ACTIVE):
            owners = {id(e.obj) for e in events if e.type is etype}
            assert owners == {id(first), id(second)}, f"{etype.name} not seen from both IAs"
        # the queue holds 1 event, yet none was lost: the async EVD grows and counts the overflow
        assert shared.overflow_count >= 3
        second.close()
        assert not shared.closed  # it belongs to the first IA
        wait_port_active(rdma_device.name)
    finally:
        first.close()


async def test_async_evd_qlen(rdma_device: RdmaDevice) -> None:
    with aiodat.open_ia(rdma_device.name, async_evd_qlen=32) as ia:
        param = ia.async_evd.query()
        assert param.qlen >= 32 and param.is_async and param.ia is ia
    with pytest.raises(aiodat.InvalidParameter, match="async_evd_qlen"):
        aiodat.open_ia(rdma_device.name, async_evd_qlen=0)
    # a bool is not a length: True used to give a one-entry queue
    with pytest.raises(aiodat.InvalidParameter, match="async_evd_qlen must be an int >= 1, got True"):
        aiodat.open_ia(rdma_device.name, async_evd_qlen=True)
    with aiodat.open_ia(rdma_device.name) as ia, pytest.raises(aiodat.InvalidParameter, match="qlen .* got True"):
        ia.create_evd(True)


async def test_abrupt_disconnect_flushes_every_posted_receive(ia: Any) -> None:
    pair = await make_ep_pair(ia)
    server = pair.server
    for i in range(8):
        server.post_recv(pair.server_lmr[i * 64:(i + 1) * 64], cookie=i)
    assert server.recv_query().nbufs_allocated == 8
    await server.disconnect(graceful=False)  # the QP goes to ERR at once
    events: List[Any] = []
    while len(events) < 8:
        events += await server.recv_evd.wait(1, timeout=T)
    assert sorted(e.cookie for e in events) == list(range(8))
    assert all(e.status == "IBV_WC_WR_FLUSH_ERR" and e.flushed and e.ep is server for e in events)
    with pytest.raises(aiodat.DTOError, match="IBV_WC_WR_FLUSH_ERR"):
        events[0].raise_for_status()
    assert server.recv_query().nbufs_allocated == 0
    pair.server_lmr.free()  # the flushed receives no longer pin the memory


async def test_qp_error_from_a_transport_error_flushes_the_rest(ia: Any) -> None:
    """A message longer than the receive buffer breaks the receiver's QP: the rest are flushed."""
    pair = await make_ep_pair(ia)
    server, client = pair.server, pair.client
    for i in range(6):
        server.post_recv(pair.server_lmr[i * 16:(i + 1) * 16], cookie=i)
    client.post_send(pair.client_lmr[0:64], cookie="too long")
    events: List[Any] = []
    while len(events) < 6:
        events += await server.recv_evd.wait(1, timeout=T)
    by_cookie = {e.cookie: e.status for e in events}
    assert set(by_cookie) == set(range(6))
    # the verbs say LOC_LEN_ERR; rxe (kernel 6.1) reports LOC_QP_OP_ERR: either way an error, not a flush
    assert by_cookie[0] in ("IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR")
    assert all(by_cookie[i] == "IBV_WC_WR_FLUSH_ERR" for i in range(1, 6))
    sent = await client.request_evd.wait_one(timeout=T)
    assert sent.cookie == "too long" and not sent.ok
    # the failed receive broke the receiver's QP as a failed request does: the EP says so
    assert server.state is EPState.ERROR
    broken = await server.connect_evd.wait_one(timeout=T)
    assert broken.type is EventType.CONNECTION_EVENT_BROKEN and "receive with cookie 0" in broken.reason
    with pytest.raises(aiodat.InvalidState, match="ERROR"):
        server.post_recv(pair.server_lmr[0:16], cookie="after")


async def test_peer_disconnect_flushes_receives_and_requests_on_both_sides(ia: Any) -> None:
    pair = await make_ep_pair(ia)
    for i in range(4):
        pair.server.post_recv(pair.server_lmr[i * 64:(i + 1) * 64], cookie=("s", i))
        pair.client.post_recv(pair.client_lmr[i * 64:(i + 1) * 64], cookie=("c", i))
    await pair.client.disconnect()
    event = await pair.server.connect_evd.wait_one(timeout=T)
    assert event.type is EventType.CONNECTION_EVENT_DISCONNECTED
    assert pair.server.state is EPState.DISCONNECTED
    for ep, side in ((pair.server, "s"), (pair.client, "c")):
        events: List[Any] = []
        while len(events) < 4:
            events += await ep.recv_evd.wait(1, timeout=T)
        assert sorted(e.cookie for e in events) == [(side, i) for i in range(4)]
        assert all(e.flushed for e in events)


# rdma_cm's ADDR_CHANGE: on kernel 6.1 the only source is a bonding failover that changes the
# bond's hardware address under a bound cm_id (cma_netdev_callback, NETDEV_BONDING_FAILOVER).
# librdmacm keeps a device context open until its process exits, and rxe cannot be deleted
# while one is open, so the aiodat side runs in a child process and the test deletes the
# bonded rxe device after the child is gone.
_ADDR_CHANGE_CHILD = r"""
import asyncio, os, sys, time
import aiodat
from aiodat import EvdFlags, EventType

async def main() -> int:
    with aiodat.open_ia(sys.argv[1]) as ia:
        psp = ia.create_psp_any(ia.create_evd(8, EvdFlags.CR))
        print("listening", psp.port, flush=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                events = await ia.async_evd.wait(1, timeout=max(0.01, deadline - time.monotonic()))
            except aiodat.TimeoutExpired:
                break
            for event in events:
                if event.type is EventType.ASYNC_ADDRESS_CHANGE:
                    print("event", event.reason, "obj-is-psp" if event.obj is psp else repr(event.obj), flush=True)
                    return 0
    print("no ADDR_CHANGE", flush=True)
    return 1

if os.environ.get("AIODAT_LOOP") == "uvloop":
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
sys.exit(asyncio.run(main()))
"""

BOND, SLAVES, BOND_RXE, BOND_ADDR = "aiodatbond0", ("aiodatbs1", "aiodatbs2"), "aiodatrxe1", "169.254.78.1/24"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=30, capture_output=True)


def _remove_rxe(device: str, netdevs: Tuple[str, ...]) -> None:
    """Delete a test's own rxe device and its netdevs.  Never wait on a removal the kernel might
    block (while a process holds the device open): give it 20 s, then leave it."""
    remove = subprocess.Popen(["rdma", "link", "delete", device], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        remove.wait(20)
    except subprocess.TimeoutExpired:
        pass
    for dev in netdevs:
        subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=30)


@pytest.fixture
def bonded_rxe(netdev: str) -> Iterator[str]:
    """An rxe device on an active-backup bond of two dummies (only inside the test bed)."""
    if os.geteuid() != 0 or subprocess.run(["modprobe", "bonding"], capture_output=True).returncode:
        pytest.skip("needs root and the bonding module (the test bed guest has both)")
    try:
        _sh("ip", "link", "add", BOND, "type", "bond", "mode", "active-backup", "fail_over_mac", "active",
            "miimon", "50")
        for slave in SLAVES:
            _sh("ip", "link", "add", slave, "type", "dummy")
            _sh("ip", "link", "set", slave, "master", BOND)
        _sh("ip", "link", "set", BOND, "up")
        _sh("ip", "addr", "add", BOND_ADDR, "dev", BOND)
        _sh("rdma", "link", "add", BOND_RXE, "type", "rxe", "netdev", BOND)
        _sh("ip", "link", "set", BOND, "type", "bond", "active_slave", SLAVES[0])
        wait_port_active(BOND_RXE)
        yield BOND_RXE
    finally:
        _remove_rxe(BOND_RXE, (BOND,) + SLAVES)


async def test_rdma_cm_address_change_on_bond_failover(bonded_rxe: str, request: pytest.FixtureRequest) -> None:
    import sys

    loop = request.config.getoption("--aiodat-loop") or os.environ.get("AIODAT_LOOP") or "asyncio"
    child = subprocess.Popen([sys.executable, "-c", _ADDR_CHANGE_CHILD, bonded_rxe], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "AIODAT_LOOP": loop})
    try:
        assert child.stdout is not None
        first = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
        assert first.startswith("listening"), first + (child.stderr.read() if child.poll() is not None else "")
        _sh("ip", "link", "set", BOND, "type", "bond", "active_slave", SLAVES[1])  # the bond's MAC changes
        out, err = await asyncio.get_running_loop().run_in_executor(None, lambda: child.communicate(timeout=60))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0, out + err
    assert "event RDMA_CM_EVENT_ADDR_CHANGE obj-is-psp" in out


# rdma_cm's DEVICE_REMOVAL: an rxe device of the test's own, on a dummy netdev (which drops every
# packet, so a datagram resolution's SIDR REQ is never answered and the resolution stays under way
# for a minute of CM retries), deleted while a resolution is pending and a group joined.  As above,
# the aiodat side runs in a child process: the deletion completes only once its contexts are closed.
_REMOVAL_CHILD = r"""
import asyncio, os, subprocess, sys
import aiodat
from aiodat import EPAttr, EventType, ServiceType

async def main() -> int:
    device, peer = sys.argv[1], sys.argv[2]
    ia = aiodat.open_ia(device)
    ep = ia.create_ep(ia.create_pz(), attrs=EPAttr(service_type=ServiceType.UD))
    group = await ep.join_multicast("239.1.9.1", timeout=30)
    pending = asyncio.ensure_future(ep.resolve_datagram(peer, 4791, timeout=None))
    await asyncio.sleep(1.0)
    print("pending" if not pending.done() else f"ended early: {pending}", flush=True)
    remove = subprocess.Popen(["rdma", "link", "delete", device])
    try:
        await asyncio.wait_for(asyncio.shield(pending), 30)
    except aiodat.ProviderNotFound as exc:
        print("resolution failed:", exc, flush=True)
    except BaseException as exc:
        print("resolution ended otherwise:", type(exc).__name__, exc, flush=True)
    named = []
    for _ in range(200):  # (the group's id has an event of its own: it may come after the resolution's)
        while (event := ia.async_evd.dequeue()) is not None:
            if event.type is EventType.ASYNC_DEVICE_REMOVAL:
                named.append("the ep" if event.obj is ep else "the group" if event.obj is group else repr(event.obj))
        if not group.joined and len(named) >= 2:
            break
        await asyncio.sleep(0.05)
    print("group joined" if group.joined else f"group left: {group.error}", flush=True)
    for name in named:
        print("removal names", name, flush=True)
    ia.close()
    return 0

if os.environ.get("AIODAT_LOOP") == "uvloop":
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
sys.exit(asyncio.run(main()))
"""

DUMMY, DUMMY_RXE, DUMMY_ADDR, DUMMY_PEER = "aiodatdm0", "aiodatrxe2", "169.254.79.1/24", "169.254.79.2"


@pytest.fixture
def removable_rxe(rdma_device: RdmaDevice) -> Iterator[str]:
    """An rxe device on a dummy netdev, for the test to delete (only inside the test bed)."""
    if os.geteuid() != 0 or subprocess.run(["modprobe", "dummy"], capture_output=True).returncode:
        pytest.skip("needs root and the dummy module (the test bed guest has both)")
    try:
        _sh("ip", "link", "add", DUMMY, "type", "dummy")
        _sh("ip", "link", "set", DUMMY, "up")
        _sh("ip", "addr", "add", DUMMY_ADDR, "dev", DUMMY)
        _sh("rdma", "link", "add", DUMMY_RXE, "type", "rxe", "netdev", DUMMY)
        wait_port_active(DUMMY_RXE)
        yield DUMMY_RXE
    finally:
        _remove_rxe(DUMMY_RXE, (DUMMY,))  # (the test deleted it, or tried)


async def test_device_removal_fails_a_pending_resolution_and_leaves_the_group(
        removable_rxe: str, request: pytest.FixtureRequest) -> None:
    """A resolution under way when its device goes ends with ProviderNotFound (nothing else would
    end one with no timeout); a joined group is marked left; the async events name the EP and the
    group, not aiodat's internal objects."""
    import sys

    loop = request.config.getoption("--aiodat-loop") or os.environ.get("AIODAT_LOOP") or "asyncio"
    child = subprocess.Popen([sys.executable, "-c", _REMOVAL_CHILD, removable_rxe, DUMMY_PEER],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "AIODAT_LOOP": loop})
    try:
        out, err = await asyncio.get_running_loop().run_in_executor(None, lambda: child.communicate(timeout=90))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0, out + err
    lines = out.splitlines()
    assert lines[0] == "pending", out + err
    assert lines[1].startswith("resolution failed:") and "the device was removed" in lines[1], out + err
    assert lines[2] == "group left: RDMA_CM_EVENT_DEVICE_REMOVAL", out + err
    assert {"removal names the ep", "removal names the group"} <= set(lines[3:]), out + err
