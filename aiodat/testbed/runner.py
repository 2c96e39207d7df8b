"""``run``: pick the way (native, one QEMU guest, two guests) and run the command there."""
from __future__ import annotations

import math
import os
import time
from typing import Mapping, Optional, Sequence

from ._common import EXIT_TESTBED_FAILED, msg
from .native import run_native
from .qemu import run_qemu
from .qemu_pair import run_qemu_hosts
from .probe import format_status, status


def run(cmd: Sequence[str], *, timeout: float, memory: str = "2G", cpus: int = 2,
        env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
        method: Optional[str] = None, verbose: bool = False,
        rw_paths: Optional[Sequence[str]] = None, hosts: int = 1) -> int:
    """Run ``cmd`` where an rxe device is up; return its exit status.

    ``hosts=2`` boots two QEMU guests joined by a virtio NIC each (see
    docs/testbed.md, "Two hosts"): ``cmd`` runs on host A, an agent on host
    B runs what :mod:`aiodat.testbed.hosts` asks it to; the deadline covers
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
    if not (math.isfinite(timeout) and timeout > 0):  # (NaN: one host times out at once, two never)
        raise ValueError("timeout must be finite and > 0, not %r" % (timeout,))
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
        return run_qemu_hosts(cmd, deadline, timeout, memory, cpus, env, cwd, verbose, rw_paths)
    if method is None:
        st = status()
        method = st["method"]
        if method is None:
            msg("aiodat rxe: no way to run rxe on this machine.\n" + format_status(st))
            return EXIT_TESTBED_FAILED
    if method == "native":
        return run_native(cmd, deadline, timeout, env, cwd)
    if method == "qemu":
        return run_qemu(cmd, deadline, timeout, memory, cpus, env, cwd, verbose, rw_paths)
    raise ValueError("method must be 'native', 'qemu' or None, not %r" % (method,))
