"""Memory: Protection Zones, LMRs (registered Python buffers), their segments, RMRs and remote region descriptors.

``pz.register(buffer, privileges)`` is dat_lmr_create over any buffer-protocol
object (bytearray, memoryview, mmap, array.array, numpy array).  The LMR holds
an export of the buffer while it is registered, so the buffer cannot move: a
registered bytearray refuses to resize (BufferError) instead of corrupting
memory.  A ctypes object that owns its memory is refused: ctypes.resize()
ignores exports.  ``lmr[a:b]`` is a :class:`Segment` to post; ``lmr.remote()`` is a
:class:`RemoteRegion` a peer can target with RDMA.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import struct
from collections import deque
from dataclasses import dataclass
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Deque, Optional, Sequence, Set, Tuple, Union

from aiodat._handle import Handle, Raw, fail_waiter
from aiodat._lib import ffi, lib
from aiodat.epattr import EPState
from aiodat.errors import (InsufficientResources, InvalidHandle, InvalidParameter, InvalidState, LengthError,
                           PrivilegesViolation, ProtectionViolation, error_from_errno, shown)
from aiodat.evd import DTOOp, EvdFlags, EventType, RMRBindEvent

if TYPE_CHECKING:
    from aiodat.ia import IA


class Privileges(enum.IntFlag):
    """Memory privileges (DAT_MEM_PRIV_*); local read is always granted."""

    LOCAL_READ = 0x01
    REMOTE_READ = 0x02
    LOCAL_WRITE = 0x10
    REMOTE_WRITE = 0x20
    REMOTE_ATOMIC = 0x40
    MW_BIND = 0x80
    NONE = 0
    DEFAULT = LOCAL_READ | LOCAL_WRITE
    ALL = LOCAL_READ | REMOTE_READ | LOCAL_WRITE | REMOTE_WRITE | REMOTE_ATOMIC | MW_BIND


def ibv_access(privileges: Privileges) -> int:
    """Translate DAT privileges to ibv_access_flags (remote write/atomic imply local write, as verbs demand)."""
    access = 0
    if privileges & (Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE | Privileges.REMOTE_ATOMIC):
        access |= lib.IBV_ACCESS_LOCAL_WRITE
    if privileges & Privileges.REMOTE_WRITE:
        access |= lib.IBV_ACCESS_REMOTE_WRITE
    if privileges & Privileges.REMOTE_READ:
        access |= lib.IBV_ACCESS_REMOTE_READ
    if privileges & Privileges.REMOTE_ATOMIC:
        access |= lib.IBV_ACCESS_REMOTE_ATOMIC
    if privileges & Privileges.MW_BIND:
        access |= lib.IBV_ACCESS_MW_BIND
    return access


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _slice_indices(key: slice, length: int) -> Tuple[int, int, int]:
    """``key.indices(length)``, with non-integer bounds an InvalidParameter (not TypeError)."""
    try:
        return key.indices(length)
    except (TypeError, ValueError) as exc:
        raise InvalidParameter(f"bad slice {key!r}: {exc}") from None


def _privileges(value: Any) -> "Privileges":
    """``value`` as Privileges (None: the default); anything else is an InvalidParameter."""
    if value is None:
        return Privileges.DEFAULT
    if not isinstance(value, int) or isinstance(value, bool):  # (True would be LOCAL_READ, False NONE)
        raise InvalidParameter(f"privileges must be Privileges flags, not {type(value).__name__}")
    if value < 0 or value & ~int(Privileges.ALL):  # (IntFlag keeps unknown bits; -1 would grant every privilege)
        raise InvalidParameter(f"invalid privileges {shown(value)}: only the bits of Privileges.ALL "
                               f"({int(Privileges.ALL):#x}) are privileges")
    return Privileges(value)


@dataclass(frozen=True)
class Segment:
    """A slice of an LMR to post (DAT_LMR_TRIPLET): ``length`` bytes at ``offset``."""

    lmr: "LMR"
    offset: int
    length: int

    def __post_init__(self) -> None:
        # The class is public, so a Segment made by hand is checked as lmr.segment() checks one:
        # a post must never see a foreign object, a negative offset or bytes past the region.
        lmr, offset, length = self.lmr, self.offset, self.length
        if not isinstance(lmr, LMR):
            raise InvalidParameter(f"Segment.lmr must be an LMR, not {type(lmr).__name__}")
        if not (_is_int(offset) and _is_int(length)):
            raise InvalidParameter(f"Segment offset and length must be ints, got {shown(offset)}, {shown(length)}")
        if offset < 0 or length < 0 or offset + length > lmr.length:
            raise LengthError(f"segment [{shown(offset)}, {shown(offset)}+{shown(length)}) is outside the LMR of "
                              f"{lmr.length} bytes")

    @property
    def address(self) -> int:
        """The virtual address of the first byte."""
        return self.lmr.address + self.offset

    @property
    def lmr_context(self) -> int:
        """The local key (lkey) of the LMR."""
        return self.lmr.lmr_context

    def memoryview(self) -> memoryview:
        """The bytes of this segment, as a memoryview of the registered buffer."""
        return self.lmr.memoryview()[self.offset:self.offset + self.length]

    def remote(self) -> "RemoteRegion":
        """This slice as a region a peer can target (needs remote privileges on the LMR:
        PrivilegesViolation without)."""
        self.lmr._check_remote()
        return RemoteRegion(self.address, self.length, self.lmr.rmr_context)


_REGION = struct.Struct("!QQI")
#: the most bytes one scatter/gather element carries (ibv_sge.length is 32 bits): a longer segment
#: is refused by every post (check_sge_length)
SGE_MAX = 0xFFFFFFFF


def check_writable(seg: "Segment", what: str) -> None:
    """PrivilegesViolation if the device may not write into ``seg`` (a receive's, an RDMA read's or an
    atomic's local buffer): its LMR has no local write.  The device would fail the request with a
    local protection error, and an RC connection with it."""
    if not seg.lmr._writable:
        raise PrivilegesViolation(f"{what}: the device writes into this buffer, but its LMR was registered with "
                                  f"{seg.lmr.privileges!r}, without local write: register it with "
                                  "Privileges.LOCAL_WRITE")


def check_sge_length(seg: "Segment", what: str) -> None:
    """LengthError if ``seg`` is longer than one scatter/gather element holds (``what``: the call)."""
    if seg.length > SGE_MAX:
        raise LengthError(f"{what}: a segment of {seg.length} bytes is more than one scatter/gather "
                          f"element holds ({SGE_MAX}): split it into several segments")


def check_post_segments(segs: Tuple["Segment", ...], pz: "PZ", what: str, owner: str, limit: int,
                        limit_name: str, writes: bool) -> None:
    """The segments of a post on an EP or SRQ (``owner``) of ``pz``: at most ``limit`` (the attribute
    ``limit_name``), each of an open LMR of ``pz``, one scatter/gather element long, and with
    ``writes`` (the device writes into them) writable."""
    if len(segs) > limit:
        raise InvalidParameter(f"{what} takes at most {limit} segment(s) on this {owner} ({limit_name}), "
                               f"got {len(segs)}")
    for seg in segs:
        seg.lmr._check()
        if seg.lmr._pz is not pz:
            raise ProtectionViolation(f"{what}: an LMR of another PZ cannot be used on this {owner}")
        check_sge_length(seg, what)
        if writes:
            check_writable(seg, what)


def fill_sges(sges: Any, start: int, segs: Tuple["Segment", ...]) -> None:
    """Write ``segs`` into the C scatter/gather array ``sges`` from index ``start``."""
    for i, seg in enumerate(segs):
        sge = sges[start + i]
        sge.addr = seg.lmr.address + seg.offset
        sge.length = seg.length
        sge.lkey = seg.lmr.lmr_context


@dataclass(frozen=True)
class RemoteRegion:
    """Where a peer may read or write: address, length and the rkey (DAT_RMR_TRIPLET)."""

    address: int
    length: int
    rmr_context: int

    def __post_init__(self) -> None:
        # Public too, as Segment: one made by hand must fit what a post and to_bytes put on the wire
        # (64-bit address and length, 32-bit rkey), never a raw OverflowError or struct.error there.
        for name, value, bits in (("address", self.address, 64), ("length", self.length, 64),
                                  ("rmr_context", self.rmr_context, 32)):
            if not _is_int(value) or not 0 <= value < 1 << bits:
                raise InvalidParameter(f"RemoteRegion {name} must be an int between 0 and 2**{bits}-1, "
                                       f"got {shown(value)}")

    def to_bytes(self) -> bytes:
        """20 bytes, network order: address, length, rmr_context (fits in private data)."""
        return _REGION.pack(self.address, self.length, self.rmr_context)

    @classmethod
    def from_bytes(cls, data: Union[bytes, bytearray, memoryview]) -> "RemoteRegion":
        """Parse what :meth:`to_bytes` produced (extra trailing bytes are ignored)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidParameter(f"RemoteRegion.from_bytes needs bytes, not {type(data).__name__}")
        try:
            view = memoryview(data)
        except ValueError as exc:  # a released memoryview
            raise InvalidParameter(f"RemoteRegion.from_bytes cannot read this memoryview: {exc}") from None
        with view:
            if not view.c_contiguous:
                raise InvalidParameter("RemoteRegion.from_bytes needs a contiguous buffer")
            size = view.nbytes  # bytes, not items: a view of wider items (array "I") counts them all
            if size < _REGION.size:
                raise InvalidParameter(f"a RemoteRegion needs {_REGION.size} bytes, got {size}")
            fields = _REGION.unpack_from(view)
        return cls(*fields)

    def __getitem__(self, key: slice) -> "RemoteRegion":
        if not isinstance(key, slice):
            raise TypeError("RemoteRegion supports slicing only")
        start, stop, step = _slice_indices(key, self.length)
        if step != 1 or stop < start:
            raise InvalidParameter(f"unsupported slice {key!r} of a remote region")
        return RemoteRegion(self.address + start, stop - start, self.rmr_context)


@dataclass(frozen=True)
class LMRParam:
    """What :meth:`LMR.query` returns (DAT_LMR_PARAM)."""

    pz: "PZ"
    address: int
    length: int
    privileges: Privileges
    lmr_context: int
    rmr_context: int
    registered_size: int
    registered_address: int


class LMR(Handle):
    """A Local Memory Region: a registered buffer (dat_lmr_create)."""

    _kind = "lmr"
    _close_rank = 5  # after EPs and RMRs of the same PZ

    def __init__(self, pz: "PZ", buffer: Any, privileges: Optional[Privileges] = None, *,
                 _pinned: Optional[Tuple[Any, Any, Any, Privileges]] = None) -> None:
        view, cdata, mr, privileges = _pinned or LMR._pin(pz, buffer, privileges)
        try:
            super().__init__(pz)
        except BaseException:  # the PZ was closed meanwhile (register_async): unpin
            lib.ibv_dereg_mr(mr)
            raise
        self._pz = pz
        self._view = view
        self._cdata = cdata  # holds the buffer export: the buffer cannot be resized or freed
        self._mr = mr
        # the MR holds the export too: if deregistration fails the device may still use the memory
        self._raw = Raw(mr, lib.ibv_dereg_mr, "MR", pz._raw, cdata)
        self._inflight = 0
        #: the RMRs bound to a range of this LMR, or with a bind to one pending (memory windows
        #: pin their MR: rxe refuses to deregister it while one is bound)
        self._windows: "weakref.WeakSet[RMR]" = weakref.WeakSet()
        self.privileges = privileges
        # the device may write into it (receives, RDMA reads, atomics land here); read by the C posts too
        self._writable = bool(ibv_access(privileges) & lib.IBV_ACCESS_LOCAL_WRITE)
        #: the local key (lkey) and remote key (rkey) of the registration
        self.lmr_context: int = mr.lkey
        self.rmr_context: int = mr.rkey
        self.address: int = int(ffi.cast("uintptr_t", cdata))
        self.length: int = view.nbytes

    @staticmethod
    def _pin(pz: "PZ", buffer: Any, privileges: Optional[Privileges]) -> Tuple[Any, Any, Any, Privileges]:
        """Check the buffer and register it (ibv_reg_mr pins its pages: slow for large buffers,
        so register_async runs this in an executor thread)."""
        pz._check()
        privileges = _privileges(privileges)
        try:
            view = memoryview(buffer)
        except TypeError:
            raise InvalidParameter(
                f"cannot register a {type(buffer).__name__}: it does not support the buffer protocol"
            ) from None
        except ValueError as exc:  # a released memoryview
            raise InvalidParameter(f"cannot register this {type(buffer).__name__}: {exc}") from None
        cdata = None
        try:
            if getattr(view.obj, "_b_needsfree_", False):  # (a ctypes object that owns its memory)
                raise InvalidParameter(
                    f"cannot register a {type(view.obj).__name__} that owns its memory: ctypes.resize() moves it "
                    f"whatever exports it (the device would write into freed memory); register a bytearray, mmap or "
                    f"numpy array, or a ctypes object made over one with from_buffer()"
                )
            if not view.c_contiguous:
                raise InvalidParameter("cannot register a non-contiguous buffer")
            writes = privileges & (Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE | Privileges.REMOTE_ATOMIC)
            if view.readonly and writes:
                raise InvalidParameter(
                    f"cannot register a read-only {type(buffer).__name__} with write privileges ({privileges!r})"
                )
            length = view.nbytes
            if length == 0:
                raise LengthError("cannot register an empty buffer")
            max_size = pz.ia._device_attr.max_mr_size
            if length > max_size:
                raise LengthError(f"buffer of {length} bytes exceeds max_lmr_block_size {max_size}")
            cdata = ffi.from_buffer("char[]", view, require_writable=bool(writes))
            mr = lib.ibv_reg_mr(pz._pd, cdata, length, ibv_access(privileges))
            if mr == ffi.NULL:
                raise error_from_errno(ffi.errno, f"registering {length} bytes (ibv_reg_mr)")
        except BaseException:
            # The exception's traceback keeps this frame, and so the view and cdata, alive: end
            # their exports of the buffer now, or it could not be resized while the error lives.
            if cdata is not None:
                ffi.release(cdata)
            view.release()
            raise
        return view, cdata, mr, privileges

    @property
    def pz(self) -> "PZ":
        """The PZ the LMR belongs to."""
        return self._pz

    def __getitem__(self, key: slice) -> Segment:
        self._check()
        if not isinstance(key, slice):
            raise TypeError("index an LMR with a slice, e.g. lmr[0:64]")
        start, stop, step = _slice_indices(key, self.length)
        if step != 1:
            raise InvalidParameter("LMR segments must be contiguous (step 1)")
        return Segment(self, start, max(0, stop - start))

    def __len__(self) -> int:
        return self.length

    def segment(self, offset: int = 0, length: Optional[int] = None) -> Segment:
        """The ``length`` bytes at ``offset`` (to the end by default), checked against the LMR."""
        self._check()
        if not _is_int(offset) or not (length is None or _is_int(length)):
            raise InvalidParameter(f"segment offset and length must be ints, got {shown(offset)}, {shown(length)}")
        if length is None:
            length = self.length - offset
        return Segment(self, offset, length)  # (which checks the range)

    def memoryview(self) -> memoryview:
        """The registered bytes (a byte-format view of the buffer)."""
        self._check()
        # a new view each time: the caller may release it (``with lmr.memoryview() as mv``), and
        # the LMR's own view cannot be released while the registration exports it
        return self._view.cast("B") if self._view.format != "B" or self._view.ndim != 1 else self._view[:]

    def remote(self) -> RemoteRegion:
        """The whole LMR as a region a peer can target with RDMA (needs remote privileges:
        PrivilegesViolation without)."""
        self._check_remote()
        return RemoteRegion(self.address, self.length, self.rmr_context)

    def _check_remote(self) -> None:
        """InvalidHandle once freed (its rkey names nothing, or another's registration later);
        PrivilegesViolation if no peer may reach it: every RDMA a peer aimed at the region would
        fail on the device and break that peer's connection, far from the mistake."""
        self._check()
        if not self.privileges & (Privileges.REMOTE_READ | Privileges.REMOTE_WRITE | Privileges.REMOTE_ATOMIC):
            raise PrivilegesViolation(f"remote(): this LMR was registered with {self.privileges!r}, which lets no peer "
                                      "reach it: register it with Privileges.REMOTE_READ, REMOTE_WRITE or "
                                      "REMOTE_ATOMIC (or register it with MW_BIND, bind a memory window to it and use "
                                      "rmr.remote())")

    def query(self) -> LMRParam:
        """Return the LMR's parameters (dat_lmr_query)."""
        self._check()
        return LMRParam(self._pz, self.address, self.length, self.privileges, self.lmr_context,
                        self.rmr_context, self._mr.length, int(ffi.cast("uintptr_t", self._mr.addr)))

    def sync_rdma_read(self) -> None:
        """Make local writes visible to a peer's RDMA read (dat_lmr_sync_rdma_read); a no-op on coherent hosts."""
        self._check()

    def sync_rdma_write(self) -> None:
        """Make a peer's RDMA writes visible locally (dat_lmr_sync_rdma_write); a no-op on coherent hosts."""
        self._check()

    def free(self) -> None:
        """Deregister (dat_lmr_free); refused while posted requests still use the memory or a
        memory window is bound to it (:meth:`close` closes those windows instead)."""
        self._check()
        windows = list(self._windows)
        self._refuse_close_while(bool(windows), f"memory window(s) {', '.join(map(repr, windows))} are bound to it "
                                                f"(or a bind to it is pending): unbind or free them first")
        self._refuse_close_while(self._inflight > 0, f"{self._inflight} posted request(s) still use it")
        self.close()

    def close(self) -> None:
        """Deregister now, closing first the memory windows (RMRs) bound to it, as an EVD's close
        closes the EPs using it: a window pins its MR, and the deregistration would fail."""
        if not self._closed:
            for rmr in list(self._windows):
                rmr.close()
        super().close()

    def _release(self) -> None:
        failed = 0
        if self._mr != ffi.NULL:
            failed = self._raw.release()
            self._mr = ffi.NULL
        cdata, self._cdata = self._cdata, None
        if failed:  # the MR is still registered: keep the buffer exported (Raw keeps it alive)
            raise error_from_errno(failed, f"deregistering {self.length} bytes (ibv_dereg_mr)")
        if cdata is not None:
            ffi.release(cdata)  # end the buffer export now, not at garbage collection
        try:
            self._view.release()
        except BufferError:  # the program holds an export of memoryview() (a numpy array, say): that
            pass             # view stays valid until it lets go; the registration is gone all the same

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<aiodat.LMR {self.length} bytes at {self.address:#x}{state}>"


@dataclass(frozen=True)
class RMRParam:
    """What :meth:`RMR.query` returns (DAT_RMR_PARAM)."""

    pz: "PZ"
    bound: bool
    lmr: Optional["LMR"]
    address: Optional[int]
    length: int
    privileges: Privileges
    rmr_context: int
    type: int


_BIND_PRIVILEGES = Privileges.REMOTE_READ | Privileges.REMOTE_WRITE | Privileges.REMOTE_ATOMIC


class RMR(Handle):
    """A Remote Memory Region: a type-2 memory window bound to a range of an LMR (dat_rmr_create).

    ``await rmr.bind(lmr[a:b], privileges, ep)`` posts a bind on ``ep``'s send
    queue (IBV_WR_BIND_MW) with the next rkey of the window
    (``ibv_inc_rkey``) and resolves with that new ``rmr_context`` once the
    bind completes; a peer can then reach exactly that range, with exactly
    those privileges, through :meth:`remote`.  ``await rmr.unbind(ep)``
    invalidates the window (IBV_WR_LOCAL_INV of its rkey): any later remote
    access with the old rmr_context fails at the initiator with
    IBV_WC_REM_ACCESS_ERR; it must go through the EP the window is bound
    through, once no bind or unbind of the window is pending.  Type-2 windows
    must be unbound before they are bound again.  The LMR needs ``Privileges.MW_BIND``; the EP must be
    connected and in the RMR's PZ.

    The bind completion is a :class:`aiodat.RMRBindEvent`.  The awaitable
    forms consume it (it never reaches an EVD); the ``*_nowait`` forms, or an
    awaitable that was cancelled, leave it on the EP's request EVD, as DAT's
    RMR_BIND_COMPLETION_EVENT.
    """

    _kind = "rmr"
    # Before EPs and LMRs: a bound type-2 window holds references on both its MR and the QP
    # that bound it (rxe waits 50 s in ibv_destroy_qp for them), and deallocating the window
    # first releases both.
    _close_rank = -1

    def __init__(self, pz: "PZ") -> None:
        pz._check()
        # (through a cell made first: a MemoryError making the result's Python object would lose the window)
        cell = ffi.new("struct ibv_mw **")
        err = lib.aiodat_alloc_mw(pz._pd, cell)
        if err:
            if err in (95, 38):  # EOPNOTSUPP, ENOSYS
                from aiodat.errors import NotImplementedByProvider

                raise NotImplementedByProvider(f"{pz.ia.device_name} does not support type-2 memory windows "
                                               f"(ibv_alloc_mw errno {err})")
            raise error_from_errno(err, "allocating a memory window (ibv_alloc_mw)")
        raw: Optional[Raw] = None
        try:
            mw = cell[0]
            raw = Raw(mw, lib.ibv_dealloc_mw, "MW", pz._raw)
            super().__init__(pz)
            self._raw = raw
            self._pz = pz
            self._mw = mw
            self._rkey: int = mw.rkey
        except BaseException:  # (a MemoryError) at once: the traceback keeps this frame, and a window alive
            # holds its PD (ibv_dealloc_pd: EBUSY, the PZ's close deferred)
            if raw is None:
                lib.aiodat_dealloc_mw_at(cell)
            else:
                raw.release()
            raise
        self._bound: Optional[Tuple[Segment, Privileges]] = None
        # The EP the window is bound through, or has its bind or unbind pending on (None: neither).
        # A type-2B window belongs to that QP: it alone may unbind it, and only its destruction
        # touches the window (_qp_gone).  The EP's _windows holds this RMR for exactly as long.
        self._ep: Any = None
        # posted binds/unbinds in order: (future or None, op, new rkey, segment, privileges)
        self._pending: Deque[Tuple[Any, Any, int, Optional[Segment], Privileges]] = deque()

    @property
    def pz(self) -> "PZ":
        """The PZ the RMR belongs to."""
        return self._pz

    @property
    def rmr_context(self) -> int:
        """The window's current rkey (the one a peer must use while it is bound)."""
        return self._rkey

    @property
    def bound(self) -> bool:
        """True while the window is bound to an LMR range."""
        return self._bound is not None

    def _post(self, op: Any, ep: Any, segment: Optional[Segment], privileges: Privileges, cookie: Any,
              waiter: Any) -> int:
        self._check()
        # Duck-typed: memory.py sits below ep.py in the layers; an EP offers _bind_window.
        if not callable(getattr(ep, "_bind_window", None)):
            raise InvalidParameter(f"an RMR is bound through a connected EP, not {type(ep).__name__}")
        ep._check()
        if ep.pz is not self._pz:
            raise InvalidParameter("the EP belongs to another PZ than the RMR")
        if ep.state is not EPState.CONNECTED:
            raise InvalidState(f"binding a type-2 window needs a connected EP; this one is {ep.state.value}")
        if not int.__and__(ep.request_evd.streams, EvdFlags.RMR_BIND):  # (plain ints: no enum member built)
            raise InvalidParameter(f"the EP's request_evd does not accept the RMR_BIND stream, where a bind's "
                                   f"event goes: create it with EvdFlags.RMR_BIND (its streams: "
                                   f"{ep.request_evd.streams!r})")
        if waiter is not None:
            # the completion must be drained by the waiter's loop: InvalidState if another loop owns
            # the request EVD, raised here, before the bind goes
            ep.request_evd._attach(waiter.get_loop())
        if op is DTOOp.BIND:
            assert segment is not None  # (bind_nowait passes one; an unbind passes None)
            self._refuse_while_pending("binding")
            if self._bound is not None:
                raise InvalidState("the window is bound: unbind it first (type-2 windows cannot be rebound in place)")
            new_rkey = int(lib.ibv_inc_rkey(self._rkey))
            access = ibv_access(privileges) & ~lib.IBV_ACCESS_LOCAL_WRITE & ~lib.IBV_ACCESS_MW_BIND
            bind = (self._mw, new_rkey, segment.lmr._mr, segment.address, segment.length, access)
            if self._ep is not None and self._ep is not ep:
                self._leave_ep()  # (nothing is bound or pending there: the old QP has no claim left)
        else:
            # _check_unbind made sure: bound through this very EP, nothing pending, so the key is the bound one
            new_rkey = self._rkey
            bind = (self._mw, self._rkey, ffi.NULL, 0, 0, 0)
        # Every record of the request is made before its post, as a post's are (docs/reliability.md,
        # Memory pressure), and taken back if the post does not go: a bind the device has is always
        # pending here, and counted on its LMR.
        entry = (waiter, op, new_rkey, segment, privileges)
        ep_before, evd = self._ep, ep.request_evd
        self._pending.append(entry)
        self._ep = ep
        needed = awaited = False
        counted: Optional[LMR] = None
        try:
            # a bound window holds a reference on the QP: if both are dropped, free the window first
            needed = self._raw.need(ep._raw)
            if segment is not None:
                segment.lmr._inflight += 1  # the LMR cannot be freed while the window points into it
                counted = segment.lmr
                segment.lmr._windows.add(self)  # ... and its close closes the window first
            if waiter is not None:
                evd._awaited += 1  # polled even if the EVD is full (docs/events.md)
                awaited = True
                evd._rearm_fully()  # its channel event must come (a solicited wait may have narrowed the arm)
            ep._bind_window(self, op, bind, cookie)
        except BaseException:
            self._pending.pop()
            self._ep = ep_before
            if awaited:
                evd._awaited -= 1
            try:  # (what cannot be taken back for want of memory stays: the safe side)
                if counted is not None:
                    counted._windows.discard(self)
                    counted._inflight -= 1  # (else high: that refuses a free and loses nothing)
                if needed:
                    self._raw.unneed(ep._raw)  # (else kept: the QP outlives the window)
            except Exception:  # (MemoryError; or CPython's SystemError for a frame it could not allocate)
                pass
            raise
        return new_rkey

    def _check_bind(self, segment: Any, privileges: Any) -> Tuple[Segment, Privileges]:
        if isinstance(segment, LMR):
            segment = segment.segment()
        if not isinstance(segment, Segment):
            raise InvalidParameter(f"bind takes an LMR segment (lmr[a:b]), not {type(segment).__name__}")
        segment.lmr._check()
        if segment.lmr._pz is not self._pz:
            raise InvalidParameter("the LMR belongs to another PZ than the RMR")
        if segment.length == 0:
            raise LengthError("cannot bind a window to an empty segment (unbind instead)")
        privileges = _privileges(privileges)
        if not privileges & _BIND_PRIVILEGES:
            raise InvalidParameter("a window needs at least one remote privilege (REMOTE_READ, REMOTE_WRITE, "
                                   "REMOTE_ATOMIC)")
        lmr_priv = segment.lmr.privileges
        if not lmr_priv & Privileges.MW_BIND:
            raise PrivilegesViolation("the LMR was registered without Privileges.MW_BIND: windows cannot be "
                                      "bound to it")
        writes = privileges & (Privileges.REMOTE_WRITE | Privileges.REMOTE_ATOMIC)
        if writes and not segment.lmr._writable:
            # verbs: a window granting remote write or atomics needs an MR with local write; the device
            # would fail the bind (and the connection with it)
            raise PrivilegesViolation(f"privileges {writes!r} of a window need an LMR with local write, but it was "
                                      f"registered with {lmr_priv!r}: register it with Privileges.LOCAL_WRITE")
        return segment, privileges & (_BIND_PRIVILEGES | Privileges.LOCAL_READ | Privileges.LOCAL_WRITE)

    def bind_nowait(self, segment: Segment, privileges: Privileges, ep: Any, cookie: Any = None) -> int:
        """Post the bind (dat_rmr_bind) and return the new rmr_context at once.

        The RMR_BIND_COMPLETION event arrives on ``ep.request_evd``; the
        window is usable by the peer only once it completed successfully.
        """
        segment, privileges = self._check_bind(segment, privileges)
        return self._post(DTOOp.BIND, ep, segment, privileges, cookie, None)

    async def bind(self, segment: Segment, privileges: Privileges, ep: Any, cookie: Any = None) -> int:
        """Bind the window to ``segment`` with ``privileges`` through ``ep``; return the new rmr_context.

        Raises :class:`aiodat.DTOError` naming the completion status if the
        bind fails.  Cancelling the await leaves the event on the request EVD.
        """
        segment, privileges = self._check_bind(segment, privileges)
        fut = asyncio.get_running_loop().create_future()
        self._post(DTOOp.BIND, ep, segment, privileges, cookie, fut)
        event = await fut
        self._raise_for(event, "bind")
        return event.rmr_context

    def unbind_nowait(self, ep: Any, cookie: Any = None) -> None:
        """Post the invalidation of the window (dat_rmr_bind with a zero length); the event goes to the EVD.

        ``ep`` must be the EP the window is bound through (InvalidParameter otherwise), and no bind or
        unbind of the window may be pending (InvalidState): wait for its RMR_BIND_COMPLETION first.
        """
        self._check_unbind(ep)
        self._post(DTOOp.UNBIND, ep, None, Privileges.NONE, cookie, None)

    async def unbind(self, ep: Any, cookie: Any = None) -> None:
        """Invalidate the window through ``ep``, the EP it is bound through; the old rmr_context stops
        working for the peer.  Refused while a bind or unbind of the window is pending (see
        :meth:`unbind_nowait`)."""
        self._check_unbind(ep)
        fut = asyncio.get_running_loop().create_future()
        self._post(DTOOp.UNBIND, ep, None, Privileges.NONE, cookie, fut)
        event = await fut
        self._raise_for(event, "unbind")

    def _refuse_while_pending(self, doing: str) -> None:
        """One bind or unbind of the window at a time: an invalidation names the window's current
        key, which only a completed bind sets, and a second one would hit a window already free
        (rxe_do_invalidate_mw).  So each completion is the one pending request's."""
        if self._pending:
            what = "a bind" if self._pending[-1][1] is DTOOp.BIND else "an unbind"
            raise InvalidState(f"{what} of the window is pending: wait for its RMR_BIND_COMPLETION before {doing}")

    def _check_unbind(self, ep: Any) -> None:
        self._check()
        self._refuse_while_pending("unbinding")
        if self._bound is None:
            raise InvalidState("the window is not bound")
        if ep is not self._ep:
            # a type-2B window belongs to the QP that bound it: another QP's invalidation fails on the device
            shown_ep = repr(ep) if callable(getattr(ep, "_bind_window", None)) else f"a {type(ep).__name__}"
            raise InvalidParameter(f"the window is bound through {self._ep!r}, not through {shown_ep}: "
                                   f"unbind it through the EP that bound it")

    def _leave_ep(self, window_going: bool = False) -> None:
        """The window is no longer bound (nor pending) through its EP: leave that EP's window set.
        ``window_going``: the window itself is about to be destroyed, which lets the QP go; until
        then (and for ever, if its destruction fails) the QP must outlive it."""
        ep, self._ep = self._ep, None
        if ep is not None:
            if not window_going:
                # an unbound window no longer keeps the QP alive (ep._raw is still the one it
                # needed: a reset or close of the EP goes through _qp_gone first)
                self._raw.unneed(ep._raw)
            ep._forget_window(self)

    @staticmethod
    def _raise_for(event: Any, what: str) -> None:
        if not event.ok:
            from aiodat.errors import DTOError

            raise DTOError(f"memory window {what} with cookie {shown(event.cookie)} failed: {event.status}",
                           status=event.status, cookie=event.cookie)

    def _bind_completed(self, evd: Any, cookie: Any, status: str, op: Any, take: Callable[..., Any]) -> Any:
        """Called by the EP when a bind/unbind of this window completes: returns the event, or None if awaited.

        Raises with nothing changed, or takes the pending request whole: what allocates (the event,
        the binding) comes before the request is popped, so the retry of a completion kept in its
        EVD's backlog meets the same request (not the next one).  ``take(extra)`` takes the EP's
        entry (wr.py), first, with the window's own release (``extra``: (segments, requests)) in
        the same plan: its call may fail, nothing taken; what it returns is held until the end
        (its release may run finalizers).  Nothing changes before it: the take sets the counts of
        the suppressed sends the entry retires too, which a count worked out here before the take
        would undo."""
        if not self._pending:  # (the window was closed while its bind was pending: its entry still goes)
            held = take()
            del held  # (the finalizers run here)
            return None
        pend = self._pending[0]  # (the take checks it is still there: a close clears it, releasing its segment)
        waiter, pop_op, new_rkey, segment, privileges = pend
        ok = status == "IBV_WC_SUCCESS"
        bind = pop_op is DTOOp.BIND  # (before the take: an enum member's lookup may allocate)
        event: Any = RMRBindEvent(EventType.RMR_BIND_COMPLETION, evd, self, cookie, status,
                                  new_rkey if ok and bind else None)
        lmr: Any = None
        bound: Any = None
        extra: Any = []
        if bind:
            assert segment is not None  # (a bind always names its segment: bind_nowait)
            if ok:  # its pin is held on while bound
                bound = (segment, privileges)
            else:
                lmr, extra = segment.lmr, [((segment,), 1)]
        elif ok and self._bound is not None:
            lmr, extra = self._bound[0].lmr, [(self._bound[:1], 1)]
        # taken from here
        held = take(extra, (self._pending, None, pend))  # (_PlanStale if the window was closed since)
        self._pending.popleft()
        if waiter is not None and evd._awaited > 0:
            evd._awaited -= 1
        if bind and ok:
            self._rkey = new_rkey
            self._mw.rkey = new_rkey  # verbs leaves this to the consumer; the next bind names it
            self._bound = bound
        elif lmr is not None:  # a failed bind or an invalidation: neither the LMR nor the QP is held by the window
            lmr._windows.discard(self)
            if not bind:
                self._bound = None
            self._leave_ep()
        if waiter is not None and not waiter.done():
            waiter.set_result(event)
            event = None
        del held  # (the finalizers run here)
        return event

    def _forget(self, why: str) -> None:
        """Drop every pending request and the binding (their LMR pins too); wake waiters with InvalidHandle."""
        bound_through = getattr(self, "_ep", None)
        evd = bound_through.request_evd if bound_through is not None else None
        for waiter, _op, _key, segment, _priv in self._pending:
            if waiter is not None and evd is not None and evd._awaited > 0:
                evd._awaited -= 1
            fail_waiter(waiter, InvalidHandle(why))
            if segment is not None:
                segment.lmr._inflight -= 1
                segment.lmr._windows.discard(self)
        self._pending.clear()
        if self._bound is not None:
            self._bound[0].lmr._inflight -= 1
            self._bound[0].lmr._windows.discard(self)
            self._bound = None
        if getattr(self, "_ep", None) is not None:
            self._leave_ep(window_going=True)  # (closed, or replaced: _qp_gone)

    def _qp_gone(self, ep: Any) -> None:
        """``ep`` is destroying its QP: if the window is bound (or pending) through it, start over
        with a fresh window (a type-2B window is tied to that QP); otherwise leave the window alone."""
        if ep is not self._ep or self._closed:
            ep._forget_window(self)  # (not ours any more: a stale entry must not tear down another binding)
            return
        self._forget("the EP the window was bound through was freed")
        if self._mw != ffi.NULL:
            self._raw.release()
        self._mw = lib.ibv_alloc_mw(self._pz._pd, lib.IBV_MW_TYPE_2)
        if self._mw == ffi.NULL:
            self._closed = True  # no window to offer any more
            self._pz._children.pop(self, None)
            return
        self._raw = Raw(self._mw, lib.ibv_dealloc_mw, "MW", self._pz._raw)
        self._rkey = self._mw.rkey

    def remote(self) -> RemoteRegion:
        """The bound range as a region a peer can target (address, length, the window's rkey)."""
        self._check()
        if self._bound is None:
            raise InvalidState("the window is not bound: bind it first")
        seg = self._bound[0]
        return RemoteRegion(seg.address, seg.length, self._rkey)

    def query(self) -> RMRParam:
        """Return the window's parameters (dat_rmr_query)."""
        self._check()
        if self._bound is None:
            return RMRParam(self._pz, False, None, None, 0, Privileges.NONE, self._rkey, self._mw.type)
        seg, priv = self._bound
        return RMRParam(self._pz, True, seg.lmr, seg.address, seg.length, priv, self._rkey, self._mw.type)

    def free(self) -> None:
        """Free the window (dat_rmr_free); a bound window is invalidated by its destruction.

        Refused (InvalidState) while a bind or unbind of the window is pending: its
        RMR_BIND_COMPLETION would be lost.  :meth:`close` (and closing the LMR, PZ or IA) frees it
        anyway, failing an awaiting bind with InvalidHandle and dropping a ``*_nowait`` one's event.
        Freeing the EP a window was bound through leaves the RMR usable but
        unbound (aiodat replaces the window: a type-2B window is tied to that QP).
        """
        self._check()
        self._refuse_while_pending("freeing it")
        self.close()

    def _release(self) -> None:
        self._forget("the RMR was freed while a bind waited on it")
        if self._mw != ffi.NULL:
            self._raw.release()
            self._mw = ffi.NULL

    def __del__(self) -> None:
        if not self._closed:
            # Dropped unclosed (with the EP that holds it): its window goes with its Raw holder, so
            # its LMR pins go too; else lmr.free() would stay refused for a window nobody has.
            try:
                self._forget("the RMR was dropped")
            except Exception:  # (a half-made RMR has no pins)
                pass
        Handle.__del__(self)  # (not super(): its object is an allocation, which could fail and lose the warning)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("bound" if self._bound else "unbound")
        return f"<aiodat.RMR rkey={self._rkey:#x} {state}>"


Segments = Union[Segment, LMR, Sequence[Segment], None]


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


class _Pin:
    """One register_async's registration, pinned in an executor thread.

    The PZ knows its pins in flight.  Its close takes each pin's lock, so it waits for a
    registration under way (one ``ibv_reg_mr``) and a pin that starts afterwards finds the PZ
    closed; then it undoes what was registered, before the PD goes.  So no thread registers
    on a PD being freed, and nothing registered is left behind.

    A cancelled await abandons its pin: the thread itself undoes a registration that ends
    afterwards.  Nothing waits for the loop, which may have closed by then (a callback
    scheduled on it would never run, and the MR would keep the PD from being freed)."""

    def __init__(self, pz: "PZ", buffer: Any, privileges: Optional[Privileges]) -> None:
        self.pz, self.buffer, self.privileges = pz, buffer, privileges
        self.pinned: Optional[Tuple[Any, Any, Any, Privileges]] = None
        self.abandoned = False
        self.lock = threading.Lock()  # held for the whole registration: the PZ's close waits on it
        self.handoff = threading.Lock()  # held only to hand the result over: never blocks the loop
        pz._pins.add(self)

    def run(self) -> None:
        """In the executor thread: check the PZ and register (the PZ's close waits for this)."""
        with self.lock:
            if self.abandoned:  # cancelled (or its PZ closed) before the executor got to it
                self.pz._pins.discard(self)
                return
            pinned = LMR._pin(self.pz, self.buffer, self.privileges)
            with self.handoff:
                wanted = not self.abandoned
                if wanted:
                    self.pinned = pinned
            if not wanted:  # abandoned while pinning: nobody will adopt it (inside the lock: the PD waits)
                self.pz._pins.discard(self)
                _unpin(pinned)

    def abandon(self) -> None:
        """In the loop's thread, on cancellation: undo the registration now if it is done,
        else let the thread undo it when it ends."""
        with self.handoff:
            self.abandoned = True
            pinned, self.pinned = self.pinned, None
        if pinned is not None:
            self.pz._pins.discard(self)
            _unpin(pinned)

    def undo(self) -> None:
        """In the loop's thread: the registration is not wanted (failed, or its PZ closed)."""
        self.pz._pins.discard(self)
        self.abandoned = True
        with self.lock:  # (a registration still under way ends first)
            pinned, self.pinned = self.pinned, None
        if pinned is not None:
            _unpin(pinned)

    def adopt(self) -> "LMR":
        """In the loop's thread, once ``run`` has returned: the LMR, or InvalidHandle if the PZ's
        close undid the registration meanwhile."""
        self.pz._pins.discard(self)
        pinned, self.pinned = self.pinned, None
        if pinned is None:
            raise InvalidHandle("pz is closed: it was closed while register_async pinned the buffer",
                                subtype="DAT_INVALID_HANDLE_PZ")
        return LMR(self.pz, self.buffer, _pinned=pinned)


def _retrieved(future: "asyncio.Future[None]") -> None:
    if not future.cancelled():
        future.exception()


def _unpin(pinned: Tuple[Any, Any, Any, Privileges]) -> None:
    """Undo a registration no LMR took over: deregister and end the buffer's exports."""
    view, cdata, mr, _ = pinned
    lib.ibv_dereg_mr(mr)
    ffi.release(cdata)
    view.release()


class PZ(Handle):
    """A Protection Zone (an ibv protection domain): LMRs, RMRs, EPs and SRQs live in one."""

    _kind = "pz"
    _close_rank = 10  # after PSPs; before EVDs (EPs inside must go before their CQs)

    def __init__(self, ia: "IA") -> None:
        super().__init__(ia)
        self._ia = ia
        self._pd = lib.ibv_alloc_pd(ia._context)
        if self._pd == ffi.NULL:
            self._closed = True
            ia._children.pop(self, None)
            raise InsufficientResources(f"ibv_alloc_pd failed: {os.strerror(ffi.errno)}")
        self._raw = Raw(self._pd, lib.ibv_dealloc_pd, "PD", ia._raw)
        self._pins: Set[_Pin] = set()  # register_async's registrations in flight

    @property
    def ia(self) -> "IA":
        """The IA this PZ belongs to."""
        return self._ia

    def register(self, buffer: Any, privileges: Optional[Privileges] = None) -> LMR:
        """Register a writable buffer as a Local Memory Region (dat_lmr_create).

        Pinning takes time in proportion to the buffer's size (about a
        millisecond per few MiB); for large buffers in async code use
        :meth:`register_async`, which does not block the event loop.
        """
        return LMR(self, buffer, privileges)

    async def register_async(self, buffer: Any, privileges: Optional[Privileges] = None, *,
                             executor: Optional[concurrent.futures.Executor] = None) -> LMR:
        """Register like :meth:`register`, pinning the pages in ``executor`` (the loop's default)
        so the event loop keeps running meanwhile.

        Cancelling the await loses nothing: a registration that completes after
        the cancellation is undone at once.  ``executor`` must be a
        ``concurrent.futures.Executor`` (InvalidParameter otherwise); one that
        refuses the work (shut down) is InvalidState.
        """
        self._check()
        if executor is not None and not isinstance(executor, concurrent.futures.Executor):
            raise InvalidParameter(f"executor must be a concurrent.futures.Executor or None, "
                                   f"not {type(executor).__name__}")
        loop = asyncio.get_running_loop()
        pin = _Pin(self, buffer, privileges)
        try:
            pinning = loop.run_in_executor(executor, pin.run)
        except RuntimeError as exc:  # an executor that was shut down refuses new work
            pin.undo()
            raise InvalidState(f"the executor refused the registration: {exc}") from None
        except BaseException:
            pin.undo()  # (the PZ must not keep a pin that will never run)
            raise
        try:
            await asyncio.shield(pinning)
        except asyncio.CancelledError:
            pin.abandon()
            pinning.add_done_callback(_retrieved)  # (a failure nobody awaits now is not "never retrieved")
            raise
        except BaseException:
            pin.undo()
            raise
        return pin.adopt()

    def create_rmr(self) -> RMR:
        """Create a Remote Memory Region: a memory window to bind to an LMR range (dat_rmr_create)."""
        return RMR(self)

    def free(self) -> None:
        """Free the PZ (dat_pz_free); refused while LMRs, RMRs, EPs or SRQs use it."""
        self._check()
        self._refuse_close_while(bool(self._children), f"{len(self._children)} object(s) still use it")
        self.close()

    def _release(self) -> None:
        for pin in list(self._pins):  # before the PD goes: see _Pin
            pin.undo()
        if self._pd != ffi.NULL:
            self._raw.release()
            self._pd = ffi.NULL

    def __repr__(self) -> str:
        return f"<aiodat.PZ of {self._ia.name}{' closed' if self._closed else ''}>"
