"""pyverbs as the Python peer of ``aiodat bench latency``: run :mod:`aiodat.bench.pyverbs_pingpong` by path
under the system Python (where Debian's python3-pyverbs is installed) and read its round trips."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional

from .stats import percentile

#: the interpreter that has pyverbs (Debian installs python3-pyverbs for /usr/bin/python3 only)
PYVERBS_PYTHON = os.environ.get("AIODAT_PYVERBS_PYTHON", "/usr/bin/python3")
#: the ping-pong script, run by path (it imports nothing from aiodat)
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyverbs_pingpong.py")
#: its two ways to wait for a completion
PYVERBS_MODES = ("event", "poll")


@dataclass
class PyverbsResult:
    """One pyverbs ping-pong: sorted round trips (us), or the reason there are none."""

    mode: str
    rtt_us: List[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the ping-pong ran and measured round trips."""
        return not self.error and bool(self.rtt_us)

    @property
    def p50(self) -> Optional[float]:
        """Median round trip (us), None when it did not run."""
        return percentile(self.rtt_us, 50) if self.ok else None


def parse_pyverbs_output(mode: str, stdout: str) -> PyverbsResult:
    """The result of the script's one JSON line (the last line of ``stdout`` that parses)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        rtts = data.get("rtt_us") if isinstance(data, dict) else None
        if isinstance(rtts, list) and rtts and all(isinstance(v, (int, float)) for v in rtts):
            return PyverbsResult(mode, sorted(float(v) for v in rtts))
    return PyverbsResult(mode, error="the pyverbs ping-pong printed no round trips")


def run_pyverbs_pingpong(device: str, address: Optional[str], size: int, iters: int, mode: str,
                         signal_every: int, timeout: float = 300.0) -> PyverbsResult:
    """Run the pyverbs ping-pong in ``mode`` ("event" or "poll"); never raises for a failed run."""
    if mode not in PYVERBS_MODES:
        raise ValueError(f"mode must be one of {PYVERBS_MODES}, got {mode!r}")
    if not os.path.exists(PYVERBS_PYTHON):
        return PyverbsResult(mode, error=f"{PYVERBS_PYTHON} not found (set AIODAT_PYVERBS_PYTHON)")
    argv = [PYVERBS_PYTHON, SCRIPT, "--device", device, "--size", str(size), "--iters", str(iters),
            "--mode", mode, "--signal-every", str(signal_every)]
    if address:
        argv += ["--address", address]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return PyverbsResult(mode, error=f"the pyverbs ping-pong did not finish within {timeout:g} s")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        if "No module named 'pyverbs'" in proc.stderr:
            tail = [f"{PYVERBS_PYTHON} has no pyverbs (install Debian's python3-pyverbs)"]
        return PyverbsResult(mode, error=f"exit status {proc.returncode}: {tail[0]}")
    return parse_pyverbs_output(mode, proc.stdout)
