"""Issue 13, item 1: wake-ups that cannot lose an event or hang (evd.py, shim.c aiodat_cq_drain).

The device's own failures (a failed ibv_req_notify_cq, a failed poll) cannot be
provoked on rxe at will, so the shim has a fault switch for aiodat's tests,
``lib.aiodat_inject_fault(kind, count)``: the next ``count`` calls of that kind
fail exactly as a device failure would.  Everything else is real rxe.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator, List

import pytest

import aiodat
from aiodat import EPAttr
from aiodat._lib import lib
from aiodat.testing.plugin import make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # bound for every wait: the QEMU guest runs under TCG


@pytest.fixture(autouse=True)
def no_faults_left() -> Iterator[None]:
    """Whatever a test injected, the next one starts clean."""
    yield
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_NOTIFY, 0)
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 0)
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL_LATER_CHUNK, 0)


def send(pair: Any, payload: bytes, cookie: Any = None) -> None:
    pair.client_lmr.memoryview()[0:len(payload)] = payload
    pair.client.post_send(pair.client_lmr[0:len(payload)], cookie=cookie)


def sends_completed_blocking(pair: Any, n: int) -> None:
    """Poll the client's send completions without yielding to the loop: once a send has
    completed, the server's CQ holds its receive (RC acknowledges after delivery)."""
    done, deadline = 0, time.monotonic() + T
    while done < n:
        assert time.monotonic() < deadline, f"only {done} of {n} sends completed"
        event = pair.client.request_evd.dequeue()
        if event is None:
            time.sleep(0.005)
        else:
            assert event.ok
            done += 1


def receives_waiting(pair: Any, n: int) -> None:
    """Post ``n`` receives (cookies 0..n-1) on the server and send it ``n`` messages: once this
    returns, all ``n`` receive completions wait in the server's CQ."""
    for i in range(n):
        pair.server.post_recv(pair.server_lmr[i * 8:(i + 1) * 8], cookie=i)
    for i in range(n):
        send(pair, b"m%d" % i)
    sends_completed_blocking(pair, n)


async def watch(evd: Any) -> None:
    """Make the loop watch the EVD's channel (a short wait that times out)."""
    with pytest.raises(aiodat.TimeoutExpired):
        await evd.wait(timeout=0.01)


async def test_completions_after_a_failing_one_are_kept(ia: Any, loop_errors: List[dict],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A completion that cannot be turned into an event fails the wait; it and the ones polled with
    it in the same batch stay and come out of the next wait, in order (none lost)."""
    pair = await make_ep_pair(ia)
    recv_evd = pair.server.recv_evd
    receives_waiting(pair, 5)

    real = pair.server._completion_event
    calls = []

    def fails_once(wc: Any, evd: Any) -> Any:
        calls.append(wc)
        if len(calls) == 2:
            raise RuntimeError("injected: the second completion cannot become an event")
        return real(wc, evd)

    monkeypatch.setattr(pair.server, "_completion_event", fails_once)
    # the Python path keeps what it could not turn into events: take the C common case
    # (aiodat/_shim/completions.c, which never fails on real objects) out of the way
    # (no CQ address: C's look, the wait's and the poller's, hands every look to Python)
    monkeypatch.setattr(recv_evd, "_cq_address", 0)
    monkeypatch.setattr(aiodat.evd, "_queue_common", lambda evd, address, got, refs, queue: (0, False))
    with pytest.raises(RuntimeError, match="injected") as info:
        await recv_evd.wait(5, timeout=T)  # one poll takes all five; the second raises
    assert any("it and 3 later completion(s) are kept" in note for note in info.value.__notes__)
    events = await recv_evd.wait(5, timeout=T)
    assert [e.cookie for e in events] == [0, 1, 2, 3, 4]
    assert all(e.ok for e in events)
    pair.close()


async def test_a_poll_failing_after_its_first_chunk_keeps_what_that_chunk_took(ia: Any,
                                                                            loop_errors: List[dict]) -> None:
    """One look polls the CQ in chunks of 32; the second ibv_poll_cq fails.  The 32 completions
    the first took become events, and the rest come with the next poll, all in order.  The poll
    used to return the failure alone, so the 32 already taken off the CQ were lost (their
    receives never retired: their LMR could not be freed)."""
    many = EPAttr(max_recv_dtos=64, max_request_dtos=64)
    pair = await make_ep_pair(ia, attrs=many)
    recv_evd = pair.server.recv_evd
    receives_waiting(pair, 40)
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL_LATER_CHUNK, 1)
    cookies: List[int] = []
    deadline = time.monotonic() + T
    while len(cookies) < 40:
        assert time.monotonic() < deadline, f"only {cookies} arrived"
        cookies += [e.cookie for e in await recv_evd.wait(1, timeout=T) if e.ok]
    assert cookies == list(range(40))
    assert pair.server.query().outstanding_recvs == 0  # every receive retired
    pair.close()


async def test_a_drain_failure_with_nobody_waiting_reaches_the_next_wait(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    recv_evd = pair.server.recv_evd
    pair.server.post_recv(pair.server_lmr[0:8], cookie="r")
    await watch(recv_evd)
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 1)  # the reader callback's poll will fail
    send(pair, b"hello")
    deadline = time.monotonic() + T
    while recv_evd._pending_error is None:  # (only to know the callback ran; the checks are below)
        assert time.monotonic() < deadline, "the reader callback never ran"
        await asyncio.sleep(0.01)
    with pytest.raises(aiodat.InternalError, match="polling the CQ"):
        await recv_evd.wait(timeout=T)
    (event,) = await recv_evd.wait(timeout=T)  # reported once; the completion itself is not lost
    assert event.cookie == "r" and event.ok and event.transferred_length == 5
    assert not loop_errors
    pair.close()


async def test_a_failed_arm_is_retried_and_the_next_wakeup_comes(ia: Any, loop_errors: List[dict]) -> None:
    """ibv_req_notify_cq fails (twice: the shim retries once) in the wake-up that reads the
    channel event.  The completion polled there is delivered, and the next wait arms the CQ
    again before it sleeps, so the next message wakes it: the CQ is never left unarmed."""
    pair = await make_ep_pair(ia)
    recv_evd = pair.server.recv_evd
    pair.server.post_recv(pair.server_lmr[0:8], cookie=1)
    pair.server.post_recv(pair.server_lmr[8:16], cookie=2)
    first = asyncio.ensure_future(recv_evd.wait(timeout=T))
    await asyncio.sleep(0.05)  # asleep on an armed CQ
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_NOTIFY, 2)
    send(pair, b"one")
    assert [e.cookie for e in await first] == [1]
    second = asyncio.ensure_future(recv_evd.wait(timeout=T))
    await asyncio.sleep(0.05)  # asleep again: only a re-armed CQ can wake it
    send(pair, b"two")
    assert [e.cookie for e in await second] == [2]
    pair.close()


async def test_an_arm_that_keeps_failing_fails_the_wait_instead_of_hanging(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    recv_evd = pair.server.recv_evd
    pair.server.post_recv(pair.server_lmr[0:8], cookie=1)
    pair.server.post_recv(pair.server_lmr[8:16], cookie=2)
    waiter = asyncio.ensure_future(recv_evd.wait(2, timeout=T))  # needs two: it sleeps on after one
    await asyncio.sleep(0.05)
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_NOTIFY, 1000)
    send(pair, b"one")
    with pytest.raises(aiodat.InternalError, match="arming the CQ"):
        await asyncio.wait_for(waiter, T / 2)  # not its own timeout: it must not sleep unarmed
    with pytest.raises(aiodat.InternalError, match="arming the CQ"):
        await recv_evd.wait(2, timeout=T)  # a new wait that would sleep says so too
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_NOTIFY, 0)
    send(pair, b"two")
    events = await recv_evd.wait(2, timeout=T)  # the device recovered: nothing was lost
    assert [e.cookie for e in events] == [1, 2]
    pair.close()


async def test_a_timeout_fires_even_if_its_last_look_raises(ia: Any, loop_errors: List[dict]) -> None:
    pair = await make_ep_pair(ia)
    recv_evd = pair.server.recv_evd
    waiter = asyncio.ensure_future(recv_evd.wait(timeout=0.5))
    await asyncio.sleep(0.05)
    lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 1)  # the timer's last look will fail
    with pytest.raises(aiodat.TimeoutExpired, match="last look failed") as info:
        await asyncio.wait_for(waiter, T)
    assert isinstance(info.value.__cause__, aiodat.InternalError)
    assert not recv_evd.query().waiting
    assert not loop_errors
    pair.close()


async def test_the_cq_is_rearmed_once_per_wakeup(ia: Any, loop_errors: List[dict]) -> None:
    """130 completions drained by one wake-up (three chunks of up to 64): one read, one re-arm."""
    n = 130
    pair = await make_ep_pair(ia, buffer_size=8 * n, attrs=EPAttr(max_recv_dtos=160, max_request_dtos=160))
    recv_evd = pair.server.recv_evd
    for i in range(n):
        pair.server.post_recv(pair.server_lmr[i * 8:(i + 1) * 8], cookie=i)
    await watch(recv_evd)
    before = recv_evd._rearms
    for i in range(n):
        send(pair, b"x")
    sends_completed_blocking(pair, n)  # the loop has not run: one channel event is pending
    for _ in range(5):
        await asyncio.sleep(0)  # the reader callback runs once
    assert recv_evd.query().queued == n
    assert recv_evd._rearms - before == 1
    events = await recv_evd.wait(n, timeout=T)
    assert [e.cookie for e in events] == list(range(n))
    pair.close()


async def test_a_full_evd_does_not_strand_an_awaited_bind(ia: Any, loop_errors: List[dict]) -> None:
    """The request EVD is full (its qlen of send completions queued, none taken): the
    completion of an awaited rmr.bind() still gets through, because while one is awaited the
    CQ is polled past the EVD's capacity (the extra events are queued and reported as overflow)."""
    pair = await make_ep_pair(ia, attrs=EPAttr(max_request_dtos=4))
    request_evd = pair.client.request_evd
    assert request_evd.qlen == 4
    await watch(request_evd)
    for i in range(4):
        pair.server.post_recv(pair.server_lmr[i * 8:(i + 1) * 8])
        send(pair, b"fill", cookie=i)
    deadline = time.monotonic() + T
    while request_evd.query().queued < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    rmr = pair.pz.create_rmr()
    rkey = await asyncio.wait_for(rmr.bind(pair.client_lmr[0:64], aiodat.Privileges.REMOTE_READ, pair.client), T)
    assert rkey == rmr.query().rmr_context and rmr.query().bound
    events = await request_evd.wait(4, timeout=T)
    assert [e.cookie for e in events] == [0, 1, 2, 3]  # nothing lost, in order
    rmr.close()
    pair.close()
