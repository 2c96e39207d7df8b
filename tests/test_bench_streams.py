"""``aiodat bench streams``: rstream's output parsed on the host; on rxe, rstream beside aiodat streams and
asyncio TCP in one short round."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from aiodat import bench
from aiodat.cli import main

# printed by rstream (rdmacm-utils 44) in the test bed: -S 64 -C 1 -I 300
RSTREAM_OUT = """name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer
custom    64      1       300     37k         1.74s      0.00    2899.98
"""


def test_parse_rstream() -> None:
    row = bench.parse_rstream(RSTREAM_OUT)
    assert row == {"bytes": 64.0, "xfers": 1.0, "iters": 300.0, "total": 37e3, "seconds": 1.74, "gbps": 0.0,
                   "usec_per_xfer": 2899.98}
    res = bench.RstreamResult(("-S", "64"), row)
    assert res.ok and res.rtt_us == pytest.approx(5799.96)  # a round trip: two transfers
    # 64 KiB x 64 each way in 0.5 s: 0.13 Gb/s printed, 65536 B / 3906.25 us = 16.78 MB/s
    big_out = ("name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer\n"
               "custom    64k     64      1       8m          0.50s      0.13     3906.25\n")
    assert bench.RstreamResult(("-S", "65536", "-C", "64"), bench.parse_rstream(big_out)).mb_s == \
        pytest.approx(16.777216)  # from usec/xfer: not rounded to 1.25 MB/s steps
    assert bench.RstreamResult((), bench.parse_rstream(big_out)).mb_s == pytest.approx(16.25)  # Gb/s * 1000 / 8
    assert bench.parse_rstream("rstream: connect: Connection refused\n") is None


def test_two_hosts_outside_a_two_host_bed(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODAT_HOSTS", raising=False)
    assert main(["bench", "streams", "--two-hosts"]) == 1
    assert "--hosts 2" in capsys.readouterr().err
    assert main(["bench", "streams", "--repeat", "0"]) == 2


def test_bench_streams_without_device_says_how() -> None:
    """Without a device the subcommand fails with exit status 1 and says how to get one."""
    from aiodat.testing.plugin import find_device

    if find_device() is not None:
        pytest.skip("this machine has an RDMA device")
    out = subprocess.run([sys.executable, "-m", "aiodat", "bench", "streams", "--no-rstream"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "aiodat rxe run" in out.stderr


def test_rstream_whose_client_always_fails_is_not_waited_for(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client failing all its attempts while the server lingers: an error at once, the server killed
    (not waited for until the timeout)."""
    import time

    fake = tmp_path / "rstream"
    fake.write_text('#!/bin/sh\ncase " $* " in *" -b "*) exec sleep 999;; esac\necho "rstream: connect: refused"\n'
                    'exit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    start = time.monotonic()
    res = bench.run_rstream_pair("192.0.2.1", ["-S", "64"], timeout=20.0, start_delay=0.05)
    assert time.monotonic() - start < 5.0
    assert not res.ok and res.error == "rstream client failed 5 times (last exit status 1)", res.error


def test_rstream_server_on_a_host_outside_a_two_host_bed_is_an_error(tmp_path: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A server asked on host B where there is no host B: an error naming it, no exception, no client run."""
    fake = tmp_path / "rstream"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("AIODAT_HOSTS", raising=False)
    res = bench.run_rstream_pair("192.0.2.1", ["-S", "64"], timeout=5.0, start_delay=0.05, server_host=1)
    assert not res.ok and res.error.startswith("the rstream server did not start: "), res.error
    assert "two-host" in res.error, res.error
    assert not (tmp_path / "ran").exists()


def test_rstream_prefix_missing_is_an_error() -> None:
    res = bench.run_rstream_pair("192.0.2.1", [], timeout=5.0, prefix=("aiodat-no-such-chrt",))
    assert not res.ok and "not found" in res.error


async def test_a_child_that_never_says_its_port_is_killed(tmp_path: Any) -> None:
    """A benchmark child (e.g. stream-server, which serves forever) that does not print its port in
    time, or prints something else: RuntimeError naming it, and the child is gone."""
    import time

    from aiodat.bench.peer import start_process

    pidfile = tmp_path / "pid"
    for script, timeout in (("echo $$ > {}; exec sleep 999", 0.5), ("echo $$ > {}; echo hello; exec sleep 999", 30)):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"the stream-server process did not start"):
            await start_process(["sh", "-c", script.format(pidfile)], "stream-server", timeout)
        assert time.monotonic() - start < 5.0
        pid = int(pidfile.read_text())
        assert not os.path.exists(f"/proc/{pid}"), "the child is still there"  # (killed and reaped)


@pytest.mark.rxe
@pytest.mark.parametrize("processes", [2, 1])
def test_bench_streams_with_rstream(rdma_device: Any, request: Any, capsys: Any, processes: int) -> None:
    """One short round: aiodat streams, asyncio TCP and rstream all give finite figures, and the ratios;
    the servers in a child process (the default, as rstream's), or on the client's loop."""
    loop = request.config.getoption("--aiodat-loop") or "asyncio"
    assert main(["bench", "streams", "--total", str(1 << 20), "--iters", "30", "--repeat", "1", "--loop", loop,
                 "--json", "--device", rdma_device.name, "--processes", str(processes)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["address"] == rdma_device.address and data["write_size"] == 65536
    assert data["processes"] == processes
    assert data["busy_poll_us"] == 1000
    for key in ("aiodat_mb_s", "aiodat_busy_mb_s", "tcp_mb_s", "rstream_mb_s", "aiodat_rtt", "aiodat_busy_rtt",
                "tcp_rtt", "rstream_rtt"):
        figure = data["figures"][key]
        assert figure["errors"] is None and 0 < figure["median"] < math.inf, (key, figure)
    assert all(r["median"] and r["median"] > 0 for r in data["ratios"]), data["ratios"]
    # aiodat and aiodat busy poll, each against rstream and TCP, both figures; then TCP against rstream
    assert len(data["ratios"]) == 10
    assert [r["label"] for r in data["ratios"][-2:]] == ["asyncio TCP / rstream throughput (reference)",
                                                          "asyncio TCP / rstream round trip (reference)"]


@pytest.mark.hosts2
def test_bench_streams_two_hosts(two_hosts: None, capsys: Any) -> None:
    """Between the two hosts: the servers on host B (rstream's too), aiodat, rstream and asyncio TCP over the
    same link."""
    loop = os.environ["AIODAT_LOOP"]  # the loop the two_hosts fixture exported from --aiodat-loop
    assert main(["bench", "streams", "--two-hosts", "--loop", loop, "--total", str(1 << 20), "--iters", "30",
                 "--repeat", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hosts"] == "2" and data["loop"] == loop
    for key in ("aiodat_mb_s", "aiodat_busy_mb_s", "tcp_mb_s", "rstream_mb_s", "aiodat_rtt", "aiodat_busy_rtt",
                "tcp_rtt", "rstream_rtt"):
        figure = data["figures"][key]
        assert figure["errors"] is None and 0 < figure["median"] < math.inf, (key, figure)
    # rstream's server ran on host B too: the same ratios as in one guest, each labelled with the link
    assert len(data["ratios"]) == 10 and all(r["median"] and r["median"] > 0 for r in data["ratios"]), data["ratios"]
    assert [r["label"] for r in data["ratios"][-2:]] == ["asyncio TCP / rstream 2 hosts throughput (reference)",
                                                          "asyncio TCP / rstream 2 hosts round trip (reference)"]
