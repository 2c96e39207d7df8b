"""Booting and running one QEMU guest: its run directory, the QEMU process and output, the result
(the command's exit status, or a diagnosis with the console's last lines)."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ._common import EXIT_TESTBED_FAILED, EXIT_TIMEOUT, GUEST_DEVICE, cache_dir, caller_env, msg, tail_of
from ._proc import Pump, child_setup, host_tty_size, kill_group, write_out
from .guest import GuestPlan, qemu_argv, run_script, stage2_script
from .initramfs import build_initramfs
from .modules import Kernel, find_kernels
from .probe import format_status, status


QEMU_TIMEOUT_MSG = "deadline of {:g} s passed {}; QEMU killed"


def run_qemu(cmd: List[str], deadline: float, timeout: float, memory: str, cpus: int,
              env: Optional[Mapping[str, str]], cwd: str, verbose: bool,
              rw_paths: Optional[Sequence[str]]) -> int:
    """Run ``cmd`` in one QEMU guest; its exit status (or :data:`EXIT_TIMEOUT` / :data:`EXIT_TESTBED_FAILED`)."""
    prep = prepare_guests(env, cwd, rw_paths)
    if prep is None:
        return EXIT_TESTBED_FAILED
    q, kernel, guest_env, tty_size, rw, initrd = prep
    plan = GuestPlan(
        index=0, cmd=list(cmd), cwd=cwd, env=guest_env, tty_size=tty_size,
        rw_paths=rw, kernel=kernel, busybox=q["busybox"],
        qemu=q["qemu"], memory=memory, cpus=cpus, accel=q["accel"], verbose=verbose,
    )
    guest = Guest(plan, initrd)
    return guest.run(deadline, timeout)


def prepare_guests(env: Optional[Mapping[str, str]], cwd: str, rw_paths: Optional[Sequence[str]]) -> Optional[
        Tuple[Dict[str, Any], "Kernel", Dict[str, str], Any, List[str], str]]:
    """What every guest of a run shares: QEMU's facts, the kernel, the caller's environment,
    the tty size, the read-write shares and the initramfs; None (after saying why) if it cannot boot."""
    st = status()
    q = st["qemu"]
    if not q["usable"]:
        msg("aiodat rxe: cannot boot a QEMU guest here.\n" + format_status(st))
        return None
    kernel = find_kernels()[0]
    guest_env = caller_env(env, cwd, "qemu", GUEST_DEVICE)
    tty_size = host_tty_size()
    if tty_size is None and not any(k in guest_env for k in ("FORCE_COLOR", "PY_COLORS")):
        # The command's stdout in the guest is a serial tty; where ours is not
        # a terminal, tell tools so (no colours, no progress bars), as here.
        guest_env["TERM"] = "dumb"
    if rw_paths is None:
        rw_paths = [] if os.path.realpath(cwd) == "/" else [os.path.realpath(cwd)]
    rw = [os.path.realpath(p) for p in rw_paths]
    try:
        initrd = build_initramfs(kernel, q["busybox"])
    except (OSError, LookupError, RuntimeError, subprocess.CalledProcessError) as e:
        msg("aiodat rxe: cannot build the initramfs: %s" % e)
        return None
    return q, kernel, guest_env, tty_size, rw, initrd


KEEP_FAILED_RUNS = 10


def prune_runs(runs: str, keep: str) -> None:
    """Keep the newest few run directories of failed runs (for debugging)."""
    try:
        dirs = sorted((d for d in os.listdir(runs) if not d.startswith(".")),
                      key=lambda d: os.stat(os.path.join(runs, d)).st_mtime)
    except OSError:
        return
    for d in dirs[:-KEEP_FAILED_RUNS]:
        path = os.path.join(runs, d)
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


class Guest:
    """One QEMU guest: its run directory, process, output pumps and result."""

    def __init__(self, plan: GuestPlan, initrd: str) -> None:
        self.plan = plan
        self.initrd = initrd
        runs = os.path.join(cache_dir(), "runs")
        os.makedirs(runs, exist_ok=True)
        self.rundir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs)
        self.ctl = os.path.join(self.rundir, "ctl")
        os.mkdir(self.ctl)
        self.console_log = os.path.join(self.rundir, "console.log")
        self.qemu_log = os.path.join(self.rundir, "qemu.log")
        self.proc: Optional[subprocess.Popen] = None
        self.pumps: List[Pump] = []
        self.ok = False
        self.t0 = time.monotonic()

    def write_ctl(self) -> None:
        """Write the second stage and the command's script into the control share."""
        with open(os.path.join(self.ctl, "stage2.sh"), "w") as f:
            f.write(stage2_script(self.plan))
        with open(os.path.join(self.ctl, "run.sh"), "w") as f:
            f.write(run_script(self.plan))

    def diagnose(self, why: str, console: bool = True) -> None:
        """Say why the run failed, with the console's and QEMU's last lines; keep the run directory."""
        parts = ["aiodat rxe: " + why]
        tail = tail_of(self.console_log) if console else ""
        if tail:
            parts.append("--- last lines of the guest console (%s) ---\n%s" % (self.console_log, tail))
        qtail = tail_of(self.qemu_log, 15)
        if qtail:
            parts.append("--- QEMU's own messages (%s) ---\n%s" % (self.qemu_log, qtail))
        parts.append("aiodat rxe: run directory kept: " + self.rundir)
        msg("\n".join(parts))
        prune_runs(os.path.dirname(self.rundir), keep=self.rundir)

    def finish_ok(self) -> None:
        """After a good run: keep the console log as ``last-console.log``, remove the run directory."""
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
        self.write_ctl()
        pipes = {name: os.pipe() for name in ("con", "out", "err")}
        fds = {name: w for name, (r, w) in pipes.items()}
        argv = qemu_argv(self.plan, self.initrd, self.ctl, fds)
        with open(os.path.join(self.rundir, "qemu.argv"), "w") as f:
            f.write(" ".join(shlex.quote(a) for a in argv) + "\n")
        self.console = open(self.console_log, "wb")
        console = self.console
        verbose = self.plan.verbose
        sink = out_sink or write_out

        def con_sink(data: bytes) -> None:
            console.write(data)
            console.flush()
            if verbose:
                write_out("stderr", data)

        pumps = [
            Pump(pipes["con"][0], con_sink),
            Pump(pipes["out"][0], lambda d: sink("stdout", d)),
            Pump(pipes["err"][0], lambda d: sink("stderr", d)),
        ]
        self.t0 = time.monotonic()
        self.qlog = open(self.qemu_log, "wb")
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self.qlog, stderr=subprocess.STDOUT,
                pass_fds=tuple(fds.values()), start_new_session=True,
                preexec_fn=child_setup(),
            )
        except OSError as e:
            for r, w in pipes.values():
                os.close(r)
                os.close(w)
            self.qlog.close()
            self.console.close()
            self.proc = None
            self.diagnose("cannot start QEMU: %s" % e)
            return False
        for w in fds.values():
            os.close(w)
        # only now: close() joins self.pumps, and a thread never started cannot be joined
        self.pumps = pumps
        for p in self.pumps:
            p.start()
        return True

    def kill(self) -> None:
        """Kill QEMU (if running) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)
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
        ready = self.read_ctl("ready")
        exit_file = self.read_ctl("exitstatus")
        who = (name + ": ") if name else ""
        if timed_out:
            where = "while the command ran" if ready else "before rxe came up in the guest"
            self.diagnose(who + QEMU_TIMEOUT_MSG.format(timeout, where) + " after %.1f s" % elapsed,
                           console=not ready)
            return EXIT_TIMEOUT
        err = self.read_ctl("setup-error")
        if err is not None:
            self.diagnose(who + "the guest could not bring rxe up, the command did not run: " + err.strip())
            return EXIT_TESTBED_FAILED
        if exit_file is None:
            assert self.proc is not None  # (a result is asked only after start() succeeded)
            self.diagnose(who + "QEMU exited (status %s) after %.1f s without the command's exit status%s"
                           % (self.proc.returncode, elapsed, "" if ready else "; rxe never came up"))
            return EXIT_TESTBED_FAILED
        try:
            rc = int(exit_file.strip())
        except ValueError:
            self.diagnose(who + "unreadable exit status %r" % exit_file)
            return EXIT_TESTBED_FAILED
        if self.plan.verbose:
            msg("aiodat rxe: %srxe up %s s after the guest kernel started; QEMU ran %.1f s; status %d"
                 % (who, (ready or "?").strip(), elapsed, rc))
        self.ok = True
        return rc

    def run(self, deadline: float, timeout: float) -> int:
        """Boot, wait for the end or the deadline, and return the exit status."""
        if not self.start():
            return EXIT_TESTBED_FAILED
        assert self.proc is not None  # (start() succeeded)
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
            self.finish_ok()
        return rc

    def read_ctl(self, name: str) -> Optional[str]:
        """A file the guest left in the control share, or None."""
        try:
            with open(os.path.join(self.ctl, name)) as f:
                return f.read()
        except OSError:
            return None
