"""The benchmark's own peer in a child process (``python -m aiodat.bench pong|sink ...``): start it,
learn its port, wait for it; and, in the child, accept the one connection."""
from __future__ import annotations

import asyncio
import sys
from typing import Any, List, Tuple


async def start_child(args: List[str], loop_name: str) -> Tuple[Any, int]:
    """Start ``python -m aiodat.bench ARGS... LOOP`` and read the port it listens on."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodat.bench", *args, loop_name,
        stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if not line.startswith(b"port "):
        await finish_child(proc)
        raise RuntimeError(f"the {args[0]} process did not start (said {line!r})")
    return proc, int(line.split()[1])


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
