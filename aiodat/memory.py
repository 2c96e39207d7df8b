"""Memory: LMRs (registered Python buffers), their segments, and remote region descriptors.

``pz.register(buffer, privileges)`` is dat_lmr_create over any buffer-protocol
object (bytearray, memoryview, mmap, array.array, numpy array).  The LMR holds
an export of the buffer while it is registered, so the buffer cannot move: a
registered bytearray refuses to resize (BufferError) instead of corrupting
memory.  ``lmr[a:b]`` is a :class:`Segment` to post; ``lmr.remote()`` is a
:class:`RemoteRegion` a peer can target with RDMA.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from aiodat._handle import Handle
from aiodat._lib import ffi, lib
from aiodat.errors import InvalidParameter, LengthError, error_from_errno

if TYPE_CHECKING:
    from aiodat.ia import PZ


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


@dataclass(frozen=True)
class Segment:
    """A slice of an LMR to post (DAT_LMR_TRIPLET): ``length`` bytes at ``offset``."""

    lmr: "LMR"
    offset: int
    length: int

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
        """This slice as a region a peer can target (needs remote privileges on the LMR)."""
        return RemoteRegion(self.address, self.length, self.lmr.rmr_context)


_REGION = struct.Struct("!QQI")


@dataclass(frozen=True)
class RemoteRegion:
    """Where a peer may read or write: address, length and the rkey (DAT_RMR_TRIPLET)."""

    address: int
    length: int
    rmr_context: int

    def to_bytes(self) -> bytes:
        """20 bytes, network order: address, length, rmr_context (fits in private data)."""
        return _REGION.pack(self.address, self.length, self.rmr_context)

    @classmethod
    def from_bytes(cls, data: bytes) -> "RemoteRegion":
        """Parse what :meth:`to_bytes` produced (extra trailing bytes are ignored)."""
        if len(data) < _REGION.size:
            raise InvalidParameter(f"a RemoteRegion needs {_REGION.size} bytes, got {len(data)}")
        return cls(*_REGION.unpack_from(data))

    def __getitem__(self, key: slice) -> "RemoteRegion":
        if not isinstance(key, slice):
            raise TypeError("RemoteRegion supports slicing only")
        start, stop, step = key.indices(self.length)
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

    def __init__(self, pz: "PZ", buffer: Any, privileges: Optional[Privileges] = None) -> None:
        pz._check()
        privileges = Privileges.DEFAULT if privileges is None else Privileges(privileges)
        try:
            view = memoryview(buffer)
        except TypeError:
            raise InvalidParameter(
                f"cannot register a {type(buffer).__name__}: it does not support the buffer protocol"
            ) from None
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
        super().__init__(pz)
        self._pz = pz
        self._view = view
        self._cdata = cdata  # holds the buffer export: the buffer cannot be resized or freed
        self._mr = mr
        self._inflight = 0
        self.privileges = privileges
        #: the local key (lkey) and remote key (rkey) of the registration
        self.lmr_context: int = mr.lkey
        self.rmr_context: int = mr.rkey
        self.address: int = int(ffi.cast("uintptr_t", cdata))
        self.length: int = length

    @property
    def pz(self) -> "PZ":
        """The PZ the LMR belongs to."""
        return self._pz

    def __getitem__(self, key: slice) -> Segment:
        self._check()
        if not isinstance(key, slice):
            raise TypeError("index an LMR with a slice, e.g. lmr[0:64]")
        start, stop, step = key.indices(self.length)
        if step != 1:
            raise InvalidParameter("LMR segments must be contiguous (step 1)")
        return Segment(self, start, max(0, stop - start))

    def __len__(self) -> int:
        return self.length

    def segment(self, offset: int = 0, length: Optional[int] = None) -> Segment:
        """The ``length`` bytes at ``offset`` (to the end by default), checked against the LMR."""
        self._check()
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise LengthError(f"segment [{offset}, {offset}+{length}) is outside the LMR of {self.length} bytes")
        return Segment(self, offset, length)

    def memoryview(self) -> memoryview:
        """The registered bytes (a byte-format view of the buffer)."""
        self._check()
        return self._view.cast("B") if self._view.format != "B" or self._view.ndim != 1 else self._view

    def remote(self) -> RemoteRegion:
        """The whole LMR as a region a peer can target with RDMA."""
        self._check()
        return RemoteRegion(self.address, self.length, self.rmr_context)

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
        """Deregister (dat_lmr_free); refused while posted requests still use the memory."""
        self._check()
        self._refuse_close_while(self._inflight > 0, f"{self._inflight} posted request(s) still use it")
        self.close()

    def _release(self) -> None:
        if self._mr != ffi.NULL:
            lib.ibv_dereg_mr(self._mr)
            self._mr = ffi.NULL
        cdata, self._cdata = self._cdata, None
        if cdata is not None:
            ffi.release(cdata)  # end the buffer export now, not at garbage collection
        self._view.release()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<aiodat.LMR {self.length} bytes at {self.address:#x}{state}>"
