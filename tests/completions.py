"""A test helper: take an exact number of completions from an EVD."""
from __future__ import annotations

from typing import Any, List


async def take(evd: Any, n: int, timeout: float = 30.0) -> List[Any]:
    """Exactly ``n`` events of ``evd`` (no more is taken, so the rest stay queued), each one
    successful: AssertionError naming the failed statuses otherwise."""
    got: List[Any] = []
    while len(got) < n:
        got += await evd.wait(timeout=timeout, max_events=n - len(got))
    assert all(event.ok for event in got), [event.status for event in got if not event.ok]
    return got
