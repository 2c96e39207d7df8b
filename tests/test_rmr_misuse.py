"""Misuse of memory windows (RMRs) and registrations, on real rxe: unbinds the window's state does
not allow, binds that fail on the device, windows rebound through another EP, privileges the LMR
cannot give a window, LMRs closed under a window, register_async with a bad executor, failed
registrations that kept the buffer exported, and RemoteRegion.from_bytes of odd buffers.  Each
misuse is an aiodat error naming what was wrong, raised before anything is posted; nothing is
left behind (no window, pin or buffer export)."""
from __future__ import annotations

import array
import asyncio
import concurrent.futures
from typing import Any, List, Tuple

import pytest

import aiodat
from aiodat import EPState, EventType, Privileges
from aiodat._lib import ffi
from aiodat.cm import connect_pair
from aiodat.testing.plugin import make_ep_pair

T = 30.0  # generous bound for every wait: the QEMU guest runs under TCG
WINDOWED = Privileges.LOCAL_WRITE | Privileges.MW_BIND


async def _pair_in(ia: Any, pz: Any) -> Tuple[Any, Any, Any]:
    """Another connected RC pair inside ``pz``: (client, server, psp)."""
    client, server = ia.create_ep(pz), ia.create_ep(pz)
    psp = await connect_pair(client, server, timeout=T)
    return client, server, psp


async def _write_through(client: Any, lmr: Any, remote: Any, data: bytes) -> str:
    """RDMA-write ``data`` from ``lmr`` through ``remote``; the completion status."""
    lmr.memoryview()[0:len(data)] = data
    client.post_rdma_write(lmr[0:len(data)], remote[0:len(data)], "probe")
    event = await client.request_evd.wait_one(timeout=T)
    return str(event.status)


# ---------------------------------------------------------------- unbind (defect 1)


@pytest.mark.rxe
async def test_an_unbind_while_a_bind_or_unbind_is_pending_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """An unbind while the window's bind is pending would invalidate the old key (rxe refuses it and
    the QP goes to ERR); a second unbind while one is pending would invalidate a window already
    free (a NULL dereference in rxe_do_invalidate_mw).  Both are InvalidState naming what is
    pending, and nothing is posted; they used to be accepted."""
    p = await make_ep_pair(ia)
    exposed = p.pz.register(bytearray(4096), WINDOWED)
    rmr = p.pz.create_rmr()
    rmr.bind_nowait(exposed[0:512], Privileges.REMOTE_WRITE, p.server, cookie="b")
    outstanding = p.server.query().outstanding_requests
    with pytest.raises(aiodat.InvalidState, match="a bind of the window is pending"):
        rmr.unbind_nowait(p.server)
    with pytest.raises(aiodat.InvalidState, match="a bind of the window is pending"):
        await rmr.unbind(p.server)
    assert p.server.query().outstanding_requests == outstanding == 1
    event = await p.server.request_evd.wait_one(timeout=T)
    assert (event.type, event.cookie, event.ok) == (EventType.RMR_BIND_COMPLETION, "b", True)

    rmr.unbind_nowait(p.server, cookie="u")
    with pytest.raises(aiodat.InvalidState, match="an unbind of the window is pending"):
        rmr.unbind_nowait(p.server)
    with pytest.raises(aiodat.InvalidState, match="an unbind of the window is pending"):
        await rmr.unbind(p.server)
    with pytest.raises(aiodat.InvalidState, match="unbind"):  # (a bind too: it is still bound)
        rmr.bind_nowait(exposed[0:512], Privileges.REMOTE_WRITE, p.server)
    event = await p.server.request_evd.wait_one(timeout=T)
    assert (event.type, event.cookie, event.ok) == (EventType.RMR_BIND_COMPLETION, "u", True)
    assert not rmr.bound and p.server.request_evd.dequeue() is None
    assert p.server.state is EPState.CONNECTED and p.server.connect_evd.dequeue() is None
    # the connection and the window still work
    await rmr.bind(exposed[512:1024], Privileges.REMOTE_WRITE, p.server)
    assert await _write_through(p.client, p.client_lmr, rmr.remote(), b"ok") == "IBV_WC_SUCCESS"
    assert bytes(exposed.memoryview()[512:514]) == b"ok"


@pytest.mark.rxe
async def test_an_unbind_through_another_ep_than_the_binding_one_is_refused(ia: Any,
                                                                            loop_errors: List[dict]) -> None:
    """A type-2B window belongs to the QP that bound it: an invalidation posted on another QP is
    refused by the device (and breaks that connection).  It is InvalidParameter naming the EP the
    window is bound through, before anything is posted; it used to be posted."""
    p = await make_ep_pair(ia)
    exposed = p.pz.register(bytearray(4096), WINDOWED)
    rmr = p.pz.create_rmr()
    await rmr.bind(exposed[0:512], Privileges.REMOTE_WRITE, p.server)
    with pytest.raises(aiodat.InvalidParameter, match="bound through .*, not through"):
        rmr.unbind_nowait(p.client)
    with pytest.raises(aiodat.InvalidParameter, match="bound through .*, not through"):
        await rmr.unbind(p.client)
    with pytest.raises(aiodat.InvalidParameter, match="bound through"):
        await rmr.unbind("not an EP")
    assert p.client.query().outstanding_requests == 0 and p.client.state is EPState.CONNECTED
    assert rmr.bound
    await rmr.unbind(p.server)
    assert not rmr.bound and p.server.state is EPState.CONNECTED


# ---------------------------------------------------------------- failed binds (defect 2)


@pytest.mark.rxe
async def test_a_bind_failing_on_the_device_breaks_the_connection(ia: Any, loop_errors: List[dict],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bind that completes in error leaves the RC QP in ERR, like any failed request: the EP must
    leave CONNECTED and its connect EVD get CONNECTION_EVENT_BROKEN.  It used to stay CONNECTED
    with no event.  (The failure is real: the LMR's Python record is made to claim MW_BIND, which
    the registration lacks, so rxe refuses the bind.)"""
    p = await make_ep_pair(ia)
    plain = p.pz.register(bytearray(4096), Privileges.LOCAL_WRITE)
    monkeypatch.setattr(plain, "privileges", Privileges.LOCAL_WRITE | Privileges.MW_BIND)
    rmr = p.pz.create_rmr()
    with pytest.raises(aiodat.DTOError):
        await rmr.bind(plain[0:64], Privileges.REMOTE_READ, p.server, cookie="bad")
    assert not rmr.bound and plain._inflight == 0
    assert p.server.state is EPState.ERROR
    event = await p.server.connect_evd.wait_one(timeout=T)
    assert event.type is EventType.CONNECTION_EVENT_BROKEN
    assert "bad" in str(getattr(event, "reason", ""))


# ---------------------------------------------------------------- rebinding elsewhere (defect 3)


@pytest.mark.rxe
async def test_freeing_an_ep_a_window_was_once_bound_through_leaves_it_alone(ia: Any,
                                                                            loop_errors: List[dict]) -> None:
    """Bound through A, unbound, bound through B: freeing A must leave the window bound through B
    (it used to be torn down), and for a freed RMR it must not allocate a new window (it used to,
    and the window leaked)."""
    p = await make_ep_pair(ia)
    exposed = p.pz.register(bytearray(4096), WINDOWED)
    client_b, server_b, psp = await _pair_in(ia, p.pz)
    rmr, gone = p.pz.create_rmr(), p.pz.create_rmr()
    await rmr.bind(exposed[0:512], Privileges.REMOTE_WRITE, p.server)
    await rmr.unbind(p.server)
    await rmr.bind(exposed[512:1024], Privileges.REMOTE_WRITE, server_b)
    # a freed RMR, too, was once bound through p.server
    await gone.bind(exposed[0:64], Privileges.REMOTE_READ, p.server)
    await gone.unbind(p.server)
    await gone.bind(exposed[64:128], Privileges.REMOTE_READ, client_b)
    gone.free()
    p.server.free()
    assert rmr.bound and not rmr.closed and rmr in server_b._windows
    assert gone.closed and gone._mw == ffi.NULL  # no new window allocated for a freed RMR
    assert await _write_through(client_b, p.client_lmr, rmr.remote(), b"via B") == "IBV_WC_SUCCESS"
    assert bytes(exposed.memoryview()[512:517]) == b"via B"
    # freeing the EP the window is bound through still gives it a fresh, unbound window
    server_b.free()
    assert not rmr.bound and not rmr.closed and rmr._mw != ffi.NULL
    rmr.free()
    exposed.free()
    psp.free()


# ---------------------------------------------------------------- privileges (defect 4)


@pytest.mark.rxe
async def test_a_writable_window_on_an_lmr_without_local_write_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """A window with REMOTE_WRITE or REMOTE_ATOMIC needs an LMR with local write (verbs): it is
    PrivilegesViolation before the bind is posted.  It used to be posted, fail on the device and
    break the connection."""
    p = await make_ep_pair(ia)
    readable = p.pz.register(bytearray(4096), Privileges.REMOTE_READ | Privileges.MW_BIND)
    rmr = p.pz.create_rmr()
    for privileges in (Privileges.REMOTE_WRITE, Privileges.REMOTE_ATOMIC,
                       Privileges.REMOTE_READ | Privileges.REMOTE_WRITE):
        with pytest.raises(aiodat.PrivilegesViolation, match="LOCAL_WRITE"):
            await rmr.bind(readable[0:64], privileges, p.server)
        with pytest.raises(aiodat.PrivilegesViolation, match="LOCAL_WRITE"):
            rmr.bind_nowait(readable[0:64], privileges, p.server)
    assert not rmr.bound and readable._inflight == 0 and p.server.query().outstanding_requests == 0
    await rmr.bind(readable[0:64], Privileges.REMOTE_READ, p.server)  # read-only is fine
    assert rmr.bound and p.server.state is EPState.CONNECTED


# ---------------------------------------------------------------- LMRs under windows (defect 5)


@pytest.mark.rxe
async def test_an_lmr_under_a_window_refuses_free_and_close_takes_the_window(ia: Any,
                                                                            loop_errors: List[dict]) -> None:
    """lmr.free() while a window is bound to it is InvalidState naming the window; lmr.close()
    closes the windows bound to it first (as an EVD's close closes its EPs), then deregisters
    cleanly.  close() used to fail with the device's EINVAL after marking the LMR closed."""
    from aiodat import _handle

    p = await make_ep_pair(ia)
    exposed = p.pz.register(bytearray(4096), WINDOWED)
    other = p.pz.register(bytearray(4096), WINDOWED)
    rmr, elsewhere = p.pz.create_rmr(), p.pz.create_rmr()
    await rmr.bind(exposed[0:512], Privileges.REMOTE_WRITE, p.server)
    await elsewhere.bind(other[0:512], Privileges.REMOTE_WRITE, p.server)
    deferred = len(_handle._deferred)
    exposed.close()  # (it used to raise EINVAL from ibv_dereg_mr, and leave the MR behind)
    assert exposed.closed and rmr.closed and len(_handle._deferred) == deferred
    with pytest.raises(aiodat.InvalidState, match=r"memory window\(s\) .*RMR rkey=.* bound"):
        other.free()
    assert not other.closed and elsewhere.bound
    assert p.server.state is EPState.CONNECTED
    # the other window, on another LMR, is untouched
    assert elsewhere.bound and not other.closed
    assert await _write_through(p.client, p.client_lmr, elsewhere.remote(), b"still") == "IBV_WC_SUCCESS"
    await elsewhere.unbind(p.server)
    other.free()  # no window any more: free is allowed


@pytest.mark.rxe
async def test_freeing_a_window_with_a_bind_pending_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """rmr.free() while a bind_nowait of the window is pending is InvalidState: the bind's
    RMR_BIND_COMPLETION still reaches the request EVD, and the window can be freed after it.  The
    free used to forget the pending bind, so its event was silently lost."""
    p = await make_ep_pair(ia)
    exposed = p.pz.register(bytearray(4096), WINDOWED)
    rmr = p.pz.create_rmr()
    rmr.bind_nowait(exposed[0:512], Privileges.REMOTE_READ, p.server, cookie="b")
    with pytest.raises(aiodat.InvalidState, match="a bind of the window is pending: .* before freeing it"):
        rmr.free()
    assert not rmr.closed
    event = await p.server.request_evd.wait_one(timeout=T)
    assert (event.type, event.cookie, event.ok) == (EventType.RMR_BIND_COMPLETION, "b", True)
    rmr.free()  # bound, nothing pending: its destruction invalidates it
    exposed.free()  # (the window's pin went with it)
    assert p.server.state is EPState.CONNECTED


@pytest.mark.rxe
async def test_an_rmr_dropped_with_its_ep_gives_back_its_lmr(ia: Any, loop_errors: List[dict]) -> None:
    """A window bound through an EP, both dropped unclosed: the window goes with its Raw holder,
    and so does its pin on the LMR, which the program kept and can free.  The pin used to stay,
    so lmr.free() was refused for ever for a window nobody had."""
    import gc
    import warnings

    pz = ia.create_pz()
    exposed = pz.register(bytearray(4096), WINDOWED)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        client, server, psp = await _pair_in(ia, pz)
        rmr = pz.create_rmr()
        await rmr.bind(exposed[0:512], Privileges.REMOTE_WRITE, server)
        with pytest.raises(aiodat.InvalidState, match="memory window"):
            exposed.free()
        psp.free()
        client.free()
        del server, rmr
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
    exposed.free()
    pz.free()


# ---------------------------------------------------------------- registrations (defects 6, 7)


@pytest.mark.rxe
async def test_register_async_with_a_bad_executor_leaves_no_pin(ia: Any, loop_errors: List[dict]) -> None:
    """register_async with something that is not an Executor is InvalidParameter naming it (it was
    a raw AttributeError), and an executor that refuses the work (shut down) is InvalidState; neither
    leaves a pin in the PZ (the pin used to stay)."""
    pz = ia.create_pz()
    with pytest.raises(aiodat.InvalidParameter, match="executor must be a concurrent.futures.Executor"):
        await pz.register_async(bytearray(64), executor="x")
    assert not pz._pins
    stopped = concurrent.futures.ThreadPoolExecutor(1)
    stopped.shutdown()
    with pytest.raises(aiodat.InvalidState, match="executor"):
        await pz.register_async(bytearray(64), executor=stopped)
    assert not pz._pins and not list(pz._children)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lmr = await pz.register_async(bytearray(64), executor=pool)
    assert lmr.length == 64 and not pz._pins
    pz.close()


@pytest.mark.rxe
async def test_a_failed_registration_keeps_no_export_of_the_buffer(ia: Any, loop_errors: List[dict]) -> None:
    """While the exception of a failed registration lives (its traceback holds the frames), the
    buffer must be resizable: the registration releases its view of it on failure.  It used to
    stay exported (BufferError on resize)."""
    pz = ia.create_pz()
    empty = bytearray()
    with pytest.raises(aiodat.LengthError, match="empty") as failed:
        pz.register(empty)
    empty.extend(b"grow")  # BufferError if the failed registration still exports it
    assert failed.value.__traceback__ is not None
    empty_async = bytearray()
    with pytest.raises(aiodat.LengthError, match="empty") as failed_async:
        await pz.register_async(empty_async)
    empty_async.extend(b"grow")
    real = ia._device_attr.max_mr_size
    ia._device_attr.max_mr_size = 64
    try:
        big = bytearray(65)
        with pytest.raises(aiodat.LengthError, match="max_lmr_block_size 64") as too_big:
            pz.register(big)
        big.extend(b"x")
    finally:
        ia._device_attr.max_mr_size = real
    assert failed_async.value and too_big.value
    assert not list(pz._children) and not pz._pins
    pz.free()


# ---------------------------------------------------------------- from_bytes (defect 8; no device)


def test_remote_region_from_bytes_counts_bytes_and_refuses_a_released_view() -> None:
    """from_bytes counts bytes, not items, of a buffer of wider items; a released memoryview (or a
    non-contiguous one) is InvalidParameter, not a raw ValueError."""
    region = aiodat.RemoteRegion(0x1122334455667788, 4096, 0xABCDEF01)
    wide = array.array("I")
    wide.frombytes(region.to_bytes())  # 5 items of 4 bytes
    assert len(wide) == 5
    assert aiodat.RemoteRegion.from_bytes(memoryview(wide)) == region
    assert aiodat.RemoteRegion.from_bytes(memoryview(region.to_bytes() + b"tail")) == region
    released = memoryview(region.to_bytes())
    released.release()
    with pytest.raises(aiodat.InvalidParameter, match="released"):
        aiodat.RemoteRegion.from_bytes(released)
    with pytest.raises(aiodat.InvalidParameter, match="contiguous"):
        aiodat.RemoteRegion.from_bytes(memoryview(region.to_bytes() * 2)[::2])
    with pytest.raises(aiodat.InvalidParameter, match="needs 20 bytes, got 16"):
        aiodat.RemoteRegion.from_bytes(memoryview(array.array("I", [1, 2, 3, 4])))
