"""Event Dispatchers: where completions, connection events and async errors become events.

An EVD is a queue of immutable events fed by any DAT stream:

* DTO and RMR-bind completions come from the EVD's CQ.  Its completion
  channel fd is non-blocking and watched by the running loop; a wake-up drains
  in one C call (read and ack the channel event, poll the CQ) and leaves the CQ
  unarmed with the loop's poller (poller.py), which polls it once per turn of
  the loop while completions keep coming and arms it when they stop (NAPI).
* Connection and connection-request events are routed here by cm.py.
* Software events come from :meth:`EVD.post_se`.
* The IA's asynchronous EVD is fed by the device's async fd (:class:`AsyncSource`).

``await evd.wait(threshold)`` returns at least ``threshold`` events;
``evd.dequeue()`` never blocks; ``async for ev in evd`` streams them.  A waiter
that is cancelled takes nothing: its events stay queued for the next wait.
Instead of waits, ``evd.set_callback(fn)`` hands each batch of events to
``fn(events)`` from inside the loop's reader callback (the Access Layer's
completion callback).  ``busy_poll_us`` keeps the CQ with the poller for a
while after the last completion, spinning on it in C when nothing else came,
before the CQ is armed and the EVD sleeps.

Capacity (qlen): completions are polled from the CQ only while the EVD has
room, so the rest wait in the CQ, losing nothing; a CQ that itself overruns
raises an EVD overflow event on the async EVD.  Connection events are never
dropped: one that arrives when the EVD is full is queued anyway and an
ASYNC_ERROR_EVD_OVERFLOW event tells the async EVD.  ``post_se`` on a full
EVD raises :class:`aiodat.QueueFull`.
"""
from __future__ import annotations

import asyncio
import enum
import inspect
import struct
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
import time
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Deque, Generic, List, Optional, Tuple, TypeVar

from aiodat._fdwatch import FdWatch
from aiodat._handle import Handle, Raw, fail_waiter
from aiodat._lib import ffi, lib
from aiodat._shim import _completions
from aiodat.poller import MAX_BUSY_POLL_US, Poller, poller_for
from aiodat.errors import (
    DTOError,
    InsufficientResources,
    InvalidHandle,
    InvalidParameter,
    InvalidState,
    QueueFull,
    TimeoutExpired,
    error_from_errno,
    shown,
)

if TYPE_CHECKING:
    from aiodat.cm import CR, PSP
    from aiodat.ep import EP
    from aiodat.ia import IA
    from aiodat.memory import RMR


class EvdFlags(enum.IntFlag):
    """The event streams an EVD accepts (DAT_EVD_*_FLAG)."""

    SOFTWARE = 0x01
    CR = 0x10
    DTO = 0x20
    CONNECTION = 0x40
    RMR_BIND = 0x80
    ASYNC = 0x100
    DEFAULT = DTO | RMR_BIND
    ALL = SOFTWARE | CR | DTO | CONNECTION | RMR_BIND


_KNOWN_STREAMS = int(EvdFlags.ALL | EvdFlags.ASYNC)


_new, _setattr = object.__new__, object.__setattr__  # build frozen events without their __init__

#: an EP's ``_taken`` when no take of a completion of it is under way (wr.py notes the event there
#: before it takes the completion's entry: see EVD._queue_one)
class _NotTaken:
    def __repr__(self) -> str:
        return "<not taken>"


_NOT_TAKEN: Any = _NotTaken()


#: the streams that come through a CQ: an EVD fed by one of them has a CQ of its own
_CQ_STREAMS = int(EvdFlags.DTO | EvdFlags.RMR_BIND)


class EventType(enum.IntEnum):
    """DAT event numbers (DAT_EVENT_NUMBER); aiodat's own async events are numbered from 0x20001."""

    DTO_COMPLETION = 0x00001
    RMR_BIND_COMPLETION = 0x01001
    CONNECTION_REQUEST = 0x02001
    CONNECTION_EVENT_ESTABLISHED = 0x04001
    CONNECTION_EVENT_PEER_REJECTED = 0x04002
    CONNECTION_EVENT_NON_PEER_REJECTED = 0x04003
    CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR = 0x04004
    CONNECTION_EVENT_DISCONNECTED = 0x04005
    CONNECTION_EVENT_BROKEN = 0x04006
    CONNECTION_EVENT_TIMED_OUT = 0x04007
    CONNECTION_EVENT_UNREACHABLE = 0x04008
    ASYNC_ERROR_EVD_OVERFLOW = 0x08001
    ASYNC_ERROR_IA_CATASTROPHIC = 0x08002
    ASYNC_ERROR_EP_BROKEN = 0x08003
    ASYNC_ERROR_TIMED_OUT = 0x08004
    ASYNC_ERROR_PROVIDER_INTERNAL_ERROR = 0x08005
    SOFTWARE_EVENT = 0x10001
    # aiodat's async events for what verbs and rdma_cm report beyond DAT 1.2:
    ASYNC_SRQ_LOW_WATERMARK = 0x20001
    ASYNC_SRQ_ERROR = 0x20002
    ASYNC_PORT_ACTIVE = 0x20003
    ASYNC_PORT_ERROR = 0x20004
    ASYNC_LID_CHANGE = 0x20005
    ASYNC_PKEY_CHANGE = 0x20006
    ASYNC_GID_CHANGE = 0x20007
    ASYNC_SM_CHANGE = 0x20008
    ASYNC_CLIENT_REREGISTER = 0x20009
    ASYNC_EP_LAST_WQE_REACHED = 0x2000A
    ASYNC_EP_COMM_ESTABLISHED = 0x2000B
    ASYNC_EP_SQ_DRAINED = 0x2000C
    ASYNC_EP_PATH_MIGRATED = 0x2000D
    ASYNC_DEVICE_REMOVAL = 0x2000E
    ASYNC_ADDRESS_CHANGE = 0x2000F


class DTOOp(enum.Enum):
    """What a completed data-transfer operation was."""

    SEND = "send"
    RECV = "recv"
    RDMA_WRITE = "rdma_write"
    RDMA_READ = "rdma_read"
    COMPARE_SWAP = "compare_swap"
    FETCH_ADD = "fetch_add"
    BIND = "bind"
    UNBIND = "unbind"
    RECV_RDMA_WRITE_IMM = "recv_rdma_write_imm"


@dataclass(frozen=True)
class Event:
    """Base of every event: its DAT type and the EVD it was dequeued from."""

    type: EventType
    evd: "EVD" = field(repr=False)


@dataclass(frozen=True)
class DTOCompletionEvent(Event):
    """A data transfer completed (DAT_DTO_COMPLETION_EVENT).

    ``status`` is the ibv_wc_status name ("IBV_WC_SUCCESS", "IBV_WC_WR_FLUSH_ERR", ...).
    ``imm_data`` is the immediate data of a receive that carried one.
    For UD receives, ``src_qp`` is the sender's QP number.
    """

    ep: "EP"  # (always there: completions of an EP the program dropped are not turned into events)
    cookie: Any
    status: str
    transferred_length: int
    operation: DTOOp
    imm_data: Optional[int] = None
    vendor_err: int = 0
    src_qp: Optional[int] = None
    #: False for a completion posted with CompletionFlags.UNSIGNALLED: it is queued
    #: but does not wake a waiting task by itself (DAT's unsignalled notification)
    notify: bool = field(default=True, repr=False, compare=False)

    @classmethod
    def _completed(cls, evd: "EVD", ep: Any, cookie: Any, status: str, length: int, op: DTOOp,
                   imm: Optional[int], vendor_err: int, src_qp: Optional[int],
                   notify: bool) -> "DTOCompletionEvent":
        """Build one event per completion on the hot path: a single dict update instead of the
        frozen dataclass __init__, which sets each field through object.__setattr__."""
        event = _new(cls)
        _setattr(event, "__dict__", {
            "type": _DTO_COMPLETION, "evd": evd, "ep": ep, "cookie": cookie, "status": status,
            "transferred_length": length, "operation": op, "imm_data": imm, "vendor_err": vendor_err,
            "src_qp": src_qp, "notify": notify})
        return event

    @property
    def ok(self) -> bool:
        """True when the transfer succeeded."""
        return self.status == "IBV_WC_SUCCESS"

    @property
    def flushed(self) -> bool:
        """True when the request was flushed because its EP left the connected state."""
        return self.status == "IBV_WC_WR_FLUSH_ERR"

    def raise_for_status(self) -> "DTOCompletionEvent":
        """Return self if the transfer succeeded, else raise :class:`aiodat.DTOError` naming the status."""
        if not self.ok:
            op = self.operation.value if self.operation else "request"
            raise DTOError(
                f"{op} with cookie {shown(self.cookie)} failed: {self.status}",
                status=self.status,
                vendor_err=self.vendor_err,
            )
        return self


@dataclass(frozen=True)
class RMRBindEvent(Event):
    """A memory window bind or unbind completed (DAT_RMR_BIND_COMPLETION_EVENT)."""

    rmr: "RMR"
    cookie: Any = None
    status: str = "IBV_WC_SUCCESS"
    rmr_context: Optional[int] = None
    notify = True  # (a class attribute, not a field) it always ends a wait, as DTO events do by default

    @property
    def ok(self) -> bool:
        """True when the bind succeeded."""
        return self.status == "IBV_WC_SUCCESS"


@dataclass(frozen=True)
class ConnectionRequestEvent(Event):
    """A peer asks to connect (DAT_CONNECTION_REQUEST_EVENT); answer ``cr`` with accept or reject."""

    cr: "CR"
    psp: "PSP"

    @classmethod
    def _made(cls, evd: "EVD", cr: "CR", psp: "PSP") -> "ConnectionRequestEvent":
        """Build one per request (cm.py) with a single dict, as DTO events are built."""
        event = _new(cls)
        _setattr(event, "__dict__", {"type": EventType.CONNECTION_REQUEST, "evd": evd, "cr": cr, "psp": psp})
        return event


@dataclass(frozen=True)
class ConnectionEvent(Event):
    """A connection changed state (DAT_CONNECTION_EVENT_*); ``private_data`` is the peer's, if any."""

    ep: "EP"
    private_data: bytes = b""
    reason: str = ""

    @classmethod
    def _made(cls, etype: EventType, evd: Optional["EVD"], ep: "EP", private_data: bytes,
              reason: str) -> "ConnectionEvent":
        """Build one per connection step (cm.py) with a single dict, as DTO events are built."""
        event = _new(cls)
        _setattr(event, "__dict__", {"type": etype, "evd": evd, "ep": ep, "private_data": private_data,
                                     "reason": reason})
        return event


@dataclass(frozen=True)
class SoftwareEvent(Event):
    """An event the application posted itself (DAT_SOFTWARE_EVENT)."""

    payload: Any = None


@dataclass(frozen=True)
class AsyncEvent(Event):
    """An asynchronous event of the IA: ``obj`` is the EP, EVD, SRQ or IA it concerns."""

    obj: Any = None
    port: Optional[int] = None
    reason: str = ""


#: the events an EVD yields, for a type checker: ``ia.create_evd(n, EvdFlags.DTO)`` is an
#: ``EVD[DTOCompletionEvent]``, an EVD of several streams an ``EVD[Event]`` (narrow with isinstance)
E = TypeVar("E", bound=Event, covariant=True)


class EVD(Handle, Generic[E]):
    """An Event Dispatcher (dat_evd_create): a queue of events from one or more streams.

    For a type checker an EVD is generic in the events it yields: an EVD of one stream
    (``EvdFlags.DTO``, ``CR``, ``CONNECTION``, ``RMR_BIND`` or ``SOFTWARE``) yields that stream's
    event class only, so ``(await evd.wait_one()).raise_for_status()`` type-checks; an EVD of
    several streams is an ``EVD[Event]``.
    """

    _kind = "evd"
    _taken_past = False  # _queue_one queued an interrupted take's event: _take_backlog moves past it
    _close_rank = 20  # after PZs (and the EPs inside them), so QPs go before their CQs

    def __init__(self, ia: "IA", qlen: int, streams: Optional[EvdFlags] = None, *, _is_async: bool = False,
                 comp_vector: Optional[int] = None, busy_poll_us: int = 0) -> None:
        _check_qlen(qlen, ia)
        if streams is not None and (not isinstance(streams, int) or isinstance(streams, bool)):
            raise InvalidParameter(f"streams must be EvdFlags, not {type(streams).__name__}")
        if streams is not None and (streams <= 0 or streams & ~_KNOWN_STREAMS):
            # (as an int, 0 would take nothing, -1 every stream, and an unknown bit would stay)
            raise InvalidParameter(f"streams must be one or more EvdFlags, got {shown(streams)}")
        streams = EvdFlags.ALL if streams is None else EvdFlags(streams)
        vectors = ia._context.num_comp_vectors
        if comp_vector is not None and (not isinstance(comp_vector, int) or isinstance(comp_vector, bool)
                                        or not 0 <= comp_vector < max(vectors, 1)):
            raise InvalidParameter(f"comp_vector must be None or between 0 and {max(vectors, 1) - 1} "
                                   f"(the device has {vectors} completion vectors), got {comp_vector!r}")
        _check_busy_poll_us(busy_poll_us)
        _check_busy_poll_streams(busy_poll_us, streams)
        super().__init__(ia)
        self._ia = ia
        self._qlen = qlen
        has_cq = int.__and__(streams, _CQ_STREAMS)  # (a plain int: IntFlag's & builds an enum member)
        self._busy_poll_us = busy_poll_us  # (the C poller reads it every turn)
        #: a busy-polling EVD stays with the loop's poller until then (monotonic; see poller.py)
        self._busy_until = 0.0
        self._poller: Optional[Poller] = None  # the poller of the loop watching the channel
        self._arm_retried = False  # the poller's arm failed once and is being tried again
        #: set_callback's function and the loop it runs in; None: events wait for wait()/dequeue()
        self._callback: Optional[Callable[[List[Any]], Any]] = None
        self._callback_loop: Optional[asyncio.AbstractEventLoop] = None
        self._on_error: Optional[Callable[[BaseException], Any]] = None
        self._cq_bound: Optional[int] = None  # an upper bound of what may complete at once (cqsize.py)
        self._delivery_scheduled = False
        self._attached_loop: Optional[asyncio.AbstractEventLoop] = None  # see _attach
        self._streams = streams
        self._is_async = _is_async
        #: other IAs whose async events this (async) EVD receives: open_ia(..., async_evd=this)
        self._sharers: "weakref.WeakSet[IA]" = weakref.WeakSet()  # (weak: a dropped IA is released, as any)
        self._queue: Deque[Any] = deque()  # (Any: what E each EVD holds is the type checker's business)
        self._waiter: Optional["asyncio.Future[None]"] = None
        #: the task of the current wait (None if it was being cancelled already when the wait
        #: began): once it is being cancelled the EVD is free for another wait (see _waited)
        self._waiter_task: Optional["asyncio.Task[Any]"] = None
        self._threshold = 1
        # The waits' timeout timer, kept across waits (see _set_deadline): the current wait's
        # deadline and timeout, the timer and when it fires (None: no timer pending)
        self._deadline: Optional[float] = None
        self._wait_timeout = 0.0
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_when = 0.0
        self._solicited = False  # a solicited-only wait is in progress
        self._armed_solicited = False  # the CQ's current arm is for solicited completions only
        self._solicited_hit = False
        self._overflow_reported = False
        #: how many events arrived while the EVD was full (reported on the async EVD)
        self.overflow_count = 0
        self._channel: Any = ffi.NULL
        self._cq: Any = ffi.NULL
        self._watch: Optional[FdWatch] = None
        self._wcs: Any = None
        # what _completions reads: the addresses (0: none) of the CQ, the completion array, the
        # channel and the drain's status, the IA's table of EPs by QP number, and where it leaves
        # a poll it did not finish
        self._cq_address = self._wcs_address = self._channel_address = self._status_address = 0
        self._qpn_refs = ia._qpn_owner.data  # type: ignore[attr-defined]  # (the WeakValueDictionary's weak refs)
        self._polled: Tuple[int, int, int] = (0, 0, 0)
        # Completions polled from the CQ whose events are not queued yet stay where the poll put
        # them, in _wcs[_wc_next:_backlog] (0: none), and every drain takes them first: the CQ is
        # not polled again (into the same array) until they are.  Both are set with small ints
        # and no allocation, so a MemoryError anywhere in taking completions loses none of them.
        self._backlog = 0
        self._wc_next = 0
        # True while polled completions are being taken in Python (C notes its own takes itself:
        # _taking_in_c): a finalizer their entries run (a cookie's, which may reset or close an EP
        # of this EVD) must not take them again.  (A Python take has its backlog noted meanwhile,
        # which keeps C's look off the CQ.)
        self._taking = False
        self._taken_past = False  # (made here: _queue_one's store into it must not allocate)
        # a callback EVD's drain of its backlog again after a failure (_callback_failed): one at a time
        self._backlog_retry: Optional[asyncio.TimerHandle] = None
        #: a failure of the reader callback with no task waiting: raised by the next wait or dequeue
        self._pending_error: Optional[BaseException] = None
        self._unarmed = False  # the last arm failed: arm again before anyone sleeps
        self._arm_error: Optional[BaseException] = None
        self._rearms = 0  # how many times the CQ was armed (at most once per wake-up)
        #: awaited requests (rmr.bind) whose completion comes through this EVD's CQ: polled even when full
        self._awaited = 0
        if has_cq:
            #: the completion vector (interrupt) of the EVD's CQ; by default EVDs take the device's in turn
            self.comp_vector: Optional[int] = ia._next_comp_vector() if comp_vector is None else comp_vector
            self._create_cq()
        else:
            self.comp_vector = None

    @classmethod
    def _create_async(cls, ia: "IA", qlen: int) -> "EVD":
        return cls(ia, qlen, EvdFlags.ASYNC, _is_async=True)

    def _create_cq(self) -> None:
        """Make the channel, the CQ and what the drain uses; a failure at any step closes the EVD
        (what was made is freed, and the IA lets go of it) and raises."""
        ia = self._ia
        # the drain's arrays first: _release drains the CQ it destroys
        self._wcs = ffi.new("struct aiodat_wc[]", 64)
        self._wc_bytes = ffi.buffer(self._wcs)
        self._wcs_address = int(ffi.cast("uintptr_t", self._wcs))
        self._status = ffi.new("int[3]")  # channel events read, arm errno, completions copied (aiodat_cq_drain)
        self._status_address = int(ffi.cast("uintptr_t", self._status))
        try:
            channel = lib.ibv_create_comp_channel(ia._context)
            if channel == ffi.NULL:
                raise error_from_errno(ffi.errno, "creating a completion channel")
            self._raw_channel = Raw(channel, lib.ibv_destroy_comp_channel, "completion channel", ia._raw)
            self._channel = channel  # (set once its Raw is: _release frees what is set)
            cq = lib.ibv_create_cq(ia._context, self._qlen, ffi.NULL, channel, self.comp_vector)
            if cq == ffi.NULL:
                raise InsufficientResources(f"ibv_create_cq({self._qlen}) failed (errno {ffi.errno})")
            self._raw_cq = Raw(cq, lib.ibv_destroy_cq, "CQ", self._raw_channel)  # the CQ goes first
            self._cq = cq
            ia._cq_owner[int(ffi.cast("uintptr_t", self._cq))] = self
            self._cq_address = int(ffi.cast("uintptr_t", self._cq))
            self._channel_address = int(ffi.cast("uintptr_t", self._channel))
            # the loop keeps the channel (its fd) while it watches it, even if this EVD is dropped
            self._watch = FdWatch(self._channel.fd, self._on_readable, "completion channel", keep=self._raw_channel)
            if lib.ibv_req_notify_cq(self._cq, 0):
                raise error_from_errno(ffi.errno, "arming the CQ")
        except BaseException:
            self._discard()
            raise

    # -- feeding the queue -------------------------------------------------
    def _drain_cq(self, rearm: bool = True, spin_us: int = 0, arm_if_unarmed: bool = True,
                  napi: bool = False) -> bool:
        """Move completions from the CQ into the queue while there is room (one C call per 64).

        With ``rearm`` the channel's event is read and acked and the CQ
        re-armed, in the first call only: once per wake-up, however many
        chunks follow.  The reader callback's drain (``napi``) arms lazily
        instead: it leaves the CQ unarmed and the caller hands the EVD to the
        loop's poller (poller.py), which arms it only when completions stop
        coming, so a busy consumer takes no interrupts.  A CQ whose last arm
        failed (or was left unarmed) is armed again by any drain that is not a
        spin (or told not to: ``arm_if_unarmed``).
        ``spin_us``: poll for up to that long in C when the CQ is empty (busy polling).  Completions polled but not yet turned into
        events when something raised stay in ``_backlog`` and come first next
        time (see _queue_backlog).  While an awaited request (``rmr.bind``) is outstanding the CQ is
        polled even when the EVD is full, so its completion cannot be stranded
        behind the EVD's capacity.  Returns True when an event that notifies
        arrived (anything but an UNSIGNALLED completion).
        """
        wcs = self._wcs
        if wcs is None or self._taking or _taking_in_c(self):  # (a finalizer run by a take, Python's or
            return False  # C's: the take under way takes the rest)
        notified = False
        if self._backlog:  # (raises with what is left still there: the CQ is not polled over it)
            notified = self._queue_backlog()
        queue = self._queue
        queued, counted = len(queue), self.overflow_count
        polled_past = False  # polled beyond qlen for an awaited request, in any chunk
        interrupt: Optional[BaseException] = None
        channel = self._channel if rearm else _NULL
        lazy = napi and not self._solicited
        if rearm:
            arm = -1 if lazy else (1 if self._solicited else 0)
        else:
            arm = (1 if self._solicited else 0) if self._unarmed and arm_if_unarmed and not spin_us else -1
        while True:
            if self._awaited:
                polled_past = True  # (noted before the poll: the awaited completion lowers _awaited)
                room = 64
            else:
                room = self._qlen - len(queue)
                if room > 64:
                    room = 64
                elif room < 0:
                    room = 0
            try:
                if spin_us and room:
                    got = lib.aiodat_cq_spin(self._cq, wcs, room, spin_us, self._status)
                    spin_us = 0
                else:
                    got = lib.aiodat_cq_drain(channel, self._cq, arm, wcs, room, self._status)
            except BaseException as exc:  # a signal handler's, run at the call's return (CPython looks for
                # signals there, not before the call, from 3.10): got is lost, but C noted it in _status
                got, interrupt = self._status[2], exc
            if got > 0:
                self._backlog = got  # first: what was polled is kept whatever fails from here
            try:  # the arm is noted first, while _status is this drain's
                if arm >= 0:
                    if self._status[1] or arm or self._armed_solicited:
                        self._note_arm(bool(arm), channel is not _NULL)
                    else:  # the common case of _note_arm, inline: an arm for every completion worked
                        self._rearms += 1
                        self._unarmed = False
                    arm = -1
                elif channel is not _NULL and lazy:
                    self._unarmed = True  # the wake-up consumed the arm: whoever sleeps next arms first
                    self._arm_error = None
            finally:  # what was polled becomes events even when that failed (a KeyboardInterrupt)
                channel = _NULL
                if got > 0 and self._queue_polled(got):
                    notified = True
            if interrupt is not None:  # (its arm noted, its completions queued: as if it came after)
                try:
                    raise interrupt
                finally:  # (its traceback holds this frame: no cycle through the local)
                    interrupt = None
            if got < 0:
                raise error_from_errno(-got, "polling the CQ")
            if got < room or room == 0:
                # the events this drain queued over qlen, less those _push counted itself (a BROKEN)
                over = len(queue) - max(self._qlen, queued) - (self.overflow_count - counted)
                if polled_past and over > 0:
                    self._report_overflow(queue[-1], over)
                return notified

    def _poll(self) -> bool:
        """A look with no system call and no arm, in one C call in the common case
        (_completions.look): a wait's first look and the poller's.  True when an event that
        notifies arrived (see _drain_cq).  An unarmed CQ is left to the poller, which a wait
        hands it to if it sleeps."""
        found = _look(self)
        if found >= 0:
            return found == 1
        return self._poll_rest(found)

    def _poll_rest(self, found: int) -> bool:
        """_poll after C's look left the work to Python (``found``: -1 or -2, see _completions.look);
        also called from C (_completions: the poller's look and a wait's)."""
        if found == -1:  # not the common case: nothing was polled
            if self._closed:
                return False
            return self._drain_cq(rearm=False, arm_if_unarmed=False)
        # completions were polled that C left to Python
        got, _, notified = self._polled
        if got < 0:
            raise error_from_errno(-got, "polling the CQ")
        notified = self._queue_backlog() or notified  # (C noted what it did not take as the backlog)
        if got == 64:  # more may wait: the full drain takes them
            notified = self._drain_cq(rearm=False, arm_if_unarmed=False) or notified
        return bool(notified)

    def _note_arm(self, solicited: bool, read_channel: bool) -> None:
        """After an arm: remember a failure (the next sleeper must arm again), and for
        solicited waits which kind of arm is in place."""
        self._rearms += 1
        err = self._status[1]
        if err:
            self._unarmed = True
            self._arm_error = error_from_errno(err, "arming the CQ (ibv_req_notify_cq, tried twice)")
            self._armed_solicited = False
            return
        was_unarmed, self._unarmed = self._unarmed, False
        if solicited or self._armed_solicited:
            self._note_solicited_arm(solicited, read_channel and self._status[0] > 0, was_unarmed)

    def _note_solicited_arm(self, solicited: bool, fired: bool, was_unarmed: bool = False) -> None:
        """After a re-arm, for solicited waits.  Verbs cannot narrow an armed CQ, so a channel
        event counts as solicited only when the arm it consumed was made solicited-only, and
        the new arm is narrow only when no other was in place: the previous one was consumed
        (now, or by an earlier wake-up that left the CQ unarmed), or was narrow already."""
        was_solicited_arm = self._armed_solicited
        if solicited and fired and was_solicited_arm:
            self._solicited_hit = True
        self._armed_solicited = solicited and (fired or was_solicited_arm or was_unarmed)

    def _queue_polled(self, got: int) -> bool:
        """Turn the ``got`` completions just polled into ``_wcs`` (the backlog: _drain_cq noted it)
        into events; True if one of them notifies.  The leading common-case ones are done in C
        (aiodat/_shim/completions.c: a success that is the oldest request of its EP's queue, or a
        send after suppressed ones), which moves the backlog past them itself, the rest from the
        first other one on by _queue_backlog."""
        self._taking = True
        try:
            taken, notified = _queue_common(self, self._wcs_address, got, self._qpn_refs, self._queue)
        finally:
            self._taking = False
        if taken < got:  # (C noted it too, in case its answer could not be made)
            self._wc_next = taken
            return self._queue_backlog() or bool(notified)
        self._backlog = 0
        return bool(notified)

    def _queue_backlog(self) -> bool:
        """Turn the polled completions in ``_wcs[_wc_next:_backlog]`` into events, in order; True
        if one of them notifies.  Each is taken whole or not at all: its event is given its place
        in the queue first, then its request's entry is taken (wr.py: only steps that allocate
        nothing, after everything that can fail), then the backlog moves past it.  So when one
        raises (a MemoryError), it and those after it stay in the backlog for the next drain:
        none is lost, none is taken twice."""
        if self._taking or _taking_in_c(self):  # (a finalizer run by a take: the outer loop takes the rest)
            return False
        self._taking = True
        try:
            return self._take_backlog()
        finally:
            self._taking = False

    def _take_backlog(self) -> bool:
        notified = False
        queue, refs, wcs = self._queue, self._ia._qpn_owner.data, self._wc_bytes  # type: ignore[attr-defined]
        queue_one, unpack = self._queue_one, _WC.unpack_from
        qpn = ep = None  # a batch mostly comes from one QP: look its EP up once
        # The backlog moves past each completion as it is taken: ``at`` is written back to
        # _wc_next when the loop ends, raising or not (an int of at most 64, cached: no
        # allocation), once per batch, not per completion.  Nothing reads _wc_next meanwhile: a
        # drain a finalizer starts (_taking) leaves the backlog alone, and nothing else moves it.
        at, end = self._wc_next, self._backlog
        wc: Any = None
        try:
            while at < end:
                wc = unpack(wcs, at * _WC_SIZE)
                if wc[_WC_QP_NUM] != qpn:
                    ref = refs.get(wc[_WC_QP_NUM])
                    ep = ref() if ref is not None else None
                    qpn = wc[_WC_QP_NUM]
                if ep is not None and queue_one(ep, wc, queue):
                    notified = True
                at += 1
                wc = None  # (taken: a failure of the next unpack names none)
        except BaseException as exc:  # (a KeyboardInterrupt too)
            if self._taken_past:  # (_queue_one queued its event: the entry was gone when it raised)
                self._taken_past = False
                at += 1
                wc = None
            self._wc_next = at
            if wc is not None and hasattr(exc, "add_note"):  # (else its unpack failed: it is named
                # by none; add_note is Python 3.11's)
                exc.add_note(f"aiodat: the completion of wr_id {wc[0]:#x} on QP {wc[_WC_QP_NUM]} could not be "
                             f"turned into an event; it and {end - at - 1} later "
                             f"completion(s) are kept for the next wait or drain")
            raise
        self._backlog = self._wc_next = 0
        return notified

    def _queue_one(self, ep: Any, wc: Any, queue: Any) -> bool:
        """Queue the event of one completion of ``ep``; True if it notifies.  Raises with nothing
        changed (the queue as it was, the entry not taken), or queues it with the entry taken.

        wr.py notes the event in ``ep._taken`` just before it takes the entry (no step that can
        run Python or raise comes between).  A failure after that (a KeyboardInterrupt a signal
        handler raises in the steps after the take, a drain marker's callback) finds it noted:
        the event is queued all the same and the failure goes on up, with ``_taken_past`` telling
        _take_backlog to move past the completion (its retry found no entry: the event was lost,
        or a receive's came again with no cookie)."""
        place = len(queue)
        queue.append(None)  # the event's place, made first: a deque's append may need a block
        outer = ep._taken  # (a take of the EP's by its other EVD, under way: a finalizer it ran drains here)
        ep._taken = _NOT_TAKEN
        failure = None
        try:
            event = ep._completion_event(wc, self)
        except BaseException as exc:  # (a KeyboardInterrupt too; _take_backlog notes it)
            event, failure = ep._taken, exc
        ep._taken = outer
        if event is None or event is _NOT_TAKEN:
            # the place is taken back here, by steps that allocate nothing and call no Python
            # function (an interrupt at its entry left an empty place in the queue; a deque's del
            # rotates it, which may need a block and stop part way)
            if queue[-1] is not None:  # its EP's BROKEN was pushed after it (wr.py: _on_async_error,
                queue[-2] = queue[-1]  # one event at most): it moves into the place
            queue.pop()
        else:
            # (an error completion that broke its EP had its BROKEN, this EVD taking connection
            # events too, pushed after this place: the cause comes first)
            queue[place] = event  # (first: nothing before it may fail)
            if wc[_WC_STATUS]:
                self._solicited_hit = True  # an error completion always notifies
        if failure is not None:
            if event is not _NOT_TAKEN:
                self._taken_past = True  # (an attribute __init__ made: its store allocates nothing)
            try:
                raise failure
            finally:  # (its traceback holds this frame: no cycle through the local)
                failure = None
        if event is None:
            return False
        return True if wc[_WC_STATUS] else event.notify

    def _on_readable(self) -> None:
        """The loop's reader callback for the completion channel: one C call (_completions.wakeup)
        that reads the channel's event, drains the CQ, delivers or wakes, and hands the unarmed CQ
        to the loop's poller; what is not its common case it leaves to _woken."""
        _wakeup(self)

    def _woken(self) -> None:
        """The reader callback in Python (see _on_readable).  Never raises into the loop: a
        failure goes to the waiting task, or to the next wait or dequeue if none waits."""
        if self._closed:
            return
        if self._callback is not None:
            self._callback_wakeup()
            return
        try:
            # (_solicited_hit: the channel event of a solicited completion the poller has taken
            # already, which this drain finds no more; _wake ends a solicited wait with it)
            if self._wake_due(self._drain_cq(napi=True)) or self._solicited_hit:
                self._wake()
        except Exception as exc:
            self._wake(exc)
        if self._unarmed:  # (also after a failure: the CQ must be armed or polled)
            self._napi_add()

    # -- the loop's poller (poller.py) ---------------------------------------
    def _napi_add(self) -> None:
        """Hand the unarmed CQ to the poller of the loop watching it (or arm it now, with no loop)."""
        watch = self._watch
        loop = watch._loop if watch is not None else None
        if loop is None:
            self._napi_arm()
            return
        poller = self._poller
        if poller is None or poller._loop is not loop:
            if poller is not None:  # the EVD moved to another loop after its first one closed
                poller.discard(self)
            poller = self._poller = poller_for(loop)
        if self._busy_poll_us:
            self._busy_until = _monotonic() + self._busy_poll_us * 1e-6
        if not poller.add(self):
            self._napi_arm()

    def _napi_spin(self, spin_us: int) -> bool:
        """The poller's spin on a busy-polling EVD: poll the CQ for up to ``spin_us`` microseconds
        without arming it and hand what came to the callback or the waiting task.  True if a
        completion that notifies came.  Never raises: a failure goes where the reader callback's
        would.  (The poller's plain look is C: _completions.turn.)"""
        if self._closed:  # (a callback earlier in the poller's turn may have freed it)
            return False
        try:
            notified = self._drain_cq(rearm=False, spin_us=spin_us, arm_if_unarmed=False)
        except Exception as exc:
            self._napi_failed(exc, "polling the CQ")
            return False
        self._hand_over(notified)
        return notified

    def _napi_arm(self) -> bool:
        """The poller is done with this EVD: arm its CQ, then look once more (what raced the arm).
        (The turn's common case is C: _completions' napi_arm, which calls this for the rest.)
        A failed arm is tried again after the poller's next turns (True: keep polling); when
        that fails too, it goes to the callback's on_error or the waiting task, and a later wait
        or wake-up tries again."""
        if self._closed or self._wcs is None:
            return False
        try:
            self._hand_over(self._drain_cq(rearm=False))
        except Exception as exc:
            self._napi_failed(exc, "polling the CQ")
        return self._napi_arm_retry()

    def _napi_arm_retry(self) -> bool:
        """After the poller's arm (here or in C: _completions.turn): True to keep polling and try
        the arm again."""
        if not self._unarmed:
            self._arm_retried = False
            return False
        if not self._arm_retried:
            self._arm_retried = True
            return True
        self._arm_retried = False
        # to the callback's on_error, the waiting task, or (nobody waits) the next wait or dequeue
        self._napi_failed(self._arm_error or InvalidState("the CQ could not be armed"), "arming the CQ")
        return False

    def _hand_over(self, notified: bool) -> None:
        """After the poller's look: deliver to the callback, or wake the waiting task."""
        if notified and self._busy_poll_us:
            self._busy_until = _monotonic() + self._busy_poll_us * 1e-6
        if self._callback is not None:
            if self._queue:
                self._deliver()
        elif self._wake_due(notified):
            self._wake()

    def _wake_due(self, notified: bool) -> bool:
        """Whether a drain's end may wake the waiting task: an event that notifies came, or the
        queue is full (UNSIGNALLED completions that meet the wait's threshold notify no one, and
        with no room the completion that would cannot leave the CQ).  (C's twin: wake_due.)"""
        return notified or len(self._queue) >= self._qlen

    def _queued_aside(self) -> None:
        """Events were queued outside the reader callback and the poller (an EP's close polled the
        CQ): hand them to the callback at the loop's next turn, or wake the waiting task."""
        if self._callback is not None:
            loop = self._callback_loop
            if loop is not None and not loop.is_closed():
                self._schedule_delivery()
        else:
            self._wake()

    def _napi_failed(self, exc: BaseException, what: str) -> None:
        if self._callback is not None:
            self._callback_failed(exc, what)
        else:
            self._wake(exc)

    def _push(self, event: Event) -> None:
        """Queue an event from a non-CQ stream (CM, async); never dropped."""
        if self._closed:
            return
        if len(self._queue) >= self._qlen:
            self._report_overflow(event)
        self._queue.append(event)
        if self._callback is not None:
            self._schedule_delivery()
        else:
            self._wake()

    def _report_overflow(self, event: Event, count: int = 1) -> None:
        """``count`` events, the last ``event``, are queued beyond qlen: count them, and tell the
        async EVD once per overflow."""
        self.overflow_count += count
        if not self._overflow_reported and not self._is_async:
            self._overflow_reported = True
            self._ia.async_evd._push(
                AsyncEvent(EventType.ASYNC_ERROR_EVD_OVERFLOW, self._ia.async_evd, obj=self,
                           reason=f"{event.type.name} arrived with {len(self._queue)} events queued (qlen {self._qlen})")
            )

    def _wake(self, exc: Optional[BaseException] = None) -> None:
        fut = self._waiter
        if fut is None or fut.done() or fut.get_loop().is_closed():
            if exc is not None and self._pending_error is None:
                self._pending_error = exc  # nobody waits: the next wait or dequeue raises it
            return
        if exc is not None:
            fut.set_exception(exc)
        elif len(self._queue) >= self._threshold or (self._solicited and self._solicited_hit):
            fut.set_result(None)

    def _pump(self) -> None:
        """Collect everything available now from every source, without waiting."""
        self._ia._pump()
        for ia in self._sharers:  # an async EVD shared by other IAs (open_ia(async_evd=...))
            ia._pump()
        self._drain_cq()

    def _waited(self) -> bool:
        """A task waits on this EVD now: its wait sleeps, spins, or was woken and has not run again
        yet (the events queued are the woken wait's until it takes them).  The EVD is free once the
        wait's Future is cancelled, or its task is being cancelled (a spinning wait awaits no Future
        that task.cancel() could cancel, a woken one's Future is already done: either way its task
        raises CancelledError and takes nothing), or its loop is closed (its task never runs again).
        (C's twin: waiter_gone in _completions.)"""
        fut = self._waiter
        if fut is None or fut.cancelled() or fut.get_loop().is_closed():
            return False
        task = self._waiter_task
        return task is None or not task.cancelling()

    def _take(self, max_events: Optional[int]) -> List[Any]:
        queue = self._queue
        if max_events is None or max_events >= len(queue):
            events = list(queue)
            queue.clear()
            self._overflow_reported = False  # there is room again
        else:
            # copied first, then popped by a loop that allocates nothing (its iterator is made
            # before the first pop): a MemoryError halfway would lose the events popped
            events = list(islice(queue, max_events))
            for _ in events:
                queue.popleft()
            if len(queue) < self._qlen:
                self._overflow_reported = False
        return events

    # -- DAT calls ---------------------------------------------------------
    @property
    def qlen(self) -> int:
        """The queue length the EVD guarantees room for."""
        return self._qlen

    @property
    def streams(self) -> EvdFlags:
        """The streams this EVD accepts."""
        return self._streams

    @property
    def busy_poll_us(self) -> int:
        """How long (us) the EVD polls its CQ after the last completion before it arms and sleeps
        (see ``ia.create_evd``); settable, with the same checks."""
        return self._busy_poll_us

    @busy_poll_us.setter
    def busy_poll_us(self, value: int) -> None:
        # checked here: the loop's poller reads it each turn, and a bad one would stop that turn
        # for every EVD of the loop
        self._check()
        _check_busy_poll_us(value)
        _check_busy_poll_streams(value, self._streams)
        self._busy_poll_us = value

    def dequeue(self) -> Optional[E]:
        """Return the next event, or None if there is none; never blocks (dat_evd_dequeue).

        A failure of the EVD's wake-up that no waiting task received is raised
        here (or by the next wait), once; the events stay queued.
        """
        self._check()
        self._refuse_if_callback("dequeue")
        if self._waited():  # (DAT_INVALID_STATE: the events are the waiting task's)
            raise InvalidState("dequeue: a task is waiting on this EVD")
        self._raise_pending()
        if self._taking or _taking_in_c(self):  # (a finalizer run by a take: a Python take's queue holds an
            return None  # event's place not filled yet; C's may take an event back off the queue's end)
        if not self._queue:
            self._pump()
        if not self._queue:
            return None
        event = self._queue.popleft()
        if len(self._queue) < self._qlen:
            self._overflow_reported = False
        return event

    async def wait(
        self,
        threshold: int = 1,
        timeout: Optional[float] = None,
        *,
        max_events: Optional[int] = None,
        solicited_only: bool = False,
    ) -> List[E]:
        """Wait until at least ``threshold`` events are queued and return them (dat_evd_wait).

        Returns every queued event (at most ``max_events`` if given).  Raises
        :class:`aiodat.TimeoutExpired` after ``timeout`` seconds.  With
        ``solicited_only`` the CQ is armed for solicited completions only and
        the wait ends early (below ``threshold``) when a receive of a message
        the peer sent with ``CompletionFlags.SOLICITED_WAIT`` (or an error
        completion) arrives: DAT's solicited wait.  Verbs cannot narrow an
        armed CQ, so when the EVD was armed for every completion the first
        channel event after the switch only re-arms it (see docs/datapath.md).
        An UNSIGNALLED completion is queued but does not end a wait by itself;
        a wait that starts when enough events are queued returns at once.  Only one task may
        wait on an EVD at a time (DAT_INVALID_STATE otherwise).  Cancelling the
        wait loses nothing: the events stay queued.
        """
        if max_events is None and not solicited_only:
            # the common case in C, up to the sleep (_completions.wait_begin): the same checks,
            # look and hand-over to the poller as below; None when it is not the common case
            begun = _wait_begin(self, threshold, timeout)
            if begun is not None:
                if type(begun) is list:
                    return begun
                # the rest in C too (_completions.Spin): on a CQ the loop's poller holds (completions
                # came lately) the wait yields its turns and looks itself until the poller arms it,
                # then it sleeps on its Future; at the end it frees the EVD and takes the events
                try:
                    return await begun
                except BaseException:
                    begun.abandon()  # the EVD is free again, unless a new wait took it since a cancel
                    raise
        if self._closed:
            self._check()
        if self._callback is not None:
            self._refuse_if_callback("wait")
        if type(threshold) is not int or not 1 <= threshold <= self._qlen:
            raise InvalidParameter(f"threshold must be between 1 and qlen ({self._qlen}), got {shown(threshold)}")
        if timeout is not None and not is_timeout(timeout):
            raise InvalidParameter(f"timeout must be None or >= 0 seconds, got {shown(timeout)}")
        if max_events is not None and (type(max_events) is not int or max_events < 1):
            raise InvalidParameter(f"max_events must be None or an int >= 1, got {shown(max_events)}")
        if self._waited():
            raise InvalidState("another task is already waiting on this EVD")
        loop = _get_running_loop()
        if loop is not self._attached_loop or self._sharers:
            self._attach(loop)  # (before the pending failure: a wait of another loop must not take it)
        if self._pending_error is not None:
            self._raise_pending()
        try:
            if solicited_only or self._armed_solicited:
                # (self._solicited is False here: only a wait sets it, and every way out clears it)
                self._solicited = bool(solicited_only) and self._wcs is not None
                self._solicited_hit = False
                self._drain_cq()  # re-arm the CQ for the kind of completion this wait wants
            else:
                # Hot path: poll the CQ, no system call.  The CQ is armed, or with the loop's poller
                # (poller.py), which arms it when nothing comes.  Connection and async events need
                # no look here: the loop runs their fds' reader callbacks before anyone sleeps long.
                self._solicited = False  # (a cancelled solicited wait whose task never ran again left it)
                self._poll()
            if len(self._queue) >= threshold:
                return self._take(max_events)
            fut: "asyncio.Future[None]" = loop.create_future()
            self._waiter, self._waiter_task, self._threshold = fut, _task_of_wait(loop), threshold
            self._deadline = None  # (not a cancelled wait's, whose task never ran again)
            try:
                if timeout is not None:  # (inside the try: if it fails, the EVD is free again)
                    self._set_deadline(loop, timeout)
                if not self._solicited and (self._unarmed or self._busy_poll_us):
                    # the loop's poller looks at the CQ at the next turns, and arms it if nothing comes
                    # (a busy-polling EVD: after busy_poll_us without a completion)
                    self._napi_add()
                elif self._unarmed and not fut.done():
                    # a solicited wait about to sleep on an unarmed CQ (its last arm failed):
                    # arm it, then look once more, or fail instead of sleeping forever
                    if self._drain_cq(rearm=False):
                        self._wake()
                    if self._unarmed and not fut.done():
                        raise self._arm_error or InvalidState("the CQ could not be armed")
                await fut
            finally:
                if self._waiter is fut:  # else a new wait has taken the EVD since this one was cancelled
                    self._waiter = self._waiter_task = None
                    self._deadline = None  # (its timer stays, for the next wait: see _set_deadline)
            return self._take(max_events)
        finally:
            if self._waiter is None:  # the solicited flag is the current wait's, if another has begun
                self._solicited = False  # also after returning at once or failing before sleeping

    def _set_deadline(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Make the current wait time out after ``timeout`` seconds.

        One timer serves every wait with a timeout: a wait whose deadline is no earlier than the
        pending timer's keeps it, and the timer, when it fires early, moves itself to the deadline of
        the wait then in progress (or ends, with none).  A consumer that waits with the same timeout
        thousands of times a second so pays no timer creation and cancellation per wake-up.
        """
        self._deadline = deadline = loop.time() + timeout
        self._wait_timeout = timeout
        timer = self._timer
        if timer is None or self._timer_when > deadline:
            if timer is not None:
                timer.cancel()
            self._timer, self._timer_when = loop.call_at(deadline, _timer_fired, weakref.ref(self)), deadline

    def _on_timer(self) -> None:
        """The timer fired: expire the wait in progress if its deadline has come, else move the timer."""
        self._timer = None
        fut, deadline = self._waiter, self._deadline
        if fut is None or fut.done() or deadline is None:
            return
        loop = fut.get_loop()
        if deadline - loop.time() > _TIMER_SLACK:  # set for an earlier wait's deadline
            self._timer, self._timer_when = loop.call_at(deadline, _timer_fired, weakref.ref(self)), deadline
            return
        self._expire(fut, self._wait_timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, fut: "asyncio.Future[None]", timeout: float) -> None:
        """The wait's timer: a last look, then the timeout fires, even if the look raised."""
        if fut.done():
            return
        look_error: Optional[Exception] = None
        try:
            self._pump()  # a last look: completions may sit in the CQ while the EVD was full
        except Exception as exc:
            look_error = exc
        if fut.done():  # (the look queued an event that woke the wait)
            return
        # (a solicited hit: the look read the channel event of the narrow arm, which uvloop, running
        # its timers before its I/O, had not yet handed to the reader callback)
        if look_error is None and (len(self._queue) >= self._threshold or (self._solicited and self._solicited_hit)):
            fut.set_result(None)
            return
        expired = TimeoutExpired(f"EVD wait for {self._threshold} event(s) timed out after {timeout}s "
                                 f"({len(self._queue)} queued)"
                                 + (f"; its last look failed: {look_error}" if look_error else ""))
        expired.__cause__ = look_error
        fut.set_exception(expired)

    def _raise_pending(self) -> None:
        exc, self._pending_error = self._pending_error, None
        if exc is not None:
            raise exc

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let ``loop`` watch this EVD's channel and its IA's fds (InvalidState if they belong
        to another loop that is still open)."""
        self._ia._attach_loop()
        for ia in self._sharers:
            ia._attach_loop()
        if self._watch is not None:
            self._watch.attach()
            if self._unarmed and self._poller is not None and self._poller._loop is not self._watch._loop:
                self._napi_add()  # an unarmed CQ left with a closed loop's poller: this loop's polls it
        watch, ia = self._watch, self._ia
        if self._timer is not None and self._attached_loop is not loop:
            self._cancel_timer()  # a timer of another loop
        # a wait skips _attach while all of these are watched by its loop
        if ((watch is None or watch._loop is loop) and ia._cm.watch._loop is loop
                and ia._async_source.watch._loop is loop):
            self._attached_loop = loop

    # -- callback delivery ---------------------------------------------------
    def set_callback(self, fn: Optional[Callable[[List[E]], Any]], *,
                     on_error: Optional[Callable[[BaseException], Any]] = None) -> None:
        """Deliver events to ``fn(events)`` instead of waits; ``None`` goes back to waits.

        The Access Layer's completion callback (``ib_create_cq`` with
        ``pfn_comp_cb``): ``fn`` is called from inside the running loop's
        reader callback with each batch of events, oldest first, with no
        Future and no task switch; it may post new requests at once.  It must
        not block: it runs inside the event loop.  Events already queued, and
        connection or software events, are delivered by a ``call_soon``.  An
        exception from ``fn`` goes to the loop's exception handler
        (``loop.call_exception_handler``), as a protocol's ``data_received``
        error does; the events after it stay queued for the next delivery.
        A failure of the EVD itself (polling, arming or busy polling its CQ),
        which ``fn`` would otherwise never learn of, goes to
        ``on_error(exc)`` if given (a transport aborts its connection there),
        else to the loop's exception handler too; an exception from
        ``on_error`` goes to the exception handler.  While a callback is set,
        ``wait()`` and ``dequeue()`` raise :class:`aiodat.InvalidState`.  Call
        it from the loop the EVD belongs to (the callbacks run there).
        """
        self._check()
        if fn is not None and not callable(fn):
            raise InvalidParameter(f"set_callback takes a callable or None, not {type(fn).__name__}")
        if on_error is not None and (fn is None or not callable(on_error)):
            raise InvalidParameter("on_error must be a callable, given together with a callback"
                                   f" (got on_error={on_error!r} with fn={fn!r})")
        for given in (fn, on_error):
            # (it would be called, and what it returns never awaited: its events lost unseen)
            if _is_coroutine_function(given):
                raise InvalidParameter(f"set_callback takes plain functions, not the coroutine function "
                                       f"{given!r}: the EVD calls it from the loop's reader callback and "
                                       "awaits nothing (start a task from a plain function instead)")
        if self._waited():
            raise InvalidState("a task is waiting on this EVD: a callback cannot be set while it waits")
        if fn is None:
            self._callback = self._callback_loop = self._on_error = None
            return
        try:
            loop = _get_running_loop()
        except RuntimeError:
            raise InvalidState("set_callback needs the running event loop the callbacks will run in: "
                               "call it from a coroutine or callback of that loop") from None
        self._attach(loop)
        if loop is not self._callback_loop:  # (_attach refused if the last one is still open)
            self._delivery_scheduled = False  # a delivery scheduled on a loop since closed never runs
            self._backlog_retry = None  # (so does a retry)
        self._callback, self._callback_loop, self._on_error = fn, loop, on_error
        if self._queue or self._backlog or self._pending_error is not None:
            self._schedule_delivery()
        # The CQ may hold completions no channel event will announce (a full EVD left them there
        # under an armed CQ), or be armed for solicited completions only (a solicited wait's):
        # the poller looks at it, delivers what it holds, and arms it for every completion.
        self._rearm_fully(look=True)

    def _rearm_fully(self, look: bool = False) -> None:
        """Make the CQ raise a channel event for every completion again, for a consumer that is
        no wait and relies on the channel (set_callback, an awaited ``rmr.bind``, a graceful
        disconnect's drain marker).  A solicited wait that ended through the reader callback or
        timed out leaves the CQ armed for solicited completions only; waits widen the arm
        themselves, nothing else does.  The loop's poller takes the CQ: it looks at it, hands
        what came to the callback or waiting task, and arms it for every completion (unless a
        solicited wait is in progress) when nothing more comes.  ``look``: hand it to the poller
        even when the arm is for every completion already.  Cheap when there is nothing to do."""
        if (look or self._armed_solicited) and self._wcs is not None and not self._closed:
            self._unarmed = True  # (what the poller arms: _napi_arm, which clears _armed_solicited)
            self._napi_add()

    def _refuse_if_callback(self, what: str) -> None:
        if self._callback is not None:
            raise InvalidState(f"{what}: this EVD delivers its events to a callback "
                               f"({self._callback!r}); call set_callback(None) to wait on it")

    def _schedule_delivery(self) -> None:
        # Never on a closed loop (the events stay queued for the next set_callback), and the flag
        # only once call_soon worked: a flag left set would stop every later delivery.
        if not self._delivery_scheduled:
            loop = self._callback_loop
            if loop is not None and not loop.is_closed():
                loop.call_soon(self._scheduled_delivery)
                self._delivery_scheduled = True

    def _scheduled_delivery(self) -> None:
        self._delivery_scheduled = False
        if self._callback is None or self._closed:
            return
        # A full queue may have left completions in the CQ, and so may a drain that failed part
        # way (its backlog, and what the CQ holds behind it): an armed CQ raises no event for
        # those, so they are polled once the callback has emptied the queue.
        left = len(self._queue) >= self._qlen or self._backlog
        try:
            self._raise_pending()
        except Exception as exc:
            self._callback_failed(exc, "taking the EVD's queued completions")
        self._deliver()
        if left and self._callback is not None and not self._closed:
            try:
                self._drain_cq(rearm=False, arm_if_unarmed=False)
            except Exception as exc:
                self._callback_failed(exc, "taking the EVD's queued completions")
            if self._queue:
                self._schedule_delivery()

    def _deliver(self) -> None:
        """Hand every queued event to the callback, once (the queue is empty afterwards)."""
        fn = self._callback
        if fn is None or not self._queue:
            return
        events = list(self._queue)
        self._queue.clear()
        self._overflow_reported = False
        try:
            fn(events)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # as asyncio's own callbacks: a CancelledError too (else the CQ
            self._callback_raised(fn, exc)  # would stay unarmed with nobody polling it)

    def _callback_raised(self, fn: Callable[[List[Event]], Any], exc: BaseException) -> None:
        """The callback ``fn`` raised ``exc`` (here or in the C poller's delivery, _completions.turn)."""
        self._callback_failed(exc, f"its callback {fn!r}", own=False)

    def _callback_wakeup(self) -> None:
        """The reader callback of an EVD with a callback: drain, deliver, and look again while the
        callback's own posts keep completions coming (up to _CALLBACK_ROUNDS looks per wake-up);
        the poller takes the CQ from there."""
        try:
            notified = self._drain_cq(napi=True)
            for _ in range(_CALLBACK_ROUNDS):
                if not notified and not self._queue:
                    break
                self._deliver()
                if self._callback is None or self._closed:
                    break
                notified = self._poll()
                if not notified:
                    break
        except Exception as exc:
            self._callback_failed(exc, "draining the CQ")
        finally:  # also under a callback's SystemExit or KeyboardInterrupt: the CQ must be armed or polled
            if self._unarmed and not self._closed:
                self._napi_add()

    def _callback_failed(self, exc: BaseException, what: str, own: bool = True) -> None:
        """Report a failure of a callback EVD: the EVD's own (``own``) to ``on_error`` if set,
        else (and the callback's exceptions) to the loop's exception handler.  A drain that
        failed part way left a backlog, which no channel event announces (the CQ may be armed):
        another drain is scheduled after the report, and so on until the backlog is taken: at the
        loop's next turn after a MemoryError (memory comes back), else after _BACKLOG_RETRY_S (a
        failure that comes every time must not spin the loop), one such retry at a time (each
        failure meanwhile scheduled its own: a retry that failed again multiplied them)."""
        try:
            self._report_failure(exc, what, own)
        finally:
            loop = self._callback_loop
            if own and self._backlog and loop is not None and not loop.is_closed():
                try:
                    if isinstance(exc, MemoryError):
                        self._schedule_delivery()
                    elif self._backlog_retry is None:
                        self._backlog_retry = loop.call_later(_BACKLOG_RETRY_S, self._retry_backlog)
                except Exception:  # (memory again: the next wake-up or set_callback drains it)
                    pass

    def _retry_backlog(self) -> None:
        """_callback_failed's retry, due: the next failure may schedule another."""
        self._backlog_retry = None
        self._schedule_delivery()

    def _report_failure(self, exc: BaseException, what: str, own: bool) -> None:
        loop = self._callback_loop
        if loop is None and not own:  # the callback took itself off, then raised: still its loop's
            try:
                loop = _get_running_loop()
            except RuntimeError:
                pass
        if loop is None:
            self._pending_error = self._pending_error or exc
            return
        on_error = self._on_error if own else None
        if on_error is not None:
            try:
                on_error(exc)
                return
            except Exception as handler_exc:
                handler_exc.__context__ = exc
                exc, what = handler_exc, f"{what} failed, and its on_error {on_error!r}"
        loop.call_exception_handler({"message": f"aiodat: {self!r}: {what} failed", "exception": exc, "evd": self})

    async def wait_one(self, timeout: Optional[float] = None) -> E:
        """Wait for and return exactly one event."""
        events = await self.wait(1, timeout, max_events=1)
        return events[0]

    def __aiter__(self) -> AsyncIterator[E]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[E]:
        while not self._closed:
            try:  # (one event per step: a loop that breaks leaves the rest queued, not taken)
                events = await self.wait(1, max_events=1)
            except Exception:
                if self._closed:
                    return
                raise
            yield events[0]

    def post_se(self, payload: Any = None) -> None:
        """Post a software event carrying ``payload`` (dat_evd_post_se)."""
        self._check()
        if not self._streams & EvdFlags.SOFTWARE:
            raise InvalidParameter("this EVD was not created with the SOFTWARE stream")
        if len(self._queue) >= self._qlen:
            raise QueueFull(f"EVD is full ({self._qlen} events queued)")
        served_by = self._callback_loop if self._callback is not None else (
            self._waiter.get_loop() if self._waited() else None)  # type: ignore[union-attr]
        # (a callback's loop that was closed serves nobody: the event waits for the next set_callback)
        if served_by is not None and not served_by.is_closed():
            try:
                here: Optional[asyncio.AbstractEventLoop] = _get_running_loop()
            except RuntimeError:
                here = None
            if here is not served_by:  # (its waiter or callback would never learn: not thread-safe)
                raise InvalidState("post_se: this EVD is served by another event loop's task or callback; "
                                   "call it there, e.g. loop.call_soon_threadsafe(evd.post_se, payload)")
        self._queue.append(SoftwareEvent(EventType.SOFTWARE_EVENT, self, payload))
        if self._callback is not None:
            self._schedule_delivery()
        else:
            self._wake()

    def _queued(self) -> Tuple[Event, ...]:
        """The events queued now, oldest first, left in place (package-level: srq.py counts its completions)."""
        return tuple(self._queue)

    def query(self) -> "EVDParam":
        """Return the EVD's parameters (dat_evd_query)."""
        self._check()
        return EVDParam(ia=self._ia, qlen=self._qlen, streams=self._streams, queued=len(self._queue),
                        is_async=self._is_async, waiting=self._waited())

    def resize(self, qlen: int) -> None:
        """Change the queue length (dat_evd_resize); below the number of queued events, or below the
        threshold a waiting task waits for, raises InvalidState.  The CQ grows to hold ``qlen``
        completions if it must, and never shrinks (its EPs may need more entries)."""
        self._check()
        _check_qlen(qlen, self._ia)
        # (the loop's reader callback may be draining the CQ, and a waiter's Future is the loop's)
        self._refuse_foreign_thread("resize")
        if qlen < len(self._queue):
            raise InvalidState(f"cannot resize to {qlen}: {len(self._queue)} events are queued")
        if self._waited() and qlen < self._threshold:
            # (the queue stops filling at qlen: the wait would never end)
            raise InvalidState(f"cannot resize to {qlen}: a task waits for {self._threshold} events")
        # the CQ only grows: the EPs sharing it may need more entries than qlen (cqsize.py), and a
        # CQ shrunk below what they can have pending would overrun
        if self._cq != ffi.NULL and qlen > self._cq.cqe and lib.ibv_resize_cq(self._cq, qlen):
            raise error_from_errno(ffi.errno, f"resizing the CQ to {qlen}")
        self._qlen = qlen
        if len(self._queue) >= qlen:  # full now: a waiter its UNSIGNALLED events satisfy is woken (_wake_due)
            self._wake()

    def free(self) -> None:
        """Free the EVD (dat_evd_free); refused while an EP or PSP still uses it."""
        self._check()
        eps, psps = self._users()
        self._refuse_close_while(bool(eps), f"{len(eps)} endpoint(s) still use it")
        self._refuse_close_while(bool(psps), f"{len(psps)} PSP(s) still deliver connection requests to it")
        self.close()

    def close(self) -> None:
        """Free the EVD and what cannot work without it: the endpoints that feed it and the PSPs
        that deliver connection requests to it are closed first, as pyverbs closes the QPs of a
        CQ it closes (a QP cannot outlive its CQ).  Idempotent.  :meth:`free` refuses instead."""
        if not self._closed:
            self._refuse_foreign_thread()  # (before its users are closed)
            eps, psps = self._users()
            first_error: Optional[BaseException] = None
            for user in (*eps, *psps):
                try:
                    user.close()
                except Exception as exc:  # keep going, and close this EVD too; report the first
                    first_error = first_error or exc
            if first_error is not None:
                super().close()
                raise first_error
        super().close()

    def _users(self) -> Tuple[List["EP"], List[Any]]:
        """The open endpoints whose QP completes on this EVD or sends it connection events, and the
        open PSPs whose requests come to it."""
        eps = [ep for ep in self._ia._qpn_owner.values() if self in ep._evds()]
        # PSPs are the IA's children with a cr_evd (duck-typed: cm.py is above this module)
        psps = [c for c in self._ia._children if getattr(c, "cr_evd", None) is self and not c.closed]
        return eps, psps

    def _release(self) -> None:
        fail_waiter(self._waiter, InvalidHandle("the EVD was freed while a task waited on it"))
        on_error, loop, self._on_error = self._on_error, self._callback_loop, None
        if on_error is not None and loop is not None and not loop.is_closed():
            # freed under its callback (its IA or EP closed): nothing more will come, and the
            # callback's owner (a stream transport) would wait for ever; tell it as a failure of
            # the EVD, from the loop (not from inside the close that freed it)
            loop.call_soon(on_error, InvalidHandle("the EVD was freed while its callback was set"))
        self._attached_loop = None
        self._cancel_timer()
        if self._poller is not None:
            self._poller.discard(self)
        if self._watch is not None:
            self._watch.detach()
        if self._cq != ffi.NULL:
            self._ia._cq_owner.pop(int(ffi.cast("uintptr_t", self._cq)), None)
            # ack every event the channel still holds, then destroy CQ before channel (a channel
            # never watched is still blocking, and was never armed: nothing to read from it)
            channel = self._channel if self._watch is not None else ffi.NULL
            lib.aiodat_cq_drain(channel, self._cq, -1, self._wcs, 0, self._status)
            self._cq_address = self._channel_address = 0
            self._raw_cq.release()
            self._cq = ffi.NULL
        if self._channel != ffi.NULL:
            self._raw_channel.release()
            self._channel = ffi.NULL

    def __repr__(self) -> str:
        kind = "async " if self._is_async else ""
        return f"<aiodat.EVD {kind}qlen={self._qlen} queued={len(self._queue)}{' closed' if self._closed else ''}>"


@dataclass(frozen=True)
class EVDParam:
    """What :meth:`EVD.query` returns (DAT_EVD_PARAM)."""

    ia: "IA"
    qlen: int
    streams: EvdFlags
    queued: int
    is_async: bool
    waiting: bool


_DTO_COMPLETION = EventType.DTO_COMPLETION
# the C common case (completions.c) makes DTOCompletionEvents as _completed does; a send or RDMA
# write has the length of its segments, which it sums itself
_completions.configure(DTOCompletionEvent, _DTO_COMPLETION, DTOOp.RECV, DTOOp.RECV_RDMA_WRITE_IMM,
                       frozenset({DTOOp.SEND, DTOOp.RDMA_WRITE}),
                       int(ffi.cast("uintptr_t", ffi.addressof(lib, "aiodat_cq_poll"))),
                       int(ffi.cast("uintptr_t", ffi.addressof(lib, "aiodat_cq_drain"))))
_queue_common, _look, _wait_begin = _completions.queue_common, _completions.look, _completions.wait_begin
#: whether C is taking polled completions of an EVD now (its own mark, kept in C for its looks' sake:
#: an attribute set around each take cost the callback ping-pong ~5%; Python's takes set _taking)
_taking_in_c = _completions.taking
_wakeup = _completions.wakeup


def _task_getter() -> Optional[Callable[[asyncio.AbstractEventLoop], Optional["asyncio.Task[Any]"]]]:
    """What a wait records as its task: the loop's running task.  None (no task is recorded, and
    waits never spin: they sleep on their Future at once) where a task cannot say it is being
    cancelled (Task.cancelling, Python 3.11): a spinning or woken wait's Future is not cancelled
    with its task, and the EVD must be free the moment that task is cancelled (see _waited)."""
    if not hasattr(asyncio.Task, "cancelling"):
        return None
    try:  # asyncio.current_task in C (3.12), or 3.11's own table of running tasks
        import _asyncio

        return getattr(_asyncio, "current_task", None) or _asyncio._current_tasks.get  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return asyncio.current_task


_running_task = _task_getter()


def _task_of_wait(loop: asyncio.AbstractEventLoop) -> Optional["asyncio.Task[Any]"]:
    """The task a wait beginning now records (C's twin: waiting_task in _completions): the running
    task, unless it is being cancelled already (a clean-up that waits, or a cancel it swallowed),
    whose wait would otherwise count as gone from its start."""
    task = _running_task(loop) if _running_task is not None else None
    return None if task is None or task.cancelling() else task


_completions.configure_waits(_running_task)
_NULL = ffi.NULL


def _is_coroutine_function(fn: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _check_qlen(qlen: Any, ia: "IA") -> None:
    """An EVD's queue length (create_evd, resize): an int from 1 to the device's max_cqe."""
    if not isinstance(qlen, int) or isinstance(qlen, bool) or qlen < 1:
        raise InvalidParameter(f"qlen must be an int >= 1, got {shown(qlen)}")
    max_qlen = ia._device_attr.max_cqe
    if qlen > max_qlen:
        raise InvalidParameter(f"qlen {qlen} exceeds the device's max_evd_qlen {max_qlen}")


def _check_busy_poll_streams(value: int, streams: EvdFlags) -> None:
    if value and not int.__and__(streams, _CQ_STREAMS):
        raise InvalidParameter("busy_poll_us: this EVD takes no completions (its streams have neither DTO "
                               "nor RMR_BIND), so there is no CQ to poll")


def _check_busy_poll_us(value: Any) -> None:
    if type(value) is not int or not 0 <= value <= MAX_BUSY_POLL_US:
        raise InvalidParameter(f"busy_poll_us must be an int between 0 and {MAX_BUSY_POLL_US} "
                               f"microseconds, got {shown(value)}")


def is_timeout(value: Any) -> bool:
    """A wait's timeout: seconds >= 0 (inf included) as the loop's timer takes them (cm.py's
    connection calls take the same, above 0).  NaN and an int too large for a float are not: they
    would fail in the timer (uvloop), or schedule a NaN deadline (asyncio), after the wait took
    the EVD.  Nor is a bool: ``timeout=True`` is a mistake (a flag in the wrong place), not 1 s."""
    try:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0 <= float(value) <= _INF)  # (NaN compares False)
    except OverflowError:
        return False


_INF = float("inf")
_get_running_loop = asyncio.get_running_loop
_monotonic = time.monotonic
#: how many times a callback EVD's wake-up looks at the CQ again after delivering (one number for
#: this Python path and the common case in C)
_BACKLOG_RETRY_S = 0.5  # a callback EVD's drain of its backlog again, after a failure that is no MemoryError
_CALLBACK_ROUNDS = _completions.CALLBACK_ROUNDS


#: a waits' timer that fires this close to the deadline (s) expires the wait: loops round timers
#: (libuv to whole milliseconds), and moving the timer for less would only spin
_TIMER_SLACK = 0.001


def _timer_fired(ref: "weakref.ReferenceType[EVD]") -> None:
    # the timer holds the EVD weakly: a pending timer must not keep a dropped EVD alive for the
    # rest of a long timeout
    evd = ref()
    if evd is not None:
        evd._on_timer()


#: struct aiodat_wc (shim.h) as Python's struct reads it, native alignment and padding
_WC = struct.Struct("@QiiIIIIIIHB5x")
_WC_STATUS, _WC_QP_NUM = 1, 6
_WC_SIZE = _WC.size
_WC_LAYOUT = {"wr_id": 0, "status": 8, "opcode": 12, "vendor_err": 16, "byte_len": 20, "imm_data": 24,
              "qp_num": 28, "src_qp": 32, "wc_flags": 36, "slid": 40, "sl": 42}
if _WC.size != ffi.sizeof("struct aiodat_wc") or any(  # shim and module disagree: never read garbage
        ffi.offsetof("struct aiodat_wc", name) != offset for name, offset in _WC_LAYOUT.items()):
    raise ImportError("struct aiodat_wc in the built shim does not match aiodat.evd's layout: rebuild aiodat")

# ibv_event_type -> (DAT event type, kind of object it names)
_ASYNC_MAP = {
    "IBV_EVENT_CQ_ERR": (EventType.ASYNC_ERROR_EVD_OVERFLOW, "cq"),
    "IBV_EVENT_QP_FATAL": (EventType.ASYNC_ERROR_EP_BROKEN, "qp"),
    "IBV_EVENT_QP_REQ_ERR": (EventType.ASYNC_ERROR_EP_BROKEN, "qp"),
    "IBV_EVENT_QP_ACCESS_ERR": (EventType.ASYNC_ERROR_EP_BROKEN, "qp"),
    "IBV_EVENT_PATH_MIG_ERR": (EventType.ASYNC_ERROR_EP_BROKEN, "qp"),
    "IBV_EVENT_COMM_EST": (EventType.ASYNC_EP_COMM_ESTABLISHED, "qp"),
    "IBV_EVENT_SQ_DRAINED": (EventType.ASYNC_EP_SQ_DRAINED, "qp"),
    "IBV_EVENT_PATH_MIG": (EventType.ASYNC_EP_PATH_MIGRATED, "qp"),
    "IBV_EVENT_QP_LAST_WQE_REACHED": (EventType.ASYNC_EP_LAST_WQE_REACHED, "qp"),
    "IBV_EVENT_DEVICE_FATAL": (EventType.ASYNC_ERROR_IA_CATASTROPHIC, "ia"),
    "IBV_EVENT_SRQ_ERR": (EventType.ASYNC_SRQ_ERROR, "srq"),
    "IBV_EVENT_SRQ_LIMIT_REACHED": (EventType.ASYNC_SRQ_LOW_WATERMARK, "srq"),
    "IBV_EVENT_PORT_ACTIVE": (EventType.ASYNC_PORT_ACTIVE, "port"),
    "IBV_EVENT_PORT_ERR": (EventType.ASYNC_PORT_ERROR, "port"),
    "IBV_EVENT_LID_CHANGE": (EventType.ASYNC_LID_CHANGE, "port"),
    "IBV_EVENT_PKEY_CHANGE": (EventType.ASYNC_PKEY_CHANGE, "port"),
    "IBV_EVENT_GID_CHANGE": (EventType.ASYNC_GID_CHANGE, "port"),
    "IBV_EVENT_SM_CHANGE": (EventType.ASYNC_SM_CHANGE, "port"),
    "IBV_EVENT_CLIENT_REREGISTER": (EventType.ASYNC_CLIENT_REREGISTER, "port"),
}

_IBV_EVENT_NAMES = [
    "IBV_EVENT_CQ_ERR", "IBV_EVENT_QP_FATAL", "IBV_EVENT_QP_REQ_ERR", "IBV_EVENT_QP_ACCESS_ERR",
    "IBV_EVENT_COMM_EST", "IBV_EVENT_SQ_DRAINED", "IBV_EVENT_PATH_MIG", "IBV_EVENT_PATH_MIG_ERR",
    "IBV_EVENT_DEVICE_FATAL", "IBV_EVENT_PORT_ACTIVE", "IBV_EVENT_PORT_ERR", "IBV_EVENT_LID_CHANGE",
    "IBV_EVENT_PKEY_CHANGE", "IBV_EVENT_SM_CHANGE", "IBV_EVENT_SRQ_ERR", "IBV_EVENT_SRQ_LIMIT_REACHED",
    "IBV_EVENT_QP_LAST_WQE_REACHED", "IBV_EVENT_CLIENT_REREGISTER", "IBV_EVENT_GID_CHANGE",
    "IBV_EVENT_WQ_FATAL",
]  # the order of enum ibv_event_type


class AsyncSource:
    """The IA's async fd on the loop: every ibv async event becomes an event on ``ia.async_evd``."""

    def __init__(self, ia: "IA") -> None:
        self._ia = ia
        self._buf = ffi.new("struct aiodat_async_event[]", 16)
        # the loop keeps the device context (the async fd's owner) while it watches the fd
        self.watch = FdWatch(ia._context.async_fd, self._on_readable, "device async", keep=ia._raw)

    def drain(self) -> None:
        """Turn every pending device event into an async EVD event."""
        ia = self._ia
        ia._cm.settle()  # (a QP_FATAL's BROKEN whose push failed, owed: cm.broken; none, almost always)
        while True:
            got = lib.aiodat_async_get_events(ia._context, self._buf, 16)
            if got <= 0:
                return
            for i in range(got):
                try:
                    self._dispatch(self._buf[i])
                except Exception as exc:  # one event's trouble must not lose the rest of the batch
                    report_internal_error(ia, exc, "turning a device async event into an event")
            if got < 16:
                return

    def _dispatch(self, raw: Any) -> None:
        """One copied-out ibv async event -> an event on the async EVD.  ``raw.element`` is a key
        only: the event was acked in C, so the object may be gone (the QP number was copied)."""
        ia = self._ia
        name = _IBV_EVENT_NAMES[raw.event_type] if raw.event_type < len(_IBV_EVENT_NAMES) else str(raw.event_type)
        kind_type, kind = _ASYNC_MAP.get(name, (EventType.ASYNC_ERROR_PROVIDER_INTERNAL_ERROR, ""))
        obj: Any = None
        port = None
        try:
            if kind == "qp":
                obj = ia._qpn_owner.get(raw.qp_num)
                # only an error breaks the connection: COMM_EST, SQ_DRAINED, PATH_MIG and
                # LAST_WQE_REACHED are news about a QP that works (or is closing already)
                if obj is not None and kind_type is EventType.ASYNC_ERROR_EP_BROKEN:
                    obj._on_async_error(name, False)  # (nothing retries a device event: cm.broken owes it)
            elif kind == "cq":
                obj = ia._cq_owner.get(int(ffi.cast("uintptr_t", raw.element)))
            elif kind == "srq":
                obj = ia._srq_owner.get(int(ffi.cast("uintptr_t", raw.element)))
                if obj is not None:
                    obj._on_async_event(name)
            elif kind == "port":
                obj = ia  # the IA is the port; a shared async EVD tells its IAs apart by it
                port = raw.port_num
            elif kind == "ia":
                obj = ia
        finally:  # the async EVD hears of the event even when the EP or SRQ could not take it
            ia.async_evd._push(AsyncEvent(kind_type, ia.async_evd, obj=obj, port=port, reason=name))

    def _on_readable(self) -> None:
        if not self._ia.closed:
            try:
                self.drain()
            except Exception as exc:  # a loop callback: never let it escape into the loop
                report_internal_error(self._ia, exc, "reading the device's async events")

    def destroy(self) -> None:
        """Stop watching the async fd (the IA closes the device itself)."""
        self.watch.detach()


def report_internal_error(ia: "IA", exc: BaseException, what: str) -> None:
    """An exception inside a loop callback: an ASYNC_ERROR_PROVIDER_INTERNAL_ERROR event on the async EVD.

    Loop callbacks (the rdma_cm channel, the device async fd) must never let an
    exception escape into the event loop; the failure is reported where DAT
    reports provider trouble instead, with the exception as ``event.obj``.
    (It lived in cm.py, which re-exports it; it is here because both use it.)
    """
    evd = getattr(ia, "async_evd", None)
    if evd is None or evd.closed:
        return
    evd._push(AsyncEvent(EventType.ASYNC_ERROR_PROVIDER_INTERNAL_ERROR, evd, obj=exc,
                         reason=f"{what}: {type(exc).__name__}: {exc}"))
