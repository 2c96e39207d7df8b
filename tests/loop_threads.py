"""Run calls from an event loop in another thread: the misuse tests' "from another loop" cases."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, List, Tuple


async def in_another_loop(calls: List[Tuple[str, Callable[[], Any]]], join_timeout: float) -> List[Tuple[str, Any]]:
    """Run each call (awaiting what it returns, 5 s at most) in a loop of another thread, in order;
    returns (name, the exception it raised or None) for each call that finished by ``join_timeout``."""
    outcomes: List[Tuple[str, Any]] = []

    async def misuse() -> None:
        for name, call in calls:
            try:
                result = call()
                if asyncio.iscoroutine(result):
                    await asyncio.wait_for(result, 5)
                outcomes.append((name, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                outcomes.append((name, exc))

    thread = threading.Thread(target=lambda: asyncio.run(misuse()))
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, thread.join, join_timeout)
    return outcomes
