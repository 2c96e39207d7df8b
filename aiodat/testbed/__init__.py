"""The rxe test bed: run a command where a Soft-RoCE (rxe) device is up.

Two ways, chosen by :func:`status`:

``native``
    We are root on a kernel that has (or can load) ``rdma_rxe``: load the
    modules, create a dummy netdev ``aiodat0`` with ``169.254.77.1/24``, add an
    rxe device on it, run the command, and remove what we created
    (:mod:`aiodat.testbed.native`).

``qemu``
    Everywhere else (the usual case on development machines whose kernel has
    no RDMA at all): boot a throwaway QEMU guest with the distribution's own
    kernel over the host's ``/`` exported read-only via virtio-9p with a tmpfs
    overlay on top, bring rxe up inside, and run the command there
    (:mod:`aiodat.testbed.qemu`; two guests joined by a link:
    :mod:`aiodat.testbed.qemu_pair`, driven from inside by
    :mod:`aiodat.testbed.hosts`).

The package is pure standard library and imports nothing else from aiodat, so
it works before the C extension is built: ``python3 aiodat/testbed run -- CMD``.
See docs/testbed.md.

Modules: ``probe`` (what the machine offers: :func:`status`), ``modules`` (kernels and their
modules), ``initramfs`` (the cpio writer and the first stage), ``guest`` (a
guest's scripts and QEMU command line), ``qemu`` (one guest), ``qemu_pair``
(two guests), ``native``, ``hosts`` (two-host control, inside the guests),
``runner`` (:func:`run`) and ``command`` (the ``rxe`` command line, :func:`main`).
"""
from __future__ import annotations

from ._common import ADDR, EXIT_TESTBED_FAILED, EXIT_TIMEOUT, HOST_ADDRS, NETDEV
from .command import main
from .initramfs import CpioWriter
from .runner import run
from .probe import format_status, status

__all__ = [
    "ADDR",
    "NETDEV",
    "HOST_ADDRS",
    "EXIT_TIMEOUT",
    "EXIT_TESTBED_FAILED",
    "status",
    "format_status",
    "run",
    "main",
    "CpioWriter",
]
