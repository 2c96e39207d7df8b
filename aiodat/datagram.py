"""Datagrams and multicast: UD endpoints over rdma_cm's UDP port space.

The Access Layer's datagram service (ib_init_dgrm_svc, SIDR) and multicast
(ib_join_mcast, ib_leave_mcast) on rdma_cm:

* A UD endpoint is ``ia.create_ep(pz, attrs=EPAttr(service_type=ServiceType.UD))``,
  a :class:`DatagramEP` (an :class:`aiodat.EP` with the datagram calls below).
  Its QP is taken to RTS at once with rdma_cm's UDP Q_Key (RDMA_UDP_QKEY), so
  it needs no connection.
* The passive side, :class:`DatagramPSP` (``ep.serve_datagram(port)``),
  listens on a UDP-port-space cm_id and answers every address-resolution
  request (a SIDR REQ) with its EP's QP number and Q_Key (rdma_accept on the
  request's id).
* The active side, ``await ep.resolve_datagram(host, port)``, resolves the
  address and route and sends the SIDR REQ (rdma_connect on a UDP id); the
  ESTABLISHED event carries the peer's QP number, Q_Key and path, from which
  an address handle is made on the EP's PD (``aiodat_create_ah``: librdmacm's
  own ``id->pd`` lives on its own device context, and a QP only sends to AHs
  of its own PD).  The result is an
  :class:`AddressHandle` to post sends to: ``ep.post_send_to(segs, ah)``.
* ``await ep.join_multicast("239.1.1.1")`` resolves the group on the IA's
  address and joins it; when the join completes the EP's QP is attached to
  the group's GID and LID (ibv_attach_mcast, as librdmacm would do for a QP
  of its own; aiodat never hands its QP to librdmacm), and detached on leave;
  it returns a :class:`MulticastGroup` whose ``address_handle`` sends to the
  group.  ``await ep.leave_multicast(group)`` (or ``group.leave()``) leaves.

Receives on a UD EP begin with the 40-byte Global Route Header (GRH) the
device writes in front of every datagram: post at least ``GRH_SIZE`` more
bytes than the largest message, and the payload starts at offset 40; the
completion's ``transferred_length`` counts the GRH too.  ``ep.post_recv_datagram``
puts the GRH into a per-EP scratch buffer instead (it needs
``EPAttr.max_recv_iov`` >= 1 + the segments given), so the segments receive
the payload alone.  The completion's ``src_qp`` is the sender's QP number.
A datagram is at most one path MTU (``max_message_size`` below).
"""
from __future__ import annotations

import asyncio
import ipaddress
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Optional, Tuple

from aiodat._handle import Handle, Raw, fail_waiter
from aiodat._lib import ffi, lib
from aiodat.cm import (
    Listener,
    _check_family,
    check_peer,
    _family,
    _private,
    _send_conn,
    check_port,
    check_timeout,
    _sockaddr,
    listen_address,
    request_addresses,
    require_address,
    resolve_within,
)
from aiodat.ep import EP, CompletionFlags, Segments
from aiodat.epattr import EPState, ServiceType
from aiodat.errors import (
    InvalidHandle,
    InvalidParameter,
    InvalidState,
    ProviderNotFound,
    TimeoutExpired,
    Unreachable,
    ConnectionRejected,
    error_from_errno,
)
from aiodat.evd import DTOOp
from aiodat.memory import Privileges, as_segments
from aiodat.post import GRH_SIZE, WR_SEND, WR_SEND_WITH_IMM, check_imm_data

if TYPE_CHECKING:
    from aiodat.memory import PZ

#: the QP number multicast sends go to
MULTICAST_QPN = 0xFFFFFF
#: private data a datagram resolution carries through rdma_cm on IB/RoCE: the SIDR REQ's 216
#: bytes less rdma_cm's 36-byte header, and the SIDR REP's 136.  Raw, as for connections:
#: the receiver gets the CM's full, zero-filled block.
RESOLVE_PRIVATE_DATA_MAX = 180
SERVE_PRIVATE_DATA_MAX = 136

# enum rdma_cm_event_type (see cm.py)
(_ADDR_RESOLVED, _ADDR_ERROR, _ROUTE_RESOLVED, _ROUTE_ERROR, _CONNECT_REQUEST, _CONNECT_RESPONSE,
 _CONNECT_ERROR, _UNREACHABLE, _REJECTED, _ESTABLISHED, _DISCONNECTED, _DEVICE_REMOVAL,
 _MULTICAST_JOIN, _MULTICAST_ERROR) = range(14)
_RESOLVE_MS = 2000


def _check_ud(ep: Any, what: str) -> None:
    if not isinstance(ep, EP):
        raise InvalidParameter(f"{what} needs an EP, not {type(ep).__name__}")
    ep._check()
    if ep.attrs.service_type is not ServiceType.UD:
        raise InvalidParameter(f"{what} needs a UD endpoint (EPAttr(service_type=ServiceType.UD))")


class AddressHandle(Handle):
    """Where datagrams go: an ibv_ah with the remote QP number and Q_Key (ib_dgrm_info).

    Made by :meth:`aiodat.EP.resolve_datagram` or a multicast join; freed with
    its PZ or by :meth:`free`.
    """

    _kind = "address handle"
    _close_rank = 1  # after EPs (which may still have sends to it posted), before LMRs

    def __init__(self, pz: "PZ", ah: Any, remote_qpn: int, remote_qkey: int,
                 address: Optional[Tuple[str, int]], private_data: bytes = b"") -> None:
        super().__init__(pz)
        self._ah = ah
        self._raw = Raw(ah, lib.ibv_destroy_ah, "AH", pz._raw)
        #: the peer's QP number (MULTICAST_QPN for a group)
        self.remote_qpn: int = remote_qpn
        #: the Q_Key sends carry
        self.remote_qkey: int = remote_qkey
        #: the (host, port) resolved, or (group, 0) for multicast
        self.address: Optional[Tuple[str, int]] = address
        #: the private data of the peer's answer (SIDR REP) as the CM delivered it: raw, from
        #: offset 0, on IB/RoCE the whole 136-byte field zero-filled past what was sent
        self.private_data: bytes = private_data

    def free(self) -> None:
        """Destroy the address handle; refused (InvalidState) while sends to it are posted and their
        completions not yet taken: the device reads the handle when it sends."""
        self._check()
        self._refuse_close_while(self._sends_posted(), "sends to it are still posted; take their completions first")
        self.close()

    def _sends_posted(self) -> bool:
        """Whether a send-queue entry of an EP of this PZ still targets this handle."""
        # (a scan, at free only: a counter would cost every post_send_to)
        pz = self._parent
        assert pz is not None  # (an AH always has its PZ)
        return any(entry[4] is self for ep in list(pz._children) if isinstance(ep, EP) for entry in ep._send_q)

    def _release(self) -> None:
        if self._ah != ffi.NULL:
            self._raw.release()
            self._ah = ffi.NULL

    def __repr__(self) -> str:
        return f"<aiodat.AddressHandle {self.address} qpn={self.remote_qpn:#x}{' closed' if self._closed else ''}>"


class _Resolution:
    """One rdma_cm UDP id driving address/route resolution and a SIDR REQ (or a join) to its end."""

    def __init__(self, ep: "EP", fut: "asyncio.Future[Any]", what: str) -> None:
        self.ep = ep
        self.fut = fut
        self.what = what
        self.closed = False
        ia = ep._ia
        self.cm = ia._cm
        self.cm_id = self.cm.create_id(self, lib.RDMA_PS_UDP)
        self.pdata = b""
        conn = ep._conn  # the EP's close fails what is under way (cm.freed)
        if conn.resolutions is None:
            conn.resolutions = set()
        conn.resolutions.add(self)

    def fail(self, exc: BaseException) -> None:
        fail_waiter(self.fut, exc)
        self.destroy()

    def subject(self) -> Any:
        """What a device event about this id names (cm.py): the EP."""
        return self.ep

    def device_removed(self) -> None:
        """rdma_cm's DEVICE_REMOVAL on this id: a resolution under way fails (no other event ends it)."""
        if not self.fut.done():
            self.fail(ProviderNotFound(f"{self.what}: the device was removed"))

    def destroy(self) -> None:
        if not self.closed:
            self.closed = True
            if self.ep._conn.resolutions is not None:
                self.ep._conn.resolutions.discard(self)
            self.cm.destroy_id(self.cm_id)


class _Resolver(_Resolution):
    address: Tuple[str, int]  # the peer's (host, port): resolve_datagram sets it before the id's first event
    def _on_cm_event(self, ev: Any, pdata: bytes) -> None:
        if self.fut.done():  # cancelled or timed out: drop what arrived
            self.destroy()
            return
        kind = ev.event
        if kind == _ADDR_RESOLVED:
            if lib.rdma_resolve_route(self.cm_id, _RESOLVE_MS):
                self.fail(Unreachable(f"{self.what}: rdma_resolve_route failed (errno {ffi.errno})"))
            return
        if kind == _ROUTE_RESOLVED:
            err = _send_conn(self.ep, self.cm_id, False, self.pdata, 0, 0)
            if err:
                self.fail(Unreachable(f"{self.what}: rdma_connect (SIDR REQ) failed (errno {err})"))
            return
        if kind == _ESTABLISHED:
            # the AH goes on the EP's PD (librdmacm's id->pd is its own, and a QP may only
            # send to AHs of its own PD)
            raw = lib.aiodat_create_ah(self.ep._pz._pd, ev)
            if raw == ffi.NULL:
                self.fail(error_from_errno(ffi.errno, f"{self.what}: creating the address handle"))
                return
            ah = AddressHandle(self.ep._pz, raw, ev.ud_qp_num, ev.ud_qkey, self.address, pdata)
            self.fut.set_result(ah)
            self.destroy()
            return
        if kind == _REJECTED:
            self.fail(ConnectionRejected(f"{self.what}: the peer refused the datagram resolution "
                                         f"(status {ev.status}); is a DatagramPSP listening there?",
                                         private_data=pdata))
            return
        if kind in (_ADDR_ERROR, _ROUTE_ERROR, _UNREACHABLE, _CONNECT_ERROR):
            if ev.status == -110:
                self.fail(TimeoutExpired(f"{self.what}: timed out ({_event_name(kind)})"))
            else:
                self.fail(Unreachable(f"{self.what}: {_event_name(kind)} (status {ev.status})"))


def _event_name(kind: int) -> str:
    return ffi.string(lib.rdma_event_str(kind)).decode()


async def _await(res: _Resolution, timeout: Optional[float]) -> Any:
    try:
        return await asyncio.wait_for(asyncio.shield(res.fut), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
        fut = res.fut
        if fut.done() and not fut.cancelled() and fut.exception() is exc:
            raise  # the resolution's own failure (rdma_cm's ETIMEDOUT is a TimeoutExpired too)
        if not fut.done():
            # (cancelled, not failed: nobody awaits res.fut any more, and a failed one would be
            # logged as "Future exception was never retrieved")
            fut.cancel()
        elif not fut.cancelled() and fut.exception() is None:
            fut.result().close()  # it came as the wait ended: nobody takes it
        res.destroy()
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise TimeoutExpired(f"{res.what}: no answer within {timeout}s") from None


async def resolve_datagram(ep: "EP", host: str, port: int, private_data: bytes = b"",
                           timeout: Optional[float] = 10.0) -> AddressHandle:
    """``await ep.resolve_datagram(host, port)``: see :meth:`aiodat.EP.resolve_datagram`."""
    _check_ud(ep, "resolve_datagram")
    require_address(ep._ia, "resolve a datagram peer from")
    check_port(port, lowest=1)  # (port 0 is a listener's "pick one", never a peer's)
    pdata = _private(private_data, RESOLVE_PRIVATE_DATA_MAX, "resolve_datagram")
    timeout = check_timeout(timeout)
    ia = ep._ia
    host, timeout = await resolve_within(host, _family(ia.address or ""), timeout)
    _check_ud(ep, "resolve_datagram")  # again: the EP, its PZ or its IA may have closed during the lookup
    check_peer(ia, host)
    dst = ia._cm.sockaddr(host, port)  # (a pointer that owns its storage: held until rdma_resolve_addr)
    src = ia._cm.source()  # (before the resolver's cm_id: an InvalidAddress here must not leave one behind)
    ia._attach_loop()  # (InvalidState if another loop owns the IA: before anything is sent)
    fut: "asyncio.Future[AddressHandle]" = asyncio.get_running_loop().create_future()
    res = _Resolver(ep, fut, f"resolve_datagram {host}:{port}")
    res.pdata = pdata
    res.address = (host, port)
    if lib.rdma_resolve_addr(res.cm_id, src, dst, _RESOLVE_MS):
        err = ffi.errno
        res.destroy()
        raise error_from_errno(err, f"resolving {host}:{port}")
    return await _await(res, timeout)


class DatagramPSP(Listener):
    """A datagram service point: answers address resolutions for a UD EP (ib_init_dgrm_svc + SIDR).

    Every request a peer's ``resolve_datagram`` sends to ``port`` is accepted
    with the EP's QP number (and ``private_data``); ``requests`` counts them
    and ``peers`` holds the (host, port) and private data of the latest
    :attr:`PEERS_KEPT`.
    """

    _kind = "datagram psp"
    #: how many of the latest requests ``peers`` keeps (a long-lived service must not grow with its peers)
    PEERS_KEPT = 1024

    def __init__(self, ep: "EP", port: int, private_data: bytes = b"") -> None:
        _check_ud(ep, "serve_datagram")
        ia = ep._ia
        self._pdata = _private(private_data, SERVE_PRIVATE_DATA_MAX, "serve_datagram")
        addr = listen_address(ia, port)
        super().__init__(ia)
        self.ep = ep
        self.requests = 0
        self.peers: Deque[Tuple[Any, bytes]] = deque(maxlen=self.PEERS_KEPT)
        self._listen(ia, addr, port, lib.RDMA_PS_UDP, 128, "UDP port")

    def _on_cm_request(self, ev: Any, pdata: bytes) -> None:
        """A SIDR REQ: accept it with the EP's QP number, then drop the request's id."""
        cm_id = ev.id
        if self.ep.closed or self.ep._conn.state is EPState.ERROR:  # (its QP takes no datagram: reset() first)
            lib.rdma_reject(cm_id, ffi.NULL, 0)
            lib.rdma_destroy_id(cm_id)
            return
        err = _send_conn(self.ep, cm_id, True, self._pdata, 0, 0)
        if not err:
            self.requests += 1
            self.peers.append((request_addresses(ev)[1], pdata))
        lib.rdma_destroy_id(cm_id)


class _Joiner(_Resolution):
    def subject(self) -> Any:
        return self.group  # type: ignore[attr-defined]

    def device_removed(self) -> None:
        group: "MulticastGroup" = self.group  # type: ignore[attr-defined]
        if group.joined:  # (as a MULTICAST_ERROR after the join)
            group.joined = False
            group.error = "RDMA_CM_EVENT_DEVICE_REMOVAL"
        super().device_removed()

    def _on_cm_event(self, ev: Any, pdata: bytes) -> None:
        kind = ev.event
        group: "MulticastGroup" = self.group  # type: ignore[attr-defined]
        if kind == _ADDR_RESOLVED and not self.fut.done():
            if lib.rdma_join_multicast(self.cm_id, ffi.cast("struct sockaddr *", group._sockaddr), ffi.NULL):
                self.fail(error_from_errno(ffi.errno, f"{self.what}: rdma_join_multicast"))
            return
        if kind == _MULTICAST_JOIN:
            if self.fut.done() or group.closed:
                return
            err = lib.aiodat_mcast_attach(self.ep._qp, ev, 1)
            if err:
                self.fail(error_from_errno(err, f"{self.what}: attaching the QP to the group"))
                return
            join_event = ffi.new("struct aiodat_cm_event *", ev[0])  # its GID and LID, to detach
            # The attachment is a Raw the QP's waits for: a group dropped with its EP (a cycle the
            # collector ends in any order) detaches first; else the QP could never be destroyed
            # (EBUSY while attached), nor, with it, the PD, the CQs and the device context.
            group._attachment = Raw(self.ep._qp, lambda qp: lib.aiodat_mcast_attach(qp, join_event, 0),
                                    "multicast attachment", self.ep._raw, join_event)
            raw = lib.aiodat_create_ah(self.ep._pz._pd, ev)
            if raw == ffi.NULL:
                self.fail(error_from_errno(ffi.errno, f"{self.what}: creating the group's address handle"))
                return
            group.address_handle = AddressHandle(self.ep._pz, raw, ev.ud_qp_num, ev.ud_qkey, (group.group, 0))
            group.address_handle._warn_if_dropped = False  # the group's: dropped with it, its warning says so
            group.joined = True
            self.fut.set_result(group)
            return
        if kind in (_ADDR_ERROR, _MULTICAST_ERROR, _UNREACHABLE):
            if not self.fut.done():
                self.fail(Unreachable(f"{self.what}: {_event_name(kind)} (status {ev.status})"))
            else:
                group.joined = False
                group.error = f"{_event_name(kind)} (status {ev.status})"


class MulticastGroup(Handle):
    """A multicast group a UD EP has joined (ib_join_mcast): send to ``address_handle``, receive as usual.

    The EP holds it, joined, until :meth:`leave` or the EP's close, even if the program drops it.
    """

    _kind = "multicast group"
    _close_rank = 0
    # Joined until left, like a listening PSP: the EP holds it.  A group dropped unclosed would
    # otherwise leave the QP attached (ibv_attach_mcast), and a QP attached to a group cannot
    # be destroyed (EBUSY).
    _parent_holds = True

    def __init__(self, ep: "EP", group: str) -> None:
        sockaddr = _sockaddr(group, 0)  # (first: a group that fails here leaves nothing in the EP)
        _check_family(ep._ia, group)  # (an IPv6 group on an IPv4 IA: rdma_cm's bare EINVAL otherwise)
        super().__init__(ep)
        self.ep = ep
        #: the group's IP address
        self.group = group
        self._sockaddr = sockaddr
        self._joiner: Optional[_Joiner] = None
        self._attachment: Optional[Raw] = None  # the QP's attachment to the group, once joined
        #: the handle multicast sends go to (set once joined)
        self.address_handle: Optional[AddressHandle] = None
        self.joined = False
        #: a MULTICAST_ERROR reported after the join, if any
        self.error: Optional[str] = None

    async def leave(self) -> None:
        """Leave the group (ib_leave_mcast): the QP is detached and receives nothing more from it.

        Refused (InvalidState) while sends to the group are posted and their completions not yet
        taken: leaving destroys the group's address handle, which the device reads when it sends."""
        self._check()
        ah = self.address_handle
        if ah is not None and not ah.closed:
            self._refuse_close_while(ah._sends_posted(), "sends to it are still posted; take their completions first")
        self.close()

    def _release(self) -> None:
        joiner, self._joiner = self._joiner, None
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.release()  # detached (the QP's destruction waits for it, however the EP goes)
        if joiner is not None and not joiner.closed:
            if self.joined:
                lib.rdma_leave_multicast(joiner.cm_id, ffi.cast("struct sockaddr *", self._sockaddr))
            # (a join still under way fails: its task learns the group is gone, and waits no more)
            joiner.fail(InvalidHandle(f"multicast group {self.group} was left (or its EP closed) during the join"))
        self.joined = False
        ah, self.address_handle = self.address_handle, None
        if ah is not None:
            ah.close()

    def __repr__(self) -> str:
        state = "joined" if self.joined else ("left" if self._closed else "joining")
        return f"<aiodat.MulticastGroup {self.group} {state}>"


async def join_multicast(ep: "EP", group: str, timeout: Optional[float] = 10.0) -> MulticastGroup:
    """``await ep.join_multicast(group)``: see :meth:`aiodat.EP.join_multicast`."""
    _check_ud(ep, "join_multicast")
    require_address(ep._ia, "join a multicast group from")
    if not isinstance(group, str):  # (ipaddress also takes ints and packed bytes, which rdma_cm does not)
        raise InvalidParameter(f"group must be an IP address as a str, not {type(group).__name__}")
    try:
        is_multicast = ipaddress.ip_address(group).is_multicast
    except ValueError:
        raise InvalidParameter(f"{group!r} is not an IP address") from None
    if not is_multicast:
        raise InvalidParameter(f"{group!r} is not a multicast address (224.0.0.0/4 or ff00::/8)")
    # The device attaches a QP to a group once: a second membership would be deafened by the first's leave.
    same = ipaddress.ip_address(group)
    if any(isinstance(g, MulticastGroup) and ipaddress.ip_address(g.group) == same for g in list(ep._children)):
        raise InvalidState(f"this EP has joined (or is joining) multicast group {group} already; one membership "
                           "per group and EP")
    timeout = check_timeout(timeout)
    ia = ep._ia
    ia._attach_loop()  # (InvalidState if another loop owns the IA: before anything is sent)
    fut: "asyncio.Future[MulticastGroup]" = asyncio.get_running_loop().create_future()
    mg = MulticastGroup(ep, group)
    try:  # (the EP holds the group from here: a joiner that cannot be made must not leave it "joining")
        joiner = _Joiner(ep, fut, f"join_multicast {group}")
    except BaseException:
        mg.close()
        raise
    joiner.group = mg  # type: ignore[attr-defined]
    mg._joiner = joiner
    if lib.rdma_resolve_addr(joiner.cm_id, ia._cm.source(), ffi.cast("struct sockaddr *", mg._sockaddr),
                             _RESOLVE_MS):
        err = ffi.errno
        fut.cancel()  # (nobody awaits it: failed by mg.close(), it would be logged as never retrieved)
        mg.close()
        raise error_from_errno(err, f"resolving multicast group {group}")
    try:
        return await _await(joiner, timeout)
    except BaseException:
        mg.close()
        raise


def post_send_to(ep: "EP", segments: Any, dest: Any, cookie: Any, flags: Any, imm_data: Optional[int]) -> None:
    """``ep.post_send_to``: see :meth:`aiodat.EP.post_send_to`."""
    _check_ud(ep, "post_send_to")
    ah = dest.address_handle if isinstance(dest, MulticastGroup) else dest
    if not isinstance(ah, AddressHandle):
        raise InvalidParameter("post_send_to needs an AddressHandle (from resolve_datagram) or a joined "
                               f"MulticastGroup, not {type(dest).__name__}")
    ah._check()
    if ah._parent is not ep._pz:
        raise InvalidParameter("the address handle belongs to another PZ than the EP")
    segs = as_segments(segments)
    ep._check_post(segs, ep.attrs.max_request_iov, "post_send_to")
    size = segs[0].length if len(segs) == 1 else sum(seg.length for seg in segs)
    if size > _SMALLEST_MTU:  # (smaller ones fit every port: no port query for them)
        _check_fits_mtu(ep, size)
    check_imm_data(imm_data)
    opcode = WR_SEND if imm_data is None else WR_SEND_WITH_IMM
    ep._post_one(DTOOp.SEND, opcode, segs, cookie, flags, imm_data=imm_data, ah=ah._ah,
                 remote_qpn=ah.remote_qpn, remote_qkey=ah.remote_qkey, target=ah)


def post_recv_datagram(ep: "EP", segments: Any, cookie: Any, flags: Any) -> None:
    """``ep.post_recv_datagram``: see :meth:`aiodat.EP.post_recv_datagram`."""
    _check_ud(ep, "post_recv_datagram")
    segs = as_segments(segments)
    if 1 + len(segs) > ep.attrs.max_recv_iov:
        raise InvalidParameter(
            f"post_recv_datagram puts the GRH in a segment of its own: it needs EPAttr.max_recv_iov >= "
            f"{1 + len(segs)} for {len(segs)} segment(s), this EP has {ep.attrs.max_recv_iov}")
    grh = getattr(ep, "_grh_lmr", None)  # the EP's scratch for GRHs, made on first use
    if grh is None or grh.closed:
        grh = ep._grh_lmr = ep._pz.register(bytearray(GRH_SIZE), Privileges.LOCAL_WRITE)  # type: ignore[attr-defined]
        grh._warn_if_dropped = False  # aiodat's own, dropped with the EP: the EP's warning says so
    ep.post_recv([grh.segment(), *segs], cookie, flags)


_SMALLEST_MTU = 256


def _check_fits_mtu(ep: Any, size: int) -> None:
    """A datagram larger than the path MTU is dropped by the device with a successful send
    completion (IB spec C10-93.1.1), so it is refused here.  The MTU is kept on the EP and read
    again only when a datagram does not fit it (the port's MTU may have grown since)."""
    if size <= getattr(ep, "_mtu", 0):
        return
    ep._mtu = max_message_size(ep)
    if size > ep._mtu:
        raise InvalidParameter(f"post_send_to: a datagram of {size} bytes does not fit the port's MTU of "
                               f"{ep._mtu} bytes (max_message_size)")


def max_message_size(ep: "EP") -> int:
    """The largest datagram the EP's port carries: its active MTU in bytes (InvalidHandle once it is closed)."""
    if not isinstance(ep, EP):
        raise InvalidParameter(f"max_message_size needs an EP, not {type(ep).__name__}")
    ep._check()
    pattr = ep._ia._port_attr()
    return 128 << pattr.active_mtu  # IBV_MTU_256 == 1 ... IBV_MTU_4096 == 5


class DatagramEP(EP):
    """A UD endpoint: an :class:`aiodat.EP` whose QP is unreliable datagram (``ia.create_ep`` makes
    one for ``EPAttr(service_type=ServiceType.UD)``), with the datagram and multicast calls."""

    def _release(self) -> None:
        super()._release()
        grh = self.__dict__.get("_grh_lmr")
        if grh is not None:  # post_recv_datagram's scratch goes with its EP, not later with the PZ
            grh.close()

    async def resolve_datagram(self, host: str, port: int, private_data: bytes = b"",
                               timeout: Optional[float] = 10.0) -> AddressHandle:
        """Resolve the UD service at ``host:port`` (a peer's :meth:`serve_datagram`) to an AddressHandle.

        rdma_cm resolves the address and route and asks the peer for its QP
        number and Q_Key (SIDR); the answer becomes an :class:`AddressHandle`
        to pass to :meth:`post_send_to`.  Raises Unreachable,
        ConnectionRejected (nothing serves that port) or TimeoutExpired.
        ``private_data`` (at most 180 bytes) is sent as given; the handle's
        ``private_data`` is the CM's raw SIDR REP block (136 bytes on IB/RoCE,
        zero-filled).
        """
        return await resolve_datagram(self, host, port, private_data, timeout)

    def serve_datagram(self, port: int = 0, private_data: bytes = b"") -> DatagramPSP:
        """Answer datagram resolutions on UDP-port-space ``port`` with this EP's QP (a DatagramPSP).

        ``private_data`` (at most 136 bytes) goes raw into every answer.
        """
        return DatagramPSP(self, port, private_data)

    def post_send_to(self, segments: Segments, dest: Any, cookie: Any = None,
                     flags: CompletionFlags = CompletionFlags.DEFAULT, *, imm_data: Optional[int] = None) -> None:
        """Send one datagram to ``dest`` (an AddressHandle or a joined MulticastGroup).

        The message must fit one path MTU (:func:`max_message_size`).
        """
        post_send_to(self, segments, dest, cookie, flags, imm_data)

    def post_recv_datagram(self, segments: Segments, cookie: Any = None,
                           flags: CompletionFlags = CompletionFlags.DEFAULT) -> None:
        """Post a UD receive whose 40-byte GRH goes to a scratch buffer, so ``segments`` get the payload alone.

        Needs ``EPAttr.max_recv_iov`` >= 1 + the number of segments.  The
        completion's ``transferred_length`` still counts the GRH (payload =
        transferred_length - GRH_SIZE); ``src_qp`` names the sender.
        """
        post_recv_datagram(self, segments, cookie, flags)

    async def join_multicast(self, group: str, timeout: Optional[float] = 10.0) -> MulticastGroup:
        """Join the multicast ``group`` (an IP address); returns a MulticastGroup (ib_join_mcast).

        The QP is attached to the group, so datagrams sent to it arrive in
        this EP's receives; send to it with ``post_send_to(segs, group)``.
        """
        return await join_multicast(self, group, timeout)

    async def leave_multicast(self, group: Any) -> None:
        """Leave a group joined with :meth:`join_multicast` (ib_leave_mcast)."""
        if not isinstance(group, MulticastGroup) or group.ep is not self:
            raise InvalidParameter("leave_multicast takes a MulticastGroup this EP joined")
        await group.leave()
