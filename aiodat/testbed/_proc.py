"""Child processes of the test bed (QEMU, a native command): their output pumped to ours, tied to our life."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from typing import Callable, Optional, Tuple


def write_out(which: str, data: bytes) -> None:
    """Forward a child's bytes to our stdout or stderr (``which``), as they come."""
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


class Pump(threading.Thread):
    """Copy a pipe to a sink until EOF."""

    def __init__(self, fd: int, sink: Callable[[bytes], None]) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.sink = sink

    def run(self) -> None:
        """Pump until EOF, then close the pipe."""
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


def child_setup(memlock: bool = False) -> Callable[[], None]:
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


def host_tty_size() -> Optional[Tuple[int, int]]:
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


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (it runs in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
