"""``aiodat bench bandwidth`` / ``rate``: argument checks on the host, short real runs on rxe."""
from __future__ import annotations

from typing import Any

import pytest

from aiodat import bench
from aiodat.cli import main


def test_bad_arguments_are_refused(capsys: Any) -> None:
    assert main(["bench", "bandwidth", "--size", "0"]) == 2
    assert main(["bench", "rate", "--batch", "64", "--depth", "8"]) == 2
    assert "--batch <= --depth" in capsys.readouterr().err
    with pytest.raises(ValueError, match="op must be"):
        bench.bandwidth("atomic")


def test_report_ratio_and_format() -> None:
    sample = bench.BandwidthSample("write", 65536, 1000, 2.0)
    assert sample.mib_per_s == pytest.approx(31.25) and sample.mpps == pytest.approx(0.0005)
    out = "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]\n 65536 1000 30.00 25.00 0.000400\n"
    res = bench.PerftestResult("ib_write_bw", ("-s", "65536"), 0, out, bench.parse_perftest(out))
    report = bench.BandwidthReport("rxe0", "1.2.3.4", "asyncio", "write", 65536, 64, 16, sample, res)
    assert report.ratio() == pytest.approx(31.25 / 25.0)
    assert "ratio (aiodat / ib_write_bw bandwidth): 1.25" in report.format()
    rate = bench.BandwidthReport("rxe0", "1.2.3.4", "asyncio", "send", 64, 64, 16,
                                 bench.BandwidthSample("send", 64, 1000, 2.0), res, kind="rate")
    assert rate.ratio() == pytest.approx(0.0005 / 0.0004)
    assert rate.as_dict()["perftest"]["Mpps"] == pytest.approx(0.0004)


@pytest.mark.rxe
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("op", ["write", "read", "send"])
def test_short_real_run(rdma_device: Any, op: str, processes: int) -> None:
    """Each op, with the receiving side in this process or in a child (which checks the bytes it got)."""
    report = bench.bandwidth(op, 4096, 16, 200, batch=4, perftest=False, device=rdma_device.name,
                             address=rdma_device.address, processes=processes)
    assert report.aiodat.iters == 200 and report.aiodat.seconds > 0 and report.aiodat.mib_per_s > 0
    assert report.ratio() is None and f"op={op}" in report.format()
    assert f"{processes} process(es)" in report.format() and report.as_dict()["processes"] == processes


@pytest.mark.rxe
def test_rate_json(rdma_device: Any, capsys: Any) -> None:
    import json

    assert main(["bench", "rate", "--iters", "500", "--depth", "32", "--batch", "8", "--no-perftest",
                 "--json", "--device", rdma_device.name]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "rate" and data["iters"] == 500 and data["aiodat"]["Mpps"] > 0
