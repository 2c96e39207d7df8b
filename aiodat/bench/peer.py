"""The benchmark's own peer in a child process (``python -m aiodat.bench pong|sink ...``): start it,
learn its port, wait for it; and, in the child, accept the one connection."""
from __future__ import annotations

import asyncio
import sys
from typing import Any, List, Optional, Tuple


#: ``python -m aiodat.bench``, exec'd by sh with SIGINT ignored: Ctrl-C reaches the whole process
#: group, and the interrupted parent kills its children; a child it reached would print a traceback,
#: even before its first line of code (a site import interrupted is a fatal error: seen on a busy host,
#: 2026-11-30). An interpreter started with SIGINT ignored keeps it ignored. sh sets it because
#: uvloop's spawn resets every signal after a preexec_fn (the exec keeps the pid).
_CHILD = ["/bin/sh", "-c", "trap '' INT; exec \"$@\"", "sh", sys.executable, "-m", "aiodat.bench"]


async def start_child(args: List[str], loop_name: str) -> Tuple[Any, int]:
    """Start ``python -m aiodat.bench ARGS... LOOP`` (as :data:`_CHILD`) and read the port it listens on."""
    return await start_process([*_CHILD, *args, loop_name], args[0])


async def start_process(argv: List[str], what: str, timeout: float = 60.0) -> Tuple[Any, int]:
    """Start ``argv`` and read the ``port N`` line it prints first.

    If no such line comes within ``timeout`` seconds (or anything else goes wrong, cancellation
    too), the process is killed and waited for: a stream server would otherwise serve forever.
    RuntimeError names ``what`` did not start.
    """
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stdin=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    line: Optional[bytes] = None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except asyncio.TimeoutError:
        pass
    except BaseException:  # (cancelled: the child goes too)
        await kill_child(proc)
        raise
    parts = (line or b"").split()
    if len(parts) < 2 or parts[0] != b"port" or not parts[1].isdigit():
        await kill_child(proc)
        why = f"no port within {timeout:g} s" if line is None else f"said {line!r}"
        raise RuntimeError(f"the {what} process did not start ({why})")
    return proc, int(parts[1])


async def kill_child(proc: Any) -> None:
    """SIGKILL a child started by :func:`start_process` and reap it."""
    try:
        proc.kill()
    except ProcessLookupError:  # (it ended already)
        pass
    await proc.wait()


async def finish_child(proc: Any) -> None:
    """Wait for a benchmark's child to end (killed after 30 s)."""
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


async def accept_one(ia: Any, ep: Any, private_data: bytes = b"") -> None:
    """A benchmark's child process: listen on a free port, tell the parent which (one line,
    ``port N``, on stdout, as :func:`start_child` reads it) and accept one connection onto ``ep``."""
    import sys

    from aiodat import EvdFlags

    cr_evd = ia.create_evd(4, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    sys.stdout.write(f"port {psp.port}\n")
    sys.stdout.flush()
    event = await cr_evd.wait_one(timeout=60)
    await event.cr.accept(ep, private_data=private_data)
