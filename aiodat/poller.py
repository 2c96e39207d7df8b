"""NAPI for completion queues: a busy CQ stays unarmed and is polled once per loop turn.

Arming a CQ (``ibv_req_notify_cq``) and reading its channel event cost a system
call each, and every completion that lands on an armed CQ makes the kernel
queue a channel event and wake the loop's ``epoll``.  While completions keep
coming none of that is needed.  So a wake-up leaves its CQ unarmed and hands
the EVD to its loop's :class:`Poller`, which polls every such EVD at each turn
of the loop (one ``call_soon``), as Linux NAPI polls a busy NIC with its
interrupt off.  An EVD goes back to sleep (its CQ armed, then polled once more
for what raced the arm) when the poller has found nothing on it for
:data:`IDLE_TURNS` turns and, for an EVD made with ``busy_poll_us``, that long
has passed since its last completion; in a turn that found nothing, the poller
spins on the busy-polling EVDs' CQs in C for a short slice.

Invariant: every CQ of an EVD is either armed or in its loop's poller, so no
completion waits unseen however the EVD is consumed (waits, callbacks, an
awaited bind, a disconnect's drain marker).  With both ends of a connection in
one process, rxe completes the peer's receive inside the sender's post, and a
callback EVD's reply is then found and delivered in the same poller turn, with
no system call and no wake-up between the two sides.

The poller is duck-typed over the EVD (evd.py is the layer above).  Its turn is
``_completions.turn`` (aiodat/_shim/completions.c), C that arms the EVDs that go to sleep and
calls the EVD's own Python methods for what is not the common case (``_poll_rest``,
``_napi_arm``, ``_napi_arm_retry``, ``_napi_failed``, ``_callback_raised``) and the poller's
``_decide`` for the EVDs that busy-poll.  ``_decide`` calls ``_napi_spin(spin_us)`` to spin and
``_napi_arm()`` (True: keep polling), which never raise, and reads ``_closed``, ``_callback``,
``_busy_poll_us`` and ``_busy_until``.  A channel's wake-up hands its EVD to the poller in C
too (``_completions.wakeup``); ``add`` is the Python path of that.
"""
from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any, Dict, List

from ._shim._completions import turn as _turn

#: turns with nothing found before an EVD's CQ is armed (a busy-polling EVD's at the earliest):
#: three, so that a task woken by its channel (the reader callback in one turn, the task in the
#: next) can run and post before its peer's EVD gives up, and a one-loop ping-pong settles into
#: polling instead of interrupts
IDLE_TURNS = 3
#: how many times one turn polls its EVDs again while callbacks' posts keep completions coming
PASSES = 16
#: longest stretch one turn spends spinning in C on busy-polling EVDs (us)
SPIN_SLICE_US = 20
#: the largest ``busy_poll_us`` an EVD (and a stream, which passes it on) accepts: one second
MAX_BUSY_POLL_US = 1_000_000

_monotonic = time.monotonic


class Poller:
    """The EVDs of one event loop whose CQs are unarmed, polled at each turn of the loop."""

    __slots__ = ("_loop", "_hot", "_scheduled", "__weakref__")  # (weak: poller_for's table)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: EVD -> turns in a row with nothing found
        self._hot: Dict[Any, int] = {}
        self._scheduled = False

    def __contains__(self, evd: Any) -> bool:
        return evd in self._hot

    def add(self, evd: Any) -> bool:
        """Poll ``evd`` from the next turn on; False when the loop is closed (arm it instead)."""
        if evd not in self._hot:
            self._hot[evd] = 0
        if not self._scheduled:
            if self._loop.is_closed():
                self._hot.pop(evd, None)
                return False
            self._loop.call_soon(self._turn)
            self._scheduled = True  # (after: a call_soon that raised must not leave it set)
        return True

    def discard(self, evd: Any) -> None:
        """Stop polling ``evd`` (it is being freed)."""
        self._hot.pop(evd, None)

    def _turn(self) -> None:
        # one C call (_completions.turn): the sweep, which looks at every EVD (hands what came to
        # its callback or waiting task) and counts the idle turns of the rest; after callbacks,
        # up to PASSES looks in this turn (a callback may have posted, and on one device the
        # peer's completion may be there already: a woken task runs only at the next turn);
        # then _decide when there is anything to decide, then the next turn's call_soon
        try:
            _turn(self, IDLE_TURNS, PASSES)
        except (SystemExit, KeyboardInterrupt):  # a callback's: on up, as from any loop callback,
            self._schedule_next()  # with the CQs still polled if the loop runs again
            raise
        except BaseException as exc:  # a loop callback: never let it escape (the EVD methods do not raise)
            self._loop.call_exception_handler({"message": "aiodat: the CQ poller failed", "exception": exc})
            self._schedule_next()

    def _schedule_next(self) -> None:
        if self._hot and not self._scheduled and not self._loop.is_closed():
            self._loop.call_soon(self._turn)
            self._scheduled = True

    def _decide(self, found_any: bool, rest: List[Any]) -> None:
        """The part of a turn Python decides, after the sweep: the EVDs in ``rest`` busy-poll (the
        turn arms the others itself); ``found_any``: the sweep found something."""
        hot = self._hot
        spinning: List[Any] = []
        for evd in rest:  # they busy-poll (the turn gives Python no other EVD)
            idle = hot.get(evd)
            if idle is None:  # freed by a callback in this turn
                continue
            idle += 1
            # busy polling lengthens the stay, never shortens it
            busy = evd._busy_poll_us and _monotonic() < evd._busy_until
            if busy:
                spinning.append(evd)
            if busy or idle < IDLE_TURNS:
                hot[evd] = idle
                continue
            del hot[evd]
            if evd._napi_arm():  # the arm failed: polled on, and tried again
                hot[evd] = 0
        if spinning and not found_any:
            # nothing came this turn and busy pollers wait: spin in C, a slice shared among them
            slice_us = max(1, SPIN_SLICE_US // len(spinning))
            for evd in spinning:
                if evd._napi_spin(slice_us) and evd in hot:
                    hot[evd] = 0


#: loop -> a weak reference to its poller.  Weak both ways, as a poller holds its loop (the C turn
#: reads ``_loop``) and its hot EVDs: a closed loop's poller, with the EVDs still hot in it and
#: their IA, must not be pinned here (a closed loop runs no turn that could let them go).  Those
#: EVDs hold the poller (``evd._poller``), so it lives exactly as long as anything uses it.
_pollers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ReferenceType[Poller]]" = (
    weakref.WeakKeyDictionary())


def poller_for(loop: asyncio.AbstractEventLoop) -> Poller:
    """The poller of ``loop``: made on first use, dropped once no EVD holds it and no turn is scheduled.

    Called when an EVD first hands its CQ to a loop's poller (it keeps the poller), never per turn.
    """
    ref = _pollers.get(loop)
    poller = ref() if ref is not None else None
    if poller is None:
        poller = Poller(loop)
        _pollers[loop] = weakref.ref(poller)
    return poller
