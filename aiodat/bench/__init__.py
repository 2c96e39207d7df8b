"""Benchmarks (``aiodat bench ...``): aiodat measured beside its C or Python peer on the same device, in
the same run.

One module per benchmark family, each with one entry function returning a
report (``format()`` for the text ``aiodat bench`` prints, ``as_dict()`` for
``--json``):

* :mod:`~aiodat.bench.latency`: :func:`bench_latency`, the send/recv ping-pong
  beside ``ib_send_lat -R -e`` and ``ib_send_lat -R``;
* :mod:`~aiodat.bench.throughput`: :func:`bandwidth`, RDMA write/read/send
  streaming beside ``ib_<op>_bw -R``;
* :mod:`~aiodat.bench.msgrate`: :func:`rate`, small-message send rate beside
  ``ib_send_bw -R``;
* :mod:`~aiodat.bench.streams_vs_tcp`: :func:`streams`, aiodat streams beside
  asyncio TCP streams;
* :mod:`~aiodat.bench.endurance`: :func:`soak`, many connections under mixed
  load for a while, checking that nothing grows.

Shared pieces: :mod:`~aiodat.bench.perftest` (the C peer: run a perftest
pair, parse its table), :mod:`~aiodat.bench.peer` (the benchmark's own peer
in a child process, ``python -m aiodat.bench pong|sink``),
:mod:`~aiodat.bench.harness` (device, address, event loop) and
:mod:`~aiodat.bench.stats` (percentiles, ratios).  The benchmarks use only
aiodat's public API; the core never imports this package.
"""
from __future__ import annotations

from .endurance import SoakInterval, SoakReport, soak
from .harness import LOOPS, device_and_address, run_on_loop
from .latency import SIGNAL_EVERY, LatencyReport, LatencySample, bench_latency, latency_pingpong
from .msgrate import rate
from .perftest import PerftestResult, parse_perftest, run_perftest_pair
from .stats import percentile, ratio
from .streams_vs_tcp import StreamsFigures, StreamsReport, streams
from .throughput import BW_TOOLS, BandwidthReport, BandwidthSample, bandwidth, bandwidth_stream

__all__ = [
    "bench_latency", "latency_pingpong", "LatencyReport", "LatencySample", "SIGNAL_EVERY",
    "bandwidth", "bandwidth_stream", "BandwidthReport", "BandwidthSample", "BW_TOOLS", "rate",
    "streams", "StreamsReport", "StreamsFigures", "soak", "SoakReport", "SoakInterval",
    "PerftestResult", "parse_perftest", "run_perftest_pair",
    "LOOPS", "device_and_address", "run_on_loop", "percentile", "ratio",
]
