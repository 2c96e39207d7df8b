"""Benchmarks (``aiodat bench ...``): aiodat measured beside its C or Python peer on the same device, in
the same run.

One module per benchmark family, each with one entry function returning a
report (``format()`` for the text ``aiodat bench`` prints, ``as_dict()`` for
``--json``):

* :mod:`~aiodat.bench.latency`: :func:`bench_latency`, the send/recv ping-pong
  (await, callback, busypoll) beside pyverbs (:mod:`~aiodat.bench.pyverbs_peer`,
  running :mod:`~aiodat.bench.pyverbs_pingpong`), ``ib_send_lat -R -e`` and ``ib_send_lat -R``;
* :mod:`~aiodat.bench.throughput`: :func:`bandwidth`, RDMA write/read/send
  streaming beside ``ib_<op>_bw -R``;
* :mod:`~aiodat.bench.msgrate`: :func:`rate`, small-message send rate beside
  ``ib_send_bw -R``;
* :mod:`~aiodat.bench.streams_vs_tcp`: :func:`streams`, aiodat streams beside
  ``rstream`` (:mod:`~aiodat.bench.rstream`) and asyncio TCP streams, in one
  guest or between two hosts;
* :mod:`~aiodat.bench.connect`: :func:`connect`, connection set-up beside ``cmtime``;
* :mod:`~aiodat.bench.endurance`: :func:`soak`, many connections under mixed
  load for a while, checking that nothing grows.

Shared pieces: :mod:`~aiodat.bench.perftest` (the C peer: run a perftest
pair, parse its table), :mod:`~aiodat.bench.peer` (the benchmark's own peer
in a child process, ``python -m aiodat.bench pong|sink``),
:mod:`~aiodat.bench.harness` (device, address, event loop),
:mod:`~aiodat.bench.stats` (percentiles, medians, ratios) and
:mod:`~aiodat.bench.rounds` (``--repeat``: figures by round, the median of the
rounds' ratios, the printed table).  The benchmarks use only
aiodat's public API; the core never imports this package.
"""
from __future__ import annotations

from .connect import MODES as CONNECT_MODES
from .connect import CmtimeResult, connect, connect_cycle, parse_cmtime, run_cmtime_pair
from .endurance import SoakInterval, SoakReport, soak
from .harness import LOOPS, device_and_address, run_on_loop
from .latency import BUSY_POLL_US, MODES, SIGNAL_EVERY, LatencySample, bench_latency, latency_pingpong
from .msgrate import rate
from .perftest import PerftestResult, parse_perftest, run_perftest_pair
from .pyverbs_peer import PyverbsResult, parse_pyverbs_output, run_pyverbs_pingpong
from .rounds import Comparison, Figure, Ratio, median_of_ratios
from .stats import median, percentile, ratio
from .rstream import RstreamResult, parse_rstream, run_rstream_pair
from .streams_vs_tcp import streams
from .throughput import BW_TOOLS, BandwidthReport, BandwidthSample, bandwidth, bandwidth_stream, compare_streaming

__all__ = [
    "bench_latency", "latency_pingpong", "LatencySample", "SIGNAL_EVERY", "MODES", "BUSY_POLL_US",
    "PyverbsResult", "parse_pyverbs_output", "run_pyverbs_pingpong",
    "Comparison", "Figure", "Ratio", "median_of_ratios", "median",
    "bandwidth", "bandwidth_stream", "BandwidthReport", "BandwidthSample", "BW_TOOLS", "rate",
    "streams", "RstreamResult", "parse_rstream", "run_rstream_pair",
    "connect", "CONNECT_MODES", "connect_cycle", "CmtimeResult", "parse_cmtime", "run_cmtime_pair", "compare_streaming", "soak", "SoakReport", "SoakInterval",
    "PerftestResult", "parse_perftest", "run_perftest_pair",
    "LOOPS", "device_and_address", "run_on_loop", "percentile", "ratio",
]
