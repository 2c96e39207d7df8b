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
from collections import Counter, deque
from itertools import chain, compress, repeat, starmap
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

from aiodat._shim import _completions
from aiodat.epattr import EPRecvInfo
from aiodat.errors import InvalidParameter, shown
from aiodat.evd import DTOCompletionEvent, DTOOp
from aiodat.memory import Segment

if TYPE_CHECKING:
    from aiodat.evd import EVD

WC_RECV_RDMA_WITH_IMM = 129  # IBV_WC_RECV_RDMA_WITH_IMM
_WC_WR_FLUSH_ERR = 5
_RECV, _RECV_IMM = DTOOp.RECV, DTOOp.RECV_RDMA_WRITE_IMM
_WR_ID, _SEGS, _TARGET = operator.itemgetter(0), operator.itemgetter(3), operator.itemgetter(4)  # of a send entry
_LMR = operator.attrgetter("lmr")  # of a Segment


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
        """The event of one completion; ``wc`` is a struct aiodat_wc as a tuple (evd._WC)."""
        wr_id = wc[0]
        if wr_id & 1:
            q = self._recv_q  # (empty on an SRQ's EP)
            if q and q[0][0] == wr_id:  # the usual case: receives complete in the order they were posted
                _, cookie, segs = q.popleft()
            elif self._srq is not None:
                cookie, segs = self._srq._complete(wr_id)
            else:
                cookie, segs = self._pop_recv(wr_id)
            if len(segs) == 1:
                segs[0].lmr._inflight -= 1
            else:
                self._track(segs, -1)
            code = wc[1]
            notify = True
            if self._quiet and wr_id in self._quiet:
                self._quiet.discard(wr_id)
                notify = bool(code)
            return DTOCompletionEvent._completed(
                evd, self, cookie, wc_status_name(code) if code else "IBV_WC_SUCCESS", wc[4],
                _RECV_IMM if wc[2] == WC_RECV_RDMA_WITH_IMM else _RECV,
                wc[5] if wc[8] & 2 else None,  # imm_data, with IBV_WC_WITH_IMM
                wc[3], wc[7] if self._ud else None, notify)
        code, byte_len, vendor_err = wc[1], wc[4], wc[3]
        status = wc_status_name(code) if code else "IBV_WC_SUCCESS"
        entry = self._pop_send(wr_id)
        if entry is None:
            return None
        _, cookie, op, segs, target = entry
        self._track(segs, -1)
        if target is not None and type(target) is DrainMarker:
            self._quiet.discard(wr_id)
            if code and code != _WC_WR_FLUSH_ERR and self._rc:
                self._on_async_error(f"the drain before a graceful disconnect completed with {status}")
            target.completed(status)
            return None
        if op is DTOOp.BIND or op is DTOOp.UNBIND:
            if code and code != _WC_WR_FLUSH_ERR and self._rc:
                # a failed bind or invalidation puts the RC QP in ERR too: the connection is broken
                self._on_async_error(f"memory window {op.value} with cookie {shown(cookie)} completed with {status}")
            return target._bind_completed(evd, cookie, status, op)
        if op is DTOOp.RDMA_READ:
            length = byte_len
        elif op is DTOOp.COMPARE_SWAP or op is DTOOp.FETCH_ADD:
            length = 8 if not code else byte_len  # verbs leaves byte_len undefined; 8 bytes landed locally
        else:
            length = segs[0].length if len(segs) == 1 else sum(s.length for s in segs)
        notify = True
        if self._quiet and wr_id in self._quiet:
            self._quiet.discard(wr_id)
            notify = bool(code)
        if code and code != _WC_WR_FLUSH_ERR and self._rc:
            # An error completion puts an RC queue pair in ERR: the connection is broken (DAT:
            # the EP leaves CONNECTED and the connect EVD gets CONNECTION_EVENT_BROKEN).
            self._on_async_error(f"{op.value} with cookie {shown(cookie)} completed with {status}")
        return DTOCompletionEvent._completed(evd, self, cookie, status, length, op,
                                             None, vendor_err, None, notify)

    def _pop_send(self, wr_id: int) -> Any:
        """Take the entry of ``wr_id`` off the send queue (None if it is not there).  The entries
        before it, posted without a completion of their own, finished before it: they are retired
        in bulk, with no Python step per entry (one per run and per distinct LMR, none for plain
        entries on one buffer)."""
        q = self._send_q
        if not q:
            return None
        head = q[0]
        if head[0] == wr_id and type(head[4]) is not SendRun:  # the oldest request
            return q.popleft()
        if type(head[4]) is SendRun and head[0] <= wr_id <= head[4].last:  # a batch's completion
            return self._take_from_run(head, wr_id)
        held = _entries_before(q, wr_id + 1)  # the entries posted at or before wr_id
        if not held:
            return None
        newest = q[held - 1]
        inside = newest[0] == wr_id or (type(newest[4]) is SendRun and wr_id <= newest[4].last)
        self._retire(held - 1 if inside else held)
        if not inside:
            return None
        head = q[0]
        return self._take_from_run(head, wr_id) if type(head[4]) is SendRun else q.popleft()

    def _take_from_run(self, head: Tuple[Any, ...], wr_id: int) -> Tuple[Any, ...]:
        """The entry of ``wr_id``, which the run at the head of the send queue holds; the run's
        requests before it completed (suppressed) and are retired, those after it stay."""
        first, cookies, op, segs, run = head
        q = self._send_q
        if wr_id == run.last:
            q.popleft()
        else:
            q[0] = (wr_id + 2, cookies, op, segs, run)
        done = (wr_id - first) // 2  # suppressed requests before wr_id
        if done:
            for seg in segs:
                seg.lmr._inflight -= done
            if self._quiet:
                self._quiet.difference_update(range(first, wr_id, 2))
        return (wr_id, cookies[(wr_id - run.base) // 2], op, segs, None)

    def _retire(self, n: int) -> None:
        """Retire the ``n`` oldest entries of the send queue (they completed without a completion
        of their own): release their LMRs and forget their UNSIGNALLED marks."""
        q = self._send_q
        retired = list(starmap(q.popleft, repeat((), n)))  # n pops, in C
        if not retired:
            return
        # the LMR of every segment of every retired entry, gathered in C
        lmrs = list(map(_LMR, chain.from_iterable(map(_SEGS, retired))))
        runs = list(compress(retired, map(_IS_RUN, map(_TARGET, retired))))
        for first, _, _, segs, run in runs:  # a run's other requests
            lmrs += map(_LMR, segs * (run.size(first) - 1))
        if lmrs and all_same(lmrs):  # the usual case: one buffer
            lmrs[0]._inflight -= len(lmrs)
        else:
            for lmr, count in Counter(lmrs).items():
                lmr._inflight -= count
        if self._quiet:
            self._quiet.difference_update(map(_WR_ID, retired))
            for first, _, _, _, run in runs:
                self._quiet.difference_update(range(first, run.last + 1, 2))

    def _sends_outstanding(self) -> int:
        """How many requests the send queue holds (a run entry stands for several)."""
        return sum(e[4].size(e[0]) if type(e[4]) is SendRun else 1 for e in self._send_q)

    def _pop_recv(self, wr_id: int) -> Tuple[Any, Tuple[Segment, ...]]:
        q = self._recv_q
        # Receives complete in order and their ids only grow: an entry before this one is done, one
        # after it is still posted.  So a completion with no entry of its own (the post's
        # bookkeeping failed: MemoryError) leaves the later ones where they are.
        while q and q[0][0] <= wr_id:
            entry = q.popleft()
            if entry[0] == wr_id:
                return entry[1], entry[2]
            self._track(entry[2], -1)
        return None, ()

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
        """Forget every posted request (the QP was reset or destroyed): release their LMRs."""
        for entry in self._send_q:
            run = entry[4]
            self._track(entry[3], -(run.size(entry[0]) if type(run) is SendRun else 1))
            if type(run) is DrainMarker:
                run.release()
        for posted in self._recv_q:
            self._track(posted[2], -1)
        self._send_q.clear()
        self._recv_q.clear()
        self._quiet.clear()
