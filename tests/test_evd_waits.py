"""EVD waits that race with other takers, cancellation, other threads and closed loops (real rxe).

Each test is a sequence the audit of 2026-11-28 found losing events, hanging a waiter or failing
without a clear error: the events an EVD holds go to exactly one taker, once, and a misuse is an
aiodat error naming what was wrong."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, List, Tuple

import pytest

import aiodat
from aiodat import EvdFlags
from turns import until

pytestmark = pytest.mark.rxe

T = 30.0


async def test_breaking_out_of_async_for_leaves_the_rest_queued(ia: Any, loop_errors: List[dict]) -> None:
    """``async for event in evd: break`` takes one event; the rest stay queued (the iterator used
    to take a whole batch and drop what it had not yielded)."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    for n in range(4):
        evd.post_se(n)
    async for event in evd:
        assert event.payload == 0
        break
    assert [evd.dequeue().payload for _ in range(3)] == [1, 2, 3]  # type: ignore[union-attr]
    assert evd.dequeue() is None


async def test_dequeue_while_a_task_waits_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """DAT: a dequeue while a task waits on the EVD is DAT_INVALID_STATE; the events are the
    waiter's.  It used to take one, and could leave the waiter asleep with events queued."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    task = asyncio.ensure_future(evd.wait(threshold=2, timeout=T))
    await until(lambda: evd._waiter is not None, "the wait started")
    evd.post_se("a")
    with pytest.raises(aiodat.InvalidState, match="dequeue: a task is waiting"):
        evd.dequeue()
    evd.post_se("b")
    assert [e.payload for e in await asyncio.wait_for(task, T)] == ["a", "b"]
    assert evd.dequeue() is None  # nobody waits: allowed again


def _woken_wait(evd: Any, how: str) -> "asyncio.Future[List[Any]]":
    """A wait on a software EVD (attached to this loop), in C's common path or Python's general one."""
    return asyncio.ensure_future(evd.wait(timeout=T) if how == "c" else evd.wait(timeout=T, max_events=4))


@pytest.mark.parametrize("how", ["c", "python"])
async def test_a_woken_wait_keeps_its_events_until_it_runs(ia: Any, loop_errors: List[dict], how: str) -> None:
    """Between the event that wakes a wait and its task's next step, a dequeue or a second wait is
    refused: the events are the woken wait's.  They used to be taken, and the woken wait returned
    [] (fewer events than its threshold)."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    evd.post_se("attach")
    assert [e.payload for e in await evd.wait(timeout=T)] == ["attach"]  # (the EVD takes this loop)
    task = _woken_wait(evd, how)
    await until(lambda: evd._waiter is not None, "the wait started")
    evd.post_se("mine")  # wakes the wait; its task runs at a later turn
    assert evd._waiter.done() and not task.done()
    with pytest.raises(aiodat.InvalidState, match="dequeue: a task is waiting"):
        evd.dequeue()
    with pytest.raises(aiodat.InvalidState, match="another task is already waiting"):
        await evd.wait(timeout=T)
    assert evd.query().waiting
    assert [e.payload for e in await asyncio.wait_for(task, T)] == ["mine"]
    assert not evd.query().waiting and evd.dequeue() is None


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="needs Task.cancelling (Python 3.11)")
@pytest.mark.parametrize("how", ["c", "python"])
async def test_a_woken_wait_whose_task_is_cancelled_leaves_its_events(ia: Any, loop_errors: List[dict],
                                                                      how: str) -> None:
    """A wait woken, then its task cancelled before it ran: the EVD is free at once and the events
    are still queued for the next taker; the cancelled task takes nothing."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    evd.post_se("attach")
    await evd.wait(timeout=T)
    task = _woken_wait(evd, how)
    await until(lambda: evd._waiter is not None, "the wait started")
    evd.post_se("kept")
    task.cancel()
    assert not evd.query().waiting
    assert evd.dequeue().payload == "kept"  # type: ignore[union-attr]
    with pytest.raises(asyncio.CancelledError):
        await task
    assert evd.dequeue() is None


async def test_a_cancelled_waits_deadline_is_not_the_next_waits(ia: Any, loop_errors: List[dict]) -> None:
    """A wait with a timeout, cancelled, then at once a wait without one: the second waits for its
    event.  It used to time out at the first wait's deadline."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    first = asyncio.ensure_future(evd.wait(timeout=0.3))
    await until(lambda: evd._waiter is not None, "the first wait started")
    first.cancel()
    second = asyncio.ensure_future(evd.wait())  # before the first task ran again
    await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.sleep(0.8)  # past the first wait's deadline
    assert not second.done(), second
    evd.post_se("late")
    assert [e.payload for e in await asyncio.wait_for(second, T)] == ["late"]


async def test_a_wait_left_in_a_closed_loop_does_not_hold_the_evd(ia: Any, loop_errors: List[dict]) -> None:
    """A task of another loop waited on the EVD and that loop was closed without cancelling it:
    the EVD is free for this loop's waits and post_se.  It used to say another task was waiting
    (for ever), and post_se raised "Event loop is closed" with its event queued anyway."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    stale: List[Any] = []

    def other_loop() -> None:
        loop = asyncio.new_event_loop()

        async def start() -> None:
            stale.append(asyncio.ensure_future(evd.wait(timeout=None)))
            await asyncio.sleep(0.05)

        loop.run_until_complete(start())
        loop.close()

    thread = threading.Thread(target=other_loop)
    thread.start()
    thread.join(T)
    assert stale and not stale[0].done()
    stale[0]._log_destroy_pending = False
    evd.post_se("here")
    assert [e.payload for e in await evd.wait(timeout=T)] == ["here"]


def _raised_in_thread(call: Any) -> List[BaseException]:
    """Run ``call()`` in a thread of its own; what it raised, if anything."""
    outcome: List[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(T)
    return outcome


async def test_post_se_from_another_thread_to_a_waited_evd_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """post_se from another thread while a task of this loop waits raises InvalidState saying how
    to hand it over (call_soon_threadsafe), and queues nothing; it used to queue the event without
    waking the waiter.  Handed over that way, it wakes the wait."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    task = asyncio.ensure_future(evd.wait(timeout=T))
    await until(lambda: evd._waiter is not None, "the wait started")
    outcome = _raised_in_thread(lambda: evd.post_se("wrong thread"))
    assert len(outcome) == 1 and isinstance(outcome[0], aiodat.InvalidState), outcome
    assert "call_soon_threadsafe" in str(outcome[0]) and not task.done()
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: loop.call_soon_threadsafe(evd.post_se, "handed over")).start()
    assert [e.payload for e in await asyncio.wait_for(task, T)] == ["handed over"]


async def test_a_wait_from_another_loop_leaves_the_pending_failure_to_this_one(
        ia: Any, loop_errors: List[dict], aiodat_loop: str) -> None:
    """A failure of the reader callback that no task received waits for the next wait of the EVD's
    loop.  A wait from another thread's loop is refused with InvalidState naming the loop, and
    leaves it there.  That wait used to raise the failure instead, and take it: the EVD's own
    consumer never learnt of it."""
    from aiodat._lib import lib
    from aiodat.testing.plugin import _loop_factory, make_ep_pair

    pair = await make_ep_pair(ia)
    evd = pair.server.recv_evd
    try:
        pair.server.post_recv(pair.server_lmr[0:8], cookie="r")
        with pytest.raises(aiodat.TimeoutExpired):
            await evd.wait(timeout=0.01)  # this loop watches the channel
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 1)  # the reader callback's poll fails
        try:
            pair.client.post_send(pair.client_lmr[0:8])
            await until(lambda: evd._pending_error is not None, "the reader callback failed", turns=100000)
        finally:
            lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 0)
        outcome: List[BaseException] = []

        def other_loop() -> None:
            loop = _loop_factory(aiodat_loop)()
            try:
                loop.run_until_complete(evd.wait(timeout=0.01))
            except BaseException as exc:
                outcome.append(exc)
            finally:
                loop.close()

        thread = threading.Thread(target=other_loop)
        thread.start()
        thread.join(T)
        assert len(outcome) == 1 and isinstance(outcome[0], aiodat.InvalidState), outcome
        assert "event loop" in str(outcome[0])
        with pytest.raises(aiodat.InternalError, match="polling the CQ"):
            await evd.wait(timeout=T)
        (event,) = await evd.wait(timeout=T)  # the completion itself is not lost
        assert event.cookie == "r" and event.ok
    finally:
        pair.close()


async def test_max_events_must_be_a_positive_int(ia: Any, loop_errors: List[dict]) -> None:
    """wait(max_events=0) used to return [] at once (a loop over it spins) and "x" raised TypeError;
    both are InvalidParameter, and nothing is taken."""
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    evd.post_se(1)
    for bad in (0, -1, "x", 1.5):
        with pytest.raises(aiodat.InvalidParameter, match="max_events"):
            await evd.wait(max_events=bad)  # type: ignore[arg-type]
    assert [e.payload for e in await evd.wait(max_events=1)] == [1]


async def test_a_callback_that_removes_itself_and_raises_reports_to_the_loop(ia: Any) -> None:
    """A callback that calls set_callback(None) and then raises: the exception goes to the loop's
    exception handler, as any callback's does.  It used to be kept for the next wait(), which
    then raised the callback's own error."""
    loop = asyncio.get_running_loop()
    seen: List[dict] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        evd = ia.create_evd(8, EvdFlags.SOFTWARE)

        def once(events: List[Any]) -> None:
            evd.set_callback(None)
            raise ValueError("the callback's own")

        evd.set_callback(once)
        evd.post_se(1)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert len(seen) == 1 and isinstance(seen[0]["exception"], ValueError), seen
        evd.post_se(2)
        assert [e.payload for e in await evd.wait(timeout=T)] == [2]  # no stale error
    finally:
        loop.set_exception_handler(None)


async def test_an_arm_that_fails_twice_with_nobody_waiting_reaches_the_next_wait(ia: Any,
                                                                                 loop_errors: List[dict]) -> None:
    """The poller tries a failed arm once more; when that fails too and no task waits and no
    callback is set, the error is kept for the next wait (it used to be dropped, and the CQ left
    neither armed nor polled with nobody told).  The failure is injected at the arm's record
    (``_unarmed`` and ``_arm_error``, what a failed ibv_req_notify_cq leaves), since rxe's never fails."""
    evd = ia.create_evd(8, EvdFlags.DTO)
    evd._unarmed, evd._arm_error = True, OSError(5, "injected: ibv_req_notify_cq failed")
    assert evd._napi_arm_retry() is True  # the first failure: the poller tries again
    assert evd._napi_arm_retry() is False  # the second: reported
    with pytest.raises(OSError, match="injected"):
        await evd.wait(timeout=T)
    evd._unarmed, evd._arm_error = False, None
    evd.free()


async def _pair_on(ia: Any, rx: Any) -> Any:
    """A connected pair (client, server, their LMRs) whose server receives on ``rx``."""
    from aiodat import Privileges
    from aiodat.cm import connect_pair

    pz = ia.create_pz()
    client, server = ia.create_ep(pz), ia.create_ep(pz, recv_evd=rx)
    clmr, slmr = pz.register(bytearray(4096), Privileges.ALL), pz.register(bytearray(4096), Privileges.ALL)
    await connect_pair(client, server)
    return client, server, clmr, slmr


async def test_busy_poll_us_set_later_is_checked(ia: Any, loop_errors: List[dict]) -> None:
    """evd.busy_poll_us is checked when set, as at creation: the loop's poller reads it every turn,
    and a bad value there stopped the turn for every EVD of the loop."""
    evd = ia.create_evd(8, EvdFlags.DTO)
    for bad in (50.0, -1, "10", True, 10**9):
        with pytest.raises(aiodat.InvalidParameter, match="busy_poll_us"):
            evd.busy_poll_us = bad
    evd.busy_poll_us = 20
    assert evd.busy_poll_us == 20
    cr = ia.create_evd(8, EvdFlags.CR)
    with pytest.raises(aiodat.InvalidParameter, match="no CQ to poll"):
        cr.busy_poll_us = 20
    cr.busy_poll_us = 0
    # create_evd refuses it as the setter does (it dropped the value silently)
    with pytest.raises(aiodat.InvalidParameter, match="no CQ to poll"):
        ia.create_evd(8, EvdFlags.SOFTWARE, busy_poll_us=10)
    assert ia.create_evd(8, EvdFlags.SOFTWARE, busy_poll_us=0).busy_poll_us == 0


async def test_recv_query_wakes_the_wait_whose_completion_it_took(ia: Any, loop_errors: List[dict]) -> None:
    """ep.recv_query() polls the recv EVD's CQ and reads its channel's event: the task waiting for
    that completion is woken, not left asleep until some later completion."""
    import time

    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(8, EvdFlags.DTO))
    server.post_recv(slmr[0:64], cookie="r")
    waiting = asyncio.ensure_future(server.recv_evd.wait(1, timeout=T))
    await asyncio.sleep(0.2)  # asleep, the CQ armed
    client.post_send(clmr[0:8])
    time.sleep(0.5)  # (no loop turn) the completion lands, the channel is readable
    assert server.recv_query().nbufs_allocated == 0
    events = await asyncio.wait_for(waiting, 5)
    assert [e.cookie for e in events] == ["r"]


async def test_a_queue_full_of_unsignalled_completions_wakes_its_waiter(ia: Any, loop_errors: List[dict]) -> None:
    """UNSIGNALLED receives that fill the EVD to its qlen wake the wait whose threshold they meet:
    the signalled completion that would wake it cannot leave the CQ until there is room."""
    from aiodat import CompletionFlags

    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(2, EvdFlags.DTO))
    server.post_recv(slmr[0:64], cookie="r0", flags=CompletionFlags.UNSIGNALLED)
    server.post_recv(slmr[64:128], cookie="r1", flags=CompletionFlags.UNSIGNALLED)
    server.post_recv(slmr[128:192], cookie="r2")
    waiting = asyncio.ensure_future(server.recv_evd.wait(1, timeout=T))
    await asyncio.sleep(0.2)
    for _ in range(3):
        client.post_send(clmr[0:8])
    events = await asyncio.wait_for(waiting, 5)
    assert [e.cookie for e in events] == ["r0", "r1"]
    assert [e.cookie for e in await server.recv_evd.wait(1, timeout=T)] == ["r2"]


async def test_a_resize_that_fills_the_queue_wakes_its_waiter(ia: Any, loop_errors: List[dict]) -> None:
    """UNSIGNALLED completions that meet a wait's threshold wake it once they fill the EVD, also
    when a resize down to their number fills it.  The resize used to wake nobody: the wait slept
    to its timeout (for ever without one), the signalled completion that would end it stuck in
    the CQ behind the full queue."""
    from aiodat import CompletionFlags

    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(8, EvdFlags.DTO))
    server.post_recv(slmr[0:64], cookie="r0", flags=CompletionFlags.UNSIGNALLED)
    server.post_recv(slmr[64:128], cookie="r1", flags=CompletionFlags.UNSIGNALLED)
    waiting = asyncio.ensure_future(server.recv_evd.wait(2, timeout=T))
    await asyncio.sleep(0.2)
    client.post_send(clmr[0:8])
    client.post_send(clmr[0:8])
    await until(lambda: server.recv_evd.query().queued == 2, "both completions queued", turns=100000)
    await asyncio.sleep(0.3)  # the poller's turns are over: it armed the CQ, and nothing looks at the queue
    # (unsignalled: they wake no one by themselves)
    assert not waiting.done() and server.recv_evd not in server.recv_evd._poller._hot
    server.recv_evd.resize(2)
    events = await asyncio.wait_for(waiting, 5)
    assert [e.cookie for e in events] == ["r0", "r1"]


async def test_a_resize_from_another_thread_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """evd.resize from a thread other than the one running the EVD's loop raises InvalidState saying
    how to hand it over, and changes nothing: the loop's reader callback may be draining the CQ
    meanwhile, and a resize that fills the queue completes the waiter's Future, which only its
    loop's thread may do.  Handed over with call_soon_threadsafe, the same resize wakes the wait."""
    from aiodat import CompletionFlags

    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(8, EvdFlags.DTO))
    rx = server.recv_evd
    server.post_recv(slmr[0:64], cookie="r0", flags=CompletionFlags.UNSIGNALLED)
    server.post_recv(slmr[64:128], cookie="r1", flags=CompletionFlags.UNSIGNALLED)
    waiting = asyncio.ensure_future(rx.wait(2, timeout=T))
    await until(lambda: rx._waiter is not None, "the wait started")  # (else it would find both queued)
    client.post_send(clmr[0:8])
    client.post_send(clmr[0:8])
    await until(lambda: rx.query().queued == 2, "both completions queued", turns=100000)
    outcome = _raised_in_thread(lambda: rx.resize(2))
    assert len(outcome) == 1 and isinstance(outcome[0], aiodat.InvalidState), outcome
    assert "resize: this evd is served by an event loop running in another thread" in str(outcome[0])
    assert rx.query().qlen == 8 and not waiting.done()
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: loop.call_soon_threadsafe(rx.resize, 2)).start()
    assert [e.cookie for e in await asyncio.wait_for(waiting, 5)] == ["r0", "r1"]


@pytest.mark.parametrize("first", ["queued", "taken_by_a_wait"])
async def test_a_callback_gets_what_the_cq_still_holds(ia: Any, loop_errors: List[dict], first: str) -> None:
    """Completions that came while the EVD was full stay in the CQ, for which an armed CQ raises no
    event: set_callback hands them over (after the queued ones), not at some later completion.
    ``taken_by_a_wait``: a wait took the full queue first, and set_callback on the now empty EVD
    used to schedule nothing, so the callback saw them only when a new completion came."""
    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(2, EvdFlags.DTO))
    rx = server.recv_evd
    with pytest.raises(aiodat.TimeoutExpired):
        await rx.wait(timeout=0.01)  # the loop watches its channel from here on
    for i in range(4):
        server.post_recv(slmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    for _ in range(4):
        client.post_send(clmr[0:8])
    await asyncio.sleep(1.0)  # two are queued, two wait in the CQ, which the poller armed
    expected = ["r0", "r1", "r2", "r3"]
    if first == "taken_by_a_wait":
        assert [e.cookie for e in await rx.wait(2, timeout=T)] == expected[:2]
        expected = expected[2:]
    got: List[Any] = []
    rx.set_callback(got.extend)
    for _ in range(50):
        if len(got) == len(expected):
            break
        await asyncio.sleep(0.1)
    assert [e.cookie for e in got] == expected
    rx.set_callback(None)


async def _one_wake_up_of_four_receives(ia: Any, evd: Any) -> Tuple[Any, Any, Any]:
    """An EP pair whose server receives on ``evd``, four receives (r0-r3) posted there, and one wait
    woken by the first message (r0); returns (client EP, the server's recv EVD, client LMR)."""
    client, server, clmr, slmr = await _pair_on(ia, evd)
    rx = server.recv_evd
    for i in range(4):
        server.post_recv(slmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    first = asyncio.ensure_future(rx.wait(1, timeout=T))
    await asyncio.sleep(0.2)
    client.post_send(clmr[0:8], "a")
    # (awaited as is, its own timeout bounding it: wait_for's turns would use up the poller's)
    assert [e.cookie for e in await first] == ["r0"]
    return client, rx, clmr


async def test_a_solicited_wait_right_after_a_wake_up_ends_at_the_solicited_completion(
        ia: Any, loop_errors: List[dict]) -> None:
    """A solicited wait that starts while the CQ is still unarmed after a wake-up (the poller's
    turns) arms it solicited-only, so the solicited completion ends the wait below its threshold.
    Its arm used to be taken for a broad one, and the wait slept to its timeout."""
    from aiodat import CompletionFlags

    client, rx, clmr = await _one_wake_up_of_four_receives(ia, ia.create_evd(8, EvdFlags.DTO))
    assert rx._unarmed  # (the wake-up left the CQ to the poller)
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, client.post_send, clmr[0:8], "b", CompletionFlags.SOLICITED_WAIT)
    began = loop.time()
    # (awaited here, not as a task: the wait starts in this turn, while the CQ is still unarmed)
    events = await rx.wait(3, timeout=T, solicited_only=True)
    assert [e.cookie for e in events] == ["r1"] and loop.time() - began < T / 2


@pytest.mark.parametrize("busy_poll_us", [0, 500_000])
async def test_a_solicited_completion_the_poller_took_first_still_ends_the_solicited_wait(
        ia: Any, loop_errors: List[dict], busy_poll_us: int) -> None:
    """A solicited wait whose CQ the loop's poller still polls (its idle turns after a wake-up, or
    busy polling) ends at the solicited completion, though the poller took it from the CQ before
    the reader callback read its channel event.  That channel event used to wake nobody (the
    drain behind it found nothing new), and the wait slept to its timeout."""
    from aiodat import CompletionFlags

    client, rx, clmr = await _one_wake_up_of_four_receives(
        ia, ia.create_evd(8, EvdFlags.DTO, busy_poll_us=busy_poll_us))
    assert rx in rx._poller._hot  # (the wake-up left the CQ to the poller)
    loop = asyncio.get_running_loop()
    # (the poller's next turn polls the completion, before the channel's reader callback runs; a
    # busy-polling one, from its spinning a little later)
    send = (client.post_send, clmr[0:8], "b", CompletionFlags.SOLICITED_WAIT)
    loop.call_later(0.05, *send) if busy_poll_us else loop.call_soon(*send)
    began = loop.time()
    events = await rx.wait(3, timeout=T, solicited_only=True)
    assert [e.cookie for e in events] == ["r1"] and loop.time() - began < T / 2


async def _solicited_armed(client: Any, rx: Any, clmr: Any, how: str) -> None:
    """Leave ``rx``'s CQ armed for solicited completions only, by a solicited wait that ends through
    the reader callback (``how == "woken"``) or times out (``"timed_out"``); r0 and r1 are taken."""
    from aiodat import CompletionFlags

    if how == "woken":
        waiter = asyncio.ensure_future(rx.wait(4, timeout=T, solicited_only=True))
        await asyncio.sleep(0.05)
        client.post_send(clmr[0:8], "a")  # its channel event (the arm was broad) narrows the arm
        await asyncio.sleep(1.0)
        assert not waiter.done()
        client.post_send(clmr[0:8], "b", CompletionFlags.SOLICITED_WAIT)
        assert [e.cookie for e in await asyncio.wait_for(waiter, T)] == ["r0", "r1"]
    else:
        client.post_send(clmr[0:8], "a")
        client.post_send(clmr[0:8], "b")
        assert [e.cookie for e in await rx.wait(2, timeout=T)] == ["r0", "r1"]
        # (in this turn, while the wake-up's CQ is unarmed: the solicited wait arms it narrow)
        with pytest.raises(aiodat.TimeoutExpired):
            await rx.wait(1, timeout=0.3, solicited_only=True)
    assert rx._armed_solicited and not rx._unarmed, "the test needs the CQ armed for solicited completions only"


async def test_a_solicited_completion_found_at_the_deadline_ends_the_wait(ia: Any, loop_errors: List[dict]) -> None:
    """A solicited wait's timer that runs while the solicited message's channel event is pending
    (it landed after the loop's poll and before its timers) makes a last look, which reads that
    event: a solicited hit.  The wait still timed out, with the completion queued.  Now it returns
    it.  The timer is run by hand here, at the one moment it can be (no loop orders it so on
    demand): the message landed, the loop not yet back."""
    import time

    from aiodat import CompletionFlags

    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(8, EvdFlags.DTO))
    rx = server.recv_evd
    for i in range(4):
        server.post_recv(slmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    await _solicited_armed(client, rx, clmr, "timed_out")  # (r0 and r1 taken)
    waiter = asyncio.ensure_future(rx.wait(2, timeout=T, solicited_only=True))
    await asyncio.sleep(0.1)
    assert not waiter.done() and rx._armed_solicited
    client.post_send(clmr[0:8], "c", CompletionFlags.SOLICITED_WAIT)
    time.sleep(1.0)  # (the loop blocked on purpose: the message lands, its channel event unread)
    rx._expire(rx._waiter, T)  # what the wait's timer runs at its deadline
    assert [e.cookie for e in await waiter] == ["r2"]


@pytest.mark.parametrize("how", ["woken", "timed_out"])
async def test_a_callback_set_after_a_solicited_wait_gets_plain_completions(
        ia: Any, loop_errors: List[dict], how: str) -> None:
    """A solicited wait that ends through the reader callback or times out leaves the CQ armed for
    solicited completions only; waits widen the arm again, but set_callback did not, and plain
    receives never reached the callback (they raise no channel event on such a CQ)."""
    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(8, EvdFlags.DTO))
    rx = server.recv_evd
    for i in range(4):
        server.post_recv(slmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    await _solicited_armed(client, rx, clmr, how)
    got: List[Any] = []
    rx.set_callback(got.extend)
    await asyncio.sleep(0.5)  # the poller's turns: it arms the CQ, and c must raise a channel event
    client.post_send(clmr[0:8], "c")
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.1)
    assert [e.cookie for e in got] == ["r2"]
    rx.set_callback(None)


async def test_rearm_fully_widens_a_solicited_arm_for_a_consumer_that_is_no_wait(
        ia: Any, loop_errors: List[dict]) -> None:
    """EVD._rearm_fully (what an awaited rmr.bind and a graceful disconnect's drain marker call:
    they rely on the channel, as a callback does) arms a CQ left armed for solicited completions
    only for every completion, so a plain completion wakes the loop again; with a broad arm it
    does nothing."""
    client, server, clmr, slmr = await _pair_on(ia, ia.create_evd(8, EvdFlags.DTO))
    rx = server.recv_evd
    rx._rearm_fully()
    assert not rx._unarmed  # a broad arm already: left alone
    for i in range(4):
        server.post_recv(slmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    await _solicited_armed(client, rx, clmr, "woken")
    rx._rearm_fully()
    await until(lambda: not rx._unarmed, "the poller armed the CQ")
    assert not rx._armed_solicited
    client.post_send(clmr[0:8], "c")
    for _ in range(100):  # nobody waits: only the channel's reader can queue it
        if rx._queued():
            break
        await asyncio.sleep(0.1)
    assert [e.cookie for e in rx._queued()] == ["r2"]
