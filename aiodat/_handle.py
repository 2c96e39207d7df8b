"""The lifetime rules every DAT object shares.

Objects form a tree (IA > PZ > LMR/RMR/EP/SRQ, IA > EVD, IA > PSP).  Children
hold their parent; parents hold their children weakly, except those that serve
until freed, as a listening socket does (PSPs: the IA holds them).  Closing a parent
closes its (live) children first, lowest ``_close_rank`` first, so the verbs
see QPs destroyed before their CQs and MRs before their PD.  ``close()`` is
idempotent; any other use after close raises :class:`aiodat.InvalidHandle`.

Dropped objects: an object garbage-collected unclosed warns with
ResourceWarning (naming where it was created when Python runs in development
mode, ``python -X dev``).  Its verbs objects are freed by their :class:`Raw`
holders, which hold the holders they depend on (a QP's holds its CQs' and its
PD's), so reference counting frees children before parents.  A holder released
while one that depends on it lives waits for it, so the order holds also when
the garbage collector finalizes a dead cycle's holders in an order of its own,
and when a parent is closed before a dropped child's fd is let go.  Finalizers
only destroy verbs objects: they never call into the event loop.

Fork: verbs objects belong to the process that made them.  In a child after
``fork()`` every aiodat object is abandoned without touching the device: no
Raw holder destroys anything there (not when the child collects garbage, nor
when it exits), and using an object raises :class:`aiodat.InvalidState`
naming fork.
"""
from __future__ import annotations

import asyncio
import errno
import gc
import os
import sys
import traceback
import warnings
import weakref
from typing import Any, Callable, ClassVar, Dict, Iterator, List, MutableMapping, Optional, Set, Tuple

from aiodat._lib import ffi, lib
from aiodat.errors import InvalidHandle, InvalidState

#: bumped in every child after fork(): a Raw made in an older generation is the parent's
_generation = 0
#: every live root (IA): the child of a fork abandons their trees
_roots: "weakref.WeakSet[Handle]" = weakref.WeakSet()
#: raw objects not destroyed yet: those whose destruction failed, kept with what they depend on
#: (a buffer export, say: the device may still use them), and those released while a raw object
#: that depends on them still lived.  Each is tried again whenever another raw object is destroyed
#: and after every garbage collection, so it goes as soon as what kept it does.
_deferred: List["Raw"] = []
_retrying = False


def _after_fork_in_child() -> None:
    global _generation, _retrying
    _generation += 1
    # A thread of the parent may have been retrying (the flag would stay set for good in the
    # child, which has only this thread), and the parent's deferred objects are not the child's.
    _retrying = False
    _deferred.clear()
    for root in list(_roots):
        root._abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


def fail_waiter(fut: Any, exc: BaseException) -> None:
    """Fail a task's future with ``exc`` unless it is done already or its loop is closed.

    Closing an object fails the futures of the tasks waiting on it.  A program may close it
    after the loop those tasks ran in has ended (``asyncio.run`` is over, say), where
    ``set_exception`` itself would raise and stop the close half-way, leaving verbs objects
    behind: there is nobody left to tell, so nothing is set.
    """
    if fut is not None and not fut.done() and not fut.get_loop().is_closed():
        fut.set_exception(exc)


def fork_support() -> str:
    """How registered memory behaves across ``fork()`` here (``ibv_is_fork_initialized``).

    ``"unneeded"``: the kernel copies pinned pages for the child at fork (Linux
    5.13 and later), so the parent's registrations are unaffected whatever the
    child does: the normal case, and what aiodat's fork tests run on.
    ``"enabled"``: someone called ``ibv_fork_init``; registered memory is
    MADV_DONTFORK, absent from the child (touching it there faults).
    ``"disabled"``: an older kernel without it: a parent writing to registered
    memory after fork may get a copy the device does not see.
    """
    return {0: "disabled", 1: "enabled", 2: "unneeded"}.get(lib.ibv_is_fork_initialized(), "disabled")


class Raw:
    """One verbs or rdma_cm object and the call that destroys it.

    ``deps`` are the Raw holders (or buffers) it needs alive until it is
    destroyed.  :meth:`release` destroys it once; dropping the last reference
    releases it too (that is the finalizer of a dropped aiodat object).
    Nothing is destroyed in a forked child.
    """

    __slots__ = ("ptr", "what", "_destroy", "_deps", "_generation", "_users", "then", "__weakref__")

    def __init__(self, ptr: Any, destroy: Callable[[Any], int], what: str, *deps: Any) -> None:
        # ``ptr`` is stored last: a Raw whose set-up failed (a MemoryError) owns nothing, so its
        # finalizer destroys nothing, and the caller that made the object still frees it
        self.ptr = ffi.NULL
        self.what = what
        self._destroy = destroy
        self._deps = deps
        self._generation = _generation
        #: how many live Raw holders depend on this one (hold it in their deps)
        self._users = 0
        #: called once the object is gone (destroyed now or by a later retry, or left to the parent
        #: in a forked child): what the device held through it is released then, not before
        self.then: Optional[Callable[[], None]] = None
        for dep in deps:
            if isinstance(dep, Raw):
                dep._users += 1
        self.ptr = ptr

    def need(self, dep: Any) -> bool:
        """Also keep ``dep`` alive until this object is destroyed (a window bound through a QP);
        True if it was not kept already."""
        if self.ptr != ffi.NULL and not any(d is dep for d in self._deps):
            self._deps += (dep,)
            if isinstance(dep, Raw):
                dep._users += 1
            return True
        return False

    def unneed(self, dep: Any) -> None:
        """Stop keeping ``dep`` alive for this object (a window no longer bound through that QP)."""
        kept = tuple(d for d in self._deps if d is not dep)
        if isinstance(dep, Raw):
            dep._users -= len(self._deps) - len(kept)  # (once per copy, as __init__ counted them)
        self._deps = kept

    def _forget(self, deps: Optional[Iterator[Any]] = None) -> None:
        """Mark the object gone and let go of what it depended on (which may release them in turn).

        ``deps`` is the iterator of its deps, made before anything changed: nothing allocates
        between forgetting the deps and lowering their users, so a MemoryError cannot leave one
        counted for good (never destroyed).  ``then`` runs last; if it raises (a MemoryError in a
        finalizer's release, say), it is kept and the object waits on the deferred list, to run
        it again at the next retry: what it releases (an SRQ's posted receives, a QP's requests)
        is not left counted for good.  So a ``then`` must be restartable.  Only an exception
        that is no Exception (a KeyboardInterrupt) goes on up."""
        if deps is None:
            deps = iter(self._deps)
        then = self.then
        self.ptr, self._deps, self.then = ffi.NULL, (), None
        for dep in deps:
            if isinstance(dep, Raw):
                dep._users -= 1
        if then is not None:
            try:
                then()
            except BaseException as exc:
                # kept: a slot's store and ``in`` (by identity: a Raw has no __eq__) allocate nothing
                # before the append, which keeps a finalized Raw alive until the retry
                self.then = then
                if self not in _deferred:
                    _deferred.append(self)
                if not isinstance(exc, Exception):
                    raise

    def release(self) -> int:
        """Destroy the object (once); return the destroy call's result (0 or an errno).

        While a Raw that depends on this one lives, nothing is destroyed (EBUSY): the object
        waits in the deferred list and goes right after the last of them.  If destruction
        fails, the object and everything it depends on are kept alive (the device may still
        use them) and it is tried again later.
        """
        if self.ptr == ffi.NULL:
            return 0
        if self._generation != _generation:  # the parent's, in a forked child: never destroyed here
            self._forget()
            return 0
        if self._users:
            # A Raw that needs this one is alive: a child whose destruction failed, a dropped
            # object's channel its loop has not let go of yet, or (in a garbage collection, which
            # finalizes a dead cycle's objects in any order: PEP 442) a QP whose finalizer has not
            # run yet.  Destroyed first, a device context would leave them freed memory.
            _retry_deferred()
            if self._users:
                if not any(raw is self for raw in _deferred):
                    _deferred.append(self)  # (from a finalizer: resurrected until then)
                if self._users:  # (again: a collection in the append may have freed the last)
                    return errno.EBUSY
        deps = iter(self._deps)  # (made before the destruction: see _forget)
        err = self._destroy(self.ptr)
        if err:
            if not any(raw is self for raw in _deferred):
                _deferred.append(self)
            return err
        self.ptr = ffi.NULL  # at once: nothing may fail before a destroyed object is marked gone
        self._forget(deps)  # dropping the deps may release them in turn
        if _deferred:
            # it had failed before: no longer deferred (unless its ``then`` failed now: see _forget)
            if self.then is None and any(raw is self for raw in _deferred):
                _deferred[:] = [raw for raw in _deferred if raw is not self]
            if not _retrying:
                _retry_deferred()
        return 0

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # a finalizer: never raise
            # A MemoryError before the destruction (the deps' iterator, say) must not drop a live
            # object: its verbs object would leak and what it depends on stay counted for good (a
            # device context, CQs, a PD never destroyed).  Resurrected on the deferred list, for the
            # next retry (``in`` and an append that rarely grows: the allocation failed already).
            try:
                if self.ptr != ffi.NULL and self not in _deferred:
                    _deferred.append(self)
            except Exception:
                pass


def _retry_deferred() -> None:
    """Destroy what can be destroyed now among the deferred raw objects: those no live Raw
    needs any more, whose destruction (tried again) works."""
    global _retrying
    if _retrying or not _deferred:
        return
    _retrying = True
    try:
        progress = True
        while progress:
            progress = False
            for raw in list(_deferred):
                if raw.ptr != ffi.NULL and raw._generation == _generation and raw._users:
                    continue  # after what still needs it
                deps = iter(raw._deps)  # (made before the destruction, as in release)
                if raw.ptr != ffi.NULL and raw._generation == _generation:
                    if raw._destroy(raw.ptr):
                        continue  # fails still: tried again later
                    raw.ptr = ffi.NULL  # at once, as in release
                # off the list only once forgotten: a MemoryError in between (the iterator _forget
                # made) left a destroyed object off the list with its pointer, which its finalizer
                # then destroyed a second time
                raw._forget(deps)
                if raw.then is not None:
                    continue  # its ``then`` failed again: kept for the next retry (see _forget)
                try:
                    _deferred.remove(raw)
                except ValueError:  # (what _forget ran released it meanwhile, which took it off)
                    pass
                progress = True
    finally:
        _retrying = False


def _after_collection(phase: str, info: Dict[str, int]) -> None:
    """A gc callback: destroy what waited for a collection.  Never raises (a callback's exception
    is only reported, as unraisable): what a MemoryError stopped stays deferred, for the next."""
    if phase == "stop" and _deferred:
        try:
            _retry_deferred()
        except MemoryError:
            pass


gc.callbacks.append(_after_collection)


def _close_rank(handle: "Handle") -> int:
    return handle._close_rank


class Handle:
    """Base of every aiodat object that owns a verbs or rdma_cm resource."""

    _kind: ClassVar[str] = "object"
    #: children with a lower rank are closed first when their parent closes
    _close_rank: ClassVar[int] = 0
    _closed = True  # until __init__ ran: a half-built object is never "unclosed"
    _forked = False
    _created_at: Optional[List[str]] = None
    #: False for objects another one owns (an EP's own EVDs): that owner's warning covers them
    _warn_if_dropped = True
    #: True for objects that serve until freed, like a listening socket (PSPs): the parent holds them
    _parent_holds: ClassVar[bool] = False
    _held: Optional[Set["Handle"]] = None  # the children this one holds strongly (see _parent_holds)
    #: the children: weak, insertion-ordered (a child the program dropped goes; its Raws free it).
    #: Made with the first child: most objects (every EP and CR) never have one.  Until then this
    #: empty class-level dict stands in; it is only read (and popped from: a no-op), never written.
    _children: "MutableMapping[Handle, None]" = {}

    def __init__(self, parent: Optional["Handle"]) -> None:
        self._parent = parent
        if sys.flags.dev_mode:  # asyncpg's habit: say where a leaked object came from
            self._created_at = traceback.format_stack()[:-2]
        if parent is not None:
            parent._check()
            siblings = parent.__dict__.get("_children")
            if siblings is None:
                siblings = parent._children = weakref.WeakKeyDictionary()
            siblings[self] = None
            if self._parent_holds:
                if parent._held is None:
                    parent._held = set()
                parent._held.add(self)
        else:
            _roots.add(self)
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once the object has been freed or closed (or abandoned in a forked child)."""
        return self._closed

    def _check(self) -> None:
        """Raise InvalidHandle if this object (or an ancestor) is closed."""
        if self._closed:
            if self._forked:
                raise InvalidState(
                    f"this {self._kind} was made before fork() and belongs to the parent process; "
                    "aiodat objects are unusable in a child: open a new IA there")
            raise InvalidHandle(f"{self._kind} is closed", subtype=f"DAT_INVALID_HANDLE_{self._kind.upper()}")

    def close(self) -> None:
        """Free this object and everything created from it. Idempotent."""
        if self._closed:
            return
        self._refuse_foreign_thread()
        self._close_tree()

    def _discard(self) -> None:
        """Free an object its constructor could not finish: as close(), but from any thread, since
        no loop has seen it yet."""
        if not self._closed:
            self._close_tree()

    def _close_tree(self) -> None:
        first_error: Optional[BaseException] = None
        # (most objects, every EP and CR among them, have no children: no sort for those)
        for child in sorted(self._children, key=_close_rank) if self._children else ():
            try:
                child.close()
            except Exception as exc:  # keep closing the rest; report the first
                first_error = first_error or exc
        self._closed = True
        try:
            self._release()
        finally:
            if self._parent is not None:
                self._parent._children.pop(self, None)
                if self._parent._held is not None:
                    self._parent._held.discard(self)
        if first_error is not None:
            raise first_error

    def _release(self) -> None:
        """Destroy this object's own resources (children are already closed)."""

    def _serving_loop(self) -> Any:
        """The event loop that watches this object's tree (its IA's), or None; the IA says."""
        root = self
        while root._parent is not None:
            root = root._parent
        return root._serving_loop() if root is not self else None

    def _refuse_foreign_thread(self, call: str = "close") -> None:
        """A close (or another ``call`` that changes what the loop's callbacks use, such as a resize)
        from a thread other than the one running the loop that serves the object would change what
        those callbacks may be using at that moment (a CQ being drained): refused, before anything
        is done."""
        loop = self._serving_loop()
        if loop is not None and loop.is_running() and asyncio._get_running_loop() is not loop:
            raise InvalidState(f"{call}: this {self._kind} is served by an event loop running in another "
                               f"thread; call it in that thread (loop.call_soon_threadsafe, or "
                               f"asyncio.run_coroutine_threadsafe for a coroutine such as cr.accept)")

    def _abandon(self) -> None:
        """In a forked child: mark this tree unusable without touching the device."""
        for child in list(self._children):
            child._abandon()
        self._closed = self._forked = True

    def _refuse_close_while(self, busy: bool, why: str) -> None:
        """DAT's free calls refuse with DAT_INVALID_STATE while the object is in use."""
        if busy:
            raise InvalidState(f"cannot free {self._kind}: {why}")

    def _warn_unclosed(self) -> None:
        where = "".join(self._created_at) if self._created_at else ""
        hint = (f"; it was created at:\n{where}" if where
                else " (run Python with -X dev to see where it was created)")
        # (no source=self: a recorded warning would keep the object alive)
        warnings.warn(f"unclosed {self._kind} {self!r}{hint}", ResourceWarning, stacklevel=3)

    def __del__(self) -> None:
        # Only the warning: the Raw holders this object drops free its verbs objects, in order.
        if not self._closed and self._warn_if_dropped:
            try:
                self._warn_unclosed()
            except Exception:
                pass

    def __enter__(self) -> Any:
        self._check()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Any:
        self._check()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class RootHandle(Handle):
    """A handle with no parent (the IA).  Dropped unclosed, it warns like any handle; its tree is
    garbage with it (children hold their parent), and the Raw holders free it in order."""
