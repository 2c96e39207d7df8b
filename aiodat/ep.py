"""Endpoints: a queue pair, its DTO posts and its states (dat_ep_*).

Posting goes through the C shim, one crossing per call (or per batch with
:meth:`EP.post_send_batch`).  Each posted request is remembered with its
cookie and the LMR segments it uses; the completion that comes back through
the EVD (evd.py) finds it again, so the event carries the cookie, and the
LMRs cannot be freed while the hardware may still touch them.  Requests posted
without a completion (suppressed or unsignalled) are retired when a later
request of the same send queue completes, as the send queue is ordered.
Connection set-up and tear-down live in cm.py.
"""
from __future__ import annotations

import enum
import itertools
from itertools import repeat
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Deque, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from aiodat._handle import Handle
from aiodat._lib import ffi, lib
from aiodat.errors import (
    InvalidHandle,
    InvalidParameter,
    InvalidState,
    LengthError,
    QueueFull,
    error_from_errno,
)
from aiodat.evd import DTOCompletionEvent, DTOOp, EvdFlags, EventType, ConnectionEvent
from aiodat.memory import LMR, Segment

if TYPE_CHECKING:
    from aiodat.evd import EVD
    from aiodat.ia import IA, PZ
    from aiodat.memory import RemoteRegion
    from aiodat.srq import SRQ

Segments = Union[Segment, LMR, Sequence[Segment], None]


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


class EPState(enum.Enum):
    """DAT endpoint states (DAT_EP_STATE_*)."""

    UNCONNECTED = "UNCONNECTED"
    RESERVED = "RESERVED"
    PASSIVE_CONNECTION_PENDING = "PASSIVE_CONNECTION_PENDING"
    ACTIVE_CONNECTION_PENDING = "ACTIVE_CONNECTION_PENDING"
    TENTATIVE_CONNECTION_PENDING = "TENTATIVE_CONNECTION_PENDING"
    CONNECTED = "CONNECTED"
    DISCONNECT_PENDING = "DISCONNECT_PENDING"
    DISCONNECTED = "DISCONNECTED"
    ERROR = "ERROR"


class ServiceType(enum.Enum):
    """Transport service of an EP (DAT_SERVICE_TYPE): reliable connected or (aiodat) unreliable datagram."""

    RC = "RC"
    UD = "UD"


@dataclass(frozen=True)
class EPAttr:
    """Endpoint attributes (DAT_EP_ATTR): queue depths, segment limits, RDMA read depth and
    the transport settings of the QP (see docs/hardware.md for when to change them)."""

    max_recv_dtos: int = 64
    max_request_dtos: int = 64
    max_recv_iov: int = 1
    max_request_iov: int = 1
    max_rdma_read_in: int = 4
    max_rdma_read_out: int = 4
    #: sends and RDMA writes of at most this many bytes go inline (copied into the work request
    #: at post time: no DMA read of the buffer, lower latency on hardware).  None: what the
    #: device offers, up to DEFAULT_INLINE_DATA bytes (0 on a device without inline data); an
    #: int asks for exactly that much and fails if the device cannot give it.
    max_inline_data: Optional[int] = None
    service_type: ServiceType = ServiceType.RC
    #: how many times the transport resends an unacknowledged request before it fails with
    #: IBV_WC_RETRY_EXC_ERR and the connection breaks (0-7; the connecting side's value is the
    #: one both QPs use).  The default is 6, not the usual 7, because rxe retries for ever at 7.
    retry_count: int = 6
    #: the ACK timeout of this side's QP, IB-encoded: 4.096 us * 2**ack_timeout (1-31).  None
    #: keeps the connection manager's (on RoCE 19, about 2.1 s).  With retry_count it sets how
    #: long a dead link takes to be reported: about (retry_count + 1) timeouts.
    ack_timeout: Optional[int] = None
    #: how many times a send is retried after a receiver-not-ready NAK (0-7; 7: for ever, so a
    #: slow receiver stalls the sender instead of breaking the connection)
    rnr_retry: int = 7
    #: the RNR NAK delay this side asks of a sender that finds no receive posted, IB-encoded
    #: (1: 0.01 ms ... 12: 0.64 ms ... 31: 491 ms; 0: 655 ms).  12 is the usual value on
    #: hardware; the connection manager would leave 0, the longest.
    min_rnr_timer: int = 12
    #: the completion vector (interrupt) of the EP's own EVDs' CQs; None spreads EVDs over the
    #: device's vectors in turn (``ia.create_evd(comp_vector=...)`` for shared EVDs)
    comp_vector: Optional[int] = None

    def _validate(self, ia: "IA") -> None:
        dev = ia._device_attr
        limits = {
            "max_recv_dtos": dev.max_qp_wr, "max_request_dtos": dev.max_qp_wr,
            "max_recv_iov": min(dev.max_sge, 32), "max_request_iov": min(dev.max_sge, 32),
            "max_rdma_read_in": dev.max_qp_rd_atom, "max_rdma_read_out": dev.max_qp_init_rd_atom,
        }
        limits.update(retry_count=7, rnr_retry=7, min_rnr_timer=31)
        for name, limit in limits.items():
            value = getattr(self, name)
            low = 0 if name.startswith("max_rdma_read") or name in ("retry_count", "rnr_retry", "min_rnr_timer") else 1
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= limit:
                raise InvalidParameter(f"EPAttr.{name} must be between {low} and {limit}, got {value!r}")
        optional = {"ack_timeout": (1, 31), "max_inline_data": (0, 1 << 16),
                    "comp_vector": (0, max(0, ia._context.num_comp_vectors - 1))}
        for name, (low, high) in optional.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high):
                raise InvalidParameter(f"EPAttr.{name} must be None or between {low} and {high}, got {value!r}")


# ibv_wr_opcode values (enum ibv_wr_opcode, stable ABI)
WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, WR_SEND, WR_SEND_WITH_IMM = 0, 1, 2, 3
WR_RDMA_READ, WR_ATOMIC_CMP_AND_SWP, WR_ATOMIC_FETCH_AND_ADD = 4, 5, 6
WR_LOCAL_INV, WR_BIND_MW = 7, 8
# ibv_send_flags
SEND_FENCE, SEND_SIGNALED, SEND_SOLICITED, SEND_INLINE = 1, 2, 4, 8
WC_RECV_RDMA_WITH_IMM = 129  # IBV_WC_RECV_RDMA_WITH_IMM
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


# the hot paths compare by identity with these
_NO_FLAGS = CompletionFlags.DEFAULT
_CONNECTED, _DISCONNECTED, _ERROR = EPState.CONNECTED, EPState.DISCONNECTED, EPState.ERROR
_SEND, _RECV = DTOOp.SEND, DTOOp.RECV


def _wc_status_name(status: int) -> str:
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


def as_segments(segments: Segments, what: str = "segments") -> Tuple[Segment, ...]:
    """Normalise what a post accepts (a Segment, a whole LMR, a list of them, or None) to a tuple."""
    if segments is None:
        return ()
    if isinstance(segments, Segment):
        return (segments,)
    if isinstance(segments, LMR):
        return (segments.segment(),)
    try:
        items = tuple(segments)
    except TypeError:
        raise InvalidParameter(
            f"{what} must be a Segment (lmr[a:b]), an LMR or a list of them, not {type(segments).__name__}"
        ) from None
    out = []
    for item in items:
        if isinstance(item, LMR):
            item = item.segment()
        if not isinstance(item, Segment):
            raise InvalidParameter(f"{what} must hold Segments (lmr[a:b]), found {type(item).__name__}")
        out.append(item)
    return tuple(out)


class EP(Handle):
    """An Endpoint (dat_ep_create): a queue pair with its EVDs, in a PZ."""

    _kind = "ep"
    _close_rank = 0  # QPs go first: before the RMRs, LMRs and SRQs of their PZ

    def __init__(
        self,
        ia: "IA",
        pz: "PZ",
        recv_evd: Optional["EVD"],
        request_evd: Optional["EVD"],
        connect_evd: Optional["EVD"],
        srq: Optional["SRQ"],
        attrs: Optional[EPAttr],
    ) -> None:
        from aiodat.ia import PZ

        ia._check()
        if not isinstance(pz, PZ):
            raise InvalidParameter(f"pz must be a PZ, not {type(pz).__name__}")
        pz._check()
        if pz.ia is not ia:
            raise InvalidParameter("the PZ belongs to another IA")
        attrs = attrs or EPAttr()
        if not isinstance(attrs, EPAttr):
            raise InvalidParameter(f"attrs must be an EPAttr, not {type(attrs).__name__}")
        attrs._validate(ia)
        for name, evd, stream in (("recv_evd", recv_evd, EvdFlags.DTO), ("request_evd", request_evd, EvdFlags.DTO),
                                  ("connect_evd", connect_evd, EvdFlags.CONNECTION)):
            if evd is not None:
                evd._check()
                if evd._ia is not ia:
                    raise InvalidParameter(f"{name} belongs to another IA")
                if not evd.streams & stream:
                    raise InvalidParameter(f"{name} does not accept the {stream.name} stream")
        if srq is not None:
            from aiodat.srq import SRQ

            if not isinstance(srq, SRQ):
                raise InvalidParameter(f"srq must be an SRQ, not {type(srq).__name__}")
            srq._check()
            if srq._ia is not ia:
                raise InvalidParameter("the SRQ belongs to another IA")
            if srq._pz is not pz and not ia.query().provider_attr.srq_ep_pz_difference_supported:
                from aiodat.errors import ModelNotSupported

                raise ModelNotSupported("the EP's PZ differs from the SRQ's PZ, and this provider does not "
                                        "support that (srq_ep_pz_difference_supported is False)")
        super().__init__(pz)
        self._ia, self._pz, self._srq, self.attrs = ia, pz, srq, attrs
        self._own_evds: List["EVD"] = []
        try:
            self.recv_evd: "EVD" = recv_evd or self._private_evd(attrs.max_recv_dtos, EvdFlags.DTO, "recv_evd")
            self.request_evd: "EVD" = request_evd or self._private_evd(
                attrs.max_request_dtos, EvdFlags.DTO | EvdFlags.RMR_BIND, "request_evd")
            self.connect_evd: "EVD" = connect_evd or self._private_evd(16, EvdFlags.CONNECTION, "connect_evd")
        except BaseException:  # leave no half-made EP in the PZ (its close would fail, the PZ never free)
            self._destroy_own_evds()
            self._closed = True
            pz._children.pop(self, None)
            raise
        self._state = EPState.UNCONNECTED
        self._ids = itertools.count(1)
        self._send_q: Deque[Tuple[int, Any, DTOOp, Tuple[Segment, ...], Any]] = deque()
        self._recv_q: Deque[Tuple[int, Any, Tuple[Segment, ...]]] = deque()
        self._cm_id: Any = ffi.NULL
        self._connect_waiter: Any = None  # future of an awaited connect/accept/disconnect
        self._cm_timer: Any = None
        self._pending_private = b""
        self._wr = ffi.new("struct aiodat_send_wr *")
        self._sges = ffi.new("struct aiodat_sge[]", 32)
        self._posted = ffi.new("int *")
        self._recv_wr = (ffi.new("uint64_t[1]"), ffi.new("int[1]"), ffi.new("int[1]"))
        self._quiet: set = set()  # wr_ids posted UNSIGNALLED: their events do not notify
        self._rc = attrs.service_type is ServiceType.RC  # the post fast paths are for RC only
        self._ud = attrs.service_type is ServiceType.UD
        self._grh_lmr: Optional[LMR] = None  # scratch for the GRH of post_recv_datagram
        self._qp = self._create_qp()
        self.qp_num: int = self._qp.qp_num
        ia._qpn_owner[self.qp_num] = self
        if srq is not None:
            srq._eps[self] = None

    def _private_evd(self, qlen: int, streams: EvdFlags, what: str = "EVD") -> "EVD":
        from aiodat.evd import EVD

        limit = self._ia._device_attr.max_cqe
        if qlen > limit:
            raise InvalidParameter(f"the EP's own {what} would need {qlen} entries, more than max_evd_qlen "
                                   f"{limit}: lower the EPAttr queue depth or pass an EVD")
        evd = EVD(self._ia, max(qlen, 1), streams, comp_vector=self.attrs.comp_vector)
        self._own_evds.append(evd)
        return evd

    def _create_qp(self) -> Any:
        a = self.attrs
        init = ffi.new("struct ibv_qp_init_attr *")
        init.send_cq = self.request_evd._cq
        init.recv_cq = self.recv_evd._cq
        init.srq = self._srq._srq if self._srq is not None else ffi.NULL
        init.cap.max_send_wr = a.max_request_dtos
        init.cap.max_recv_wr = 0 if self._srq is not None else a.max_recv_dtos
        init.cap.max_send_sge = a.max_request_iov
        init.cap.max_recv_sge = 0 if self._srq is not None else a.max_recv_iov
        init.cap.max_inline_data = DEFAULT_INLINE_DATA if a.max_inline_data is None else a.max_inline_data
        init.qp_type = lib.IBV_QPT_UD if a.service_type is ServiceType.UD else lib.IBV_QPT_RC
        init.sq_sig_all = 0
        qp = lib.ibv_create_qp(self._pz._pd, init)
        if qp == ffi.NULL and a.max_inline_data is None:  # a device without (that much) inline data
            init.cap.max_inline_data = 0
            qp = lib.ibv_create_qp(self._pz._pd, init)
        #: the bytes a send or RDMA write may have to go inline: what the device granted (it may
        #: round up), but never more than an explicit EPAttr.max_inline_data
        self.max_inline: int = init.cap.max_inline_data if a.max_inline_data is None else min(
            init.cap.max_inline_data, a.max_inline_data)
        if qp == ffi.NULL:
            err = ffi.errno
            self._destroy_own_evds()
            self._closed = True
            self._pz._children.pop(self, None)
            raise error_from_errno(err, f"creating the queue pair ({a})")
        # Move to INIT now so receives can be posted before connecting (as DAT allows);
        # rdma_cm takes the QP on through RTR and RTS when the connection forms.
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = lib.IBV_QPS_INIT
        attr.pkey_index = 0
        attr.port_num = self._ia.port
        mask = lib.IBV_QP_STATE | lib.IBV_QP_PKEY_INDEX | lib.IBV_QP_PORT
        if a.service_type is ServiceType.UD:
            attr.qkey = lib.RDMA_UDP_QKEY
            mask |= lib.IBV_QP_QKEY
        else:
            attr.qp_access_flags = (lib.IBV_ACCESS_REMOTE_WRITE | lib.IBV_ACCESS_REMOTE_READ
                                    | lib.IBV_ACCESS_REMOTE_ATOMIC)
            mask |= lib.IBV_QP_ACCESS_FLAGS
        err = lib.ibv_modify_qp(qp, attr, mask)
        if not err and a.service_type is ServiceType.UD:
            # A UD QP needs no connection: take it on to RTS now (as librdmacm's
            # ucma_init_ud_qp does), so it can send as soon as it has an address handle.
            attr = ffi.new("struct ibv_qp_attr *")
            attr.qp_state = lib.IBV_QPS_RTR
            err = lib.ibv_modify_qp(qp, attr, lib.IBV_QP_STATE)
            if not err:
                attr.qp_state = lib.IBV_QPS_RTS
                attr.sq_psn = 0
                err = lib.ibv_modify_qp(qp, attr, lib.IBV_QP_STATE | lib.IBV_QP_SQ_PSN)
        if err:
            lib.ibv_destroy_qp(qp)
            self._destroy_own_evds()
            self._closed = True
            self._pz._children.pop(self, None)
            raise error_from_errno(err, "moving the new queue pair to INIT" if a.service_type is ServiceType.RC
                                   else "moving the new UD queue pair to RTS")
        return qp

    # -- state -------------------------------------------------------------
    @property
    def state(self) -> EPState:
        """The DAT state of the endpoint."""
        return self._state

    @property
    def ia(self) -> "IA":
        """The IA the endpoint belongs to."""
        return self._ia

    @property
    def pz(self) -> "PZ":
        """The PZ the endpoint belongs to."""
        return self._pz

    @property
    def srq(self) -> Optional["SRQ"]:
        """The SRQ the endpoint receives from, if any."""
        return self._srq

    def _evds(self) -> Tuple["EVD", ...]:
        return (self.recv_evd, self.request_evd, self.connect_evd)

    def query(self) -> "EPParam":
        """Return the endpoint's parameters (dat_ep_query)."""
        self._check()
        from aiodat.cm import cm_addresses

        local, remote = cm_addresses(self._cm_id)
        retry_count = ack_timeout = None
        if self._state is EPState.CONNECTED and self._rc:
            attr, init = ffi.new("struct ibv_qp_attr *"), ffi.new("struct ibv_qp_init_attr *")
            if not lib.ibv_query_qp(self._qp, attr, lib.IBV_QP_TIMEOUT | lib.IBV_QP_RETRY_CNT, init):
                retry_count, ack_timeout = attr.retry_cnt, attr.timeout
        return EPParam(ia=self._ia, pz=self._pz, state=self._state, attrs=self.attrs, qp_num=self.qp_num,
                       local_address=local, remote_address=remote, recv_evd=self.recv_evd,
                       request_evd=self.request_evd, connect_evd=self.connect_evd, srq=self._srq,
                       outstanding_requests=len(self._send_q), outstanding_recvs=len(self._recv_q),
                       retry_count=retry_count, ack_timeout=ack_timeout)

    # -- posting -----------------------------------------------------------
    def _check_post(self, segs: Tuple[Segment, ...], limit: int, what: str) -> None:
        self._check()
        if len(segs) > limit:
            raise InvalidParameter(f"{what} takes at most {limit} segment(s) on this EP "
                                   f"(EPAttr max iov), got {len(segs)}")
        for seg in segs:
            seg.lmr._check()
            if seg.lmr._pz is not self._pz:
                from aiodat.errors import ProtectionViolation

                raise ProtectionViolation(f"{what}: an LMR of another PZ cannot be used on this EP")

    def _fill_sges(self, sges: Any, start: int, segs: Tuple[Segment, ...]) -> None:
        for i, seg in enumerate(segs):
            sge = sges[start + i]
            sge.addr = seg.lmr.address + seg.offset
            sge.length = seg.length
            sge.lkey = seg.lmr.lmr_context

    def _track(self, segs: Tuple[Segment, ...], delta: int) -> None:
        for seg in segs:
            seg.lmr._inflight += delta

    def post_recv(self, segments: Segments, cookie: Any = None,
                  flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Post a receive into ``segments`` (dat_ep_post_recv); it completes on ``recv_evd``."""
        if type(segments) is Segment and flags is _NO_FLAGS and self._srq is None and not self._closed:
            # The hot path (one segment, default flags): the same checks as below, in fewer
            # steps, and scalars into C instead of filling arrays field by field.
            lmr, state = segments.lmr, self._state
            if lmr._pz is self._pz and not lmr._closed and state is not _DISCONNECTED and state is not _ERROR:
                wr_id = next(self._ids) * 2 + 1
                err = lib.aiodat_post_recv1(self._qp, wr_id, lmr.address + segments.offset, segments.length,
                                            lmr.lmr_context)
                if err:
                    raise self._post_error(err, "post_recv", len(self._recv_q), self.attrs.max_recv_dtos)
                self._recv_q.append((wr_id, cookie, (segments,)))
                lmr._inflight += 1
                return
        if not isinstance(flags, int):
            raise InvalidParameter(f"flags must be CompletionFlags, not {type(flags).__name__}")
        segs = as_segments(segments)
        self._check_post(segs, self.attrs.max_recv_iov, "post_recv")
        if self._srq is not None:
            raise InvalidState("this EP receives from an SRQ: post to srq.post_recv")
        if self._state in (EPState.DISCONNECTED, EPState.ERROR):
            raise InvalidState(f"cannot post a receive on an EP in state {self._state.value}")
        wr_id = next(self._ids) * 2 + 1
        self._fill_sges(self._sges, 0, segs)
        ids, starts, counts = self._recv_wr  # made once per EP: no allocation per post
        ids[0], counts[0] = wr_id, len(segs)
        err = lib.aiodat_post_recv(self._qp, ffi.NULL, ids, starts, counts, 1, self._sges, self._posted)
        if err:
            raise self._post_error(err, "post_recv", len(self._recv_q), self.attrs.max_recv_dtos)
        self._recv_q.append((wr_id, cookie, segs))
        self._track(segs, 1)
        if flags & CompletionFlags.UNSIGNALLED:
            self._quiet.add(wr_id)

    def post_recv_batch(self, items: Iterable[Tuple[Segments, Any]]) -> int:
        """Post many receives in one crossing into C; ``items`` are (segments, cookie) pairs.

        Every item is checked first; returns how many were posted (QueueFull
        says how many went if the receive queue fills part way).
        """
        self._check()
        if self._srq is not None:
            raise InvalidState("this EP receives from an SRQ: post to srq.post_recv_batch")
        if self._state in (EPState.DISCONNECTED, EPState.ERROR):
            raise InvalidState(f"cannot post a receive on an EP in state {self._state.value}")
        batch = []
        last_in: Any = batch  # a sentinel no item is
        checked: Tuple[Segment, ...] = ()
        for segs, cookie in items:
            if segs is not last_in:  # the same segments again: checked already
                checked = as_segments(segs)
                self._check_post(checked, self.attrs.max_recv_iov, "post_recv_batch")
                last_in = segs
            batch.append((checked, cookie))
        n = len(batch)
        if n == 0:
            return 0
        first = batch[0][0]
        if all(segs is first for segs, _ in batch):  # one scatter list shared by every receive
            sges = ffi.new("struct aiodat_sge[]", max(1, len(first)))
            self._fill_sges(sges, 0, first)
            first_id = self._take_ids(n) * 2 + 1
            err = lib.aiodat_post_recv_same(self._qp, ffi.NULL, first_id, 2, n, sges, len(first), self._posted)
            posted = self._posted[0]
            self._recv_q.extend(zip(range(first_id, first_id + 2 * posted, 2), [c for _, c in batch], repeat(first)))
            for seg in first:
                seg.lmr._inflight += posted
            if err:
                raise self._post_error(err, f"post_recv_batch (posted {posted} of {n})", len(self._recv_q),
                                       self.attrs.max_recv_dtos)
            return posted
        id_gen = self._ids
        wr_ids = [next(id_gen) * 2 + 1 for _ in range(n)]
        sges = ffi.new("struct aiodat_sge[]", max(1, sum(len(s) for s, _ in batch)))
        start_list, start = [], 0
        for segs, _ in batch:
            self._fill_sges(sges, start, segs)
            start_list.append(start)
            start += len(segs)
        starts = ffi.new("int[]", start_list)
        counts = ffi.new("int[]", [len(segs) for segs, _ in batch])
        ids = ffi.new("uint64_t[]", wr_ids)
        err = lib.aiodat_post_recv(self._qp, ffi.NULL, ids, starts, counts, n, sges, self._posted)
        posted = self._posted[0]
        self._recv_q.extend([(wr_ids[i], batch[i][1], batch[i][0]) for i in range(posted)])
        for segs, _ in batch[:posted]:
            for seg in segs:
                seg.lmr._inflight += 1
        if err:
            raise self._post_error(err, f"post_recv_batch (posted {posted} of {n})", len(self._recv_q),
                                   self.attrs.max_recv_dtos)
        return posted

    def _take_ids(self, n: int) -> int:
        """Reserve ``n`` consecutive request numbers (a batch's wr_ids); returns the first."""
        first = next(self._ids)
        self._ids = itertools.count(first + n)
        return first

    def _inline_bit(self, opcode: int, segs: Tuple[Segment, ...]) -> int:
        """IBV_SEND_INLINE for a send or RDMA write small enough to go inline, else 0."""
        if opcode in _INLINE_OPCODES and sum(seg.length for seg in segs) <= self.max_inline:
            return SEND_INLINE
        return 0

    def _post_error(self, err: int, what: str, outstanding: int, limit: int) -> Exception:
        if err == 12:  # ENOMEM from a full work queue
            return QueueFull(f"{what}: the queue is full ({outstanding} of {limit} outstanding)")
        return error_from_errno(err, what)

    def _post_one(self, op: DTOOp, opcode: int, segs: Tuple[Segment, ...], cookie: Any,
                  flags: CompletionFlags, *, imm_data: Optional[int] = None,
                  remote: Optional["RemoteRegion"] = None, compare_add: int = 0, swap: int = 0,
                  target: Any = None, ah: Any = None, remote_qpn: int = 0, remote_qkey: int = 0,
                  bind: Optional[Tuple[Any, int, Any, int, int, int]] = None) -> None:
        """Fill the EP's single request and post it; remember it for its completion."""
        send_flags, quiet = _flag_bits("flags", flags)
        if self._state is not EPState.CONNECTED and self.attrs.service_type is ServiceType.RC and opcode != WR_BIND_MW:
            raise InvalidState(f"cannot post {op.value} on an EP in state {self._state.value} (connect it first)")
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
        self._fill_sges(self._sges, 0, segs)
        err = lib.aiodat_post_send(self._qp, wr, 1, self._sges, self._posted)
        if err:
            raise self._post_error(err, f"post {op.value}", len(self._send_q), self.attrs.max_request_dtos)
        self._send_q.append((wr_id, cookie, op, segs, target))
        self._track(segs, 1)
        if quiet:
            self._quiet.add(wr_id)

    def post_send(self, segments: Segments, cookie: Any = None,
                  flags: CompletionFlags = CompletionFlags.DEFAULT, *, imm_data: Optional[int] = None) -> None:
        """Send the bytes of ``segments`` to the peer (dat_ep_post_send); with ``imm_data``, a send with immediate."""
        if (type(segments) is Segment and imm_data is None and type(flags) is CompletionFlags and 0 <= flags < 16
                and self._state is _CONNECTED and self._rc and not self._closed):
            lmr = segments.lmr
            if lmr._pz is self._pz and not lmr._closed:  # the hot path, as in post_recv
                send_flags, quiet = _SEND_BITS[flags]
                if segments.length <= self.max_inline:
                    send_flags |= SEND_INLINE
                wr_id = next(self._ids) * 2
                err = lib.aiodat_post_send1(self._qp, wr_id, WR_SEND, send_flags, 0, lmr.address + segments.offset,
                                            segments.length, lmr.lmr_context, 0, 0)
                if err:
                    raise self._post_error(err, "post send", len(self._send_q), self.attrs.max_request_dtos)
                self._send_q.append((wr_id, cookie, _SEND, (segments,), None))
                lmr._inflight += 1
                if quiet:
                    self._quiet.add(wr_id)
                return
        segs = as_segments(segments)
        self._check_post(segs, self.attrs.max_request_iov, "post_send")
        if imm_data is not None and not (isinstance(imm_data, int) and 0 <= imm_data < 2**32):
            raise InvalidParameter(f"imm_data must be a 32-bit unsigned int, got {imm_data!r}")
        opcode = WR_SEND if imm_data is None else WR_SEND_WITH_IMM
        self._post_one(DTOOp.SEND, opcode, segs, cookie, flags, imm_data=imm_data)

    def post_send_batch(self, items: Iterable[Tuple[Segments, Any]],
                        flags: CompletionFlags = CompletionFlags.DEFAULT,
                        last_flags: Optional[CompletionFlags] = None) -> int:
        """Post many sends in one crossing into C; ``items`` are (segments, cookie) pairs. Returns how many were posted.

        ``last_flags`` (default: ``flags``) are the last request's: ``flags=SUPPRESS,
        last_flags=DEFAULT`` asks for one completion per batch, which also retires the others.
        """
        batch = []
        last_in: Any = batch  # a sentinel no item is
        checked: Tuple[Segment, ...] = ()
        for segs, cookie in items:
            if segs is not last_in:  # the same segments again (a stream of one buffer): checked already
                checked = as_segments(segs)
                self._check_post(checked, self.attrs.max_request_iov, "post_send_batch")
                last_in = segs
            batch.append((checked, cookie))
        return self._post_many(DTOOp.SEND, WR_SEND, batch, flags, last_flags)

    # -- RDMA and atomics ---------------------------------------------------------
    def _check_remote(self, remote: Any, segs: Tuple[Segment, ...], what: str) -> None:
        from aiodat.memory import RemoteRegion

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
        if imm_data is not None and not (isinstance(imm_data, int) and 0 <= imm_data < 2**32):
            raise InvalidParameter(f"imm_data must be a 32-bit unsigned int, got {imm_data!r}")
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
        self._check_post(segs, self._read_iov_limit(), "post_rdma_read")
        self._check_remote(remote, segs, "post_rdma_read")
        if self.attrs.max_rdma_read_out == 0:
            raise InvalidParameter("post_rdma_read: this EP was created with EPAttr.max_rdma_read_out=0")
        self._post_one(DTOOp.RDMA_READ, WR_RDMA_READ, segs, cookie, flags, remote=remote)

    def _check_atomic(self, local_segment: Any, remote: Any, what: str) -> Tuple[Segment, ...]:
        segs = as_segments(local_segment, "local_segment")
        if len(segs) != 1 or segs[0].length != 8:
            raise InvalidParameter(f"{what}: the local segment must be exactly one 8-byte Segment "
                                   f"(lmr[i:i+8]), got {[s.length for s in segs]}")
        self._check_post(segs, 1, what)
        from aiodat.memory import RemoteRegion

        if not isinstance(remote, RemoteRegion):
            raise InvalidParameter(f"{what}: remote must be an aiodat.RemoteRegion, not {type(remote).__name__}")
        if remote.address % 8:
            raise InvalidParameter(f"{what}: the remote address {remote.address:#x} is not 8-byte aligned")
        if remote.length < 8:
            raise LengthError(f"{what}: the remote region is {remote.length} bytes; an atomic needs 8")
        if not self._ia._device_attr.atomic_cap:
            from aiodat.errors import NotImplementedByProvider

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
        batch, remotes = self._remote_batch(items, self.attrs.max_request_iov, "post_rdma_write_batch")
        return self._post_many(DTOOp.RDMA_WRITE, WR_RDMA_WRITE, batch, flags, last_flags, remotes)

    def post_rdma_read_batch(self, items: Iterable[Tuple[Segments, "RemoteRegion", Any]],
                             flags: CompletionFlags = CompletionFlags.DEFAULT,
                             last_flags: Optional[CompletionFlags] = None) -> int:
        """Post many RDMA reads in one crossing into C; ``items`` are (local_segments, remote, cookie).

        ``last_flags`` as in :meth:`post_send_batch`."""
        if self.attrs.max_rdma_read_out == 0:
            raise InvalidParameter("post_rdma_read_batch: this EP was created with EPAttr.max_rdma_read_out=0")
        batch, remotes = self._remote_batch(items, self._read_iov_limit(), "post_rdma_read_batch")
        return self._post_many(DTOOp.RDMA_READ, WR_RDMA_READ, batch, flags, last_flags, remotes)

    def _remote_batch(self, items: Iterable[Tuple[Segments, "RemoteRegion", Any]], limit: int,
                      what: str) -> Tuple[List[Tuple[Tuple[Segment, ...], Any]], List["RemoteRegion"]]:
        batch: List[Tuple[Tuple[Segment, ...], Any]] = []
        remotes: List["RemoteRegion"] = []
        last_local: Any = batch  # sentinels no item is
        last_remote: Any = batch
        segs: Tuple[Segment, ...] = ()
        for item in items:
            try:
                local, remote, cookie = item
            except (TypeError, ValueError):
                raise InvalidParameter(f"{what}: items must be (local_segments, remote, cookie) triples") from None
            if local is not last_local or remote is not last_remote:  # else: checked already
                segs = as_segments(local, "local_segments")
                self._check_post(segs, limit, what)
                self._check_remote(remote, segs, what)
                last_local, last_remote = local, remote
            batch.append((segs, cookie))
            remotes.append(remote)
        return batch, remotes

    def _post_many(self, op: DTOOp, opcode: int, batch: List[Tuple[Tuple[Segment, ...], Any]],
                   flags: CompletionFlags, last_flags: Optional[CompletionFlags] = None,
                   remotes: Optional[Sequence["RemoteRegion"]] = None) -> int:
        bits = (_flag_bits("flags", flags), _flag_bits("last_flags", flags if last_flags is None else last_flags))
        if self._state is not EPState.CONNECTED:
            raise InvalidState(f"cannot post on an EP in state {self._state.value} (connect it first)")
        n = len(batch)
        if n == 0:
            return 0
        first = batch[0][0]
        if n > 1 and all(segs is first for segs, _ in batch) and (
                remotes is None or all(r is remotes[0] for r in remotes)):
            return self._post_same(op, opcode, first, [cookie for _, cookie in batch], bits,
                                   remotes[0] if remotes is not None else None)
        wrs = ffi.new("struct aiodat_send_wr[]", n)
        sges = ffi.new("struct aiodat_sge[]", max(1, sum(len(s) for s, _ in batch)))
        (send_flags, quiet), (last_send_flags, last_quiet) = bits
        entries = []
        start = 0
        for i, (segs, cookie) in enumerate(batch):
            wr = wrs[i]
            wr_id = next(self._ids) * 2
            wr.wr_id, wr.opcode = wr_id, opcode
            wr.send_flags = (send_flags if i + 1 < n else last_send_flags) | self._inline_bit(opcode, segs)
            wr.sge_start, wr.num_sge = start, len(segs)
            if remotes is not None:
                wr.remote_addr, wr.rkey = remotes[i].address, remotes[i].rmr_context
            self._fill_sges(sges, start, segs)
            start += len(segs)
            entries.append((wr_id, cookie, op, segs, None))
        err = lib.aiodat_post_send(self._qp, wrs, n, sges, self._posted)
        posted = self._posted[0]
        for i, entry in enumerate(entries[:posted]):
            self._send_q.append(entry)
            self._track(entry[3], 1)
            if quiet if i + 1 < n else last_quiet:
                self._quiet.add(entry[0])
        if err:
            raise self._post_error(err, f"post {op.value} batch (posted {posted} of {n})",
                                   len(self._send_q), self.attrs.max_request_dtos)
        return posted

    def _post_same(self, op: DTOOp, opcode: int, segs: Tuple[Segment, ...], cookies: List[Any],
                   bits: Tuple[Tuple[int, bool], Tuple[int, bool]], remote: Optional["RemoteRegion"]) -> int:
        """The batch fast path: n requests on the same segments (and remote): one scatter/gather
        list, the request written once and copied n times in C, only the wr_ids set one by one."""
        n = len(cookies)
        sges = ffi.new("struct aiodat_sge[]", max(1, len(segs)))
        self._fill_sges(sges, 0, segs)
        (send_flags, quiet), (last_send_flags, last_quiet) = bits
        inline = self._inline_bit(opcode, segs)
        send_flags, last_send_flags = send_flags | inline, last_send_flags | inline
        wr = ffi.new("struct aiodat_send_wr *")
        wr.opcode, wr.send_flags = opcode, send_flags
        wr.sge_start, wr.num_sge = 0, len(segs)
        if remote is not None:
            wr.remote_addr, wr.rkey = remote.address, remote.rmr_context
        first = self._take_ids(n) * 2
        err = lib.aiodat_post_send_same(self._qp, wr, last_send_flags, sges, first, 2, n, self._posted)
        posted = self._posted[0]
        wr_ids = range(first, first + 2 * posted, 2)
        self._send_q.extend(zip(wr_ids, cookies, repeat(op), repeat(segs), repeat(None)))
        for seg in segs:
            seg.lmr._inflight += posted
        if quiet:
            self._quiet.update(wr_ids[:n - 1])
        if last_quiet and posted == n:
            self._quiet.add(wr_ids[-1])
        if err:
            raise self._post_error(err, f"post {op.value} batch (posted {posted} of {n})",
                                   len(self._send_q), self.attrs.max_request_dtos)
        return posted

    # -- completions (called by evd.py) ---------------------------------------
    def _completion_event(self, wc: Tuple[int, ...], evd: "EVD") -> Any:
        """The event of one completion; ``wc`` is a struct aiodat_wc as a tuple (evd._WC)."""
        wr_id, code, opcode, vendor_err, byte_len, imm_data, _qpn, src_qp, wc_flags = wc[:9]
        status = _wc_status_name(code) if code else "IBV_WC_SUCCESS"
        if wr_id & 1:
            if self._srq is not None:
                cookie, segs = self._srq._complete(wr_id)
            else:
                cookie, segs = self._pop_recv(wr_id)
            self._track(segs, -1)
            notify = True
            if self._quiet and wr_id in self._quiet:
                self._quiet.discard(wr_id)
                notify = bool(code)
            op = DTOOp.RECV_RDMA_WRITE_IMM if opcode == WC_RECV_RDMA_WITH_IMM else _RECV
            imm = imm_data if wc_flags & 2 else None  # IBV_WC_WITH_IMM
            return DTOCompletionEvent._completed(evd, self, cookie, status, byte_len, op,
                                                 imm, vendor_err, src_qp if self._ud else None, notify)
        entry = self._pop_send(wr_id)
        if entry is None:
            return None
        _, cookie, op, segs, target = entry
        self._track(segs, -1)
        if op is DTOOp.BIND or op is DTOOp.UNBIND:
            return target._bind_completed(evd, cookie, status, op)
        if op is DTOOp.RDMA_READ:
            length = byte_len
        elif op is DTOOp.COMPARE_SWAP or op is DTOOp.FETCH_ADD:
            length = 8 if not code else byte_len  # verbs leaves byte_len undefined; 8 bytes landed locally
        else:
            length = sum(s.length for s in segs)
        notify = True
        if self._quiet and wr_id in self._quiet:
            self._quiet.discard(wr_id)
            notify = bool(code)
        if code and code != 5 and self._rc:  # 5: WR_FLUSH_ERR
            # An error completion puts an RC queue pair in ERR: the connection is broken (DAT:
            # the EP leaves CONNECTED and the connect EVD gets CONNECTION_EVENT_BROKEN).
            self._on_async_error(f"{op.value} with cookie {cookie!r} completed with {status}")
        return DTOCompletionEvent._completed(evd, self, cookie, status, length, op,
                                             None, vendor_err, None, notify)

    def _pop_send(self, wr_id: int) -> Any:
        # Earlier entries without a completion of their own finished before this one.
        q, quiet = self._send_q, self._quiet
        while q:
            entry = q.popleft()
            if entry[0] == wr_id:
                return entry
            self._track(entry[3], -1)
            if quiet:
                quiet.discard(entry[0])
        return None

    def _pop_recv(self, wr_id: int) -> Tuple[Any, Tuple[Segment, ...]]:
        q = self._recv_q
        while q:
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
        self.recv_evd._drain_cq()  # completions the device already wrote are not "allocated" any more
        return EPRecvInfo(len(self._recv_q), None)

    def set_watermark(self, soft_high_watermark: Optional[int] = None,
                      hard_high_watermark: Optional[int] = None) -> None:
        """Set the EP's soft and hard high watermarks (dat_ep_set_watermark).

        ``None`` is DAT_WATERMARK_INFINITE (no watermark), the default, and is
        always accepted.  A finite watermark raises
        :class:`aiodat.ModelNotSupported`: verbs devices do not tell how many
        buffers an EP holds, so aiodat cannot watch it
        (``srq_watermarks_supported`` has only the SRQ low watermark).
        """
        self._check()
        from aiodat.errors import ModelNotSupported

        for name, value in (("soft_high_watermark", soft_high_watermark),
                            ("hard_high_watermark", hard_high_watermark)):
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidParameter(f"{name} must be None (infinite) or an int >= 0, got {value!r}")
            raise ModelNotSupported(f"{name}: this provider supports no EP high watermarks "
                                    f"(only None, DAT_WATERMARK_INFINITE)")

    def _on_async_error(self, reason: str) -> None:
        """The device reported the QP broken: the EP is in error; tell the connect EVD."""
        if self._state in (EPState.CONNECTED, EPState.DISCONNECT_PENDING):
            self._state = EPState.ERROR
            self.connect_evd._push(ConnectionEvent(EventType.CONNECTION_EVENT_BROKEN, self.connect_evd, self,
                                                   reason=reason))

    # -- datagrams and multicast (implemented in datagram.py) -----------------------
    async def resolve_datagram(self, host: str, port: int, private_data: bytes = b"",
                               timeout: Optional[float] = 10.0) -> Any:
        """Resolve the UD service at ``host:port`` (a peer's :meth:`serve_datagram`) to an AddressHandle.

        rdma_cm resolves the address and route and asks the peer for its QP
        number and Q_Key (SIDR); the answer becomes an
        :class:`aiodat.datagram.AddressHandle` to pass to :meth:`post_send_to`.
        Raises Unreachable, ConnectionRejected (nothing serves that port) or
        TimeoutExpired.  UD endpoints only.  ``private_data`` (at most 180 bytes)
        is sent as given; the handle's ``private_data`` is the CM's raw SIDR REP
        block (136 bytes on IB/RoCE, zero-filled).
        """
        from aiodat.datagram import resolve_datagram

        return await resolve_datagram(self, host, port, private_data, timeout)

    def serve_datagram(self, port: int = 0, private_data: bytes = b"") -> Any:
        """Answer datagram resolutions on UDP-port-space ``port`` with this EP's QP (a DatagramPSP).

        ``private_data`` (at most 136 bytes) goes raw into every answer.
        """
        from aiodat.datagram import DatagramPSP

        return DatagramPSP(self, port, private_data)

    def post_send_to(self, segments: Segments, dest: Any, cookie: Any = None,
                     flags: CompletionFlags = CompletionFlags.DEFAULT, *, imm_data: Optional[int] = None) -> None:
        """Send one datagram to ``dest`` (an AddressHandle or a joined MulticastGroup); UD endpoints only.

        The message must fit one path MTU (:func:`aiodat.datagram.max_message_size`).
        """
        from aiodat.datagram import post_send_to

        post_send_to(self, segments, dest, cookie, flags, imm_data)

    def post_recv_datagram(self, segments: Segments, cookie: Any = None,
                           flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Post a UD receive whose 40-byte GRH goes to a scratch buffer, so ``segments`` get the payload alone.

        Needs ``EPAttr.max_recv_iov`` >= 1 + the number of segments.  The
        completion's ``transferred_length`` still counts the GRH (payload =
        transferred_length - GRH_SIZE); ``src_qp`` names the sender.
        """
        from aiodat.datagram import post_recv_datagram

        post_recv_datagram(self, segments, cookie, flags)

    async def join_multicast(self, group: str, timeout: Optional[float] = 10.0) -> Any:
        """Join the multicast ``group`` (an IP address); returns a MulticastGroup (ib_join_mcast).

        The QP is attached to the group, so datagrams sent to it arrive in
        this EP's receives; send to it with ``post_send_to(segs, group)``.
        """
        from aiodat.datagram import join_multicast

        return await join_multicast(self, group, timeout)

    async def leave_multicast(self, group: Any) -> None:
        """Leave a group joined with :meth:`join_multicast` (ib_leave_mcast)."""
        from aiodat.datagram import MulticastGroup

        if not isinstance(group, MulticastGroup) or group.ep is not self:
            raise InvalidParameter("leave_multicast takes a MulticastGroup this EP joined")
        await group.leave()

    # -- connections (implemented in cm.py) ----------------------------------------
    def connect_nowait(self, host: str, port: int, private_data: bytes = b"", timeout: float = 10.0) -> None:
        """Start connecting to ``host:port`` (dat_ep_connect); the outcome arrives on ``connect_evd``."""
        from aiodat.cm import start_connect

        start_connect(self, host, port, private_data, timeout, None)

    async def connect(self, host: str, port: int, private_data: bytes = b"", timeout: float = 10.0) -> bytes:
        """Connect to a PSP at ``host:port`` and return the peer's accept private data.

        ``private_data`` (at most 56 bytes through rdma_cm on IB/RoCE) goes on
        the wire exactly as given.  The value returned is what the CM
        delivered, from offset 0: on IB/RoCE the whole 196-byte REP field,
        zero-filled past what the peer sent.

        Raises :class:`aiodat.ConnectionRejected` (with the peer's reject private
        data), :class:`aiodat.Unreachable` or :class:`aiodat.TimeoutExpired`.
        """
        from aiodat.cm import connect

        return await connect(self, host, port, private_data, timeout)

    def disconnect_nowait(self, graceful: bool = True) -> None:
        """Start tearing the connection down (dat_ep_disconnect); DISCONNECTED arrives on ``connect_evd``."""
        from aiodat.cm import start_disconnect

        start_disconnect(self, graceful, None)

    async def disconnect(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Send DREQ and wait for the DREP (graceful), or drop the connection at once (abrupt)."""
        from aiodat.cm import disconnect

        await disconnect(self, graceful, timeout)

    def reset(self) -> None:
        """Return a disconnected EP to UNCONNECTED so it can connect again (dat_ep_reset)."""
        self._check()
        if self._state not in (EPState.DISCONNECTED, EPState.ERROR, EPState.UNCONNECTED):
            raise InvalidState(f"cannot reset an EP in state {self._state.value}")
        from aiodat.cm import detach_cm_id

        detach_cm_id(self)
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = lib.IBV_QPS_RESET
        err = lib.ibv_modify_qp(self._qp, attr, lib.IBV_QP_STATE)
        if err:
            raise error_from_errno(err, "resetting the queue pair")
        self._retire_all()
        self._drop_windows()
        lib.ibv_destroy_qp(self._qp)
        self._ia._qpn_owner.pop(self.qp_num, None)
        self._qp = self._create_qp()
        self.qp_num = self._qp.qp_num
        self._ia._qpn_owner[self.qp_num] = self
        self._state = EPState.UNCONNECTED

    def _to_error(self, check: bool = True) -> None:
        """Move the QP to ERR at once: every posted request completes with the flush status.

        ``check=False`` is for tear-down paths, where a QP already in ERR (or
        one the device refuses to move) must not stop the rest."""
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = lib.IBV_QPS_ERR
        err = lib.ibv_modify_qp(self._qp, attr, lib.IBV_QP_STATE)
        if err and check:
            raise error_from_errno(err, "moving the queue pair to ERR")

    def _drop_windows(self) -> None:
        """Type-2 windows bound through this QP hold a reference on it (rxe then waits 50 s in
        ibv_destroy_qp): give each RMR a fresh, unbound window before the QP goes."""
        for rmr in list(getattr(self, "_windows", ())):
            rmr._qp_gone(self)

    def _retire_all(self) -> None:
        for entry in self._send_q:
            self._track(entry[3], -1)
        for entry in self._recv_q:
            self._track(entry[2], -1)
        self._send_q.clear()
        self._recv_q.clear()
        self._quiet.clear()

    def free(self) -> None:
        """Free the endpoint (dat_ep_free): an open connection is dropped abruptly first."""
        self._check()
        self.close()

    def _destroy_own_evds(self) -> None:
        for evd in self._own_evds:
            evd.close()
        self._own_evds.clear()

    def _release(self) -> None:
        from aiodat.cm import detach_cm_id

        waiter = self._connect_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(InvalidHandle("the EP was freed while a connection call waited on it"))
        if self._qp != ffi.NULL:
            detach_cm_id(self)  # QP before its cm_id, but librdmacm must forget the QP first
            self._drop_windows()
            lib.ibv_destroy_qp(self._qp)
            self._qp = ffi.NULL
        self._retire_all()
        self._ia._qpn_owner.pop(self.qp_num, None)
        if self._srq is not None:
            self._srq._eps.pop(self, None)
        self._destroy_own_evds()

    def __repr__(self) -> str:
        return f"<aiodat.EP qp={self.qp_num} {self._state.value}{' closed' if self._closed else ''}>"


class EPRecvInfo(NamedTuple):
    """What :meth:`EP.recv_query` returns; ``None`` is DAT_VALUE_UNKNOWN."""

    nbufs_allocated: Optional[int]
    bufs_alloc_span: Optional[int]


@dataclass(frozen=True)
class EPParam:
    """What :meth:`EP.query` returns (DAT_EP_PARAM)."""

    ia: "IA"
    pz: "PZ"
    state: EPState
    attrs: EPAttr
    qp_num: int
    local_address: Optional[Tuple[str, int]]
    remote_address: Optional[Tuple[str, int]]
    recv_evd: "EVD"
    request_evd: "EVD"
    connect_evd: "EVD"
    srq: Optional["SRQ"]
    outstanding_requests: int
    outstanding_recvs: int
    #: the QP's transport retry count and ACK timeout as the device reports them (None before connecting)
    retry_count: Optional[int] = None
    ack_timeout: Optional[int] = None
