"""One fd registered with the running event loop (asyncio's or uvloop's).

aiodat hands three kinds of fd to the loop: completion channels (evd.py), the
rdma_cm event channel (cm.py) and the IA's async fd (evd.py).  Each is made
non-blocking and registered with ``loop.add_reader`` the first time something
waits on it from a running loop, and is removed before the fd is destroyed and
never on a loop that is already closed.

One loop: the first loop that watches an fd owns it.  Waiting on it from
another loop (another thread's, or a second loop in this thread) raises
InvalidState instead of moving the fd and stranding the owner's waiters.  Once
the owner is closed, the next loop may take it over (pytest gives each test a
loop of its own).

Lifetimes: the loop holds the watch, never the object it reports to (the
callback is held weakly), so an EVD or IA the program drops can be collected
while its fd is watched.  Its finalizer must not touch the loop, so the fd
stays open (``keep`` holds the raw object that owns it) until the loop itself
notices: at the next readiness of the fd, or at the loop's next sweep (every
``SWEEP_SECONDS`` while it watches anything), it unregisters the fd and lets
the raw object go.  A loop that closed before its sweep ran lets such fds go at
the next garbage collection, or when another loop first watches an fd.
"""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any, Callable, Dict, Optional, Set

from aiodat._lib import lib
from aiodat.errors import InvalidState, error_from_errno

#: how often a loop that watches aiodat fds looks for watches whose object was dropped
SWEEP_SECONDS = 0.5

# loop -> the watches it has registered (for the sweep); weak, so a dropped loop takes its set along
_watched: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Set[FdWatch]]" = weakref.WeakKeyDictionary()


class FdWatch:
    """Registers ``callback`` (a bound method, held weakly) as the reader of ``fd`` on the running loop.

    ``keep`` is whatever owns the fd (a raw verbs object): held as long as the
    loop watches the fd, so the fd cannot be closed under the loop.
    """

    def __init__(self, fd: int, callback: Callable[[], None], what: str, keep: Any = None) -> None:
        err = lib.aiodat_set_nonblocking(fd)
        if err:
            raise error_from_errno(err, f"making the {what} fd non-blocking")
        self.fd = fd
        # the owner weakly and its function strongly: one C-level call per wake-up (WeakMethod's is Python)
        self._owner_ref = weakref.ref(callback.__self__)  # type: ignore[attr-defined]
        self._func = callback.__func__  # type: ignore[attr-defined]
        self._what = what
        self._keep = keep
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the loop watching now
        self._owner: Optional[asyncio.AbstractEventLoop] = None  # the loop it belongs to

    def attach(self) -> Optional[asyncio.AbstractEventLoop]:
        """Make sure the running loop (if any) watches the fd; return that loop.

        Raises InvalidState if the fd belongs to another loop that is still open.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._refuse_outside_owner()
            return None
        if loop is not self._loop:
            self._check_owner(loop)
            self.detach()
            loop.add_reader(self.fd, self._ready)
            self._loop = self._owner = loop
            watches = _watched.get(loop)
            if watches is None:
                _forget_closed_loops()
                watches = _watched[loop] = set()
                loop.call_later(SWEEP_SECONDS, _sweep, loop)
            watches.add(self)
        return loop

    def check_loop(self) -> None:
        """Raise InvalidState if the running loop may not watch the fd (another open loop owns
        it), without registering it: for a call that must fail before it starts anything."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._refuse_outside_owner()
            return
        if loop is not self._loop:
            self._check_owner(loop)

    def _refuse_outside_owner(self) -> None:
        """A call with no loop running here (a plain thread) while the owner runs, in another
        thread: its reader callback may be handling this fd's events at that moment (a connect
        from here would add a cm_id that the loop's events look up), so refuse it.  With the
        owner stopped, or no owner yet, the call goes ahead (a script with no loop)."""
        owner = self._owner
        if owner is not None and owner.is_running():
            raise InvalidState(
                f"this aiodat object belongs to an event loop running in another thread ({owner!r}); "
                f"its {self._what} events are handled there: make the call in that thread "
                "(loop.call_soon_threadsafe, or asyncio.run_coroutine_threadsafe for a coroutine)")

    def _check_owner(self, loop: asyncio.AbstractEventLoop) -> None:
        owner = self._owner
        if owner is not None and owner is not loop and not owner.is_closed():
            raise InvalidState(
                f"this aiodat object belongs to the event loop it first waited on ({owner!r}); its "
                f"{self._what} fd cannot be watched by another loop or thread ({loop!r}): "
                "open a separate IA for each loop")

    def detach(self) -> None:
        """Stop watching; safe to call many times and after the loop closed."""
        loop, self._loop = self._loop, None
        if loop is not None:
            watches = _watched.get(loop)
            if watches is not None:
                watches.discard(self)
            if not loop.is_closed():
                try:
                    loop.remove_reader(self.fd)
                except (ValueError, OSError):
                    pass

    @property
    def orphaned(self) -> bool:
        """True once the object the callback belongs to was collected."""
        return self._owner_ref() is None

    def _ready(self) -> None:
        owner = self._owner_ref()
        if owner is None:  # its object was dropped: stop watching, let the fd's owner go
            self._retire()
        else:
            self._func(owner)

    def _retire(self) -> None:
        self.detach()
        self._keep = None


def _sweep(loop: asyncio.AbstractEventLoop) -> None:
    """A loop callback: retire the watches whose object was dropped; again later while any remain."""
    watches = _watched.get(loop)
    if not watches:
        _watched.pop(loop, None)
        return
    for watch in [w for w in watches if w.orphaned]:
        watch._retire()
    if watches:
        loop.call_later(SWEEP_SECONDS, _sweep, loop)
    else:
        _watched.pop(loop, None)


def _forget_closed_loops() -> None:
    """Let closed loops go, with the fds of objects dropped while they ran.

    A loop that closed before its sweep ran leaves its watches here, and they hold it (each
    watch names its loop), so neither the loop nor a dropped object's fds would ever be freed.
    The next garbage collection, or another loop's first watch, retires them.  (What the loop's
    garbage then frees, the Raw holders free in order, whatever order the collector finalizes
    them in: _handle.Raw.)
    """
    # keyrefs(): one C-level copy, since another thread's loop may add its entry meanwhile
    for loop in [ref() for ref in _watched.keyrefs()]:
        if loop is None or not loop.is_closed():
            continue
        # (a default: a collection in here runs this again, which may take the entry first)
        for watch in _watched.pop(loop, ()):
            if watch.orphaned:
                watch._retire()


def _after_collection(phase: str, info: Dict[str, int]) -> None:
    """A gc callback.  Never raises (a callback's exception is only reported, as unraisable): a
    MemoryError before a closed loop's entry is popped leaves it for the next collection; after,
    the watches not yet retired go with the popped set, and their fds' owners with them."""
    if phase == "stop" and _watched:
        try:
            _forget_closed_loops()
        except MemoryError:
            pass


gc.callbacks.append(_after_collection)
