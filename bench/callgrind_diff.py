"""Where a round trip's instructions go: the difference of two callgrind profiles of one benchmark
mode, run for two numbers of round trips, divided by the difference (start-up and set-up cancel
out).  A developer's tool; the profiles come from the rxe guest (valgrind runs there unchanged):

    aiodat rxe run -- sh -c 'for n in 300 1300; do valgrind --tool=callgrind \\
        --callgrind-out-file=build/cb_$n.out .venv/bin/python bench/modes_pingpong.py uvloop $n 16 callback; done'
    python3 bench/callgrind_diff.py build/cb_300.out build/cb_1300.out 1000 [--calls REGEX]

It prints instructions per round trip by function (self cost), or with ``--calls`` the calls per
round trip to the functions REGEX matches, by caller (e.g. ``^PyObject_GetAttr$``).  Only modes
whose work per round trip does not depend on time qualify: a wait that spins until the
completion comes (await, busypoll) executes more the slower the run, and valgrind slows it.
Change no source between the two runs (a recompiled module adds its parser's work to one).
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
from typing import Counter, Tuple

COST = re.compile(r"\s*([\d,]+) \([^)]*\)\s+(.*)")
CALLER = re.compile(r"\s*[\d,]+ \([^)]*\)\s+\*\s+(\S+)")
CALLEE = re.compile(r"\s*[\d,]+ \([^)]*\)\s+>\s+(\S+) \(([\d,]+)x\)")


def annotate(path: str, *options: str) -> str:
    return subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", *options, path],
                          capture_output=True, text=True, check=True).stdout


def self_costs(path: str) -> Counter[str]:
    """Instructions by function (its own, not its callees'), and the program's total as TOTAL."""
    costs: Counter[str] = collections.Counter()
    for line in annotate(path).splitlines():
        m = COST.match(line)
        if m and "=>" not in line:
            name = "TOTAL" if "PROGRAM TOTALS" in line else m.group(2).split(" [")[0]
            costs[name] += int(m.group(1).replace(",", ""))
    return costs


def calls(path: str, callee: "re.Pattern[str]") -> Counter[Tuple[str, str]]:
    """Calls to the functions ``callee`` matches, by (caller, callee)."""
    counts: Counter[Tuple[str, str]] = collections.Counter()
    caller = None
    for line in annotate(path, "--tree=calling", "--inclusive=yes").splitlines():
        m = CALLER.match(line)
        if m:
            caller = m.group(1).split(":")[-1]
            continue
        m = CALLEE.match(line)
        if m and caller and callee.search(m.group(1).split(":")[-1]):
            counts[(caller, m.group(1).split(":")[-1])] += int(m.group(2).replace(",", ""))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("short"), ap.add_argument("long")
    ap.add_argument("round_trips", type=int, help="how many more round trips the long run made")
    ap.add_argument("--calls", metavar="REGEX", help="count calls to these functions instead")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    if args.calls:
        pattern = re.compile(args.calls)
        short, long = calls(args.short, pattern), calls(args.long, pattern)
        rows = [((long[k] - short[k]) / args.round_trips, f"{k[0]} -> {k[1]}") for k in set(short) | set(long)]
    else:
        a, b = self_costs(args.short), self_costs(args.long)
        rows = [((b[k] - a[k]) / args.round_trips, k) for k in set(a) | set(b)]
    for per_round_trip, name in sorted(rows, reverse=True)[:args.top]:
        print(f"{per_round_trip:10.1f}  {name}")


if __name__ == "__main__":
    main()
