"""The IAs aiodat streams share: one per (event loop, device, address), and which device serves a host.

An aiodat object belongs to the event loop it first waited on, so a stream on
one loop must never use an IA another loop is watching: the pool's key is
``(loop, device, address)``.  Two loops in two threads each get their own IA;
the entries of a loop that has been closed are dropped (their IA closed) the
next time the pool is used.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from aiodat.errors import InvalidAddress, InvalidHandle, InvalidParameter, ProviderNotFound
from aiodat.netdev import same_address

__all__ = ["IAPool", "pool_key", "shared_ia_count", "device_for", "IARef", "check_ia", "PROVIDER_CACHE_SECONDS"]

PoolKey = Tuple[Any, str, Optional[str]]


def pool_key(loop: Any, name: str, address: Optional[str] = None) -> PoolKey:
    """The pool's key: the loop object itself (identity), the device name, the address (None: the first)."""
    return (loop, name, address)


def _open_ia(name: str, address: Optional[str]) -> Any:
    from aiodat.ia import open_ia  # the core's public opener (aiodat.open_ia)

    return open_ia(name, address=address)


class IAPool:
    """Shared IAs, reference-counted by the streams and servers using them, closed with the last of them.

    ``opener(name, address)`` opens an IA (aiodat.open_ia; tests pass a fake).
    """

    def __init__(self, opener: Callable[[str, Optional[str]], Any] = _open_ia) -> None:
        self._opener = opener
        self._entries: Dict[PoolKey, List[Any]] = {}  # key -> [ia, refcount]
        self._lock = threading.Lock()  # loops in several threads share the pool

    def acquire(self, loop: Any, name: str, address: Optional[str] = None) -> Any:
        """The IA of ``(loop, name, address)``, opened on first use; one more reference to it."""
        with self._lock:
            self._drop_closed_loops()
            key = pool_key(loop, name, address)
            entry = self._entries.get(key)
            if entry is None or entry[0].closed:
                entry = self._entries[key] = [self._opener(name, address), 0]
            entry[1] += 1
            return entry[0]

    def addref(self, ia: Any) -> None:
        """One more reference to a pooled IA (a connection a server accepted)."""
        with self._lock:
            for entry in self._entries.values():
                if entry[0] is ia:
                    entry[1] += 1

    def release(self, ia: Any) -> None:
        """Drop a reference; the last one closes the IA."""
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry[0] is ia:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        # closed first: if the close raises (from another thread than its loop's,
                        # say), the entry stays, to be reused or closed when its loop has ended
                        ia.close()
                        del self._entries[key]
                    return

    def open_count(self) -> int:
        """How many shared IAs are open (0 once every stream and server is closed)."""
        with self._lock:
            self._drop_closed_loops()
            return sum(1 for entry in self._entries.values() if not entry[0].closed)

    def keys(self) -> List[PoolKey]:
        """The keys of the open entries (for tests and debugging)."""
        with self._lock:
            return [key for key, entry in self._entries.items() if not entry[0].closed]

    def _drop_closed_loops(self) -> None:
        # a closed loop can never run its streams again: free their IA instead of keeping it forever
        for key in [k for k in self._entries if _loop_closed(k[0])]:
            ia = self._entries.pop(key)[0]
            try:
                ia.close()
            except Exception:  # closing after the loop is gone must not break the living loops
                pass


def _loop_closed(loop: Any) -> bool:
    is_closed = getattr(loop, "is_closed", None)
    return bool(is_closed()) if is_closed is not None else False


_POOL = IAPool()


def shared_ia_count() -> int:
    """How many per-device IAs the streams of this process hold open now (for leak checks)."""
    return _POOL.open_count()


#: how long the device and address list is reused before it is read again (a host that no
#: device has also reads it again at once)
PROVIDER_CACHE_SECONDS = 5.0
_providers_cache: Tuple[float, List[Any]] = (-PROVIDER_CACHE_SECONDS, [])


def _active_providers(refresh: bool = False) -> List[Any]:
    """The active device ports with addresses, cached: reading them opens every device."""
    global _providers_cache
    from aiodat.ia import list_providers  # aiodat.list_providers

    now = time.monotonic()
    if refresh or now - _providers_cache[0] > PROVIDER_CACHE_SECONDS:
        _providers_cache = (now, [p for p in list_providers() if p.state == "PORT_ACTIVE" and p.addresses])
    return list(_providers_cache[1])


def device_for(host: Optional[str], listening: bool = False) -> Tuple[str, Optional[str]]:
    """(device, address) for ``host``: the device that has that address, else one with an address of
    the same family ($AIODAT_RXE_DEVICE first).  A server (``listening``) must name a device's own address.
    The address is None for the port's first one (the IA's default), so one IA serves both."""
    from aiodat.ia import DEVICE_ENV, _names_port

    candidates = _active_providers()
    if listening and host and not any(same_address(a, host) for p in candidates for a in p.addresses):
        # an address may have been added since; a client's peer is mostly no local address at
        # all, and reading the list on the loop for every connect would open every device
        candidates = _active_providers(refresh=True)
    for p in candidates:
        for addr in p.addresses:
            if host and same_address(addr, host):
                # the port's first address is the IA's default: named None, as below, so a
                # server on that address and the clients of the loop share one IA, not two
                return p.name, (None if addr == p.addresses[0] else addr)
    if listening and host:
        known = ", ".join(a for p in candidates for a in p.addresses) or "none"
        raise InvalidAddress(f"cannot listen on {host}: no RDMA device has that address (an aiodat server "
                             f"listens on a device's address; the devices have: {known})")
    family6 = bool(host) and ":" in str(host)
    env = os.environ.get(DEVICE_ENV) or None
    # (as environment_port reads it: "rxe0", "rxe0:1" and "RO_AWARE_rxe0" name the same port)
    if env:  # a name that matches nothing is a mistake to report, not a preference to pass over
        # (the CLI, the benchmarks and the pytest plugin refuse it too)
        candidates = _with_port_named(env, candidates, f"no active port with an address matches {DEVICE_ENV}={env} "
                                                       f"(set in the environment)")
    candidates.sort(key=lambda p: not (env and _names_port(env, p)))
    for p in candidates:
        for addr in p.addresses:
            if (":" in addr) == family6:
                return p.name, (None if addr == p.addresses[0] else addr)
    if env:
        return env, None
    raise ProviderNotFound("no active RDMA device with an IP address%s; aiodat streams need one "
                           "(run under `aiodat rxe run -- ...` for Soft-RoCE)" % (" of that family" if candidates else ""))


def _with_port_named(name: str, candidates: List[Any], refusal: str) -> List[Any]:
    """``candidates`` (the active ports with an address), read again if none is the port the IA name
    ``name`` opens (it may have come up since); ProviderNotFound, ``refusal`` and the ports there
    are, if none is still."""
    from aiodat.ia import _names_port

    if not any(_names_port(name, p) for p in candidates):
        candidates = _active_providers(refresh=True)
        if not any(_names_port(name, p) for p in candidates):
            ports = ", ".join(p.name for p in candidates) or "none (run under `aiodat rxe run`)"
            raise ProviderNotFound(f"{refusal}; the RDMA ports with an address here: {ports}")
    return candidates


def device_addresses() -> List[str]:
    """Every address of the active device ports (cached, as device_for reads them)."""
    return [a for p in _active_providers() for a in p.addresses]


def check_ia(ia: Any) -> None:
    """Refuse an ``ia`` stream option that is neither None, a device name nor an aiodat.IA."""
    from aiodat.ia import IA  # aiodat.IA

    if ia is not None and not isinstance(ia, (str, IA)):
        raise InvalidParameter(f"ia must be None, a device name or an aiodat.IA, not {type(ia).__name__}")


def check_ia_option(ia: Any) -> None:
    """``ia`` as the integrations take it when they are made: :func:`check_ia`, and a name must open
    an active port (ProviderNotFound), since at a connect a framework would take the failure of
    every request for a network error, and retry it."""
    from aiodat.ia import _parse_name

    check_ia(ia)
    if isinstance(ia, str):
        _parse_name(ia)  # (InvalidParameter for what is no IA name at all)
        _with_port_named(ia, _active_providers(), f"ia={ia!r} opens no active port with an address")


class IARef:
    """The IA a connection or server uses: pooled (for the running loop) or the caller's own IA object."""

    def __init__(self, ia: Any, host: Optional[str], listening: bool = False) -> None:
        from aiodat.ia import IA  # aiodat.IA

        if isinstance(ia, IA):
            if ia.closed:
                raise InvalidHandle("the IA given to an aiodat stream is closed", subtype="DAT_INVALID_HANDLE_IA")
            self.ia, self._pooled = ia, False
        else:
            check_ia(ia)
            loop = asyncio.get_running_loop()
            if ia is None:
                self.ia = _POOL.acquire(loop, *device_for(host, listening))
            else:
                self.ia = _POOL.acquire(loop, ia, host if listening else None)
            self._pooled = True
        self._released = False

    def share(self) -> "IARef":
        """Another reference to the same IA (pooled IAs count it)."""
        ref = IARef.__new__(IARef)
        ref.ia, ref._pooled, ref._released = self.ia, self._pooled, False
        if self._pooled:
            _POOL.addref(self.ia)
        return ref

    def release(self) -> None:
        """Drop this reference (idempotent); the pool closes the IA with the last one."""
        if not self._released:
            self._released = True
            if self._pooled:
                _POOL.release(self.ia)


# the names streams.py had, for code that imported them from there
_IAPool = IAPool
_IARef = IARef
_device_for = device_for
