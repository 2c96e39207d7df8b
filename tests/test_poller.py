"""The loop's CQ poller (aiodat/poller.py) as a state table, host-only: when an EVD stays with the
poller, when it is armed, and what a turn does.  The EVD side is a small stand-in recording the
poller's calls, which reach it through the poller's C looks (aiodat/_shim/completions.c); the
real EVDs are exercised on rxe in tests/test_delivery_modes.py and tests/test_wakeups.py."""
from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections import deque
from typing import Any, Deque, List

from aiodat import poller as P


class FakeEVD:
    """What the poller reads and calls on an EVD, with scripted answers."""

    def __init__(self, finds: List[bool], busy_poll_us: int = 0, arm_fails: int = 0,
                 callback: bool = False) -> None:
        self._closed = False
        self._callback = (lambda events: None) if callback else None
        self._busy_poll_us = busy_poll_us
        self._busy_until = time.monotonic() + busy_poll_us * 1e-6
        self.finds = list(finds)
        self.arm_fails = arm_fails
        self.calls: List[str] = []

    #: the poller's looks are C (_completions.turn), and C's look hands an EVD
    #: with a backlog to its Python _poll_rest: that is where this stand-in answers; C's
    #: hand-over then finds nothing queued and no task waiting
    _backlog = ["scripted"]
    _queue: Deque[Any] = deque()
    _waiter = None

    def _poll_rest(self, found: int) -> bool:
        self.calls.append("poll")
        return self.finds.pop(0) if self.finds else False

    def _napi_spin(self, spin_us: int) -> bool:
        self.calls.append(f"spin{spin_us}")
        return self.finds.pop(0) if self.finds else False

    def _napi_arm(self) -> bool:
        self.calls.append("arm")
        if self.arm_fails:
            self.arm_fails -= 1
            return True
        return False


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_an_evd_with_nothing_coming_is_armed_after_the_idle_turns() -> None:
    poller = P.Poller(asyncio.get_running_loop())
    evd = FakeEVD([])
    poller.add(evd)
    await turns(P.IDLE_TURNS + 3)
    assert evd.calls == ["poll"] * P.IDLE_TURNS + ["arm"]
    assert evd not in poller


async def test_each_completion_restarts_the_idle_turns() -> None:
    poller = P.Poller(asyncio.get_running_loop())
    evd = FakeEVD([False, True, False, False, True])
    poller.add(evd)
    await turns(10 + P.IDLE_TURNS)
    # found at the 2nd and 5th looks: armed only after IDLE_TURNS empty looks following the last
    assert evd.calls == ["poll"] * (5 + P.IDLE_TURNS) + ["arm"]


async def test_callbacks_are_looked_at_again_in_the_same_turn_and_waits_are_not() -> None:
    loop = asyncio.get_running_loop()
    for callback, expected in ((True, 4), (False, 1)):
        poller = P.Poller(loop)
        evd = FakeEVD([True, True, True, False], callback=callback)
        poller.add(evd)
        await turns(1)
        assert evd.calls.count("poll") == expected, (callback, evd.calls)


async def test_a_busy_evd_stays_for_its_window_and_spins_only_when_nothing_came() -> None:
    poller = P.Poller(asyncio.get_running_loop())
    busy = FakeEVD([True], busy_poll_us=100_000)
    poller.add(busy)
    await turns(1)
    assert busy.calls == ["poll"]  # it found something: no spin this turn
    await turns(3)
    assert busy.calls[1:] == ["poll", f"spin{P.SPIN_SLICE_US}"] * 3
    assert busy in poller
    busy._busy_until = 0.0  # the window has passed
    await turns(2)
    assert busy.calls[-1] == "arm" and busy not in poller


async def test_a_failed_arm_keeps_the_evd_polled_and_is_tried_again() -> None:
    poller = P.Poller(asyncio.get_running_loop())
    evd = FakeEVD([], arm_fails=1)
    poller.add(evd)
    await turns(2 * P.IDLE_TURNS + 3)
    assert evd.calls.count("arm") == 2 and evd not in poller


async def test_closed_and_discarded_evds_are_dropped_unpolled() -> None:
    poller = P.Poller(asyncio.get_running_loop())
    closed, discarded = FakeEVD([]), FakeEVD([])
    poller.add(closed)
    poller.add(discarded)
    closed._closed = True
    poller.discard(discarded)
    await turns(3)
    assert closed.calls == [] and discarded.calls == []
    assert closed not in poller


def test_a_closed_loop_takes_nothing() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    poller = P.Poller(loop)
    evd = FakeEVD([])
    assert poller.add(evd) is False  # the EVD arms itself instead
    assert evd not in poller


async def test_one_poller_per_loop() -> None:
    loop = asyncio.get_running_loop()
    assert P.poller_for(loop) is P.poller_for(loop)
    other = asyncio.new_event_loop()
    try:
        assert P.poller_for(other) is not P.poller_for(loop)
    finally:
        other.close()


def test_a_closed_loops_hot_evds_are_not_kept() -> None:
    """A loop closed while an EVD is hot never runs the turn that would let the EVD go: neither
    poller_for's table nor the poller may keep it (and so its IA) alive once its owner drops it,
    even while the closed loop itself is still referenced (it was: the poller held its loop, and
    the table the poller, until another loop's first poller_for)."""
    loop = asyncio.new_event_loop()
    evd = FakeEVD([])
    poller = evd._poller = P.poller_for(loop)  # (as EVD._napi_add: the EVD holds its poller)
    assert poller.add(evd)  # a turn is scheduled
    del poller
    gc.collect()
    assert P.poller_for(loop) is evd._poller  # one poller per loop while anything uses it
    loop.close()  # before the turn ran: it never will
    gone = weakref.ref(evd)
    del evd
    gc.collect()
    assert gone() is None


async def test_a_short_busy_window_still_gets_the_idle_turns() -> None:
    """Busy polling lengthens an EVD's stay, never shortens it: a window shorter than a turn
    (50 us under emulation) must not arm the CQ sooner than a plain EVD's idle turns."""
    poller = P.Poller(asyncio.get_running_loop())
    evd = FakeEVD([], busy_poll_us=1)
    evd._busy_until = 0.0
    poller.add(evd)
    await turns(P.IDLE_TURNS + 3)
    assert evd.calls == ["poll"] * P.IDLE_TURNS + ["arm"]
