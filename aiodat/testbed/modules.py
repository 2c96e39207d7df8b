"""Kernels and their modules: which kernel can boot a guest with rxe, which module files the
first stage loads (dependencies first, from modules.dep), and their bytes (decompressed)."""
from __future__ import annotations

import dataclasses
import glob
import gzip
import lzma
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

from ._common import under


#: Modules the first stage needs to mount 9p and overlayfs; their
#: dependencies are read from modules.dep.  The fallback order, for a module
#: directory without modules.dep, is the one verified by hand.
STAGE1_TARGETS = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
STAGE1_FALLBACK = (
    "virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
    "virtio_pci", "9pnet", "9pnet_virtio", "netfs", "fscache", "9p", "overlay",
)
GUEST_MODULES = ("rdma_rxe", "ib_uverbs", "rdma_ucm", "dummy")
#: Extra modules in two-host guests: the virtio NIC and tc netem for faults.
NIC_MODULES = ("virtio_net", "sch_netem")


MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")


def version_key(v: str) -> Tuple:
    """A sort key for kernel versions (numbers compare as numbers)."""
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.\-+~]", v))


@dataclasses.dataclass
class Kernel:
    """A kernel that can boot a guest: its version, image and module directory."""
    version: str
    image: str          # /boot/vmlinuz-<version>
    modules: str        # /lib/modules/<version>


def find_module(moddir: str, name: str) -> Optional[str]:
    """Path of module ``name`` (relative to moddir) from modules.dep, or by search."""
    names = {name, name.replace("-", "_"), name.replace("_", "-")}
    dep = os.path.join(moddir, "modules.dep")
    try:
        with open(dep) as f:
            for line in f:
                path = line.split(":", 1)[0]
                base = os.path.basename(path)
                for suf in MODULE_SUFFIXES:
                    if base.endswith(suf) and base[: -len(suf)] in names:
                        return path
    except OSError:
        pass
    for suf in MODULE_SUFFIXES:
        for n in names:
            hits = glob.glob(os.path.join(moddir, "kernel", "**", n + suf), recursive=True)
            if hits:
                return os.path.relpath(hits[0], moddir)
    return None


def builtin_modules(moddir: str) -> set:
    """Names of the modules built into the kernel (from ``modules.builtin``)."""
    out = set()
    try:
        with open(os.path.join(moddir, "modules.builtin")) as f:
            for line in f:
                base = os.path.basename(line.strip())
                for suf in MODULE_SUFFIXES:
                    if base.endswith(suf):
                        out.add(base[: -len(suf)].replace("-", "_"))
    except OSError:
        pass
    return out


def load_order(moddir: str, targets: Sequence[str]) -> List[str]:
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
    builtin = builtin_modules(moddir)
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
            p = find_module(moddir, t)
            if p is None:
                raise LookupError(t)
            visit(p)
        return order
    for t in STAGE1_FALLBACK:
        if t in builtin:
            continue
        p = find_module(moddir, t)
        if p is None:
            raise LookupError(t)
        order.append(p)
    return order


def find_kernels(root: str = "/") -> List[Kernel]:
    """Kernels with an image and a module tree that has rdma_rxe, newest first."""
    found = []
    for image in glob.glob(under(root, "/boot/vmlinuz-*")):
        version = os.path.basename(image)[len("vmlinuz-"):]
        moddir = under(root, "/lib/modules/" + version)
        if not os.path.isdir(moddir):
            continue
        if find_module(moddir, "rdma_rxe") is None and "rdma_rxe" not in builtin_modules(moddir):
            continue
        found.append(Kernel(version, image, moddir))
    found.sort(key=lambda k: version_key(k.version), reverse=True)
    return found


def read_module(path: str) -> bytes:
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
