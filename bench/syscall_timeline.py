"""Where does a ping-pong's round trip go, seen from the kernel?  A developer's tool, run as root where rxe is::

    aiodat rxe run -- .venv/bin/python bench/syscall_timeline.py -- CMD [ARGS...]
    aiodat rxe run -- .venv/bin/python bench/syscall_timeline.py --report trace.txt   # an earlier trace again

It turns on the kernel's own tracer (tracefs: system calls, scheduler switches and wake-ups,
softirqs) around ``CMD``, which should be a two-process ping-pong (for instance
``bench/echo_pair.py`` over aiodat streams or asyncio TCP, or ``ib_send_lat -R -e``), then
splits each process's round trips at the system call by which a message leaves: ``write(2)``
(rxe's doorbell: every ``ibv_post_send`` is one) or ``writev(2)``/``sendto(2)`` (a TCP send).
The tracer keeps its records in the kernel's ring buffer, so no recording process competes
for the guest's two vCPUs while the command runs (``perf record`` does, and it changes the
result).  Keep a boot's traced runs few and short: under TCG, one guest that traced four
echoes in a row locked up on the fifth.

For every thread that sent at least ``--min-rts`` messages, over the middle of its run, the
median of:

* **post**: the leaving system call itself (for rxe, the whole requester runs inside it);
* **tail**: from its return until the thread goes to sleep (the longest system call before the
  next message, usually ``epoll_wait``); what the loop does after a send;
* **asleep**: that sleep;
* **head**: from waking until the next message leaves: taking the peer's message and answering it;
* **user**: the part of head plus tail spent outside system calls;
* **preempted**: time the thread was runnable but switched out, between the post's return and
  the next message (one process of a ping-pong on the other's CPU).

Only head and post are on the round trip's critical path when each process has its own CPU:
a side's tail runs while the peer's head does.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from typing import Any, Dict, List, Tuple

TRACEFS = "/sys/kernel/tracing"
EVENTS = ("raw_syscalls/sys_enter", "raw_syscalls/sys_exit", "sched/sched_switch",
          "sched/sched_wakeup", "irq/softirq_entry", "irq/softirq_exit")
LEAVING = {"1": "write", "20": "writev", "44": "sendto"}
NAMES = {"0": "read", "1": "write", "7": "poll", "16": "ioctl", "20": "writev", "23": "select", "44": "sendto",
         "45": "recvfrom", "228": "clock_gettime", "232": "epoll_wait", "270": "pselect6",
         "281": "epoll_pwait", "441": "epoll_pwait2"}
LINE = re.compile(r"^\s*(.+)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):\s*(.*)$")
SWITCH = re.compile(r"prev_pid=(\d+) .*prev_state=(\S+) ==> .*next_pid=(\d+)")


def record(cmd: List[str], out: str) -> int:
    """Run ``cmd`` with the tracer on; the trace goes to ``out``.  Returns the command's status."""
    if not os.path.isdir(os.path.join(TRACEFS, "events")):
        subprocess.run(["mount", "-t", "tracefs", "none", TRACEFS], check=False)

    def put(path: str, value: str) -> None:
        with open(os.path.join(TRACEFS, path), "w") as f:
            f.write(value)

    put("tracing_on", "0")
    put("trace", "")
    put("buffer_size_kb", "32768")
    for event in EVENTS:
        put(f"events/{event}/enable", "1")
    put("tracing_on", "1")
    try:
        status = subprocess.call(cmd)
    finally:
        put("tracing_on", "0")
        for event in EVENTS:
            put(f"events/{event}/enable", "0")
    with open(os.path.join(TRACEFS, "trace")) as src, open(out, "w") as dst:
        dst.writelines(src)
    return status


def parse(path: str) -> Tuple[Dict[int, List[Tuple[float, str, str]]], Dict[int, str]]:
    """Per thread: its system call entries/exits, and its switches out/in, as (time us, kind, detail)."""
    rows: Dict[int, List[Tuple[float, str, str]]] = defaultdict(list)
    comms: Dict[int, str] = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            comm, tid, _cpu, t, event, detail = m.groups()
            us = float(t) * 1e6
            if event in ("sys_enter", "sys_exit"):
                rows[int(tid)].append((us, event, detail.split()[1]))
                comms[int(tid)] = comm
            elif event == "sched_switch":
                s = SWITCH.search(detail)
                if s:
                    rows[int(s.group(1))].append((us, "out", s.group(2)))
                    rows[int(s.group(3))].append((us, "in", ""))
    return rows, comms


def round_trips(rows: List[Tuple[float, str, str]]) -> List[Dict[str, Any]]:
    """Split one thread's records at each leaving system call; per round trip, its times (us) and
    ``sleep``, the name of the system call it slept in."""
    calls: List[Tuple[float, float, str]] = []  # (enter, exit, nr)
    out_at = None
    preempted: List[Tuple[float, float]] = []
    enter = None
    for t, kind, detail in rows:
        if kind == "sys_enter":
            enter = (t, detail)
        elif kind == "sys_exit" and enter is not None:
            calls.append((enter[0], t, enter[1]))
            enter = None
        elif kind == "out":
            out_at = t if detail.startswith("R") else None  # runnable, yet switched out
        elif kind == "in" and out_at is not None:
            preempted.append((out_at, t))
            out_at = None
    marks = [i for i, c in enumerate(calls) if c[2] in LEAVING]
    result = []
    for a, b in zip(marks, marks[1:]):
        between = calls[a + 1:b]
        if not between:
            continue
        sleep = max(between, key=lambda c: c[1] - c[0])
        post_exit, next_enter = calls[a][1], calls[b][0]
        in_calls = sum(c[1] - c[0] for c in between if c is not sleep)
        result.append({
            "post": calls[a][1] - calls[a][0],
            "tail": sleep[0] - post_exit,
            "asleep": sleep[1] - sleep[0],
            "head": next_enter - sleep[1],
            "user": (next_enter - post_exit) - (sleep[1] - sleep[0]) - in_calls,
            "preempted": sum(min(e, next_enter) - max(s, post_exit) for s, e in preempted
                             if e > post_exit and s < next_enter),
            "round trip": calls[b][0] - calls[a][0],
            "sleep": NAMES.get(sleep[2], sleep[2]),
        })
    return result


def report(path: str, min_rts: int) -> None:
    """Print the medians for every thread of the trace that sent at least ``min_rts`` messages."""
    rows, comms = parse(path)
    for tid, records in sorted(rows.items()):
        rts = round_trips(records)
        if len(rts) < min_rts:
            continue
        middle = rts[len(rts) // 10: len(rts) - len(rts) // 10]  # leave out the start and the end
        sleeps = Counter(r["sleep"] for r in middle)
        parts = ", ".join(f"{k} {statistics.median(r[k] for r in middle):.0f}"
                          for k in ("round trip", "head", "post", "tail", "asleep", "user", "preempted"))
        print(f"{comms.get(tid, '?')}/{tid}: {len(middle)} round trips, medians in us: {parts}; "
              f"sleeps in {dict(sleeps)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="syscall_timeline.txt", help="where the trace is written")
    parser.add_argument("--report", metavar="TRACE", help="only report an earlier trace")
    parser.add_argument("--min-rts", type=int, default=100, help="threads with fewer round trips are left out")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the ping-pong to run")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.min_rts)
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command to trace after --")
    status = record(cmd, args.trace)
    report(args.trace, args.min_rts)
    return status


if __name__ == "__main__":
    sys.exit(main())
