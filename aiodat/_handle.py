"""The lifetime rules every DAT object shares.

Objects form a tree (IA > PZ > LMR/RMR/EP/SRQ, IA > EVD, IA > PSP).  Closing a
parent closes its children first, lowest ``_close_rank`` first, so the verbs
see QPs destroyed before their CQs and MRs before their PD.  ``close()`` is
idempotent; any other use after close raises :class:`aiodat.InvalidHandle`;
an IA dropped unclosed warns with ResourceWarning (children are owned by their
parent, so they are never dropped while it lives).
"""
from __future__ import annotations

import warnings
from typing import Any, ClassVar, Dict, Optional

from aiodat.errors import InvalidHandle


class Handle:
    """Base of every aiodat object that owns a verbs or rdma_cm resource."""

    _kind: ClassVar[str] = "object"
    #: children with a lower rank are closed first when their parent closes
    _close_rank: ClassVar[int] = 0

    def __init__(self, parent: Optional["Handle"]) -> None:
        self._parent = parent
        self._children: Dict["Handle", None] = {}  # insertion-ordered set
        self._closed = False
        if parent is not None:
            parent._check()
            parent._children[self] = None

    @property
    def closed(self) -> bool:
        """True once the object has been freed or closed."""
        return self._closed

    def _check(self) -> None:
        """Raise InvalidHandle if this object (or an ancestor) is closed."""
        if self._closed:
            raise InvalidHandle(f"{self._kind} is closed", subtype=f"DAT_INVALID_HANDLE_{self._kind.upper()}")

    def close(self) -> None:
        """Free this object and everything created from it. Idempotent."""
        if self._closed:
            return
        children = sorted(self._children, key=lambda child: child._close_rank)
        first_error: Optional[BaseException] = None
        for child in children:
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
        if first_error is not None:
            raise first_error

    def _release(self) -> None:
        """Destroy this object's own resources (children are already closed)."""

    def _refuse_close_while(self, busy: bool, why: str) -> None:
        """DAT's free calls refuse with DAT_INVALID_STATE while the object is in use."""
        if busy:
            from aiodat.errors import InvalidState

            raise InvalidState(f"cannot free {self._kind}: {why}")

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
    """A handle with no parent (the IA): warns if garbage-collected unclosed."""

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self._kind} {self!r}", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:
                pass
