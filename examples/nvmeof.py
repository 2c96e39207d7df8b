"""NVMe over Fabrics host (RDMA transport) written with aiodat, for the Linux kernel's target.

    python examples/nvmeof.py --address 169.254.77.1 --port 4420 --subnqn nqn.2026-01.io.example:disk

This is the host side of NVMe/RDMA (the NVM Express RDMA Transport Specification and
NVMe over Fabrics), enough of it to find a namespace and move blocks:

1. **Queues are RC connections.**  The admin queue (qid 0) and one I/O queue (qid 1)
   are each an aiodat endpoint connected with rdma_cm.  The CM request carries the
   transport binding's private data, ``struct nvme_rdma_cm_req`` (32 bytes,
   little-endian): ``recfmt`` 0, ``qid``, ``hrqsize`` (how many responses the host can
   receive) and ``hsqsize`` (the submission queue size, 0's based), then 24 reserved
   bytes.  The target accepts with ``nvme_rdma_cm_rep`` (``recfmt``, ``crqsize``: the
   commands it can receive) or rejects with ``nvme_rdma_cm_rej`` (``recfmt``, ``sts``).
   aiodat's private data is raw, so these structs are exactly what crosses the CM.
2. **Commands are sends, completions are receives.**  Each command is a 64-byte
   submission queue entry (SQE) sent with ``ep.post_send``; each completion is a
   16-byte completion queue entry (CQE) that arrives in a receive the host posted
   beforehand.  A CQE names its command by command id; a task per queue (the "reaper")
   takes completions off the queue's EVD, re-posts the receive and wakes the command's
   waiter.  Several commands can be in flight on a queue.
3. **Data never travels in the capsule here.**  A command that moves data carries a
   *keyed SGL data block descriptor* (type 0x4, subtype 0x0: address, 24-bit length and
   the rkey of memory registered with aiodat).  The target moves the data itself: an
   RDMA READ of host memory for data going to the controller (Connect data, Write), an
   RDMA WRITE into host memory for data coming back (Identify, Read), before it sends
   the CQE.  Subtype 0xF would ask the target to invalidate the rkey with
   SEND_WITH_INVALIDATE; that is for fast-registered MRs, and these are plain LMRs.
4. **The controller comes up through Fabrics commands (opcode 0x7F).**  Connect on the
   admin queue (fctype 0x01, controller id 0xFFFF: "any") creates the controller and
   returns its cntlid; Property Get CAP, Property Set CC (EN=1, IOSQES=6, IOCQES=4),
   Property Get CSTS until RDY=1 enable it.  Identify Controller and Identify
   Namespace describe it; the I/O queue's Connect names the cntlid; then NVM Write
   (0x01), Flush and Read (0x02) move blocks.  Closing shuts the controller down
   (CC.SHN) and disconnects both queues.

Every SQE has byte 1 = 0x40 (PSDT: SGLs), which the kernel target checks on every
command, and every dptr is a keyed descriptor, even with length 0: an all-zero dptr is
an (unkeyed, invalid here) data block descriptor.  Keep-alive is off (KATO 0).

Run it against a target set up through configfs (tests/test_nvmeof.py does that in the
test bed) with ``aiodat rxe run -- python examples/nvmeof.py ...``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import struct
import sys
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import aiodat
from aiodat import DTOOp, EPAttr, EvdFlags, Privileges, Segment

# ---------------------------------------------------------------- wire formats
SQE_SIZE, CQE_SIZE = 64, 16
ADMIN_DEPTH = 32                       # NVME_AQ_DEPTH: the admin queue the Fabrics spec sizes
PSDT_SGL = 0x40                        # SQE byte 1: data pointer is an SGL (NVME_CMD_SGL_METABUF)
KEYED_SGL_DATA = 0x40                  # SGL identifier: keyed data block (0x4 << 4), subtype address (0x0)
CM_REQ = struct.Struct("<HHHH24x")     # nvme_rdma_cm_req: recfmt, qid, hrqsize, hsqsize, reserved
CM_REP = struct.Struct("<HH")          # nvme_rdma_cm_rep: recfmt, crqsize (then 28 reserved bytes)
CM_REJ = struct.Struct("<HH")          # nvme_rdma_cm_rej: recfmt, sts
CQE = struct.Struct("<QHHHH")          # result, sq_head, sq_id, command_id, status
CM_REJECT_STATUS = {1: "invalid length", 2: "invalid record format", 3: "invalid queue ID",
                    4: "invalid host SQ size", 5: "invalid host RQ size", 6: "no resources",
                    7: "invalid IRD", 8: "invalid ORD"}

OPC_FLUSH, OPC_WRITE, OPC_READ, OPC_IDENTIFY, OPC_FABRICS = 0x00, 0x01, 0x02, 0x06, 0x7F
FCTYPE_PROPERTY_SET, FCTYPE_CONNECT, FCTYPE_PROPERTY_GET = 0x00, 0x01, 0x04
REG_CAP, REG_CC, REG_CSTS = 0x00, 0x14, 0x1C          # controller properties (registers)
CC_EN, CC_SHN_NORMAL, CC_IOSQES, CC_IOCQES = 1, 1 << 14, 6 << 16, 4 << 20
CSTS_RDY, CSTS_CFS, CSTS_SHST_MASK, CSTS_SHST_DONE = 1, 2, 3 << 2, 2 << 2
CONNECT_DATA_SIZE, IDENTIFY_SIZE = 1024, 4096


class NvmeofError(Exception):
    """A queue could not connect, or a command failed or timed out."""


class QueueRejected(NvmeofError):
    """The target rejected a queue's connection with an nvme_rdma_cm_rej."""

    def __init__(self, qid: int, recfmt: int, sts: int) -> None:
        self.qid, self.recfmt, self.sts = qid, recfmt, sts
        super().__init__(f"queue {qid}: the target rejected the connection: sts {sts} "
                         f"({CM_REJECT_STATUS.get(sts, 'unknown')}), recfmt {recfmt}")


class CommandFailed(NvmeofError):
    """A completion carried a non-zero status."""

    def __init__(self, what: str, cqe: "Completion") -> None:
        self.cqe = cqe
        super().__init__(f"{what} failed: status type {cqe.sct:#x} code {cqe.sc:#04x}"
                         f"{' (do not retry)' if cqe.dnr else ''}, result {cqe.result:#x}")


@dataclass(frozen=True)
class Completion:
    """A 16-byte CQE: ``result`` (command specific), the SQ head, the command id and the status."""

    result: int
    sq_head: int
    sq_id: int
    command_id: int
    status: int                        # bit 0 is the phase tag, unused on fabrics

    @classmethod
    def parse(cls, raw: bytes) -> "Completion":
        return cls(*CQE.unpack(raw))

    @property
    def sc(self) -> int:               # status code
        return (self.status >> 1) & 0xFF

    @property
    def sct(self) -> int:              # status code type
        return (self.status >> 9) & 0x7

    @property
    def dnr(self) -> bool:
        return bool(self.status >> 15)


def sqe(opcode: int, *, nsid: int = 0, fctype: Optional[int] = None, **dwords: int) -> bytearray:
    """A 64-byte SQE.  Command id and data pointer are filled in by :meth:`Queue.submit`.

    ``dwords`` name command-specific fields by offset: ``u8_40=1`` puts a byte at 40,
    ``u16_42``, ``u32_44``, ``u64_48`` little-endian fields likewise.
    """
    entry = bytearray(SQE_SIZE)
    entry[0], entry[1] = opcode, PSDT_SGL
    if fctype is None:
        struct.pack_into("<I", entry, 4, nsid)
    else:
        entry[4] = fctype              # Fabrics commands keep their type where nsid would be
    for name, value in dwords.items():
        kind, offset = name.split("_")
        struct.pack_into({"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q"}[kind], entry, int(offset), value)
    return entry


def connect_command(qid: int, sqsize: int) -> bytearray:
    """Fabrics Connect: recfmt 0, qid, sqsize (0's based), cattr 0, kato 0 (no keep-alive)."""
    return sqe(OPC_FABRICS, fctype=FCTYPE_CONNECT, u16_40=0, u16_42=qid, u16_44=sqsize, u8_46=0, u32_48=0)


def connect_data(hostid: uuid.UUID, cntlid: int, subnqn: str, hostnqn: str) -> bytes:
    """struct nvmf_connect_data (1024 bytes): hostid, cntlid, then the two NQNs at 256 and 512."""
    data = bytearray(CONNECT_DATA_SIZE)
    data[0:16] = hostid.bytes
    struct.pack_into("<H", data, 16, cntlid)
    for offset, nqn in ((256, subnqn), (512, hostnqn)):
        raw = nqn.encode()
        if len(raw) > 255:
            raise ValueError(f"NQN longer than 255 bytes: {nqn!r}")
        data[offset:offset + len(raw)] = raw
    return bytes(data)


def property_get(offset: int, size: int) -> bytearray:
    """Property Get: attrib bit 0 is the size (0: 4 bytes, 1: 8 bytes)."""
    return sqe(OPC_FABRICS, fctype=FCTYPE_PROPERTY_GET, u8_40=1 if size == 8 else 0, u32_44=offset)


def property_set(offset: int, value: int) -> bytearray:
    return sqe(OPC_FABRICS, fctype=FCTYPE_PROPERTY_SET, u8_40=0, u32_44=offset, u64_48=value)


def identify(cns: int, nsid: int = 0) -> bytearray:
    return sqe(OPC_IDENTIFY, nsid=nsid, u8_40=cns)


def read_write(opcode: int, nsid: int, slba: int, blocks: int) -> bytearray:
    """NVM Read or Write: starting LBA (cdw10-11) and the number of blocks, 0's based (cdw12)."""
    return sqe(opcode, nsid=nsid, u64_40=slba, u16_48=blocks - 1)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", "replace").strip()


@dataclass(frozen=True)
class ControllerInfo:
    """A few fields of the 4096-byte Identify Controller data structure."""

    vid: int
    serial: str
    model: str
    firmware: str
    mdts: int                          # max transfer: 2**mdts minimum-size pages (0: no limit)
    cntlid: int
    version: str
    namespaces: int                    # NN
    subnqn: str
    ioccsz: int                        # I/O command capsule size, in 16-byte units
    iorcsz: int                        # I/O response capsule size, in 16-byte units

    @classmethod
    def parse(cls, data: bytes) -> "ControllerInfo":
        ver = struct.unpack_from("<I", data, 80)[0]
        return cls(vid=struct.unpack_from("<H", data, 0)[0], serial=_text(data[4:24]), model=_text(data[24:64]),
                   firmware=_text(data[64:72]), mdts=data[77], cntlid=struct.unpack_from("<H", data, 78)[0],
                   version=f"{ver >> 16}.{(ver >> 8) & 0xFF}.{ver & 0xFF}",
                   namespaces=struct.unpack_from("<I", data, 516)[0], subnqn=_text(data[768:1024]),
                   ioccsz=struct.unpack_from("<I", data, 1792)[0], iorcsz=struct.unpack_from("<I", data, 1796)[0])


@dataclass(frozen=True)
class NamespaceInfo:
    """A few fields of Identify Namespace: size, capacity, and the LBA format in use."""

    nsze: int                          # size in logical blocks
    ncap: int
    lba_format: int                    # FLBAS bits 0-3: which of the LBA formats is in use
    block_size: int                    # 2**LBADS of that format
    metadata_size: int

    @classmethod
    def parse(cls, data: bytes) -> "NamespaceInfo":
        nsze, ncap = struct.unpack_from("<QQ", data, 0)
        fmt = data[26] & 0x0F
        ms, lbads = struct.unpack_from("<HB", data, 128 + 4 * fmt)
        return cls(nsze, ncap, fmt, 1 << lbads, ms)


# ---------------------------------------------------------------- one queue: one RC endpoint
class Queue:
    """An NVMe submission/completion queue pair carried by one aiodat RC endpoint.

    SQEs go out of a registered array of ``depth`` 64-byte slots (slot = command id);
    CQEs land in ``depth`` 16-byte receive slots.  One EVD takes both the send and the
    receive completions of the endpoint, and the reaper task drains it.
    """

    def __init__(self, ia: aiodat.IA, pz: aiodat.PZ, qid: int, depth: int) -> None:
        self.qid, self.depth = qid, depth
        self.evd = ia.create_evd(2 * depth + 4, EvdFlags.DTO)
        self.ep = ia.create_ep(pz, recv_evd=self.evd, request_evd=self.evd,
                               attrs=EPAttr(max_recv_dtos=depth, max_request_dtos=depth))
        self.sq = pz.register(bytearray(depth * SQE_SIZE))                      # sent from: local access only
        self.cq = pz.register(bytearray(depth * CQE_SIZE), Privileges.LOCAL_WRITE)
        for slot in range(depth):      # every response slot posted before the first command
            self.ep.post_recv(self._cqe_slot(slot), cookie=slot)
        self.crqsize = 0
        self._free = list(range(depth - 1, -1, -1))       # command ids (and SQE slots) not in use
        self._room = asyncio.Semaphore(depth - 1)         # an NVMe queue of N entries holds N-1
        self._waiting: Dict[int, "asyncio.Future[Completion]"] = {}
        self._reaper: Optional["asyncio.Task[None]"] = None
        self._broken: Optional[BaseException] = None

    def _cqe_slot(self, slot: int) -> Segment:
        return self.cq[slot * CQE_SIZE:(slot + 1) * CQE_SIZE]

    def cm_request(self) -> bytes:
        """nvme_rdma_cm_req: hrqsize = depth receives posted, hsqsize = depth - 1 (0's based)."""
        return CM_REQ.pack(0, self.qid, self.depth, self.depth - 1)

    async def connect(self, address: str, port: int, timeout: float = 30.0) -> None:
        try:
            reply = await self.ep.connect(address, port, self.cm_request(), timeout=timeout)
        except aiodat.ConnectionRejected as exc:
            if isinstance(exc, aiodat.NonPeerRejected):  # nothing listening: no NVMe reject to decode
                raise NvmeofError(f"queue {self.qid}: nothing listens on {address}:{port} ({exc})") from exc
            raise QueueRejected(self.qid, *CM_REJ.unpack_from(exc.private_data)) from exc
        recfmt, self.crqsize = CM_REP.unpack_from(reply)   # the CM padded the 32 bytes to 196
        if recfmt != 0 or self.crqsize < self.depth - 1:
            await self.ep.disconnect()
            raise NvmeofError(f"queue {self.qid}: unexpected nvme_rdma_cm_rep recfmt {recfmt} crqsize {self.crqsize}")
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Route each CQE to the command waiting for its id; re-post its receive at once."""
        try:
            while True:
                for event in await self.evd.wait():
                    if not event.ok:   # a failed send or receive: the connection is broken
                        op = event.operation.value if event.operation else "request"
                        raise aiodat.DTOError(f"queue {self.qid}: {op} {event.status}", status=event.status)
                    if event.operation is not DTOOp.RECV:
                        continue       # a send completed: nothing to do, its slot is freed by the CQE
                    slot = self._cqe_slot(event.cookie)
                    cqe = Completion.parse(bytes(slot.memoryview()))
                    self.ep.post_recv(slot, cookie=event.cookie)
                    waiter = self._waiting.pop(cqe.command_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(cqe)
        except BaseException as exc:   # flushed by our disconnect, a broken connection, or close()
            self._broken = exc
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(NvmeofError(f"queue {self.qid} stopped: {exc!r}"))
            if not isinstance(exc, aiodat.DTOError):
                raise                  # cancellation goes on; anything else is a bug to see

    async def submit(self, command: bytearray, data: Optional[Segment] = None, what: str = "command",
                     timeout: float = 30.0) -> Completion:
        """Send one SQE and await its CQE.  ``data``: the registered memory the target will read
        or write (its address, length and rkey go into the keyed SGL descriptor)."""
        async with self._room:
            if self._broken is not None:
                raise NvmeofError(f"queue {self.qid} is not usable: {self._broken!r}")
            cid = self._free.pop()
            struct.pack_into("<H", command, 2, cid)
            address, length, rkey = (data.address, data.length, data.lmr.rmr_context) if data else (0, 0, 0)
            if length >= 1 << 24:
                raise ValueError("a keyed SGL data block describes at most 16 MiB - 1")
            struct.pack_into("<Q", command, 24, address)
            command[32:35] = length.to_bytes(3, "little")
            struct.pack_into("<IB", command, 35, rkey, KEYED_SGL_DATA)
            slot = self.sq[cid * SQE_SIZE:(cid + 1) * SQE_SIZE]
            slot.memoryview()[:] = command
            waiter = self._waiting[cid] = asyncio.get_running_loop().create_future()
            self.ep.post_send(slot, cookie=cid)
            try:
                cqe = await asyncio.wait_for(waiter, timeout)
            except asyncio.TimeoutError:
                self._waiting.pop(cid, None)   # the id stays out of use: a late CQE must not match
                raise NvmeofError(f"queue {self.qid}: {what} (command id {cid}) timed out after {timeout}s")
            self._free.append(cid)
        if cqe.sc or cqe.sct:
            raise CommandFailed(what, cqe)
        return cqe

    async def close(self) -> None:
        if self.ep.state is aiodat.EPState.CONNECTED:
            await self.ep.disconnect()     # the DREQ flushes the receives: the reaper stops
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for handle in (self.ep, self.sq, self.cq, self.evd):
            handle.close()


# ---------------------------------------------------------------- the controller
class NvmeofHost:
    """One host connection to one NVM subsystem: an admin queue and one I/O queue."""

    def __init__(self, ia: aiodat.IA, subnqn: str, hostnqn: Optional[str] = None,
                 hostid: Optional[uuid.UUID] = None, io_depth: int = 32, timeout: float = 30.0) -> None:
        self.ia, self.subnqn, self.timeout, self.io_depth = ia, subnqn, timeout, io_depth
        self.hostid = hostid or uuid.uuid4()
        self.hostnqn = hostnqn or f"nqn.2014-08.org.nvmexpress:uuid:{self.hostid}"
        self.pz = ia.create_pz()
        # what the target reads (connect data) and what it writes (identify data): the
        # privileges say which way the target's RDMA goes
        self._connect_data = self.pz.register(bytearray(CONNECT_DATA_SIZE), Privileges.REMOTE_READ)
        self._identify = self.pz.register(bytearray(IDENTIFY_SIZE), Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE)
        self.admin = Queue(ia, self.pz, 0, ADMIN_DEPTH)
        self.io: Optional[Queue] = None
        self.cntlid = 0xFFFF
        self.cap = 0
        self.controller: Optional[ControllerInfo] = None

    async def connect(self, address: str, port: int) -> None:
        """Admin queue, controller enable, Identify Controller, then the I/O queue."""
        await self.admin.connect(address, port, self.timeout)
        self.cntlid = await self._fabrics_connect(self.admin)
        await self.enable()
        self.controller = await self.identify_controller()
        self.io = Queue(self.ia, self.pz, 1, self.io_depth)
        await self.io.connect(address, port, self.timeout)
        await self._fabrics_connect(self.io)

    async def _fabrics_connect(self, queue: Queue) -> int:
        """Connect the NVMe queue on an established RDMA connection; returns the controller id.
        The target fetches the 1024 bytes of connect data with an RDMA READ of our LMR."""
        self._connect_data.memoryview()[:] = connect_data(self.hostid, self.cntlid, self.subnqn, self.hostnqn)
        self._connect_data.sync_rdma_read()
        cqe = await queue.submit(connect_command(queue.qid, queue.depth - 1), self._connect_data[0:CONNECT_DATA_SIZE],
                                 f"Connect (qid {queue.qid})", self.timeout)
        return cqe.result & 0xFFFF

    async def get_property(self, offset: int, size: int = 4) -> int:
        cqe = await self.admin.submit(property_get(offset, size), None, f"Property Get {offset:#x}", self.timeout)
        return cqe.result & (0xFFFFFFFF if size == 4 else 0xFFFFFFFFFFFFFFFF)

    async def set_property(self, offset: int, value: int) -> None:
        await self.admin.submit(property_set(offset, value), None, f"Property Set {offset:#x}", self.timeout)

    async def enable(self) -> None:
        """CC.EN=1 with 4 KiB pages, the NVM command set and 64/16-byte I/O queue entries; then
        wait (CAP.TO, in 500 ms units, bounds it) for CSTS.RDY."""
        self.cap = await self.get_property(REG_CAP, 8)
        if not self.cap >> 37 & 1:
            raise NvmeofError(f"the controller does not offer the NVM command set (CAP {self.cap:#x})")
        await self.set_property(REG_CC, CC_IOSQES | CC_IOCQES | CC_EN)   # CSS 0 (NVM), MPS 0 (4 KiB), AMS 0
        await self._wait_status(CSTS_RDY, CSTS_RDY, "ready (CSTS.RDY=1)")

    async def _wait_status(self, mask: int, value: int, what: str) -> int:
        deadline = asyncio.get_running_loop().time() + max(self.timeout, (self.cap >> 24 & 0xFF) * 0.5)
        while True:
            csts = await self.get_property(REG_CSTS)
            if csts & CSTS_CFS:
                raise NvmeofError(f"controller fatal status while waiting to be {what} (CSTS {csts:#x})")
            if csts & mask == value:
                return csts
            if asyncio.get_running_loop().time() > deadline:
                raise NvmeofError(f"the controller did not become {what} in time (CSTS {csts:#x})")
            await asyncio.sleep(0.05)

    async def identify_controller(self) -> ControllerInfo:
        """CNS 1: the target RDMA-writes 4096 bytes into our identify LMR, then sends the CQE."""
        await self.admin.submit(identify(1), self._identify[0:IDENTIFY_SIZE], "Identify Controller", self.timeout)
        self._identify.sync_rdma_write()
        return ControllerInfo.parse(bytes(self._identify.memoryview()))

    async def identify_namespace(self, nsid: int = 1) -> NamespaceInfo:
        await self.admin.submit(identify(0, nsid), self._identify[0:IDENTIFY_SIZE], f"Identify Namespace {nsid}",
                                self.timeout)
        self._identify.sync_rdma_write()
        return NamespaceInfo.parse(bytes(self._identify.memoryview()))

    def _io(self) -> Queue:
        if self.io is None:
            raise NvmeofError("the I/O queue is not connected")
        return self.io

    async def write(self, nsid: int, slba: int, blocks: int, data: Segment) -> None:
        """NVM Write: the target pulls ``data`` (REMOTE_READ) with RDMA READ."""
        await self._io().submit(read_write(OPC_WRITE, nsid, slba, blocks), data, f"Write LBA {slba}+{blocks}",
                                self.timeout)

    async def read(self, nsid: int, slba: int, blocks: int, into: Segment) -> None:
        """NVM Read: the target pushes the blocks into ``into`` (REMOTE_WRITE) with RDMA WRITE."""
        await self._io().submit(read_write(OPC_READ, nsid, slba, blocks), into, f"Read LBA {slba}+{blocks}",
                                self.timeout)
        into.lmr.sync_rdma_write()

    async def flush(self, nsid: int) -> None:
        await self._io().submit(sqe(OPC_FLUSH, nsid=nsid), None, "Flush", self.timeout)

    async def shutdown(self) -> None:
        """Normal shutdown: CC.SHN=01, then CSTS.SHST=10 (shutdown processing complete)."""
        cc = await self.get_property(REG_CC)
        await self.set_property(REG_CC, cc | CC_SHN_NORMAL)
        await self._wait_status(CSTS_SHST_MASK, CSTS_SHST_DONE, "shut down (CSTS.SHST=10b)")

    async def close(self) -> None:
        """Shut the controller down if it is up, then disconnect the I/O queue and the admin queue."""
        try:
            if self.controller is not None and self.admin._broken is None:
                await self.shutdown()
        finally:
            for queue in (self.io, self.admin):
                if queue is not None:
                    await queue.close()
            self.pz.close()


# ---------------------------------------------------------------- the demonstration
@dataclass
class Report:
    """What :func:`main` found and did (the test checks it)."""

    cntlid: int = 0
    admin_crqsize: int = 0
    io_crqsize: int = 0
    controller: Optional[ControllerInfo] = None
    namespace: Optional[NamespaceInfo] = None
    blocks_written: int = 0
    verified: bool = False
    lines: List[str] = field(default_factory=list)


def pattern(size: int, seed: int) -> bytes:
    """Reproducible bytes that differ every 16 bytes (seed, offset), so a misplaced block shows."""
    return b"".join(struct.pack("<QQ", seed, i) for i in range(size // 16))


async def main(address: str, port: int, subnqn: str, *, device: Optional[str] = None, nsid: int = 1,
               slba: int = 8, blocks: int = 8, commands: int = 4, timeout: float = 30.0,
               echo: bool = True) -> Report:
    """Connect, identify, write ``blocks`` blocks at ``slba`` as ``commands`` concurrent Writes, read
    them back with one Read and compare; then shut down and disconnect."""
    report = Report()

    def say(line: str) -> None:
        report.lines.append(line)
        if echo:
            print(line, flush=True)

    with aiodat.open_ia(device or default_device()) as ia:
        host = NvmeofHost(ia, subnqn, timeout=timeout)
        try:
            await host.connect(address, port)
            report.cntlid, report.controller = host.cntlid, host.controller
            report.admin_crqsize, report.io_crqsize = host.admin.crqsize, host._io().crqsize
            ctrl = host.controller
            assert ctrl is not None
            say(f"admin queue: crqsize {host.admin.crqsize}; controller {host.cntlid} for {host.hostnqn}")
            say(f"CAP {host.cap:#018x}: MQES {(host.cap & 0xFFFF) + 1}, timeout {(host.cap >> 24 & 0xFF) * 500} ms; "
                "enabled (CSTS.RDY=1)")
            say(f"identify controller: model {ctrl.model!r} serial {ctrl.serial!r} firmware {ctrl.firmware!r} "
                f"NVMe {ctrl.version}, {ctrl.namespaces} namespace(s), subnqn {ctrl.subnqn}")
            ns = report.namespace = await host.identify_namespace(nsid)
            say(f"namespace {nsid}: {ns.nsze} blocks of {ns.block_size} bytes (LBA format {ns.lba_format})")
            say(f"I/O queue: crqsize {host._io().crqsize}")
            if slba + blocks > ns.nsze or blocks % commands:
                raise NvmeofError(f"cannot write {blocks} blocks at {slba} in {commands} commands "
                                  f"on a namespace of {ns.nsze}")
            size, per = blocks * ns.block_size, blocks // commands
            source = bytearray(pattern(size, slba))
            out = host.pz.register(source, Privileges.REMOTE_READ)                    # the target reads it
            back = host.pz.register(bytearray(size), Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE)
            out.sync_rdma_read()
            step = per * ns.block_size
            await asyncio.gather(*(host.write(nsid, slba + i * per, per, out[i * step:(i + 1) * step])
                                   for i in range(commands)))
            await host.flush(nsid)
            report.blocks_written = blocks
            say(f"wrote {blocks} blocks at LBA {slba} in {commands} concurrent Writes (target RDMA READ)")
            await host.read(nsid, slba, blocks, back[0:size])
            report.verified = bytes(back.memoryview()) == bytes(source)
            say(f"read {blocks} blocks back (target RDMA WRITE): "
                f"{'data verified' if report.verified else 'DATA DIFFERS'}")
        finally:
            await host.close()
        say("controller shut down, both queues disconnected")
    return report


def default_device() -> str:
    """$AIODAT_RXE_DEVICE (set by `aiodat rxe run`) or the first RDMA device."""
    providers = aiodat.list_providers()
    if not os.environ.get("AIODAT_RXE_DEVICE") and not providers:
        raise SystemExit("no RDMA device here; try: aiodat rxe run -- python examples/nvmeof.py ...")
    return os.environ.get("AIODAT_RXE_DEVICE") or providers[0].name


def cli(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("AIODAT_RXE_ADDR"), help="the target's RDMA address")
    parser.add_argument("--port", type=int, default=4420, help="the target's port (trsvcid)")
    parser.add_argument("--subnqn", required=True, help="the subsystem NQN")
    parser.add_argument("--device", default=None, help="RDMA device (default: $AIODAT_RXE_DEVICE or the first)")
    parser.add_argument("--nsid", type=int, default=1)
    parser.add_argument("--slba", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--commands", type=int, default=4, help="concurrent Write commands")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("--address is needed (or run under `aiodat rxe run`, which sets AIODAT_RXE_ADDR)")
    coro = main(args.address, args.port, args.subnqn, device=args.device, nsid=args.nsid, slba=args.slba,
                blocks=args.blocks, commands=args.commands)
    try:
        if args.loop == "uvloop":
            import uvloop

            report = uvloop.run(coro)
        else:
            report = asyncio.run(coro)
    except NvmeofError as exc:
        print(f"nvmeof: {exc}", file=sys.stderr)
        return 1
    return 0 if report.verified else 1


if __name__ == "__main__":
    sys.exit(cli())
