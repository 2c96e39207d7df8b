#!/bin/sh
# Before/after figures of a change to connection set-up, like with like: two checkouts of aiodat
# (each with its shim built) alternate in one guest run, each round `aiodat bench connect` with
# cmtime in the same round; ROUNDS rounds on uvloop, then one on asyncio.
#   aiodat rxe run -- bench/compare_connect_trees.sh OLD_TREE NEW_TREE [ROUNDS]   (one RESULT line per run)
[ $# -ge 2 ] || { echo "usage: $0 OLD_TREE NEW_TREE [ROUNDS]" >&2; exit 2; }
# Each tree runs from its own directory: `python -m` puts the working directory first on
# sys.path, ahead of PYTHONPATH, so from elsewhere every run would import the same tree.
python=$(cd "$(dirname "${PYTHON:-.venv/bin/python}")" && pwd)/$(basename "${PYTHON:-.venv/bin/python}")
rounds=${3:-3}
run() {  # tree loop
  out=$(cd "$1" && PYTHONPATH=. "$python" -m aiodat bench connect --repeat 1 --json --loop $2 2>&1 | tr -d '\n')
  echo "RESULT $1 $2 connect $out"
}
i=0
while [ $i -lt "$rounds" ]; do
  i=$((i + 1))
  for tree in "$1" "$2"; do run "$tree" uvloop; done
done
for tree in "$1" "$2"; do run "$tree" asyncio; done
