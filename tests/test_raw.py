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
