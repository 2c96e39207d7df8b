"""Issue 13 item 5: the IAs aiodat streams share are keyed by (event loop, device, address), without a device.

An aiodat object belongs to the loop it first waited on, so two loops must
never share a pooled IA; a closed loop's IAs are closed and forgotten.  A fake
opener stands in for aiodat.open_ia.  (tests/test_streams.py has the device
test: two threads, two loops, streaming at the same time.)
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, List, Optional

import pytest

from aiodat.streams import pool as pool_mod
from aiodat.streams.pool import IAPool, IARef, pool_key


class FakeIA:
    def __init__(self, name: str, address: Optional[str]) -> None:
        self.name, self.address, self.closed = name, address, False

    def close(self) -> None:
        self.closed = True


def make_pool() -> "tuple[IAPool, List[FakeIA]]":
    opened: List[FakeIA] = []

    def opener(name: str, address: Optional[str]) -> FakeIA:
        ia = FakeIA(name, address)
        opened.append(ia)
        return ia

    return IAPool(opener), opened


def test_key_is_loop_device_address() -> None:
    loop1, loop2 = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert pool_key(loop1, "rxe0", None) == pool_key(loop1, "rxe0", None)
        assert pool_key(loop1, "rxe0", None) != pool_key(loop2, "rxe0", None)
        assert pool_key(loop1, "rxe0", None) != pool_key(loop1, "rxe0", "10.0.0.1")
        assert pool_key(loop1, "rxe0", None) != pool_key(loop1, "rxe1", None)
    finally:
        loop1.close(), loop2.close()


def test_same_loop_shares_other_loop_does_not() -> None:
    pool, opened = make_pool()
    loop1, loop2 = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        a = pool.acquire(loop1, "rxe0")
        b = pool.acquire(loop1, "rxe0")
        c = pool.acquire(loop2, "rxe0")
        d = pool.acquire(loop1, "rxe0", "fd00::1")
        assert a is b and a is not c and d is not a
        assert len(opened) == 3 and pool.open_count() == 3
        pool.release(a)
        assert not a.closed  # b still holds it
        pool.release(b)
        assert a.closed and not c.closed
        pool.addref(c)
        pool.release(c)
        assert not c.closed
        pool.release(c)
        assert c.closed
        pool.release(d)
        assert pool.open_count() == 0
    finally:
        loop1.close(), loop2.close()


def test_a_closed_loops_entries_are_dropped() -> None:
    pool, opened = make_pool()
    old, new = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        stale = pool.acquire(old, "rxe0")
        old.close()  # its streams were never closed: the IA would leak
        fresh = pool.acquire(new, "rxe0")
        assert stale.closed and not fresh.closed
        assert pool.keys() == [pool_key(new, "rxe0", None)]
        assert pool.open_count() == 1
        pool.release(stale)  # a late release of the dropped entry changes nothing
        assert pool.open_count() == 1 and not fresh.closed
    finally:
        new.close()
    assert pool.open_count() == 0 and fresh.closed


def test_iaref_takes_the_running_loops_ia_in_each_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """IARef (what open_connection/start_server use) picks the IA of the loop running in its thread."""
    pool, opened = make_pool()
    monkeypatch.setattr(pool_mod, "_POOL", pool)
    got: dict = {}
    barrier = threading.Barrier(2, timeout=30)

    async def use(i: int) -> None:
        first = IARef("rxe0", None)
        second = IARef("rxe0", None)
        barrier.wait()  # both loops hold their references at the same time
        got[i] = (first.ia, second.ia)
        barrier.wait()
        first.release()
        second.release()

    threads = [threading.Thread(target=asyncio.run, args=(use(i),)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got[1][0] is got[1][1] and got[2][0] is got[2][1]  # one IA per loop...
    assert got[1][0] is not got[2][0]  # ...and never one across loops
    assert len(opened) == 2 and all(ia.closed for ia in opened)
    assert pool.open_count() == 0


def test_iaref_needs_a_running_loop_for_a_pooled_ia() -> None:
    with pytest.raises(RuntimeError, match="no running event loop"):
        IARef("rxe0", None)


def test_iaref_refuses_other_types() -> None:
    async def bad() -> Any:
        return IARef(42, None)

    with pytest.raises(ValueError, match="ia must be None, a device name or an aiodat.IA"):
        asyncio.run(bad())


def test_an_ia_whose_close_raises_stays_in_the_pool_until_it_closes() -> None:
    """The last release closes the IA before forgetting it: a close that raises (called from
    another thread than its loop's) leaves it pooled, reused by the next stream or closed when
    its loop has ended, instead of open and forgotten."""
    pool, opened = make_pool()
    loop = asyncio.new_event_loop()
    try:
        ia = pool.acquire(loop, "rxe0")
        refuse = [True]
        real_close = ia.close

        def close() -> None:
            if refuse[0]:
                raise RuntimeError("closed from another thread")
            real_close()

        ia.close = close  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            pool.release(ia)
        assert not ia.closed and pool.open_count() == 1
        assert pool.acquire(loop, "rxe0") is ia  # reused, not opened again
        refuse[0] = False
        pool.release(ia)
        assert ia.closed and pool.open_count() == 0 and len(opened) == 1
    finally:
        loop.close()


def test_a_client_does_not_read_the_device_list_for_every_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's peer is mostly no local address: picking its device reads the cached list, not
    every device's ports and GIDs on the loop for each connect.  A server naming an address no
    device has still reads it again (the address may be new) before refusing."""
    from types import SimpleNamespace

    import aiodat.ia
    from aiodat.errors import InvalidAddress

    reads: List[int] = []

    def list_providers() -> List[Any]:
        reads.append(1)
        return [SimpleNamespace(name="rxe0", state="PORT_ACTIVE", addresses=["10.0.0.1"])]

    monkeypatch.setattr(aiodat.ia, "list_providers", list_providers)
    monkeypatch.setattr(pool_mod, "_providers_cache", (-pool_mod.PROVIDER_CACHE_SECONDS, []))
    monkeypatch.delenv("AIODAT_RXE_DEVICE", raising=False)
    for _ in range(50):
        assert pool_mod.device_for("10.0.0.9") == ("rxe0", None)
    assert len(reads) == 1
    with pytest.raises(InvalidAddress):
        pool_mod.device_for("10.0.0.9", listening=True)
    assert len(reads) == 2


def test_the_ports_first_address_is_keyed_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that is the port's first address is the IA's default address: device_for names it
    None, as for a host no device has, so a server on that address (or on None) and the clients
    connecting to it share one pooled IA instead of opening the device twice.  Another address of
    the port is still named."""
    from types import SimpleNamespace

    import aiodat.ia

    def list_providers() -> List[Any]:
        return [SimpleNamespace(name="rxe0", state="PORT_ACTIVE", addresses=["10.0.0.1", "10.0.0.2"])]

    monkeypatch.setattr(aiodat.ia, "list_providers", list_providers)
    monkeypatch.setattr(pool_mod, "_providers_cache", (-pool_mod.PROVIDER_CACHE_SECONDS, []))
    monkeypatch.delenv("AIODAT_RXE_DEVICE", raising=False)
    assert pool_mod.device_for(None, listening=True) == ("rxe0", None)
    assert pool_mod.device_for("10.0.0.1", listening=True) == ("rxe0", None)
    assert pool_mod.device_for("10.0.0.1") == ("rxe0", None)
    assert pool_mod.device_for("10.0.0.9") == ("rxe0", None)
    assert pool_mod.device_for("10.0.0.2", listening=True) == ("rxe0", "10.0.0.2")


@pytest.mark.parametrize("env", ["rxe1", "rxe1:1", "RO_AWARE_rxe1"])
def test_the_device_the_environment_names_is_preferred_however_it_is_named(
        monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    """$AIODAT_RXE_DEVICE is read as environment_port and open_ia read it: every IA name of a port
    makes it the one a client picks for a peer no device has (an exact compare of the provider's
    name missed ``rxe1:1`` and ``RO_AWARE_rxe1`` and took the first device)."""
    import aiodat.ia
    from aiodat.ia import Provider

    def list_providers() -> List[Any]:
        return [Provider(f"rxe{i}", f"rxe{i}", 1, "Ethernet", "PORT_ACTIVE", (), (f"10.0.{i}.1",)) for i in (0, 1)]

    monkeypatch.setattr(aiodat.ia, "list_providers", list_providers)
    monkeypatch.setattr(pool_mod, "_providers_cache", (-pool_mod.PROVIDER_CACHE_SECONDS, []))
    monkeypatch.setenv("AIODAT_RXE_DEVICE", env)
    assert pool_mod.device_for("10.9.9.9") == ("rxe1", None)
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "rxe0")
    assert pool_mod.device_for("10.9.9.9") == ("rxe0", None)


def test_an_environment_device_that_matches_no_port_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """$AIODAT_RXE_DEVICE naming no active port with an address is an error naming it, as the CLI,
    the benchmarks and the plugin make it: device_for passed over it silently and took another
    device (or, with none, returned the name for open_ia to fail on).  The list is read again
    first (the port may have come up since)."""
    import aiodat.ia
    from aiodat.errors import ProviderNotFound
    from aiodat.ia import Provider

    reads: List[int] = []

    def list_providers() -> List[Any]:
        reads.append(1)
        return [Provider("rxe0", "rxe0", 1, "Ethernet", "PORT_ACTIVE", (), ("10.0.0.1",)),
                Provider("rxe1", "rxe1", 1, "Ethernet", "PORT_ACTIVE", (), ())]  # (no address)

    monkeypatch.setattr(aiodat.ia, "list_providers", list_providers)
    monkeypatch.setattr(pool_mod, "_providers_cache", (-pool_mod.PROVIDER_CACHE_SECONDS, []))
    for env in ("rxe9", "rxe0:2", "rxe1"):
        monkeypatch.setenv("AIODAT_RXE_DEVICE", env)
        for listening in (False, True):
            with pytest.raises(ProviderNotFound, match=rf"no active port with an address matches "
                                                       rf"AIODAT_RXE_DEVICE={env} .* here: rxe0$"):
                pool_mod.device_for(None if listening else "10.9.9.9", listening=listening)
    assert len(reads) == 7  # the first read, and one again before each refusal
    # a host a device has is that device's, whatever the environment names
    assert pool_mod.device_for("10.0.0.1", listening=True) == ("rxe0", None)
