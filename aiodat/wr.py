"""Work-request tracking of an endpoint: the wr_id table, the segments in flight, completion -> event.

Each posted request is remembered with its cookie and the LMR segments it uses
(``_send_q`` and ``_recv_q``, in posting order; send wr_ids are even, receive
wr_ids odd, so one completion queue can carry both); the completion that comes
back through the EVD (evd.py calls :meth:`WorkRequests._completion_event`)
finds it again, so the event carries the cookie, and the LMRs cannot be freed
while the hardware may still touch them (``lmr._inflight``).  Requests posted
without a completion of their own (suppressed) are retired when a later
request of the same send queue completes, as the send queue is ordered.  A batch
of requests on the same segments whose requests before the last are suppressed is
one entry, a run (:class:`SendRun`): its last request's completion, the one that
normally comes, retires it whole, with no step per request.

The common case of :meth:`WorkRequests._completion_event` (a success that is
the oldest entry of its queue, a send after plain requests posted suppressed (retired with it), or
the last request of the run at its head, no
UNSIGNALLED requests outstanding, no internal target) is also written in C, in
aiodat/_shim/completions.c, which reads ``_recv_q``, ``_send_q``, ``_quiet``,
``_ud``, the entries' layout and :class:`SendRun`: a change here must be made there too
(tests/test_hot_paths_c.py compares the two).

:class:`WorkRequests` is a mixin of :class:`aiodat.EP`; it owns the attributes
set by :meth:`WorkRequests._init_tracking` and reads the EP's ``_srq``, ``_rc``,
``_ud`` and ``recv_evd`` (duck-typed: this module sits below ep.py).
"""
from __future__ import annotations

import itertools
import operator
from collections import deque
from functools import partial
from itertools import compress, islice, repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

from aiodat._shim import _completions
from aiodat.epattr import EPRecvInfo
from aiodat.errors import InvalidParameter, shown
from aiodat.evd import _NOT_TAKEN, DTOCompletionEvent, DTOOp
from aiodat.memory import Segment

if TYPE_CHECKING:
    from aiodat.evd import EVD

WC_RECV_RDMA_WITH_IMM = 129  # IBV_WC_RECV_RDMA_WITH_IMM
_WC_WR_FLUSH_ERR = 5
_RECV, _RECV_IMM = DTOOp.RECV, DTOOp.RECV_RDMA_WRITE_IMM
_WR_ID, _SEGS, _TARGET = operator.itemgetter(0), operator.itemgetter(3), operator.itemgetter(4)  # of a send entry
_LMR = attrgetter("lmr")  # of a segment


def _entries_before(q: Deque[Tuple[Any, ...]], wr_id: int) -> int:
    """How many entries of a queue in wr_id order come before ``wr_id`` (a binary search)."""
    lo, hi = 0, len(q)
    while lo < hi:
        mid = (lo + hi) // 2
        if q[mid][0] < wr_id:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _lmr_counts(column: Iterable[Tuple[Segment, ...]], times: int = 1) -> Dict[Any, int]:
    """How many times each LMR is used by the requests of ``column`` (a segment, a use), ``times`` over."""
    counts: Dict[Any, int] = {}
    for segs in column:
        for seg in segs:
            counts[seg.lmr] = counts.get(seg.lmr, 0) + times
    return counts


def _columns(items: Iterable[Any], width: int, what: str, shape: str) -> List[Tuple[Any, ...]]:
    """A batch's items (tuples of ``width``) as ``width`` columns, transposed in C: a batch of
    thousands costs no Python step per item here."""
    if type(items) is not list and type(items) is not tuple:
        try:
            items = list(items)
        except TypeError:
            raise InvalidParameter(f"{what}: items must be an iterable of {shape}, not "
                                   f"{type(items).__name__}") from None
    if not items:
        return [()] * width
    try:
        if set(map(len, items)) == {width}:
            return list(zip(*items))
    except TypeError:
        pass
    raise InvalidParameter(f"{what}: items must be {shape}")


def all_same(column: Any) -> bool:
    """True when every entry of a non-empty sequence is the very object of the first (checked in C)."""
    return all(map(operator.is_, column, repeat(column[0])))


class SendRun:
    """The ``target`` of a send-queue entry that stands for a batch of requests on the same
    segments, all but the last suppressed (post.py's ``_post_same``): wr_ids ``base``,
    ``base + 2``, ... ``last``, their cookies in order in the entry's cookie slot.  The entry's
    wr_id is the oldest request still pending: a completion inside the run (an error or a flush
    of a suppressed request) moves it on."""

    __slots__ = ("base", "last")

    def __init__(self, base: int, last: int) -> None:
        self.base, self.last = base, last

    def size(self, first: int) -> int:
        """How many requests the entry whose wr_id is ``first`` still stands for."""
        return (self.last - first) // 2 + 1


_IS_RUN = SendRun.__instancecheck__  # (a C-level test, for map)
_completions.configure_send_run(SendRun)  # a run's last completion takes the C path (completions.c)


class DrainMarker:
    """The ``target`` of the internal zero-length RDMA write a graceful disconnect posts (cm.py):
    its completion means every earlier request of the send queue has completed; it makes no event."""

    __slots__ = ("callback", "status", "evd")

    def __init__(self, callback: Callable[[str], object]) -> None:
        self.callback = callback
        self.status: Optional[str] = None
        #: the request EVD while the marker is posted: awaited, so its CQ is polled even when the
        #: EVD is full (the marker's completion must not wait behind events nobody takes)
        self.evd: Any = None

    def completed(self, status: str) -> None:
        self.release()
        if self.status is None:
            self.status = status
            self.callback(status)

    def release(self) -> None:
        """The marker no longer waits on its EVD (it completed, or its QP was reset or destroyed)."""
        evd, self.evd = self.evd, None
        if evd is not None and evd._awaited > 0:
            evd._awaited -= 1


def wc_status_name(status: int) -> str:
    """The ``ibv_wc_status`` name of a work completion's status number (``IBV_WC_STATUS_<n>`` if unknown)."""
    return _WC_STATUS[status] if status < len(_WC_STATUS) else f"IBV_WC_STATUS_{status}"


_WC_STATUS = [
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_OP_ERR",
    "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_LOC_RDD_VIOL_ERR",
    "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR", "IBV_WC_INV_EECN_ERR",
    "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR", "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR",
    "IBV_WC_TM_ERR", "IBV_WC_TM_RNDV_INCOMPLETE",
]




class _PlanStale(Exception):
    """A completion's take found its plan no longer holds (a finalizer run by a collection since
    changed the EP's queue or an LMR's count): nothing was taken; the completion is worked out
    again."""


def _lowered(released: List[Tuple[Tuple[Segment, ...], int]]) -> List[Tuple[Any, Any, Any]]:
    """The in-flight count each LMR will have once ``released`` (segments, requests) are taken off
    it: (lmr, its count now, the new count) triples, worked out before anything is taken (a count
    that is no small int allocates), and checked then set by loops that allocate nothing."""
    lmr = None
    total = 0
    for segs, n in released:  # the usual case: every segment on one LMR
        if len(segs) != 1 or (segs[0].lmr is not lmr and lmr is not None):
            break
        lmr = segs[0].lmr
        total += n
    else:
        if lmr is None:
            return []
        was = lmr._inflight
        return [(lmr, was, was - total)]
    by_lmr: Dict[Any, int] = {}
    for segs, n in released:
        for seg in segs:
            lmr = seg.lmr
            by_lmr[lmr] = by_lmr.get(lmr, 0) + n
    lowered = []
    for lmr, n in by_lmr.items():
        was = lmr._inflight
        lowered.append((lmr, was, was - n))
    return lowered


def _on_one_lmr(segs: Tuple[Segment, ...]) -> bool:
    """Whether ``segs``, not one segment, are two or more on one LMR (a completion's fast path)."""
    n = len(segs)
    if n < 2:
        return False
    lmr = segs[0].lmr
    return segs[1].lmr is lmr if n == 2 else all(map(is_, map(_LMR, segs), repeat(lmr)))


class WorkRequests:
    """Mixin of the EP: the table of posted requests and the turning of completions into events."""

    _srq: Any
    _rc: bool
    _ud: bool
    recv_evd: "EVD"
    _on_async_error: Callable[[str], None]  # the EP's: a failed completion breaks the connection
    _check: Callable[[], None]  # the EP's (a Handle's): InvalidHandle once it is closed

    def _init_tracking(self) -> None:
        self._ids = itertools.count(1)
        #: posted sends in order: (wr_id, cookie, DTOOp, segments, target)
        self._send_q: Deque[Tuple[int, Any, Any, Tuple[Segment, ...], Any]] = deque()
        #: posted receives in order: (wr_id, cookie, segments)
        self._recv_q: Deque[Tuple[int, Any, Tuple[Segment, ...]]] = deque()
        self._quiet: set = set()  # wr_ids posted UNSIGNALLED: their events do not notify
        #: the event of the completion whose entry is being taken, noted just before the take
        #: (evd.py's _queue_one queues it when the take is interrupted after: see there)
        self._taken: Any = _NOT_TAKEN

    def _track(self, segs: Tuple[Segment, ...], delta: int) -> None:
        for seg in segs:
            seg.lmr._inflight += delta

    def _take_ids(self, n: int) -> int:
        """Reserve ``n`` consecutive request numbers (a batch's wr_ids); returns the first."""
        first = next(self._ids)
        self._ids = itertools.count(first + n)
        return first

    # -- completions (called by evd.py) ---------------------------------------
    def _completion_event(self, wc: Tuple[int, ...], evd: "EVD") -> Any:
        """The event of one completion; ``wc`` is a struct aiodat_wc as a tuple (evd._WC).

        Under memory pressure it raises with nothing changed, or returns with the request's entry
        taken: what it takes is worked out first (it allocates), and taken by steps that allocate
        nothing (a MemoryError in between would lose the cookie).  An allocation can also start a
        collection whose finalizers post on or reset this EP: after the last allocation the take
        checks, by identity, that the queue's head and the counts are still the ones it planned
        from (the usual case reads its count only then: no check), and works the completion out
        again if not (_PlanStale).  A drain marker's callback
        runs after the take; a window's bind is taken by memory.py's _bind_completed, which runs
        the take (_take_with) before it changes anything."""
        wr_id = wc[0]
        code = wc[1]
        event: Any
        if wr_id & 1:
            q: Deque[Any] = self._recv_q  # (empty on an SRQ's EP)
            # the usual case: receives complete in the order they were posted; its segments on
            # one LMR: taken with no plan
            if q and (entry := q[0])[0] == wr_id:
                segs = entry[2]
                n = len(segs)
                if n == 1 or _on_one_lmr(segs):
                    quiet = self._quiet
                    marked = quiet and wr_id in quiet  # (only its take or a reset, which empties q, changes it)
                    event = DTOCompletionEvent._completed(
                        evd, self, entry[1], wc_status_name(code) if code else "IBV_WC_SUCCESS", wc[4],
                        _RECV_IMM if wc[2] == WC_RECV_RDMA_WITH_IMM else _RECV,
                        wc[5] if wc[8] & 2 else None,  # imm_data, with IBV_WC_WITH_IMM
                        wc[3], wc[7] if self._ud else None, not marked or bool(code))
                    if code and code != _WC_WR_FLUSH_ERR:  # a failed receive breaks the QP (RC and UD: ERR)
                        self._on_async_error(f"receive with cookie {shown(entry[1])} completed with {event.status}")
                    # after the last step that can run Python (the event's allocations: a
                    # collection's finalizer may have reset the EP, or posted on it): the head
                    # checked, then the new count made from what it is now (an int: a MemoryError
                    # takes nothing), then the entry and the count, by steps no signal handler can
                    # come between (a KeyboardInterrupt between a lowered count and a pop had the
                    # retry lower it again)
                    if q and q[0] is entry:
                        count = segs[0].lmr._inflight - n
                        self._taken = event  # (an existing attribute: no allocation, no step between)
                        del q[0]
                        segs[0].lmr._inflight = count
                        if marked:  # (a reset clears this set, never replaces it)
                            quiet.discard(wr_id)
                        return event
                    return self._completion_event(wc, evd)
            try:
                return self._recv_planned(wc, evd, q)
            except _PlanStale:
                return self._completion_event(wc, evd)
        q = self._send_q
        # the usual case: the oldest request, no target, its segments on one LMR: taken with no plan
        if q and (entry := q[0])[0] == wr_id and entry[4] is None:
            segs = entry[3]
            n = len(segs)
            if n == 1 or _on_one_lmr(segs):
                op = entry[2]
                status = wc_status_name(code) if code else "IBV_WC_SUCCESS"
                if op is DTOOp.RDMA_READ:
                    length = wc[4]
                elif op is DTOOp.COMPARE_SWAP or op is DTOOp.FETCH_ADD:
                    length = 8 if not code else wc[4]  # verbs leaves byte_len undefined; 8 bytes landed locally
                else:
                    length = segs[0].length if n == 1 else sum(s.length for s in segs)
                quiet = self._quiet
                marked = quiet and wr_id in quiet
                event = DTOCompletionEvent._completed(evd, self, entry[1], status, length, op, None, wc[3],
                                                      None, not marked or bool(code))
                if code and code != _WC_WR_FLUSH_ERR and self._rc:
                    # An error completion puts an RC queue pair in ERR: the connection is broken (DAT:
                    # the EP leaves CONNECTED and the connect EVD gets CONNECTION_EVENT_BROKEN).  (A UD
                    # send's error puts its QP in SQE, where receives still work: it breaks nothing.)
                    # (Before the entry is taken: a retry after a failure here breaks it again, a no-op.)
                    self._on_async_error(f"{op.value} with cookie {shown(entry[1])} completed with {status}")
                # (after the last step that can run Python: the head checked, then the count
                # lowered from what it is now, as for a receive above)
                if q and q[0] is entry:
                    count = segs[0].lmr._inflight - n  # (as for a receive above)
                    self._taken = event
                    del q[0]
                    segs[0].lmr._inflight = count
                    if marked:
                        quiet.discard(wr_id)
                    return event
                return self._completion_event(wc, evd)
        try:
            return self._send_planned(wc, evd, q)
        except _PlanStale:
            return self._completion_event(wc, evd)

    def _recv_planned(self, wc: Tuple[int, ...], evd: "EVD", q: Deque[Any]) -> Any:
        """A receive's event that is no usual case: an SRQ's, one after receives with no completion
        (their post failed), one on several LMRs; planned, then taken (_take)."""
        wr_id = wc[0]
        code = wc[1]
        first = q[0] if q else None  # (what the plan reads: the take checks it is still there)
        posted = None  # an SRQ's table of its buffers, whose entry goes at the end
        if q and q[0][0] == wr_id:
            _, cookie, segs = q[0]
            pops, released = 1, [(segs, 1)]
        elif self._srq is not None:
            # the SRQ's entry, taken at the end (as completions.c's srq_event does)
            srq = self._srq
            if len(srq._eps) != srq._eps_seen:  # an EP came or went: remember its recv EVD for the counters
                srq._note_evds()
            posted = srq._posted
            mine = posted.get(wr_id)  # (the take checks it is still there: an SRQ's close clears the table)
            cookie, segs = mine if mine is not None else (None, ())
            pops, released = 0, [(segs, 1)]
        else:
            cookie, segs, pops, released = self._plan_recv(wr_id)
        event = DTOCompletionEvent._completed(
            evd, self, cookie, wc_status_name(code) if code else "IBV_WC_SUCCESS", wc[4],
            _RECV_IMM if wc[2] == WC_RECV_RDMA_WITH_IMM else _RECV,
            wc[5] if wc[8] & 2 else None,  # imm_data, with IBV_WC_WITH_IMM
            wc[3], wc[7] if self._ud else None, not (self._quiet and wr_id in self._quiet) or bool(code))
        if code and code != _WC_WR_FLUSH_ERR:  # (before the take, as a request's)
            self._on_async_error(f"receive with cookie {shown(cookie)} completed with {event.status}")
        # (an SRQ's buffer leaves its table in the take, before the counts: its cookie and
        # segments are held here, so that runs no finalizer)
        self._take(q, first, pops, None, released, (wr_id,) if self._quiet else (),
                   (posted, wr_id, mine) if posted is not None else None, event)
        return event

    def _send_planned(self, wc: Tuple[int, ...], evd: "EVD", q: Deque[Any]) -> Any:
        """A send's event that is no usual case: one that retires suppressed requests, a run's,
        one with a target (a drain marker, a window's bind), one on several LMRs; planned, then
        taken (_take, or _bind_completed's take)."""
        wr_id = wc[0]
        code = wc[1]
        first = q[0] if q else None  # (what the plan reads: the take checks it is still there)
        byte_len, vendor_err = wc[4], wc[3]
        status = wc_status_name(code) if code else "IBV_WC_SUCCESS"
        entry, pops, head, released, quiet = self._plan_send(wr_id)
        if entry is None:
            self._take(q, first, pops, head, released, quiet, None, None)
            return None
        released.append((entry[3], 1))
        if self._quiet:
            quiet = [*quiet, wr_id]
        _, cookie, op, segs, target = entry
        if target is not None and type(target) is DrainMarker:
            if code and code != _WC_WR_FLUSH_ERR and self._rc:  # (before the take, as below)
                self._on_async_error(f"the drain before a graceful disconnect completed with {status}")
            self._take(q, first, pops, head, released, quiet, None, None)  # (it raises with nothing taken, or takes all)
            target.completed(status)  # after the take: its callback may go on to reset the QP (which forgets every entry)
            return None
        if op is DTOOp.BIND or op is DTOOp.UNBIND:
            if code and code != _WC_WR_FLUSH_ERR and self._rc:
                # a failed bind or invalidation puts the RC QP in ERR too: the connection is broken
                # (a UD QP binds no window)
                self._on_async_error(f"memory window {op.value} with cookie {shown(cookie)} completed with {status}")
            # the take done by _bind_completed first, before it changes anything: it pops the
            # window's pending request, which a retry would not meet again (it took the next).  The
            # window's own release (a failed bind's segment, an unbind's binding) is part of the
            # same take (``extra``): a count of its own set after the take undid the take's
            return target._bind_completed(evd, cookie, status, op,
                                          partial(self._take_with, q, first, pops, head, released, quiet))
        if op is DTOOp.RDMA_READ:
            length = byte_len
        elif op is DTOOp.COMPARE_SWAP or op is DTOOp.FETCH_ADD:
            length = 8 if not code else byte_len  # verbs leaves byte_len undefined; 8 bytes landed locally
        else:
            length = segs[0].length if len(segs) == 1 else sum(s.length for s in segs)
        event = DTOCompletionEvent._completed(evd, self, cookie, status, length, op, None, vendor_err, None,
                                              not (self._quiet and wr_id in self._quiet) or bool(code))
        if code and code != _WC_WR_FLUSH_ERR and self._rc:  # (a UD send's: see above)
            # (before the entry is taken: a retry after a failure here breaks it again, a no-op)
            self._on_async_error(f"{op.value} with cookie {shown(cookie)} completed with {status}")
        self._take(q, first, pops, head, released, quiet, None, event)
        return event

    def _plan_recv(self, wr_id: int) -> Tuple[Any, Tuple[Segment, ...], int, List[Tuple[Any, int]]]:
        """A receive that is not the oldest entry: (cookie, segments, entries to pop, segments
        released), changing nothing.  Receives complete in order and their ids only grow: an entry
        before this one is done, one after it is still posted.  So a completion with no entry of
        its own (the post's bookkeeping failed: MemoryError) leaves the later ones where they are."""
        pops = 0
        released: List[Tuple[Any, int]] = []
        for entry in self._recv_q:
            if entry[0] > wr_id:
                break
            pops += 1
            if entry[0] == wr_id:
                released.append((entry[2], 1))
                return entry[1], entry[2], pops, released
            released.append((entry[2], 1))
        return None, (), pops, released

    def _plan_send(self, wr_id: int) -> Tuple[Any, int, Any, List[Tuple[Any, int]], List[int]]:
        """How the completion of ``wr_id`` takes the send queue, changing nothing: (its entry or
        None, how many entries to pop from the head, the entry then put at the head or None, the
        segments released with the requests they stand for, the wr_ids whose UNSIGNALLED marks
        go).  The entries before it, posted without a completion of their own, finished before
        it: they are retired with it, with no Python step per entry (one per run and per distinct
        LMR, none for plain entries on one buffer).  Its own segments are the caller's to add."""
        q = self._send_q
        if not q:
            return None, 0, None, [], []
        head = q[0]
        if head[0] == wr_id and type(head[4]) is not SendRun:  # the oldest request
            return head, 1, None, [], []
        retire = 0
        released: List[Tuple[Any, int]] = []
        quiet: List[int] = []
        if not (type(head[4]) is SendRun and head[0] <= wr_id <= head[4].last):  # not a batch's completion
            held = _entries_before(q, wr_id + 1)  # the entries posted at or before wr_id
            if not held:
                return None, 0, None, [], []
            newest = q[held - 1]
            inside = newest[0] == wr_id or (type(newest[4]) is SendRun and wr_id <= newest[4].last)
            retire = held - 1 if inside else held
            released, quiet = self._retired(retire)
            if not inside:
                return None, retire, None, released, quiet
            head = q[retire]
            if type(head[4]) is not SendRun:
                return head, retire + 1, None, released, quiet
        # the run at the head holds it: its requests before it completed (suppressed), those after stay
        first, cookies, op, segs, run = head
        done = (wr_id - first) // 2  # suppressed requests before wr_id
        if done:
            released.append((segs, done))
            if self._quiet:
                quiet += range(first, wr_id, 2)
        entry = (wr_id, cookies[(wr_id - run.base) // 2], op, segs, None)
        if wr_id == run.last:
            return entry, retire + 1, None, released, quiet
        return entry, retire, (wr_id + 2, cookies, op, segs, run), released, quiet

    def _retired(self, n: int) -> Tuple[List[Tuple[Any, int]], List[int]]:
        """The ``n`` oldest entries of the send queue, to be retired (they completed without a
        completion of their own): their segments with the requests they stand for, and their
        wr_ids for the UNSIGNALLED marks (none when there are no marks)."""
        retired = list(islice(self._send_q, n))
        released: List[Tuple[Any, int]] = [(e[3], e[4].size(e[0]) if type(e[4]) is SendRun else 1) for e in retired]
        quiet: List[int] = []
        if self._quiet:
            quiet += map(_WR_ID, retired)
            for first, _, _, _, run in compress(retired, map(_IS_RUN, map(_TARGET, retired))):
                quiet += range(first, run.last + 1, 2)
        return released, quiet

    def _take(self, q: Deque[Any], first: Any, pops: int, head: Any, released: List[Tuple[Any, int]],
              quiet: Iterable[int], guard: Any = None, event: Any = _NOT_TAKEN) -> None:
        """Take what a completion's plan planned: ``pops`` entries off the head of ``q`` (``head``
        then put at its head), the LMRs' counts lowered by ``released`` (segments, requests), the
        UNSIGNALLED marks of ``quiet``.  ``first`` is the head of ``q`` the plan read; ``guard``,
        if given, one more entry the plan read (see _commit); ``event`` the completion's (or None),
        noted in ``_taken`` as the take begins.  Raises with nothing taken (a MemoryError, or
        _PlanStale), or takes it all (see _prepare)."""
        self._commit(self._prepare(q, first, pops, head, released, quiet, guard), event)  # (the finalizers run as it returns)

    def _take_with(self, q: Deque[Any], first: Any, pops: int, head: Any, released: List[Tuple[Any, int]],
                   quiet: Iterable[int], extra: Iterable[Tuple[Any, int]] = (), guard: Any = None) -> List[Any]:
        """_take with ``extra`` (segments, requests) released too, in the same plan (a window's
        bind completion: memory.py's _bind_completed, whose ``guard`` is the window's pending
        request it planned from); returns the entries to hold (see _commit)."""
        return self._commit(self._prepare(q, first, pops, head, [*released, *extra] if extra else released, quiet,
                                          guard))

    @staticmethod
    def _prepare(q: Deque[Any], first: Any, pops: int, head: Any, released: List[Tuple[Any, int]],
                 quiet: Iterable[int], guard: Any = None) -> Tuple[Any, ...]:
        """What can fail in a take, made first (a MemoryError here changes nothing): the list
        holding the entries, the iterators _commit's loops use, the new counts (made last, from the
        counts as they are)."""
        counts = _lowered(released)
        return (q, first, list(islice(q, pops)), repeat(None, pops), head, iter(quiet), iter(counts),
                iter(counts), guard)

    def _commit(self, taking: Tuple[Any, ...], event: Any = _NOT_TAKEN) -> List[Any]:
        """The take _prepare made ready, by steps that allocate nothing: the plan checked first
        (the head of the queue and the counts still the ones it read: a collection run by an
        allocation since may have run a finalizer that reset or posted on this EP; _PlanStale if
        not, nothing taken), then the entries go, then the counts are set (the safe order if a
        signal handler raises part way: counts left high), the entries returned to be held
        until the caller's end, so that the finalizer their release may run (a cookie's, which may
        post on or reset this EP) finds everything taken.  The guard, if any, is one more entry the
        plan read, checked the same way: (a deque, None, its head) for a window's pending request
        (a close clears it, releasing the request's segment itself), (a dict, key, its value or
        None) for an SRQ's posted buffer (a close clears the table, releasing every buffer), which
        leaves the table with the entries.  ``event``, the completion's, is noted in ``_taken``
        before the first step that takes anything (see evd.py's _queue_one); a window's bind
        (_take_with) notes none: memory.py's steps after it are not covered."""
        q, first, held, steps, head, marks, checks, counts, guard = taking
        if (q[0] if q else None) is not first:
            raise _PlanStale
        if guard is not None:
            where, key, expected = guard
            if key is None:
                if (where[0] if where else None) is not expected:
                    raise _PlanStale
            elif where.get(key) is not expected:
                raise _PlanStale
        for lmr, was, _ in checks:
            if lmr._inflight is not was:
                raise _PlanStale
        if event is not _NOT_TAKEN:
            self._taken = event
        for _ in steps:
            q.popleft()
        if head is not None:
            q[0] = head
        if guard is not None and guard[1] is not None and guard[2] is not None:
            del guard[0][guard[1]]  # (an SRQ's buffer, checked above; its caller holds it)
        if self._quiet:
            for wr_id in marks:
                self._quiet.discard(wr_id)
        # the counts last: a KeyboardInterrupt raised by a signal handler between two steps here
        # leaves them high (lmr.free() refused: nothing lost), never lowered for entries still
        # queued, which the completion's retry would lower again (a buffer freed under the device)
        for lmr, _, count in counts:
            lmr._inflight = count
        return held

    def _sends_outstanding(self) -> int:
        """How many requests the send queue holds (a run entry stands for several)."""
        return sum(e[4].size(e[0]) if type(e[4]) is SendRun else 1 for e in self._send_q)

    def recv_query(self) -> "EPRecvInfo":
        """Receive buffers held by the EP (dat_ep_recv_query): ``(nbufs_allocated, bufs_alloc_span)``.

        ``nbufs_allocated`` counts the buffers allocated to the EP whose
        completion has not been generated yet: for an EP with its own receive
        queue, the receives posted and not yet completed (exact); for an EP on
        an SRQ, the buffers it has taken from the SRQ, which the device does
        not report, so ``None`` (DAT_VALUE_UNKNOWN).  ``bufs_alloc_span`` is
        always ``None``: verbs devices do not expose message sequence numbers.
        """
        self._check()
        if self._srq is not None:
            return EPRecvInfo(None, None)
        evd = self.recv_evd
        # completions the device already wrote are not "allocated" any more; the drain read the
        # channel's event, so whoever waits for them (a wait, a callback) is told here
        if evd._drain_cq():
            evd._queued_aside()
        return EPRecvInfo(len(self._recv_q), None)

    def _retire_all(self) -> None:
        """Forget every posted request (the QP was reset or destroyed): release their LMRs.
        Restartable (see retire_requests): a call that raised part way is made again to finish."""
        retire_requests(self._send_q, self._recv_q, self._quiet)


def _send_uses(entry: Tuple[Any, ...]) -> Tuple[Tuple[Segment, ...], int]:
    """A send-queue entry's segments and the requests it stands for (a run's are several)."""
    run = entry[4]
    return entry[3], run.size(entry[0]) if type(run) is SendRun else 1


def _recv_uses(entry: Tuple[Any, ...]) -> Tuple[Tuple[Segment, ...], int]:
    """A receive-queue entry's segments and its one request."""
    return entry[2], 1


def retire_requests(send_q: Deque[Any], recv_q: Deque[Any], quiet: Set[int]) -> None:
    """Forget every request of an EP's queues (their QP was reset or destroyed): release their LMRs.

    The EP's ``_retire_all``, and its QP's Raw ``then`` (ep.py): a dropped EP's finalizer whose
    retirement raised leaves the rest to the QP's destruction, which a failure there leaves to a
    retry after the next collection (_handle.Raw._forget).  So it is restartable: each queue is
    taken whole or not at all, as a completion's take is (wr.WorkRequests._commit): what allocates
    first (the entries held, the new counts made last from the counts as they are), then, by steps
    that allocate nothing, a check that the head and the counts are still those it planned from
    (a collection an allocation started may have run a finalizer that posted, took a completion or
    retired: else it plans again), the entries off the queue, the counts set.  A call that raised
    part way (a MemoryError) retired nothing twice, and the next one retires the rest.  A signal
    handler's exception between two of those steps leaves counts high (lmr.free() refused), never
    lowered for an entry still queued, which the next call would lower again."""
    for q, uses in ((send_q, _send_uses), (recv_q, _recv_uses)):
        while q:
            held = list(q)  # (their cookies go once the counts are set: a finalizer may post again)
            first = held[0]
            if uses is _send_uses:
                for entry in held:  # a graceful disconnect's drain marker (idempotent: a retry's is a no-op)
                    if type(entry[4]) is DrainMarker:
                        entry[4].release()
            counts = _lowered(list(map(uses, held)))
            steps, checks, writes = repeat(None, len(held)), iter(counts), iter(counts)
            if (q[0] if q else None) is not first:
                continue
            for lmr, was, _ in checks:
                if lmr._inflight is not was:
                    break  # (planned again)
            else:
                for _ in steps:
                    q.popleft()
                for lmr, _, count in writes:
                    lmr._inflight = count
            del held
    quiet.clear()  # (an UNSIGNALLED mark of a retired request is never looked up again)
