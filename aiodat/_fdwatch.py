"""One fd registered with the running event loop (asyncio's or uvloop's).

aiodat hands three kinds of fd to the loop: completion channels (evd.py), the
rdma_cm event channel (cm.py) and the IA's async fd (evd.py).  Each is made
non-blocking and registered with ``loop.add_reader`` the first time something
waits on it from a running loop; it follows the caller to a new loop (pytest
gives each test its own), and is removed before the fd is destroyed and never
on a loop that is already closed.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from aiodat._lib import lib
from aiodat.errors import error_from_errno


class FdWatch:
    """Registers ``callback`` as the reader of ``fd`` on whichever loop is running."""

    def __init__(self, fd: int, callback: Callable[[], None], what: str) -> None:
        err = lib.aiodat_set_nonblocking(fd)
        if err:
            raise error_from_errno(err, f"making the {what} fd non-blocking")
        self.fd = fd
        self._callback = callback
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def attach(self) -> Optional[asyncio.AbstractEventLoop]:
        """Make sure the running loop (if any) watches the fd; return that loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        if loop is not self._loop:
            self.detach()
            loop.add_reader(self.fd, self._callback)
            self._loop = loop
        return loop

    def detach(self) -> None:
        """Stop watching; safe to call many times and after the loop closed."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self.fd)
            except (ValueError, OSError):
                pass
