"""scripts/lanes.sh, the two lanes of scripts/test.sh, run by bash with lanes of the test's own.

What it must do: run both lanes at once; when one fails, stop the other at once (its whole
process group) and exit with the failing lane's status; when both pass, show lane B's log after
lane A's output and return; on Ctrl-C, which reaches only the script, take both lanes with it.
"""

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Tuple

import pytest
from procs import live_pids

LANES = Path(__file__).resolve().parent.parent / "scripts" / "lanes.sh"


def lanes_script(tmp_path: Path, lane_a: str, lane_b: str) -> str:
    """A bash script running two_lanes with these lane bodies; each lane first notes its process
    group in tmp_path (a.pgid, b.pgid)."""
    return f"""
set -euo pipefail
stage() {{ echo "== $*"; }}
source {LANES}
pgid() {{ local _x; read -r _x _x _x _x pgid _x < /proc/$BASHPID/stat; echo "$pgid"; }}  # (bash: no spaces)
lane_a() {{ pgid > {tmp_path}/a.pgid; {lane_a}; }}
lane_b() {{ pgid > {tmp_path}/b.pgid; {lane_b}; }}
two_lanes
echo "after the lanes"
"""


def run_lanes(tmp_path: Path, lane_a: str, lane_b: str, timeout: float = 60) -> Tuple[subprocess.CompletedProcess, float]:
    """Run two_lanes with these lane bodies to the end; also how long it took."""
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", lanes_script(tmp_path, lane_a, lane_b)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL)
    return done, time.monotonic() - started


def group_alive(tmp_path: Path, lane: str) -> bool:
    """Whether a process of the lane's group still runs."""
    return bool(live_pids("pgid", int((tmp_path / f"{lane}.pgid").read_text())))


def test_both_lanes_pass_and_lane_b_log_follows(tmp_path: Path) -> None:
    done, _ = run_lanes(tmp_path, "sleep 0.5; echo lane-a-output", "echo lane-b-output")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.index("lane-a-output") < out.index("lane-b-output") < out.index("after the lanes")
    assert not list(tmp_path.glob("aiodat-lane-b.*")), "lane B's log file was left behind"


@pytest.mark.parametrize("failing", ["A", "B"])
def test_a_failing_lane_stops_the_other_at_once(tmp_path: Path, failing: str) -> None:
    fail, hang = "sleep 0.5; echo failing; exit 7", "sleep 300 & wait"  # (the sleep: a guest, say)
    lane_a, lane_b = (fail, hang) if failing == "A" else (hang, fail)
    done, took = run_lanes(tmp_path, lane_a, lane_b)
    assert done.returncode == 7, (done.stdout, done.stderr)
    assert took < 30, f"the run went on for {took:.0f} s after lane {failing} failed"
    assert f"lane {failing} failed (exit 7)" in done.stdout
    assert "after the lanes" not in done.stdout
    other = "b" if failing == "A" else "a"
    assert not group_alive(tmp_path, other), "the other lane's processes are still running"
    if failing == "B":  # its log is shown
        assert "failing" in done.stdout
    assert not list(tmp_path.glob("aiodat-lane-b.*"))


def test_ctrl_c_stops_both_lanes(tmp_path: Path) -> None:
    """Ctrl-C at a terminal reaches only the script (the lanes are in process groups of their
    own): it must take both lanes, guests and all, with it."""
    script = lanes_script(tmp_path, "sleep 300 & wait", "echo lane-b-so-far; sleep 300 & wait")
    run = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                           env={**os.environ, "TMPDIR": str(tmp_path)},
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert run.stdout is not None
        assert "lane B started" in run.stdout.readline()
        deadline = time.monotonic() + 10
        while not ((tmp_path / "a.pgid").exists() and (tmp_path / "b.pgid").exists()):
            assert time.monotonic() < deadline, "the lanes did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # (each lane writes its pgid before its sleep)
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=10) == -signal.SIGINT
        assert "lane-b-so-far" in run.stdout.read(), "lane B's log was not shown"
    finally:
        run.kill()
        run.wait()
        if run.stdout is not None:
            run.stdout.close()
    assert not list(tmp_path.glob("aiodat-lane-b.*")), "lane B's log file was left behind"
    deadline = time.monotonic() + 5
    while group_alive(tmp_path, "a") or group_alive(tmp_path, "b"):
        assert time.monotonic() < deadline, "a lane's processes outlived the Ctrl-C"
        time.sleep(0.05)
