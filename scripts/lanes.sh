# Sourced by scripts/test.sh: two_lanes runs the caller's functions lane_a and lane_b at once.
# tests/test_scripts.py runs it with lanes of its own.
#
# Both lanes, each in its own process group (so stopping a lane stops all of it, its guest
# included), lane A's output live and lane B's in a file. The first lane to fail stops the
# other at once and ends the run with lane B's log shown; when both pass, lane B's log follows.
two_lanes() {
  local lane_b_log lane_a_pid lane_b_pid done_pid status
  lane_b_log=$(mktemp "${TMPDIR:-/tmp}/aiodat-lane-b.XXXXXX")
  set -m
  lane_b "$@" </dev/null >"$lane_b_log" 2>&1 &
  lane_b_pid=$!
  lane_a "$@" </dev/null &
  lane_a_pid=$!
  set +m
  # stopped from outside (Ctrl-C, a time limit's SIGTERM): both lanes go, and lane B's log so far is shown
  trap 'kill -TERM -- -"$lane_a_pid" -"$lane_b_pid" 2>/dev/null || true; cat "$lane_b_log" 2>/dev/null || true; rm -f "$lane_b_log"' EXIT
  stage "lane B started beside lane A (its log follows lane A's)"
  status=0
  wait -n -p done_pid "$lane_a_pid" "$lane_b_pid" || status=$?
  if [ "$status" = 0 ]; then  # one lane passed: wait for the other
    [ "$done_pid" = "$lane_a_pid" ] && done_pid=$lane_b_pid || done_pid=$lane_a_pid
    wait "$done_pid" || status=$?
  fi
  if [ "$status" != 0 ]; then
    local lane=A
    [ "$done_pid" = "$lane_b_pid" ] && lane=B
    stage "lane $lane failed (exit $status): the run stops here, the other lane with it; lane B's log:"
    kill -TERM -- -"$lane_a_pid" -"$lane_b_pid" 2>/dev/null || true
    wait || true  # (so the log is whole when the EXIT trap shows it)
    exit "$status"
  fi
  trap - EXIT
  cat "$lane_b_log"
  rm -f "$lane_b_log"
}
