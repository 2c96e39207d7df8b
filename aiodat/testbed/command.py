"""The ``rxe`` command line (``aiodat rxe ...``, ``python -m aiodat.testbed ...``): ``status`` and
``run [options] -- CMD``."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from typing import Any, Callable, List, Optional, Sequence, TypedDict

from ._common import msg
from .runner import run
from .probe import format_status, status


USAGE = """usage: rxe status [--json]
       rxe run [--timeout SECONDS] [--memory SIZE] [--cpus N] [--method native|qemu]
               [--share DIR]... [--hosts 1|2] [--verbose] [--] CMD [ARG...]

status  report whether rxe can run natively or in a QEMU guest, and what is missing
        (exit 0 when some way exists, 1 otherwise)
run     run CMD where an rxe device is up; exit with CMD's status
        (124: --timeout passed, default 3000 s; 125: the test bed failed, CMD did not run)
        --hosts 2: two QEMU guests joined by a virtio link; CMD runs on host A
        (169.254.78.1), host B (169.254.78.2) runs an agent (aiodat.testbed.hosts)
"""


class _RunOptions(TypedDict):
    """``rxe run``'s options, as :func:`aiodat.testbed.runner.run` takes them."""

    timeout: float
    memory: str
    cpus: int
    method: Optional[str]
    verbose: bool
    hosts: int


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``rxe status`` / ``rxe run ... -- CMD`` (``aiodat rxe ...``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    sub, rest = args[0], args[1:]
    if sub == "status":
        if any(a in ("-h", "--help") for a in rest):
            sys.stdout.write(USAGE)
            return 0
        bad = [a for a in rest if a != "--json"]
        if bad:
            msg("rxe status: unexpected argument %r\n%s" % (bad[0], USAGE))
            return 2
        st = status()
        if "--json" in rest:
            print(json.dumps(st, indent=2))
        else:
            print(format_status(st))
        return 0 if st["method"] else 1
    if sub != "run":
        msg("rxe: unknown subcommand %r\n%s" % (sub, USAGE))
        return 2
    opts: _RunOptions = {"timeout": 3000.0, "memory": "2G", "cpus": 2, "method": None, "verbose": False, "hosts": 1}
    shares: List[str] = []
    i = 0
    try:
        while i < len(rest):
            a = rest[i]
            if a == "--":
                i += 1
                break
            if not a.startswith("-"):
                break
            name, eq, val = a.partition("=")
            if name in ("-v", "--verbose"):
                opts["verbose"] = True
                i += 1
                continue
            if name in ("-h", "--help"):
                sys.stdout.write(USAGE)
                return 0
            if name not in ("--timeout", "--memory", "--cpus", "--method", "--share", "--hosts"):
                raise ValueError("unknown option %s" % a)
            if not eq:
                i += 1
                if i >= len(rest):
                    raise ValueError("%s needs a value" % name)
                val = rest[i]
            i += 1
            if name == "--timeout":  # (NaN: no deadline at all)
                opts["timeout"] = _value(name, val, float, lambda t: math.isfinite(t) and t > 0,
                                         "a finite number of seconds > 0")
            elif name == "--cpus":
                opts["cpus"] = _value(name, val, int, lambda n: n >= 1, "a whole number >= 1")
            elif name == "--hosts":
                opts["hosts"] = _value(name, val, int, lambda n: n in (1, 2), "1 or 2")
            elif name == "--share":  # (QEMU would refuse it only after the set-up)
                shares.append(os.path.abspath(_value(name, val, str, os.path.isdir, "an existing directory")))
            elif name == "--memory":
                opts["memory"] = _value(name, val, str, _is_memory_size, "a size > 0 as QEMU's -m takes it (2G, 1536M)")
            else:
                opts["method"] = _value(name, val, str, lambda m: m in ("native", "qemu"), "native or qemu")
        if opts["hosts"] == 2 and opts["method"] == "native":
            raise ValueError("--hosts 2 boots two QEMU guests: it takes no --method native")
    except ValueError as e:
        msg("rxe run: %s\n%s" % (e, USAGE))
        return 2
    cmd = rest[i:]
    if not cmd:
        msg("rxe run: no command\n" + USAGE)
        return 2
    rw = None
    if shares:
        rw = [os.getcwd()] + shares
    def on_term(signum: int, frame: object) -> None:
        raise Terminated(signum)

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, on_term)
    try:
        return run(cmd, timeout=opts["timeout"], memory=opts["memory"], cpus=opts["cpus"],
                   method=opts["method"], verbose=opts["verbose"], rw_paths=rw, hosts=opts["hosts"])
    except KeyboardInterrupt:
        msg("aiodat rxe: interrupted")
        return 130
    except Terminated:
        msg("aiodat rxe: terminated")
        return 128 + signal.SIGTERM
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _value(name: str, val: str, kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Any:
    """``kind(val)`` if that works and is ``ok``, else ValueError: ``name`` must be ``what``."""
    try:
        parsed = kind(val)
    except ValueError:
        parsed = None
    if parsed is None or not ok(parsed):
        raise ValueError("%s must be %s, not %r" % (name, what, val))
    return parsed


def _is_memory_size(val: str) -> bool:
    """A size QEMU's -m takes: MiB, or with a suffix (B, k, M, G, T, P, E); more than nothing."""
    number = val[:-1] if val[-1:] and val[-1:] in "bBkKmMgGtTpPeE" else val
    digits = number.replace(".", "", 1)
    return digits.isascii() and digits.isdigit() and float(number) > 0


class Terminated(BaseException):
    """SIGTERM in the CLI: unwinds like KeyboardInterrupt so QEMU is killed."""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
