"""bench/syscall_timeline.py's parser and round-trip split, on a hand-written trace (no device, no tracer)."""
import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parent.parent / "bench" / "syscall_timeline.py"
_spec = importlib.util.spec_from_file_location("syscall_timeline", _path)
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)

# tracefs's text, as `cat /sys/kernel/tracing/trace` prints it: thread 7 posts (write), runs its
# tail, sleeps in epoll_pwait, wakes, is preempted for 30 us, and posts again; twice over.
TRACE = """\
# tracer: nop
          python-7       [000] d..2.   10.000000: sys_enter: NR 1 (5, 7ffc, 20, 2cc, 1, 0)
          python-7       [000] d..2.   10.000200: sys_exit: NR 1 = 32
          python-7       [000] d..2.   10.000300: sys_enter: NR 228 (1, 7ffe, 0, 0, 0, 0)
          python-7       [000] d..2.   10.000310: sys_exit: NR 228 = 0
          python-7       [000] d..2.   10.000500: sys_enter: NR 281 (a, 7ffe, 0, 0, 0, 0)
          python-7       [000] d..2.   10.001500: sys_exit: NR 281 = 1
          python-7       [000] d..2.   10.001600: sched_switch: prev_comm=python prev_pid=7 prev_prio=120 prev_state=R ==> next_comm=ksoftirqd/0 next_pid=14 next_prio=120
     ksoftirqd/0-14      [000] d..2.   10.001630: sched_switch: prev_comm=ksoftirqd/0 prev_pid=14 prev_prio=120 prev_state=S ==> next_comm=python next_pid=7 next_prio=120
          python-7       [000] d..2.   10.001900: sys_enter: NR 1 (5, 7ffc, 20, 2cc, 1, 0)
          python-7       [000] d..2.   10.002100: sys_exit: NR 1 = 32
          python-7       [000] d..2.   10.002500: sys_enter: NR 281 (a, 7ffe, 0, 0, 0, 0)
          python-7       [000] d..2.   10.003500: sys_exit: NR 281 = 1
          python-7       [000] d..2.   10.003900: sys_enter: NR 1 (5, 7ffc, 20, 2cc, 1, 0)
          python-7       [000] d..2.   10.004100: sys_exit: NR 1 = 32
"""


def test_round_trips_split_at_each_post(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text(TRACE)
    rows, comms = timeline.parse(str(path))
    assert comms[7] == "python"
    first, second = timeline.round_trips(rows[7])
    assert first["post"] == pytest.approx(200)
    assert first["tail"] == pytest.approx(300)  # the write's exit to the epoll_pwait
    assert first["asleep"] == pytest.approx(1000)
    assert first["head"] == pytest.approx(400)
    assert first["user"] == pytest.approx(300 + 400 - 10)  # the clock_gettime is a call, not user time
    assert first["preempted"] == pytest.approx(30)
    assert first["round trip"] == pytest.approx(1900)
    assert first["sleep"] == "epoll_pwait"
    assert second["preempted"] == 0 and second["round trip"] == pytest.approx(2000)


def test_report_leaves_out_threads_with_few_round_trips(tmp_path, capsys):
    path = tmp_path / "trace.txt"
    path.write_text(TRACE)
    timeline.report(str(path), min_rts=3)
    assert capsys.readouterr().out == ""
    timeline.report(str(path), min_rts=2)
    out = capsys.readouterr().out
    assert out.startswith("python/7: 2 round trips") and "post 200" in out and "epoll_pwait" in out
