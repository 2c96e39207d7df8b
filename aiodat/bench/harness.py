"""Where and on what a benchmark runs: the device and its address, and a fresh asyncio or uvloop loop."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional, Tuple, TypeVar

T = TypeVar("T")

#: event loops the benchmarks can run on
LOOPS = ("asyncio", "uvloop")


def device_and_address(device: Optional[str] = None, address: Optional[str] = None) -> Tuple[str, str]:
    """The IA name and IP address to benchmark on.

    Defaults: ``$AIODAT_RXE_DEVICE`` / ``$AIODAT_RXE_ADDR`` (set by ``aiodat rxe
    run``; either alone picks the active port it names), else the first active
    port with an address: :func:`aiodat.ia.environment_port`, as the CLI and the
    pytest plugin read them.  Raises :class:`aiodat.ProviderNotFound` when there
    is none, or when a variable names no active port (naming it, its value and
    the ports there are: a wrong name used to run on the first device).
    """
    from aiodat import ProviderNotFound, open_ia
    from aiodat.ia import environment_port

    if device and address:
        return device, address
    if device and not address:
        with open_ia(device) as ia:
            address = ia.address
        if not address:
            raise ProviderNotFound(f"{device} has no IPv4 address (GID) for rdma_cm")
        return device, address
    found = environment_port()
    if found is None:
        raise ProviderNotFound(
            "no RDMA device with an IPv4 address here; run the benchmark where rxe is up: "
            "`aiodat rxe run -- aiodat bench ...`"
        )
    return found.name, address or found.address


def run_on_loop(loop_name: str, factory: Callable[[], Awaitable[T]]) -> T:
    """Run ``factory()`` to completion on a new ``asyncio`` or ``uvloop`` event loop, then close it."""
    loop: asyncio.AbstractEventLoop
    if loop_name == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    elif loop_name == "asyncio":
        loop = asyncio.new_event_loop()
    else:
        raise ValueError(f"loop must be one of {LOOPS}, not {loop_name!r}")
    try:
        asyncio.set_event_loop(loop)
        task = asyncio.ensure_future(factory(), loop=loop)
        try:
            return loop.run_until_complete(task)
        except KeyboardInterrupt:
            # Ctrl-C stops the loop between two steps of the run: cancel it (and the tasks it started) and
            # let it end, so that its finally blocks kill the child processes it started instead of
            # leaving them running, and no task is destroyed pending
            pending = asyncio.all_tasks(loop)
            for each in pending:
                each.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()
