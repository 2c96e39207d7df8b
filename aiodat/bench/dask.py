"""``aiodat bench dask``: a Dask worker-to-worker transfer over ``rdma://`` beside Dask's ``tcp://``.

For each protocol, one after the other on the same event loop and the same address (the RDMA
device's netdev address, so TCP crosses the same link: loopback in one guest, the virtio link
between two hosts): a ``LocalCluster`` with two workers, then ``repeat`` times: an array of
``size`` bytes is made on worker A (not timed), and a task on worker B that needs it is timed
from submission to result; the array crosses from A to B in that time.  The task returns a
checksum that is compared with A's.  Figures: the median time and MB/s, and rdma/tcp.
Needs ``aiodat[dask]`` (distributed) and numpy.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from .harness import device_and_address, run_on_loop
from .stats import percentile

PROTOCOLS = ("rdma", "tcp")


@dataclass
class DaskFigures:
    """One protocol's transfers: seconds per transfer (each repeat) and the median's MB/s."""

    protocol: str
    seconds: List[float]
    median_s: float
    mb_s: float
    startup_s: float


@dataclass
class DaskReport:
    """What ``aiodat bench dask`` measured."""

    loop: str
    device: str
    address: str
    size: int
    repeat: int
    processes: bool
    figures: Dict[str, DaskFigures] = field(default_factory=dict)

    @property
    def ratio(self) -> Optional[float]:
        """rdma:// throughput over tcp:// throughput (> 1: rdma:// is faster)."""
        rdma, tcp = self.figures.get("rdma"), self.figures.get("tcp")
        if rdma is None or tcp is None or not tcp.mb_s:
            return None
        return rdma.mb_s / tcp.mb_s

    def as_dict(self) -> Dict[str, Any]:
        """The report as plain data (for --json)."""
        out = asdict(self)
        out["ratio"] = self.ratio
        return out

    def format(self) -> str:
        """The report as text."""
        lines = [f"dask worker-to-worker transfer: {self.size / 2**20:g} MiB, median of {self.repeat}, "
                 f"{'worker processes' if self.processes else 'workers in one process'}, loop {self.loop}, "
                 f"{self.device} at {self.address}",
                 f"{'protocol':<10}{'median s':>10}{'MB/s':>10}{'cluster start s':>17}  each (s)"]
        for f in self.figures.values():
            each = " ".join(f"{s:.3f}" for s in f.seconds)
            lines.append(f"{f.protocol + '://':<10}{f.median_s:>10.3f}{f.mb_s:>10.1f}{f.startup_s:>17.1f}  {each}")
        if self.ratio is not None:
            lines.append(f"rdma:// / tcp:// throughput: {self.ratio:.2f}x")
        return "\n".join(lines)


def _make(size: int, seed: int) -> Any:
    import numpy

    array = numpy.empty(size, dtype=numpy.uint8)
    array[::4096] = numpy.arange(0, size, 4096, dtype=numpy.uint64) % 251 + seed
    return array


def _checksum(array: Any) -> int:
    return int(array[::4096].sum(dtype="uint64")) + int(array.nbytes)


async def transfer(protocol: str, address: str, size: int, repeat: int, processes: bool = False) -> DaskFigures:
    """Time ``repeat`` transfers of ``size`` bytes between the two workers of a LocalCluster on ``protocol``."""
    from distributed import Client, LocalCluster

    t0 = time.monotonic()
    async with LocalCluster(protocol=protocol, host=address, n_workers=2, threads_per_worker=1,
                            processes=processes, asynchronous=True, dashboard_address=None) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            startup = time.monotonic() - t0
            await client.wait_for_workers(2)
            a, b = sorted((await client.scheduler.identity(n_workers=-1))["workers"])
            seconds = []
            for i in range(repeat):
                made = client.submit(_make, size, i, workers=[a], pure=False)
                expected = await client.submit(_checksum, made, workers=[a], pure=False)
                t1 = time.monotonic()
                got = await client.submit(_checksum, made, workers=[b], pure=False)
                seconds.append(time.monotonic() - t1)
                if got != expected:
                    raise AssertionError(f"{protocol}:// transfer {i}: checksum {got} on B, {expected} on A")
                del made
    median = percentile(sorted(seconds), 50)
    return DaskFigures(protocol, seconds, median, size / median / 1e6, startup)


def dask_transfer(size: int = 64 << 20, repeat: int = 3, loop: str = "asyncio", processes: bool = False,
                  device: Optional[str] = None, address: Optional[str] = None,
                  protocols: tuple = PROTOCOLS) -> DaskReport:
    """Run the transfer for each protocol in ``protocols`` and return the report (module docstring)."""
    if size < 1 or repeat < 1:
        raise ValueError(f"size and repeat must be >= 1, got {size} and {repeat}")
    for p in protocols:
        if p not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {p!r}")
    device, address = device_and_address(device, address)
    report = DaskReport(loop, device, address, size, repeat, processes)

    async def run() -> None:
        for p in protocols:
            report.figures[p] = await transfer(p, address, size, repeat, processes)
            await asyncio.sleep(0)

    run_on_loop(loop, run)
    return report
