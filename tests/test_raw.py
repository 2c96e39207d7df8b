"""Issue 13 item 4 (pure, no device): the Raw holder keeps what a failed destruction needs."""
from __future__ import annotations

import gc
from typing import Any, List


def test_a_raw_object_whose_destruction_fails_keeps_what_it_depends_on() -> None:
    """(Pure.) An LMR whose deregistration fails keeps its buffer export: the device may still
    use the memory.  Raw keeps the object with its dependencies and tries again when another raw
    object is destroyed (in a garbage cycle a parent may be finalized before its child)."""
    from aiodat import _handle

    buffer = bytearray(b"still in use by the device")
    busy = [True]
    destroyed: List[str] = []

    def dereg(ptr: Any) -> int:
        if busy[0]:
            return 16  # EBUSY
        destroyed.append("mr")
        return 0

    raw = _handle.Raw(_handle.ffi.cast("void *", 1), dereg, "MR", buffer)
    assert raw.release() == 16
    assert raw in _handle._deferred and raw._deps == (buffer,)  # the export is kept
    del raw
    gc.collect()
    assert any(r._deps == (buffer,) for r in _handle._deferred)  # ... even with no one holding it
    busy[0] = False
    other = _handle.Raw(_handle.ffi.cast("void *", 2), lambda ptr: 0, "child")
    other.release()  # another destruction succeeds: the deferred one is tried again
    assert destroyed == ["mr"] and not any(r._deps == (buffer,) for r in _handle._deferred)


def test_a_deferred_raw_released_again_by_hand_is_never_destroyed_twice() -> None:
    from aiodat import _handle

    calls: List[int] = []

    def destroy(ptr: Any) -> int:
        calls.append(1)
        return 16 if len(calls) == 1 else 0

    raw = _handle.Raw(_handle.ffi.cast("void *", 3), destroy, "SRQ")
    assert raw.release() == 16 and raw in _handle._deferred
    assert raw.release() == 0  # the caller tried again, and it went
    assert raw not in _handle._deferred
    other = _handle.Raw(_handle.ffi.cast("void *", 4), lambda ptr: 0, "other")
    other.release()  # a later retry must not call destroy on it again
    assert len(calls) == 2


class _Cycle:
    """A garbage cycle that alone holds Raw holders: only the collector can free them."""

    def __init__(self, raws: List[Any]) -> None:
        self.raws = raws
        self.me = self


def test_a_collected_cycle_destroys_children_before_their_parents_whatever_the_finalizer_order() -> None:
    """(Pure.) When the collector frees a dead cycle it calls every reachable finalizer in an
    order of its own (PEP 442), so a device context's Raw may be finalized before its QP's:
    destroyed first, the QP's destroy would then use freed memory.  A Raw that live Raws still
    depend on waits for them, in both creation orders."""
    from aiodat import _handle

    for parent_first in (True, False):
        order: List[str] = []
        alive = set()

        def destroyer(name: str) -> Any:
            alive.add(name)

            def destroy(ptr: Any) -> int:
                assert all(dep not in alive for dep in needs[name]), f"{name} destroyed before {needs[name]}"
                alive.discard(name)
                order.append(name)
                return 0
            return destroy

        needs = {"context": ["pd", "qp", "mr"], "pd": ["qp", "mr"], "qp": [], "mr": []}
        context = _handle.Raw(_handle.ffi.cast("void *", 11), destroyer("context"), "device context")
        pd = _handle.Raw(_handle.ffi.cast("void *", 12), destroyer("pd"), "PD", context)
        qp = _handle.Raw(_handle.ffi.cast("void *", 13), destroyer("qp"), "QP", pd)
        mr = _handle.Raw(_handle.ffi.cast("void *", 14), destroyer("mr"), "MR", pd)
        raws = [context, pd, qp, mr] if parent_first else [mr, qp, pd, context]
        _Cycle(raws if parent_first else list(reversed(raws)))
        del context, pd, qp, mr, raws
        gc.collect()
        assert sorted(order) == ["context", "mr", "pd", "qp"], order
        assert order[-1] == "context" and order.index("pd") > max(order.index("qp"), order.index("mr"))
        assert not _handle._deferred


def test_a_window_that_no_longer_needs_its_qp_lets_it_go() -> None:
    """(Pure.) ``unneed`` undoes ``need``: an unbound window's Raw stops holding the QP's."""
    from aiodat import _handle

    destroyed: List[str] = []
    qp = _handle.Raw(_handle.ffi.cast("void *", 21), lambda ptr: destroyed.append("qp") or 0, "QP")
    mw = _handle.Raw(_handle.ffi.cast("void *", 22), lambda ptr: destroyed.append("mw") or 0, "MW")
    mw.need(qp)
    assert qp._users == 1
    mw.unneed(qp)
    assert qp._users == 0 and mw._deps == ()
    del qp
    assert destroyed == ["qp"]  # the window no longer kept it
    mw.release()
    assert destroyed == ["qp", "mw"]
    cq = _handle.Raw(_handle.ffi.cast("void *", 23), lambda ptr: 0, "CQ")
    twice = _handle.Raw(_handle.ffi.cast("void *", 24), lambda ptr: 0, "QP", cq, cq)  # send and recv CQ
    assert cq._users == 2
    twice.unneed(cq)
    assert cq._users == 0 and cq.release() == 0


def test_a_fork_while_a_thread_retries_leaves_the_child_able_to_retry(tmp_path: Any) -> None:
    """(Pure.) A fork taken while another thread was retrying deferred destroys (the flag set) left the
    child's flag set for good: nothing the child deferred was ever destroyed again.  Here a raw
    object of the child's whose first destroy fails is destroyed by the next collection."""
    script = tmp_path / "fork_retry.py"
    script.write_text('''
import gc, os, sys
from aiodat import _handle
from aiodat._lib import ffi
_handle._retrying = True  # as if another thread were retrying when the fork came
pid = os.fork()
if pid == 0:
    tries = []
    raw = _handle.Raw(ffi.new("int *"), lambda ptr: 0 if tries.append(ptr) or len(tries) > 1 else 16,
                      "test object")  # (16: EBUSY, the first time)
    raw.release()
    gc.collect()  # the deferred one is tried again
    os._exit(0 if len(tries) == 2 and raw.ptr == ffi.NULL and not _handle._deferred else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
''')
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_then_that_raises_is_run_again_at_the_next_collection() -> None:
    """(Pure.) A Raw's ``then`` (what the device held through it: a QP's requests, an SRQ's
    receives) that raises when the Raw is finalized (a MemoryError in the collection of a dropped
    EP, say) is kept, with the Raw on the deferred list, and run again after the next collection,
    until it goes through; the object is destroyed once.  (It was lost: its Raw's finalizer
    swallowed the exception, and the LMRs stayed counted for good.)  An exception that is no
    Exception still goes on up, the ``then`` kept all the same."""
    import weakref

    import pytest

    from aiodat import _handle

    destroyed: List[int] = []
    runs: List[bool] = []
    failing = [True]

    def then() -> None:
        runs.append(failing[0])
        if failing[0]:
            raise MemoryError

    raw = _handle.Raw(_handle.ffi.cast("void *", 21), lambda ptr: destroyed.append(1) or 0, "QP")
    raw.then = then
    ref = weakref.ref(raw)
    del raw  # finalized: destroyed, its ``then`` fails
    kept = ref()
    assert kept is not None and kept in _handle._deferred and kept.then is then
    assert kept.ptr == _handle.ffi.NULL and destroyed == [1] and runs and all(runs)
    del kept
    tried = len(runs)
    gc.collect()  # fails again: still kept
    assert len(runs) > tried and ref() is not None and ref() in _handle._deferred
    failing[0] = False
    gc.collect()
    assert runs[-1] is False and runs.count(False) == 1 and ref() is None and destroyed == [1]

    def interrupted() -> None:
        runs.append(True)
        if len(runs) == 1:
            raise KeyboardInterrupt

    runs.clear()
    raw = _handle.Raw(_handle.ffi.cast("void *", 22), lambda ptr: 0, "SRQ")
    raw.then = interrupted
    with pytest.raises(KeyboardInterrupt):
        raw.release()
    assert raw in _handle._deferred and raw.then is interrupted
    gc.collect()
    assert len(runs) == 2 and raw not in _handle._deferred and raw.then is None


def test_a_raw_whose_finalizer_runs_out_of_memory_before_the_destruction_is_destroyed_later() -> None:
    """(Pure.) A dropped Raw whose release raises (a MemoryError before the destruction: the deps'
    iterator, say) is kept on the deferred list and destroyed, once, after the next collection, and
    what it depends on is let go.  (Its finalizer swallowed the exception and the Raw went: the
    verbs object leaked and its CQs, PD and device context stayed counted for good, deferred for
    ever once closed: a later test's ``assert not _handle._deferred`` failed.)"""
    from aiodat import _handle

    parent = _handle.Raw(_handle.ffi.cast("void *", 1), lambda ptr: 0, "CQ")
    calls: List[int] = []

    def destroy(ptr: Any) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError
        return 0

    raw = _handle.Raw(_handle.ffi.cast("void *", 2), destroy, "QP", parent)
    assert parent._users == 1
    del raw  # its finalizer runs out of memory
    assert [r.what for r in _handle._deferred] == ["QP"] and parent._users == 1
    gc.collect()  # the retry
    assert calls == [1, 1] and not _handle._deferred and parent._users == 0
    assert parent.release() == 0 and parent.ptr == _handle.ffi.NULL
