"""Endpoints: the lifecycle and state of a queue pair (dat_ep_create/query/reset/free).

An :class:`EP` is put together from its parts, one module each (see
docs/architecture.md, "Core layers"):

* posting and its flag tables: post.py (:class:`aiodat.post.Posting`);
* work-request tracking, completion -> event: wr.py (:class:`aiodat.wr.WorkRequests`);
* its connection state (``ep._conn``, an :class:`aiodat.cm.Connection`) and the
  logic that changes it: cm.py;
* UD endpoints are :class:`aiodat.datagram.DatagramEP`, a subclass made by
  ``ia.create_ep`` for ``EPAttr(service_type=ServiceType.UD)``.

This module creates and destroys the QP, sizes the EP's EVDs and answers
queries.  The names other modules import from here (EPAttr, EPState,
CompletionFlags, as_segments, ...) are re-exported from where they live now.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Hashable, List, Optional, Tuple

from aiodat import cm
from aiodat._handle import Handle, Raw
from aiodat._lib import ffi, lib
from aiodat.cm import Connection
from aiodat.cqsize import cq_entries, fit_cqs
from aiodat.epattr import EPAttr, EPParam, EPRecvInfo, EPState, ServiceType
from aiodat.errors import DATError, InvalidParameter, InvalidState, ModelNotSupported, error_from_errno
from aiodat.evd import EVD, EvdFlags
from aiodat.memory import PZ, Segments, as_segments  # noqa: F401  (as_segments: re-exported)
from aiodat.post import (  # noqa: F401  (re-exported: other modules and users import them from here)
    DEFAULT_INLINE_DATA,
    SEND_FENCE,
    SEND_INLINE,
    SEND_SIGNALED,
    SEND_SOLICITED,
    WR_ATOMIC_CMP_AND_SWP,
    WR_ATOMIC_FETCH_AND_ADD,
    WR_BIND_MW,
    WR_LOCAL_INV,
    WR_RDMA_READ,
    WR_RDMA_WRITE,
    WR_RDMA_WRITE_WITH_IMM,
    WR_SEND,
    WR_SEND_WITH_IMM,
    CompletionFlags,
    Posting,
)
from aiodat.srq import SRQ
from aiodat.wr import WC_RECV_RDMA_WITH_IMM, retire_requests, wc_status_name  # noqa: F401

if TYPE_CHECKING:
    from aiodat.ia import IA

__all__ = ["EP", "EPAttr", "EPParam", "EPRecvInfo", "EPState", "ServiceType", "CompletionFlags", "Segments",
           "as_segments"]

_wc_status_name = wc_status_name  # the old private name

#: the attributes of an EP created without any (frozen, so one instance serves every such EP)
_DEFAULT_ATTRS = EPAttr()
_DTO, _CONNECTION = int(EvdFlags.DTO), int(EvdFlags.CONNECTION)


class EP(Posting, Handle):
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
        ia._check()
        if not isinstance(pz, PZ):
            raise InvalidParameter(f"pz must be a PZ, not {type(pz).__name__}")
        pz._check()
        if pz.ia is not ia:
            raise InvalidParameter("the PZ belongs to another IA")
        attrs = attrs or _DEFAULT_ATTRS
        if not isinstance(attrs, EPAttr):
            raise InvalidParameter(f"attrs must be an EPAttr, not {type(attrs).__name__}")
        if ia._valid_epattr is not attrs:  # EPAttr is frozen: the last one checked on this IA is still good
            attrs._validate(ia)
            ia._valid_epattr = attrs
        for name, evd, stream in (("recv_evd", recv_evd, _DTO), ("request_evd", request_evd, _DTO),
                                  ("connect_evd", connect_evd, _CONNECTION)):
            if evd is not None:
                if not isinstance(evd, EVD):
                    raise InvalidParameter(f"{name} must be an EVD, not {type(evd).__name__}")
                evd._check()
                if evd._ia is not ia:
                    raise InvalidParameter(f"{name} belongs to another IA")
                if not int.__and__(evd._streams, stream):  # (plain ints: IntFlag's & builds an enum member)
                    raise InvalidParameter(f"{name} does not accept the {EvdFlags(stream).name} stream")
        if srq is not None:
            if not isinstance(srq, SRQ):
                raise InvalidParameter(f"srq must be an SRQ, not {type(srq).__name__}")
            srq._check()
            if srq._ia is not ia:
                raise InvalidParameter("the SRQ belongs to another IA")
            if srq._pz is not pz and not ia.query().provider_attr.srq_ep_pz_difference_supported:
                raise ModelNotSupported("the EP's PZ differs from the SRQ's PZ, and this provider does not "
                                        "support that (srq_ep_pz_difference_supported is False)")
        super().__init__(pz)
        self._ia, self._pz, self._srq, self.attrs = ia, pz, srq, attrs
        self._own_evds: List["EVD"] = []
        # the EP's own connect EVD is made on first use: an awaited connect/accept never needs it
        self._connect_evd: Optional["EVD"] = connect_evd
        try:
            self.recv_evd: "EVD" = recv_evd or self._private_evd(attrs.max_recv_dtos, EvdFlags.DTO, "recv_evd")
            self.request_evd: "EVD" = request_evd or self._private_evd(
                attrs.max_request_dtos, EvdFlags.DTO | EvdFlags.RMR_BIND, "request_evd")
        except BaseException:  # leave no half-made EP in the PZ (its close would fail, the PZ never free)
            self._destroy_own_evds(half_made=True)
            self._closed = True
            pz._children.pop(self, None)
            raise
        #: the connection state (cm.py changes it; ``state`` reads it)
        self._conn = Connection(self)
        self._init_tracking()
        self._init_posting()
        self._rc = attrs.service_type is ServiceType.RC  # the post fast paths are for RC only
        self._ud = attrs.service_type is ServiceType.UD
        self._resetting = False  # reset() polls the old QP: an error met there breaks nothing (cm.broken)
        try:  # EVDs passed in may be shared: grow their CQs so what feeds them fits (docs/events.md)
            own = self._own_evds  # fed by this EP alone: checked without looking at the IA's other EPs
            fit_cqs(ia, [share for share in self._cq_shares() if share[0] not in own or share[2] > cq_entries(share[0])])
            self._qp = self._create_qp()
        except BaseException:
            self._destroy_own_evds(half_made=True)
            self._closed = True
            pz._children.pop(self, None)
            raise
        self._qp_address = int(ffi.cast("uintptr_t", self._qp))  # for the C hot paths (post.py)
        self.qp_num: int = self._qp.qp_num
        ia._qpn_owner[self.qp_num] = self
        if srq is not None:
            srq._attach(self)

    def _private_evd(self, qlen: int, streams: EvdFlags, what: str = "EVD") -> "EVD":
        limit = self._ia._device_attr.max_cqe
        if qlen > limit:
            raise InvalidParameter(f"the EP's own {what} would need {qlen} entries, more than max_evd_qlen "
                                   f"{limit}: lower the EPAttr queue depth or pass an EVD")
        evd: "EVD[Any]" = EVD(self._ia, max(qlen, 1), streams, comp_vector=self.attrs.comp_vector)
        evd._warn_if_dropped = False  # part of the EP: dropped with it, the EP's warning says so
        self._own_evds.append(evd)
        return evd

    def _create_qp(self) -> Any:
        """The EP's QP, made and taken to INIT (UD: to RTS) in one C call (shim.c, aiodat_create_qp)."""
        a = self.attrs
        srq = self._srq
        ud = a.service_type is ServiceType.UD
        out = ffi.new("int[2]")  # the inline size granted; which step failed
        # made before the QP: once the QP is gone its Raw retires the requests still queued (again,
        # if a dropped EP's finalizer could not finish that: see __del__)
        retire = partial(retire_requests, self._send_q, self._recv_q, self._quiet)
        qp = lib.aiodat_create_qp(self._pz._pd, self.request_evd._cq, self.recv_evd._cq,
                                  srq._srq if srq is not None else ffi.NULL, a.max_request_dtos, a.max_recv_dtos,
                                  a.max_request_iov, a.max_recv_iov,
                                  -1 if a.max_inline_data is None else a.max_inline_data, DEFAULT_INLINE_DATA,
                                  ud, self._ia.port, out)
        if qp == ffi.NULL:
            err = ffi.errno
            if out[1] == 0:
                raise error_from_errno(err, f"creating the queue pair ({a})")
            raise error_from_errno(err, "moving the new UD queue pair to RTS" if ud
                                   else "moving the new queue pair to INIT")
        #: the bytes a send or RDMA write may have to go inline: what the device granted (it may
        #: round up), but never more than an explicit EPAttr.max_inline_data
        self.max_inline: int = out[0] if a.max_inline_data is None else min(out[0], a.max_inline_data)
        # the QP goes before its CQs, SRQ and PD, also when all are dropped together
        self._raw = Raw(qp, lib.ibv_destroy_qp, "QP", self._pz._raw, self.request_evd._raw_cq,
                        self.recv_evd._raw_cq, *((srq._raw,) if srq is not None else ()))
        self._raw.then = retire
        return qp

    # -- state -------------------------------------------------------------
    @property
    def state(self) -> EPState:
        """The DAT state of the endpoint."""
        return self._conn.state

    @property
    def _cm_id(self) -> Any:
        """The rdma_cm id of the connection (ffi.NULL when there is none); owned by ``_conn``."""
        return self._conn.cm_id

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

    @property
    def connect_evd(self) -> "EVD":
        """The EVD the EP's connection events go to: the one passed to create_ep, else the EP's own
        (made on first use, freed with the EP).  InvalidHandle for a freed EP that never made one."""
        evd = self._connect_evd
        if evd is None:
            self._check()  # an EP freed before it ever needed one has none (its IA may be gone too)
            evd = self._connect_evd = self._private_evd(16, EvdFlags.CONNECTION, "connect_evd")
        return evd

    def _evds(self) -> Tuple[Optional["EVD"], ...]:
        """The EVDs the EP feeds (its own connect EVD only if it was made)."""
        return (self.recv_evd, self.request_evd, self._connect_evd)

    def _cq_shares(self) -> List[Tuple["EVD", Hashable, int]]:
        """What this EP may have completing at once on each CQ it feeds: (evd, key, entries).

        cqsize.py sums these over every EP of the IA; an SRQ's receives are counted once
        per EVD, however many of its EPs complete there (it holds at most its size)."""
        shares: List[Tuple["EVD", Hashable, int]] = [(self.request_evd, ("send", self), self.attrs.max_request_dtos)]
        if self._srq is not None:
            shares.append((self.recv_evd, ("srq", self._srq), self._srq._max_wr))
        else:
            shares.append((self.recv_evd, ("recv", self), self.attrs.max_recv_dtos))
        return shares

    def query(self) -> "EPParam":
        """Return the endpoint's parameters (dat_ep_query)."""
        self._check()
        local, remote = cm.cm_addresses(self._conn.cm_id)
        retry_count = ack_timeout = None
        if self._conn.state is EPState.CONNECTED and self._rc:
            attr, init = ffi.new("struct ibv_qp_attr *"), ffi.new("struct ibv_qp_init_attr *")
            if not lib.ibv_query_qp(self._qp, attr, lib.IBV_QP_TIMEOUT | lib.IBV_QP_RETRY_CNT, init):
                retry_count, ack_timeout = attr.retry_cnt, attr.timeout
        return EPParam(ia=self._ia, pz=self._pz, state=self._conn.state, attrs=self.attrs, qp_num=self.qp_num,
                       local_address=local, remote_address=remote, recv_evd=self.recv_evd,
                       request_evd=self.request_evd, connect_evd=self.connect_evd, srq=self._srq,
                       outstanding_requests=self._sends_outstanding(), outstanding_recvs=len(self._recv_q),
                       retry_count=retry_count, ack_timeout=ack_timeout)

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
        for name, value in (("soft_high_watermark", soft_high_watermark),
                            ("hard_high_watermark", hard_high_watermark)):
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidParameter(f"{name} must be None (infinite) or an int >= 0, got {value!r}")
            raise ModelNotSupported(f"{name}: this provider supports no EP high watermarks "
                                    f"(only None, DAT_WATERMARK_INFINITE)")

    def _on_async_error(self, reason: str, retried: bool = True) -> None:
        """The device reported the QP broken (evd.py, wr.py): the connection breaks (cm.py).
        ``retried``: False for the device's async event (cm.broken owes a BROKEN it cannot push)."""
        cm.broken(self, reason, retried)

    # -- datagrams: UD endpoints are aiodat.datagram.DatagramEP; an RC EP says so ---------
    def _not_ud(self, what: str) -> InvalidParameter:
        return InvalidParameter(f"{what} needs a UD endpoint (EPAttr(service_type=ServiceType.UD))")

    async def resolve_datagram(self, host: str, port: int, private_data: bytes = b"",
                               timeout: Optional[float] = 10.0) -> Any:
        """UD endpoints only (:meth:`aiodat.datagram.DatagramEP.resolve_datagram`); raises InvalidParameter here."""
        self._check()
        raise self._not_ud("resolve_datagram")

    def serve_datagram(self, port: int = 0, private_data: bytes = b"") -> Any:
        """UD endpoints only (:meth:`aiodat.datagram.DatagramEP.serve_datagram`); raises InvalidParameter here."""
        self._check()
        raise self._not_ud("serve_datagram")

    def post_send_to(self, segments: Segments, dest: Any, cookie: Any = None,
                     flags: CompletionFlags = CompletionFlags.DEFAULT, *, imm_data: Optional[int] = None) -> None:
        """UD endpoints only (:meth:`aiodat.datagram.DatagramEP.post_send_to`); raises InvalidParameter here."""
        self._check()
        raise self._not_ud("post_send_to")

    def post_recv_datagram(self, segments: Segments, cookie: Any = None,
                           flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """UD endpoints only (:meth:`aiodat.datagram.DatagramEP.post_recv_datagram`); raises InvalidParameter here."""
        self._check()
        raise self._not_ud("post_recv_datagram")

    async def join_multicast(self, group: str, timeout: Optional[float] = 10.0) -> Any:
        """UD endpoints only (:meth:`aiodat.datagram.DatagramEP.join_multicast`); raises InvalidParameter here."""
        self._check()
        raise self._not_ud("join_multicast")

    async def leave_multicast(self, group: Any) -> None:
        """UD endpoints only (:meth:`aiodat.datagram.DatagramEP.leave_multicast`); raises InvalidParameter here."""
        raise InvalidParameter("leave_multicast takes a MulticastGroup this EP joined")

    # -- connections (the logic lives in cm.py) ------------------------------------
    def connect_nowait(self, host: str, port: int, private_data: bytes = b"",
                       timeout: Optional[float] = 10.0) -> None:
        """Start connecting to ``host:port`` (dat_ep_connect); the outcome arrives on ``connect_evd``."""
        cm.start_connect(self, host, port, private_data, timeout, None)

    async def connect(self, host: str, port: int, private_data: bytes = b"",
                      timeout: Optional[float] = 10.0) -> bytes:
        """Connect to a PSP at ``host:port`` and return the peer's accept private data.

        ``private_data`` (at most 56 bytes through rdma_cm on IB/RoCE) goes on
        the wire exactly as given.  The value returned is what the CM
        delivered, from offset 0: on IB/RoCE the whole 196-byte REP field,
        zero-filled past what the peer sent.

        Raises :class:`aiodat.ConnectionRejected` (with the peer's reject private
        data), :class:`aiodat.Unreachable` or :class:`aiodat.TimeoutExpired`.
        Cancelling the task before the connection is established drops the
        attempt (the EP ends DISCONNECTED); cancelling it once ESTABLISHED has
        arrived leaves the EP CONNECTED with the event on ``connect_evd``
        (docs/connections.md, "Awaitable and nowait forms", on cancellation).
        """
        return await cm.connect(self, host, port, private_data, timeout)

    def disconnect_nowait(self, graceful: bool = True) -> None:
        """Start tearing the connection down (dat_ep_disconnect); DISCONNECTED arrives on ``connect_evd``.

        ``graceful`` lets the requests already posted complete first (see :meth:`disconnect`)."""
        cm.start_disconnect(self, graceful, None)

    async def disconnect(self, graceful: bool = True, timeout: Optional[float] = 10.0) -> None:
        """Tear the connection down and wait until it is (DISCONNECTED).

        ``graceful=True``: no new posts are accepted, every request already
        posted on the send queue completes (at most ``timeout`` seconds), then
        the QP goes to ERR and the DREQ is sent; the DREP is awaited (at most
        ``timeout`` seconds more).  ``graceful=False``: the QP goes to ERR at
        once, so posted requests complete with IBV_WC_WR_FLUSH_ERR, then the
        DREQ.  See docs/connections.md, "Disconnect".
        """
        await cm.disconnect(self, graceful, timeout)

    def reset(self) -> None:
        """Return a disconnected EP to UNCONNECTED so it can connect again (dat_ep_reset)."""
        self._check()
        # it polls the EP's EVDs and replaces the QP the loop's callbacks look completions up by, as close does
        self._refuse_foreign_thread("reset")
        state = self._conn.state
        if state not in (EPState.DISCONNECTED, EPState.ERROR, EPState.UNCONNECTED):
            raise InvalidState(f"cannot reset an EP in state {state.value}")
        cm.detach_cm_id(self)
        # Polled before the RESET too: mlx5, mlx4 and hns clean the QP's completions out of its CQs
        # on that transition; and after it, for what rxe's tasks flushed meanwhile.
        self._poll_completions(reset=True)
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = lib.IBV_QPS_RESET
        err = lib.ibv_modify_qp(self._qp, attr, lib.IBV_QP_STATE)
        if err:
            raise error_from_errno(err, "resetting the queue pair")
        self._poll_completions(reset=True)
        self._retire_all()
        # retired: the old QP's Raw must not retire the queues again once they hold the new QP's
        # requests (its ``then`` kept for a retry, or run when a failed destruction is retried)
        self._raw.then = None
        self._drop_windows()
        for held in list(self._held or ()):  # its multicast groups: a QP attached to one cannot be destroyed
            held.close()
        err = self._raw.release()
        if err:  # (the old QP is kept, and its destruction tried again later: see _handle.Raw)
            # the EP cannot go on with a QP that a later retry frees under it: free the EP whole
            self._qp, self._qp_address = ffi.NULL, 0
            self.close()
            raise error_from_errno(err, "destroying the queue pair (ibv_destroy_qp)")
        self._ia._qpn_owner.pop(self.qp_num, None)
        try:
            self._qp = self._create_qp()
        except BaseException:  # no QP: the EP cannot go on; free it whole (its SRQ, its own EVDs)
            self._qp, self._qp_address = ffi.NULL, 0
            self.close()
            raise
        self._qp_address = int(ffi.cast("uintptr_t", self._qp))
        self.qp_num = self._qp.qp_num
        self._ia._qpn_owner[self.qp_num] = self
        cm.reset(self)

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
        for rmr in list(self._windows):
            rmr._qp_gone(self)

    def _poll_completions(self, reset: bool = False) -> None:
        """Before the QP goes: poll its EVDs while its QP number still names this EP.  rxe keeps
        completions in the CQ after their QP is destroyed, where no EP claims them.  On a close this
        matters for receives taken from an SRQ, which come back to its count (and their events to a
        shared EVD); else the SRQ would count their buffers as posted for ever.  On a ``reset`` it
        matters for every request the disconnect flushed: their events, with the program's cookies,
        go to the EP's EVDs (which stay), instead of being lost.  A full EVD is polled all the same,
        its overflow reported (docs/events.md): the completions cannot wait in the CQ any more."""
        if reset:
            evds = [self.recv_evd, self.request_evd]
        else:
            evds = [self.recv_evd] if self._srq is not None else []
        for evd in dict.fromkeys(evds):  # (one EVD may take both)
            if evd.closed:
                continue
            evd._awaited += 1  # polled even when the EVD is full: after this, no EP claims them
            self._resetting = reset
            try:
                notified = evd._drain_cq(rearm=False, arm_if_unarmed=False)
            except DATError:
                continue  # (the close goes on; the EVD's next wait meets the broken CQ itself)
            finally:
                evd._awaited -= 1
                self._resetting = False
            if notified and (reset or evd not in self._own_evds):
                evd._queued_aside()

    def free(self) -> None:
        """Free the endpoint (dat_ep_free): an open connection is dropped abruptly first."""
        self._check()
        self.close()

    def _destroy_own_evds(self, half_made: bool = False) -> None:
        """Close the EP's own EVDs; ``half_made``: the EP's constructor failed, and no loop has seen
        them (freed from any thread: Handle._discard)."""
        for evd in self._own_evds:
            if half_made:
                evd._discard()
            else:
                evd.close()
        self._own_evds.clear()

    def _release(self) -> None:
        cm.freed(self)  # wakes a connection call waiting on the EP
        if self._qp != ffi.NULL:
            cm.detach_cm_id(self)  # QP before its cm_id, but librdmacm must forget the QP first
            self._drop_windows()
            self._poll_completions()
            self._raw.release()
            self._qp, self._qp_address = ffi.NULL, 0
        self._retire_all()
        self._ia._qpn_owner.pop(self.qp_num, None)
        if self._srq is not None:
            self._srq._detach(self)
        self._destroy_own_evds()

    def __del__(self) -> None:
        if not self._closed:
            # Dropped unclosed: its requests go with its QP (its Raw holder destroys it), so their
            # buffers are free again; else lmr.free() would stay refused for requests nobody has.
            # Retired here (the QP may outlive the EP: a window bound through it holds it).  If this
            # raises part way (a MemoryError), the QP's Raw retires the rest once the QP is gone (its
            # ``then``: wr.retire_requests is restartable), or a retry after the next collection.
            try:
                self._retire_all()
            except Exception:  # (a half-made EP has no queues)
                pass
        Handle.__del__(self)  # (not super(): its object is an allocation, which could fail and lose the warning)

    def __repr__(self) -> str:
        return f"<aiodat.{type(self).__name__} qp={self.qp_num} {self._conn.state.value}{' closed' if self._closed else ''}>"
