"""``aiodat bench rate``: the small-message send rate beside ``ib_send_bw -R`` (Mpps)."""
from __future__ import annotations

from typing import Optional

from .harness import device_and_address, run_on_loop
from .throughput import BandwidthReport, bandwidth_stream, check_args, run_bw_perftest


def rate(size: int = 64, depth: int = 128, iters: int = 20000, loop: str = "asyncio", *, batch: int = 32,
         perftest: bool = True, device: Optional[str] = None, address: Optional[str] = None,
         timeout: float = 300.0, processes: int = 2) -> BandwidthReport:
    """``aiodat bench rate``: small-message send rate beside ``ib_send_bw -R`` (ratio of Mpps)."""
    check_args("send", size, depth, iters, batch)
    device, address = device_and_address(device, address)
    sample = run_on_loop(loop, lambda: bandwidth_stream(device, address, "send", size, depth, iters, batch,
                                                        processes=processes, loop_name=loop))
    report = BandwidthReport(device, address, loop, "send", size, depth, batch, sample, kind="rate",
                             processes=processes)
    if perftest:
        report.perftest = run_bw_perftest("send", size, depth, iters, device, address, timeout)
    return report
