"""What the machine offers for the test bed: native rxe, or what a QEMU guest needs (QEMU, a kernel
with rdma_rxe, a static busybox, KVM or TCG), and the Debian packages that are missing."""
from __future__ import annotations

import glob
import os
import platform
import struct
from typing import List, Optional, Tuple

from ._common import under, which
from .modules import STAGE1_TARGETS, builtin_modules, find_kernels, find_module, load_order


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


def elf_is_static(path: str) -> bool:
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


def find_busybox(root: str = "/") -> Tuple[Optional[str], Optional[str]]:
    """(static busybox, any busybox) paths."""
    cands = []
    w = which("busybox", root)
    if w:
        cands.append(under(root, w))
    for p in ("/bin/busybox", "/usr/bin/busybox", "/sbin/busybox", "/usr/sbin/busybox"):
        cands.append(under(root, p))
    any_bb = None
    for c in cands:
        if os.path.isfile(c):
            any_bb = any_bb or c
            if elf_is_static(c):
                return c, c
    return None, any_bb


def kvm_usable(root: str = "/") -> Tuple[bool, str]:
    """Whether ordinary KVM is there (a ``kvm_intel``/``kvm_amd`` module and a usable /dev/kvm), and why."""
    mods = [m for m in ("kvm_intel", "kvm_amd") if os.path.isdir(under(root, "/sys/module/" + m))]
    dev = under(root, "/dev/kvm")
    if not mods:
        extra = ""
        if os.path.isdir(under(root, "/sys/module/kvm")):
            extra = " (a bare 'kvm' module is a nested hypervisor that hangs stock kernels)"
        return False, "no kvm_intel/kvm_amd module" + extra + ": using TCG"
    if not os.path.exists(dev):
        return False, "%s loaded but no /dev/kvm: using TCG" % mods[0]
    if root in ("", "/") and not os.access(dev, os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible to this user: using TCG"
    return True, "%s and /dev/kvm present" % mods[0]


def native_check(root: str = "/") -> Tuple[bool, str]:
    """Whether the native path can run here (root, a kernel with rdma_rxe, the tools), and why."""
    release = platform.release() if root in ("", "/") else ""
    ib = under(root, "/sys/class/infiniband")
    loaded = os.path.isdir(under(root, "/sys/module/rdma_rxe"))
    moddir = under(root, "/lib/modules/" + release) if release else ""
    loadable = bool(moddir) and os.path.isdir(moddir) and (
        find_module(moddir, "rdma_rxe") is not None or "rdma_rxe" in builtin_modules(moddir))
    if not (loaded or loadable):
        why = "kernel %s has no rdma_rxe (no /sys/module/rdma_rxe, no module in /lib/modules/%s)" % (
            release or "?", release or "?")
        if not os.path.isdir(ib):
            why += ", no /sys/class/infiniband"
        return False, why
    if os.geteuid() != 0:
        return False, "kernel can run rdma_rxe but we are not root"
    missing = [t for t in ("ip", "rdma") if not which(t, root)]
    if not loaded and not which("modprobe", root):
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
    native_ok, native_why = native_check(root)
    st["native"] = {"usable": native_ok, "reason": native_why}

    missing: List[str] = []
    recommended: List[str] = []
    q: dict = {}
    qemu = which("qemu-system-x86_64", root)
    q["qemu"] = qemu
    if not qemu:
        missing.append(PACKAGES["qemu"])
    kernels = find_kernels(root)
    if kernels:
        k = kernels[0]
        q["kernel"] = k.image
        q["kernel_version"] = k.version
        q["modules"] = k.modules
        try:
            order = load_order(k.modules, STAGE1_TARGETS)
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
    bb_static, bb_any = find_busybox(root)
    q["busybox"] = bb_static
    if not bb_static:
        missing.append(PACKAGES["busybox"])
        if bb_any:
            q["busybox_note"] = "%s is dynamically linked; the initramfs needs busybox-static" % bb_any
    kvm_ok, kvm_why = kvm_usable(root)
    q["accel"] = "kvm" if kvm_ok else "tcg"
    q["accel_reason"] = kvm_why

    tools = {t: which(t, root) for t in ("ip", "rdma", "modprobe", "ibv_devinfo", "rping", "ib_send_lat")}
    st["tools"] = tools
    if not tools["ip"] or not tools["rdma"]:
        missing.append(PACKAGES["iproute2"])
    if not tools["modprobe"]:
        missing.append(PACKAGES["kmod"])
    if not os.path.isdir(under(root, "/etc/rdma")):
        missing.append(PACKAGES["rdma-core"])
    libdirs = ["/usr/lib/*/libibverbs", "/usr/lib64/libibverbs", "/usr/lib/libibverbs"]
    if not any(glob.glob(under(root, d + "/librxe-rdmav*.so")) for d in libdirs):
        missing.append(PACKAGES["ibverbs-providers"])
    libs = ["/usr/lib/*/", "/usr/lib64/", "/usr/lib/", "/lib/*/"]
    if not any(glob.glob(under(root, d + "libibverbs.so.1*")) for d in libs):
        missing.append(PACKAGES["libibverbs1"])
    if not any(glob.glob(under(root, d + "librdmacm.so.1*")) for d in libs):
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
