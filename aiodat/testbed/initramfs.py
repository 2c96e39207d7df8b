"""The guest's initramfs: a newc cpio writer and the first stage (static busybox, the 9p and overlayfs
modules, ``/init``), cached per kernel."""
from __future__ import annotations

import glob
import hashlib
import io
import os
import stat
import tempfile
import time
from typing import IO, Optional, Tuple

from ._common import cache_dir
from .modules import MODULE_SUFFIXES, STAGE1_TARGETS, Kernel, load_order, read_module


FORMAT_VERSION = "1"  # bump when the initramfs layout or /init changes


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


INIT_SCRIPT = r"""#!/bin/sh
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


def build_initramfs(kernel: Kernel, busybox: str) -> str:
    """Path of the cached initramfs for ``kernel``, (re)built when stale."""
    order = load_order(kernel.modules, STAGE1_TARGETS)
    key = hashlib.sha256()
    key.update(FORMAT_VERSION.encode())
    key.update(INIT_SCRIPT.encode())
    for p in [busybox] + [os.path.join(kernel.modules, m) for m in order]:
        s = os.stat(p)
        key.update(("%s:%d:%d\n" % (p, s.st_size, s.st_mtime_ns)).encode())
    digest = key.hexdigest()[:16]
    cache = cache_dir()
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
        data = read_module(os.path.join(kernel.modules, rel))
        name = os.path.basename(rel)
        for suf in MODULE_SUFFIXES:
            if name.endswith(suf):
                name = name[: -len(suf)] + ".ko"
                break
        w.add_file("lib/modules/" + name, data)
        names.append(name)
    w.add_file("modules.order", ("\n".join(names) + "\n").encode())
    w.add_file("init", INIT_SCRIPT.encode(), 0o755)
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
