"""The native path: rxe on this host's own kernel (root, ``rdma_rxe`` loadable), set up around the
command and removed after it."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import tempfile
import time
from typing import List, Mapping, Optional

from . import modules
from ._common import (ADDR, EXIT_TESTBED_FAILED, EXIT_TIMEOUT, NATIVE_DEVICE, NETDEV, PREFIXLEN, caller_env,
                      gid_for, msg)
from ._proc import Pump, child_setup, kill_group, write_out


def sh(argv: List[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a set-up tool; RuntimeError with its message if it fails and ``check``."""
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if check and res.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(argv), (res.stderr or res.stdout).strip()))
    return res


def rxe_on(netdev: str) -> Optional[str]:
    """The rxe device bound to ``netdev``, if any."""
    res = sh(["rdma", "-j", "link", "show"], check=False)
    if res.returncode == 0:
        try:
            for link in json.loads(res.stdout or "[]"):
                dev = link.get("ifname")
                if link.get("netdev") == netdev and dev:
                    return dev
        except (ValueError, AttributeError):
            pass
    res = sh(["rdma", "link", "show"], check=False)
    for line in res.stdout.splitlines():
        m = re.match(r"link (\S+)/\d+ .*\bnetdev (\S+)", line)
        if m and m.group(2) == netdev:
            return m.group(1)
    return None


def run_native(cmd: List[str], deadline: float, timeout: float,
                env: Optional[Mapping[str, str]], cwd: str) -> int:
    """Bring rxe up on this host (under a lock), run ``cmd``, remove what we created; its exit status."""
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
                    msg("aiodat rxe: deadline of %g s passed waiting for another native run" % timeout)
                    return EXIT_TIMEOUT
                time.sleep(0.2)
        try:
            if not os.path.isdir("/sys/module/rdma_rxe"):
                sh(["modprobe", "-a"] + list(modules.GUEST_MODULES))
            else:
                sh(["modprobe", "-a"] + list(modules.GUEST_MODULES), check=False)
            if not os.path.isdir("/sys/class/net/" + NETDEV):
                sh(["ip", "link", "add", NETDEV, "type", "dummy"])
                undo.append(["ip", "link", "del", NETDEV])
            addrs = sh(["ip", "-o", "-4", "addr", "show", "dev", NETDEV]).stdout
            if (" %s/" % ADDR) not in addrs:
                sh(["ip", "addr", "add", "%s/%d" % (ADDR, PREFIXLEN), "dev", NETDEV])
                if not undo:
                    undo.append(["ip", "addr", "del", "%s/%d" % (ADDR, PREFIXLEN), "dev", NETDEV])
            with open("/sys/class/net/%s/flags" % NETDEV) as f:
                was_up = int(f.read(), 16) & 1
            if not was_up:
                sh(["ip", "link", "set", NETDEV, "up"])
                if not any(u[:3] == ["ip", "link", "del"] for u in undo):
                    undo.append(["ip", "link", "set", NETDEV, "down"])
            sh(["ip", "link", "set", "lo", "up"], check=False)
            device = rxe_on(NETDEV)
            if device is None:
                device = NATIVE_DEVICE
                sh(["rdma", "link", "add", device, "type", "rxe", "netdev", NETDEV])
                undo.insert(0, ["rdma", "link", "delete", device])
            port = "/sys/class/infiniband/%s/ports/1" % device
            gid = gid_for(ADDR)
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
            msg("aiodat rxe: could not bring rxe up natively, the command did not run: %s" % e)
            return EXIT_TESTBED_FAILED

        return run_command(cmd, deadline, timeout, caller_env(env, cwd, "native", device), cwd)
    finally:
        for argv in undo:
            sh(argv, check=False)
        lockf.close()


def run_command(cmd: List[str], deadline: float, timeout: float, env: Mapping[str, str], cwd: str) -> int:
    """Run ``cmd`` (in a session of its own, output forwarded to ours) until it exits or ``deadline``
    passes; its exit status, 128+N for signal N, or :data:`EXIT_TIMEOUT`."""
    preexec = child_setup(memlock=True)

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out_w, stderr=err_w,
                                start_new_session=True, preexec_fn=preexec)
    except OSError as e:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        msg("aiodat rxe: cannot run %s: %s" % (cmd[0], e))
        return 127 if isinstance(e, FileNotFoundError) else 126
    os.close(out_w)
    os.close(err_w)
    pumps = [Pump(out_r, lambda d: write_out("stdout", d)),
             Pump(err_r, lambda d: write_out("stderr", d))]
    for p in pumps:
        p.start()
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        for p in pumps:
            p.join(timeout=5)
        msg("aiodat rxe: deadline of %g s passed; command killed" % timeout)
        return EXIT_TIMEOUT
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise
    # what it left in the background goes too: it would hold rxe (rdma link delete fails) and our
    # output pipes (the pumps would wait)
    kill_group(proc)
    for p in pumps:
        p.join(timeout=5)
    return rc if rc >= 0 else 128 - rc
