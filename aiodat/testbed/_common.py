"""What every part of the test bed shares: its addresses and names, exit statuses, and small helpers
(messages, paths under a fake root, finding tools, the cache directory)."""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Dict, List, Mapping, Optional


#: The IPv4 address the rxe device's netdev carries (link-local, never routed).
ADDR = "169.254.77.1"
PREFIXLEN = 24
#: The dummy netdev the rxe device is bound to.
NETDEV = "aiodat0"
#: rxe device name inside a QEMU guest (a fresh kernel: the name is ours).
GUEST_DEVICE = "rxe0"
#: rxe device name created on the host by the native path (beside any others).
NATIVE_DEVICE = "aiodat_rxe0"

#: Exit status when the deadline passed (as timeout(1)).
EXIT_TIMEOUT = 124
#: Exit status when the test bed itself failed (rxe not up, QEMU failed, ...):
#: the command did not run.
EXIT_TESTBED_FAILED = 125


#: Two-host runs (``--hosts 2``): the subnet, the addresses of host A (index
#: 0, runs the command) and host B (index 1, runs the agent), and where the
#: shared hosts directory is mounted in each guest.
HOSTS_SUBNET = "169.254.78"
HOST_ADDRS = ("169.254.78.1", "169.254.78.2")
HOST_MACS = ("52:54:00:ad:a7:01", "52:54:00:ad:a7:02")
GUEST_HOSTS_DIR = "/run/aiodat-hosts"
#: How long host A waits for host B's agent before giving up (seconds).
PEER_WAIT_S = 240


SBIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def msg(text: str) -> None:
    """A message from the test bed itself, on the caller's stderr."""
    stream = sys.stderr
    try:
        stream.write(text if text.endswith("\n") else text + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def under(root: str, path: str) -> str:
    """``path`` (absolute) as seen under ``root``."""
    if root in ("", "/"):
        return path
    return os.path.join(root, path.lstrip("/"))


def which(name: str, root: str = "/") -> Optional[str]:
    """Find an executable: on the real root also along $PATH; sbin always."""
    dirs: List[str] = []
    if root in ("", "/"):
        dirs.extend(p for p in os.environ.get("PATH", "").split(os.pathsep) if p)
    dirs.extend(SBIN_DIRS)
    seen = set()
    for d in dirs:
        if d in seen:
            continue
        seen.add(d)
        cand = os.path.join(under(root, d), name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand if root in ("", "/") else "/" + os.path.relpath(cand, root)
    return None


def cache_dir() -> str:
    """Our cache directory (``$AIODAT_CACHE_DIR``, else ``~/.cache/aiodat``), ``rxe/`` in it; a temporary one if that is not writable."""
    base = os.environ.get("AIODAT_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "aiodat")
    path = os.path.join(base, "rxe")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(path)
    except OSError:
        path = os.path.join(tempfile.gettempdir(), "aiodat-%d" % os.getuid(), "rxe")
        os.makedirs(path, exist_ok=True)
    return path


def tail_of(path: str, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (empty if unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(text.rstrip("\n").split("\n")[-lines:])


def gid_for(addr: str) -> str:
    """The sysfs text of the IPv4-mapped RoCE v2 GID for ``addr``."""
    a, b, c, d = (int(x) for x in addr.split("."))
    return "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x" % (a, b, c, d)


def caller_env(env: Optional[Mapping[str, str]], cwd: str, testbed: str, device: str) -> Dict[str, str]:
    """The command's environment: ``env`` (default: ours) plus where it runs and the ``AIODAT_RXE_*`` names of the device."""
    out = dict(os.environ if env is None else env)
    out["PWD"] = cwd
    out["AIODAT_RXE_DEVICE"] = device
    out["AIODAT_RXE_ADDR"] = ADDR
    out["AIODAT_RXE_NETDEV"] = NETDEV
    out["AIODAT_TESTBED"] = testbed
    return out
