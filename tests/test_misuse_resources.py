"""Misuse of the resource layers (srq.py, datagram.py, memory.py) on real rxe: numbers of the wrong
kind or size, batches of the wrong shape, bad timeouts, calls from another thread's loop, waits
their SRQ can no longer wake, and objects the program drops.  Each misuse is an aiodat error naming
what was wrong, raised before anything is posted or sent: nothing is lost or left behind."""
from __future__ import annotations

import asyncio
import gc
from typing import Any, List, Tuple

import pytest

import aiodat
from aiodat import EPAttr, EvdFlags, Privileges, ServiceType
from aiodat.testing.plugin import make_ep_pair
from loop_threads import in_another_loop

T = 30.0  # generous bound for every wait: the QEMU guest runs under TCG
HUGE = 10**5000  # an int too long for repr(): a message built with it would raise ValueError
HUGE_WORDS = "an int of 16610 bits"
#: timeouts no loop timer takes: NaN, ints no float holds, negative, not a number
BAD_TIMEOUTS = (float("nan"), 10**400, 10**5000, -10**400, -1, "10", b"1", True, False)
UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2, max_request_iov=2)
WINDOWED = Privileges.LOCAL_WRITE | Privileges.MW_BIND


def _routes(ia: Any) -> int:
    return len(ia._cm._routes)


def _kinds(parent: Any, kind: type) -> int:
    return sum(isinstance(child, kind) for child in list(parent._children))


async def _connected_srq(ia: Any, buffers: int) -> Tuple[Any, Any, Any, Any]:
    """An SRQ holding ``buffers`` receives, one EP receiving from it connected to a client."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    pool = pz.register(bytearray(16 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(buffers))
    server, client = ia.create_ep(pz, srq=srq), ia.create_ep(pz)
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    connecting = asyncio.ensure_future(client.connect(ia.address, psp.port, timeout=T))
    await (await cr_evd.wait_one(timeout=T)).cr.accept(server, timeout=T)
    await asyncio.wait_for(connecting, T)
    return srq, server, client, pz.register(bytearray(64))


# ---------------------------------------------------------------- SRQ


def _device_counts(ia: Any) -> Any:
    from test_leaks import kernel_resources

    return kernel_resources(ia.device_name)


@pytest.mark.rxe
async def test_an_evd_failing_at_its_last_step_frees_its_cq(
        ia: Any, loop_errors: List[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """The EVD's constructor fails after its CQ and channel were made (here: watching the channel's
    fd): the CQ and the channel are destroyed at once and the IA holds no half-made EVD.  They used
    to stay, with the channel's fd, until the collector freed the EVD (or the IA closed).  (Closing it
    then hung, on a channel fd not yet made non-blocking: the test found that.)"""
    from test_leaks import fds

    before, kernel, owned, evds = fds(), _device_counts(ia), len(ia._cq_owner), _kinds(ia, aiodat.EVD)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the loop cannot watch the channel")

    monkeypatch.setattr(aiodat.evd, "FdWatch", refuse)
    with pytest.raises(RuntimeError, match="injected") as info:
        ia.create_evd(8, EvdFlags.DTO)
    monkeypatch.undo()
    # (while the exception lives, as a program's handler or log keeps it: its traceback holds the
    # half-made EVD, so the collector cannot have freed it)
    assert info.traceback and fds() == before and len(ia._cq_owner) == owned
    assert _kinds(ia, aiodat.EVD) == evds and _device_counts(ia) == kernel
    assert ia.create_evd(8, EvdFlags.DTO).query().qlen >= 8  # the IA goes on


@pytest.mark.rxe
async def test_an_srq_failing_at_its_last_step_frees_it(
        ia: Any, loop_errors: List[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """The SRQ's constructor fails after ibv_create_srq (here: its first query): the SRQ is destroyed
    at once and the PZ holds no half-made SRQ.  It used to stay until the collector freed it (or the
    PZ closed)."""
    pz = ia.create_pz()
    kernel = _device_counts(ia)

    def refuse(self: Any) -> None:
        raise aiodat.InsufficientResources("injected: ibv_query_srq failed")

    monkeypatch.setattr(aiodat.srq.SRQ, "_refresh_sizes", refuse)
    with pytest.raises(aiodat.InsufficientResources, match="injected") as info:
        ia.create_srq(pz, 16)
    monkeypatch.undo()
    assert info.traceback and _kinds(pz, aiodat.SRQ) == 0  # (the exception alive: see above) and not ia._srq_owner and _device_counts(ia) == kernel
    assert ia.create_srq(pz, 16).query().max_recv_dtos >= 16  # the PZ goes on



@pytest.mark.rxe
@pytest.mark.parametrize("recv_evd", ["own", "shared"])
async def test_an_srq_receive_completed_unpolled_when_its_ep_closes_is_counted_back(
        ia: Any, loop_errors: List[dict], recv_evd: str) -> None:
    """A message landed in a buffer the EP took from its SRQ, and the EP closed before anything polled
    its CQ.  The buffer is no longer posted (rxe keeps the completion after the QP is gone), so the
    SRQ counts it back; on a shared recv EVD its event comes, with its cookie.  The SRQ used to count
    it as posted for ever (its LMR could not be freed), and the shared EVD never saw it."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    pool = pz.register(bytearray(4 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], f"b{i}") for i in range(4))
    shared = ia.create_evd(16, EvdFlags.DTO) if recv_evd == "shared" else None
    server, client = ia.create_ep(pz, recv_evd=shared, srq=srq), ia.create_ep(pz)
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    connecting = asyncio.ensure_future(client.connect(ia.address, psp.port, timeout=T))
    await (await cr_evd.wait_one(timeout=T)).cr.accept(server, timeout=T)
    await asyncio.wait_for(connecting, T)
    client.post_send(pz.register(bytearray(8))[0:8], cookie="s")
    # the message is in the buffer once the send completed; nothing polled the server's CQ (no
    # task ever waited on its recv EVD, so no loop watches it)
    assert (await client.request_evd.wait_one(timeout=T)).ok
    server.close()
    if shared is None:
        assert srq.query().outstanding_dto_count == 3
    else:
        assert srq.query().outstanding_dto_count == 4  # three posted, one queued on the EVD
        event = shared.dequeue()
        assert event is not None and event.cookie == "b0" and event.ok
        assert srq.query().outstanding_dto_count == 3
    srq.close()
    pool.free()  # no buffer of it counts as posted any more


@pytest.mark.rxe
async def test_srq_sizes_no_repr_can_show_are_invalid_parameter(ia: Any, loop_errors: List[dict]) -> None:
    """create_srq, resize and set_lw with an int too long for repr() raise InvalidParameter naming the
    argument and its size (they raised ValueError from building the message); the SRQ is unchanged."""
    pz = ia.create_pz()
    for kwargs, words in (({"max_recv_dtos": HUGE}, "max_recv_dtos"), ({"max_recv_iov": HUGE}, "max_recv_iov"),
                          ({"low_watermark": HUGE}, "low_watermark")):
        with pytest.raises(aiodat.InvalidParameter, match=f"{words} must be .* got {HUGE_WORDS}"):
            ia.create_srq(pz, **{"max_recv_dtos": 8, **kwargs})
    srq = ia.create_srq(pz, 8)
    with pytest.raises(aiodat.InvalidParameter, match=f"max_recv_dtos must be .* got {HUGE_WORDS}"):
        srq.resize(HUGE)
    with pytest.raises(aiodat.InvalidParameter, match=f"low_watermark must be .* got {HUGE_WORDS}"):
        srq.set_lw(HUGE)
    param = srq.query()
    assert param.low_watermark is None and param.max_recv_dtos >= 8
    assert [type(c).__name__ for c in pz._children] == ["SRQ"]


@pytest.mark.rxe
async def test_srq_post_recv_batch_of_the_wrong_shape_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """srq.post_recv_batch with items that are not (segments, cookie) pairs raises InvalidParameter
    naming the call, as ep.post_recv_batch does (it raised TypeError or ValueError from unpacking),
    and posts nothing."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    lmr = pz.register(bytearray(256))
    for items in (5, [1], [(lmr[0:8], "a", "b")], [lmr[0:8]], [(lmr[0:8], "a"), None]):
        with pytest.raises(aiodat.InvalidParameter, match="post_recv_batch"):
            srq.post_recv_batch(items)  # type: ignore[arg-type]
        assert not srq._posted and lmr._inflight == 0, items
    assert srq.post_recv_batch(iter([(lmr[0:8], "a"), (lmr[8:16], "b")])) == 2
    assert srq.query().outstanding_dto_count == 2


@pytest.mark.rxe
@pytest.mark.parametrize("how", ["generator", "segments iterable"])
async def test_an_srq_closed_while_its_post_reads_the_items_is_invalid_handle(ia: Any, loop_errors: List[dict],
                                                                              how: str) -> None:
    """The program's own code run while srq.post_recv_batch reads its items (a generator) or
    post_recv its segments (an iterable) closes the SRQ: InvalidHandle, nothing posted or counted.
    The SRQ was checked before the items were read, and the post went to the freed queue: the
    process died of a segmentation fault."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    lmr = pz.register(bytearray(256))

    def items() -> Any:
        yield lmr[0:64], "a"
        srq.close()
        yield lmr[64:128], "b"

    class Segments:
        def __iter__(self) -> Any:
            srq.close()
            return iter([lmr[0:64]])

    with pytest.raises(aiodat.InvalidHandle, match="srq is closed"):
        if how == "generator":
            srq.post_recv_batch(items())
        else:
            srq.post_recv(Segments(), "a")  # type: ignore[arg-type]
    assert srq.closed and not srq._posted and lmr._inflight == 0
    lmr.free()
    pz.free()


@pytest.mark.rxe
async def test_a_bad_low_watermark_timeout_is_refused_and_loses_no_event(ia: Any, loop_errors: List[dict]) -> None:
    """srq.low_watermark with a NaN, huge, negative or non-number timeout raises InvalidParameter
    naming the timeout and leaves no waiter behind.  A huge one used to raise OverflowError from the
    loop's timer after its future had joined the waiters: the next low-watermark event then went to
    that orphan, and the call that should have had it waited in vain."""
    srq, server, client, send_lmr = await _connected_srq(ia, 4)
    srq.set_lw(3)
    for bad in BAD_TIMEOUTS:
        with pytest.raises(aiodat.InvalidParameter, match="timeout must be"):
            await asyncio.wait_for(srq.low_watermark(timeout=bad), 5)
        assert not srq._waiters, bad
    for i in range(2):  # 4 -> 2 buffers left: below 3, the event fires with nobody waiting
        client.post_send(send_lmr[0:8], cookie=i)
        assert (await client.request_evd.wait_one(timeout=T)).ok
        assert (await server.recv_evd.wait_one(timeout=T)).ok
    await asyncio.wait_for(srq.low_watermark(timeout=10), T)  # kept for this call
    assert srq.low_watermark_events == 1


@pytest.mark.rxe
async def test_disarming_the_low_watermark_wakes_its_waiter(ia: Any, loop_errors: List[dict]) -> None:
    """set_lw(None) while a task waits in low_watermark(): nothing could wake that wait any more, so
    it raises InvalidState saying so (it used to wait for ever), as a call made unarmed does."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    srq.set_lw(2)
    waiter = asyncio.ensure_future(srq.low_watermark())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    srq.set_lw(None)
    with pytest.raises(aiodat.InvalidState, match="disarmed"):
        await asyncio.wait_for(waiter, 5)
    assert not srq._waiters
    srq.set_lw(2)  # arming again afterwards works, and a new wait waits
    again = asyncio.ensure_future(srq.low_watermark())
    await asyncio.sleep(0.05)
    assert not again.done()
    srq.free()
    with pytest.raises(aiodat.InvalidHandle, match="freed"):
        await asyncio.wait_for(again, 5)


# ---------------------------------------------------------------- memory


@pytest.mark.rxe
async def test_registering_a_released_memoryview_is_invalid_parameter(ia: Any, loop_errors: List[dict]) -> None:
    """pz.register / register_async of a released memoryview raise InvalidParameter saying so (they
    raised ValueError); nothing is registered."""
    pz = ia.create_pz()
    view = memoryview(bytearray(64))
    view.release()
    with pytest.raises(aiodat.InvalidParameter, match="released memoryview"):
        pz.register(view)
    with pytest.raises(aiodat.InvalidParameter, match="released memoryview"):
        await pz.register_async(view)
    assert not list(pz._children)


@pytest.mark.rxe
async def test_a_ctypes_object_owning_its_memory_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """ctypes.resize() frees and moves a ctypes object's own memory whatever exports it, so the
    device could write into freed memory: registering one (or a view of one) is InvalidParameter,
    nothing registered.  One made with from_buffer() over a bytearray cannot move: it registers."""
    import ctypes

    pz = ia.create_pz()
    owning = (ctypes.c_ubyte * 64)()
    for buffer in (owning, memoryview(owning)):
        with pytest.raises(aiodat.InvalidParameter, match="c_ubyte_Array_64 that owns its memory"):
            pz.register(buffer)
        with pytest.raises(aiodat.InvalidParameter, match="owns its memory"):
            await pz.register_async(buffer)
    assert not list(pz._children)
    ctypes.resize(owning, 128)  # (no export was left behind by the refusal)
    backing = bytearray(64)
    lmr = pz.register((ctypes.c_ubyte * 64).from_buffer(backing))
    lmr.memoryview()[:4] = b"ping"
    assert backing[:4] == b"ping"
    lmr.free()


@pytest.mark.rxe
async def test_lmr_memoryview_can_be_released(ia: Any, loop_errors: List[dict]) -> None:
    """``with lmr.memoryview() as mv`` releases a view of its own: it raised BufferError, the
    LMR's own view being exported to the registration.  The LMR works on after it."""
    buf = bytearray(64)
    lmr = ia.create_pz().register(buf)
    with lmr.memoryview() as mv:
        mv[:4] = b"ping"
    with lmr.memoryview().cast("B", (8, 8)) as rows:
        assert bytes(rows.tolist()[0]) == b"ping\0\0\0\0"
    assert bytes(lmr.memoryview()[:4]) == b"ping" and bytes(lmr[0:4].memoryview()) == b"ping"
    lmr.free()


@pytest.mark.rxe
async def test_segments_no_repr_can_show_are_length_errors(ia: Any, loop_errors: List[dict]) -> None:
    """lmr.segment and Segment with an offset or length too long for repr() raise LengthError naming
    its size (they raised ValueError from building the message)."""
    lmr = ia.create_pz().register(bytearray(64))
    for call in (lambda: lmr.segment(HUGE), lambda: lmr.segment(0, HUGE), lambda: aiodat.Segment(lmr, 0, HUGE),
                 lambda: aiodat.Segment(lmr, HUGE, 1)):
        with pytest.raises(aiodat.LengthError, match=f"{HUGE_WORDS}.* outside the LMR of 64 bytes"):
            call()
    assert lmr.segment(8).length == 56


@pytest.mark.rxe
async def test_a_hand_built_remote_region_is_checked(ia: Any, loop_errors: List[dict]) -> None:
    """aiodat.RemoteRegion is public, like Segment: one made by hand whose address or length no
    64-bit field holds, whose rmr_context no 32-bit one holds, or that is not an int, is refused where
    it is made, with InvalidParameter naming the field.  It used to be accepted, then fail as
    struct.error in to_bytes() or OverflowError / TypeError in an RDMA post."""
    pair = await make_ep_pair(ia)
    for args, field in (((-1, 8, 1), "address"), ((2**64, 8, 1), "address"), (("0", 8, 1), "address"),
                        ((0, -1, 1), "length"), ((0, 2**64, 1), "length"), ((0, True, 1), "length"),
                        ((0, 8, -1), "rmr_context"), ((0, 8, 2**32), "rmr_context"),
                        ((0, 8, HUGE), "rmr_context"), ((0, 8, 1.0), "rmr_context")):
        with pytest.raises(aiodat.InvalidParameter, match=f"RemoteRegion {field} must be"):
            aiodat.RemoteRegion(*args)
    edge = aiodat.RemoteRegion(2**64 - 1, 2**64 - 1, 2**32 - 1)
    assert aiodat.RemoteRegion.from_bytes(edge.to_bytes()) == edge
    # a real one still works
    pair.client_lmr.memoryview()[0:4] = b"rdma"
    pair.client.post_rdma_write(pair.client_lmr[0:4], pair.server_lmr.remote()[0:4])
    assert (await pair.client.request_evd.wait_one(timeout=T)).ok
    assert bytes(pair.server_lmr.memoryview()[0:4]) == b"rdma"


#: privileges register and a window's bind refuse, and what the refusal says
BAD_PRIVILEGES = [(-1, "invalid privileges"), (-2, "invalid privileges"), (1 << 8, "invalid privileges"),
                  (2**40, "invalid privileges"), (HUGE, "invalid privileges"),
                  (2**40 | Privileges.REMOTE_READ, "invalid privileges"),
                  (True, "privileges must be Privileges flags, not"), (False, "privileges must be Privileges flags, not"),
                  (1.0, "privileges must be Privileges flags, not"), ("LOCAL_WRITE", "privileges must be Privileges flags, not")]


@pytest.mark.rxe
async def test_privileges_outside_the_flags_or_of_the_wrong_type_are_refused(ia: Any, loop_errors: List[dict]) -> None:
    """Privileges with bits outside Privileges.ALL, or negative, are InvalidParameter for register and
    for a window's bind.  -1 used to register the buffer (and bind a window) with every privilege,
    remote write and atomics included; unknown bits were ignored.  A bool (or a float, a string) is
    not Privileges either, as every int argument of aiodat refuses a bool: register used to take
    True as LOCAL_READ and False as NONE (a read-only registration), saying nothing."""
    pair = await make_ep_pair(ia)
    pz = pair.pz
    exposed = pz.register(bytearray(256), WINDOWED)
    rmr = pz.create_rmr()
    children = len(pz._children)
    for bad, says in BAD_PRIVILEGES:
        with pytest.raises(aiodat.InvalidParameter, match=says):
            pz.register(bytearray(64), bad)
        with pytest.raises(aiodat.InvalidParameter, match=says):
            await pz.register_async(bytearray(64), bad)
        with pytest.raises(aiodat.InvalidParameter, match=says):
            await rmr.bind(exposed[0:64], bad, pair.server)
        with pytest.raises(aiodat.InvalidParameter, match=says):
            rmr.bind_nowait(exposed[0:64], bad, pair.server)
    assert len(pz._children) == children
    assert not rmr.bound and exposed._inflight == 0 and pair.server.query().outstanding_requests == 0
    await rmr.bind(exposed[0:64], Privileges.REMOTE_READ, pair.server)
    assert rmr.query().privileges == Privileges.REMOTE_READ


@pytest.mark.rxe
async def test_remote_of_an_lmr_no_peer_may_reach_is_privileges_violation(ia: Any, loop_errors: List[dict]) -> None:
    """lmr.remote() and segment.remote() of an LMR registered without any remote privilege raise
    PrivilegesViolation naming the privileges: the region would only make every RDMA a peer aims at
    it fail on the device and break that peer's connection.  They used to hand it out.  With one
    remote privilege, remote() works; a window bound to such an LMR is the way to lend it."""
    pz = ia.create_pz()
    for local in (Privileges.DEFAULT, Privileges.LOCAL_READ, Privileges.LOCAL_WRITE | Privileges.MW_BIND):
        lmr = pz.register(bytearray(128), local)
        with pytest.raises(aiodat.PrivilegesViolation, match="lets no peer reach it"):
            lmr.remote()
        with pytest.raises(aiodat.PrivilegesViolation, match="lets no peer reach it"):
            lmr[0:64].remote()
        lmr.close()
    for remote in (Privileges.REMOTE_READ, Privileges.REMOTE_WRITE | Privileges.LOCAL_WRITE,
                   Privileges.REMOTE_ATOMIC | Privileges.LOCAL_WRITE):
        lmr = pz.register(bytearray(128), remote)
        region = lmr[8:72].remote()
        assert (region.address, region.length, region.rmr_context) == (lmr.address + 8, 64, lmr.rmr_context)
        lmr.close()
        with pytest.raises(aiodat.InvalidHandle):
            lmr.remote()


@pytest.mark.rxe
async def test_a_bind_from_another_loop_is_refused_before_it_is_posted(ia: Any, loop_errors: List[dict]) -> None:
    """rmr.bind / rmr.unbind awaited in another thread's loop raise InvalidState (the EP's request EVD
    belongs to this loop) before the bind or invalidation goes.  The bind used to be posted first:
    the window then got bound behind the caller's back, its LMR pinned, and the completion was set
    from this loop's thread on the other loop's future."""
    pair = await make_ep_pair(ia)
    evd = pair.server.request_evd
    with pytest.raises(aiodat.TimeoutExpired):
        await evd.wait_one(timeout=0.05)  # this loop watches the request EVD from here on
    exposed = pair.pz.register(bytearray(256), WINDOWED)
    rmr, bound = pair.pz.create_rmr(), pair.pz.create_rmr()
    await bound.bind(exposed[64:128], Privileges.REMOTE_READ, pair.server)
    inflight = exposed._inflight
    outcomes = await in_another_loop([
        ("bind", lambda: rmr.bind(exposed[0:64], Privileges.REMOTE_WRITE, pair.server)),
        ("unbind", lambda: bound.unbind(pair.server))], 4 * T)
    await asyncio.sleep(0.5)  # a bind posted anyway would have completed by now
    seen = ([(name, repr(exc)[:80]) for name, exc in outcomes], rmr.bound, bound.bound, exposed._inflight)
    assert [name for name, _ in outcomes] == ["bind", "unbind"], seen
    assert all(isinstance(exc, aiodat.InvalidState) for _, exc in outcomes), seen
    assert not rmr.bound and not rmr._pending and bound.bound and not bound._pending, seen
    assert exposed._inflight == inflight and evd._awaited == 0, seen
    assert evd.dequeue() is None and pair.server.query().outstanding_requests == 0, seen
    await rmr.bind(exposed[0:64], Privileges.REMOTE_WRITE, pair.server)  # from this loop it works
    await bound.unbind(pair.server)
    assert rmr.bound and not bound.bound


# ---------------------------------------------------------------- datagrams


@pytest.mark.rxe
async def test_a_bad_datagram_timeout_is_refused_before_anything_starts(ia: Any, loop_errors: List[dict]) -> None:
    """resolve_datagram and join_multicast with a NaN, huge, negative or non-number timeout raise
    InvalidParameter naming the timeout, with no cm_id made.  A huge or non-number one used to raise
    OverflowError / TypeError from asyncio.wait_for after the resolution had started: its cm_id
    stayed, and its answer became an AddressHandle nobody had."""
    from aiodat.datagram import AddressHandle

    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    psp = ep.serve_datagram(0)
    routes, handles = _routes(ia), _kinds(pz, AddressHandle)
    for bad in BAD_TIMEOUTS + (0,):
        with pytest.raises(aiodat.InvalidParameter, match="timeout"):
            await asyncio.wait_for(ep.resolve_datagram(ia.address, psp.port, timeout=bad), T)
        with pytest.raises(aiodat.InvalidParameter, match="timeout"):
            await asyncio.wait_for(ep.join_multicast("239.1.2.3", timeout=bad), T)
        assert _routes(ia) == routes and not list(ep._children), bad
    await asyncio.sleep(0.5)  # a resolution started anyway would have its answer by now
    assert _routes(ia) == routes and _kinds(pz, AddressHandle) == handles
    assert psp.requests == 0
    ah = await ep.resolve_datagram(ia.address, psp.port, timeout=float("inf"))  # inf: no timer, as None
    assert ah.remote_qpn == ep.qp_num and psp.requests == 1


@pytest.mark.rxe
async def test_a_datagram_timeout_that_expires_logs_nothing(ia: Any, loop_errors: List[dict],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolution or a join whose timeout expires raises TimeoutExpired, and nothing else: its
    internal future used to be failed with nobody left to retrieve it, and asyncio then logged
    "Future exception was never retrieved" into the loop's exception handler.  (The rdma_cm events
    are dropped here so that no answer can beat the timer.)"""
    from aiodat import datagram

    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    psp = ep.serve_datagram(0)
    routes = _routes(ia)
    monkeypatch.setattr(datagram._Resolver, "_on_cm_event", lambda self, ev, pdata: None)
    monkeypatch.setattr(datagram._Joiner, "_on_cm_event", lambda self, ev, pdata: None)
    with pytest.raises(aiodat.TimeoutExpired, match="no answer within 0.2s"):
        await ep.resolve_datagram(ia.address, psp.port, timeout=0.2)
    with pytest.raises(aiodat.TimeoutExpired, match="no answer within 0.2s"):
        await ep.join_multicast("239.1.2.4", timeout=0.2)
    gc.collect()
    await asyncio.sleep(0.1)
    assert _routes(ia) == routes and not list(ep._children)


def _absent_neighbour(ia: Any) -> Tuple[str, str]:
    """The IA's netdev and an address in its IPv4 subnet that nothing answers (the test bed's dummy
    netdev has ARP off: the caller turns it on, so that resolving the address waits for a reply)."""
    import ipaddress
    import os
    import subprocess
    from pathlib import Path

    netdev = Path(f"/sys/class/infiniband/{ia.device_name}/ports/{ia.port}/gid_attrs/ndevs/0")
    if os.geteuid() != 0 or not netdev.exists() or ":" in (ia.address or ":"):
        pytest.skip("needs root and a RoCE port with an IPv4 address (run under aiodat rxe run)")
    name = netdev.read_text().strip()
    shown_addrs = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", name], capture_output=True, text=True,
                                 check=True).stdout.split()
    ours = ipaddress.ip_interface(next(word for word in shown_addrs if word.startswith(ia.address + "/")))
    absent = next(host for host in reversed(list(ours.network.hosts())) if host != ours.ip)
    return name, str(absent)


@pytest.mark.rxe
async def test_a_resolution_the_cm_times_out_raises_the_cms_error(ia: Any, loop_errors: List[dict]) -> None:
    """rdma_cm's own timeout (no ARP reply: RDMA_CM_EVENT_ADDR_ERROR, ETIMEDOUT) comes out as it is,
    a TimeoutExpired naming the event.  It was taken for the caller's timeout expiring, being a
    TimeoutError too: "no answer within Nones" with no timeout, "within 30.0s" after 2 s."""
    import subprocess

    netdev, absent = _absent_neighbour(ia)
    ep = ia.create_ep(ia.create_pz(), attrs=UD)
    routes = _routes(ia)
    from pathlib import Path

    noarp = int(Path(f"/sys/class/net/{netdev}/flags").read_text(), 16) & 0x80  # IFF_NOARP
    subprocess.run(["ip", "link", "set", "dev", netdev, "arp", "on"], check=True)
    try:
        for timeout in (None, T):
            with pytest.raises(aiodat.TimeoutExpired) as info:
                await ep.resolve_datagram(absent, 4791, timeout=timeout)
            assert "timed out (RDMA_CM_EVENT_ADDR_ERROR)" in str(info.value), str(info.value)
    finally:
        subprocess.run(["ip", "neigh", "flush", "dev", netdev], check=False)
        if noarp:
            subprocess.run(["ip", "link", "set", "dev", netdev, "arp", "off"], check=True)
    await asyncio.sleep(0.1)
    assert _routes(ia) == routes and not list(ep._children)


@pytest.mark.rxe
async def test_datagram_calls_from_another_loop_are_refused_before_anything_starts(
        ia: Any, loop_errors: List[dict]) -> None:
    """resolve_datagram and join_multicast in another thread's loop raise InvalidState (the IA belongs
    to this loop) before the resolution or join starts.  They used to raise after rdma_resolve_addr:
    the resolution ran on regardless (an AddressHandle nobody had, the answer set from this loop's
    thread on the other loop's future), and the half-made MulticastGroup was left to the collector."""
    from aiodat.datagram import AddressHandle

    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    psp = ep.serve_datagram(0)  # this loop watches the IA's rdma_cm channel from here on
    await ep.resolve_datagram(ia.address, psp.port, timeout=T)
    routes, handles, requests = _routes(ia), _kinds(pz, AddressHandle), psp.requests
    outcomes = await in_another_loop([
        ("resolve_datagram", lambda: ep.resolve_datagram(ia.address, psp.port, timeout=T)),
        ("join_multicast", lambda: ep.join_multicast("239.1.2.5", timeout=T))], 4 * T)
    await asyncio.sleep(1.0)  # a resolution started anyway would have its answer by now
    seen = ([(name, repr(exc)[:80]) for name, exc in outcomes], _routes(ia) - routes,
            _kinds(pz, AddressHandle) - handles, psp.requests - requests, list(ep._children))
    assert [name for name, _ in outcomes] == ["resolve_datagram", "join_multicast"], seen
    assert all(isinstance(exc, aiodat.InvalidState) for _, exc in outcomes), seen
    assert _routes(ia) == routes and _kinds(pz, AddressHandle) == handles, seen
    assert psp.requests == requests and not list(ep._children), seen


@pytest.mark.rxe
async def test_numbers_no_repr_can_show_in_datagram_calls(ia: Any, loop_errors: List[dict]) -> None:
    """serve_datagram / resolve_datagram with a port, and post_send_to with imm_data, too long for
    repr() raise InvalidParameter naming it (they raised ValueError); nothing is posted."""
    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    psp = ep.serve_datagram(0)
    with pytest.raises(aiodat.InvalidParameter, match=f"port must be .* got {HUGE_WORDS}"):
        ep.serve_datagram(HUGE)
    with pytest.raises(aiodat.InvalidParameter, match=f"port must be .* got {HUGE_WORDS}"):
        await ep.resolve_datagram(ia.address, HUGE, timeout=T)
    ah = await ep.resolve_datagram(ia.address, psp.port, timeout=T)
    lmr = pz.register(bytearray(64))
    with pytest.raises(aiodat.InvalidParameter, match=f"imm_data must be .* got {HUGE_WORDS}"):
        ep.post_send_to(lmr[0:8], ah, imm_data=HUGE)
    assert ep.query().outstanding_requests == 0 and lmr._inflight == 0


@pytest.mark.rxe
async def test_a_dropped_multicast_group_stays_joined_and_its_ep_closes(ia: Any, loop_errors: List[dict]) -> None:
    """A joined MulticastGroup the program drops stays joined, held by its EP, as a PSP is held by
    its IA, until the EP closes, which leaves the group and destroys the QP.  A dropped group used
    to leave its QP attached (ibv_attach_mcast) with nothing to detach it: destroying the QP then
    failed with EBUSY, and the retry of that failed destruction after the IA had closed its device
    context crashed the interpreter."""
    import aiodat._handle as handle
    from aiodat.datagram import MulticastGroup

    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    group = await ep.join_multicast("239.1.2.6", timeout=T)
    assert group.joined
    del group
    gc.collect()
    held = [child for child in ep._children if isinstance(child, MulticastGroup)]
    joined = [g.joined for g in held]
    before = list(handle._deferred)
    ep.close()
    failed = [raw for raw in handle._deferred if raw not in before]
    for raw in failed:  # (the old code: leave nothing for the IA's close to crash on)
        handle._deferred.remove(raw)
        raw.ptr, raw._deps = aiodat._lib.ffi.NULL, ()
    assert not failed, [raw.what for raw in failed]
    assert joined == [True]  # held by the EP, joined, until the EP closed
    assert ep.closed and not held[0].joined and held[0].closed
    # a new EP joins the same group
    other = ia.create_ep(pz, attrs=UD)
    again = await other.join_multicast("239.1.2.6", timeout=T)
    assert again.joined
    await other.leave_multicast(again)
    assert again.closed and not list(other._children)
    other.close()


# ---------------------------------------------------------------- lifetimes (no device)


def test_an_object_a_failed_destruction_still_needs_is_kept() -> None:
    """When destroying a verbs object fails (a QP the device holds: EBUSY), it is kept and tried
    again later; what it depends on must then be kept too, until it is gone.  The IA's close used to
    free the device context regardless, and the retry that followed destroyed the QP on freed
    memory: a segmentation fault (reached by a dropped multicast group, test above)."""
    import errno

    import aiodat._handle as handle
    from aiodat._handle import Raw
    from aiodat._lib import ffi

    calls: List[str] = []
    busy = [True]
    context = Raw(ffi.new("int *"), lambda _: calls.append("context") or 0, "context")
    cq = Raw(ffi.new("int *"), lambda _: calls.append("cq") or 0, "cq", context)
    qp = Raw(ffi.new("int *"), lambda _: calls.append("qp") or (errno.EBUSY if busy[0] else 0), "qp", cq)
    try:
        assert qp.release() == errno.EBUSY
        assert cq.release() == errno.EBUSY and context.release() == errno.EBUSY
        assert "cq" not in calls and "context" not in calls, calls
        busy[0] = False  # the device lets go: the next retry destroys all three, children first
        gc.collect()
        assert calls[-3:] == ["qp", "cq", "context"], calls
        assert not any(raw in handle._deferred for raw in (qp, cq, context))
    finally:
        for raw in (qp, cq, context):
            if raw in handle._deferred:
                handle._deferred.remove(raw)
            raw.ptr, raw._deps = ffi.NULL, ()


def test_what_a_failed_destruction_holds_is_released_when_the_object_goes() -> None:
    """A Raw's ``then`` (an SRQ's: release the LMR counts of the receives still posted on it) runs
    once the object is really destroyed: not when its destruction fails (the device still holds it
    and what was posted on it), but by the retry that destroys it, and only once."""
    import errno

    import aiodat._handle as handle
    from aiodat._handle import Raw
    from aiodat._lib import ffi

    released: List[str] = []
    busy = [True]
    srq = Raw(ffi.new("int *"), lambda _: errno.EBUSY if busy[0] else 0, "srq")
    srq.then = lambda: released.append("counts")
    try:
        assert srq.release() == errno.EBUSY and srq in handle._deferred
        assert released == []  # the device still holds the buffers
        gc.collect()  # a retry that fails again releases nothing either
        assert released == [] and srq in handle._deferred
        busy[0] = False
        gc.collect()  # the retry that destroys it releases them
        assert released == ["counts"] and srq not in handle._deferred and srq.ptr == ffi.NULL
        assert srq.release() == 0 and released == ["counts"]
        plain = Raw(ffi.new("int *"), lambda _: 0, "srq")
        plain.then = lambda: released.append("at once")
        assert plain.release() == 0 and released == ["counts", "at once"]  # destroyed at once: released at once
    finally:
        if srq in handle._deferred:
            handle._deferred.remove(srq)
        srq.ptr, srq._deps, srq.then = ffi.NULL, (), None


@pytest.mark.rxe
async def test_imm_data_no_repr_can_show_is_invalid_parameter_on_every_post(ia: Any, loop_errors: List[dict]) -> None:
    """post_send and post_rdma_write with an imm_data too long for repr() raise InvalidParameter naming it
    by its size (they raised ValueError while building the message, as post_send_to did); nothing is
    posted."""
    pz = ia.create_pz()
    ep = ia.create_ep(pz)
    lmr = pz.register(bytearray(64))
    region = aiodat.RemoteRegion(lmr.address, lmr.length, lmr.rmr_context)  # (no remote privilege: remote() refuses)
    with pytest.raises(aiodat.InvalidParameter, match=f"imm_data must be .* got {HUGE_WORDS}"):
        ep.post_send(lmr[0:8], imm_data=HUGE)
    with pytest.raises(aiodat.InvalidParameter, match=f"imm_data must be .* got {HUGE_WORDS}"):
        ep.post_rdma_write(lmr[0:8], region[0:8], imm_data=HUGE)
    with pytest.raises(aiodat.InvalidParameter, match="imm_data must be .* got -1"):
        ep.post_send(lmr[0:8], imm_data=-1)
    assert ep.query().outstanding_requests == 0 and lmr._inflight == 0


@pytest.mark.rxe
async def test_a_closed_datagram_ep_frees_its_grh_scratch_and_answers_no_more(ia: Any, loop_errors: List[dict]) -> None:
    """post_recv_datagram's scratch LMR for GRHs is freed with its EP (it stayed registered until the EP
    object was collected or its PZ closed), and max_message_size on a closed EP raises InvalidHandle
    (it returned the port's MTU)."""
    from aiodat.datagram import max_message_size

    pz = ia.create_pz()
    ep = ia.create_ep(pz, attrs=UD)
    lmr = pz.register(bytearray(256))
    assert max_message_size(ep) >= 256
    ep.post_recv_datagram(lmr[0:128], "r")
    grh = ep._grh_lmr
    assert not grh.closed
    ep.close()
    assert grh.closed and lmr._inflight == 0 and not lmr.closed
    with pytest.raises(aiodat.InvalidHandle):
        max_message_size(ep)


@pytest.mark.rxe
async def test_a_failed_completion_whose_cookie_no_repr_can_show_is_delivered(ep_pair: Any,
                                                                               loop_errors: List[dict]) -> None:
    """A request that fails with a cookie repr() cannot show (an int of more than 4300 digits) still
    gives its event and breaks the connection; the message names the cookie by its size.  Building
    the message used to raise ValueError, which took the event with it and left the EP CONNECTED."""
    from aiodat import EPState, EventType
    from aiodat.memory import RemoteRegion

    pair = ep_pair
    good = pair.server_lmr.remote()
    wrong = RemoteRegion(good.address, 8, good.rmr_context ^ 0x5A5A5A00)
    cookie = 10 ** 5000
    pair.client.post_rdma_write(pair.client_lmr[0:8], wrong, cookie=cookie)
    event = await pair.client.request_evd.wait_one(timeout=T)
    assert event.cookie == cookie and not event.ok
    with pytest.raises(aiodat.DTOError, match="cookie an int of 16610 bits failed"):
        event.raise_for_status()
    broken = await pair.client.connect_evd.wait_one(timeout=T)
    assert broken.type is EventType.CONNECTION_EVENT_BROKEN
    assert pair.client.state is not EPState.CONNECTED


@pytest.mark.rxe
async def test_posts_of_the_wrong_kind_are_refused_before_anything_is_posted(ep_pair: Any,
                                                                             loop_errors: List[dict]) -> None:
    """A batch that is not an iterable, receive flags out of range or with SUPPRESS, and an empty
    batch on a freed EP are each an aiodat error naming what is wrong; nothing is posted."""
    from aiodat import CompletionFlags

    pair = ep_pair
    ep, lmr = pair.client, pair.client_lmr
    for batch in (ep.post_rdma_write_batch, ep.post_rdma_read_batch):
        with pytest.raises(aiodat.InvalidParameter, match="iterable"):
            batch(5)  # type: ignore[arg-type]
    for flags in (CompletionFlags.SUPPRESS, -1, 1 << 80, 16):
        with pytest.raises(aiodat.InvalidParameter, match="flags"):
            ep.post_recv(lmr[0:8], flags=flags)
    assert not ep._recv_q and lmr._inflight == 0
    ep.free()
    for batch in (ep.post_send_batch, ep.post_rdma_write_batch, ep.post_rdma_read_batch):
        with pytest.raises(aiodat.InvalidHandle):
            batch([])


@pytest.mark.rxe
async def test_an_lmr_whose_view_the_program_still_exports_is_freed(ia: Any, loop_errors: List[dict]) -> None:
    """free() deregisters an LMR while the program holds an export of its memoryview() (a view of
    it, a numpy array); that export stays usable.  It used to raise a bare BufferError after the
    deregistration, from free() and from the PZ's or IA's close."""
    from cffi import FFI

    ffi = FFI()
    pz = ia.create_pz()
    lmr = pz.register(bytearray(b"abcdefgh"))
    held = ffi.from_buffer(lmr.memoryview())  # a C consumer's export of the view itself
    lmr.free()
    assert lmr.closed and ffi.buffer(held)[:4] == b"abcd"
    pz.free()


@pytest.mark.rxe
async def test_the_device_writes_only_into_an_lmr_with_local_write(ep_pair: Any, loop_errors: List[dict]) -> None:
    """A receive, an RDMA read or an atomic into an LMR registered without local write is refused
    with PrivilegesViolation before anything is posted, on every path (C and general, one and
    batch, EP and SRQ).  The device used to fail it with a local protection error, and the
    connection with it."""
    from aiodat import CompletionFlags

    pair = ep_pair
    ep = pair.client
    ro = pair.pz.register(bytearray(64), Privileges.REMOTE_READ)  # the device may only read it
    remote = pair.server_lmr.remote()
    srq = pair.ia.create_srq(pair.pz, 8)
    calls = [
        lambda: ep.post_recv(ro[0:8]),  # (C)
        lambda: ep.post_recv(ro[0:8], flags=CompletionFlags.UNSIGNALLED),  # (the general path)
        lambda: ep.post_recv_batch([(ro[0:8], 1), (ro[8:16], 2)]),  # (C, one segment each)
        lambda: ep.post_recv_batch([(ro[0:8], 1), (ro[0:8], 2)]),  # (the same segment)
        lambda: ep.post_recv_batch(iter([(ro[0:8], 1)])),  # (the general path)
        lambda: ep.post_rdma_read(ro[0:8], remote),
        lambda: ep.post_rdma_read_batch([(ro[0:8], remote, 1), (ro[8:16], remote, 2)]),
        lambda: ep.post_rdma_read_batch([(ro[0:8], remote, 1), (ro[0:8], remote, 2)]),
        lambda: ep.post_fetch_add(ro[0:8], remote, 1),
        lambda: srq.post_recv(ro[0:8]),
        lambda: srq.post_recv_batch([(ro[0:8], 1), (ro[8:16], 2)]),
    ]
    for call in calls:
        with pytest.raises(aiodat.PrivilegesViolation, match="LOCAL_WRITE"):
            call()
    assert not ep._recv_q and not ep._send_q and ro._inflight == 0 and srq.query().outstanding_dto_count == 0
    assert ep.state is aiodat.EPState.CONNECTED
    srq.free()


@pytest.mark.rxe
async def test_an_lmr_closed_while_a_batch_reads_its_items_is_invalid_handle(ep_pair: Any,
                                                                             loop_errors: List[dict]) -> None:
    """The program's code run while an EP's batch reads its items (a generator, a segments iterable)
    closes the LMR of an item read before: InvalidHandle, nothing posted or counted, on every batch
    that reads its items one by one.  That item's LMR was checked when it was read, and its request
    went with the closed LMR's address and lkey: an 8-byte write, inlined, was copied from the buffer
    the closed LMR no longer held (it could have been freed) and completed successfully."""
    pair = ep_pair
    ep, remote = pair.client, pair.server_lmr.remote()

    def lmrs() -> Tuple[Any, Any]:
        return pair.pz.register(bytearray(64), Privileges.ALL), pair.pz.register(bytearray(64), Privileges.ALL)

    def items(a: Any, b: Any) -> Any:
        yield a[0:8], remote[0:8], "a"
        a.close()
        yield b[0:8], remote[8:16], "b"

    class Closing:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

        def __iter__(self) -> Any:
            self.a.close()
            return iter([self.b[0:8]])

    for post in (lambda a, b: ep.post_rdma_write_batch(items(a, b)),
                 lambda a, b: ep.post_rdma_read_batch(items(a, b)),
                 lambda a, b: ep.post_send_batch([(a[0:8], "a"), (Closing(a, b), "b")])):
        a, b = lmrs()
        with pytest.raises(aiodat.InvalidHandle, match="lmr is closed"):
            post(a, b)
        assert a.closed and not ep._send_q and a._inflight == 0 and b._inflight == 0
        b.free()
    assert ep.state is aiodat.EPState.CONNECTED
    a, b = lmrs()
    a.memoryview()[0:4] = b"good"
    ep.post_rdma_write_batch(iter([(a[0:4], remote[0:4], "ok")]))
    assert (await ep.request_evd.wait_one(timeout=T)).ok and bytes(pair.server_lmr.memoryview()[0:4]) == b"good"
