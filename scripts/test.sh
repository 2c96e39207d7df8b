#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, host-only tests, the wheel, the device
# tests on real rxe (natively or in a QEMU guest), once on asyncio and once on uvloop, the
# docs build and the shim under ASan, then the two-host tests (faults, Dask, streams).
# Device tests must run there: AIODAT_REQUIRE_DEVICE=1 turns a missing device into a failure.
#
# Two lanes at once: a guest under TCG keeps about one host CPU busy (the host was 50-55% busy
# on two CPUs through the whole one-guest device stage, 2026-11-30), so with two CPUs or more
# lane B (the uvloop device pass, then ASan, each in its own guest) runs beside lane A (host
# tests, the wheel, the asyncio device pass, docs). Lane B's log follows lane A's; a failure in
# either lane stops the other at once. On the development VM each guest then ran at 50-60% of
# its speed alone: 52-59 minutes instead of 61.
# The two-host stage runs last and alone: its loss windows and retry budgets are timed. One lane
# where there is one CPU, or no guest at all: native runs share the host's one rxe device under a lock.
set -euo pipefail
cd "$(dirname "$0")/.."
# each stage's header says how long the run has taken so far (CI's budget is 60 minutes)
stage() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }
./scripts/bootstrap.sh

# Hypothesis builds its tables of Unicode characters on first use and keeps them in .hypothesis/ (the
# guests share this directory): about 2 s here, where the first fuzz test in the guest paid 46 s
.venv/bin/python -W ignore -c 'from hypothesis import strategies as st; st.text().example()'

# One device pass in its own guest. A test still running after 300 s prints every thread's stack
# into the log: a stall of the device run, idle guest and no test finishing, was seen twice
# (2026-11-25) and its cause is not known. --durations lists the pass's slowest tests, so the log
# shows where the 60-minute budget goes.
device_pass() {  # device_pass LOOP MARKS [pytest args...]
  local loop=$1 marks=$2
  shift 2
  .venv/bin/aiodat rxe run --timeout "${AIODAT_TEST_TIMEOUT:-3600}" -- env AIODAT_REQUIRE_DEVICE=1 \
    .venv/bin/python -m pytest -q -m "$marks" -p no:cacheprovider -o faulthandler_timeout=300 --durations=15 \
    --aiodat-loop "$loop" "$@"
}

lane_b() {
  # A test marked loop_independent runs no loop of the chosen kind (it is synchronous, or the programs
  # it starts run on their own default loop): the uvloop pass leaves it out, as it would only repeat
  # the asyncio pass (examples, CLI runs, fuzzing: about 6 of the uvloop pass's minutes).
  stage "lane B: device tests on rxe, uvloop (its own guest)"
  device_pass uvloop "rxe and not loop_independent" "$@"
  if [ "${AIODAT_SKIP_ASAN:-0}" != 1 ]; then
    # issue 7: the C shim built with AddressSanitizer on the host (fast), its device tests in a guest
    stage "lane B: the C shim under AddressSanitizer (scripts/asan.sh, one guest)"
    AIODAT_ASAN_BUILD_ONLY=1 ./scripts/asan.sh
    .venv/bin/aiodat rxe run --timeout "${AIODAT_ASAN_TIMEOUT:-1200}" -- \
      env AIODAT_REQUIRE_DEVICE=1 AIODAT_ASAN_SKIP_BUILD=1 ./scripts/asan.sh
  fi
  stage "lane B passed"
}

lane_a() {
  stage "host-only tests (and the test bed's own boot tests)"
  .venv/bin/python -m pytest -q -m "not rxe and not hosts2" "$@"

  if [ "${AIODAT_SKIP_WHEEL:-0}" != 1 ]; then
    stage "the wheel: contents, its extension's dynamic section, installed with no compiler (host + one guest)"
    ./scripts/check_wheel.sh
  fi

  stage "device tests on rxe, asyncio (its own guest)"
  device_pass asyncio rxe "$@"

  if [ "${AIODAT_SKIP_DOCS:-0}" != 1 ]; then
    stage "docs build (warnings are errors)"
    .venv/bin/python -m mkdocs build --strict --quiet --site-dir "${TMPDIR:-/tmp}/aiodat-site"
  fi
  stage "lane A passed"
}

# two_lanes: lane A and lane B at once, the first failure stopping both
source scripts/lanes.sh

method=$(.venv/bin/aiodat rxe status --json 2>/dev/null |
  .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["method"])' || true)
if [ "$method" = qemu ] && [ "$(nproc)" -ge 2 ]; then
  two_lanes "$@"
else
  lane_a "$@"
  lane_b "$@"
fi

if [ "${AIODAT_SKIP_FAULTS:-0}" != 1 ]; then
  stage "two-host tests (two guests joined by a virtio link): faults, Dask and streams between hosts, asyncio, then uvloop"
  # packet loss lasts 30 s of each loss test here (60 s by default), and each loss rate runs in one pass
  # (asyncio_pass_only, uvloop_pass_only): about 12 min for both loops (TCG), plus the Dask test
  # (tests/test_hosts2_dask.py) in the same boot, once: it is marked both_loops (the test's own worker
  # on asyncio, the dask command lines on uvloop), so the uvloop pass leaves it out
  .venv/bin/aiodat rxe run --hosts 2 --timeout "${AIODAT_FAULTS_TIMEOUT:-2400}" -- \
    env AIODAT_REQUIRE_DEVICE=1 AIODAT_LOSS_WINDOW="${AIODAT_LOSS_WINDOW:-30}" sh -c '
    .venv/bin/python -m pytest -q -m "hosts2 and not uvloop_pass_only" -p no:cacheprovider --durations=5 --aiodat-loop asyncio tests/test_faults.py tests/test_hosts2_dask.py tests/test_bench_streams.py &&
    .venv/bin/python -m pytest -q -m "hosts2 and not both_loops and not asyncio_pass_only" -p no:cacheprovider --durations=5 --aiodat-loop uvloop tests/test_faults.py tests/test_hosts2_dask.py tests/test_bench_streams.py'
fi
stage "all tests passed"
