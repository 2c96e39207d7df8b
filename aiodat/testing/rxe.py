"""The rxe test bed: run a command where a Soft-RoCE (rxe) device is up.

Two ways, chosen by :func:`status`:

``native``
    We are root on a kernel that has (or can load) ``rdma_rxe``: load the
    modules, create a dummy netdev ``aiodat0`` with ``169.254.77.1/24``, add an
    rxe device on it, run the command, and remove what we created.

``qemu``
    Everywhere else (the usual case on development machines whose kernel has
    no RDMA at all): boot a throwaway QEMU guest with the distribution's own
    kernel (``/boot/vmlinuz-*``) over the host's ``/`` exported read-only via
    virtio-9p with a tmpfs overlay on top, bring rxe up inside, and run the
    command there.  The working directory is exported read-write and mounted
    at the same path, so results come back.  The command's stdout and stderr
    come back on two serial ports (``ttyS1``, ``ttyS2``); the kernel console
    (``ttyS0``) goes to a boot log that is printed only when something fails.

This module is pure standard library and imports nothing else from aiodat, so
it works before the C extension is built: ``python -m aiodat.testing.rxe``.
See docs/testbed.md.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import io
import json
import lzma
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "ADDR",
    "NETDEV",
    "EXIT_TIMEOUT",
    "EXIT_TESTBED_FAILED",
    "status",
    "format_status",
    "run",
    "main",
    "CpioWriter",
]

#: The IPv4 address the rxe device's netdev carries (link-local, never routed).
ADDR = "169.254.77.1"
PREFIXLEN = 24
#: The dummy netdev the rxe device is bound to.
NETDEV = "aiodat0"
#: rxe device name inside a QEMU guest (a fresh kernel: the name is ours).
GUEST_DEVICE = "rxe0"
#: rxe device name created on the host by the native path (beside any others).
NATIVE_DEVICE = "aiodat_rxe0"

#: Exit status when the deadline passed (as timeout(1)).
EXIT_TIMEOUT = 124
#: Exit status when the test bed itself failed (rxe not up, QEMU failed, ...):
#: the command did not run.
EXIT_TESTBED_FAILED = 125

#: Modules the first stage needs to mount 9p and overlayfs; their
#: dependencies are read from modules.dep.  The fallback order, for a module
#: directory without modules.dep, is the one verified by hand.
_STAGE1_TARGETS = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
_STAGE1_FALLBACK = (
    "virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
    "virtio_pci", "9pnet", "9pnet_virtio", "netfs", "fscache", "9p", "overlay",
)
_GUEST_MODULES = ("rdma_rxe", "ib_uverbs", "rdma_ucm", "dummy")
#: Extra modules in two-host guests: the virtio NIC and tc netem for faults.
_NIC_MODULES = ("virtio_net", "sch_netem")

#: Two-host runs (``--hosts 2``): the subnet, the addresses of host A (index
#: 0, runs the command) and host B (index 1, runs the agent), and where the
#: shared hosts directory is mounted in each guest.
HOSTS_SUBNET = "169.254.78"
HOST_ADDRS = ("169.254.78.1", "169.254.78.2")
HOST_MACS = ("52:54:00:ad:a7:01", "52:54:00:ad:a7:02")
GUEST_HOSTS_DIR = "/run/aiodat-hosts"
#: How long host A waits for host B's agent before giving up (seconds).
PEER_WAIT_S = 240
_MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")

_SBIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")

#: Debian package names for what the test bed uses, for the status report.
PACKAGES = {
    "qemu": "qemu-system-x86",
    "kernel": "linux-image-amd64",
    "busybox": "busybox-static",
    "iproute2": "iproute2",
    "kmod": "kmod",
    "rdma-core": "rdma-core",
    "ibverbs-providers": "ibverbs-providers",
    "libibverbs1": "libibverbs1",
    "librdmacm1": "librdmacm1",
    "ibverbs-utils": "ibverbs-utils",
    "rdmacm-utils": "rdmacm-utils",
    "perftest": "perftest",
}

_QEMU_TIMEOUT_MSG = "deadline of {:g} s passed {}; QEMU killed"
_FORMAT_VERSION = "1"  # bump when the initramfs layout or /init changes


# --------------------------------------------------------------------------
# small helpers

def _msg(text: str) -> None:
    """A message from the test bed itself, on the caller's stderr."""
    stream = sys.stderr
    try:
        stream.write(text if text.endswith("\n") else text + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _under(root: str, path: str) -> str:
    """``path`` (absolute) as seen under ``root``."""
    if root in ("", "/"):
        return path
    return os.path.join(root, path.lstrip("/"))


def _which(name: str, root: str = "/") -> Optional[str]:
    """Find an executable: on the real root also along $PATH; sbin always."""
    dirs: List[str] = []
    if root in ("", "/"):
        dirs.extend(p for p in os.environ.get("PATH", "").split(os.pathsep) if p)
    dirs.extend(_SBIN_DIRS)
    seen = set()
    for d in dirs:
        if d in seen:
            continue
        seen.add(d)
        cand = os.path.join(_under(root, d), name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand if root in ("", "/") else "/" + os.path.relpath(cand, root)
    return None


def _elf_is_static(path: str) -> bool:
    """True for an ELF executable with no program interpreter (static)."""
    try:
        with open(path, "rb") as f:
            ident = f.read(16)
            if ident[:4] != b"\x7fELF":
                return False
            is64 = ident[4] == 2
            endian = "<" if ident[5] == 1 else ">"
            if is64:
                hdr = f.read(48)
                e_phoff, = struct.unpack(endian + "Q", hdr[16:24])
                e_phentsize, e_phnum = struct.unpack(endian + "HH", hdr[38:42])
            else:
                hdr = f.read(36)
                e_phoff, = struct.unpack(endian + "I", hdr[12:16])
                e_phentsize, e_phnum = struct.unpack(endian + "HH", hdr[26:30])
            for i in range(e_phnum):
                f.seek(e_phoff + i * e_phentsize)
                p_type, = struct.unpack(endian + "I", f.read(4))
                if p_type == 3:  # PT_INTERP
                    return False
            return True
    except (OSError, struct.error):
        return False


def _version_key(v: str) -> Tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.\-+~]", v))


def _cache_dir() -> str:
    base = os.environ.get("AIODAT_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "aiodat")
    path = os.path.join(base, "rxe")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(path)
    except OSError:
        path = os.path.join(tempfile.gettempdir(), "aiodat-%d" % os.getuid(), "rxe")
        os.makedirs(path, exist_ok=True)
    return path


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(text.rstrip("\n").split("\n")[-lines:])


def _gid_for(addr: str) -> str:
    """The sysfs text of the IPv4-mapped RoCE v2 GID for ``addr``."""
    a, b, c, d = (int(x) for x in addr.split("."))
    return "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x" % (a, b, c, d)


# --------------------------------------------------------------------------
# newc cpio writer (the initramfs format)

class CpioWriter:
    """Write a "newc" (SVR4, no CRC) cpio archive, the format of an initramfs.

    >>> w = CpioWriter(); w.add_dir("bin"); w.add_file("bin/x", b"hi", 0o755)
    >>> data = w.finish()
    """

    def __init__(self, out: Optional[IO[bytes]] = None) -> None:
        self._out = out if out is not None else io.BytesIO()
        self._ino = 1
        self._finished = False

    def _entry(self, name: str, mode: int, data: bytes = b"", *, nlink: int = 1,
               rdev: Tuple[int, int] = (0, 0), mtime: int = 0) -> None:
        if self._finished:
            raise ValueError("archive already finished")
        bname = name.encode() + b"\0"
        fields = (
            self._ino, mode, 0, 0, nlink, mtime, len(data),
            0, 0, rdev[0], rdev[1], len(bname), 0,
        )
        self._ino += 1
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        out = self._out
        out.write(header + bname)
        out.write(b"\0" * (-(len(header) + len(bname)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))

    def add_dir(self, name: str, mode: int = 0o755) -> None:
        """Append a directory to the archive."""
        self._entry(name, stat.S_IFDIR | mode, nlink=2)

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Append a regular file with these bytes to the archive."""
        self._entry(name, stat.S_IFREG | mode, data)

    def add_symlink(self, name: str, target: str) -> None:
        """Append a symbolic link to target to the archive."""
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def add_chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        """Append a character device node (major, minor) to the archive."""
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        """Write the trailer; return the archive if writing to memory."""
        self._entry("TRAILER!!!", 0, nlink=1)
        self._finished = True
        out = self._out
        if isinstance(out, io.BytesIO):
            return out.getvalue()
        return b""


# --------------------------------------------------------------------------
# what the machine offers

@dataclasses.dataclass
class _Kernel:
    version: str
    image: str          # /boot/vmlinuz-<version>
    modules: str        # /lib/modules/<version>


def _find_module(moddir: str, name: str) -> Optional[str]:
    """Path of module ``name`` (relative to moddir) from modules.dep, or by search."""
    names = {name, name.replace("-", "_"), name.replace("_", "-")}
    dep = os.path.join(moddir, "modules.dep")
    try:
        with open(dep) as f:
            for line in f:
                path = line.split(":", 1)[0]
                base = os.path.basename(path)
                for suf in _MODULE_SUFFIXES:
                    if base.endswith(suf) and base[: -len(suf)] in names:
                        return path
    except OSError:
        pass
    for suf in _MODULE_SUFFIXES:
        for n in names:
            hits = glob.glob(os.path.join(moddir, "kernel", "**", n + suf), recursive=True)
            if hits:
                return os.path.relpath(hits[0], moddir)
    return None


def _builtin_modules(moddir: str) -> set:
    out = set()
    try:
        with open(os.path.join(moddir, "modules.builtin")) as f:
            for line in f:
                base = os.path.basename(line.strip())
                for suf in _MODULE_SUFFIXES:
                    if base.endswith(suf):
                        out.add(base[: -len(suf)].replace("-", "_"))
    except OSError:
        pass
    return out


def _module_load_order(moddir: str, targets: Sequence[str]) -> List[str]:
    """Module files (relative to moddir), dependencies first, for insmod.

    Raises LookupError naming a module that is neither a file nor built in.
    """
    deps: Dict[str, List[str]] = {}
    try:
        with open(os.path.join(moddir, "modules.dep")) as f:
            for line in f:
                if ":" in line:
                    mod, rest = line.split(":", 1)
                    deps[mod.strip()] = rest.split()
    except OSError:
        deps = {}
    builtin = _builtin_modules(moddir)
    order: List[str] = []
    if deps:
        def visit(path: str, stack: Tuple[str, ...] = ()) -> None:
            if path in order or path in stack:
                return
            for d in reversed(deps.get(path, [])):
                visit(d, stack + (path,))
            order.append(path)

        for t in targets:
            if t.replace("-", "_") in builtin:
                continue
            p = _find_module(moddir, t)
            if p is None:
                raise LookupError(t)
            visit(p)
        return order
    for t in _STAGE1_FALLBACK:
        if t in builtin:
            continue
        p = _find_module(moddir, t)
        if p is None:
            raise LookupError(t)
        order.append(p)
    return order


def _find_kernels(root: str = "/") -> List[_Kernel]:
    """Kernels with an image and a module tree that has rdma_rxe, newest first."""
    found = []
    for image in glob.glob(_under(root, "/boot/vmlinuz-*")):
        version = os.path.basename(image)[len("vmlinuz-"):]
        moddir = _under(root, "/lib/modules/" + version)
        if not os.path.isdir(moddir):
            continue
        if _find_module(moddir, "rdma_rxe") is None and "rdma_rxe" not in _builtin_modules(moddir):
            continue
        found.append(_Kernel(version, image, moddir))
    found.sort(key=lambda k: _version_key(k.version), reverse=True)
    return found


def _find_busybox(root: str = "/") -> Tuple[Optional[str], Optional[str]]:
    """(static busybox, any busybox) paths."""
    cands = []
    w = _which("busybox", root)
    if w:
        cands.append(_under(root, w))
    for p in ("/bin/busybox", "/usr/bin/busybox", "/sbin/busybox", "/usr/sbin/busybox"):
        cands.append(_under(root, p))
    any_bb = None
    for c in cands:
        if os.path.isfile(c):
            any_bb = any_bb or c
            if _elf_is_static(c):
                return c, c
    return None, any_bb


def _kvm_usable(root: str = "/") -> Tuple[bool, str]:
    mods = [m for m in ("kvm_intel", "kvm_amd") if os.path.isdir(_under(root, "/sys/module/" + m))]
    dev = _under(root, "/dev/kvm")
    if not mods:
        extra = ""
        if os.path.isdir(_under(root, "/sys/module/kvm")):
            extra = " (a bare 'kvm' module is a nested hypervisor that hangs stock kernels)"
        return False, "no kvm_intel/kvm_amd module" + extra + ": using TCG"
    if not os.path.exists(dev):
        return False, "%s loaded but no /dev/kvm: using TCG" % mods[0]
    if root in ("", "/") and not os.access(dev, os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible to this user: using TCG"
    return True, "%s and /dev/kvm present" % mods[0]


def _native_check(root: str = "/") -> Tuple[bool, str]:
    release = platform.release() if root in ("", "/") else ""
    ib = _under(root, "/sys/class/infiniband")
    loaded = os.path.isdir(_under(root, "/sys/module/rdma_rxe"))
    moddir = _under(root, "/lib/modules/" + release) if release else ""
    loadable = bool(moddir) and os.path.isdir(moddir) and (
        _find_module(moddir, "rdma_rxe") is not None or "rdma_rxe" in _builtin_modules(moddir))
    if not (loaded or loadable):
        why = "kernel %s has no rdma_rxe (no /sys/module/rdma_rxe, no module in /lib/modules/%s)" % (
            release or "?", release or "?")
        if not os.path.isdir(ib):
            why += ", no /sys/class/infiniband"
        return False, why
    if os.geteuid() != 0:
        return False, "kernel can run rdma_rxe but we are not root"
    missing = [t for t in ("ip", "rdma") if not _which(t, root)]
    if not loaded and not _which("modprobe", root):
        missing.append("modprobe")
    if missing:
        return False, "missing tools: " + ", ".join(missing)
    return True, "root on kernel %s with rdma_rxe %s" % (release, "loaded" if loaded else "loadable")


def status(root: str = "/") -> dict:
    """What the machine offers for the rxe test bed.

    ``root`` lets tests point at a fake filesystem tree.  Returns a dict with
    ``method`` (``"native"``, ``"qemu"`` or ``None``), per-method details,
    ``missing_packages`` (Debian names needed for the QEMU path and for rxe
    userspace) and ``recommended_packages`` (tools the tests use).
    """
    st: dict = {"root": root}
    native_ok, native_why = _native_check(root)
    st["native"] = {"usable": native_ok, "reason": native_why}

    missing: List[str] = []
    recommended: List[str] = []
    q: dict = {}
    qemu = _which("qemu-system-x86_64", root)
    q["qemu"] = qemu
    if not qemu:
        missing.append(PACKAGES["qemu"])
    kernels = _find_kernels(root)
    if kernels:
        k = kernels[0]
        q["kernel"] = k.image
        q["kernel_version"] = k.version
        q["modules"] = k.modules
        try:
            order = _module_load_order(k.modules, _STAGE1_TARGETS)
            q["stage1_modules"] = [os.path.basename(p) for p in order]
            q["module_compression"] = sorted({
                p.rsplit(".", 1)[-1] for p in order if not p.endswith(".ko")}) or ["none"]
        except LookupError as e:
            q["stage1_modules"] = None
            q["problem"] = "kernel %s lacks module %s (9p/overlay boot)" % (k.version, e)
        if not os.access(k.image, os.R_OK):
            q["problem"] = "%s is not readable by this user" % k.image
    else:
        q["kernel"] = None
        missing.append(PACKAGES["kernel"])
    bb_static, bb_any = _find_busybox(root)
    q["busybox"] = bb_static
    if not bb_static:
        missing.append(PACKAGES["busybox"])
        if bb_any:
            q["busybox_note"] = "%s is dynamically linked; the initramfs needs busybox-static" % bb_any
    kvm_ok, kvm_why = _kvm_usable(root)
    q["accel"] = "kvm" if kvm_ok else "tcg"
    q["accel_reason"] = kvm_why

    tools = {t: _which(t, root) for t in ("ip", "rdma", "modprobe", "ibv_devinfo", "rping", "ib_send_lat")}
    st["tools"] = tools
    if not tools["ip"] or not tools["rdma"]:
        missing.append(PACKAGES["iproute2"])
    if not tools["modprobe"]:
        missing.append(PACKAGES["kmod"])
    if not os.path.isdir(_under(root, "/etc/rdma")):
        missing.append(PACKAGES["rdma-core"])
    libdirs = ["/usr/lib/*/libibverbs", "/usr/lib64/libibverbs", "/usr/lib/libibverbs"]
    if not any(glob.glob(_under(root, d + "/librxe-rdmav*.so")) for d in libdirs):
        missing.append(PACKAGES["ibverbs-providers"])
    libs = ["/usr/lib/*/", "/usr/lib64/", "/usr/lib/", "/lib/*/"]
    if not any(glob.glob(_under(root, d + "libibverbs.so.1*")) for d in libs):
        missing.append(PACKAGES["libibverbs1"])
    if not any(glob.glob(_under(root, d + "librdmacm.so.1*")) for d in libs):
        missing.append(PACKAGES["librdmacm1"])
    if not tools["ibv_devinfo"]:
        recommended.append(PACKAGES["ibverbs-utils"])
    if not tools["rping"]:
        recommended.append(PACKAGES["rdmacm-utils"])
    if not tools["ib_send_lat"]:
        recommended.append(PACKAGES["perftest"])

    guest_needs = [PACKAGES[x] for x in ("qemu", "kernel", "busybox", "iproute2", "kmod")]
    qemu_ok = (not any(p in missing for p in guest_needs)) and "problem" not in q
    q["usable"] = qemu_ok
    st["qemu"] = q
    st["missing_packages"] = missing
    st["recommended_packages"] = recommended
    st["method"] = "native" if native_ok else ("qemu" if qemu_ok else None)
    return st


def format_status(st: Optional[dict] = None) -> str:
    """A human-readable report of :func:`status`."""
    if st is None:
        st = status()
    lines = []
    n = st["native"]
    lines.append("native rxe: %s (%s)" % ("yes" if n["usable"] else "no", n["reason"]))
    q = st["qemu"]
    lines.append("QEMU guest: %s" % ("yes" if q["usable"] else "no"))
    lines.append("  qemu-system-x86_64: %s" % (q.get("qemu") or "missing"))
    if q.get("kernel"):
        lines.append("  kernel: %s (modules %s)" % (q["kernel"], q["modules"]))
        if q.get("stage1_modules"):
            lines.append("  initramfs modules: %s" % " ".join(q["stage1_modules"]))
            lines.append("  module compression: %s" % ", ".join(q.get("module_compression", [])))
    else:
        lines.append("  kernel: missing (no /boot/vmlinuz-* whose /lib/modules/<ver> has rdma_rxe)")
    lines.append("  static busybox: %s" % (q.get("busybox") or "missing"))
    if q.get("busybox_note"):
        lines.append("    " + q["busybox_note"])
    lines.append("  acceleration: %s (%s)" % (q["accel"], q["accel_reason"]))
    if q.get("problem"):
        lines.append("  problem: " + q["problem"])
    tools = st.get("tools", {})
    lines.append("tools: " + ", ".join("%s=%s" % (k, v or "missing") for k, v in tools.items()))
    if st["missing_packages"]:
        lines.append("missing packages: " + " ".join(st["missing_packages"]))
    if st["recommended_packages"]:
        lines.append("recommended packages: " + " ".join(st["recommended_packages"]))
    if st["missing_packages"] or st["recommended_packages"]:
        lines.append("  install: apt-get install -y --no-install-recommends "
                     + " ".join(st["missing_packages"] + st["recommended_packages"]))
    lines.append("method: %s" % (st["method"] or "none (the test bed cannot run here)"))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# output forwarding

def _write_out(which: str, data: bytes) -> None:
    stream = sys.stdout if which == "stdout" else sys.stderr
    try:
        buf = getattr(stream, "buffer", None)
        if buf is not None:
            stream.flush()
            buf.write(data)
            buf.flush()
        else:
            stream.write(data.decode("utf-8", "replace"))
            stream.flush()
    except (OSError, ValueError):
        pass


class _Pump(threading.Thread):
    """Copy a pipe to a sink until EOF."""

    def __init__(self, fd: int, sink: Callable[[bytes], None]) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.sink = sink

    def run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self.fd, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                self.sink(data)
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass


def _caller_env(env: Optional[Mapping[str, str]], cwd: str, testbed: str, device: str) -> Dict[str, str]:
    out = dict(os.environ if env is None else env)
    out["PWD"] = cwd
    out["AIODAT_RXE_DEVICE"] = device
    out["AIODAT_RXE_ADDR"] = ADDR
    out["AIODAT_RXE_NETDEV"] = NETDEV
    out["AIODAT_TESTBED"] = testbed
    return out


def _child_setup(memlock: bool = False) -> Callable[[], None]:
    """A preexec_fn: die with us (PR_SET_PDEATHSIG), optionally lift RLIMIT_MEMLOCK.

    QEMU and native commands run in their own session so that a terminal's
    Ctrl-C reaches only us (we then kill them); the death signal makes sure
    they never outlive us, whatever kills us.
    """
    import ctypes

    try:
        libc: Optional[ctypes.CDLL] = ctypes.CDLL(None, use_errno=True)
    except OSError:
        libc = None
    parent = os.getpid()

    def setup() -> None:
        if libc is not None:
            try:
                libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            except AttributeError:
                pass
            if os.getppid() != parent:
                os._exit(125)
        if memlock:
            try:
                import resource

                resource.setrlimit(resource.RLIMIT_MEMLOCK,
                                   (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except (ImportError, ValueError, OSError):
                pass

    return setup


def _host_tty_size() -> Optional[Tuple[int, int]]:
    """(columns, rows) of our stdout if it is a terminal."""
    try:
        fd = sys.stdout.fileno()
        if os.isatty(fd):
            sz = os.get_terminal_size(fd)
            if sz.columns > 0 and sz.lines > 0:
                return sz.columns, sz.lines
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        pass
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------
# QEMU guest

_INIT_SCRIPT = r"""#!/bin/sh
# aiodat rxe test bed, first stage (initramfs): mount the host's / read-only
# over virtio-9p with a tmpfs overlay, then switch_root into it and run the
# second stage that the host wrote into the control share.
export PATH=/bin
fail() {
    echo "aiodat-init: FAILED: $*"
    echo "$*" > /ctl/setup-error 2>/dev/null
    poweroff -f
    echo o > /proc/sysrq-trigger
    sleep 60
}
mkdir -p /proc /sys /dev /ro /rw /newroot /ctl
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo "aiodat-init: loading modules"
for m in $(cat /modules.order); do
    insmod /lib/modules/$m || fail "insmod $m"
done
OPTS=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o $OPTS aiodatctl /ctl || fail "mount 9p control share"
mount -t 9p -o $OPTS,ro,cache=loose aiodatroot /ro || fail "mount 9p root"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "mount tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/ro,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
    || fail "mount overlay"
mount -t tmpfs -o mode=0755 tmpfs /newroot/run || fail "mount /run"
mkdir -p /newroot/run/aiodat
umount /ctl
mount -t 9p -o $OPTS aiodatctl /newroot/run/aiodat || fail "mount control share"
[ -r /newroot/run/aiodat/stage2.sh ] || fail "no stage2.sh in the control share"
for d in dev proc sys; do mount --move /$d /newroot/$d || fail "move /$d"; done
echo "aiodat-init: switch_root"
exec switch_root /newroot /bin/sh /run/aiodat/stage2.sh
"""


def _initramfs(kernel: _Kernel, busybox: str) -> str:
    """Path of the cached initramfs for ``kernel``, (re)built when stale."""
    order = _module_load_order(kernel.modules, _STAGE1_TARGETS)
    key = hashlib.sha256()
    key.update(_FORMAT_VERSION.encode())
    key.update(_INIT_SCRIPT.encode())
    for p in [busybox] + [os.path.join(kernel.modules, m) for m in order]:
        s = os.stat(p)
        key.update(("%s:%d:%d\n" % (p, s.st_size, s.st_mtime_ns)).encode())
    digest = key.hexdigest()[:16]
    cache = _cache_dir()
    prefix = "initramfs-%s-" % kernel.version
    path = os.path.join(cache, prefix + digest + ".cpio")
    if os.path.isfile(path):
        return path
    w = CpioWriter()
    for d in ("bin", "dev", "lib", "lib/modules", "proc", "sys", "ro", "rw", "newroot", "ctl"):
        w.add_dir(d)
    w.add_chardev("dev/console", 5, 1)
    w.add_chardev("dev/null", 1, 3, 0o666)
    with open(busybox, "rb") as f:
        w.add_file("bin/busybox", f.read(), 0o755)
    for applet in ("sh", "mount", "umount", "insmod", "mkdir", "cat", "echo", "sleep",
                   "switch_root", "poweroff"):
        w.add_symlink("bin/" + applet, "busybox")
    names = []
    for rel in order:
        data = _read_module(os.path.join(kernel.modules, rel))
        name = os.path.basename(rel)
        for suf in _MODULE_SUFFIXES:
            if name.endswith(suf):
                name = name[: -len(suf)] + ".ko"
                break
        w.add_file("lib/modules/" + name, data)
        names.append(name)
    w.add_file("modules.order", ("\n".join(names) + "\n").encode())
    w.add_file("init", _INIT_SCRIPT.encode(), 0o755)
    data = w.finish()
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".initramfs-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    # drop stale images, but not ones a concurrent run may be about to boot
    for old in glob.glob(os.path.join(cache, prefix + "*.cpio")):
        try:
            if old != path and time.time() - os.stat(old).st_mtime > 3600:
                os.unlink(old)
        except OSError:
            pass
    return path


def _read_module(path: str) -> bytes:
    """A module's ELF bytes, decompressed on the host if needed."""
    if path.endswith(".ko.xz"):
        with lzma.open(path) as f:
            return f.read()
    if path.endswith(".ko.gz"):
        with gzip.open(path) as f:
            return f.read()
    if path.endswith(".ko.zst"):
        try:
            import zstandard  # type: ignore

            with open(path, "rb") as f:
                return zstandard.ZstdDecompressor().decompressobj().decompress(f.read())
        except ImportError:
            pass
        zstd = shutil.which("zstd")
        if not zstd:
            raise RuntimeError("%s is zstd-compressed: install zstd (apt-get install zstd)" % path)
        return subprocess.run([zstd, "-dc", path], check=True, stdout=subprocess.PIPE).stdout
    with open(path, "rb") as f:
        return f.read()


@dataclasses.dataclass
class _GuestPlan:
    """Everything one guest needs.  Two guests (a later ``--hosts 2``) would
    be two plans differing in ``index``, ``addr`` and the network setup."""

    index: int
    cmd: List[str]
    cwd: str
    env: Dict[str, str]
    rw_paths: List[str]
    kernel: _Kernel
    busybox: str
    qemu: str
    memory: str
    cpus: int
    accel: str
    addr: str = ADDR
    netdev: str = NETDEV
    device: str = GUEST_DEVICE
    verbose: bool = False
    tty_size: Optional[Tuple[int, int]] = None   # (columns, rows) for the guest's ttyS1/2
    #: Two-host runs: the QEMU ``-netdev`` spec (id ``aiodatnet``) and the MAC
    #: of the guest's virtio NIC, which stage2 renames to ``netdev``.  None:
    #: a dummy netdev and no NIC at all.
    nic: Optional[Tuple[str, str]] = None
    #: Two-host runs: the host directory both guests share (mailboxes,
    #: ready files), mounted at :data:`GUEST_HOSTS_DIR`.
    hosts_dir: Optional[str] = None
    #: Two-host runs: a file in the hosts directory to wait for before the
    #: command runs (the peer's agent is up).
    wait_for: Optional[str] = None


def _stage2_script(plan: _GuestPlan) -> str:
    q = shlex.quote
    mounts = []
    for i, p in enumerate(plan.rw_paths):
        mounts.append(
            "mkdir -p %s && mount -t 9p -o $OPTS,cache=mmap aiodatrw%d %s "
            "|| fail 'cannot mount the shared directory %s'" % (q(p), i, q(p), p.replace("'", "")))
    gid = _gid_for(plan.addr)
    return """#!/bin/sh
# aiodat rxe test bed, second stage (in the guest, on the host's own tools).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CTL=/run/aiodat
OPTS=trans=virtio,version=9p2000.L,msize=262144
say() {{ echo "aiodat-stage2: $*"; }}
off() {{
    sync
    {busybox} poweroff -f
    echo o > /proc/sysrq-trigger
    sleep 60
}}
fail() {{
    say "FAILED: $*"
    echo "$*" > $CTL/setup-error
    off
}}
up() {{ cat /proc/uptime | cut -d' ' -f1; }}
say "up at $(up) s"
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
hostname aiodat-rxe{index}
{mounts}
modprobe -a {modules} || fail "modprobe {modules} failed"
ip link set lo up || fail "ip link set lo up"
{netsetup}
ip addr add {addr}/{prefix} dev {netdev} || fail "ip addr add {addr}/{prefix} dev {netdev}"
ip link set {netdev} up || fail "ip link set {netdev} up"
rdma link add {device} type rxe netdev {netdev} || fail "rdma link add {device} type rxe netdev {netdev}"
P=/sys/class/infiniband/{device}/ports/1
i=0
while :; do
    if grep -qs ACTIVE $P/state && grep -qsx '{gid}' $P/gids/*; then break; fi
    i=$((i+1))
    [ $i -gt 600 ] && fail "{device} did not become ACTIVE with GID {gid} in 60 s: state $(cat $P/state 2>/dev/null)"
    sleep 0.1
done
say "{device} ACTIVE on {netdev} {addr} at $(up) s"
{waitpeer}
up > $CTL/ready
{{
    stty raw -echo {size} <&1
    stty raw -echo {size} <&2
    /bin/sh $CTL/run.sh </dev/null
    echo $? > $CTL/exitstatus.tmp
    stty raw -echo <&1
    stty raw -echo <&2
}} >/dev/ttyS1 2>/dev/ttyS2
mv $CTL/exitstatus.tmp $CTL/exitstatus
say "command finished (status $(cat $CTL/exitstatus)) at $(up) s"
off
""".format(
        busybox=q(plan.busybox), index=plan.index, mounts="\n".join(mounts),
        modules=" ".join(_GUEST_MODULES), netdev=plan.netdev, addr=plan.addr,
        prefix=PREFIXLEN, device=plan.device, gid=gid,
        size="cols %d rows %d" % plan.tty_size if plan.tty_size else "",
        netsetup=_netsetup(plan), waitpeer=_waitpeer(plan),
    )


def _netsetup(plan: _GuestPlan) -> str:
    """Stage2 lines that create ``plan.netdev`` (a dummy, or the renamed virtio NIC)."""
    if plan.nic is None:
        return 'ip link add {0} type dummy || fail "ip link add {0} type dummy"'.format(plan.netdev)
    mac = plan.nic[1]
    hosts = ""
    if plan.hosts_dir is not None:
        hosts = ("mkdir -p {d} && mount -t 9p -o $OPTS,cache=none aiodathosts {d} "
                 "|| fail 'cannot mount the hosts directory'\n").format(d=GUEST_HOSTS_DIR)
    return hosts + """modprobe -a {mods} || fail "modprobe {mods} failed"
NIC=
i=0
while [ -z "$NIC" ]; do
    for n in /sys/class/net/*; do
        [ "$(cat $n/address 2>/dev/null)" = "{mac}" ] && NIC=${{n##*/}}
    done
    i=$((i+1))
    [ -z "$NIC" ] && [ $i -gt 100 ] && fail "no network interface with MAC {mac}"
    [ -z "$NIC" ] && sleep 0.1
done
ip link set dev "$NIC" name {netdev} || fail "ip link set dev $NIC name {netdev}"
ip link set dev {netdev} mtu 1500""".format(mods=" ".join(_NIC_MODULES), mac=mac, netdev=plan.netdev)


def _waitpeer(plan: _GuestPlan) -> str:
    """Stage2 lines that wait for the peer host (two-host runs) before the command runs."""
    if not plan.wait_for:
        return ""
    return """i=0
while [ ! -e {d}/{f} ]; do
    i=$((i+1))
    [ $i -gt {n} ] && fail "the peer host did not come up in {s} s (no {f} in the hosts directory)"
    sleep 0.1
done
say "peer host up at $(up) s"
""".format(d=GUEST_HOSTS_DIR, f=plan.wait_for, n=PEER_WAIT_S * 10, s=PEER_WAIT_S)


def _run_script(plan: _GuestPlan) -> str:
    q = shlex.quote
    assigns = " ".join(q("%s=%s" % (k, v)) for k, v in sorted(plan.env.items()) if "=" not in k and k)
    return """# the caller's command, its environment and working directory
ulimit -l unlimited 2>/dev/null || echo "aiodat rxe: warning: could not raise the memlock limit" >&2
cd {cwd} || exit 125
exec env -i -- {assigns} {cmd}
""".format(cwd=q(plan.cwd), assigns=assigns, cmd=" ".join(q(c) for c in plan.cmd))


def _qemu_argv(plan: _GuestPlan, initrd: str, ctl: str,
               fds: Dict[str, int]) -> List[str]:
    append = "console=ttyS0 quiet loglevel=%d panic=-1 rdinit=/init" % (7 if plan.verbose else 4)
    argv = [
        plan.qemu, "-nodefaults", "-no-user-config",
        "-display", "none", "-monitor", "none", "-no-reboot",
        "-m", plan.memory, "-smp", str(plan.cpus),
        "-kernel", plan.kernel.image, "-initrd", initrd, "-append", append,
    ]
    if plan.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", "host"]
    else:
        argv += ["-accel", "tcg,thread=multi", "-cpu", "max"]
    for name in ("con", "out", "err"):
        argv += ["-chardev", "file,id=%s,path=/proc/self/fd/%d,append=on" % (name, fds[name]),
                 "-serial", "chardev:" + name]
    if plan.nic is None:
        argv += ["-nic", "none"]
    else:
        argv += ["-netdev", plan.nic[0],
                 "-device", "virtio-net-pci,netdev=aiodatnet,mac=%s" % plan.nic[1]]
    shares = [("aiodatroot", "/", True), ("aiodatctl", ctl, False)]
    shares += [("aiodatrw%d" % i, p, False) for i, p in enumerate(plan.rw_paths)]
    if plan.hosts_dir is not None:
        shares.append(("aiodathosts", plan.hosts_dir, False))
    for i, (tag, path, ro) in enumerate(shares):
        fs = "local,id=fs%d,path=%s,security_model=none,multidevs=remap" % (i, path.replace(",", ",,"))
        if ro:
            fs += ",readonly=on"
        argv += ["-fsdev", fs, "-device", "virtio-9p-pci,fsdev=fs%d,mount_tag=%s" % (i, tag)]
    return argv


def _run_qemu(cmd: List[str], deadline: float, timeout: float, memory: str, cpus: int,
              env: Optional[Mapping[str, str]], cwd: str, verbose: bool,
              rw_paths: Optional[Sequence[str]]) -> int:
    prep = _prepare_guests(env, cwd, rw_paths)
    if prep is None:
        return EXIT_TESTBED_FAILED
    q, kernel, guest_env, tty_size, rw, initrd = prep
    plan = _GuestPlan(
        index=0, cmd=list(cmd), cwd=cwd, env=guest_env, tty_size=tty_size,
        rw_paths=rw, kernel=kernel, busybox=q["busybox"],
        qemu=q["qemu"], memory=memory, cpus=cpus, accel=q["accel"], verbose=verbose,
    )
    guest = _Guest(plan, initrd)
    return guest.run(deadline, timeout)


def _prepare_guests(env: Optional[Mapping[str, str]], cwd: str, rw_paths: Optional[Sequence[str]]) -> Optional[
        Tuple[Dict[str, Any], "_Kernel", Dict[str, str], Any, List[str], str]]:
    """What every guest of a run shares: QEMU's facts, the kernel, the caller's environment,
    the tty size, the read-write shares and the initramfs; None (after saying why) if it cannot boot."""
    st = status()
    q = st["qemu"]
    if not q["usable"]:
        _msg("aiodat rxe: cannot boot a QEMU guest here.\n" + format_status(st))
        return None
    kernel = _find_kernels()[0]
    guest_env = _caller_env(env, cwd, "qemu", GUEST_DEVICE)
    tty_size = _host_tty_size()
    if tty_size is None and not any(k in guest_env for k in ("FORCE_COLOR", "PY_COLORS")):
        # The command's stdout in the guest is a serial tty; where ours is not
        # a terminal, tell tools so (no colours, no progress bars), as here.
        guest_env["TERM"] = "dumb"
    if rw_paths is None:
        rw_paths = [] if os.path.realpath(cwd) == "/" else [os.path.realpath(cwd)]
    rw = [os.path.realpath(p) for p in rw_paths]
    try:
        initrd = _initramfs(kernel, q["busybox"])
    except (OSError, LookupError, RuntimeError, subprocess.CalledProcessError) as e:
        _msg("aiodat rxe: cannot build the initramfs: %s" % e)
        return None
    return q, kernel, guest_env, tty_size, rw, initrd


def _hosts_env(base: Dict[str, str], index: int, hosts_dir: str) -> Dict[str, str]:
    """The environment of a command on host ``index`` of a two-host run."""
    out = dict(base)
    out["AIODAT_RXE_ADDR"] = HOST_ADDRS[index]
    out["AIODAT_PEER_ADDR"] = HOST_ADDRS[1 - index]
    out["AIODAT_HOSTS"] = "2"
    out["AIODAT_HOST_INDEX"] = str(index)
    out["AIODAT_HOST_ADDRS"] = ",".join(HOST_ADDRS)
    out["AIODAT_HOSTS_DIR"] = hosts_dir
    return out


def _run_qemu_hosts(cmd: List[str], deadline: float, timeout: float, memory: str, cpus: int,
                    env: Optional[Mapping[str, str]], cwd: str, verbose: bool,
                    rw_paths: Optional[Sequence[str]]) -> int:
    """Two guests joined by a virtio NIC each: ``cmd`` runs on host A, an agent on host B."""
    prep = _prepare_guests(env, cwd, rw_paths)
    if prep is None:
        return EXIT_TESTBED_FAILED
    q, kernel, base_env, tty_size, rw, initrd = prep
    netdir = tempfile.mkdtemp(prefix="aiodat-link-")
    sock = os.path.join(netdir, "link.sock")
    stream = "stream,id=aiodatnet,server=%s,addr.type=unix,addr.path=" + sock.replace(",", ",,")
    agent = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts.py"),
             "agent", "--dir", GUEST_HOSTS_DIR, "--index", "1"]
    plans = []
    for index, (argv, server) in enumerate(((list(cmd), "on"), (agent, "off"))):
        plans.append(_GuestPlan(
            index=index, cmd=argv, cwd=cwd, env=_hosts_env(base_env, index, GUEST_HOSTS_DIR),
            tty_size=tty_size, rw_paths=rw, kernel=kernel, busybox=q["busybox"], qemu=q["qemu"],
            memory=memory, cpus=cpus, accel=q["accel"], verbose=verbose, addr=HOST_ADDRS[index],
            nic=(stream % server, HOST_MACS[index]), wait_for="ready-1" if index == 0 else None,
        ))
    a, b = _Guest(plans[0], initrd), _Guest(plans[1], initrd)
    hosts_dir = os.path.join(a.rundir, "hosts")
    os.mkdir(hosts_dir)
    for p in plans:
        p.hosts_dir = hosts_dir
    b_log_path = os.path.join(b.rundir, "host-b.log")
    b_log = open(b_log_path, "ab")
    b_lock = threading.Lock()

    def b_sink(which: str, data: bytes) -> None:
        with b_lock:
            b_log.write(data)
            b_log.flush()
            if verbose:
                _write_out("stderr", data)

    def b_report(why: str) -> None:
        tail = _tail(b_log_path, 60)
        if tail:
            why += "\n--- last lines of host B's output (%s) ---\n%s" % (b_log_path, tail)
        b._diagnose("host B: " + why)

    timed_out = False
    b_died = False
    t0 = time.monotonic()
    try:
        if not a.start():
            return EXIT_TESTBED_FAILED
        # host B connects to host A's listening socket: wait until it is there
        while not os.path.exists(sock):
            if a.proc.poll() is not None or time.monotonic() > min(deadline, t0 + 60):
                a.kill()
                a.close()
                a.result(False, timeout, "host A")
                _msg("aiodat rxe: host A's QEMU did not open the link socket %s" % sock)
                return EXIT_TESTBED_FAILED
            time.sleep(0.05)
        if not b.start(b_sink):
            a.kill()
            return EXIT_TESTBED_FAILED
        while True:
            if a.proc.poll() is not None:
                break
            if b.proc.poll() is not None:
                b_died = True
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        # kill both on any way out (A done, B died, deadline, interrupt)
        a.kill()
        b.kill()
        for g in (a, b):
            if g.pumps:
                g.close()
        b_log.close()
        shutil.rmtree(netdir, ignore_errors=True)
    elapsed = time.monotonic() - t0
    if b_died:
        err = b._read_ctl("setup-error")
        b_report("QEMU of host B ended while host A was still running (%s); host A killed"
                 % ("set-up failed: " + err.strip() if err else "status %s" % b.proc.returncode))
        a._diagnose("host A killed because host B ended", console=a._read_ctl("ready") is None)
        return EXIT_TESTBED_FAILED
    rc = a.result(timed_out, timeout, "host A")
    if a.ok and rc == 0:
        if verbose:
            _msg("aiodat rxe: two hosts ran %.1f s" % elapsed)
        a._finish_ok()
        shutil.rmtree(b.rundir, ignore_errors=True)
        return rc
    if timed_out or not a.ok or rc != 0:
        b_report("host A's command %s" % ("did not finish" if timed_out or not a.ok else
                                          "exited with status %d" % rc))
    return rc


_KEEP_FAILED_RUNS = 10


def _prune_runs(runs: str, keep: str) -> None:
    """Keep the newest few run directories of failed runs (for debugging)."""
    try:
        dirs = sorted((d for d in os.listdir(runs) if not d.startswith(".")),
                      key=lambda d: os.stat(os.path.join(runs, d)).st_mtime)
    except OSError:
        return
    for d in dirs[:-_KEEP_FAILED_RUNS]:
        path = os.path.join(runs, d)
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


class _Guest:
    """One QEMU guest: its run directory, process, output pumps and result."""

    def __init__(self, plan: _GuestPlan, initrd: str) -> None:
        self.plan = plan
        self.initrd = initrd
        runs = os.path.join(_cache_dir(), "runs")
        os.makedirs(runs, exist_ok=True)
        self.rundir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs)
        self.ctl = os.path.join(self.rundir, "ctl")
        os.mkdir(self.ctl)
        self.console_log = os.path.join(self.rundir, "console.log")
        self.qemu_log = os.path.join(self.rundir, "qemu.log")
        self.proc: Optional[subprocess.Popen] = None
        self.pumps: List[_Pump] = []
        self.ok = False
        self.t0 = time.monotonic()

    def _write_ctl(self) -> None:
        with open(os.path.join(self.ctl, "stage2.sh"), "w") as f:
            f.write(_stage2_script(self.plan))
        with open(os.path.join(self.ctl, "run.sh"), "w") as f:
            f.write(_run_script(self.plan))

    def _diagnose(self, why: str, console: bool = True) -> None:
        parts = ["aiodat rxe: " + why]
        tail = _tail(self.console_log) if console else ""
        if tail:
            parts.append("--- last lines of the guest console (%s) ---\n%s" % (self.console_log, tail))
        qtail = _tail(self.qemu_log, 15)
        if qtail:
            parts.append("--- QEMU's own messages (%s) ---\n%s" % (self.qemu_log, qtail))
        parts.append("aiodat rxe: run directory kept: " + self.rundir)
        _msg("\n".join(parts))
        _prune_runs(os.path.dirname(self.rundir), keep=self.rundir)

    def _finish_ok(self) -> None:
        last = os.path.join(os.path.dirname(os.path.dirname(self.rundir)), "last-console.log")
        try:
            shutil.copyfile(self.console_log, last)
        except OSError:
            pass
        shutil.rmtree(self.rundir, ignore_errors=True)

    def start(self, out_sink: Optional[Callable[[str, bytes], None]] = None) -> bool:
        """Start QEMU and the output pumps; False (diagnosed) if QEMU could not start.

        ``out_sink(which, data)`` receives the command's output; default: ours.
        """
        self._write_ctl()
        pipes = {name: os.pipe() for name in ("con", "out", "err")}
        fds = {name: w for name, (r, w) in pipes.items()}
        argv = _qemu_argv(self.plan, self.initrd, self.ctl, fds)
        with open(os.path.join(self.rundir, "qemu.argv"), "w") as f:
            f.write(" ".join(shlex.quote(a) for a in argv) + "\n")
        self.console = open(self.console_log, "wb")
        console = self.console
        verbose = self.plan.verbose
        sink = out_sink or _write_out

        def con_sink(data: bytes) -> None:
            console.write(data)
            console.flush()
            if verbose:
                _write_out("stderr", data)

        self.pumps = [
            _Pump(pipes["con"][0], con_sink),
            _Pump(pipes["out"][0], lambda d: sink("stdout", d)),
            _Pump(pipes["err"][0], lambda d: sink("stderr", d)),
        ]
        self.t0 = time.monotonic()
        self.qlog = open(self.qemu_log, "wb")
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self.qlog, stderr=subprocess.STDOUT,
                pass_fds=tuple(fds.values()), start_new_session=True,
                preexec_fn=_child_setup(),
            )
        except OSError as e:
            for r, w in pipes.values():
                os.close(r)
                os.close(w)
            self.qlog.close()
            self.console.close()
            self.proc = None
            self._diagnose("cannot start QEMU: %s" % e)
            return False
        for w in fds.values():
            os.close(w)
        for p in self.pumps:
            p.start()
        return True

    def kill(self) -> None:
        """Kill QEMU (if running) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc)
            self.proc.wait()

    def close(self) -> None:
        """After QEMU ended: drain the pumps, close the logs."""
        for p in self.pumps:
            p.join(timeout=5)
        self.qlog.close()
        for p in self.pumps:
            p.join(timeout=1)
        self.console.close()

    def result(self, timed_out: bool, timeout: float, name: str = "") -> int:
        """The exit status after QEMU ended (diagnosing failures)."""
        elapsed = time.monotonic() - self.t0
        ready = self._read_ctl("ready")
        exit_file = self._read_ctl("exitstatus")
        who = (name + ": ") if name else ""
        if timed_out:
            where = "while the command ran" if ready else "before rxe came up in the guest"
            self._diagnose(who + _QEMU_TIMEOUT_MSG.format(timeout, where) + " after %.1f s" % elapsed,
                           console=not ready)
            return EXIT_TIMEOUT
        err = self._read_ctl("setup-error")
        if err is not None:
            self._diagnose(who + "the guest could not bring rxe up, the command did not run: " + err.strip())
            return EXIT_TESTBED_FAILED
        if exit_file is None:
            self._diagnose(who + "QEMU exited (status %s) after %.1f s without the command's exit status%s"
                           % (self.proc.returncode, elapsed, "" if ready else "; rxe never came up"))
            return EXIT_TESTBED_FAILED
        try:
            rc = int(exit_file.strip())
        except ValueError:
            self._diagnose(who + "unreadable exit status %r" % exit_file)
            return EXIT_TESTBED_FAILED
        if self.plan.verbose:
            _msg("aiodat rxe: %srxe up %s s after the guest kernel started; QEMU ran %.1f s; status %d"
                 % (who, (ready or "?").strip(), elapsed, rc))
        self.ok = True
        return rc

    def run(self, deadline: float, timeout: float) -> int:
        if not self.start():
            return EXIT_TESTBED_FAILED
        timed_out = False
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            self.kill()
            self.close()
        rc = self.result(timed_out, timeout)
        if self.ok:
            self._finish_ok()
        return rc

    def _read_ctl(self, name: str) -> Optional[str]:
        try:
            with open(os.path.join(self.ctl, name)) as f:
                return f.read()
        except OSError:
            return None


# --------------------------------------------------------------------------
# native

def _sh(argv: List[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if check and res.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(argv), (res.stderr or res.stdout).strip()))
    return res


def _rxe_on(netdev: str) -> Optional[str]:
    """The rxe device bound to ``netdev``, if any."""
    res = _sh(["rdma", "-j", "link", "show"], check=False)
    if res.returncode == 0:
        try:
            for link in json.loads(res.stdout or "[]"):
                dev = link.get("ifname")
                if link.get("netdev") == netdev and dev:
                    return dev
        except (ValueError, AttributeError):
            pass
    res = _sh(["rdma", "link", "show"], check=False)
    for line in res.stdout.splitlines():
        m = re.match(r"link (\S+)/\d+ .*\bnetdev (\S+)", line)
        if m and m.group(2) == netdev:
            return m.group(1)
    return None


def _run_native(cmd: List[str], deadline: float, timeout: float,
                env: Optional[Mapping[str, str]], cwd: str) -> int:
    import fcntl

    lockdir = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
    lockf = open(os.path.join(lockdir, "aiodat-rxe.lock"), "w")
    undo: List[List[str]] = []
    try:
        while True:
            try:
                fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _msg("aiodat rxe: deadline of %g s passed waiting for another native run" % timeout)
                    return EXIT_TIMEOUT
                time.sleep(0.2)
        try:
            if not os.path.isdir("/sys/module/rdma_rxe"):
                _sh(["modprobe", "-a"] + list(_GUEST_MODULES))
            else:
                _sh(["modprobe", "-a"] + list(_GUEST_MODULES), check=False)
            if not os.path.isdir("/sys/class/net/" + NETDEV):
                _sh(["ip", "link", "add", NETDEV, "type", "dummy"])
                undo.append(["ip", "link", "del", NETDEV])
            addrs = _sh(["ip", "-o", "-4", "addr", "show", "dev", NETDEV]).stdout
            if (" %s/" % ADDR) not in addrs:
                _sh(["ip", "addr", "add", "%s/%d" % (ADDR, PREFIXLEN), "dev", NETDEV])
                if not undo:
                    undo.append(["ip", "addr", "del", "%s/%d" % (ADDR, PREFIXLEN), "dev", NETDEV])
            with open("/sys/class/net/%s/flags" % NETDEV) as f:
                was_up = int(f.read(), 16) & 1
            if not was_up:
                _sh(["ip", "link", "set", NETDEV, "up"])
                if not any(u[:3] == ["ip", "link", "del"] for u in undo):
                    undo.append(["ip", "link", "set", NETDEV, "down"])
            _sh(["ip", "link", "set", "lo", "up"], check=False)
            device = _rxe_on(NETDEV)
            if device is None:
                device = NATIVE_DEVICE
                _sh(["rdma", "link", "add", device, "type", "rxe", "netdev", NETDEV])
                undo.insert(0, ["rdma", "link", "delete", device])
            port = "/sys/class/infiniband/%s/ports/1" % device
            gid = _gid_for(ADDR)
            until = min(deadline, time.monotonic() + 30)
            while True:
                try:
                    with open(port + "/state") as f:
                        active = "ACTIVE" in f.read()
                except OSError:
                    active = False
                has_gid = False
                for g in glob.glob(port + "/gids/*"):
                    try:
                        with open(g) as f:
                            if f.read().strip() == gid:
                                has_gid = True
                                break
                    except OSError:
                        pass
                if active and has_gid:
                    break
                if time.monotonic() > until:
                    raise RuntimeError("%s did not become ACTIVE with GID %s" % (device, gid))
                time.sleep(0.1)
        except (RuntimeError, OSError) as e:
            _msg("aiodat rxe: could not bring rxe up natively, the command did not run: %s" % e)
            return EXIT_TESTBED_FAILED

        full_env = _caller_env(env, cwd, "native", device)
        preexec = _child_setup(memlock=True)

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                    stdout=out_w, stderr=err_w,
                                    start_new_session=True, preexec_fn=preexec)
        except OSError as e:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            _msg("aiodat rxe: cannot run %s: %s" % (cmd[0], e))
            return 127 if isinstance(e, FileNotFoundError) else 126
        os.close(out_w)
        os.close(err_w)
        pumps = [_Pump(out_r, lambda d: _write_out("stdout", d)),
                 _Pump(err_r, lambda d: _write_out("stderr", d))]
        for p in pumps:
            p.start()
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            for p in pumps:
                p.join(timeout=5)
            _msg("aiodat rxe: deadline of %g s passed; command killed" % timeout)
            return EXIT_TIMEOUT
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        for p in pumps:
            p.join(timeout=5)
        return rc if rc >= 0 else 128 - rc
    finally:
        for argv in undo:
            _sh(argv, check=False)
        lockf.close()


# --------------------------------------------------------------------------
# public entry points

def run(cmd: Sequence[str], *, timeout: float, memory: str = "2G", cpus: int = 2,
        env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
        method: Optional[str] = None, verbose: bool = False,
        rw_paths: Optional[Sequence[str]] = None, hosts: int = 1) -> int:
    """Run ``cmd`` where an rxe device is up; return its exit status.

    ``hosts=2`` boots two QEMU guests joined by a virtio NIC each (see
    docs/testbed.md, "Two hosts"): ``cmd`` runs on host A, an agent on host
    B runs what :mod:`aiodat.testing.hosts` asks it to; the deadline covers
    both, and both are killed when ``cmd`` ends or anything fails.

    The command's stdout and stderr are forwarded to ours (``sys.stdout`` /
    ``sys.stderr``) as they arrive; its stdin is /dev/null.  ``env`` is the
    complete environment (default: ours) to which ``AIODAT_RXE_DEVICE``,
    ``AIODAT_RXE_ADDR``, ``AIODAT_RXE_NETDEV`` and ``AIODAT_TESTBED`` are
    added.  ``cwd`` (default: ours) is where the command runs; in a guest it
    and ``rw_paths`` (default ``[cwd]``) are shared read-write with the host,
    the rest of the filesystem is the host's, read-only, under a throwaway
    overlay.

    ``method`` forces ``"native"`` or ``"qemu"``; by default native is used
    when possible.  Exit status: the command's own (128+N when it died of
    signal N); :data:`EXIT_TIMEOUT` (124) when ``timeout`` seconds passed
    (the guest or command is killed); :data:`EXIT_TESTBED_FAILED` (125) when
    the test bed failed and the command did not run.
    """
    deadline = time.monotonic() + timeout
    cmd = list(cmd)
    if not cmd:
        raise ValueError("empty command")
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    if hosts not in (1, 2):
        raise ValueError("hosts must be 1 or 2, not %r" % (hosts,))
    if hosts == 2:
        if method not in (None, "qemu"):
            raise ValueError("two hosts need method 'qemu'")
        return _run_qemu_hosts(cmd, deadline, timeout, memory, cpus, env, cwd, verbose, rw_paths)
    if method is None:
        st = status()
        method = st["method"]
        if method is None:
            _msg("aiodat rxe: no way to run rxe on this machine.\n" + format_status(st))
            return EXIT_TESTBED_FAILED
    if method == "native":
        return _run_native(cmd, deadline, timeout, env, cwd)
    if method == "qemu":
        return _run_qemu(cmd, deadline, timeout, memory, cpus, env, cwd, verbose, rw_paths)
    raise ValueError("method must be 'native', 'qemu' or None, not %r" % (method,))


_USAGE = """usage: rxe status [--json]
       rxe run [--timeout SECONDS] [--memory SIZE] [--cpus N] [--method native|qemu]
               [--share DIR]... [--hosts 1|2] [--verbose] [--] CMD [ARG...]

status  report whether rxe can run natively or in a QEMU guest, and what is missing
        (exit 0 when some way exists, 1 otherwise)
run     run CMD where an rxe device is up; exit with CMD's status
        (124: --timeout passed, default 3000 s; 125: the test bed failed, CMD did not run)
        --hosts 2: two QEMU guests joined by a virtio link; CMD runs on host A
        (169.254.78.1), host B (169.254.78.2) runs an agent (aiodat.testing.hosts)
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``rxe status`` / ``rxe run ... -- CMD`` (``aiodat rxe ...``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_USAGE)
        return 0 if args else 2
    sub, rest = args[0], args[1:]
    if sub == "status":
        st = status()
        if "--json" in rest:
            print(json.dumps(st, indent=2))
        else:
            print(format_status(st))
        return 0 if st["method"] else 1
    if sub != "run":
        _msg("rxe: unknown subcommand %r\n%s" % (sub, _USAGE))
        return 2
    opts = {"timeout": 3000.0, "memory": "2G", "cpus": 2, "method": None, "verbose": False,
            "hosts": 1}
    shares: List[str] = []
    i = 0
    try:
        while i < len(rest):
            a = rest[i]
            if a == "--":
                i += 1
                break
            if not a.startswith("-"):
                break
            name, eq, val = a.partition("=")
            if name in ("-v", "--verbose"):
                opts["verbose"] = True
                i += 1
                continue
            if name in ("-h", "--help"):
                sys.stdout.write(_USAGE)
                return 0
            if name not in ("--timeout", "--memory", "--cpus", "--method", "--share", "--hosts"):
                raise ValueError("unknown option %s" % a)
            if not eq:
                i += 1
                if i >= len(rest):
                    raise ValueError("%s needs a value" % name)
                val = rest[i]
            i += 1
            if name == "--timeout":
                opts["timeout"] = float(val)
            elif name == "--cpus":
                opts["cpus"] = int(val)
            elif name == "--hosts":
                opts["hosts"] = int(val)
                if opts["hosts"] not in (1, 2):
                    raise ValueError("--hosts must be 1 or 2")
            elif name == "--share":
                shares.append(os.path.abspath(val))
            else:
                opts[name[2:]] = val
    except ValueError as e:
        _msg("rxe run: %s\n%s" % (e, _USAGE))
        return 2
    cmd = rest[i:]
    if not cmd:
        _msg("rxe run: no command\n" + _USAGE)
        return 2
    rw = None
    if shares:
        rw = [os.getcwd()] + shares
    def on_term(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, on_term)
    try:
        return run(cmd, timeout=opts["timeout"], memory=opts["memory"], cpus=opts["cpus"],
                   method=opts["method"], verbose=opts["verbose"], rw_paths=rw, hosts=opts["hosts"])
    except KeyboardInterrupt:
        _msg("aiodat rxe: interrupted")
        return 130
    except _Terminated:
        _msg("aiodat rxe: terminated")
        return 128 + signal.SIGTERM
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


class _Terminated(BaseException):
    """SIGTERM in the CLI: unwinds like KeyboardInterrupt so QEMU is killed."""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
