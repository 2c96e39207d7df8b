"""The send queue's retirement (aiodat/wr.py) as a state table, host-only: a signalled completion
takes its own entry and retires the suppressed ones posted before it, releasing their LMRs'
in-flight counts and their UNSIGNALLED marks.  A batch on one buffer with its requests before the last
suppressed is one entry, a run (wr.SendRun).  The real path runs on rxe in tests/test_rdma.py
(batches of one buffer and of many, a failure inside a run, then ``lmr.free()``, which refuses while
anything is in flight)."""
from __future__ import annotations

from typing import Any, List, Tuple

from aiodat.wr import SendRun, WorkRequests, _entries_before


class FakeLMR:
    def __init__(self) -> None:
        self._inflight = 0


class FakeSeg:
    def __init__(self, lmr: FakeLMR, length: int = 64) -> None:
        self.lmr, self.length = lmr, length


class FakeEP(WorkRequests):
    _srq = None
    _rc = True
    _ud = False


def posted(ep: FakeEP, entries: List[Tuple[int, Tuple[Any, ...]]], quiet: Tuple[int, ...] = ()) -> None:
    """Put (wr_id, segs) entries on the send queue as post.py does, LMRs counted in flight."""
    for wr_id, segs in entries:
        ep._send_q.append((wr_id, f"cookie{wr_id}", None, segs, None))
        for seg in segs:
            seg.lmr._inflight += 1
    ep._quiet.update(quiet)


def posted_run(ep: FakeEP, first: int, n: int, segs: Tuple[Any, ...]) -> None:
    """A batch of ``n`` requests on ``segs``, all but the last suppressed, as post.py's _post_same records it."""
    last = first + 2 * (n - 1)
    ep._send_q.append((first, tuple(f"cookie{w}" for w in range(first, last + 1, 2)), None, segs,
                       SendRun(first, last)))
    for seg in segs:
        seg.lmr._inflight += n


def pop_send(ep: FakeEP, wr_id: int) -> Any:
    """Take the entry of ``wr_id`` off the send queue (None if it is not there), retiring the
    entries before it, as a completion of ``wr_id`` plans and takes it; its own segments stay counted."""
    first = ep._send_q[0] if ep._send_q else None
    entry, pops, head, released, quiet = ep._plan_send(wr_id)
    ep._take(ep._send_q, first, pops, head, released, quiet)
    return entry


def make_ep() -> FakeEP:
    ep = FakeEP()
    ep._init_tracking()
    return ep


def test_one_buffer_batch_retires_together() -> None:
    lmr = FakeLMR()
    segs = (FakeSeg(lmr),)
    ep = make_ep()
    posted(ep, [(2 * i, segs) for i in range(32)], quiet=(4, 6))
    entry = pop_send(ep, 62)
    assert entry is not None and entry[0] == 62 and entry[1] == "cookie62"
    assert not ep._send_q and not ep._quiet
    assert lmr._inflight == 1  # the completed entry's own count is its caller's to release


def test_single_posts_of_one_buffer_retire_together() -> None:
    """post_send makes a new (segment,) tuple for every request: the count goes by LMR."""
    lmr = FakeLMR()
    seg = FakeSeg(lmr)
    ep = make_ep()
    posted(ep, [(2 * i, (seg,)) for i in range(16)] + [(40, ())])  # and a zero-length send
    assert pop_send(ep, 40)[0] == 40
    assert lmr._inflight == 0 and not ep._send_q


def test_mixed_segments_and_later_entries_stay() -> None:
    a, b = FakeLMR(), FakeLMR()
    ep = make_ep()
    posted(ep, [(2, (FakeSeg(a),)), (6, (FakeSeg(b), FakeSeg(a))), (8, (FakeSeg(b),)), (12, (FakeSeg(a),))],
           quiet=(2, 12))
    entry = pop_send(ep, 8)
    assert entry is not None and entry[0] == 8
    assert (a._inflight, b._inflight) == (1, 1)  # 2 and 6 retired; 8 is the caller's; 12 still posted
    assert [e[0] for e in ep._send_q] == [12] and ep._quiet == {12}


def test_head_completion_and_unknown_wr_id() -> None:
    lmr = FakeLMR()
    ep = make_ep()
    posted(ep, [(2, (FakeSeg(lmr),)), (4, (FakeSeg(lmr),)), (10, (FakeSeg(lmr),))])
    assert pop_send(ep, 2)[0] == 2  # the head: no search
    # a wr_id that is not on the queue retires what was posted before it, and nothing after
    assert pop_send(ep, 6) is None
    assert [e[0] for e in ep._send_q] == [10] and lmr._inflight == 2
    assert pop_send(ep, 12) is None and not ep._send_q and lmr._inflight == 1


def test_entries_before() -> None:
    ep = make_ep()
    posted(ep, [(i, ()) for i in (2, 4, 8, 16, 32)])
    assert [_entries_before(ep._send_q, w) for w in (0, 2, 3, 4, 16, 33)] == [0, 0, 1, 1, 3, 5]


def test_a_run_is_retired_whole_by_its_last_completion() -> None:
    lmr = FakeLMR()
    ep = make_ep()
    posted_run(ep, 2, 32, (FakeSeg(lmr),))
    posted_run(ep, 66, 32, (FakeSeg(lmr),))
    assert len(ep._send_q) == 2 and ep._sends_outstanding() == 64 and lmr._inflight == 64
    entry = pop_send(ep, 64)
    assert entry is not None and entry[0] == 64 and entry[1] == "cookie64" and entry[4] is None
    assert [e[0] for e in ep._send_q] == [66] and ep._sends_outstanding() == 32
    assert lmr._inflight == 33  # the completed request's own count is its caller's to release


def test_completions_inside_a_run_take_their_own_cookies() -> None:
    """An error or a flush completes suppressed requests one by one: each takes its own cookie, the
    ones before it are retired, the ones after it stay in the run."""
    a, b = FakeLMR(), FakeLMR()
    ep = make_ep()
    posted_run(ep, 10, 6, (FakeSeg(a), FakeSeg(b)))  # 10 .. 20
    entry = pop_send(ep, 14)  # the third request failed
    assert entry == (14, "cookie14", None, ep._send_q[0][3], None)
    assert (a._inflight, b._inflight) == (4, 4)  # 10 and 12 retired; 14 is the caller's
    assert ep._send_q[0][0] == 16 and ep._sends_outstanding() == 3
    for wr_id in (14, 16, 18, 20):  # the caller releases each taken request; then come the flushes
        if wr_id != 14:
            assert pop_send(ep, wr_id)[1] == f"cookie{wr_id}"
        a._inflight -= 1
        b._inflight -= 1
    assert not ep._send_q and (a._inflight, b._inflight) == (0, 0)


def test_runs_before_a_completion_are_retired_in_bulk() -> None:
    a, b = FakeLMR(), FakeLMR()
    ep = make_ep()
    posted_run(ep, 2, 4, (FakeSeg(a),))  # 2 .. 8, the last suppressed too
    posted(ep, [(10, (FakeSeg(b),))], quiet=(10,))
    posted_run(ep, 12, 3, (FakeSeg(b), FakeSeg(a)))  # 12 .. 16
    posted(ep, [(18, (FakeSeg(a),)), (20, (FakeSeg(a),))])
    ep._quiet.add(16)
    assert pop_send(ep, 18)[0] == 18
    assert (a._inflight, b._inflight) == (1 + 1, 0)  # 18 is the caller's, 20 is still posted
    assert [e[0] for e in ep._send_q] == [20] and not ep._quiet


def test_a_wr_id_inside_a_later_run() -> None:
    lmr = FakeLMR()
    ep = make_ep()
    posted(ep, [(2, (FakeSeg(lmr),))])
    posted_run(ep, 4, 5, (FakeSeg(lmr),))  # 4 .. 12
    posted(ep, [(14, (FakeSeg(lmr),))])
    assert pop_send(ep, 8)[1] == "cookie8"  # 2, 4 and 6 retired
    assert lmr._inflight == 7 - 3 and ep._sends_outstanding() == 3  # 10, 12, 14 (8 is the caller's)
    assert pop_send(ep, 13) is None  # not posted: what came before it is retired
    assert [e[0] for e in ep._send_q] == [14] and lmr._inflight == 2


def test_retire_all_releases_every_request_of_a_run() -> None:
    lmr = FakeLMR()
    ep = make_ep()
    posted_run(ep, 2, 16, (FakeSeg(lmr), FakeSeg(lmr)))
    posted(ep, [(40, (FakeSeg(lmr),))])
    assert lmr._inflight == 33
    ep._retire_all()
    assert lmr._inflight == 0 and not ep._send_q and ep._sends_outstanding() == 0


class FakeEVD:
    def __init__(self) -> None:
        self._awaited = 2  # the drain marker's and a wait's


def _busy(high: int) -> Tuple[FakeEP, FakeLMR, FakeLMR, FakeEVD]:
    """An EP holding sends (one on two LMRs, a zero-length one, a run, a drain marker) and receives
    (one on two LMRs), UNSIGNALLED marks, and LMRs whose counts start at ``high``."""
    from aiodat.wr import DrainMarker

    a, b = FakeLMR(), FakeLMR()
    a._inflight = b._inflight = high
    ep = make_ep()
    posted(ep, [(0, (FakeSeg(a),)), (2, (FakeSeg(a), FakeSeg(b))), (4, ())], quiet=(0, 2))
    posted_run(ep, 6, 5, (FakeSeg(b),))
    marker = DrainMarker(lambda status: None)
    marker.evd = evd = FakeEVD()
    ep._send_q.append((16, None, None, (), marker))
    for wr_id, segs in ((1, (FakeSeg(a),)), (3, (FakeSeg(a), FakeSeg(b)))):
        ep._recv_q.append((wr_id, f"cookie{wr_id}", segs))
        for seg in segs:
            seg.lmr._inflight += 1
    return ep, a, b, evd


def _queued_uses(ep: FakeEP, lmr: FakeLMR) -> int:
    """The requests on ``lmr`` the EP's queues still hold (a segment, a use)."""
    sends = sum((e[4].size(e[0]) if isinstance(e[4], SendRun) else 1) * sum(s.lmr is lmr for s in e[3])
                for e in ep._send_q)
    return sends + sum(sum(s.lmr is lmr for s in e[2]) for e in ep._recv_q)


def test_a_retirement_that_runs_out_of_memory_part_way_is_finished_by_the_next() -> None:
    """Each allocation of ``_retire_all`` fails in turn (CPython's ``_testcapi.set_nomemory``, the
    collector off), the LMRs' counts above 256 so that each change of one allocates.  Wherever it
    failed, every request still queued is counted and none retired is (nothing lowered twice by
    the next call, which a dropped EP's QP makes: see EP.__del__), and the next call retires the
    rest.  (It lowered the counts entry by entry and emptied the queues last: a MemoryError part
    way left the entries it had lowered queued, to be lowered again, below what the device holds.)"""
    import gc

    import pytest

    testcapi = pytest.importorskip("_testcapi", reason="needs CPython's _testcapi (set_nomemory)")
    high = 300
    failures = through = 0
    for n in range(1000):
        ep, a, b, evd = _busy(high)
        gc.disable()
        testcapi.set_nomemory(n, n + 1)
        try:
            ep._retire_all()
            failed = False
        except MemoryError:
            failed = True
        finally:
            testcapi.remove_mem_hooks()
            gc.enable()
        failures += failed
        through = 0 if failed else through + 1
        for lmr in (a, b):
            assert lmr._inflight == high + _queued_uses(ep, lmr), f"allocation {n}, failed: {failed}"
        ep._retire_all()  # (the next call: the QP's Raw's, once the EP's finalizer raised)
        assert a._inflight == b._inflight == high, f"allocation {n}"
        assert not ep._send_q and not ep._recv_q and not ep._quiet
        assert evd._awaited == 1, f"allocation {n}"  # the drain marker stopped waiting, once
        if through == 10:
            break
    assert failures and through == 10
