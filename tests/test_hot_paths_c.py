"""The hot paths in C (aiodat/_shim/completions.c and posts.c) against the Python they mirror.

Host-only: the C common case of turning completions into events against wr.py's
``_completion_event``: the same completions, read from a real ``struct aiodat_wc`` array, must
give equal events, queues and in-flight counts, and C must stop, changing nothing, at the first
completion that is not its case.  On rxe: a ping-pong's completions and posts take the C paths,
and the posts record what post.py's general path records.  The rest of the suite runs through
both paths too."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import weakref
from collections import deque
from types import SimpleNamespace
from typing import Any, AsyncIterator, List, Tuple

import pytest

import aiodat.post
from aiodat import CompletionFlags, DTOOp, QueueFull
from aiodat._lib import ffi
from aiodat._shim import _completions
from aiodat.evd import _NOT_TAKEN, EVD
from aiodat.wr import DrainMarker, SendRun, WorkRequests

IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM = 0, 1, 128, 129


class LMR:
    def __init__(self) -> None:
        self._inflight = 0


class Seg:
    def __init__(self, lmr: LMR, length: int) -> None:
        self.lmr, self.length = lmr, length


class EP(WorkRequests):
    _srq = None
    _rc = True

    def __init__(self, ud: bool = False) -> None:
        self._ud = ud
        self._init_tracking()
        self.errors: List[str] = []

    def _on_async_error(self, why: str) -> None:
        self.errors.append(why)


def wc_array(rows: List[Tuple[Any, ...]]) -> Any:
    """struct aiodat_wc[] of (wr_id, status, opcode, byte_len, qp_num, imm or None, src_qp, vendor_err)."""
    wcs = ffi.new("struct aiodat_wc[]", max(1, len(rows)))
    for wc, (wr_id, status, opcode, byte_len, qpn, imm, src_qp, vendor_err) in zip(wcs, rows):
        wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num = wr_id, status, opcode, byte_len, qpn
        wc.imm_data, wc.wc_flags = imm or 0, 0 if imm is None else 2
        wc.src_qp, wc.vendor_err = src_qp, vendor_err
    return wcs


def completion_failing_at(testcapi: Any, n: int, ep: Any, wc: Any, evd: Any) -> Tuple[bool, Any]:
    """``ep._completion_event(wc, evd)`` with its ``n``-th allocation failing: (raised, its event)."""
    testcapi.set_nomemory(n, n + 1)
    try:
        event = ep._completion_event(wc, evd)
    except (MemoryError, SystemError):  # (3.11 reports a frame it could not allocate as SystemError)
        return True, None
    finally:
        testcapi.remove_mem_hooks()
    return False, event  # (made with the hooks gone)


def as_tuple(wc: Any) -> Tuple[int, ...]:
    """A wc as evd.py's _WC struct reads it."""
    return (wc.wr_id, wc.status, wc.opcode, wc.vendor_err, wc.byte_len, wc.imm_data, wc.qp_num, wc.src_qp,
            wc.wc_flags, wc.slid, wc.sl)


def world() -> Tuple[Any, ...]:
    """Two identical fake worlds (an EP per QPN 7 and 8, one LMR each), one for C and one for Python."""
    worlds = []
    for _ in range(2):
        lmr_a, lmr_b = LMR(), LMR()
        ep_a, ep_b = EP(), EP(ud=True)
        for ep, lmr in ((ep_a, lmr_a), (ep_b, lmr_b)):
            for i in range(4):
                ep._recv_q.append((2 * i + 1, f"r{i}", (Seg(lmr, 256),)))
                ep._send_q.append((2 * i, f"s{i}", DTOOp.SEND, (Seg(lmr, 10), Seg(lmr, 20)), None))
                lmr._inflight += 3
        refs = {7: weakref.ref(ep_a), 8: weakref.ref(ep_b)}
        worlds.append((ep_a, ep_b, lmr_a, lmr_b, refs))
    return tuple(worlds)


def python_events(rows: List[Tuple[Any, ...]], refs: dict, evd: Any) -> deque:
    queue: deque = deque()
    for wc in wc_array(rows)[0:len(rows)]:
        ep = refs[wc.qp_num]() if wc.qp_num in refs else None
        if ep is not None:
            event = ep._completion_event(as_tuple(wc), evd)
            if event is not None:
                queue.append(event)
    return queue


def run_c(rows: List[Tuple[Any, ...]], refs: dict, evd: Any) -> Tuple[int, bool, deque]:
    wcs = wc_array(rows)
    queue: deque = deque()
    taken, notified = _completions.queue_common(evd, int(ffi.cast("uintptr_t", wcs)), len(rows), refs, queue)
    return taken, bool(notified), queue


def events_equal_ignoring_world(a: Any, b: Any) -> None:
    """Fields of two events made in the two worlds (their ep differs by construction)."""
    assert type(a) is type(b)
    for name in ("type", "cookie", "status", "transferred_length", "operation", "imm_data", "vendor_err",
                 "src_qp", "notify"):
        assert getattr(a, name) == getattr(b, name), name


def both_paths(rows: List[Tuple[Any, ...]], c_world: Tuple[Any, ...], py_world: Tuple[Any, ...],
               evd: Any = None) -> Tuple[int, bool, deque]:
    """Turn ``rows`` into events in C (in ``c_world``) and in wr.py (in ``py_world``), check that both
    gave the same events, and return C's (taken, notified, queue)."""
    evd = object() if evd is None else evd
    taken, notified, c_queue = run_c(rows, c_world[4], evd)
    py_queue = python_events(rows, py_world[4], evd)
    assert len(c_queue) == len(py_queue)
    for a, b in zip(c_queue, py_queue):
        events_equal_ignoring_world(a, b)
    return taken, notified, c_queue


def test_receives_and_sends_give_the_python_events() -> None:
    c_world, py_world = world()
    evd = object()
    rows = [(1, 0, IBV_WC_RECV, 64, 7, None, 0, 0),
            (0, 0, IBV_WC_SEND, 0, 7, None, 0, 0),
            (3, 0, IBV_WC_RECV_RDMA_WITH_IMM, 0, 7, 0xDEADBEEF, 0, 0),
            (1, 0, IBV_WC_RECV, 100, 8, 5, 77, 0),    # UD: src_qp
            (5, 0, IBV_WC_RECV, 1, 99, None, 0, 0)]   # a QP nobody owns: no event
    taken, notified, c_queue = both_paths(rows, c_world, py_world, evd)
    assert (taken, notified) == (5, True)
    assert len(c_queue) == 4
    assert [e.transferred_length for e in c_queue] == [64, 30, 0, 100]
    assert [e.imm_data for e in c_queue] == [None, None, 0xDEADBEEF, 5]
    assert [e.src_qp for e in c_queue] == [None, None, None, 77]
    assert c_queue[2].operation is DTOOp.RECV_RDMA_WRITE_IMM and c_queue[1].operation is DTOOp.SEND
    assert c_world[2]._inflight == py_world[2]._inflight == 12 - 1 - 2 - 1
    assert [e[0] for e in c_world[0]._recv_q] == [5, 7] and [e[0] for e in c_world[0]._send_q] == [2, 4, 6]
    assert c_queue[0].evd is evd
    with pytest.raises(Exception):  # frozen, as the Python-made events are
        c_queue[0].cookie = "x"  # type: ignore[misc]


@pytest.mark.parametrize("first", [10, 12])
def test_a_runs_last_completion_gives_the_python_event(first: int) -> None:
    """A batch recorded as one entry (wr.SendRun, wr_ids 10..16; at 12 after a completion inside
    it): its last completion takes the whole entry in C, as wr.py's _take_from_run does."""
    c_world, py_world = world()
    for ep, lmr in ((c_world[0], c_world[2]), (py_world[0], py_world[2])):
        ep._send_q.clear()
        ep._send_q.append((first, ("c10", "c12", "c14", "c16"), DTOOp.RDMA_WRITE, (Seg(lmr, 8),), SendRun(10, 16)))
        ep._send_q.append((18, "after", DTOOp.SEND, (Seg(lmr, 8),), None))
        lmr._inflight = 100
    taken, notified, c_queue = both_paths([(16, 0, IBV_WC_RDMA_WRITE, 0, 7, None, 0, 0)], c_world, py_world)
    assert (taken, notified) == (1, True) and len(c_queue) == 1
    assert c_queue[0].cookie == "c16" and c_queue[0].transferred_length == 8
    assert c_world[2]._inflight == py_world[2]._inflight == 100 - (16 - first) // 2 - 1
    assert [e[0] for e in c_world[0]._send_q] == [e[0] for e in py_world[0]._send_q] == [18]


@pytest.mark.parametrize("wr_id", [2, 6])
def test_suppressed_sends_before_a_signalled_one_are_retired_as_python_does(wr_id: int) -> None:
    """Selective signalling: the sends before the completed one were posted suppressed; C retires
    them with it (their LMRs released), as wr.py's _plan_send and _take do."""
    c_world, py_world = world()
    rows = [(wr_id, 0, IBV_WC_SEND, 0, 7, None, 0, 0), (1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)]
    taken, notified, c_queue = both_paths(rows, c_world, py_world)
    assert (taken, notified) == (2, True) and len(c_queue) == 2
    assert c_queue[0].cookie == f"s{wr_id // 2}" and c_queue[0].transferred_length == 30
    assert c_world[2]._inflight == py_world[2]._inflight == 12 - 2 * (wr_id // 2 + 1) - 1
    assert [e[0] for e in c_world[0]._send_q] == [e[0] for e in py_world[0]._send_q] == list(range(wr_id + 2, 8, 2))


def test_retired_sends_on_several_lmrs_release_each_lmr_as_python_does() -> None:
    """The suppressed sends C retires with a signalled one may be on several LMRs, in any order (a
    pool over two buffers, a request gathering from both): C counts them per run of one LMR, and
    every LMR ends where wr.py leaves it."""
    c_world, py_world = world()
    extras = []
    for ep, lmr in ((c_world[0], c_world[2]), (py_world[0], py_world[2])):
        other = LMR()
        other._inflight = 50
        lmr._inflight = 50
        ep._send_q.clear()
        layouts = [(lmr, other), (other,), (other, lmr, lmr), (lmr,), (other, other)]
        for i, lmrs in enumerate(layouts):
            ep._send_q.append((2 * i, f"s{i}", DTOOp.SEND, tuple(Seg(m, 10) for m in lmrs), None))
        extras.append(other)
    taken, notified, c_queue = both_paths([(8, 0, IBV_WC_SEND, 0, 7, None, 0, 0)], c_world, py_world)
    assert (taken, notified) == (1, True) and len(c_queue) == 1
    assert c_queue[0].cookie == "s4" and c_queue[0].transferred_length == 20
    assert c_world[2]._inflight == py_world[2]._inflight == 50 - 4
    assert extras[0]._inflight == extras[1]._inflight == 50 - 5
    assert not c_world[0]._send_q and not py_world[0]._send_q


@pytest.mark.parametrize("case", ["a run before", "a target before", "not in the queue", "unsignalled"])
def test_c_leaves_a_completion_after_anything_but_plain_suppressed_sends(case: str) -> None:
    """Before the completed send, a run, a request with a target, or a gap where its entry should
    be: C takes nothing and changes nothing (wr.py decides)."""
    c_world, _ = world()
    ep, lmr = c_world[0], c_world[2]
    wr_id = 4
    if case == "a run before":
        ep._send_q[1] = (2, ("a",), DTOOp.SEND, (Seg(lmr, 8),), SendRun(2, 2))
    elif case == "a target before":
        ep._send_q[0] = (0, None, DTOOp.RDMA_WRITE, (), DrainMarker(lambda status: None))
    elif case == "not in the queue":
        wr_id = 104  # beyond every entry
    else:
        ep._quiet.add(2)
    send_before, inflight = list(ep._send_q), lmr._inflight
    taken, _, c_queue = run_c([(wr_id, 0, IBV_WC_SEND, 0, 7, None, 0, 0)], c_world[4], object())
    assert taken == 0 and not c_queue
    assert list(ep._send_q) == send_before and lmr._inflight == inflight


@pytest.mark.parametrize("case", ["error", "unsignalled", "drain marker", "rdma read", "srq",
                                  "inside a run"])
def test_c_stops_changing_nothing_where_python_must_decide(case: str) -> None:
    c_world, py_world = world()
    rows = [(1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)]
    for ep, lmr in ((c_world[0], c_world[2]), (py_world[0], py_world[2])):
        if case == "unsignalled":
            ep._quiet.add(9)
        elif case == "drain marker":
            ep._send_q[0] = (0, None, DTOOp.RDMA_WRITE, (), DrainMarker(lambda status: None))
        elif case == "rdma read":
            ep._send_q[0] = (0, "c", DTOOp.RDMA_READ, (Seg(lmr, 8),), None)
        elif case == "srq":
            ep._recv_q.clear()
        elif case == "inside a run":
            ep._send_q[0] = (0, ("a", "b", "c"), DTOOp.SEND, (Seg(lmr, 8),), SendRun(0, 4))
    second = {"error": (3, 12, IBV_WC_RECV, 0, 7, None, 0, 1),
              "unsignalled": (3, 0, IBV_WC_RECV, 0, 7, None, 0, 0),
              "drain marker": (0, 0, IBV_WC_RDMA_WRITE, 0, 7, None, 0, 0),
              "rdma read": (0, 0, 2, 8, 7, None, 0, 0),
              "srq": (1, 0, IBV_WC_RECV, 0, 7, None, 0, 0),
              "inside a run": (2, 0, IBV_WC_SEND, 0, 7, None, 0, 0)}[case]  # not the run's last
    if case in ("unsignalled", "srq"):
        rows = [second]  # C takes nothing at all
    else:
        rows.append(second)
    recv_before = list(c_world[0]._recv_q)[len(rows) - 1:]
    send_before = list(c_world[0]._send_q)
    inflight = c_world[2]._inflight
    taken, _, c_queue = run_c(rows, c_world[4], object())
    assert taken == len(rows) - 1  # the last row is Python's
    assert len(c_queue) == taken
    if taken:  # what C took is exactly the first receive
        assert c_queue[0].cookie == "r0" and c_world[2]._inflight == inflight - 1
        assert list(c_world[0]._recv_q) == recv_before
    else:
        assert c_world[2]._inflight == inflight
    assert list(c_world[0]._send_q) == send_before


def test_configure_is_once_and_bad_arguments_are_refused() -> None:
    with pytest.raises(RuntimeError, match="configured once"):
        _completions.configure(object, 1, 2, 3, frozenset(), 0, 0)
    with pytest.raises(TypeError):
        _completions.queue_common(object(), 0, 0, "not a dict", deque())


def test_a_send_retiring_sends_on_many_lmrs_takes_the_c_path() -> None:
    """Selective signalling over a pool whose buffers are each their own LMR: the signalled send
    retires 20 suppressed ones on 20 LMRs, and C takes it, and the receive after it (C noted 8
    LMRs at most, and left such a completion, and the rest of its poll, to wr.py)."""
    c_world, py_world = world()
    pools = []
    for ep in (c_world[0], py_world[0]):
        pool = [LMR() for _ in range(21)]
        ep._send_q.clear()
        for i, lmr in enumerate(pool):
            ep._send_q.append((2 * i, f"s{i}", DTOOp.SEND, (Seg(lmr, 10),), None))
            lmr._inflight = 1
        pools.append(pool)
    rows = [(40, 0, IBV_WC_SEND, 0, 7, None, 0, 0), (1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)]
    taken, notified, c_queue = both_paths(rows, c_world, py_world)
    assert (taken, notified) == (2, True) and c_queue[0].cookie == "s20"
    assert [lmr._inflight for lmr in pools[0]] == [lmr._inflight for lmr in pools[1]] == [0] * 21
    assert not c_world[0]._send_q and not py_world[0]._send_q


# -- a completion is taken whole (host: fake EPs) ------------------------------------------------

class ReleasedCookie:
    """A cookie whose release runs a finalizer, as a caller's may: one that posts again (a request
    more on its LMR), or one that resets the EP (every entry retired)."""

    def __init__(self, ep: EP, lmr: LMR, resets: bool) -> None:
        self.ep, self.lmr, self.resets = ep, lmr, resets

    def __del__(self) -> None:
        if self.resets:
            self.ep._retire_all()
        else:
            self.lmr._inflight += 1


@pytest.mark.parametrize("resets", [False, True], ids=["posts", "resets"])
def test_a_finalizer_a_retired_entry_runs_finds_the_completion_taken(resets: bool) -> None:
    """A signalled send retires a suppressed one whose cookie goes with its entry: the cookie's
    finalizer runs once the completion is taken whole, in C and in wr.py (they set counts
    computed before it ran, over its post; a reset in the middle of the pops had the rest of the
    entries retired twice, the count short)."""
    c_world, py_world = world()
    for ep, lmr in ((c_world[0], c_world[2]), (py_world[0], py_world[2])):
        ep._send_q[0] = (0, ReleasedCookie(ep, lmr, resets), DTOOp.SEND, (Seg(lmr, 10), Seg(lmr, 20)), None)
    taken, _, c_queue = both_paths([(2, 0, IBV_WC_SEND, 0, 7, None, 0, 0)], c_world, py_world)
    assert taken == 1 and c_queue[0].cookie == "s1"
    for ep, lmr in ((c_world[0], c_world[2]), (py_world[0], py_world[2])):
        if resets:
            assert lmr._inflight == 0 and not ep._send_q and not ep._recv_q
        else:
            assert lmr._inflight == 12 - 4 + 1 and [e[0] for e in ep._send_q] == [4, 6]


class DrainingCookie:
    """A cookie whose finalizer drains its EVD, as an ``ep.reset()``, ``ep.close()`` or
    ``recv_query()`` of an EP on the same EVD does (EP._poll_completions)."""

    def __init__(self, evd: EVD) -> None:
        self.evd = evd

    def __del__(self) -> None:
        self.evd._drain_cq(rearm=False, arm_if_unarmed=False)


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_finalizer_that_drains_the_evd_takes_no_completion_twice(path: str) -> None:
    """A signalled send retires a suppressed one whose cookie's finalizer drains the same EVD
    while the polled completions are being taken: the drain leaves them to the take under way
    (it took the backlog again from its start, and queued duplicate events)."""
    ep, _, lmr, _, refs = world()[0]
    evd = EVD.__new__(EVD)
    wcs = wc_array([(2, 0, IBV_WC_SEND, 0, 7, None, 0, 0), (1, 0, IBV_WC_RECV, 64, 7, None, 0, 0),
                    (3, 0, IBV_WC_RECV, 64, 7, None, 0, 0)])
    evd._wcs, evd._wc_bytes, evd._wcs_address = wcs, ffi.buffer(wcs), int(ffi.cast("uintptr_t", wcs))
    evd._queue, evd._qpn_refs, evd._solicited_hit, evd._taking = deque(), refs, False, False
    evd._ia = type("IA", (), {"_qpn_owner": type("Owner", (), {"data": refs})})()
    ep._send_q[0] = (0, DrainingCookie(evd), DTOOp.SEND, (Seg(lmr, 10),), None)
    if path == "python":
        ep._quiet.add(99)  # an UNSIGNALLED mark: C leaves the EP to wr.py
    evd._backlog, evd._wc_next = 3, 0  # (as _drain_cq notes what it polled)
    assert evd._queue_polled(3)
    assert [e.cookie for e in evd._queue] == ["s1", "r0", "r1"]
    assert (evd._backlog, evd._wc_next, evd._taking) == (0, 0, False)


@contextlib.asynccontextmanager
async def _pair_on_one_evd(ia: Any, other: bool = False) -> AsyncIterator[SimpleNamespace]:
    """On rxe: a client EP (and, with ``other``, a second EP) taking its sends' and receives'
    completions on one EVD, connected to a server EP, with an LMR of 4 KiB; all closed after,
    in reverse."""
    from aiodat import EvdFlags, Privileges
    from aiodat.cm import connect_pair

    pz = ia.create_pz()
    handles: List[Any] = [pz]  # (closed in reverse)
    try:
        lmr = pz.register(bytearray(4096), Privileges.ALL)
        evd = ia.create_evd(16, EvdFlags.DTO)
        client = ia.create_ep(pz, recv_evd=evd, request_evd=evd)
        second = ia.create_ep(pz, recv_evd=evd, request_evd=evd) if other else None
        server = ia.create_ep(pz)
        handles += [evd, client] + ([second] if second is not None else []) + [server]
        psp = await connect_pair(client, server)
        handles += [psp, psp.cr_evd]
        yield SimpleNamespace(lmr=lmr, evd=evd, client=client, other=second, server=server)
    finally:
        for handle in reversed(handles):
            if not handle.closed:
                handle.close()


async def _retire_a_cookie_then_receive_two(client: Any, server: Any, lmr: Any, cookie: Any) -> None:
    """A suppressed send with ``cookie``, then a send "s1" (whose completion retires it), then two
    receives ("r", 0) and ("r", 1): all completed on the device, none taken from the client's EVD."""
    for i in range(2):
        server.post_recv(lmr[0:64], None)
        client.post_recv(lmr[64:128], ("r", i))
    client.post_send(lmr[0:8], cookie, CompletionFlags.SUPPRESS)
    del cookie  # (the client's queue holds the only reference: the take's retirement finalizes it)
    client.post_send(lmr[0:8], "s1")
    received = 0
    while received < 2:  # received: the client's sends completed
        received += len(await server.recv_evd.wait(timeout=5.0))
    for _ in range(2):
        server.post_send(lmr[128:136], None)
    sent = 0
    while sent < 2:  # (and so received by the client, after its sends completed)
        sent += len(await server.request_evd.wait(timeout=5.0))


@pytest.mark.rxe
@pytest.mark.parametrize("how", ["reset", "recv_query"])
async def test_a_finalizer_that_resets_an_ep_of_the_evd_takes_no_completion_twice(ia: Any, how: str) -> None:
    """On rxe: a suppressed send's cookie, retired by the next send's completion, resets (or
    queries) another EP on the same EVD from its finalizer, which drains that EVD while receives
    polled after the send wait in its backlog: each completion still gives one event (the nested
    drain took the backlog again from its start, and the take under way then gave the receives
    a second event, with no cookie)."""
    async with _pair_on_one_evd(ia, other=True) as pair:
        lmr, evd, client, other, server = pair.lmr, pair.evd, pair.client, pair.other, pair.server
        ran: List[str] = []

        class Cookie:
            def __del__(self) -> None:
                getattr(other, how)()
                ran.append(how)

        await _retire_a_cookie_then_receive_two(client, server, lmr, Cookie())
        cookies = []
        while (event := evd.dequeue()) is not None:  # (its drain in Python: _queue_polled)
            cookies.append(event.cookie)
        assert ran == [how] and cookies == ["s1", ("r", 0), ("r", 1)]
        assert lmr._inflight == 0


@pytest.mark.rxe
@pytest.mark.parametrize("taker", ["wait", "dequeue"])
async def test_a_finalizer_run_by_cs_take_dequeues_nothing(ia: Any, taker: str) -> None:
    """On rxe: a suppressed send's cookie, retired by the next send's completion in C's take
    (plain sends on one LMR: C's common case), dequeues from the same EVD in its finalizer.  The
    take is a wait's first look (C's look: C notes its take by the EVD's identity only, no
    _taking set) or a dequeue's drain (Python's _queue_polled, which sets _taking around C's
    take): the finalizer's dequeue returns None, and every completion still gives one event, in
    order (without the refusal it took the send's event, which C queues before its take, from
    under the wait)."""
    async with _pair_on_one_evd(ia) as pair:
        lmr, evd, client, server = pair.lmr, pair.evd, pair.client, pair.server
        seen: List[Any] = []

        class Cookie:
            def __del__(self) -> None:
                seen.append((_completions.taking(evd), evd.dequeue()))

        await _retire_a_cookie_then_receive_two(client, server, lmr, Cookie())
        cookies = [event.cookie for event in await evd.wait(timeout=5.0)] if taker == "wait" else []
        while (event := evd.dequeue()) is not None:
            cookies.append(event.cookie)
        assert seen == [(True, None)], "the finalizer ran outside C's take, or its dequeue took an event"
        assert cookies == ["s1", ("r", 0), ("r", 1)]
        assert evd.dequeue() is None and lmr._inflight == 0


TAKE_CASES = ["receive", "receive after a lost one", "send", "send retiring unsignalled ones", "a run's last",
              "inside a run", "an error", "a drain marker", "a failed drain marker"]


def taking(case: str) -> Tuple[Any, ...]:
    """QPN 7's EP of a world set up for ``case``, its LMR counted above 256 (a change of the count
    allocates): (ep, lmr, the completion, what the drain marker's callback was given)."""
    ep, _, lmr, _, _ = world()[0]
    lmr._inflight = 300
    calls: deque = deque()  # (its append allocates nothing: the deque has a block)
    wr_id, status, opcode = 0, 0, IBV_WC_SEND
    if case.startswith("receive"):
        wr_id, opcode = (1 if case == "receive" else 3), IBV_WC_RECV
    elif case == "send retiring unsignalled ones":
        wr_id = 4
        ep._quiet.update((0, 2))
    elif case in ("a run's last", "inside a run"):
        ep._send_q.clear()
        ep._send_q.append((0, ("c0", "c2", "c4"), DTOOp.SEND, (Seg(lmr, 8),), SendRun(0, 4)))
        ep._send_q.append((6, "s3", DTOOp.SEND, (Seg(lmr, 8),), None))
        wr_id = 4 if case == "a run's last" else 2
    elif case == "an error":
        status = 12
    elif case.endswith("drain marker"):
        ep._send_q[0] = (0, None, DTOOp.RDMA_WRITE, (), DrainMarker(calls.append))
        status, opcode = (12 if case == "a failed drain marker" else 0), IBV_WC_RDMA_WRITE
    wc = as_tuple(wc_array([(wr_id, status, opcode, 8, 7, None, 0, 0)])[0])
    return ep, lmr, wc, calls


def taken_state(ep: EP, lmr: LMR, calls: deque) -> Tuple[Any, ...]:
    """What taking a completion changes, comparable between two worlds."""
    return ([e[:2] for e in ep._send_q], [e[:2] for e in ep._recv_q], sorted(ep._quiet), lmr._inflight,
            list(calls))


@pytest.mark.parametrize("case", TAKE_CASES)
def test_a_completion_is_taken_whole_or_not_at_all_in_python(case: str) -> None:
    """wr.py's _completion_event with each of its allocations failing in turn: it raises with
    nothing changed, and taken again it gives the event and the state it gives unhindered (a list
    iterator made after the pops lost the cookie and left the count high; a drain marker whose
    error was reported after its entry was taken never completed)."""
    _testcapi = pytest.importorskip("_testcapi", reason="needs CPython's _testcapi (set_nomemory)")
    ep, lmr, wc, calls = taking(case)
    event = ep._completion_event(wc, object())
    expected = taken_state(ep, lmr, calls), None if event is None else (event.cookie, event.status)
    failures = 0
    for n in range(80):
        ep, lmr, wc, calls = taking(case)
        before = taken_state(ep, lmr, calls)
        raised, event = completion_failing_at(_testcapi, n, ep, wc, object())
        if raised:
            failures += 1
            assert taken_state(ep, lmr, calls) == before, f"allocation {n} failed with the completion part taken"
            event = ep._completion_event(wc, object())
        assert (taken_state(ep, lmr, calls), None if event is None else (event.cookie, event.status)) == expected
    assert failures and not raised, "the failures did not reach every allocation"


def binding() -> Tuple[Any, ...]:
    """QPN 7's EP of a world whose oldest send is a window's bind, a second bind of it pending
    after it: (ep, the window, the completion)."""
    from aiodat.memory import RMR, Privileges

    class Window(RMR):
        def __del__(self) -> None:  # (no handle to free)
            pass

    ep, _, lmr, _, _ = world()[0]
    rmr = Window.__new__(Window)
    rmr._pending, rmr._bound, rmr._rkey, rmr._mw = deque(), None, 0, SimpleNamespace(rkey=0)
    for rkey in (1001, 1002):
        rmr._pending.append((None, DTOOp.BIND, rkey, Seg(lmr, 8), Privileges.ALL))
    ep._send_q[0] = (0, "bind", DTOOp.BIND, (), rmr)
    return ep, rmr, as_tuple(wc_array([(0, 0, IBV_WC_SEND, 0, 7, None, 0, 0)])[0])


def test_a_binds_completion_is_taken_whole_or_not_at_all() -> None:
    """wr.py's _completion_event of a window's bind, with each of its allocations failing in
    turn: taken again, it gives the first bind's event and leaves the second bind pending (the
    take's allocations came after _bind_completed popped the first: the retry took the second)."""
    _testcapi = pytest.importorskip("_testcapi", reason="needs CPython's _testcapi (set_nomemory)")
    evd = type("EVD", (), {"_awaited": 0})()
    failures = 0
    for n in range(60):
        ep, rmr, wc = binding()
        raised, event = completion_failing_at(_testcapi, n, ep, wc, evd)
        if raised:
            failures += 1
            assert len(rmr._pending) == 2 and ep._send_q[0][0] == 0, f"allocation {n} failed part way"
            event = ep._completion_event(wc, evd)
        assert (event.cookie, event.rmr_context, rmr._rkey) == ("bind", 1001, 1001)
        assert [p[2] for p in rmr._pending] == [1002] and ep._send_q[0][0] == 2
    assert failures and not raised, "the failures did not reach every allocation"


def window_after_suppressed_sends(case: str) -> Tuple[Any, ...]:
    """An EP whose send queue holds three sends from LMR ``lmr`` posted suppressed, then a window's
    bind or unbind posted signalled: a bound window unbound (``unbind``), a bind that fails
    (``failed bind``), or a bind whose window was closed while it was pending (``closed``, its
    pending request forgotten).  (ep, window, lmr, the window's completion)."""
    from aiodat.memory import RMR, Privileges

    class Window(RMR):
        def __del__(self) -> None:  # (no handle to free)
            pass

    lmr = LMR()
    ep = EP()
    rmr = Window.__new__(Window)
    rmr._pending, rmr._bound, rmr._rkey, rmr._mw, rmr._ep = deque(), None, 0, SimpleNamespace(rkey=0), None
    for i in range(3):
        ep._send_q.append((2 * i, f"s{i}", DTOOp.SEND, (Seg(lmr, 8),), None))
        lmr._inflight += 1
    window = Seg(lmr, 64)
    lmr._windows = {rmr}  # type: ignore[attr-defined]
    lmr._inflight += 1  # the window's pin: its binding's, or its pending bind's
    if case == "unbind":
        rmr._bound = (window, Privileges.REMOTE_READ)
        rmr._pending.append((None, DTOOp.UNBIND, 5, None, Privileges.NONE))
        ep._send_q.append((6, "unbind", DTOOp.UNBIND, (), rmr))
    else:
        rmr._pending.append((None, DTOOp.BIND, 5, window, Privileges.REMOTE_READ))
        ep._send_q.append((6, "bind", DTOOp.BIND, (), rmr))
        if case == "closed":
            rmr._forget("closed")  # (as rmr.close() does: the pending bind's pin goes)
    status = 6 if case == "failed bind" else 0  # IBV_WC_MW_BIND_ERR
    return ep, rmr, lmr, as_tuple(wc_array([(6, status, IBV_WC_SEND, 0, 7, None, 0, 0)])[0])


@pytest.mark.parametrize("case", ["unbind", "failed bind", "closed"])
def test_a_window_completion_after_suppressed_sends_releases_all_of_them(case: str) -> None:
    """A window's bind or unbind completes after sends posted suppressed, which it retires: every
    count goes back to 0 and the send queue is empty (the window's own release was set after the
    take from a count read before it, which undid the retired sends' release: the LMR was never
    freeable; a completion whose window had been closed left its entry at the head of the queue,
    and C refused every later completion of the EP)."""
    ep, rmr, lmr, wc = window_after_suppressed_sends(case)
    evd = type("EVD", (), {"_awaited": 0})()
    event = ep._completion_event(wc, evd)
    assert lmr._inflight == 0
    assert not ep._send_q and not rmr._pending and rmr._bound is None
    if case == "closed":
        assert event is None
    else:
        assert event.cookie == case.split()[-1] and event.ok == (case == "unbind")
        assert not lmr._windows  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", ["unbind", "failed bind", "closed"])
def test_a_window_completion_after_suppressed_sends_is_taken_whole_or_not_at_all(case: str) -> None:
    """The same with each allocation failing in turn: raised, nothing changed (the counts, the
    send queue, the window's pending request and binding); taken again, all of it released."""
    _testcapi = pytest.importorskip("_testcapi", reason="needs CPython's _testcapi (set_nomemory)")
    evd = type("EVD", (), {"_awaited": 0})()
    failures = 0
    for n in range(80):
        ep, rmr, lmr, wc = window_after_suppressed_sends(case)
        before = (lmr._inflight, len(ep._send_q), len(rmr._pending), rmr._bound)
        raised, _ = completion_failing_at(_testcapi, n, ep, wc, evd)
        if raised:
            failures += 1
            assert (lmr._inflight, len(ep._send_q), len(rmr._pending), rmr._bound) == before, \
                f"allocation {n} failed part way"
            ep._completion_event(wc, evd)
        assert lmr._inflight == 0 and not ep._send_q and not rmr._pending and rmr._bound is None
    assert failures and not raised, "the failures did not reach every allocation"


class ResettingSeg(Seg):
    """A segment whose length, read once the completion's plan is made (for its event), runs
    Python that resets the EP first, as a finalizer a collection runs at any allocation may."""

    def __init__(self, lmr: LMR, length: int, ep: "EP") -> None:
        super().__init__(lmr, length)
        self.ep = ep

    @property  # type: ignore[override]
    def length(self) -> int:
        if self.ep is not None:
            ep, self.ep = self.ep, None
            ep._retire_all()
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value


class ResettingEP(EP):
    """An EP whose ``_ud``, read for a receive's event once its plan is made, resets it first."""

    armed = False

    @property  # type: ignore[override]
    def _ud(self) -> bool:
        if self.armed:
            self.armed = False
            self._retire_all()
        return False

    @_ud.setter
    def _ud(self, value: bool) -> None:
        pass


RESET_CASES = ["send", "send on two segments", "send retiring a suppressed one", "receive",
               "receive on two LMRs"]


def reset_while_taken(case: str) -> Tuple[Any, ...]:
    """An EP whose completion of ``case`` runs Python that resets the EP between its plan and its
    take: (ep, its LMR, the completion's row)."""
    ep = ResettingEP()
    lmr, other = LMR(), LMR()
    if case.startswith("send"):
        if case == "send retiring a suppressed one":
            ep._send_q.append((0, "s0", DTOOp.SEND, (Seg(lmr, 8),), None))
        segs: Tuple[Any, ...] = (ResettingSeg(lmr, 8, ep),)
        if case == "send on two segments":
            segs += (Seg(lmr, 8),)
        ep._send_q.append((2, "s1", DTOOp.SEND, segs, None))
        row = (2, 0, IBV_WC_SEND, 0, 7, None, 0, 0)
    else:
        segs = (Seg(lmr, 64),) + ((Seg(other, 64),) if case == "receive on two LMRs" else ())
        ep._recv_q.append((1, "r0", segs))
        ep.armed = True
        row = (1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)
    for entry in (*ep._send_q, *ep._recv_q):
        ep._track(entry[-2] if len(entry) == 5 else entry[2], 1)
    return ep, lmr, other, row


@pytest.mark.parametrize("path", ["python", "c"])
@pytest.mark.parametrize("case", RESET_CASES)
def test_a_reset_between_a_completions_plan_and_its_take_takes_nothing_twice(case: str, path: str) -> None:
    """Python run between a completion's plan and its take (a finalizer a collection runs at an
    allocation) resets the EP: the take finds its plan no longer holds, and the completion is
    worked out again: a send's entry is gone (no event), a receive's event has no cookie, and
    every count is 0 (wr.py popped an empty queue, IndexError, the count -1; C set the count to
    -1 and queued the event)."""
    ep, lmr, other, row = reset_while_taken(case)
    if path == "c":
        refs = {7: weakref.ref(ep)}
        taken, _, queue = run_c([row], refs, object())
        assert taken == 0 and not queue, "C took a completion whose plan no longer held"
        assert not ep._send_q and not ep._recv_q and lmr._inflight == 0  # (the reset ran in C's take)
    event = ep._completion_event(as_tuple(wc_array([row])[0]), object())
    assert (lmr._inflight, other._inflight) == (0, 0)
    assert not ep._send_q and not ep._recv_q
    if case.startswith("send"):
        assert event is None
    else:
        assert event.cookie is None and event.ok


def test_a_collection_between_a_completions_plan_and_its_take_takes_nothing_twice() -> None:
    """The same with a real collection: a finalizer that resets the EP, run by the first
    allocation of the completion's take (its event)."""
    import gc

    class Resetter:
        def __init__(self, ep: EP) -> None:
            self.ep, self.me = ep, self  # a cycle: only the collector frees it

        def __del__(self) -> None:
            self.ep._retire_all()

    lmr = LMR()
    ep = EP()
    ep._send_q.append((0, "s0", DTOOp.SEND, (Seg(lmr, 8),), None))
    lmr._inflight = 1
    wc = as_tuple(wc_array([(0, 0, IBV_WC_SEND, 8, 7, None, 0, 0)])[0])
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        Resetter(ep)
        gc.set_threshold(1)
        gc.enable()
        event = ep._completion_event(wc, object())
    finally:
        gc.set_threshold(*thresholds)
        if not enabled:
            gc.disable()
    assert event is None and lmr._inflight == 0 and not ep._send_q


WINDOW_CLOSE_CASES = ["bind", "failed bind", "unbind"]


@pytest.mark.parametrize("case", WINDOW_CLOSE_CASES)
def test_a_window_closed_between_its_completions_plan_and_its_take_is_released_once(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window's bind, failed bind or unbind completes after suppressed sends, and its event's
    allocation (RMRBindEvent) runs Python that closes the window first (a finalizer a collection
    runs may): the close released the pending request's segment (or the binding) and cleared the
    pending requests, so the take finds its plan no longer holds and the completion is worked out
    again as a closed window's: no event, every count 0 (memory.py planned from the pending request
    it had read: a failed bind's segment was released twice, the count -1, and the pop of the
    emptied pending requests raised IndexError after the take)."""
    import aiodat.memory as memory

    ep, rmr, lmr, wc = window_after_suppressed_sends("unbind" if case == "unbind" else "failed bind")
    if case == "bind":
        wc = (wc[0], 0, *wc[2:])  # (the bind succeeds)
    real = memory.RMRBindEvent
    closes: List[int] = []

    def closing(*args: Any, **kwargs: Any) -> Any:
        if not closes:
            closes.append(1)
            rmr._forget("closed")  # (as rmr.close() does)
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "RMRBindEvent", closing)
    evd = type("EVD", (), {"_awaited": 0})()
    event = ep._completion_event(wc, evd)
    assert closes and event is None
    assert lmr._inflight == 0
    assert not ep._send_q and not rmr._pending and rmr._bound is None


class ClosingSRQEP(EP):
    """An EP on an SRQ whose ``_ud``, read for a receive's event once its plan is made, closes the
    SRQ first (srq.py's _release_posted: every posted buffer released, the table cleared)."""

    armed = False

    @property  # type: ignore[override]
    def _ud(self) -> bool:
        if self.armed:
            self.armed = False
            from aiodat.srq import _release_posted

            _release_posted(self._srq._posted)
        return False

    @_ud.setter
    def _ud(self, value: bool) -> None:
        pass


def test_an_srq_closed_between_a_receives_plan_and_its_take_is_released_once() -> None:
    """A receive on an SRQ whose event's making runs Python that closes the SRQ (a finalizer a
    collection runs may): the close released every posted buffer and cleared the table, so the
    take finds the buffer it planned from gone and the completion is worked out again: the event
    has no cookie, every count is 0 (wr.py planned from the entry it had read: the buffer's count
    was lowered twice, -1, and the event carried the cookie of a buffer the close had released)."""
    lmr = LMR()
    ep = ClosingSRQEP()
    ep._srq = SimpleNamespace(_posted={1: ("r1", (Seg(lmr, 64),)), 3: ("r3", (Seg(lmr, 64),))},  # type: ignore[assignment]
                              _eps=[ep], _eps_seen=1)
    lmr._inflight = 2
    ep.armed = True
    event = ep._completion_event(as_tuple(wc_array([(1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)])[0]), object())
    assert not ep.armed, "the SRQ was not closed between the plan and the take"
    assert event.cookie is None and event.ok
    assert lmr._inflight == 0 and not ep._srq._posted


class SRQChangingQueue(deque):
    """An event queue whose first append runs Python that changes the SRQ (a deque's never does:
    this stands for a finalizer run by a collection, and reaches C's last check): it posts another
    receive (its count raised) or closes the SRQ (srq.py's _release_posted: every posted buffer
    released, the table cleared)."""

    def __init__(self, srq: Any, lmr: LMR, change: str) -> None:
        super().__init__()
        self.srq, self.lmr, self.change = srq, lmr, change

    def append(self, event: Any) -> None:
        change, self.change = self.change, None
        if change == "post":
            self.srq._posted[3] = ("c3", (Seg(self.lmr, 64),))
            self.lmr._inflight += 1
        elif change == "close":
            from aiodat.srq import _release_posted

            _release_posted(self.srq._posted)
        super().append(event)


@pytest.mark.parametrize("change", ["post", "close"])
def test_an_srq_changed_between_a_receives_plan_and_its_take_in_c(change: str) -> None:
    """completions.c's srq_event: the event's append (the last allocation) runs Python that posts
    on the SRQ or closes it.  C then finds its plan stale and takes nothing, and wr.py takes the
    completion: the count ends at what is still posted (C had set the count made before the post:
    0 with one receive posted)."""
    lmr = LMR()
    ep = EP()
    srq = SimpleNamespace(_posted={1: ("c1", (Seg(lmr, 64),))}, _eps=[ep], _eps_seen=1)
    ep._srq = srq  # type: ignore[assignment]
    lmr._inflight = 1
    rows = [(1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)]
    wcs = wc_array(rows)
    queue = SRQChangingQueue(srq, lmr, change)
    taken, _ = _completions.queue_common(object(), int(ffi.cast("uintptr_t", wcs)), 1, {7: weakref.ref(ep)}, queue)
    assert queue.change is None, "the SRQ was not changed between the plan and the take"
    assert taken == 0 and not queue
    queue.extend(python_events(rows, {7: weakref.ref(ep)}, object()))  # (Python's path takes the rest)
    assert [e.cookie for e in queue] == (["c1"] if change == "post" else [None])
    assert list(srq._posted) == ([3] if change == "post" else [])
    assert lmr._inflight == (1 if change == "post" else 0)


class RetryLoop:
    """What a callback EVD's _callback_failed uses of its loop, recording the retries it schedules."""

    def __init__(self) -> None:
        self.later: List[Any] = []
        self.soon: List[Any] = []

    def is_closed(self) -> bool:
        return False

    def call_later(self, delay: float, fn: Any) -> Any:
        self.later.append(fn)
        return SimpleNamespace(cancel=lambda: None)

    def call_soon(self, fn: Any) -> Any:
        self.soon.append(fn)


def test_a_callback_evd_keeps_one_backlog_retry_while_its_drains_fail() -> None:
    """A callback EVD whose drains fail (no MemoryError) with a backlog left schedules one retry
    after _BACKLOG_RETRY_S, not one per failure (each failure meanwhile, a wake-up's or a
    delivery's, added its own: they multiplied); once it is due, the next failure schedules
    another."""
    evd = EVD.__new__(EVD)
    loop, reported = RetryLoop(), []
    evd._callback_loop, evd._on_error, evd._backlog = loop, reported.append, 3
    evd._delivery_scheduled, evd._backlog_retry = False, None
    for _ in range(5):
        evd._callback_failed(RuntimeError("the drain failed"), "draining the CQ")
    assert len(reported) == 5 and len(loop.later) == 1
    loop.later.pop()()  # due: a delivery is scheduled, which drains again
    assert len(loop.soon) == 1
    evd._callback_failed(RuntimeError("the drain failed"), "draining the CQ")
    assert len(loop.later) == 1


class LookedAt:
    """What C's look reads of an EVD in its common case, noting whether it went on to read the
    CQ's address (past the test of the common case: it would poll)."""

    _closed = _awaited = _solicited = _armed_solicited = False
    _wcs_address, _qlen = 0, 4

    def __init__(self, taking: bool = False, backlog: int = 0) -> None:
        self._taking, self._backlog, self.read_cq = taking, backlog, False
        self._queue: deque = deque()

    @property
    def _cq_address(self) -> int:
        self.read_cq = True
        return 0  # (no CQ: nothing is polled either way)


class LookingCookie:
    """A cookie whose finalizer looks at its EVD, as a wait on it or an EP's reset would: C's
    look, and whether C says a take of it is under way."""

    def __init__(self, evd: Any, seen: List[Any]) -> None:
        self.evd, self.seen = evd, seen

    def __del__(self) -> None:
        self.seen.append((_completions.taking(self.evd), _completions.look(self.evd), self.evd.read_cq))


def test_c_leaves_the_cq_alone_while_a_take_is_under_way() -> None:
    """While polled completions are being taken (a finalizer their entries run, a cookie's, may
    wait on or look at the EVD), C's look is not the common case: it would poll the CQ into the
    array the take reads.  A take in Python has its backlog noted meanwhile (EVD._drain_cq before
    _queue_polled, _queue_backlog's own), which the look refuses; C notes its own takes itself,
    by the EVD's identity (_completions.taking), with no attribute to set and clear per take."""
    python_take = LookedAt(taking=True, backlog=3)
    assert _completions.look(python_take) == -1 and not python_take.read_cq, "C's look went on during a take"
    ep, _, lmr, _, refs = world()[0]
    evd, seen = LookedAt(), []
    ep._send_q[0] = (0, LookingCookie(evd, seen), DTOOp.SEND, (Seg(lmr, 10),), None)  # retired by send 2
    wcs = wc_array([(2, 0, IBV_WC_SEND, 0, 7, None, 0, 0), (1, 0, IBV_WC_RECV, 64, 7, None, 0, 0)])
    taken, _ = _completions.queue_common(evd, int(ffi.cast("uintptr_t", wcs)), 2, refs, evd._queue)
    assert taken == 2 and [e.cookie for e in evd._queue] == ["s1", "r0"]
    assert seen == [(True, -1, False)], "C's look went on during C's own take"
    assert not _completions.taking(evd) and evd._backlog == 0
    _completions.look(evd)
    assert evd.read_cq  # (the test reaches the CQ's address when no take is under way)


class PythonDrainsCookie:
    """A cookie whose finalizer drains its EVD the ways Python does (an EP's reset, a wait's pump):
    each must find C's take under way and leave the CQ and the backlog to it."""

    def __init__(self, evd: Any, seen: List[Any]) -> None:
        self.evd, self.seen = evd, seen

    def __del__(self) -> None:
        self.seen.extend(_refused(self.evd))


def _refused(evd: Any) -> List[Any]:
    """What EVD._drain_cq and EVD._queue_backlog answer for ``evd``, or the exception they raise
    on the fake EVD (past their refusal, they go on to read what it does not have)."""
    answers: List[Any] = []
    for step in (EVD._drain_cq, EVD._queue_backlog):
        try:
            answers.append(step(evd))  # type: ignore[arg-type]
        except AttributeError:
            answers.append(AttributeError)
    return answers


def test_pythons_drains_leave_the_cq_alone_while_c_takes() -> None:
    """A finalizer run by C's take (no _taking attribute set: C notes its takes by the EVD's
    identity) that drains the same EVD in Python is refused: a poll would write over the array C
    reads, and a backlog take would take the completions twice."""
    ep, _, lmr, _, refs = world()[0]
    evd, seen = LookedAt(), []
    evd._wcs = b""  # (a CQ's array: the drain's first test passes it)
    ep._send_q[0] = (0, PythonDrainsCookie(evd, seen), DTOOp.SEND, (Seg(lmr, 10),), None)  # retired by send 2
    wcs = wc_array([(2, 0, IBV_WC_SEND, 0, 7, None, 0, 0)])
    taken, _ = _completions.queue_common(evd, int(ffi.cast("uintptr_t", wcs)), 1, refs, evd._queue)
    assert taken == 1 and seen == [False, False], "a Python drain went on during C's take"
    assert _refused(evd) == [AttributeError, AttributeError]  # (no take under way: they go on)


class Breaks:
    """An EP whose completion breaks it (its BROKEN pushed on the EVD's queue, which takes
    connection events too), then fails, every allocation failing from there on."""

    _taken = _NOT_TAKEN

    def __init__(self, queue: deque, pushes: bool, testcapi: Any) -> None:
        self.queue, self.pushes, self.testcapi = queue, pushes, testcapi

    def _completion_event(self, wc: Any, evd: Any) -> Any:
        if self.pushes:
            self.queue.append("BROKEN")
        self.testcapi.set_nomemory(0)
        raise MemoryError


class QueueOneTaker:
    """What EVD._queue_one reads of its EVD."""

    _backlog, _wc_next, _solicited_hit = 1, 0, False


@pytest.mark.parametrize("pushes", [False, True], ids=["alone", "a BROKEN after it"])
def test_a_completions_place_is_taken_back_with_no_allocation(pushes: bool) -> None:
    """EVD._queue_one makes an event's place in the queue first; when the completion fails, the
    place is taken back with no allocation (in the handling of a MemoryError): the events around it
    stay, in order (a queue of 300: its length and the place's index are no small ints, and a
    deque's del rotates)."""
    _testcapi = pytest.importorskip("_testcapi", reason="needs CPython's _testcapi (set_nomemory)")

    queue: deque = deque(range(300))
    wc = as_tuple(wc_array([(1, 0, IBV_WC_RECV, 8, 7, None, 0, 0)])[0])
    try:
        with pytest.raises((MemoryError, SystemError)):
            EVD._queue_one(QueueOneTaker(), Breaks(queue, pushes, _testcapi), wc, queue)  # type: ignore[arg-type]
    finally:
        _testcapi.remove_mem_hooks()
    assert list(queue) == list(range(300)) + ["BROKEN"] * pushes


class Interrupt(BaseException):
    """What a signal handler raises (a KeyboardInterrupt, which would end pytest's run)."""


class GivesNoEvent:
    """An EP whose completion gives no event (a suppressed request's), its BROKEN pushed first."""

    _taken = _NOT_TAKEN

    def __init__(self, queue: deque, pushes: bool) -> None:
        self.queue, self.pushes = queue, pushes

    def _completion_event(self, wc: Any, evd: Any) -> None:
        if self.pushes:
            self.queue.append("BROKEN")
        return None


@pytest.mark.parametrize("pushes", [False, True], ids=["alone", "a BROKEN after it"])
def test_a_completion_with_no_event_takes_back_its_place_with_no_python_call(pushes: bool) -> None:
    """EVD._queue_one takes back the place it made for a completion that gives no event with no
    Python call: CPython looks for signals at a Python function's entry, and a KeyboardInterrupt
    raised there (by the helper that did this) left an empty place, None, in the queue for a wait
    to return.  A trace function raises at each Python call _queue_one makes after the
    completion's event was made, as a signal handler would."""
    queue: deque = deque(range(3))
    wc = as_tuple(wc_array([(1, 0, IBV_WC_SEND, 0, 7, None, 0, 0)])[0])
    made: List[bool] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_back is not None and frame.f_back.f_code is EVD._queue_one.__code__:
            if made:
                raise Interrupt
            made.append(frame.f_code.co_name == "_completion_event")
        return None

    sys.settrace(trace)
    try:
        notified = EVD._queue_one(QueueOneTaker(), GivesNoEvent(queue, pushes), wc, queue)  # type: ignore[arg-type]
    except Interrupt:
        notified = None
    finally:
        sys.settrace(None)
    assert made == [True]
    assert list(queue) == [0, 1, 2] + ["BROKEN"] * pushes and notified is False


def frame_local(exc: BaseException, function: Any, name: str) -> Any:
    """The local ``name`` of ``function``'s frame in ``exc``'s traceback, as it was left."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not function.__code__:
        tb = tb.tb_next
    assert tb is not None, f"{function.__name__} is not in the traceback"
    return tb.tb_frame.f_locals[name]


class InterruptedEvent:
    """An EP whose completion's event is interrupted before it is made (nothing taken)."""

    _taken = _NOT_TAKEN

    def _completion_event(self, wc: Any, evd: Any) -> None:
        raise Interrupt


def test_a_failure_queue_one_raises_is_not_held_by_its_frame() -> None:
    """_queue_one keeps a failure in a local to raise it after the queue is put right; the local is
    cleared as it goes up, else the exception's traceback holds the frame that holds the exception
    (a cycle only the collector frees, keeping the frame's queue and completion till then)."""
    queue: deque = deque(range(3))
    wc = as_tuple(wc_array([(1, 0, IBV_WC_SEND, 0, 7, None, 0, 0)])[0])
    with pytest.raises(Interrupt) as info:
        EVD._queue_one(QueueOneTaker(), InterruptedEvent(), wc, queue)  # type: ignore[arg-type]
    assert list(queue) == [0, 1, 2]
    assert frame_local(info.value, EVD._queue_one, "failure") is None


@pytest.mark.rxe
async def test_a_ping_pong_takes_the_c_path(ep_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On rxe: signalled sends and receives become events in C (Python's path sees none of them), with
    the cookies, lengths and immediate data the posts gave, and the LMRs free afterwards."""
    python_path: List[int] = []
    original = EVD._queue_one

    def counting(self: EVD, ep: Any, wc: Any, queue: Any) -> bool:
        python_path.append(wc[0])
        return original(self, ep, wc, queue)

    monkeypatch.setattr(EVD, "_queue_one", counting)
    pair = ep_pair
    c_recv, c_req, _ = pair.client_evds
    s_recv, _, _ = pair.server_evds
    for i in range(20):
        pair.server.post_recv(pair.server_lmr[0:64], ("recv", i))
        pair.client.post_send(pair.client_lmr[0:10 + i], ("send", i), imm_data=i if i % 2 else None)
        (got,) = await s_recv.wait()
        (sent,) = await c_req.wait()
        assert (got.cookie, got.transferred_length, got.imm_data) == (("recv", i), 10 + i, i if i % 2 else None)
        assert (sent.cookie, sent.transferred_length, sent.operation) == (("send", i), 10 + i, DTOOp.SEND)
        assert got.ep is pair.server and sent.ep is pair.client and got.evd is s_recv
    assert python_path == []
    # selective signalling: suppressed sends before a signalled one are retired in C with it, and free
    for _ in range(7):  # the sends below: four, then a run of two and one more
        pair.server.post_recv(pair.server_lmr[0:64])
    for _ in range(3):
        pair.client.post_send(pair.client_lmr[0:8], None, CompletionFlags.SUPPRESS)
    pair.client.post_send(pair.client_lmr[0:8], "last")
    assert [e.cookie for e in await c_req.wait()] == ["last"]
    assert python_path == [] and not pair.client._send_q
    assert pair.client_lmr._inflight == 0
    # a run before it (a batch whose requests are suppressed) is still wr.py's
    pair.client.post_send_batch([(pair.client_lmr[0:8], None)] * 2, CompletionFlags.SUPPRESS,
                                last_flags=CompletionFlags.SUPPRESS)
    pair.client.post_send(pair.client_lmr[0:8], "after the run")
    assert [e.cookie for e in await c_req.wait()] == ["after the run"]
    assert len(python_path) == 1 and not pair.client._send_q
    events: List[Any] = []
    while len(events) < 7:
        events += await s_recv.wait()
    pair.client_lmr.free()
    pair.server_lmr.free()  # nothing of either is in flight any more


@pytest.mark.rxe
async def test_hot_posts_record_what_the_general_path_records(ep_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """post_recv and post_send of one segment (bare or a list of one) go through posts.c: nothing of
    post.py's general path runs, and the queue entries, in-flight counts and UNSIGNALLED marks are the
    ones it would have made; a full receive queue is QueueFull, with nothing recorded."""
    pair = ep_pair
    client, server = pair.client, pair.server
    general = []

    def refused(*args: Any, **kwargs: Any) -> Any:
        general.append(args)
        raise AssertionError("the general path ran")

    monkeypatch.setattr(aiodat.post, "as_segments", refused)
    seg = pair.server_lmr[0:64]
    before = pair.server_lmr._inflight
    server.post_recv(seg, "r0")
    server.post_recv([pair.server_lmr[64:128]], "r1")
    (id0, cookie0, segs0), (id1, cookie1, segs1) = list(server._recv_q)[-2:]
    assert id0 % 2 == 1 and id1 == id0 + 2 and (cookie0, cookie1) == ("r0", "r1")
    assert segs0 == (seg,) and segs1[0].offset == 64
    assert pair.server_lmr._inflight == before + 2
    quiet = CompletionFlags.UNSIGNALLED
    client.post_send(pair.client_lmr[0:8], "s0", quiet)
    client.post_send([pair.client_lmr[8:16]], "s1")
    (sid0, c0, op0, s0, t0), (sid1, c1, op1, s1, t1) = list(client._send_q)[-2:]
    assert sid0 % 2 == 0 and sid1 == sid0 + 2 and (c0, c1) == ("s0", "s1") and op0 is op1 is DTOOp.SEND
    assert (t0, t1) == (None, None) and s0[0].length == 8 and client._quiet == {sid0}
    assert pair.client_lmr._inflight == 2
    assert not general
    events: List[Any] = []
    while len(events) < 2:
        events += await server.recv_evd.wait()
    assert [(e.cookie, e.transferred_length) for e in events] == [("r0", 8), ("r1", 8)]
    sent = await client.request_evd.wait(2)  # the UNSIGNALLED one comes with the next
    assert [e.cookie for e in sent] == ["s0", "s1"]
    assert pair.client_lmr._inflight == 0 and not client._quiet
    # the receive queue full: refused by the device, reported as post.py reports it, nothing recorded
    depth, posted = len(server._recv_q), 0
    with pytest.raises(QueueFull, match="post_recv: the queue is full"):
        for _ in range(4 * server.attrs.max_recv_dtos + 64):  # (the device may round the queue up)
            server.post_recv(seg)
            posted += 1
    assert posted >= server.attrs.max_recv_dtos - depth
    assert len(server._recv_q) == depth + posted
    assert pair.server_lmr._inflight == len(server._recv_q)
    assert not general


@pytest.mark.rxe
@pytest.mark.parametrize("mode", ["wait", "callback"])
async def test_the_pollers_look_and_hand_over_are_c(ep_pair: Any, monkeypatch: pytest.MonkeyPatch,
                                                    mode: str) -> None:
    """Once a one-loop ping-pong has settled into polling, the loop's poller finds each message and
    wakes the waiting task, or calls the callback, in C (_completions.turn), and each
    wait's look and hand-over to the poller are C too (_completions.wait_begin): C never leaves a
    look to Python (_poll_rest), a wait never runs EVD._poll, and Python's hand-over
    (_hand_over, _deliver, _wake, _napi_add) runs only around the odd arm."""
    pair = ep_pair
    recv = {pair.client.recv_evd, pair.server.recv_evd}
    python: List[str] = []
    for name in ("_poll_rest", "_hand_over", "_deliver", "_wake", "_poll", "_napi_add"):
        def spy(self: EVD, *args: Any, _name: str = name, _real: Any = getattr(EVD, name)) -> Any:
            if self in recv:
                python.append(_name)
            return _real(self, *args)
        monkeypatch.setattr(EVD, name, spy)
    quiet = CompletionFlags.SUPPRESS  # (no send completions: only the receive EVDs are in play)
    client, server = pair.client, pair.server
    rounds, warmup = 40, 10
    server.post_recv(pair.server_lmr[0:64])
    if mode == "wait":
        async def echo() -> None:
            for _ in range(rounds):
                (ev,) = await server.recv_evd.wait(timeout=10)
                server.post_recv(pair.server_lmr[0:64])
                server.post_send(pair.server_lmr[64:64 + ev.transferred_length], None, quiet)

        task = asyncio.ensure_future(echo())
        for i in range(rounds):
            if i == warmup:
                python.clear()
            client.post_recv(pair.client_lmr[0:64], i)
            client.post_send(pair.client_lmr[64:72], None, quiet)
            (ev,) = await client.recv_evd.wait(timeout=10)
            assert ev.ok and ev.cookie == i
        await asyncio.wait_for(task, 10)
    else:
        done = asyncio.get_running_loop().create_future()
        seen: List[int] = []

        def on_server(events: List[Any]) -> None:
            for ev in events:
                server.post_recv(pair.server_lmr[0:64])
                server.post_send(pair.server_lmr[64:72], None, quiet)

        def on_client(events: List[Any]) -> None:
            for ev in events:
                seen.append(ev.cookie)
                if len(seen) == warmup:
                    python.clear()
                if len(seen) == rounds:
                    done.set_result(None)
                else:
                    client.post_recv(pair.client_lmr[0:64], len(seen))
                    client.post_send(pair.client_lmr[64:72], None, quiet)

        server.recv_evd.set_callback(on_server)
        client.recv_evd.set_callback(on_client)
        client.post_recv(pair.client_lmr[0:64], 0)
        client.post_send(pair.client_lmr[64:72], None, quiet)
        await asyncio.wait_for(done, 10)
        assert seen == list(range(rounds))
        server.recv_evd.set_callback(None)
        client.recv_evd.set_callback(None)
    assert "_poll_rest" not in python, python
    if mode == "wait":
        assert "_poll" not in python, python
    # (Python hands over only around the odd arm: far fewer times than the 2 x 30 messages)
    assert len(python) < rounds - warmup, python


@pytest.mark.rxe
async def test_a_wait_that_fails_before_it_sleeps_leaves_the_evd_free(ep_pair: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait's common case is C (_completions.wait_begin).  If it fails after making the waiter
    (here: setting the timeout's timer), the EVD is left as the Python path's ``finally`` leaves
    it: no waiter and no deadline, so the next wait, with or without a timeout, works."""
    pair = ep_pair
    evd = pair.server.recv_evd
    pair.server.post_recv(pair.server_lmr[0:64], "r1")
    pair.client.post_send(pair.client_lmr[0:8], None, CompletionFlags.SUPPRESS)
    (ev,) = await evd.wait(timeout=10)  # (this loop now watches the EVD: later waits take C's path)
    assert ev.cookie == "r1"

    def no_timer(self: EVD, loop: Any, timeout: float) -> None:
        self._deadline = loop.time() + timeout
        raise RuntimeError("injected: the timer could not be set")

    def python_path(self: EVD) -> bool:
        raise AssertionError("the wait took Python's general path")

    monkeypatch.setattr(EVD, "_set_deadline", no_timer)
    monkeypatch.setattr(EVD, "_poll", python_path)
    with pytest.raises(RuntimeError, match="injected"):
        await evd.wait(timeout=0.05)
    assert evd._waiter is None and evd._deadline is None
    monkeypatch.undo()
    pair.server.post_recv(pair.server_lmr[0:64], "r2")
    waiter = asyncio.ensure_future(evd.wait())  # no timeout: nothing left over may expire it
    await asyncio.sleep(0.2)
    assert not waiter.done()
    pair.client.post_send(pair.client_lmr[0:8], None, CompletionFlags.SUPPRESS)
    (ev,) = await asyncio.wait_for(waiter, 10)
    assert ev.cookie == "r2"



@pytest.mark.rxe
@pytest.mark.parametrize("op", ["send", "recv"])
async def test_a_list_emptied_during_the_post_keeps_its_segment(ep_pair: Any, op: str) -> None:
    """posts.c holds a list's one segment for the whole post: Python that runs inside the post (here an
    LMR attribute read, from a subclass) may empty the list, which held the Segment's last reference.
    The request is posted, recorded with its segment intact, and carries the bytes (a borrowed
    reference would have been read, and stored in the queue entry, after the Segment was freed)."""
    pair = ep_pair
    sender, receiver = pair.client, pair.server
    ep, lmr = (sender, pair.client_lmr) if op == "send" else (receiver, pair.server_lmr)
    segments: List[Any] = []

    class EmptiesTheList(type(lmr)):  # type: ignore[misc]
        @property
        def address(self) -> int:
            segments.clear()  # the list held the only reference to the Segment
            return int(self.__dict__["address"])

        @address.setter
        def address(self, value: int) -> None:
            self.__dict__["address"] = value

    pair.client_lmr.memoryview()[:16] = b"kept-its-segment"
    if op == "send":
        receiver.post_recv(pair.server_lmr[0:64], "r")
    segments.append(lmr[0:16])
    plain = type(lmr)
    lmr.__class__ = EmptiesTheList
    try:
        if op == "send":
            ep.post_send(segments, "s")
        else:
            ep.post_recv(segments, "r")
    finally:
        lmr.__class__ = plain
    assert not segments
    entry = sender._send_q[-1][3] if op == "send" else receiver._recv_q[-1][2]
    (seg,) = entry
    assert (seg.lmr, seg.offset, seg.length) == (lmr, 0, 16)
    if op == "recv":
        sender.post_send(pair.client_lmr[0:16], "s")
    (received,) = await receiver.recv_evd.wait(1)
    assert received.cookie == "r" and received.transferred_length == 16
    assert bytes(pair.server_lmr.memoryview()[:16]) == b"kept-its-segment"
    (sent,) = await sender.request_evd.wait(1)
    assert sent.cookie == "s"


class InterruptedLMR:
    """An LMR whose next count write is followed by a KeyboardInterrupt: what a SIGINT handler
    raising at the next check of the eval breaker does (a loop's backward jump, a call's end)."""

    def __init__(self, count: int) -> None:
        self.__dict__["count"], self.armed = count, False

    @property
    def _inflight(self) -> int:
        return int(self.__dict__["count"])

    @_inflight.setter
    def _inflight(self, value: int) -> None:
        self.__dict__["count"] = value
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("suppressed", [0, 2], ids=["usual case", "retiring suppressed sends"])
def test_a_keyboard_interrupt_while_a_completion_is_taken_lowers_no_count_twice(suppressed: int) -> None:
    """wr.py's take sets a count and pops its entries by steps a signal handler can raise between.
    The entries go first: a KeyboardInterrupt after them leaves a count high (nothing lost), where
    one after a lowered count with the entries still queued had the completion's retry (it stays
    in its EVD's backlog) lower it again: -3 for three sends on an LMR, which lmr.free() would
    then allow under requests the device still holds."""
    lmr, ep = InterruptedLMR(suppressed + 2), EP()
    for i in range(suppressed + 1):
        ep._send_q.append((2 * i, f"s{i}", DTOOp.SEND, (Seg(lmr, 10),), None))  # type: ignore[arg-type]
        if i < suppressed:
            ep._quiet.add(2 * i)
    ep._send_q.append((2 * suppressed + 2, "later", DTOOp.SEND, (Seg(lmr, 10),), None))  # type: ignore[arg-type]
    wc = (2 * suppressed, 0, IBV_WC_SEND, 0, 10, 0, 7, 0, 0, 0, 0)
    lmr.armed = True
    with pytest.raises(KeyboardInterrupt):
        ep._completion_event(wc, object())
    ep._completion_event(wc, object())  # the retry of the same completion
    assert [e[1] for e in ep._send_q] == ["later"] and lmr._inflight == 1


def test_a_keyboard_interrupt_while_an_srqs_buffers_are_released_lowers_no_count_twice() -> None:
    """srq.py's _release_posted (a closed SRQ's receives) and its second call, as SRQ._release makes
    it: the entry goes before the counts are written, so an interrupt between leaves them high."""
    from aiodat.srq import _release_posted

    lmr = InterruptedLMR(3)
    posted = {2 * i + 1: (f"c{i}", (Seg(lmr, 64),)) for i in range(3)}  # type: ignore[arg-type]
    lmr.armed = True
    with pytest.raises(KeyboardInterrupt):
        _release_posted(posted)  # type: ignore[arg-type]
    _release_posted(posted)  # type: ignore[arg-type]
    assert not posted and lmr._inflight == 0


INTERRUPTED_TAKES = ["send", "receive", "send retiring suppressed ones", "receive after a lost one", "an SRQ's receive"]


@pytest.mark.parametrize("case", INTERRUPTED_TAKES)
def test_a_keyboard_interrupt_after_a_completions_entry_is_taken_loses_no_event(case: str) -> None:
    """EVD._queue_backlog takes a completion in Python (an UNSIGNALLED mark: C leaves the EP to
    wr.py) whose count write is followed by a KeyboardInterrupt, as a signal handler raises one
    at the next check of the eval breaker: the entry is gone by then, so the event is queued all
    the same and the backlog moves past the completion, the interrupt going on up (the retry of
    the completion, kept in the backlog, found no entry: a send's event was lost, a receive's
    came with no cookie).  Each completion gives one event, the counts end right."""
    ep, lmr = EP(), InterruptedLMR(0)
    ep._quiet.add(99)  # (an UNSIGNALLED mark of no request: C leaves the EP to wr.py)
    rows = []
    if case.startswith("send"):
        retiring = case == "send retiring suppressed ones"
        for i in range(3):
            ep._send_q.append((2 * i, f"s{i}", DTOOp.SEND, (Seg(lmr, 10),), None))  # type: ignore[arg-type]
        lmr._inflight = 3
        rows.append((2 if retiring else 0, 0, IBV_WC_SEND, 0, 7, None, 0, 0))
        expected, left = ["s1" if retiring else "s0"], 1 if retiring else 2
    elif case == "an SRQ's receive":  # (its buffer leaves the SRQ's table once, in the take)
        srq = SimpleNamespace(_posted={2 * i + 1: (f"c{i}", (Seg(lmr, 64),)) for i in range(3)}, _eps=[ep],
                              _eps_seen=1)
        ep._srq = srq  # type: ignore[assignment]
        lmr._inflight = 3
        rows.append((1, 0, IBV_WC_RECV, 64, 7, None, 0, 0))
        expected, left = ["c0"], 2
    else:
        for i in range(3):
            ep._recv_q.append((2 * i + 1, f"r{i}", (Seg(lmr, 64),)))  # type: ignore[arg-type]
        lmr._inflight = 3
        lost = case == "receive after a lost one"  # (its post's bookkeeping failed: planned)
        rows.append((3 if lost else 1, 0, IBV_WC_RECV, 64, 7, None, 0, 0))
        expected, left = ["r1" if lost else "r0"], 1 if lost else 2
    rows.append((99, 0, IBV_WC_SEND, 0, 8, None, 0, 0))  # (a later completion of an EP gone: no event)
    refs = {7: weakref.ref(ep)}
    evd = EVD.__new__(EVD)
    wcs = wc_array(rows)
    evd._wcs, evd._wc_bytes, evd._wcs_address = wcs, ffi.buffer(wcs), int(ffi.cast("uintptr_t", wcs))
    evd._queue, evd._qpn_refs, evd._solicited_hit, evd._taking = deque(), refs, False, False
    evd._ia = type("IA", (), {"_qpn_owner": type("Owner", (), {"data": refs})})()
    evd._backlog, evd._wc_next = len(rows), 0  # (as _drain_cq notes what it polled)
    lmr.armed = True
    with pytest.raises(KeyboardInterrupt):
        evd._queue_backlog()
    kept = evd._backlog, evd._wc_next
    evd._queue_backlog()  # the next drain: the rest of the backlog
    assert [e.cookie for e in evd._queue] == expected
    assert kept == (2, 1), "the taken completion was kept for a retry"
    assert (evd._backlog, evd._wc_next, evd._taking) == (0, 0, False)
    assert lmr._inflight == left and ep._taken is _NOT_TAKEN
    if ep._srq is not None:  # (left in its table, the buffer was released again by the SRQ's close)
        assert list(ep._srq._posted) == [3, 5]


@pytest.mark.rxe
async def test_a_keyboard_interrupt_after_a_completions_entry_is_taken_loses_no_event_on_rxe(
        ia: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On rxe: an UNSIGNALLED send (C leaves its EP to wr.py) is taken by a dequeue's drain, and
    its LMR's count write is followed by a KeyboardInterrupt (as a signal handler raises one):
    the interrupt goes on up, and the next dequeue returns the send's event (it was lost: the
    completion's retry found its entry gone), once, with the count right."""
    from aiodat.memory import LMR as RealLMR

    armed: List[Any] = []

    def get(self: Any) -> int:
        return int(self.__dict__["_inflight"])

    def put(self: Any, value: int) -> None:
        self.__dict__["_inflight"] = value
        if armed and armed[0] is self:
            armed.clear()
            raise KeyboardInterrupt

    monkeypatch.setattr(RealLMR, "_inflight", property(get, put), raising=False)
    async with _pair_on_one_evd(ia) as pair:
        lmr, evd, client, server = pair.lmr, pair.evd, pair.client, pair.server
        server.post_recv(lmr[0:64], None)
        client.post_send(lmr[64:72], "s0", CompletionFlags.UNSIGNALLED)
        await server.recv_evd.wait(timeout=5.0)  # (received: the send completed)
        armed.append(lmr)
        with pytest.raises(KeyboardInterrupt):
            while evd.dequeue() is None:  # (its drain takes the completion, in wr.py)
                await asyncio.sleep(0.01)
        assert not armed
        event = evd.dequeue()
        assert event is not None and event.cookie == "s0" and event.ok
        assert evd.dequeue() is None and lmr._inflight == 0


class InterruptedAtReturn:
    """aiodat.evd's ``lib``, whose next call of ``name`` that copies completions is followed by a
    KeyboardInterrupt: what a SIGINT handler does when it runs at that C call's return (CPython
    looks for signals there), before the count returned is stored.  The call itself is the real one."""

    def __init__(self, real: Any, name: str) -> None:
        self._real, self._name, self.armed = real, name, True

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._real, attr)
        if attr != self._name:
            return value

        def call(*args: Any) -> int:
            got = int(value(*args))
            if self.armed and got > 0:
                self.armed = False
                raise KeyboardInterrupt
            return got
        return call


@pytest.mark.rxe
@pytest.mark.parametrize("poll", ["aiodat_cq_drain", "aiodat_cq_spin"])
async def test_a_keyboard_interrupt_at_a_cq_polls_return_loses_no_completion(
        ia: Any, monkeypatch: pytest.MonkeyPatch, poll: str) -> None:
    """On rxe: three sends completed, and the EVD's poll of them (a dequeue's drain, or a busy
    poll's spin) is followed by a KeyboardInterrupt at its return.  The interrupt goes on up; the
    three events come next, once each, in order, with the LMR's count back to 0 (the count the
    call returned was lost with it: its completions were copied off the CQ and never queued)."""
    import aiodat.evd as evd_module

    async with _pair_on_one_evd(ia) as pair:
        lmr, evd, client, server = pair.lmr, pair.evd, pair.client, pair.server
        for i in range(3):
            server.post_recv(lmr[64 * i:64 * (i + 1)], None)
            client.post_send(lmr[256 + 8 * i:264 + 8 * i], f"s{i}")
        received = 0
        while received < 3:  # (received: the sends completed; the client's EVD, never waited on,
            received += len(await server.recv_evd.wait(timeout=5.0))  # has no reader callback)
        polls = InterruptedAtReturn(evd_module.lib, poll)
        monkeypatch.setattr(evd_module, "lib", polls)
        with pytest.raises(KeyboardInterrupt) as info:
            if poll == "aiodat_cq_drain":
                evd.dequeue()
            else:  # the loop's poller runs this spin (EVD._napi_spin), where an interrupt ends the loop's run
                evd._drain_cq(rearm=False, spin_us=100_000, arm_if_unarmed=False)
        assert not polls.armed
        assert frame_local(info.value, EVD._drain_cq, "interrupt") is None  # no cycle through the frame
        events = [evd.dequeue() for _ in range(4)]
        assert [e.cookie if e is not None else None for e in events] == ["s0", "s1", "s2", None]
        assert all(e.ok for e in events[:3] if e is not None) and lmr._inflight == 0
