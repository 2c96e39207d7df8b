"""Misuse of the resource layers (srq.py, datagram.py, memory.py) on real rxe: numbers of the wrong
kind or size, batches of the wrong shape, bad timeouts, calls from another thread's loop, waits
their SRQ can no longer wake, and objects the program drops.  Each misuse is an aiodat error naming
what was wrong, raised before anything is posted or sent: nothing is lost or left behind."""
from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any, Callable, List, Tuple

import pytest

import aiodat
from aiodat import EPAttr, EvdFlags, Privileges, ServiceType
from aiodat.testing.plugin import make_ep_pair

T = 30.0  # generous bound for every wait: the QEMU guest runs under TCG
HUGE = 10**5000  # an int too long for repr(): a message built with it would raise ValueError
HUGE_WORDS = "an int of 16610 bits"
#: timeouts no loop timer takes: NaN, ints no float holds, negative, not a number
BAD_TIMEOUTS = (float("nan"), 10**400, 10**5000, -10**400, -1, "10", b"1")
UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2, max_request_iov=2)
WINDOWED = Privileges.LOCAL_WRITE | Privileges.MW_BIND


def _routes(ia: Any) -> int:
    return len(ia._cm._routes)


def _kinds(parent: Any, kind: type) -> int:
    return sum(isinstance(child, kind) for child in list(parent._children))


async def _in_another_loop(calls: List[Tuple[str, Callable[[], Any]]]) -> List[Tuple[str, Any]]:
    """Run each call (awaiting what it returns) in a loop of another thread; (name, exception or None)."""
    outcomes: List[Tuple[str, Any]] = []

    async def misuse() -> None:
        for name, call in calls:
            try:
                result = call()
                if asyncio.iscoroutine(result):
                    await asyncio.wait_for(result, 5)
                outcomes.append((name, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                outcomes.append((name, exc))

    thread = threading.Thread(target=lambda: asyncio.run(misuse()))
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 4 * T)
    return outcomes


async def _connected_srq(ia: Any, buffers: int) -> Tuple[Any, Any, Any, Any]:
    """An SRQ holding ``buffers`` receives, one EP receiving from it connected to a client."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    pool = pz.register(bytearray(16 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], i) for i in range(buffers))
    server, client = ia.create_ep(pz, srq=srq), ia.create_ep(pz)
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    connecting = asyncio.ensure_future(client.connect(ia.address, psp.port, timeout=T))
    await (await cr_evd.wait_one(timeout=T)).cr.accept(server, timeout=T)
    await asyncio.wait_for(connecting, T)
    return srq, server, client, pz.register(bytearray(64))


# ---------------------------------------------------------------- SRQ


@pytest.mark.rxe
async def test_srq_sizes_no_repr_can_show_are_invalid_parameter(ia: Any, loop_errors: List[dict]) -> None:
    """create_srq, resize and set_lw with an int too long for repr() raise InvalidParameter naming the
    argument and its size (they raised ValueError from building the message); the SRQ is unchanged."""
    pz = ia.create_pz()
    for kwargs, words in (({"max_recv_dtos": HUGE}, "max_recv_dtos"), ({"max_recv_iov": HUGE}, "max_recv_iov"),
                          ({"low_watermark": HUGE}, "low_watermark")):
        with pytest.raises(aiodat.InvalidParameter, match=f"{words} must be .* got {HUGE_WORDS}"):
            ia.create_srq(pz, **{"max_recv_dtos": 8, **kwargs})
    srq = ia.create_srq(pz, 8)
    with pytest.raises(aiodat.InvalidParameter, match=f"max_recv_dtos must be .* got {HUGE_WORDS}"):
        srq.resize(HUGE)
    with pytest.raises(aiodat.InvalidParameter, match=f"low_watermark must be .* got {HUGE_WORDS}"):
        srq.set_lw(HUGE)
    param = srq.query()
    assert param.low_watermark is None and param.max_recv_dtos >= 8
    assert [type(c).__name__ for c in pz._children] == ["SRQ"]


@pytest.mark.rxe
async def test_srq_post_recv_batch_of_the_wrong_shape_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """srq.post_recv_batch with items that are not (segments, cookie) pairs raises InvalidParameter
    naming the call, as ep.post_recv_batch does (it raised TypeError or ValueError from unpacking),
    and posts nothing."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    lmr = pz.register(bytearray(256))
    for items in (5, [1], [(lmr[0:8], "a", "b")], [lmr[0:8]], [(lmr[0:8], "a"), None]):
        with pytest.raises(aiodat.InvalidParameter, match="post_recv_batch"):
            srq.post_recv_batch(items)  # type: ignore[arg-type]
        assert not srq._posted and lmr._inflight == 0, items
    assert srq.post_recv_batch(iter([(lmr[0:8], "a"), (lmr[8:16], "b")])) == 2
    assert srq.query().outstanding_dto_count == 2


@pytest.mark.rxe
async def test_a_bad_low_watermark_timeout_is_refused_and_loses_no_event(ia: Any, loop_errors: List[dict]) -> None:
    """srq.low_watermark with a NaN, huge, negative or non-number timeout raises InvalidParameter
    naming the timeout and leaves no waiter behind.  A huge one used to raise OverflowError from the
    loop's timer after its future had joined the waiters: the next low-watermark event then went to
    that orphan, and the call that should have had it waited in vain."""
    srq, server, client, send_lmr = await _connected_srq(ia, 4)
    srq.set_lw(3)
    for bad in BAD_TIMEOUTS:
        with pytest.raises(aiodat.InvalidParameter, match="timeout must be"):
            await asyncio.wait_for(srq.low_watermark(timeout=bad), 5)
        assert not srq._waiters, bad
    for i in range(2):  # 4 -> 2 buffers left: below 3, the event fires with nobody waiting
        client.post_send(send_lmr[0:8], cookie=i)
        assert (await client.request_evd.wait_one(timeout=T)).ok
        assert (await server.recv_evd.wait_one(timeout=T)).ok
    await asyncio.wait_for(srq.low_watermark(timeout=10), T)  # kept for this call
    assert srq.low_watermark_events == 1


@pytest.mark.rxe
async def test_disarming_the_low_watermark_wakes_its_waiter(ia: Any, loop_errors: List[dict]) -> None:
    """set_lw(None) while a task waits in low_watermark(): nothing could wake that wait any more, so
    it raises InvalidState saying so (it used to wait for ever), as a call made unarmed does."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    srq.set_lw(2)
    waiter = asyncio.ensure_future(srq.low_watermark())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    srq.set_lw(None)
    with pytest.raises(aiodat.InvalidState, match="disarmed"):
        await asyncio.wait_for(waiter, 5)
    assert not srq._waiters
    srq.set_lw(2)  # arming again afterwards works, and a new wait waits
    again = asyncio.ensure_future(srq.low_watermark())
    await asyncio.sleep(0.05)
    assert not again.done()
    srq.free()
    with pytest.raises(aiodat.InvalidHandle, match="freed"):
        await asyncio.wait_for(again, 5)
