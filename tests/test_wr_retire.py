"""The send queue's retirement (aiodat/wr.py) as a state table, host-only: a signalled completion
takes its own entry and retires the suppressed ones posted before it, releasing their LMRs'
in-flight counts and their UNSIGNALLED marks.  The real path runs on rxe in tests/test_rdma.py
(batches of one buffer and of many, then ``lmr.free()``, which refuses while anything is in flight)."""
from __future__ import annotations

from typing import Any, List, Tuple

from aiodat.wr import WorkRequests, _entries_before


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


def make_ep() -> FakeEP:
    ep = FakeEP()
    ep._init_tracking()
    return ep


def test_one_buffer_batch_retires_together() -> None:
    lmr = FakeLMR()
    segs = (FakeSeg(lmr),)
    ep = make_ep()
    posted(ep, [(2 * i, segs) for i in range(32)], quiet=(4, 6))
    entry = ep._pop_send(62)
    assert entry is not None and entry[0] == 62 and entry[1] == "cookie62"
    assert not ep._send_q and not ep._quiet
    assert lmr._inflight == 1  # the completed entry's own count is its caller's to release


def test_single_posts_of_one_buffer_retire_together() -> None:
    """post_send makes a new (segment,) tuple for every request: the count goes by LMR."""
    lmr = FakeLMR()
    seg = FakeSeg(lmr)
    ep = make_ep()
    posted(ep, [(2 * i, (seg,)) for i in range(16)] + [(40, ())])  # and a zero-length send
    assert ep._pop_send(40)[0] == 40
    assert lmr._inflight == 0 and not ep._send_q


def test_mixed_segments_and_later_entries_stay() -> None:
    a, b = FakeLMR(), FakeLMR()
    ep = make_ep()
    posted(ep, [(2, (FakeSeg(a),)), (6, (FakeSeg(b), FakeSeg(a))), (8, (FakeSeg(b),)), (12, (FakeSeg(a),))],
           quiet=(2, 12))
    entry = ep._pop_send(8)
    assert entry is not None and entry[0] == 8
    assert (a._inflight, b._inflight) == (1, 1)  # 2 and 6 retired; 8 is the caller's; 12 still posted
    assert [e[0] for e in ep._send_q] == [12] and ep._quiet == {12}


def test_head_completion_and_unknown_wr_id() -> None:
    lmr = FakeLMR()
    ep = make_ep()
    posted(ep, [(2, (FakeSeg(lmr),)), (4, (FakeSeg(lmr),)), (10, (FakeSeg(lmr),))])
    assert ep._pop_send(2)[0] == 2  # the head: no search
    # a wr_id that is not on the queue retires what was posted before it, and nothing after
    assert ep._pop_send(6) is None
    assert [e[0] for e in ep._send_q] == [10] and lmr._inflight == 2
    assert ep._pop_send(12) is None and not ep._send_q and lmr._inflight == 1


def test_entries_before() -> None:
    ep = make_ep()
    posted(ep, [(i, ()) for i in (2, 4, 8, 16, 32)])
    assert [_entries_before(ep._send_q, w) for w in (0, 2, 3, 4, 16, 33)] == [0, 0, 1, 1, 3, 5]
