"""Shared Receive Queues (dat_srq_*): one pool of receive buffers for many endpoints.

``srq = ia.create_srq(pz, max_recv_dtos, max_recv_iov)`` creates an ibv SRQ in
``pz``; ``ia.create_ep(pz, srq=srq)`` attaches endpoints to it.  Receives are
posted to the SRQ (:meth:`SRQ.post_recv`), never to the EPs; any attached EP
takes the next buffer when a message arrives on it, and the completion comes
back on *that* EP's ``recv_evd`` with the cookie given at post time (wr.py's
``_completion_event`` and completions.c's srq_event read it in ``_posted``).

Counters (:meth:`SRQ.query`, seed 001):

* ``outstanding_dto_count``: buffers posted to the SRQ whose completion the
  consumer has not yet dequeued.  aiodat knows this exactly: it is the number
  of posted buffers not yet completed plus the SRQ receive completions still
  queued in the recv EVDs of the attached EPs.
* ``available_dto_count``: buffers still on the SRQ.  The device does not
  report how many buffers EPs have taken, so this is ``None``
  (DAT_VALUE_UNKNOWN) whenever an attached EP could be receiving; it is exact
  while no attached EP is connected (none can have taken a buffer).

Low watermark: :meth:`SRQ.set_lw` arms the device's SRQ limit; when an EP takes
a buffer and fewer than ``low_watermark`` remain, the device raises
IBV_EVENT_SRQ_LIMIT_REACHED, which becomes an ``ASYNC_SRQ_LOW_WATERMARK``
event on the IA's async EVD and resolves ``await srq.low_watermark()``.  The
limit fires once per arming, as DAT and the verbs both say: afterwards
``query().low_watermark`` reads ``None`` until ``set_lw`` is called again.
aiodat never re-arms by itself.  See docs/srq.md.
"""
from __future__ import annotations

import asyncio
import enum
import errno
import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

from aiodat._handle import Handle, Raw, fail_waiter
from aiodat._lib import ffi, lib
from aiodat._shim import _posts
from aiodat.errors import (
    DATError,
    InvalidHandle,
    InvalidParameter,
    InvalidState,
    ModelNotSupported,
    QueueFull,
    TimeoutExpired,
    error_from_errno,
    shown,
)
from aiodat.cqsize import fit_cqs
from aiodat.epattr import EPState
from aiodat.evd import DTOCompletionEvent, DTOOp, is_timeout
from aiodat.memory import PZ, Segment, Segments, as_segments, check_post_segments, fill_sges
from aiodat.wr import _columns, _lmr_counts

if TYPE_CHECKING:
    from aiodat.ep import EP
    from aiodat.evd import EVD
    from aiodat.ia import IA

#: the iov limit of one posted receive in the C shim (struct aiodat_sge batches)
_SHIM_MAX_IOV = 32


class SRQState(enum.Enum):
    """DAT SRQ states (DAT_SRQ_STATE_*)."""

    OPERATIONAL = "OPERATIONAL"
    #: the device reported IBV_EVENT_SRQ_ERR: the SRQ can no longer be used
    ERROR = "ERROR"


_posts.configure_srq(SRQState.OPERATIONAL)
_c_srq_post_recv_batch = _posts.srq_post_recv_batch


@dataclass(frozen=True)
class SRQParam:
    """What :meth:`SRQ.query` returns (DAT_SRQ_PARAM).

    ``max_recv_dtos`` and ``max_recv_iov`` are the sizes the device actually
    gave (at least what was asked for).  ``low_watermark`` is ``None`` while
    the SRQ is not armed (DAT_SRQ_LW_DEFAULT): never set, or already fired.
    A counter that cannot be known at this moment is ``None``
    (DAT_VALUE_UNKNOWN).
    """

    ia: "IA"
    pz: "PZ"
    state: SRQState
    max_recv_dtos: int
    max_recv_iov: int
    low_watermark: Optional[int]
    available_dto_count: Optional[int]
    outstanding_dto_count: Optional[int]


class SRQ(Handle):
    """A Shared Receive Queue (dat_srq_create): receive buffers shared by many EPs of one PZ."""

    _kind = "srq"
    _close_rank = 3  # after the EPs that use it (0), before the LMRs its buffers live in (5)

    def __init__(
        self, ia: "IA", pz: "PZ", max_recv_dtos: int, max_recv_iov: int = 1,
        low_watermark: Optional[int] = None,
    ) -> None:
        ia._check()
        if not isinstance(pz, PZ):
            raise InvalidParameter(f"pz must be a PZ, not {type(pz).__name__}")
        pz._check()
        if pz.ia is not ia:
            raise InvalidParameter("the PZ belongs to another IA")
        dev = ia._device_attr
        if dev.max_srq <= 0:
            raise ModelNotSupported(f"{ia.device_name} does not support shared receive queues (max_srq = 0)")
        if not isinstance(max_recv_dtos, int) or isinstance(max_recv_dtos, bool) or \
                not 1 <= max_recv_dtos <= dev.max_srq_wr:
            raise InvalidParameter(
                f"max_recv_dtos must be an int between 1 and {dev.max_srq_wr} (max_recv_per_srq), "
                f"got {shown(max_recv_dtos)}")
        iov_limit = min(dev.max_srq_sge, _SHIM_MAX_IOV)
        if not isinstance(max_recv_iov, int) or isinstance(max_recv_iov, bool) or \
                not 1 <= max_recv_iov <= iov_limit:
            raise InvalidParameter(f"max_recv_iov must be an int between 1 and {iov_limit}, got {shown(max_recv_iov)}")
        lw = _check_lw(low_watermark, max_recv_dtos)
        self._srq: Any = ffi.NULL
        self._srq_address = 0
        super().__init__(pz)
        self._ia, self._pz = ia, pz
        #: the EPs receiving from this SRQ (an insertion-ordered set; ep.py calls _attach and _detach)
        self._eps: "weakref.WeakKeyDictionary[EP, None]" = weakref.WeakKeyDictionary()  # the EPs it feeds
        self._evds: Dict["EVD", None] = {}  # recv EVDs of EPs that were ever attached
        self._eps_seen = 0
        self._posted: Dict[int, Tuple[Any, Tuple[Segment, ...]]] = {}  # wr_id -> (cookie, segments)
        self._ids = itertools.count(1)
        self._state = SRQState.OPERATIONAL
        self._waiters: List["asyncio.Future[None]"] = []
        self._lw_fired = False  # an event of the current arming that no low_watermark() call took yet
        self._armed = False
        self.low_watermark_events = 0  #: how many low-watermark events this SRQ has had
        init = ffi.new("struct ibv_srq_init_attr *")
        init.attr.max_wr = max_recv_dtos
        init.attr.max_sge = max_recv_iov
        init.attr.srq_limit = 0  # never armed at creation (providers ignore it there anyway)
        srq = lib.ibv_create_srq(pz._pd, init)
        if srq == ffi.NULL:
            err = ffi.errno
            self._closed = True
            pz._children.pop(self, None)
            raise error_from_errno(err, f"creating an SRQ of {max_recv_dtos} x {max_recv_iov} (ibv_create_srq)")
        self._raw = Raw(srq, lib.ibv_destroy_srq, "SRQ", pz._raw)
        # the receives still posted hold their LMRs until the device lets go of them: when the SRQ is
        # destroyed, by free() or by a retry after a destruction that failed (see _release)
        self._raw.then = functools.partial(_release_posted, self._posted)
        self._srq = srq  # (set once its Raw is: _release frees what is set)
        try:  # a failure from here closes the SRQ: what was made is freed, and the PZ lets go of it
            self._srq_address = int(ffi.cast("uintptr_t", srq))  # for the batch post in C (_posts)
            ia._srq_owner[self._srq_address] = self
            self._attr = ffi.new("struct ibv_srq_attr *")
            self._refresh_sizes()
            self._sges = ffi.new("struct aiodat_sge[]", _SHIM_MAX_IOV)
            self._posted_n = ffi.new("int *")
            if lw:
                self.set_lw(lw)
        except BaseException:
            self._discard()
            raise

    # -- internals ---------------------------------------------------------
    def _attach(self, ep: "EP") -> None:
        """ep.py: ``ep`` now receives from this SRQ."""
        self._eps[ep] = None

    def _detach(self, ep: "EP") -> None:
        """ep.py: ``ep`` is gone."""
        self._eps.pop(ep, None)

    def _refresh_sizes(self) -> None:
        if lib.ibv_query_srq(self._srq, self._attr):
            raise error_from_errno(ffi.errno, "querying the SRQ (ibv_query_srq)")
        self._max_wr: int = self._attr.max_wr
        self._max_sge: int = self._attr.max_sge

    def _on_async_event(self, name: str) -> None:
        """evd.AsyncSource: the device reported the SRQ limit reached, or the SRQ broken."""
        if name == "IBV_EVENT_SRQ_LIMIT_REACHED":
            self._armed = False  # the device disarmed itself
            self.low_watermark_events += 1
            waiters, self._waiters = self._waiters, []
            woke = False
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
                    woke = True
            if not woke:
                self._lw_fired = True  # keep it for the next low_watermark() call
        elif name == "IBV_EVENT_SRQ_ERR":
            self._state = SRQState.ERROR
            self._fail_waiters(InvalidState("the SRQ went into error (IBV_EVENT_SRQ_ERR)"))

    def _fail_waiters(self, exc: BaseException) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            fail_waiter(fut, exc)

    def _note_evds(self) -> None:
        for ep in self._eps:
            self._evds[ep.recv_evd] = None
        self._eps_seen = len(self._eps)

    def _queued_completions(self) -> int:
        """SRQ receive completions sitting in recv EVDs, not yet dequeued by the consumer."""
        self._note_evds()
        count = 0
        for evd in list(self._evds):
            if evd.closed:
                del self._evds[evd]
                continue
            for event in evd._queued():
                if (isinstance(event, DTOCompletionEvent) and event.ep is not None and event.ep.srq is self
                        and event.operation in (DTOOp.RECV, DTOOp.RECV_RDMA_WRITE_IMM)):
                    count += 1
        return count

    def _receiving(self) -> bool:
        """True if an attached EP may hold SRQ buffers the device has not completed yet."""
        return any(ep.state is not EPState.UNCONNECTED for ep in self._eps)

    def _check_usable(self, what: str) -> None:
        self._check()
        if self._state is SRQState.ERROR:
            raise InvalidState(f"{what}: the SRQ is in error (IBV_EVENT_SRQ_ERR)")

    # -- properties --------------------------------------------------------
    @property
    def ia(self) -> "IA":
        """The IA the SRQ belongs to."""
        return self._ia

    @property
    def pz(self) -> "PZ":
        """The PZ whose LMRs the SRQ's buffers must come from."""
        return self._pz

    @property
    def eps(self) -> Tuple["EP", ...]:
        """The endpoints currently receiving from this SRQ."""
        return tuple(self._eps)

    @property
    def state(self) -> SRQState:
        """OPERATIONAL, or ERROR after the device reported IBV_EVENT_SRQ_ERR."""
        return self._state

    # -- DAT calls ---------------------------------------------------------
    def post_recv(self, segments: "Segments", cookie: Any = None) -> None:
        """Post one receive buffer to the SRQ (dat_srq_post_recv).

        ``segments`` is a Segment (``lmr[a:b]``), an LMR or a list of them, at
        most ``max_recv_iov``, all from LMRs of the SRQ's PZ.  Whichever
        attached EP takes it completes it on that EP's ``recv_evd``, carrying
        ``cookie``.  Raises :class:`aiodat.QueueFull` when the SRQ holds
        ``max_recv_dtos`` buffers.
        """
        self.post_recv_batch([(segments, cookie)])

    def post_recv_batch(self, items: Iterable[Tuple["Segments", Any]]) -> int:
        """Post many receive buffers in one crossing into C; ``items`` are (segments, cookie) pairs.

        Returns how many were posted; if the SRQ fills part way, the ones
        posted stay posted and :class:`aiodat.QueueFull` says how many.

        A list or tuple of ``(segment, cookie)`` tuples each on a single ``Segment`` (the very
        same one, or one each: a pool of buffers being refilled) is checked, posted and
        recorded in one C call (``aiodat._shim._posts``); anything else takes the general path
        below, which is also where every bad argument gets its error.
        """
        done = _c_srq_post_recv_batch(self, self._srq_address, items)
        if type(done) is int:
            return done
        if done is not None:
            raise self._refused(*done)
        segs_column, cookies = _columns(items, 2, "post_recv_batch", "(segments, cookie) pairs")
        batch = [(as_segments(segs), cookie) for segs, cookie in zip(segs_column, cookies)]
        # (once the items are made: a generator or segments iterable runs the program's code, which
        # may have closed the SRQ, and a post to its freed queue would crash the process)
        self._check_usable("post_recv")
        for segs, _ in batch:
            check_post_segments(segs, self._pz, "post_recv", "SRQ", self._max_sge, "max_recv_iov", writes=True)
        total = sum(len(segs) for segs, _ in batch)
        n = len(batch)
        if n == 0:
            return 0
        # what fits goes, as a device posts until its queue is full: the EPs' CQs hold only the SRQ's
        # size of its completions, and rxe would take more (_shim/posts.c's room_in)
        take = min(n, self._max_wr - len(self._posted))
        if take <= 0:
            raise self._refused(0, n, errno.ENOMEM)
        sges = self._sges if total <= _SHIM_MAX_IOV else ffi.new("struct aiodat_sge[]", total)
        ids = ffi.new("uint64_t[]", n)
        starts = ffi.new("int[]", n)
        counts = ffi.new("int[]", n)
        wr_ids = []
        start = 0
        for i, (segs, _) in enumerate(batch):
            wr_id = next(self._ids) * 2 + 1  # receives have odd wr_ids (ep.py routes them here)
            wr_ids.append(wr_id)
            ids[i], starts[i], counts[i] = wr_id, start, len(segs)
            fill_sges(sges, start, segs)
            start += len(segs)
        err = lib.aiodat_post_recv(ffi.NULL, self._srq, ids, starts, counts, take, sges, self._posted_n)
        posted = self._posted_n[0]
        if not err and posted < n:
            err = errno.ENOMEM
        for i in range(posted):
            segs, cookie = batch[i]
            self._posted[wr_ids[i]] = (cookie, segs)
            for seg in segs:
                seg.lmr._inflight += 1
        if err:
            raise self._refused(posted, n, err)
        return posted

    def _refused(self, posted: int, n: int, err: int) -> DATError:
        """The error of a batch the SRQ took only ``posted`` of ``n`` of (the rest refused with ``err``)."""
        if err == 12:  # ENOMEM: the SRQ is full
            return QueueFull(f"post_recv: the SRQ is full: {len(self._posted)} of max_recv_dtos={self._max_wr} "
                             f"buffers held (a buffer holds its place until its completion is taken from the "
                             f"EVD); posted {posted} of {n}")
        return error_from_errno(err, f"post_recv to the SRQ (posted {posted} of {n})")

    def query(self) -> SRQParam:
        """Return the SRQ's parameters and counters (dat_srq_query); unknown counters are None."""
        self._check()
        if lib.ibv_query_srq(self._srq, self._attr):
            raise error_from_errno(ffi.errno, "querying the SRQ (ibv_query_srq)")
        # (a limit of 0 while armed is the device disarming itself: its event is on its way to the
        # async fd, and _on_async_event disarms; clearing _armed here would make a low_watermark()
        # that looks in between refuse to wait for that event)
        limit = self._attr.srq_limit
        not_completed = len(self._posted)
        return SRQParam(
            ia=self._ia, pz=self._pz, state=self._state,
            max_recv_dtos=self._attr.max_wr, max_recv_iov=self._attr.max_sge,
            low_watermark=limit or None,
            available_dto_count=None if self._receiving() else not_completed,
            outstanding_dto_count=not_completed + self._queued_completions(),
        )

    def resize(self, max_recv_dtos: int) -> None:
        """Change the SRQ's size (dat_srq_resize).

        Raises :class:`aiodat.InvalidState` (and leaves the SRQ as it was) if
        more buffers are outstanding (posted and not yet dequeued) than
        ``max_recv_dtos``, or if it is below the armed low watermark.  The
        device may round the size up: :meth:`query` tells the size it gave.
        """
        self._check_usable("resize")
        dev = self._ia._device_attr
        if not isinstance(max_recv_dtos, int) or isinstance(max_recv_dtos, bool) or \
                not 1 <= max_recv_dtos <= dev.max_srq_wr:
            raise InvalidParameter(
                f"max_recv_dtos must be an int between 1 and {dev.max_srq_wr}, got {shown(max_recv_dtos)}")
        outstanding = len(self._posted) + self._queued_completions()
        if max_recv_dtos < outstanding:
            raise InvalidState(f"cannot resize the SRQ to {max_recv_dtos}: {outstanding} buffers are "
                               f"outstanding (posted and not yet dequeued)")
        lw = self.query().low_watermark
        if lw is not None and max_recv_dtos < lw:
            raise InvalidState(f"cannot resize the SRQ to {max_recv_dtos}: below its low watermark {lw}")
        if not dev.device_cap_flags & (1 << 13):  # IBV_DEVICE_SRQ_RESIZE
            if max_recv_dtos <= self._max_wr:
                return  # DAT does not require shrinking
            raise ModelNotSupported(f"{self._ia.device_name} cannot resize SRQs (no SRQ_RESIZE capability)")
        if max_recv_dtos > self._max_wr:  # the recv EVDs of its EPs must hold the larger SRQ (cqsize.py)
            fit_cqs(self._ia, override={("srq", self): max_recv_dtos}, evds=[ep.recv_evd for ep in self._eps],
                    what=f"the SRQ resized to {max_recv_dtos}")
        attr = ffi.new("struct ibv_srq_attr *")
        attr.max_wr = max_recv_dtos
        err = lib.ibv_modify_srq(self._srq, attr, lib.IBV_SRQ_MAX_WR)
        if err:
            if err == 22 and max_recv_dtos < self._max_wr:  # EINVAL: the device holds more than that
                raise InvalidState(f"cannot resize the SRQ to {max_recv_dtos}: the device refused "
                                   f"(it holds more buffers than that)")
            raise error_from_errno(err, f"resizing the SRQ to {max_recv_dtos} (ibv_modify_srq)")
        self._refresh_sizes()

    def set_lw(self, low_watermark: Optional[int]) -> None:
        """Set the low watermark and arm the SRQ for one low-watermark event (dat_srq_set_lw).

        The event comes when an EP takes a buffer and fewer than
        ``low_watermark`` remain on the SRQ: once per call; call ``set_lw``
        again (after refilling) for the next one.  ``None`` or 0
        (DAT_SRQ_LW_DEFAULT) disarms, and a task waiting in
        :meth:`low_watermark` then gets :class:`aiodat.InvalidState`.  Arming forgets an event of the previous
        arming that no :meth:`low_watermark` call has taken (it is still on
        the async EVD).  Raises :class:`aiodat.InvalidParameter` above
        ``max_recv_dtos``.
        """
        self._check_usable("set_lw")
        lw = _check_lw(low_watermark, self._max_wr)
        # An event of the previous arming may wait unread on the async fd: read it now, so that it
        # is taken as that arming's and not as this one's.
        self._ia._async_source.drain()
        attr = ffi.new("struct ibv_srq_attr *")
        attr.srq_limit = lw
        err = lib.ibv_modify_srq(self._srq, attr, lib.IBV_SRQ_LIMIT)
        if err:
            raise error_from_errno(err, f"setting the SRQ limit to {lw} (ibv_modify_srq)")
        self._armed = bool(lw)
        self._lw_fired = False
        if not lw:  # nothing can wake a waiter now: tell it, as low_watermark() would have at its call
            self._fail_waiters(InvalidState("the SRQ's low watermark was disarmed (set_lw(None)) while a task "
                                            "waited for it"))

    async def low_watermark(self, timeout: Optional[float] = None) -> None:
        """Wait for the low-watermark event of the current arming (see :meth:`set_lw`).

        Returns at once if that event already arrived and no earlier call took
        it.  Raises :class:`aiodat.InvalidState` at once if the SRQ is not
        armed and no event is pending (nothing could ever wake the wait), and
        :class:`aiodat.TimeoutExpired` after ``timeout`` seconds.  The same
        event also arrives on ``ia.async_evd`` as ASYNC_SRQ_LOW_WATERMARK.
        Cancelling the wait loses nothing.
        """
        self._check_usable("low_watermark")
        if timeout is not None and not is_timeout(timeout):  # (NaN, or an int no float holds, fails in the timer)
            raise InvalidParameter(f"timeout must be None or >= 0 seconds, got {shown(timeout)}")
        loop = asyncio.get_running_loop()
        ia = self._ia
        ia._attach_loop()
        ia._pump()  # an event may already wait on the async fd
        if self._lw_fired:
            self._lw_fired = False
            return
        if not self._armed:
            raise InvalidState("the SRQ's low watermark is not armed: call srq.set_lw(n) first")
        fut: "asyncio.Future[None]" = loop.create_future()
        self._waiters.append(fut)
        # the timeout is a timer on the future itself, not asyncio.wait_for, which may swallow a
        # cancellation that arrives once the event is in (then this call returns it after all)
        timer = None if timeout is None else loop.call_later(timeout, _expire, fut, timeout)
        taken = False
        try:
            await fut
            taken = True
        finally:
            if timer is not None:
                timer.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)
            if not fut.done():
                if not loop.is_closed():  # (closed: a coroutine finalized after its loop ended)
                    fut.cancel()
            elif not taken and not fut.cancelled() and fut.exception() is None:
                # the event fired for this call, which was cancelled or timed out before it
                # could return: keep it for the next call (cancelling loses nothing)
                self._lw_fired = True

    def free(self) -> None:
        """Free the SRQ (dat_srq_free); refused with InvalidState while EPs use it."""
        self._check()
        self._refuse_close_while(bool(self._eps), f"{len(self._eps)} endpoint(s) still use it")
        self.close()

    def close(self) -> None:
        """Destroy the SRQ, closing first any EP still attached (a QP cannot outlive its SRQ). Idempotent."""
        if not self._closed:
            self._refuse_foreign_thread()  # (before its users are closed)
            first_error: Optional[BaseException] = None
            for ep in list(self._eps):
                try:
                    ep.close()
                except Exception as exc:  # keep going; report the first
                    first_error = first_error or exc
                self._eps.pop(ep, None)
            if first_error is not None:
                super().close()
                raise first_error
        super().close()

    def _release(self) -> None:
        self._fail_waiters(InvalidHandle("the SRQ was freed while a task waited for its low watermark"))
        try:
            if self._srq != ffi.NULL:
                self._ia._srq_owner.pop(self._srq_address, None)
                err = self._raw.release()  # (gone: its Raw's ``then`` has released the buffers still posted)
                self._srq, self._srq_address = ffi.NULL, 0
                if err:
                    # The device still has the SRQ and the receives posted on it (its Raw keeps it and
                    # destroys it on a later retry), so their LMRs stay counted in flight, lmr.free()
                    # refused, as for any request the device holds, until that retry releases them (they
                    # used to stay counted for good: the SRQ is closed, and nothing else released them).
                    raise error_from_errno(err, "destroying the SRQ (ibv_destroy_srq)")
        finally:
            if self._raw.ptr == ffi.NULL:  # destroyed (a half-made SRQ posted nothing)
                # again if its Raw's ``then`` ran out of memory part way: this SRQ is closed, and
                # nothing else would release the rest
                _release_posted(self._posted)

    def __repr__(self) -> str:
        if self._closed:
            return "<aiodat.SRQ closed>"
        return f"<aiodat.SRQ max_recv_dtos={self._max_wr} posted={len(self._posted)} eps={len(self._eps)}>"


def _release_posted(posted: Dict[int, Tuple[Any, Tuple[Segment, ...]]]) -> None:
    """The SRQ is gone: its posted buffers are the device's no more (their LMRs can be freed).

    Each receive is released whole or not at all, so a call that ran out of memory part way can be
    made again: what can allocate comes first, then the entry goes (held: freeing its cookie may run
    code that changes a count), then the counts are written (a KeyboardInterrupt between two writes
    leaves them high, never lowered for an entry still there, which a second call would lower again).
    """
    while posted:
        wr_id = next(iter(posted))
        lowered = {lmr: lmr._inflight - n for lmr, n in _lmr_counts((posted[wr_id][1],)).items()}
        writes = iter(lowered.items())  # (made before the entry goes)
        entry = posted.pop(wr_id)
        for lmr, count in writes:
            lmr._inflight = count
        del entry  # (its cookie's release last)


def _expire(fut: "asyncio.Future[None]", timeout: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutExpired(f"no SRQ low-watermark event within {timeout}s"))


def _check_lw(low_watermark: Optional[int], max_recv_dtos: int) -> int:
    if low_watermark is None:
        return 0
    if not isinstance(low_watermark, int) or isinstance(low_watermark, bool) or \
            not 0 <= low_watermark <= max_recv_dtos:
        raise InvalidParameter(
            f"low_watermark must be None or an int between 0 and max_recv_dtos ({max_recv_dtos}), "
            f"got {shown(low_watermark)}")
    return low_watermark
