"""A test helper: let the running loop turn until something has happened."""
from __future__ import annotations

import asyncio
from typing import Callable


async def until(condition: Callable[[], object], what: str, turns: int = 1000) -> None:
    """Let the loop run (``turns`` turns at most) until ``condition()`` is true; AssertionError naming
    ``what`` if it never is."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")
