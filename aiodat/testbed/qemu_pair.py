"""Two QEMU guests joined by a virtio link (``aiodat rxe run --hosts 2``): the command on host A, the
:mod:`aiodat.testbed.hosts` agent on host B, both killed when the command ends or anything fails."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from ._common import EXIT_TESTBED_FAILED, GUEST_HOSTS_DIR, HOST_ADDRS, HOST_MACS, msg, tail_of
from ._proc import write_out
from .guest import GuestPlan
from .qemu import Guest, prepare_guests


def hosts_env(base: Dict[str, str], index: int, hosts_dir: str) -> Dict[str, str]:
    """The environment of a command on host ``index`` of a two-host run."""
    out = dict(base)
    out["AIODAT_RXE_ADDR"] = HOST_ADDRS[index]
    out["AIODAT_PEER_ADDR"] = HOST_ADDRS[1 - index]
    out["AIODAT_HOSTS"] = "2"
    out["AIODAT_HOST_INDEX"] = str(index)
    out["AIODAT_HOST_ADDRS"] = ",".join(HOST_ADDRS)
    out["AIODAT_HOSTS_DIR"] = hosts_dir
    return out


def run_qemu_hosts(cmd: List[str], deadline: float, timeout: float, memory: str, cpus: int,
                    env: Optional[Mapping[str, str]], cwd: str, verbose: bool,
                    rw_paths: Optional[Sequence[str]]) -> int:
    """Two guests joined by a virtio NIC each: ``cmd`` runs on host A, an agent on host B."""
    prep = prepare_guests(env, cwd, rw_paths)
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
        plans.append(GuestPlan(
            index=index, cmd=argv, cwd=cwd, env=hosts_env(base_env, index, GUEST_HOSTS_DIR),
            tty_size=tty_size, rw_paths=rw, kernel=kernel, busybox=q["busybox"], qemu=q["qemu"],
            memory=memory, cpus=cpus, accel=q["accel"], verbose=verbose, addr=HOST_ADDRS[index],
            nic=(stream % server, HOST_MACS[index]), wait_for="ready-1" if index == 0 else None,
        ))
    a, b = Guest(plans[0], initrd), Guest(plans[1], initrd)
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
                write_out("stderr", data)

    def b_report(why: str) -> None:
        tail = tail_of(b_log_path, 60)
        if tail:
            why += "\n--- last lines of host B's output (%s) ---\n%s" % (b_log_path, tail)
        b.diagnose("host B: " + why)

    timed_out = False
    b_died = False
    t0 = time.monotonic()
    try:
        if not a.start():
            return EXIT_TESTBED_FAILED
        assert a.proc is not None  # (start() succeeded)
        # host B connects to host A's listening socket: wait until it is there
        while not os.path.exists(sock):
            if a.proc.poll() is not None or time.monotonic() > min(deadline, t0 + 60):
                a.kill()
                a.close()
                a.result(False, timeout, "host A")
                msg("aiodat rxe: host A's QEMU did not open the link socket %s" % sock)
                return EXIT_TESTBED_FAILED
            time.sleep(0.05)
        if not b.start(b_sink):
            a.kill()
            return EXIT_TESTBED_FAILED
        assert b.proc is not None  # (start() succeeded)
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
        assert b.proc is not None  # (B ended, so it had started)
        err = b.read_ctl("setup-error")
        b_report("QEMU of host B ended while host A was still running (%s); host A killed"
                 % ("set-up failed: " + err.strip() if err else "status %s" % b.proc.returncode))
        a.diagnose("host A killed because host B ended", console=a.read_ctl("ready") is None)
        return EXIT_TESTBED_FAILED
    rc = a.result(timed_out, timeout, "host A")
    if a.ok and rc == 0:
        if verbose:
            msg("aiodat rxe: two hosts ran %.1f s" % elapsed)
        a.finish_ok()
        shutil.rmtree(b.rundir, ignore_errors=True)
        return rc
    if timed_out or not a.ok or rc != 0:
        b_report("host A's command %s" % ("did not finish" if timed_out or not a.ok else
                                          "exited with status %d" % rc))
    return rc
