"""librdmacm's ``rstream`` (rsockets, rdmacm-utils) as the C stream peer of ``aiodat bench streams``: run a
server and a client on one address, parse the result line.

rstream's client sends ``-C`` messages of ``-S`` bytes, then the server sends
them back, ``-I`` times; it prints ``name bytes xfers iters total time Gb/sec
usec/xfer`` where Gb/sec counts both directions over the whole time (the two
directions take turns, so it is the one-way streaming rate) and usec/xfer is
the time per message: half a round trip with ``-C 1``.
"""
from __future__ import annotations

import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclass
class RstreamResult:
    """One rstream run: the parsed result (``gbps``, ``usec_per_xfer``, ...) or why there is none."""

    args: Tuple[str, ...]
    row: Optional[Dict[str, float]] = None
    output: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when rstream printed its result line."""
        return not self.error and self.row is not None

    @property
    def mb_s(self) -> Optional[float]:
        """Throughput in MB/s (10**6 bytes): the message size (``-S``) over usec/xfer.

        rstream prints Gb/sec with two decimals, steps of 1.25 MB/s (8 % of what it moves under
        emulation), and usec/xfer to 0.01 us; the two are the same figure (bytes per us).  Without
        ``-S`` in the arguments, Gb/sec is all there is.
        """
        if not (self.ok and self.row):
            return None
        args = list(self.args)
        if "-S" in args[:-1] and self.row["usec_per_xfer"] > 0:
            return int(args[args.index("-S") + 1]) / self.row["usec_per_xfer"]
        return self.row["gbps"] * 1000.0 / 8.0

    @property
    def rtt_us(self) -> Optional[float]:
        """Round trip (us) of a ``-C 1`` run: twice rstream's usec/xfer."""
        return 2.0 * self.row["usec_per_xfer"] if self.ok and self.row else None


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def _count(text: str) -> float:
    """rstream's sizes and counts ("64", "37k", "1m", "64k"): k/m/g are powers of 1000 or 1024 in its
    source depending on the column; only the first digits matter here, so they are read as 1000s."""
    text = text.lower()
    unit = text[-1] if text and text[-1] in "kmg" else ""
    return float(text[:-1] if unit else text) * _UNITS[unit]


def parse_rstream(output: str) -> Optional[Dict[str, float]]:
    """The last result line rstream printed, as ``{"bytes", "xfers", "iters", "total", "seconds", "gbps",
    "usec_per_xfer"}``, or None."""
    row = None
    header = False
    for line in output.splitlines():
        parts = line.split()
        if parts[:2] == ["name", "bytes"]:
            header = True
            continue
        if not header or len(parts) != 8 or not parts[5].endswith("s"):
            continue
        try:
            row = {"bytes": _count(parts[1]), "xfers": _count(parts[2]), "iters": _count(parts[3]),
                   "total": _count(parts[4]), "seconds": float(parts[5][:-1]), "gbps": float(parts[6]),
                   "usec_per_xfer": float(parts[7])}
        except ValueError:
            continue
    return row


def run_rstream_pair(address: str, args: Sequence[str], *, timeout: float = 300.0,
                     prefix: Sequence[str] = (), start_delay: float = 1.0,
                     server_host: Optional[int] = None) -> RstreamResult:
    """Run ``rstream -b ADDRESS -p PORT ARGS`` (server) and ``rstream -s ADDRESS -p PORT ARGS`` (client).

    ``server_host``: inside ``aiodat rxe run --hosts 2``, the host the server runs on
    (:func:`aiodat.testbed.hosts.start_on`; ``ADDRESS`` is then that host's); None: here.
    Never raises for a failed run: the result's ``error`` says what went wrong.
    """
    path = shutil.which("rstream")
    if path is None:
        return RstreamResult(tuple(args), error="rstream not found (install the Debian package rdmacm-utils)")
    if prefix and shutil.which(prefix[0]) is None:
        return RstreamResult(tuple(args), error=f"{prefix[0]} not found")
    port = str(random.randint(30000, 39999))
    deadline = time.monotonic() + timeout
    try:
        server = _start_server([*prefix, path, "-b", address, "-p", port, *args], server_host)
    except (OSError, RuntimeError) as exc:  # (RuntimeError: HostsUnavailable, host B's agent is not up)
        return RstreamResult(tuple(args), error=f"the rstream server did not start: {exc}")
    out, error = "", ""
    attempts = 5
    finished = False
    try:
        time.sleep(start_delay)
        for _attempt in range(attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"rstream did not finish within {timeout:g} s"
                break
            try:
                client = subprocess.run([*prefix, path, "-s", address, "-p", port, *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, timeout=left)
            except subprocess.TimeoutExpired:
                error = f"rstream did not finish within {timeout:g} s"
                break
            out = client.stdout
            if client.returncode == 0 or server.poll() is not None:
                if client.returncode != 0:
                    error = f"rstream client exited with status {client.returncode}"
                break
            time.sleep(start_delay)  # the server may not be listening yet
        else:
            error = f"rstream client failed {attempts} times (last exit status {client.returncode})"
        finished = True
    finally:
        if not finished:  # Ctrl-C (or a failure): the server goes now, not at its deadline
            server.kill()
        # (after a failure the server is not waited for, as in perftest.py)
        _reap(server, 0 if error or not finished else max(5.0, deadline - time.monotonic()))
    row = parse_rstream(out)
    if not error and row is None:
        error = "rstream printed no result line"
    return RstreamResult(tuple(args), row, out, error)


def _start_server(argv: List[str], host: Optional[int]) -> Any:
    """The server process: a local one, or one on ``host`` of a two-host test bed (the same
    ``poll``/``kill`` either way)."""
    if host is None:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True)
    from aiodat.testbed import hosts

    return hosts.start_on(host, argv)


def _reap(server: Any, wait_s: float) -> None:
    """Let the server end by itself within ``wait_s`` seconds, else kill it; its output is not used."""
    if isinstance(server, subprocess.Popen):
        try:
            server.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
        return
    try:
        server.wait(wait_s)
    except TimeoutError:
        server.kill()  # (its host's agent kills the process group and reaps it)
