#!/bin/sh
# Before/after figures of a change, like with like: two checkouts of aiodat (each with its shim
# built) alternate in one guest run, three rounds of latency and message rate on both loops.
#   aiodat rxe run -- bench/compare_trees.sh OLD_TREE NEW_TREE     (prints one RESULT line per run)
[ $# -eq 2 ] || { echo "usage: $0 OLD_TREE NEW_TREE" >&2; exit 2; }
# Each tree runs from its own directory: `python -m` puts the working directory first on
# sys.path, ahead of PYTHONPATH, so from elsewhere every run would import the same tree.
python=$(cd "$(dirname "${PYTHON:-.venv/bin/python}")" && pwd)/$(basename "${PYTHON:-.venv/bin/python}")
for i in 1 2 3; do
  for tree in "$1" "$2"; do
    for loop in uvloop asyncio; do
      for b in latency rate; do
        extra=""; [ $b = latency ] && extra="-n 2000"
        out=$(cd "$tree" && PYTHONPATH=. "$python" -m aiodat bench $b --no-perftest --json --loop $loop $extra 2>&1 | tr -d '\n')
        echo "RESULT $tree $loop $b $out"
      done
    done
  done
done
