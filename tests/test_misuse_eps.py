"""Misuse of endpoints and IAs on real rxe: arguments of the wrong kind, a reset that cannot finish,
a reset of a UD EP in a multicast group, and an IA the program drops.  Each is an aiodat error
naming what was wrong, raised before anything is made, or a clean-up that leaves nothing behind
(the audit of 2026-11-28, second round)."""
from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import threading
import warnings
import weakref
from typing import Any, Iterator, List

import pytest

import aiodat
from aiodat import EPAttr, EvdFlags, ServiceType
from aiodat.testing.plugin import RdmaDevice
from test_leaks import kernel_resources

pytestmark = pytest.mark.rxe

T = 30.0
UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2, max_request_iov=2)


def _qps(ia: Any) -> int:
    return kernel_resources(ia.device_name).get("qp", 0)


async def test_create_ep_names_an_evd_argument_that_is_not_an_evd(ia: Any, loop_errors: List[dict]) -> None:
    """An SRQ passed where the recv_evd goes (positionally), or a number: InvalidParameter naming the
    argument.  It used to be an AttributeError from inside ('SRQ' object has no attribute '_streams')."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 4)
    children = len(pz._children)
    with pytest.raises(aiodat.InvalidParameter, match="recv_evd must be an EVD, not SRQ"):
        ia.create_ep(pz, srq)
    for name in ("recv_evd", "request_evd", "connect_evd"):
        with pytest.raises(aiodat.InvalidParameter, match=f"{name} must be an EVD, not int"):
            ia.create_ep(pz, **{name: 5})
    assert len(pz._children) == children  # no half-made EP


async def test_an_epattr_service_type_that_is_not_a_service_type_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """EPAttr(service_type="UD") used to make an RC queue pair that neither connect() nor
    resolve_datagram() would take, each saying the EP was of the other kind."""
    pz = ia.create_pz()
    qps = _qps(ia)
    for bad in ("UD", None, 2):
        with pytest.raises(aiodat.InvalidParameter, match="EPAttr.service_type must be a ServiceType"):
            ia.create_ep(pz, attrs=EPAttr(service_type=bad))  # type: ignore[arg-type]
    assert _qps(ia) == qps


async def test_reset_of_a_ud_ep_in_a_multicast_group_leaves_it_and_frees_the_old_qp(
        ia: Any, loop_errors: List[dict]) -> None:
    """reset() of a UD EP that joined a group leaves the group first, so its old QP is destroyed and
    the EP can join again.  The old QP used to stay attached to the group, undestroyable (EBUSY),
    while the group still said it was joined and nothing from it arrived any more."""
    import aiodat._handle as handle

    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    qps, deferred = _qps(ia), len(handle._deferred)
    group = await ep.join_multicast("239.1.2.12", timeout=T)
    ep.reset()
    assert group.closed and not group.joined
    assert len(handle._deferred) == deferred and _qps(ia) == qps
    again = await ep.join_multicast("239.1.2.12", timeout=T)
    assert again.joined


async def test_a_reset_that_cannot_make_its_new_qp_frees_the_ep(
        ia: Any, loop_errors: List[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """The new queue pair of a reset cannot be made (here: injected): the EP is closed whole, so it
    leaves its SRQ, which can then be freed.  It used to keep the destroyed QP's pointer, attached to
    the SRQ, which refused to be freed ('1 endpoint(s) still use it')."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    ep = ia.create_ep(pz, srq=srq)

    def refuse() -> Any:
        raise aiodat.InsufficientResources("injected: no queue pair")

    monkeypatch.setattr(ep, "_create_qp", refuse)
    with pytest.raises(aiodat.InsufficientResources, match="injected"):
        ep.reset()
    assert ep.closed
    with pytest.raises(aiodat.InvalidHandle):
        ep.post_recv(pz.register(bytearray(8))[0:8])
    srq.free()


async def test_join_multicast_takes_a_group_as_a_str_only(ia: Any, loop_errors: List[dict]) -> None:
    """A group given as an int or packed bytes (which ipaddress accepts) is InvalidParameter; a
    scope naming no interface is InvalidAddress.  Both used to leave a half-made group in the EP,
    whose close then raised AttributeError."""
    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    for bad in (0xE0000001, b"\xe0\x00\x00\x01"):
        with pytest.raises(aiodat.InvalidParameter, match="group must be an IP address as a str"):
            await ep.join_multicast(bad, timeout=T)  # type: ignore[arg-type]
    with pytest.raises(aiodat.InvalidAddress, match="no network interface 'nosuchif'"):
        await ep.join_multicast("ff02::1%nosuchif", timeout=T)
    assert not ep._children
    ep.close()


async def test_an_ia_name_with_a_port_that_is_a_digit_but_no_number(rdma_device: RdmaDevice) -> None:
    """'rxe0:²' ('²' is a digit to str.isdigit): InvalidParameter naming the port, not int()'s ValueError."""
    with pytest.raises(aiodat.InvalidParameter, match="the port after ':' must be a number"):
        aiodat.open_ia(f"{rdma_device.name}:\u00b2")


async def test_an_ia_sharing_an_async_evd_is_released_when_dropped(rdma_device: RdmaDevice) -> None:
    """An IA opened with another's async EVD and dropped unclosed is released (with a
    ResourceWarning), as any dropped aiodat object; the shared EVD held it for ever."""
    first = aiodat.open_ia(rdma_device.name)
    try:
        second = aiodat.open_ia(rdma_device.name, async_evd=first.async_evd)
        await asyncio.sleep(0)
        gone = weakref.ref(second)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            del second
            gc.collect()
        assert gone() is None and not first.async_evd._sharers
        assert any(issubclass(w.category, ResourceWarning) for w in seen), [str(w.message) for w in seen]
        assert first.async_evd.dequeue() is None  # the shared EVD works on
    finally:
        first.close()


async def test_close_from_another_thread_while_the_loop_runs_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """close() of an EP, an EVD, a PZ or the IA from a thread other than the one running the loop
    that serves them is InvalidState naming the way to do it, and closes nothing: it would free what
    the loop's callbacks may be using at that moment.  It used to go ahead.  Handed to the loop's
    thread, it closes."""
    pz = ia.create_pz()
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    evd.post_se(1)
    await evd.wait(timeout=T)  # a wait: this loop now serves the IA
    ep = ia.create_ep(pz)
    outcome: List[Any] = []

    def from_thread() -> None:
        for obj in (ep, evd, pz, ia):
            try:
                obj.close()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

    await asyncio.get_running_loop().run_in_executor(None, from_thread)  # (this loop runs on meanwhile)
    assert len(outcome) == 4 and all(isinstance(o, aiodat.InvalidState) for o in outcome), outcome
    assert all("call_soon_threadsafe" in str(o) for o in outcome)
    assert not (ep.closed or evd.closed or pz.closed or ia.closed)
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: loop.call_soon_threadsafe(ep.close)).start()
    await asyncio.wait_for(until_closed(ep), T)
    assert evd.dequeue() is None  # the rest works on


async def until_closed(obj: Any) -> None:
    while not obj.closed:
        await asyncio.sleep(0.01)


NOIP_NETDEV, NOIP_DEVICE = "aiodatnoip", "rxenoip"


@pytest.fixture
def addressless_device(rdma_device: RdmaDevice) -> Iterator[str]:
    """A second rxe device, on a dummy netdev with no IP address (no IPv6 link-local either),
    removed after the test.  Needs root and iproute2 (the test bed has both)."""
    if os.geteuid() != 0 and not os.environ.get("AIODAT_REQUIRE_DEVICE"):
        pytest.skip("needs root to add an rxe device (run it in the test bed: aiodat rxe run -- pytest ...)")
    from test_async_events import wait_port_active

    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    run("ip", "link", "add", NOIP_NETDEV, "type", "dummy")
    try:
        run("ip", "link", "set", NOIP_NETDEV, "addrgenmode", "none")
        run("ip", "link", "set", NOIP_NETDEV, "up")
        run("rdma", "link", "add", NOIP_DEVICE, "type", "rxe", "netdev", NOIP_NETDEV)
        try:
            wait_port_active(NOIP_DEVICE)
            yield NOIP_DEVICE
        finally:
            run("rdma", "link", "delete", NOIP_DEVICE)
    finally:
        run("ip", "link", "del", NOIP_NETDEV)


async def test_an_ia_without_an_address_refuses_to_connect_up_front(
        ia: Any, addressless_device: str, loop_errors: List[dict]) -> None:
    """An IA whose port has no IP address: connect, connect_nowait, resolve_datagram, join_multicast
    and create_psp are InvalidAddress saying so, before anything starts.  A connect used to go
    ahead with no source address, so rdma_cm routed it by the destination alone, through another
    device than the EP's (here: the one the peer is on), and it failed late and obscurely."""
    with aiodat.open_ia(addressless_device) as lone:
        assert lone.address is None
        pz = lone.create_pz()
        ep, ud = lone.create_ep(pz), lone.create_ep(pz, attrs=UD)
        says = f"{addressless_device} has no IP address to"
        with pytest.raises(aiodat.InvalidAddress, match=f"{says} connect from"):
            await ep.connect(ia.address, 4791, timeout=T)
        with pytest.raises(aiodat.InvalidAddress, match=f"{says} connect from"):
            ep.connect_nowait(ia.address, 4791, timeout=T)
        with pytest.raises(aiodat.InvalidAddress, match=f"{says} resolve a datagram peer from"):
            await ud.resolve_datagram(ia.address, 4791, timeout=T)
        with pytest.raises(aiodat.InvalidAddress, match=f"{says} join a multicast group from"):
            await ud.join_multicast("239.1.2.13", timeout=T)
        with pytest.raises(aiodat.InvalidAddress, match=f"{says} listen on"):
            lone.create_psp_any(lone.create_evd(4, EvdFlags.CR))
        assert ep.state is aiodat.EPState.UNCONNECTED and not ep._children and not ud._children


async def test_resizing_an_evd_never_shrinks_the_cq_its_eps_need(ia: Any, loop_errors: List[dict]) -> None:
    """Four EPs of 64 receives share an EVD of qlen 16, so its CQ grew to hold 256 completions.
    resize(8) makes the EVD queue 8 events and leaves the CQ as large: it used to shrink the CQ to
    8 entries, which 256 pending receives would overrun (IBV_EVENT_CQ_ERR, completions lost)."""
    from aiodat.cqsize import cq_entries

    pz = ia.create_pz()
    evd = ia.create_evd(16, EvdFlags.DTO)
    eps = [ia.create_ep(pz, recv_evd=evd, attrs=EPAttr(max_recv_dtos=64)) for _ in range(4)]
    grown = cq_entries(evd)
    assert grown >= 4 * 64
    evd.resize(8)
    assert evd.query().qlen == 8 and cq_entries(evd) == grown
    evd.resize(2 * grown)  # above what it holds: the CQ grows
    assert cq_entries(evd) >= 2 * grown and evd.query().qlen == 2 * grown
    for ep in eps:
        ep.close()


async def test_create_ep_failing_in_another_thread_reports_its_own_error(
        ia: Any, loop_errors: List[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """create_ep called from another thread while this loop serves the IA, failing after it made
    its own EVDs (here: injected): the caller gets that failure and the PZ holds no half-made EP.
    Its clean-up used to close the own EVDs with close(), which refuses another thread's call: the
    caller got that InvalidState instead, and a half-made EP stayed in the PZ."""
    pz = ia.create_pz()
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    evd.post_se(1)
    await evd.wait(timeout=T)  # a wait: this loop now serves the IA

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise aiodat.InsufficientResources("injected: the CQs cannot grow")

    monkeypatch.setattr(aiodat.ep, "fit_cqs", refuse)
    children, evds = len(pz._children), sum(isinstance(c, aiodat.EVD) for c in list(ia._children))
    outcome: List[BaseException] = []

    def from_thread() -> None:
        try:
            ia.create_ep(pz)
        except BaseException as exc:
            outcome.append(exc)

    await asyncio.get_running_loop().run_in_executor(None, from_thread)  # (this loop runs on meanwhile)
    assert len(outcome) == 1 and isinstance(outcome[0], aiodat.InsufficientResources), outcome
    assert len(pz._children) == children
    assert sum(isinstance(c, aiodat.EVD) for c in list(ia._children)) == evds


async def test_a_reset_keeps_the_events_of_the_requests_the_disconnect_flushed(ia: Any,
                                                                               loop_errors: List[dict]) -> None:
    """Receives flushed by an abrupt disconnect and not yet taken when the EP is reset still give
    their events, with their cookies: the reset polls the EP's EVDs while its old QP number still
    names it.  They used to stay in the CQ, claimed by no EP, and were lost."""
    from aiodat.testing.plugin import make_ep_pair

    pair = await make_ep_pair(ia)
    server = pair.server
    for i in range(4):
        server.post_recv(pair.server_lmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    await server.disconnect(graceful=False, timeout=T)
    server.reset()
    events = await server.recv_evd.wait(4, timeout=5)
    assert [e.cookie for e in events] == ["r0", "r1", "r2", "r3"] and all(e.flushed for e in events)
    assert pair.server_lmr._inflight == 0
    pair.close()


@pytest.mark.parametrize("ia_too", [False, True])
async def test_the_connect_evd_of_a_freed_ep_that_never_made_one_is_invalid_handle(ia: Any, ia_too: bool) -> None:
    """A freed EP whose connection events never needed an EVD of its own has none: reading
    ``connect_evd`` raises InvalidHandle, as any use after close does.  It used to make one and
    free it at once, and with its IA closed too it raised AttributeError from inside."""
    other = aiodat.open_ia(ia.device_name)
    ep = other.create_ep(other.create_pz())
    ep.free()
    if ia_too:
        other.close()
    with pytest.raises(aiodat.InvalidHandle, match="ep is closed"):
        ep.connect_evd
    other.close()
