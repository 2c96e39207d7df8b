"""``aiodat bench rate``: the small-message send rate beside ``ib_send_bw -R`` (Mpps)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from .rounds import Comparison
from .throughput import compare_streaming


def rate(size: int = 64, depth: int = 128, iters: int = 20000, loop: str = "asyncio", *, batch: int = 32,
         repeat: int = 3, modes: Sequence[str] = ("await", "callback", "busypoll"), busy_poll_us: int = 50,
         perftest: bool = True, device: Optional[str] = None, address: Optional[str] = None,
         timeout: float = 300.0, processes: int = 2, srq: bool = False, pool: bool = False,
         progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """``aiodat bench rate``: small-message send rate beside ``ib_send_bw -R`` (ratio of Mpps per round,
    median of ``repeat`` rounds).  ``srq``: the receiver takes its receives from an SRQ, beside
    ``ib_send_bw -R --use-srq``.  ``pool``: the sends, and the receives, take turns over ``depth``
    buffers of their own, as a server answering from a pool of buffers posts them."""
    return compare_streaming("rate", "send", size, depth, iters, loop, batch=batch, repeat=repeat, modes=modes,
                             busy_poll_us=busy_poll_us, perftest=perftest, device=device, address=address,
                             timeout=timeout, processes=processes, srq=srq, pool=pool, progress=progress)
