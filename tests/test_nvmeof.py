"""Issue 12: examples/nvmeof.py, an NVMe over Fabrics host written with aiodat, against the
Linux kernel's own target (nvmet + nvmet-rdma) on the same rxe device.

The ``nvmet_target`` fixture configures the target through configfs, as an administrator
would: a subsystem that admits any host, namespace 1 backed by a file (buffered I/O, so a
file on tmpfs works), and an RDMA port on the test bed's address with the subsystem linked
into it.  It removes all of it again in reverse order, so the suite can run twice in one
guest (asyncio, then uvloop).  Without the modules or configfs the tests fail under
AIODAT_REQUIRE_DEVICE=1 (CI) and skip elsewhere.

Nobody here wrote the peer: every byte of the CM private data, the capsules and the SGL
descriptors has to be what the NVMe/RDMA transport binding says, or the kernel refuses.
The blocks written are checked twice: read back through the target, and in the backing
file itself.
"""
from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import platform
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, List

import pytest

import aiodat

pytestmark = pytest.mark.rxe

T = 60.0  # per command and per connect: the guest runs under TCG
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "nvmeof.py"
CONFIGFS = Path("/sys/kernel/config")
NVMET = CONFIGFS / "nvmet"
NAMESPACE_BYTES = 16 << 20
_ports = itertools.count(24420 + os.getpid() % 500 * 10)
_serial = itertools.count(1)


def unavailable(why: str) -> None:
    """Fail in CI (AIODAT_REQUIRE_DEVICE=1: the test bed must have the target), skip elsewhere."""
    if os.environ.get("AIODAT_REQUIRE_DEVICE") == "1":
        pytest.fail(f"the kernel NVMe-oF target is not usable here: {why}")
    pytest.skip(f"the kernel NVMe-oF target is not usable here: {why}")


def dmesg_tail(lines: int = 40) -> str:
    """The kernel's last words: nvmet says why it refused a connection or a command."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(dmesg: {exc})"
    return "\n".join(out.splitlines()[-lines:])


@pytest.fixture(scope="module")
def nvmeof() -> ModuleType:
    """examples/nvmeof.py, imported (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("nvmeof_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Target:
    address: str
    port: int
    subnqn: str
    backing: Path


def _write(path: Path, value: str) -> None:
    path.write_text(value + "\n")


def _load_modules() -> None:
    modules = Path("/lib/modules") / platform.release()
    for name in ("nvmet", "nvmet-rdma"):
        done = subprocess.run(["modprobe", name], capture_output=True, text=True)
        if done.returncode:
            present = sorted(p.name for p in (modules / "kernel/drivers/nvme/target").glob("*.ko*"))
            unavailable(f"`modprobe {name}` failed ({done.stderr.strip()}); {modules}/kernel/drivers/nvme/target "
                        f"holds {present or 'nothing'}")
    if not NVMET.is_dir():
        if CONFIGFS.is_dir() and not os.path.ismount(CONFIGFS):
            done = subprocess.run(["mount", "-t", "configfs", "configfs", str(CONFIGFS)], capture_output=True, text=True)
            if done.returncode:
                unavailable(f"cannot mount configfs on {CONFIGFS}: {done.stderr.strip()}")
    if not NVMET.is_dir():
        unavailable(f"{NVMET} does not exist after loading nvmet (configfs mounted: {os.path.ismount(CONFIGFS)})")


@pytest.fixture
def nvmet_target(rdma_device: Any, tmp_path: Path) -> Iterator[Target]:
    """A subsystem with one file-backed namespace, exported on an RDMA port of rdma_device's address."""
    if os.geteuid() != 0:
        unavailable("configuring nvmet through configfs needs root (the test bed's guest runs as root)")
    _load_modules()
    undo: List[Callable[[], None]] = []
    subnqn = f"nqn.2026-01.io.aiodat:test-{os.getpid()}-{next(_serial)}"
    port_id = next(i for i in itertools.count(1) if not (NVMET / "ports" / str(i)).exists())
    backing = tmp_path / "namespace1.img"
    try:
        with open(backing, "wb") as f:
            f.truncate(NAMESPACE_BYTES)
        undo.append(backing.unlink)
        subsys = NVMET / "subsystems" / subnqn
        subsys.mkdir()
        undo.append(subsys.rmdir)
        _write(subsys / "attr_allow_any_host", "1")
        ns = subsys / "namespaces" / "1"
        ns.mkdir()
        undo.append(ns.rmdir)
        _write(ns / "device_path", str(backing))
        _write(ns / "buffered_io", "1")  # tmpfs has no O_DIRECT on 6.1
        _write(ns / "enable", "1")
        undo.append(lambda: _write(ns / "enable", "0"))
        port = NVMET / "ports" / str(port_id)
        port.mkdir()
        undo.append(port.rmdir)
        tcp_port = next(_ports)
        for name, value in (("addr_trtype", "rdma"), ("addr_adrfam", "ipv4"),
                            ("addr_traddr", rdma_device.address), ("addr_trsvcid", str(tcp_port))):
            _write(port / name, value)
        link = port / "subsystems" / subnqn
        link.symlink_to(subsys)  # enables the port: nvmet-rdma starts listening here
        undo.append(link.unlink)
        yield Target(rdma_device.address, tcp_port, subnqn, backing)
    finally:
        errors = []
        for step in reversed(undo):
            try:
                step()
            except OSError as exc:
                errors.append(f"{step}: {exc}")
        assert not errors, f"tearing the target down failed: {errors}\n{dmesg_tail()}"


async def test_host_writes_and_reads_back_through_kernel_target(nvmeof: ModuleType, nvmet_target: Target,
                                                                rdma_device: Any, loop_errors: List[dict]) -> None:
    """The whole flow of the example: both queues, enable, identify, 4 concurrent Writes, Read, verify."""
    t = nvmet_target
    try:
        report = await nvmeof.main(t.address, t.port, t.subnqn, device=rdma_device.name, slba=8, blocks=8,
                                   commands=4, timeout=T)
    except BaseException:
        print(dmesg_tail())
        raise
    # the CM exchange: nvmet_rdma_cm_rep's crqsize is hsqsize + 1 of our request
    assert report.admin_crqsize == 32 and report.io_crqsize == 32
    assert 1 <= report.cntlid <= 0xFFEF  # a dynamic controller id (NVME_CNTLID_MIN..MAX)
    ctrl, ns = report.controller, report.namespace
    assert ctrl.subnqn == t.subnqn and ctrl.cntlid == report.cntlid
    assert ctrl.model == "Linux" and ctrl.serial  # nvmet's default model; a random serial per subsystem
    assert ctrl.namespaces >= 1 and ctrl.ioccsz >= 4 and ctrl.iorcsz == 1  # 64-byte SQE, 16-byte CQE
    assert ns.block_size in (512, 4096) and ns.nsze * ns.block_size == NAMESPACE_BYTES
    assert report.blocks_written == 8 and report.verified, "\n".join(report.lines)
    # the target really stored them: the backing file holds the pattern at LBA 8
    size = 8 * ns.block_size
    with open(t.backing, "rb") as f:
        f.seek(8 * ns.block_size)
        on_disk = f.read(size)
    assert on_disk == nvmeof.pattern(size, 8)
    with open(t.backing, "rb") as f:
        assert f.read(8 * ns.block_size) == bytes(8 * ns.block_size)  # nothing strayed below it


async def test_target_rejects_an_oversized_admin_queue(nvmeof: ModuleType, nvmet_target: Target, ia: Any,
                                                       loop_errors: List[dict]) -> None:
    """hsqsize 32 on the admin queue is one more than NVME_AQ_DEPTH allows: the target rejects the
    CM request with nvme_rdma_cm_rej {recfmt 0, sts 4 (invalid host SQ size)}, decoded from
    ConnectionRejected.private_data."""
    pz = ia.create_pz()
    queue = nvmeof.Queue(ia, pz, qid=0, depth=33)
    assert queue.cm_request() == bytes.fromhex("0000 0000 2100 2000") + bytes(24)
    try:
        with pytest.raises(nvmeof.QueueRejected) as caught:
            await queue.connect(nvmet_target.address, nvmet_target.port, T)
    except BaseException:
        print(dmesg_tail())
        raise
    finally:
        await queue.close()
        pz.close()
    assert caught.value.recfmt == 0 and caught.value.sts == 4
    rejected = caught.value.__cause__  # the target's nvmet_rdma_cm_reject, not its CM: a peer reject
    assert isinstance(rejected, aiodat.ConnectionRejected) and not isinstance(rejected, aiodat.NonPeerRejected)
    assert rejected.private_data[:4] == b"\x00\x00\x04\x00" and rejected.private_data[4:] == bytes(144)


async def test_connect_to_unknown_subsystem_fails_with_nvme_status(nvmeof: ModuleType, nvmet_target: Target,
                                                                   rdma_device: Any, loop_errors: List[dict]) -> None:
    """The admin queue connects (the RDMA layer knows no NQNs), the Fabrics Connect command then
    completes with Connect Invalid Parameters (SCT 1, SC 0x82, DNR); the host disconnects cleanly."""
    unknown = f"nqn.2026-01.io.aiodat:missing-{uuid.uuid4()}"
    with pytest.raises(nvmeof.CommandFailed) as caught:
        await nvmeof.main(nvmet_target.address, nvmet_target.port, unknown, device=rdma_device.name, timeout=T,
                          echo=False)
    cqe = caught.value.cqe
    assert (cqe.sct, cqe.sc, cqe.dnr) == (1, 0x82, True), caught.value


async def test_cli(nvmet_target: Target, rdma_device: Any) -> None:
    """``python examples/nvmeof.py --address --port --subnqn`` on this test's loop, exit status 0."""
    t = nvmet_target
    loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), "--address", t.address, "--port", str(t.port), "--subnqn", t.subnqn,
        "--device", rdma_device.name, "--blocks", "16", "--commands", "8", "--loop", loop,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(ROOT))
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        if proc.returncode is None:
            proc.kill()
    text = out.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text}\n{dmesg_tail()}"
    for line in ("identify controller: model 'Linux'", "namespace 1: ", "in 8 concurrent Writes",
                 "data verified", "controller shut down, both queues disconnected"):
        assert line in text, text
