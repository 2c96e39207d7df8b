"""Run processes on either host of a two-host test bed, and inject link faults.

``aiodat rxe run --hosts 2 -- CMD`` (see docs/testbed.md, "Two hosts") boots
two QEMU guests, each with its own rxe device on a virtio NIC, joined by a
QEMU stream netdev over a host Unix socket.  CMD runs on host A (index 0);
host B (index 1) runs :func:`agent`.  The two talk through **mailboxes**: a
directory of the host both guests mount over 9p (``$AIODAT_HOSTS_DIR``), not
over the RDMA link itself, so the control channel keeps working while a test
drops packets, delays them or takes the link down.

Protocol (one file per step, each written to a temporary name and renamed,
so a reader never sees half a file)::

    req/<id>.json      the request: argv, env, cwd          (written by the caller)
    started/<id>.json  {"pid": ...}: the process runs       (agent)
    out/<id>.stdout    its stdout, out/<id>.stderr its stderr (agent, as it runs)
    kill/<id>          a signal number to send to the process group (caller)
    done/<id>.json     {"rc": ...}: the exit status, 128+N after signal N (agent)
    ready-<index>      the agent of host <index> is up      (agent)

``run_on(host, argv)`` / ``start_on(host, argv)`` work the same whether
``host`` is the caller's own host (a local subprocess) or the peer (through
the mailbox), so a test can run the server on B and the client on A and kill
either.  :func:`netem`, :func:`clear_netem` and :func:`link` inject faults
with ``tc qdisc ... netem`` and ``ip link set dev ... down/up`` on either side.

Pure standard library; also runs as a script (``python hosts.py agent``).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = [
    "HostsUnavailable", "Result", "RemoteProcess", "available", "count", "this_host", "peer",
    "address", "netdev", "run_on", "start_on", "arun_on", "netem", "clear_netem", "link", "agent",
]

#: Poll interval of the mailbox (seconds).
POLL = 0.02


class HostsUnavailable(RuntimeError):
    """Not inside a two-host test bed (``AIODAT_HOSTS`` is not 2)."""


@dataclass(frozen=True)
class Result:
    """What a finished process left: exit status (128+N after signal N), stdout, stderr."""

    rc: int
    stdout: str
    stderr: str

    def check(self, what: str = "command") -> "Result":
        """Raise RuntimeError with the output when ``rc`` is not 0."""
        if self.rc != 0:
            raise RuntimeError("%s exited with %d\n--- stdout ---\n%s\n--- stderr ---\n%s"
                               % (what, self.rc, self.stdout[-4000:], self.stderr[-4000:]))
        return self


def available() -> bool:
    """True inside a two-host test bed."""
    return os.environ.get("AIODAT_HOSTS") == "2" and bool(os.environ.get("AIODAT_HOSTS_DIR"))


def _need() -> None:
    if not available():
        raise HostsUnavailable("not in a two-host test bed: run under `aiodat rxe run --hosts 2 -- CMD`")


def count() -> int:
    """Number of hosts in this test bed (1 outside a two-host run)."""
    return 2 if available() else 1


def this_host() -> int:
    """Index of the host we run on (0 = A, 1 = B)."""
    _need()
    return int(os.environ.get("AIODAT_HOST_INDEX", "0"))


def peer() -> int:
    """Index of the other host."""
    return 1 - this_host()


def address(host: int) -> str:
    """IPv4 address of ``host``'s rxe netdev."""
    _need()
    return os.environ["AIODAT_HOST_ADDRS"].split(",")[host]


def netdev() -> str:
    """Name of the rxe netdev on every host (``aiodat0``)."""
    return os.environ.get("AIODAT_RXE_NETDEV", "aiodat0")


def _dir() -> str:
    _need()
    return os.environ["AIODAT_HOSTS_DIR"]


def _write_atomic(path: str, data: str) -> None:
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(data)
    os.rename(tmp, path)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


_ids = itertools.count()


class RemoteProcess:
    """A process started by :func:`start_on` on either host."""

    def __init__(self, host: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None) -> None:
        self.host = host
        self.argv = list(argv)
        self._local: Optional[subprocess.Popen] = None
        self._rc: Optional[int] = None
        if host == this_host():
            d = os.path.join(_dir(), "local")
            os.makedirs(d, exist_ok=True)
            self.id = "%d-%d-%d" % (host, os.getpid(), next(_ids))
            self._out = os.path.join(d, self.id + ".stdout")
            self._err = os.path.join(d, self.id + ".stderr")
            with open(self._out, "wb") as o, open(self._err, "wb") as e:
                self._local = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                               env=None if env is None else {**os.environ, **env},
                                               cwd=cwd, start_new_session=True)
            return
        base = _dir()
        if not os.path.exists(os.path.join(base, "ready-%d" % host)):
            raise HostsUnavailable("the agent of host %d is not up" % host)
        self.id = "%d-%d-%d" % (this_host(), os.getpid(), next(_ids))
        self._out = os.path.join(base, "out", self.id + ".stdout")
        self._err = os.path.join(base, "out", self.id + ".stderr")
        req = {"argv": self.argv, "env": env or {}, "cwd": cwd or os.getcwd()}
        _write_atomic(os.path.join(base, "req", self.id + ".json"), json.dumps(req))

    @property
    def pid(self) -> Optional[int]:
        """The process id on its host once it runs (None until then)."""
        if self._local is not None:
            return self._local.pid
        text = _read(os.path.join(_dir(), "started", self.id + ".json"))
        return json.loads(text)["pid"] if text else None

    def wait_started(self, timeout: float = 60.0) -> int:
        """Wait until the process runs; return its pid."""
        end = time.monotonic() + timeout
        while True:
            pid = self.pid
            if pid is not None:
                return pid
            if time.monotonic() > end:
                raise TimeoutError("process %s did not start on host %d within %g s" % (self.argv, self.host, timeout))
            time.sleep(POLL)

    def poll(self) -> Optional[int]:
        """The exit status if the process has ended, else None."""
        if self._rc is not None:
            return self._rc
        if self._local is not None:
            rc = self._local.poll()
            if rc is not None:
                self._rc = rc if rc >= 0 else 128 - rc
        else:
            text = _read(os.path.join(_dir(), "done", self.id + ".json"))
            if text:
                self._rc = int(json.loads(text)["rc"])
        return self._rc

    def wait(self, timeout: Optional[float] = None) -> Result:
        """Wait for the end; TimeoutError (the process keeps running) after ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                assert timeout is not None  # (end is set only with a timeout)
                raise TimeoutError("process %s on host %d still runs after %g s" % (self.argv, self.host, timeout))
            time.sleep(POLL)
        return Result(self._rc, self.stdout(), self.stderr())  # type: ignore[arg-type]

    async def wait_async(self, timeout: Optional[float] = None) -> Result:
        """:meth:`wait` without blocking the event loop."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                assert timeout is not None  # (end is set only with a timeout)
                raise TimeoutError("process %s on host %d still runs after %g s" % (self.argv, self.host, timeout))
            await asyncio.sleep(POLL * 5)
        return Result(self._rc, self.stdout(), self.stderr())  # type: ignore[arg-type]

    def stdout(self) -> str:
        """Its stdout so far."""
        return _read(self._out) or ""

    def stderr(self) -> str:
        """Its stderr so far."""
        return _read(self._err) or ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group (SIGKILL by default)."""
        if self._local is not None:
            try:
                os.killpg(self._local.pid, sig)
            except ProcessLookupError:
                pass
            return
        _write_atomic(os.path.join(_dir(), "kill", self.id), str(int(sig)))

    async def wait_output(self, text: str, timeout: float = 60.0) -> str:
        """Wait until ``text`` appears in its stdout; return the stdout.  Raises
        RuntimeError when the process ends first, TimeoutError after ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            out = self.stdout()
            if text in out:
                return out
            if self.poll() is not None:
                out = self.stdout()
                if text in out:
                    return out
                assert self._rc is not None  # (poll() returned it)
                raise RuntimeError("process %s on host %d ended (%d) before printing %r\n%s\n%s"
                                   % (self.argv, self.host, self._rc, text, out[-2000:], self.stderr()[-4000:]))
            if time.monotonic() > end:
                raise TimeoutError("process %s on host %d did not print %r within %g s\n%s"
                                   % (self.argv, self.host, text, timeout, self.stderr()[-4000:]))
            await asyncio.sleep(POLL * 5)


def start_on(host: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
             cwd: Optional[str] = None) -> RemoteProcess:
    """Start ``argv`` on ``host`` (the caller's environment plus ``env``); do not wait."""
    return RemoteProcess(host, argv, env, cwd)


def run_on(host: int, argv: Sequence[str], timeout: float = 120.0, env: Optional[Dict[str, str]] = None,
           cwd: Optional[str] = None) -> Result:
    """Run ``argv`` on ``host`` and wait for it (killed after ``timeout``: TimeoutError)."""
    p = start_on(host, argv, env, cwd)
    try:
        return p.wait(timeout)
    except TimeoutError:
        p.kill()
        raise


async def arun_on(host: int, argv: Sequence[str], timeout: float = 120.0,
                  env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> Result:
    """:func:`run_on` without blocking the event loop."""
    p = start_on(host, argv, env, cwd)
    try:
        return await p.wait_async(timeout)
    except TimeoutError:
        p.kill()
        raise


async def netem(host: int, *, loss: Optional[float] = None, delay_ms: Optional[float] = None,
                jitter_ms: Optional[float] = None, reorder: Optional[float] = None) -> None:
    """Apply ``tc qdisc replace dev aiodat0 root netem ...`` on ``host`` (egress).

    ``loss`` and ``reorder`` are percentages; reordering needs a delay.
    """
    args = ["tc", "qdisc", "replace", "dev", netdev(), "root", "netem", "limit", "10000"]
    if delay_ms is not None:
        args += ["delay", "%gms" % delay_ms]
        if jitter_ms is not None:
            args += ["%gms" % jitter_ms]
    if loss is not None:
        args += ["loss", "%g%%" % loss]
    if reorder is not None:
        args += ["reorder", "%g%%" % reorder]
    (await arun_on(host, args, timeout=60)).check(" ".join(args))


async def clear_netem(host: int) -> None:
    """Remove any qdisc set by :func:`netem` on ``host`` (no error if none)."""
    await arun_on(host, ["tc", "qdisc", "del", "dev", netdev(), "root"], timeout=60)


async def link(host: int, up: bool) -> None:
    """``ip link set dev aiodat0 up|down`` on ``host``."""
    args = ["ip", "link", "set", "dev", netdev(), "up" if up else "down"]
    (await arun_on(host, args, timeout=60)).check(" ".join(args))


# --------------------------------------------------------------------------
# the agent (host B)

def agent(directory: str, index: int) -> int:
    """Serve the mailbox in ``directory`` for host ``index`` until killed."""
    for sub in ("req", "started", "out", "kill", "done", "local"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    procs: Dict[str, subprocess.Popen] = {}
    files: Dict[str, List[Any]] = {}
    p: Optional[subprocess.Popen]  # a request's process (a kill's may be gone: None)
    prefix_other = "%d-" % (1 - index)
    _write_atomic(os.path.join(directory, "ready-%d" % index), str(os.getpid()))
    sys.stderr.write("aiodat hosts agent: host %d serving %s\n" % (index, directory))
    sys.stderr.flush()
    while True:
        busy = False
        try:
            names = sorted(os.listdir(os.path.join(directory, "req")))
        except OSError:
            names = []
        for name in names:
            if not name.endswith(".json") or not name.startswith(prefix_other):
                continue
            rid = name[:-5]
            path = os.path.join(directory, "req", name)
            busy = True
            try:
                req = json.loads(_read(path) or "{}")
                os.unlink(path)
            except (OSError, ValueError) as e:
                sys.stderr.write("aiodat hosts agent: bad request %s: %s\n" % (name, e))
                continue
            out = open(os.path.join(directory, "out", rid + ".stdout"), "wb")
            err = open(os.path.join(directory, "out", rid + ".stderr"), "wb")
            env = dict(os.environ)
            env.update(req.get("env") or {})
            sys.stderr.write("aiodat hosts agent: %s: %s\n" % (rid, " ".join(shlex.quote(a) for a in req["argv"])))
            sys.stderr.flush()
            try:
                p = subprocess.Popen(req["argv"], stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                     cwd=req.get("cwd") or None, start_new_session=True)
            except OSError as e:
                err.write(("cannot run %s: %s\n" % (req["argv"], e)).encode())
                out.close()
                err.close()
                _write_atomic(os.path.join(directory, "done", rid + ".json"),
                              json.dumps({"rc": 127 if isinstance(e, FileNotFoundError) else 126}))
                continue
            procs[rid] = p
            files[rid] = [out, err]
            _write_atomic(os.path.join(directory, "started", rid + ".json"), json.dumps({"pid": p.pid}))
        try:
            kills = os.listdir(os.path.join(directory, "kill"))
        except OSError:
            kills = []
        for rid in kills:
            if rid.endswith(".tmp"):
                continue
            path = os.path.join(directory, "kill", rid)
            try:
                sig = int((_read(path) or "9").strip())
                os.unlink(path)
            except (OSError, ValueError):
                continue
            busy = True
            p = procs.get(rid)
            if p is not None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
                sys.stderr.write("aiodat hosts agent: %s: sent signal %d\n" % (rid, sig))
        for rid, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            busy = True
            for f in files.pop(rid):
                f.close()
            del procs[rid]
            rc = rc if rc >= 0 else 128 - rc
            _write_atomic(os.path.join(directory, "done", rid + ".json"), json.dumps({"rc": rc}))
            sys.stderr.write("aiodat hosts agent: %s: exit %d\n" % (rid, rc))
            sys.stderr.flush()
        if not busy:
            time.sleep(POLL)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hosts.py agent --dir D --index N`` | ``hosts.py run HOST -- CMD...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["agent"]:
        d, idx = GUEST_DIR_DEFAULT, 1
        if "--dir" in args:
            d = args[args.index("--dir") + 1]
        if "--index" in args:
            idx = int(args[args.index("--index") + 1])
        return agent(d, idx)
    if args[:1] == ["run"] and len(args) >= 3:
        host = int(args[1])
        cmd = args[3:] if args[2] == "--" else args[2:]
        res = run_on(host, cmd, timeout=3600)
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        return res.rc
    sys.stderr.write("usage: hosts.py agent [--dir D] [--index N] | hosts.py run HOST [--] CMD...\n")
    return 2


GUEST_DIR_DEFAULT = "/run/aiodat-hosts"

if __name__ == "__main__":
    sys.exit(main())
