"""perftest as the C peer of a benchmark: run one tool as server and client over rdma_cm (``-R``) and
parse its result table."""
from __future__ import annotations

import math
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass
class PerftestResult:
    """One perftest run: the command lines, exit status, output and parsed result rows."""

    tool: str
    args: Tuple[str, ...]
    returncode: Optional[int]
    output: str
    rows: List[Dict[str, float]] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the client ran to the end and printed a result row."""
        return not self.error and bool(self.rows)

    def value(self, column: str) -> Optional[float]:
        """The figure in ``column`` of the last result row (e.g. "t_typical[usec]"), or None."""
        return self.rows[-1].get(column) if self.rows else None


def parse_perftest(output: str) -> List[Dict[str, float]]:
    """The result rows perftest printed: one dict per row, keyed by its header's column names.

    Column names are perftest's, with ``99% percentile[usec]`` written
    ``99%_percentile[usec]`` (e.g. ``t_typical[usec]``, ``BW average[MB/sec]``
    becomes ``BW_average[MB/sec]``).
    """
    rows: List[Dict[str, float]] = []
    header: Optional[List[str]] = None
    for line in output.splitlines():
        text = line.strip()
        if text.startswith("#bytes"):
            text = re.sub(r"(\S) (percentile|average|peak)\b", r"\1_\2", text)
            text = re.sub(r"\bBW (peak|average)", r"BW_\1", text)
            text = re.sub(r"\bMsgRate\[Mpps\]", "MsgRate[Mpps]", text)
            header = text.split()
            continue
        if header is None:
            continue
        parts = text.split()
        if not parts or not re.fullmatch(r"\d+", parts[0]):
            if text.startswith("-"):
                header = header  # a separator line: the table may go on
            continue
        try:
            values = [float(p) for p in parts]
        except ValueError:
            continue
        rows.append(dict(zip(header, values)))
    return rows


def _perftest_port() -> int:
    return random.randint(20000, 29999)


def run_perftest_pair(tool: str, args: Sequence[str], *, device: str, address: str,
                      timeout: float = 300.0, start_delay: float = 1.0,
                      prefix: Sequence[str] = (), figure: Optional[str] = None) -> PerftestResult:
    """Run perftest ``tool`` as a server and a client on ``address`` over rdma_cm (``-R``).

    Both processes get ``-d device -R -F -p PORT`` plus ``args``; the client
    connects to ``address`` and is retried while the server is not yet
    listening.  A pair whose client fails once the server has exited (under
    TCG perftest's own connection or completion now and then fails), or that
    has not finished within half of ``timeout`` (less for a short run:
    see _first_attempt_limit), is run once more, on a new
    port; so is one that printed 0, nothing or a
    non-finite number in the column ``figure`` (e.g. "MsgRate[Mpps]") when
    one is named, as its cycle counter now and then does under TCG.  This
    is the only retry: callers take the result as it comes.  Returns the
    client's parsed output (the server's when the client printed no table).
    Never raises for a failed tool: the result's ``error`` says what went
    wrong (tool or ``prefix[0]`` missing, timeout, exit status, an unusable figure; a retried
    failure names both attempts' errors).
    """
    path = shutil.which(tool)
    if path is None:
        return PerftestResult(tool, tuple(args), None, "",
                              error=f"{tool} not found (install the Debian package perftest)")
    if prefix and shutil.which(prefix[0]) is None:  # e.g. chrt (util-linux): not measured, no traceback
        return PerftestResult(tool, tuple(args), None, "", error=f"{prefix[0]} not found")
    deadline = time.monotonic() + timeout
    # the first attempt gets half the time, or less for a short run: a pair that hangs (both tools
    # blocked, as under TCG now and then) is killed and run again, not left to take the whole budget
    first = _usable(_run_pair_once(path, tool, args, device, address, _first_attempt_limit(args, timeout),
                                   start_delay, prefix), figure)
    left = deadline - time.monotonic()
    if (first.returncode in (0, None) and not first.error) or left <= 0:
        return first
    second = _usable(_run_pair_once(path, tool, args, device, address, left, start_delay, prefix), figure)
    if second.error:
        second.error = f"{second.error} (and before that, once: {first.error})"
    return second


#: a first attempt's bound for a run whose ``-n`` is given: seconds to start both tools and connect,
#: then seconds a message and a byte; about 20x what a pair takes under TCG (500 messages of 64 bytes:
#: 2 s), so only a hung pair reaches it
START_BOUND, MESSAGE_BOUND, BYTE_BOUND = 40.0, 0.005, 1 / 2e6


def _first_attempt_limit(args: Sequence[str], timeout: float) -> float:
    """How long the first attempt of ``args`` may run before it counts as hung: half of ``timeout``,
    and no more than START_BOUND + ``-n`` x (MESSAGE_BOUND + ``-s`` x BYTE_BOUND) when ``-n`` is given
    (the tests' short runs: a hang cost them 150 s of a 300 s timeout)."""
    def option(name: str, default: int) -> int:
        for flag, value in zip(args, args[1:]):
            if flag == name and value.isdigit():
                return int(value)
        return default

    iters = option("-n", 0)
    if not iters:
        return timeout / 2
    return min(timeout / 2, START_BOUND + iters * (MESSAGE_BOUND + option("-s", 65536) * BYTE_BOUND))


def _usable(res: PerftestResult, figure: Optional[str]) -> PerftestResult:
    """``res``, with an ``error`` if it ran but its ``figure`` column is missing, 0 or not finite."""
    if figure is not None and res.ok:
        value = res.value(figure)
        if value is None or not 0 < value < math.inf:
            res.error = f"{res.tool} printed {figure} = {value}"
    return res


def _run_pair_once(path: str, tool: str, args: Sequence[str], device: str, address: str, timeout: float,
                   start_delay: float, prefix: Sequence[str]) -> PerftestResult:
    port = str(_perftest_port())
    common = [*prefix, path, "-d", device, "-R", "-F", "-p", port, *args]
    deadline = time.monotonic() + timeout
    server = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True)
    client_out = ""
    client_rc: Optional[int] = None
    error = ""
    finished = False
    try:
        time.sleep(start_delay)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"{tool} did not finish within {timeout:g} s"
                break
            try:
                client = subprocess.run([*common, address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, timeout=left)
            except subprocess.TimeoutExpired as exc:
                client_out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                    else (exc.stdout or "")
                error = f"{tool} client did not finish within {timeout:g} s"
                break
            client_out, client_rc = client.stdout, client.returncode
            if client_rc == 0 or server.poll() is not None:
                break
            time.sleep(start_delay)  # the server may not be listening yet
        finished = True
    finally:
        if not finished:  # Ctrl-C (or a failure): the server goes now, not at its deadline
            server.kill()
        try:  # (once the pair ran out of time, the server is not waited for)
            server_out, _ = server.communicate(
                timeout=0 if error or not finished else max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.kill()
            server_out, _ = server.communicate()
    output = client_out
    rows = parse_perftest(client_out) or parse_perftest(server_out or "")
    if not error and client_rc != 0:
        error = f"{tool} client exited with status {client_rc}"
        output = client_out + "\n--- server ---\n" + (server_out or "")
    elif not error and not rows:
        error = f"{tool} printed no result table"
    return PerftestResult(tool, tuple(args), client_rc, output, rows, error)
