"""Posting work requests (dat_ep_post_*): the DAT completion flags, the verbs opcode and flag tables.

Every post goes through the C shim, one crossing per call (or per batch with
``post_*_batch``); the request is remembered by the tracking of wr.py, every
record made before the post (:meth:`Posting._record`), so that a MemoryError
posts nothing and a request the device holds is always counted and found again.
The hot paths (one segment, default flags; and a batch whose items all share
one segment) are C (aiodat/_shim/posts.c): they check the same things as the
general paths and record the same, the same way, and leave anything else, and
every error message, to the general paths.

:class:`Posting` is a mixin of :class:`aiodat.EP`: it owns the scratch request
and scatter/gather arrays set by :meth:`Posting._init_posting` and reads the
EP's ``_qp``, ``_pz``, ``_ia``, ``_srq``, ``attrs``, ``max_inline`` and its
connection's state (``_conn.state``, written only by cm.py).
"""
from __future__ import annotations

import enum
import errno
import functools
import itertools
from itertools import repeat
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

from aiodat._lib import ffi, lib
from aiodat._shim import _posts
from aiodat.epattr import EPAttr, EPState, ServiceType
from aiodat.errors import (
    InvalidParameter,
    InvalidState,
    LengthError,
    NotImplementedByProvider,
    QueueFull,
    error_from_errno,
    shown,
)
from aiodat.evd import DTOOp
from aiodat.memory import LMR, RemoteRegion, Segment, Segments, as_segments, check_post_segments, fill_sges
from aiodat.wr import DrainMarker, SendRun, WorkRequests, _columns, _lmr_counts, all_same

if TYPE_CHECKING:
    from aiodat.ia import IA
    from aiodat.memory import PZ


def check_imm_data(imm_data: Optional[int]) -> None:
    """InvalidParameter unless ``imm_data`` is None or a 32-bit unsigned int (a send's immediate data)."""
    if imm_data is not None and not (isinstance(imm_data, int) and 0 <= imm_data < 2**32):
        raise InvalidParameter(f"imm_data must be a 32-bit unsigned int, got {shown(imm_data)}")


def _count(counts: Dict[Any, int]) -> None:
    """Add ``counts`` to their LMRs' in-flight counts, before the post: a request the device holds
    must be counted, else lmr.free() could take its buffer.  An error (MemoryError: the new int):
    none added."""
    done = None  # the last LMR counted (tracked by identity: no int to allocate)
    try:
        for lmr, n in counts.items():
            lmr._inflight += n
            done = lmr
    except BaseException:
        if done is not None:
            _uncount(counts, done)
        raise


def _uncount(counts: Dict[Any, int], through: Any = None) -> None:
    """Take ``counts`` back from their LMRs (those up to ``through``; all by default): their requests
    did not go.  A count that cannot go down (its int's allocation failed) stays high: that refuses
    a free and loses nothing."""
    try:
        for lmr, n in counts.items():
            lmr._inflight -= n
            if lmr is through:
                return
    except Exception:  # (MemoryError; or CPython's SystemError for a frame it could not allocate)
        pass


class CompletionFlags(enum.IntFlag):
    """DAT completion flags of a posted request (DAT_COMPLETION_*_FLAG); see docs/datapath.md."""

    DEFAULT = 0x00
    #: no completion event if the request succeeds; a failure still completes with
    #: an event (verbs: the request is posted unsignalled).  Requests only.
    SUPPRESS = 0x01
    #: the message is sent with the solicited-event bit: the peer's receive
    #: completion ends a ``wait(..., solicited_only=True)`` on its recv EVD
    SOLICITED_WAIT = 0x02
    #: DAT's "completion with unsignalled notification": the event is produced and
    #: queued, but does not wake a waiting task by itself; it is returned by
    #: ``dequeue()`` or together with the next event that does (failures always notify)
    UNSIGNALLED = 0x04
    #: do not start until every earlier RDMA read and atomic of this EP has
    #: completed (IBV_SEND_FENCE), e.g. to send data an RDMA read just fetched
    BARRIER_FENCE = 0x08



# ibv_wr_opcode values (enum ibv_wr_opcode, stable ABI)
WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, WR_SEND, WR_SEND_WITH_IMM = 0, 1, 2, 3
WR_RDMA_READ, WR_ATOMIC_CMP_AND_SWP, WR_ATOMIC_FETCH_AND_ADD = 4, 5, 6
WR_LOCAL_INV, WR_BIND_MW = 7, 8
# ibv_send_flags
SEND_FENCE, SEND_SIGNALED, SEND_SOLICITED, SEND_INLINE = 1, 2, 4, 8
_INLINE_OPCODES = (WR_SEND, WR_SEND_WITH_IMM, WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM)

#: the inline data an EP asks for when EPAttr.max_inline_data is None
DEFAULT_INLINE_DATA = 64


def _send_flags(flags: int) -> int:
    """The ibv_send_flags of a CompletionFlags value."""
    send_flags = 0
    if not flags & CompletionFlags.SUPPRESS:
        send_flags |= SEND_SIGNALED
    if flags & CompletionFlags.SOLICITED_WAIT:
        send_flags |= SEND_SOLICITED
    if flags & CompletionFlags.BARRIER_FENCE:
        send_flags |= SEND_FENCE
    return send_flags


#: CompletionFlags value (0-15) -> (ibv_send_flags, posted UNSIGNALLED): the enum arithmetic done once
_SEND_BITS = [(_send_flags(f), bool(f & CompletionFlags.UNSIGNALLED and not f & CompletionFlags.SUPPRESS))
              for f in range(16)]


def _flag_bits(name: str, value: Any) -> Tuple[int, bool]:
    """(ibv_send_flags, posted UNSIGNALLED) of a request's CompletionFlags, checked."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 16:
        raise InvalidParameter(f"{name} must be CompletionFlags, got {value!r}")
    return _SEND_BITS[value]


#: bytes of Global Route Header the device writes at the start of every UD receive
GRH_SIZE = 40


def _not_on_ud(what: str, opcode: int) -> InvalidParameter:
    """The error of a connected-EP request (``what``, of ``opcode``) posted on a UD endpoint."""
    if opcode in (WR_SEND, WR_SEND_WITH_IMM):
        return InvalidParameter(f"{what} on a UD endpoint: a datagram goes to an address handle, post it with "
                                f"post_send_to(segments, address_handle)")
    return InvalidParameter(f"{what} on a UD endpoint: RDMA reads, writes and atomics need a connected (RC) endpoint")


# the hot paths compare by identity with these
_NO_FLAGS = CompletionFlags.DEFAULT
_UNSIGNALLED = CompletionFlags.UNSIGNALLED
_NULL = ffi.NULL
# the hot paths of post_recv and post_send, and of a batch on one segment, in C (_shim/posts.c), with
# what they compare and record
_posts.configure(Segment, CompletionFlags, _SEND_BITS, DTOOp.SEND, EPState.CONNECTED, EPState.DISCONNECTED,
                 EPState.ERROR, SendRun, RemoteRegion)
_c_post_recv, _c_post_send = _posts.post_recv, _posts.post_send
_c_post_batch, _c_post_recv_batch = _posts.post_batch, _posts.post_recv_batch


class Posting(WorkRequests):
    """Mixin of the EP: every dat_ep_post_* call, and the posts of memory-window binds."""

    _qp: Any
    _qp_address = 0  # the QP's address for the C hot paths (ep.py sets it with the QP; 0: none)
    _pz: "PZ"
    _ia: "IA"
    _conn: Any
    attrs: EPAttr
    max_inline: int
    request_evd: Any  # (the EP's EVD of its send queue's completions)

    def _init_posting(self) -> None:
        self._windows: set = set()  # RMRs bound through this QP (memory.py registers them here)
        # How many requests (receives) may await their completions being taken: a device may take
        # more (rxe frees a slot as it writes the completion, not when it is polled), but the CQs
        # hold only this many of the EP's (cqsize.py), so a post past it is refused as a full
        # queue (_room; _shim/posts.c's room_in for the fast paths), else a CQ would overrun.
        self._send_limit: int = self.attrs.max_request_dtos
        self._recv_limit: int = self.attrs.max_recv_dtos

    # The general post paths' C structures: made on an EP's first such post and kept (no
    # allocation per post), not with the EP: an EP is made per connection, and many never
    # post through these paths (the one-segment fast paths pass plain ints).
    @functools.cached_property
    def _wr(self) -> Any:
        return ffi.new("struct aiodat_send_wr *")

    @functools.cached_property
    def _sges(self) -> Any:
        return ffi.new("struct aiodat_sge[]", 32)

    @functools.cached_property
    def _posted(self) -> Any:
        return ffi.new("int *")

    @functools.cached_property
    def _recv_wr(self) -> Tuple[Any, Any, Any]:
        return ffi.new("uint64_t[1]"), ffi.new("int[1]"), ffi.new("int[1]")

    def _check_post(self, segs: Tuple[Segment, ...], limit: int, what: str, writes: bool = False) -> None:
        """The segments of a post (see check_post_segments), on this open EP."""
        self._check()
        check_post_segments(segs, self._pz, what, "EP", limit, "EPAttr max iov", writes)

    def post_recv(self, segments: Segments, cookie: Any = None,
                  flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Post a receive into ``segments`` (dat_ep_post_recv); it completes on ``recv_evd``."""
        if flags is _NO_FLAGS:
            # The hot path (one segment, or a list of one, default flags) in C (_shim/posts.c):
            # the same checks as below and the same record; -1 when it is not that case.
            err = _c_post_recv(self, self._qp_address, segments, cookie)
            if not err:
                return
            if err > 0:
                raise self._post_error(err, "post_recv", recv=True)
        _flag_bits("flags", flags)  # (a CompletionFlags value, 0-15)
        if flags & CompletionFlags.SUPPRESS:  # a receive always completes (it carries the data's length)
            raise InvalidParameter("flags: SUPPRESS is for requests (sends, RDMA); a receive always completes")
        segs = as_segments(segments)
        self._check_post(segs, self.attrs.max_recv_iov, "post_recv", writes=True)
        if self._ud:
            self._check_holds_grh(segs, "post_recv")
        if self._srq is not None:
            raise InvalidState("this EP receives from an SRQ: post to srq.post_recv")
        if self._conn.state in (EPState.DISCONNECTED, EPState.ERROR):
            raise InvalidState(f"cannot post a receive on an EP in state {self._conn.state.value}")
        wr_id = next(self._ids) * 2 + 1
        fill_sges(self._sges, 0, segs)
        ids, starts, nums = self._recv_wr  # made once per EP: no allocation per post
        ids[0], nums[0] = wr_id, len(segs)
        uses, quiet_id, entries = _lmr_counts((segs,)), wr_id if flags & _UNSIGNALLED else None, ((wr_id, cookie, segs),)
        err = self._post_recorded(self._recv_q, entries, uses, lib.aiodat_post_recv,
                                  (self._qp, _NULL, ids, starts, nums, 1, self._sges, self._posted), quiet_id)
        if err:
            self._take_back(self._recv_q, entries, 0, uses, quiet_id)
            raise self._post_error(err, "post_recv", recv=True)

    def post_recv_batch(self, items: Iterable[Tuple[Segments, Any]]) -> int:
        """Post many receives in one crossing into C; ``items`` are (segments, cookie) pairs.

        Every item is checked first; returns how many were posted (QueueFull
        says how many went if the receive queue fills part way).
        """
        # a list or tuple of items each on one segment (the very same one, or one each: a pool): in C
        # (_shim/posts.c), the checks and the record of the path below; None when it is not that case
        done = _c_post_recv_batch(self, self._qp_address, items)
        if type(done) is int:
            return done
        if done is not None:
            raise self._refused_batch(done, "post_recv_batch", True)
        self._check()
        if self._srq is not None:
            raise InvalidState("this EP receives from an SRQ: post to srq.post_recv_batch")
        if self._conn.state in (EPState.DISCONNECTED, EPState.ERROR):
            raise InvalidState(f"cannot post a receive on an EP in state {self._conn.state.value}")
        inputs, cookies = _columns(items, 2, "post_recv_batch", "(segments, cookie) pairs")
        n = len(cookies)
        if n == 0:
            return 0
        segs_column, same = self._checked(inputs, self.attrs.max_recv_iov, "post_recv_batch", writes=True)
        if self._ud:
            for segs in segs_column[:1] if same else segs_column:
                self._check_holds_grh(segs, "post_recv_batch")
        room = self._room(self._recv_q)
        if n > room:  # what fits goes, as a device posts until its queue is full
            posted = self.post_recv_batch(list(zip(segs_column[:room], cookies[:room]))) if room > 0 else 0
            raise self._refused_batch((posted, n, errno.ENOMEM), "post_recv_batch", True)
        if same:  # one scatter list shared by every receive
            first = segs_column[0]
            sges = ffi.new("struct aiodat_sge[]", max(1, len(first)))
            fill_sges(sges, 0, first)
            first_id = self._take_ids(n) * 2 + 1
            entries = list(zip(range(first_id, first_id + 2 * n, 2), cookies, repeat(first)))
            err = self._post_recorded(self._recv_q, entries, _lmr_counts((first,), n), lib.aiodat_post_recv_same,
                                      (self._qp, _NULL, first_id, 2, n, sges, len(first), self._posted))
            if not err:
                return n
            posted = self._posted[0]
            self._take_back(self._recv_q, entries, posted, _lmr_counts((first,), n - posted))
            raise self._refused_batch((posted, n, err), "post_recv_batch", True)
        id_gen = self._ids
        wr_ids = [next(id_gen) * 2 + 1 for _ in range(n)]
        sges = ffi.new("struct aiodat_sge[]", max(1, sum(map(len, segs_column))))
        start_list, start = [], 0
        for segs in segs_column:
            fill_sges(sges, start, segs)
            start_list.append(start)
            start += len(segs)
        starts = ffi.new("int[]", start_list)
        counts = ffi.new("int[]", [len(segs) for segs in segs_column])
        ids = ffi.new("uint64_t[]", wr_ids)
        entries = list(zip(wr_ids, cookies, segs_column))
        err = self._post_recorded(self._recv_q, entries, _lmr_counts(segs_column), lib.aiodat_post_recv,
                                  (self._qp, _NULL, ids, starts, counts, n, sges, self._posted))
        if not err:
            return n
        posted = self._posted[0]
        self._take_back(self._recv_q, entries, posted, _lmr_counts(segs_column[posted:]))
        raise self._refused_batch((posted, n, err), "post_recv_batch", True)

    def _checked(self, inputs: Sequence[Segments], limit: int,
                 what: str, writes: bool = False) -> Tuple[List[Tuple[Segment, ...]], bool]:
        """A batch's segments column, every item's checked, and whether every item gave the very
        same segments object (then the column repeats one tuple: the batch fast paths).  The same
        object on consecutive items is checked once, and yields one tuple."""
        if inputs and all_same(inputs):  # a stream of one buffer: check it once, no step per item
            segs = as_segments(inputs[0])
            self._check_post(segs, limit, what, writes)
            return [segs] * len(inputs), True
        column: List[Tuple[Segment, ...]] = []
        last_in: Any = column  # a sentinel no item is
        checked: Tuple[Segment, ...] = ()
        for item in inputs:
            if item is not last_in:  # the same segments again: checked already
                checked = as_segments(item)
                self._check_post(checked, limit, what, writes)
                last_in = item
            column.append(checked)
        return column, False

    def _check_holds_grh(self, segs: Tuple[Segment, ...], what: str) -> None:
        """A UD receive holds the GRH before the payload: a smaller one is completed in error,
        and that error breaks the QP (every other receive flushed)."""
        size = sum(seg.length for seg in segs)
        if size < GRH_SIZE:
            raise InvalidParameter(
                f"{what}: a receive on a UD endpoint gets the {GRH_SIZE}-byte GRH before the payload: "
                f"{size} bytes cannot hold it (post_recv_datagram puts the GRH in a buffer of its own)")

    def _inline_bit(self, opcode: int, segs: Tuple[Segment, ...]) -> int:
        """IBV_SEND_INLINE for a send or RDMA write small enough to go inline, else 0."""
        if opcode in _INLINE_OPCODES and sum(seg.length for seg in segs) <= self.max_inline:
            return SEND_INLINE
        return 0

    def _post_error(self, err: int, what: str, recv: bool = False) -> Exception:
        """The error of a post of the send (``recv``: receive) queue refused with ``err``: for a full
        queue, QueueFull naming the limit and the places held (_room), which are not requests: a
        suppressed run on one segment holds one."""
        if err != errno.ENOMEM:
            return error_from_errno(err, what)
        if recv:
            held, limit, runs = len(self._recv_q), f"max_recv_dtos={self._recv_limit}", ""
        else:
            held, limit, requests = len(self._send_q), f"max_request_dtos={self._send_limit}", self._sends_outstanding()
            runs = f" ({requests} requests: a suppressed batch on one segment holds one place)" if requests != held else ""
        return QueueFull(f"{what}: the queue is full: {held} of {limit} places held{runs}; a request holds its "
                         f"place until its completion is taken from the EVD")

    # -- the records of a post, all made before it, as posts.c makes them --------------
    # A request the device holds must be counted on its LMRs (else lmr.free() could take its
    # buffer) and have its queue entry (else its completion is matched to another request).
    # Made before the post, a record that fails (MemoryError) stops it with nothing posted; what
    # the device did not take is taken back with calls that allocate nothing.
    def _post_recorded(self, q: Deque[Any], entries: Sequence[Any], uses: Dict[Any, int], post: Any,
                       args: Tuple[Any, ...], quiet_id: Optional[int] = None) -> int:
        """Record requests, then post them: count ``uses`` on their LMRs, put their ``entries`` on
        the queue ``q``, mark ``quiet_id`` UNSIGNALLED, then ``post(*args)`` (a lib.aiodat_post_*
        function, with the EP's QP first: all looked up and made before, so that nothing between
        the records and the post can fail).  Returns the post's errno: 0, every request went;
        else the caller takes back what did not (:meth:`_take_back`).  An error raised: nothing
        posted, nothing recorded.  ENOMEM with nothing done when the entries do not fit the
        EP's :meth:`_room` (a batch's callers post what fits first)."""
        for lmr in uses:  # checked as each item was read, but reading a later one (a generator, a
            lmr._check()  # segments iterable) runs the program's code, which may have closed it since
        if len(entries) > self._room(q):
            self._posted[0] = 0
            return errno.ENOMEM
        mark = q[-1] if q else None  # (the newest entry before these)
        _count(uses)
        try:
            q.extend(entries)
            if quiet_id is not None:
                self._quiet.add(quiet_id)
            if self._qp is not args[0]:  # an allocation above ran a finalizer that closed or reset the EP
                self._check()
                raise InvalidState("cannot post: the EP was reset meanwhile")
        except BaseException:
            if quiet_id is not None:
                self._quiet.discard(quiet_id)
            while q and q[-1] is not mark:
                q.pop()
            _uncount(uses)
            raise
        try:
            return post(*args)  # (the tuple passed as is: nothing to make)
        except MemoryError:  # the call could not be made: nothing went
            self._take_back(q, entries, 0, uses, quiet_id)
            raise

    def _room(self, q: Deque[Any]) -> int:
        """How many more entries the queue ``q`` (``_send_q``, ``_recv_q``) takes: its limit (see
        _init_posting) less the entries whose completions are not taken yet."""
        return (self._send_limit if q is self._send_q else self._recv_limit) - len(q)

    def _take_back(self, q: Deque[Any], entries: Sequence[Any], posted: int, uses: Dict[Any, int],
                   quiet_id: Optional[int] = None) -> None:
        """The device took only the first ``posted`` of the requests :meth:`_post_recorded` recorded:
        take back the others' entries (the newest of ``q``: a deque's pop allocates nothing), the
        UNSIGNALLED mark ``quiet_id`` and ``uses`` (their LMR uses).  A queue whose newest entry is
        not theirs was emptied meanwhile (the EP closed or reset, its records all taken back)."""
        if not q or q[-1] is not entries[-1]:
            return
        first = entries[posted]
        while q.pop() is not first:
            pass
        if quiet_id is not None:
            self._quiet.discard(quiet_id)
        _uncount(uses)

    def _batch_in_c(self, opcode: int, op: DTOOp, items: Any, flags: Any, last_flags: Any) -> Optional[int]:
        """A send-side batch whose items (a list or tuple) are each on one segment, the very same one
        (and remote region) or one of their own (a pool of buffers): checked, posted and recorded in
        C (_shim/posts.c) as the general path does.  How many were posted, or None when it is not
        that case: then the general path takes it."""
        done = _c_post_batch(self, self._qp_address, opcode, op, items, flags, last_flags)
        if done is None or type(done) is int:
            return done
        raise self._refused_batch(done, f"post {op.value} batch")

    def _refused_batch(self, done: Tuple[int, int, int], what: str, recv: bool = False) -> Exception:
        """The error of a batch the queue refused part way: ``done`` is (posted, n, errno)."""
        posted, n, err = done
        return self._post_error(err, f"{what} (posted {posted} of {n})", recv)

    def _post_one(self, op: DTOOp, opcode: int, segs: Tuple[Segment, ...], cookie: Any,
                  flags: CompletionFlags, *, imm_data: Optional[int] = None,
                  remote: Optional["RemoteRegion"] = None, compare_add: int = 0, swap: int = 0,
                  target: Any = None, ah: Any = None, remote_qpn: int = 0, remote_qkey: int = 0,
                  bind: Optional[Tuple[Any, int, Any, int, int, int]] = None, internal: bool = False) -> None:
        """Fill the EP's single request and post it; remember it for its completion.

        ``internal``: aiodat's own request (the drain marker of a graceful disconnect, which
        may be retried once the EP is DISCONNECT_PENDING): no state check."""
        send_flags, quiet = _flag_bits("flags", flags)
        if (self._conn.state is not EPState.CONNECTED and self.attrs.service_type is ServiceType.RC
                and opcode != WR_BIND_MW and not internal):
            raise InvalidState(f"cannot post {op.value} on an EP in state {self._conn.state.value} (connect it first)")
        if self._ud and self._conn.state is EPState.ERROR:
            raise InvalidState(f"cannot post {op.value} on a UD EP in state ERROR (an error completion broke its "
                               f"queue pair: reset() it)")
        if self._ud and ah is None and opcode != WR_BIND_MW and opcode != WR_LOCAL_INV:
            # (a UD request's address handle shares its place with the RDMA fields: the device
            # would read a NULL or made-up one, and the process crash)
            raise _not_on_ud(op.value, opcode)
        wr = self._wr
        wr_id = next(self._ids) * 2
        wr.wr_id = wr_id
        wr.opcode = opcode
        wr.send_flags = send_flags | self._inline_bit(opcode, segs)
        wr.imm_data = imm_data or 0
        wr.sge_start, wr.num_sge = 0, len(segs)
        wr.remote_addr = remote.address if remote is not None else 0
        wr.rkey = remote.rmr_context if remote is not None else 0
        wr.compare_add, wr.swap = compare_add, swap
        wr.ah = ah if ah is not None else ffi.NULL
        wr.remote_qpn, wr.remote_qkey = remote_qpn, remote_qkey
        if bind is not None:
            wr.mw, wr.mw_rkey, wr.bind_mr, wr.bind_addr, wr.bind_length, wr.bind_access = bind
        else:
            wr.mw, wr.mw_rkey, wr.bind_mr = ffi.NULL, 0, ffi.NULL
        fill_sges(self._sges, 0, segs)
        uses, quiet_id, entries = _lmr_counts((segs,)), wr_id if quiet else None, ((wr_id, cookie, op, segs, target),)
        err = self._post_recorded(self._send_q, entries, uses, lib.aiodat_post_send,
                                  (self._qp, wr, 1, self._sges, self._posted), quiet_id)
        if err:
            self._take_back(self._send_q, entries, 0, uses, quiet_id)
            raise self._post_error(err, f"post {op.value}")

    def post_send(self, segments: Segments, cookie: Any = None,
                  flags: CompletionFlags = CompletionFlags.DEFAULT, *, imm_data: Optional[int] = None) -> None:
        """Send the bytes of ``segments`` to the peer (dat_ep_post_send); with ``imm_data``, a send with immediate."""
        if imm_data is None:
            # the hot path in C, as in post_recv: a send of one segment on a connected RC EP
            err = _c_post_send(self, self._qp_address, segments, cookie, flags)
            if not err:
                return
            if err > 0:
                raise self._post_error(err, "post send")
        segs = as_segments(segments)
        self._check_post(segs, self.attrs.max_request_iov, "post_send")
        check_imm_data(imm_data)
        opcode = WR_SEND if imm_data is None else WR_SEND_WITH_IMM
        self._post_one(DTOOp.SEND, opcode, segs, cookie, flags, imm_data=imm_data)

    def post_send_batch(self, items: Iterable[Tuple[Segments, Any]],
                        flags: CompletionFlags = CompletionFlags.DEFAULT,
                        last_flags: Optional[CompletionFlags] = None) -> int:
        """Post many sends in one crossing into C; ``items`` are (segments, cookie) pairs. Returns how many were posted.

        ``last_flags`` (default: ``flags``) are the last request's: ``flags=SUPPRESS,
        last_flags=DEFAULT`` asks for one completion per batch, which also retires the others.
        """
        posted = self._batch_in_c(WR_SEND, DTOOp.SEND, items, flags, last_flags)
        if posted is not None:
            return posted
        inputs, cookies = _columns(items, 2, "post_send_batch", "(segments, cookie) pairs")
        segs_column, same = self._checked(inputs, self.attrs.max_request_iov, "post_send_batch")
        return self._post_many(DTOOp.SEND, WR_SEND, segs_column, cookies, same, flags, last_flags)

    # -- RDMA and atomics ---------------------------------------------------------
    def _check_remote(self, remote: Any, segs: Tuple[Segment, ...], what: str) -> None:
        if not isinstance(remote, RemoteRegion):
            raise InvalidParameter(f"{what}: remote must be an aiodat.RemoteRegion (lmr.remote(), rmr.remote() "
                                   f"or RemoteRegion.from_bytes), not {type(remote).__name__}")
        total = sum(seg.length for seg in segs)
        if total > remote.length:
            raise LengthError(f"{what}: the local segments hold {total} bytes but the remote region "
                              f"is only {remote.length} bytes long")

    def _read_iov_limit(self) -> int:
        return min(self.attrs.max_request_iov, self._ia._device_attr.max_sge_rd)

    def post_rdma_write(self, local_segments: Segments, remote: "RemoteRegion", cookie: Any = None,
                        flags: CompletionFlags = CompletionFlags.DEFAULT, *,
                        imm_data: Optional[int] = None) -> None:
        """Write the bytes of ``local_segments`` (gathered in order) to ``remote`` (dat_ep_post_rdma_write).

        With ``imm_data`` (a 32-bit unsigned int) it is an RDMA write with
        immediate: the peer must have a receive posted, which completes with
        ``operation`` DTOOp.RECV_RDMA_WRITE_IMM, ``imm_data`` and the written
        length (the receive's own buffer is not touched).  Raises LengthError
        when the local bytes exceed ``remote.length``, InvalidParameter beyond
        ``max_request_iov`` segments.  A wrong rkey or an address outside the
        peer's region fails the completion with IBV_WC_REM_ACCESS_ERR.
        """
        segs = as_segments(local_segments, "local_segments")
        self._check_post(segs, self.attrs.max_request_iov, "post_rdma_write")
        self._check_remote(remote, segs, "post_rdma_write")
        check_imm_data(imm_data)
        opcode = WR_RDMA_WRITE if imm_data is None else WR_RDMA_WRITE_WITH_IMM
        self._post_one(DTOOp.RDMA_WRITE, opcode, segs, cookie, flags, imm_data=imm_data, remote=remote)

    def post_rdma_read(self, local_segments: Segments, remote: "RemoteRegion", cookie: Any = None,
                       flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Read ``remote`` into ``local_segments`` (scattered in order) (dat_ep_post_rdma_read).

        The segment limit is ``min(max_request_iov, device max_sge_rd)``; the
        local LMR needs LOCAL_WRITE.  The completion's ``transferred_length``
        is the number of bytes read.
        """
        segs = as_segments(local_segments, "local_segments")
        self._check_post(segs, self._read_iov_limit(), "post_rdma_read", writes=True)
        self._check_remote(remote, segs, "post_rdma_read")
        if self.attrs.max_rdma_read_out == 0:
            raise InvalidParameter("post_rdma_read: this EP was created with EPAttr.max_rdma_read_out=0")
        self._post_one(DTOOp.RDMA_READ, WR_RDMA_READ, segs, cookie, flags, remote=remote)

    def _check_atomic(self, local_segment: Any, remote: Any, what: str) -> Tuple[Segment, ...]:
        segs = as_segments(local_segment, "local_segment")
        if len(segs) != 1 or segs[0].length != 8:
            raise InvalidParameter(f"{what}: the local segment must be exactly one 8-byte Segment "
                                   f"(lmr[i:i+8]), got {[s.length for s in segs]}")
        self._check_post(segs, 1, what, writes=True)  # (the remote's old value lands here)
        if not isinstance(remote, RemoteRegion):
            raise InvalidParameter(f"{what}: remote must be an aiodat.RemoteRegion, not {type(remote).__name__}")
        if remote.address % 8:
            raise InvalidParameter(f"{what}: the remote address {remote.address:#x} is not 8-byte aligned")
        if remote.length < 8:
            raise LengthError(f"{what}: the remote region is {remote.length} bytes; an atomic needs 8")
        if not self._ia._device_attr.atomic_cap:
            raise NotImplementedByProvider(f"{what}: {self._ia.device_name} does not support atomics (atomic_cap 0)")
        if self.attrs.max_rdma_read_out == 0:
            raise InvalidParameter(f"{what}: this EP was created with EPAttr.max_rdma_read_out=0")
        return segs

    @staticmethod
    def _u64(value: Any, name: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not -2**63 <= value < 2**64:
            raise InvalidParameter(f"{name} must be an int in [-2**63, 2**64), got {value!r}")
        return value & 0xFFFFFFFFFFFFFFFF

    def post_fetch_add(self, local_segment: Segments, remote: "RemoteRegion", add: int, cookie: Any = None,
                       flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Atomically add ``add`` (mod 2**64; negative subtracts) to the 8-byte word at ``remote``.

        The word's value before the add lands in ``local_segment`` (8 bytes,
        the initiator's byte order: read it with ``int.from_bytes(seg.memoryview(),
        sys.byteorder)``, see docs/datapath.md).  The remote address must be
        8-byte aligned (InvalidParameter otherwise, before posting) and the
        remote LMR or RMR must grant REMOTE_ATOMIC.
        """
        segs = self._check_atomic(local_segment, remote, "post_fetch_add")
        self._post_one(DTOOp.FETCH_ADD, WR_ATOMIC_FETCH_AND_ADD, segs, cookie, flags, remote=remote,
                       compare_add=self._u64(add, "add"))

    def post_compare_swap(self, local_segment: Segments, remote: "RemoteRegion", compare: int, swap: int,
                          cookie: Any = None, flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Atomically replace the 8-byte word at ``remote`` with ``swap`` if it equals ``compare``.

        The word's original value lands in ``local_segment`` (compare it with
        ``compare`` to know whether the swap happened).  Same rules as
        :meth:`post_fetch_add`.
        """
        segs = self._check_atomic(local_segment, remote, "post_compare_swap")
        self._post_one(DTOOp.COMPARE_SWAP, WR_ATOMIC_CMP_AND_SWP, segs, cookie, flags, remote=remote,
                       compare_add=self._u64(compare, "compare"), swap=self._u64(swap, "swap"))

    def post_rdma_write_batch(self, items: Iterable[Tuple[Segments, "RemoteRegion", Any]],
                              flags: CompletionFlags = CompletionFlags.DEFAULT,
                              last_flags: Optional[CompletionFlags] = None) -> int:
        """Post many RDMA writes in one crossing into C; ``items`` are (local_segments, remote, cookie).

        Every item is checked as :meth:`post_rdma_write` checks it before any
        is posted.  Returns how many were posted (all of them, or QueueFull is
        raised saying how many went).  ``last_flags`` as in :meth:`post_send_batch`.
        """
        posted = self._batch_in_c(WR_RDMA_WRITE, DTOOp.RDMA_WRITE, items, flags, last_flags)
        if posted is not None:
            return posted
        segs_column, cookies, remotes, same = self._remote_batch(items, self.attrs.max_request_iov,
                                                                 "post_rdma_write_batch")
        return self._post_many(DTOOp.RDMA_WRITE, WR_RDMA_WRITE, segs_column, cookies, same, flags, last_flags,
                               remotes)

    def post_rdma_read_batch(self, items: Iterable[Tuple[Segments, "RemoteRegion", Any]],
                             flags: CompletionFlags = CompletionFlags.DEFAULT,
                             last_flags: Optional[CompletionFlags] = None) -> int:
        """Post many RDMA reads in one crossing into C; ``items`` are (local_segments, remote, cookie).

        ``last_flags`` as in :meth:`post_send_batch`."""
        if self.attrs.max_rdma_read_out == 0:
            raise InvalidParameter("post_rdma_read_batch: this EP was created with EPAttr.max_rdma_read_out=0")
        posted = self._batch_in_c(WR_RDMA_READ, DTOOp.RDMA_READ, items, flags, last_flags)
        if posted is not None:
            return posted
        segs_column, cookies, remotes, same = self._remote_batch(items, self._read_iov_limit(), "post_rdma_read_batch",
                                                                 writes=True)
        return self._post_many(DTOOp.RDMA_READ, WR_RDMA_READ, segs_column, cookies, same, flags, last_flags,
                               remotes)

    def _remote_batch(self, items: Iterable[Tuple[Segments, "RemoteRegion", Any]], limit: int, what: str,
                      writes: bool = False) -> Tuple[List[Tuple[Segment, ...]], List[Any], List["RemoteRegion"], bool]:
        """The checked columns of a batch of (local_segments, remote, cookie) items, and whether
        every item gave the very same local segments and remote (the batch fast path)."""
        segs_column: List[Tuple[Segment, ...]] = []
        cookies: List[Any] = []
        remotes: List["RemoteRegion"] = []
        last_local: Any = segs_column  # sentinels no item is
        last_remote: Any = segs_column
        segs: Tuple[Segment, ...] = ()
        changes = 0
        try:
            items = iter(items)
        except TypeError:
            raise InvalidParameter(f"{what}: items must be an iterable of (local_segments, remote, cookie) "
                                   f"triples, not {type(items).__name__}") from None
        for item in items:
            try:
                local, remote, cookie = item
            except (TypeError, ValueError):
                raise InvalidParameter(f"{what}: items must be (local_segments, remote, cookie) triples") from None
            if local is not last_local or remote is not last_remote:  # else: checked already
                segs = as_segments(local, "local_segments")
                self._check_post(segs, limit, what, writes)
                self._check_remote(remote, segs, what)
                last_local, last_remote = local, remote
                changes += 1
            segs_column.append(segs)
            cookies.append(cookie)
            remotes.append(remote)
        return segs_column, cookies, remotes, changes == 1

    def _post_many(self, op: DTOOp, opcode: int, segs_column: Sequence[Tuple[Segment, ...]], cookies: Sequence[Any],
                   same: bool, flags: CompletionFlags, last_flags: Optional[CompletionFlags] = None,
                   remotes: Optional[Sequence["RemoteRegion"]] = None) -> int:
        """Post a checked batch; ``same``: every request has the very same segments (and remote)."""
        bits = (_flag_bits("flags", flags), _flag_bits("last_flags", flags if last_flags is None else last_flags))
        self._check()  # (an empty batch on a freed EP is refused too, not "0 posted")
        if self._ud:  # (before the state: a UD EP never connects)
            raise _not_on_ud(f"{op.value} batch", opcode)
        if self._conn.state is not EPState.CONNECTED:
            raise InvalidState(f"cannot post on an EP in state {self._conn.state.value} (connect it first)")
        n = len(cookies)
        if n == 0:
            return 0
        # the very same segments, all but the last suppressed: one entry, a run (wr.SendRun)
        as_run = n > 1 and same and not bits[0][0] & SEND_SIGNALED
        room = self._room(self._send_q)
        if n > room and not (room > 0 and as_run):  # (a run goes whole)
            # what fits goes, as a device posts until its queue is full, its last request with
            # ``last_flags``: the batch's one completion, which retires the others, is not lost
            posted = 0 if room <= 0 else self._post_many(
                op, opcode, segs_column[:room], cookies[:room], same, flags, last_flags,
                remotes[:room] if remotes is not None else None)
            raise self._refused_batch((posted, n, errno.ENOMEM), f"post {op.value} batch")
        if n > 1 and same:
            return self._post_same(op, opcode, segs_column[0], cookies, bits,
                                   remotes[0] if remotes is not None else None, as_run)
        wrs = ffi.new("struct aiodat_send_wr[]", n)
        sges = ffi.new("struct aiodat_sge[]", max(1, sum(map(len, segs_column))))
        (send_flags, quiet), (last_send_flags, last_quiet) = bits
        entries = []
        start = 0
        first = self._take_ids(n) * 2
        for i, (segs, cookie) in enumerate(zip(segs_column, cookies)):
            wr = wrs[i]
            wr_id = first + 2 * i
            wr.wr_id, wr.opcode = wr_id, opcode
            wr.send_flags = (send_flags if i + 1 < n else last_send_flags) | self._inline_bit(opcode, segs)
            wr.sge_start, wr.num_sge = start, len(segs)
            if remotes is not None:
                wr.remote_addr, wr.rkey = remotes[i].address, remotes[i].rmr_context
            fill_sges(sges, start, segs)
            start += len(segs)
            entries.append((wr_id, cookie, op, segs, None))
        err = self._post_recorded(self._send_q, entries, _lmr_counts(segs_column), lib.aiodat_post_send,
                                  (self._qp, wrs, n, sges, self._posted))
        posted = n if not err else self._posted[0]
        if err:
            self._take_back(self._send_q, entries, posted, _lmr_counts(segs_column[posted:]))
        if quiet or last_quiet:
            self._mark_quiet(first, posted, n, quiet, last_quiet)
        if err:
            raise self._refused_batch((posted, n, err), f"post {op.value} batch")
        return n

    def _post_same(self, op: DTOOp, opcode: int, segs: Tuple[Segment, ...], cookies: Sequence[Any],
                   bits: Tuple[Tuple[int, bool], Tuple[int, bool]], remote: Optional["RemoteRegion"],
                   as_run: bool) -> int:
        """The batch fast path: n requests on the same segments (and remote): one scatter/gather
        list, the request written once and copied n times in C, only the wr_ids set one by one.
        ``as_run``: the requests before the last are suppressed, and the batch is one send-queue
        entry (a wr.SendRun), which its last completion retires whole."""
        n = len(cookies)
        sges = ffi.new("struct aiodat_sge[]", max(1, len(segs)))
        fill_sges(sges, 0, segs)
        (send_flags, quiet), (last_send_flags, last_quiet) = bits
        inline = self._inline_bit(opcode, segs)
        send_flags, last_send_flags = send_flags | inline, last_send_flags | inline
        wr = ffi.new("struct aiodat_send_wr *")
        wr.opcode, wr.send_flags = opcode, send_flags
        wr.sge_start, wr.num_sge = 0, len(segs)
        if remote is not None:
            wr.remote_addr, wr.rkey = remote.address, remote.rmr_context
        first = self._take_ids(n) * 2
        q = self._send_q
        if as_run:
            cookies = cookies if type(cookies) is tuple else tuple(cookies)
            entries: Sequence[Any] = ((first, cookies, op, segs, SendRun(first, first + 2 * (n - 1))),)
        else:
            entries = list(zip(range(first, first + 2 * n, 2), cookies, repeat(op), repeat(segs), repeat(None)))
        err = self._post_recorded(q, entries, _lmr_counts((segs,), n), lib.aiodat_post_send_same,
                                  (self._qp, wr, last_send_flags, sges, first, 2, n, self._posted))
        posted = n if not err else self._posted[0]
        if err and as_run and posted:  # the run's entry is swapped for one of what went
            self._shorten_run(entries[0], posted, n)
        elif err:
            self._take_back(q, entries, 0 if as_run else posted, _lmr_counts((segs,), n - posted))
        if quiet or last_quiet:
            self._mark_quiet(first, posted, n, quiet, last_quiet)
        if err:
            raise self._refused_batch((posted, n, err), f"post {op.value} batch")
        return n

    def _shorten_run(self, run_entry: Tuple[Any, ...], posted: int, n: int) -> None:
        """A run of which the queue took only ``posted`` (at least 1) of ``n``: its entry is swapped
        for one of what went (a deque's item assignment allocates nothing), the others' counts are
        taken back.  If that entry cannot be made (memory), the run stays whole and counted whole:
        that refuses a free and loses nothing (its requests are retired with the next completion)."""
        first, cookies, op, segs, _ = run_entry
        q = self._send_q
        try:
            went = ((first, cookies[:posted], op, segs, SendRun(first, first + 2 * (posted - 1))) if posted > 1
                    else (first, cookies[0], op, segs, None))
            uses = _lmr_counts((segs,), n - posted)
        except Exception:
            return
        if q and q[-1] is run_entry:
            q[-1] = went
            _uncount(uses)

    def _mark_quiet(self, first: int, posted: int, n: int, quiet: bool, last_quiet: bool) -> None:
        """The UNSIGNALLED marks of a send batch (wr_ids ``first``, ``first + 2``, ...) of which
        ``posted`` of ``n`` went: made after its post, as posts.c's mark_batch_quiet; the batch
        went, so a mark that cannot be made (memory) is dropped: it only makes that request's
        event notify."""
        try:
            if quiet:
                self._quiet.update(range(first, first + 2 * min(posted, n - 1), 2))
            if last_quiet and posted == n:
                self._quiet.add(first + 2 * (n - 1))
        except Exception:
            pass

    # -- memory windows (called by memory.py) --------------------------------------
    def _bind_window(self, rmr: Any, op: DTOOp, bind: Tuple[Any, int, Any, int, int, int], cookie: Any) -> None:
        """Post the bind (DTOOp.BIND) or invalidation (DTOOp.UNBIND) of ``rmr``'s window and remember the window.

        ``bind`` is (mw, rkey, mr, address, length, access) as struct aiodat_send_wr takes it.
        """
        opcode = WR_BIND_MW if op is DTOOp.BIND else WR_LOCAL_INV
        # known before the post, as its other records: a QP destroyed with a window bound through it
        # waits for it (rxe: 50 s), unless _drop_windows finds it here
        known = rmr in self._windows
        self._windows.add(rmr)
        try:
            self._post_one(op, opcode, (), cookie, CompletionFlags.DEFAULT, target=rmr, bind=bind)
        except BaseException:
            if not known:
                self._windows.discard(rmr)
            raise

    def _forget_window(self, rmr: Any) -> None:
        """memory.py: ``rmr`` is no longer bound through this QP."""
        self._windows.discard(rmr)

    # -- the drain of a graceful disconnect (called by cm.py) ------------------------
    def _post_drain_marker(self, callback: Callable[[str], object]) -> DrainMarker:
        """Post a signalled zero-length RDMA write behind everything posted; ``callback(status)``
        runs when it completes, i.e. once every earlier request of the send queue has.

        A zero-length RDMA write carries no data, and the responder checks no R_Key or
        address for it (IBA C9-88), so the peer sees nothing.  Raises QueueFull when the
        send queue has no room for it."""
        marker = DrainMarker(callback)
        # awaited before the post, as the request's records are made (undone by release())
        marker.evd = evd = self.request_evd
        evd._awaited += 1  # polled even if the EVD is full, as for an awaited bind (docs/events.md)
        try:
            evd._rearm_fully()  # ... and announced by the channel even after a solicited wait
            self._post_one(DTOOp.RDMA_WRITE, WR_RDMA_WRITE, (), None, CompletionFlags.DEFAULT, target=marker,
                           internal=True)
        except BaseException:
            marker.release()
            raise
        return marker
