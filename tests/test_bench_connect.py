"""``aiodat bench connect``: cmtime's table parsed on the host; on rxe, aiodat's cycle beside cmtime."""
from __future__ import annotations

import json
import math
from typing import Any

import pytest

from aiodat import bench
from aiodat.bench.connect import cmtime_connect_us, cmtime_cycle_us
from aiodat.cli import main

# the client's output of cmtime (rdmacm-utils 44, Debian 12) for -c 20 in the test bed
CMTIME_44 = """creating id
resolving address
step              total ms     max ms     min us  us / conn
create id    :        4.89       0.16      18.00     244.35
resolve addr :       47.70      40.59   31301.00    2385.00
resolve route:       13.10      11.13    5022.00     654.75
create qp    :       31.83      15.63     373.00    1591.45
connect      :      400.80     374.38  171183.00   20040.20
disconnect   :      229.17     149.12   17121.00   11458.35
destroy      :        1.69       0.56      28.00      84.35
"""

# the layout of newer cmtime (a "full connect" row, times in us)
CMTIME_NEW = """\tCreating IDs
\tResolving addresses
step              us/conn    sum(us)    max(us)    min(us)  total(us)   avg/iter
full connect :       9000     180000      12000       6000      40000       2000
create id    :         10        200         20          5        300         15
resolve addr :       1000      20000       1500        500       5000        250
cm connect   :       4000      80000       6000       2000      20000       1000
disconnect   :        500      10000        800        300       4000        200
destroy id   :         50       1000         80         30       1200         60
destroy qp   :         40        800         60         20        800         40
"""


def test_parse_cmtime_44() -> None:
    steps = bench.parse_cmtime(CMTIME_44)
    assert list(steps) == ["create id", "resolve addr", "resolve route", "create qp", "connect", "disconnect",
                           "destroy"]
    assert steps["resolve route"] == {"total(ms)": 13.10, "max(ms)": 11.13, "min(us)": 5022.0, "us/conn": 654.75}
    connect = (4.89 + 47.70 + 13.10 + 31.83 + 400.80) * 1000 / 20
    assert cmtime_connect_us(steps, 20) == pytest.approx(connect)
    assert cmtime_cycle_us(steps, 20) == pytest.approx(connect + (229.17 + 1.69) * 1000 / 20)


def test_parse_cmtime_newer() -> None:
    steps = bench.parse_cmtime(CMTIME_NEW)
    assert steps["full connect"] == {"us/conn": 9000, "sum(us)": 180000, "max(us)": 12000, "min(us)": 6000,
                                     "total(us)": 40000, "avg/iter": 2000}
    assert set(steps) == {"full connect", "create id", "resolve addr", "cm connect", "disconnect", "destroy id",
                          "destroy qp"}
    assert cmtime_connect_us(steps, 20) == 2000.0  # the full connect's wall time / connections
    assert cmtime_cycle_us(steps, 20) == 2000.0 + (4000 + 1200 + 800) / 20
    # an older cmtime without the "full connect" row: the set-up steps' wall times add up
    del steps["full connect"]
    assert cmtime_connect_us(steps, 20) == (300 + 5000 + 20000) / 20
    assert bench.parse_cmtime("cmtime: unable to connect\n") == {}
    res = bench.CmtimeResult(20, {}, "", "cmtime printed no step table")
    assert not res.ok and res.connect_us() is None


def test_bad_arguments_are_refused() -> None:
    assert main(["bench", "connect", "--connections", "0"]) == 2
    with pytest.raises(ValueError, match="connections"):
        bench.connect(0)
    assert main(["bench", "connect", "--processes", "3"]) == 2
    with pytest.raises(ValueError, match="processes"):
        bench.connect(8, processes=3)
    assert main(["bench", "connect", "--mode", "busypoll"]) == 2
    with pytest.raises(ValueError, match="modes"):
        bench.connect(8, modes=("spin",))


@pytest.mark.rxe
@pytest.mark.parametrize("processes", [2, 1])
def test_bench_connect_beside_cmtime(rdma_device: Any, request: Any, capsys: Any, processes: int) -> None:
    """One round of 8 connections in each mode (tasks awaiting, or callbacks on shared EVDs), the
    accepting side in a child process (as cmtime's server) or on the same loop: aiodat's
    per-connection times and cmtime's, finite, with the ratios."""
    loop = request.config.getoption("--aiodat-loop") or "asyncio"
    assert main(["bench", "connect", "--connections", "8", "--repeat", "1", "--loop", loop, "--json",
                 "--processes", str(processes), "--device", rdma_device.name]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["connections"] == 8 and data["processes"] == processes
    keys = [f"aiodat_{mode}_{phase}" for mode in ("await", "callback") for phase in ("connect", "cycle")]
    for key in keys + ["cmtime_connect", "cmtime_cycle"]:
        figure = data["figures"][key]
        assert figure["errors"] is None and 0 < figure["median"] < math.inf, (key, figure)
    for mode in ("await", "callback"):
        assert data["figures"][f"aiodat_{mode}_connect"]["median"] <= data["figures"][f"aiodat_{mode}_cycle"]["median"]
    assert len(data["ratios"]) == 4 and all(r["median"] > 0 for r in data["ratios"])


def test_a_cmtime_figure_of_nothing_says_why(monkeypatch: Any) -> None:
    """cmtime ran but every step took 0 (as its clock now and then says under TCG): the figure is n/a
    with a reason under the table, and no ratio is made of it (it used to be n/a with no reason)."""
    import sys

    connect_mod = sys.modules["aiodat.bench.connect"]  # (aiodat.bench.connect is also the function)

    zero = {step: {"total(ms)": 0.0, "max(ms)": 0.0, "min(us)": 0.0, "us/conn": 0.0}
            for step in ("create id", "connect", "disconnect", "destroy")}
    monkeypatch.setattr(connect_mod, "device_and_address", lambda d, a: ("rxe0", "192.0.2.1"))
    monkeypatch.setattr(connect_mod, "run_on_loop", lambda loop, factory: (0.001, 0.002))
    monkeypatch.setattr(connect_mod, "run_cmtime_pair", lambda address, n, timeout: bench.CmtimeResult(n, zero, ""))
    report = bench.connect(8, repeat=1, modes=("await",))
    out = report.format()
    assert "not measured: cmtime connect (set-up steps): cmtime's table has no time above 0" in out, out
    assert all(r.median is None for r in report.ratios) and report.ok
