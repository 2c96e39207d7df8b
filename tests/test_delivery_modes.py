"""Issue 15, items 3 and 4: callback delivery (``evd.set_callback``) and busy polling
(``ia.create_evd(..., busy_poll_us=N)``), on real rxe.

Speed itself is measured by ``aiodat bench latency --mode callback|busypoll``
(docs/performance.md); these tests prove what each mode promises.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, List, Optional, Tuple

import pytest

import aiodat
from aiodat import EvdFlags
from aiodat._lib import lib
from aiodat.cm import connect_pair
from aiodat.testing.plugin import make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # bound for every wait: the QEMU guest runs under TCG


class Pair:
    """Two connected EPs whose DTO EVDs are made by the test (busy polling, or shared)."""

    def __init__(self, ia: Any, busy_poll_us: int = 0, size: int = 4096) -> None:
        self.ia = ia
        self.pz = ia.create_pz()
        self.evds: List[Any] = []
        self.lmrs = [self.pz.register(bytearray(size)) for _ in range(2)]
        self.eps: List[Any] = []
        for _ in range(2):
            recv = self._evd(busy_poll_us)
            request = self._evd(busy_poll_us)
            self.eps.append(ia.create_ep(self.pz, recv_evd=recv, request_evd=request))
        self.psp: Any = None

    def _evd(self, busy_poll_us: int) -> Any:
        evd = self.ia.create_evd(64, EvdFlags.DTO, busy_poll_us=busy_poll_us)
        self.evds.append(evd)
        return evd

    async def connect(self) -> "Pair":
        self.psp = await connect_pair(self.eps[0], self.eps[1])
        return self

    def close(self) -> None:
        for handle in [self.psp, *self.eps, self.pz, *self.evds]:
            if handle is not None and not handle.closed:
                handle.close()


def put(lmr: Any, payload: bytes) -> Any:
    lmr.memoryview()[0:len(payload)] = payload
    return lmr[0:len(payload)]


# -- callbacks ---------------------------------------------------------------------------------
async def test_a_callback_ping_pong_runs_inside_the_reader_callback(ia: Any, loop_errors: List[dict]) -> None:
    """Both sides answer from their callbacks: every message arrives, in order, and the callback
    runs with no task (the loop's reader callback called it, no Future, no task switch)."""
    pair = await make_ep_pair(ia)
    try:
        client, server = pair.client, pair.server
        loop = asyncio.get_running_loop()
        done: "asyncio.Future[None]" = loop.create_future()
        rounds, seen, tasks = 50, [], []
        client.post_recv(pair.client_lmr[2048:2056])
        server.post_recv(pair.server_lmr[2048:2056])

        def on_server(events: List[Any]) -> None:
            tasks.append(asyncio.current_task())
            for ev in events:
                if ev.operation is aiodat.DTOOp.RECV:
                    assert ev.ok, ev
                    data = bytes(pair.server_lmr.memoryview()[2048:2048 + ev.transferred_length])
                    server.post_recv(pair.server_lmr[2048:2056])
                    server.post_send(put(pair.server_lmr, data.upper()))

        def on_client(events: List[Any]) -> None:
            tasks.append(asyncio.current_task())
            for ev in events:
                if ev.operation is aiodat.DTOOp.RECV:
                    assert ev.ok, ev
                    seen.append(bytes(pair.client_lmr.memoryview()[2048:2048 + ev.transferred_length]))
                    if len(seen) == rounds:
                        done.set_result(None)
                    else:
                        client.post_recv(pair.client_lmr[2048:2056])
                        client.post_send(put(pair.client_lmr, b"m%04d" % len(seen)))

        for evd, fn in ((server.recv_evd, on_server), (server.request_evd, on_server),
                        (client.recv_evd, on_client), (client.request_evd, on_client)):
            evd.set_callback(fn)
        client.post_send(put(pair.client_lmr, b"m0000"))
        await asyncio.wait_for(done, T)
        assert seen == [b"M%04d" % i for i in range(rounds)]
        assert tasks and all(task is None for task in tasks)
    finally:
        pair.close()


async def test_wait_and_dequeue_refuse_an_evd_with_a_callback(ep_pair: Any) -> None:
    evd = ep_pair.server.recv_evd
    evd.set_callback(lambda events: None)
    with pytest.raises(aiodat.InvalidState, match="callback"):
        await evd.wait(timeout=1)
    with pytest.raises(aiodat.InvalidState, match="callback"):
        evd.dequeue()
    evd.set_callback(None)  # back to waits
    with pytest.raises(aiodat.TimeoutExpired):
        await evd.wait(timeout=0.05)


async def test_set_callback_rejects_what_it_cannot_use(ep_pair: Any) -> None:
    evd = ep_pair.server.recv_evd
    with pytest.raises(aiodat.InvalidParameter, match="callable"):
        evd.set_callback(42)  # type: ignore[arg-type]
    waiter = asyncio.ensure_future(evd.wait(timeout=T))
    await asyncio.sleep(0.01)
    with pytest.raises(aiodat.InvalidState, match="waiting"):
        evd.set_callback(lambda events: None)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    evd.set_callback(lambda events: None)  # free again once the wait is cancelled
    evd.close()
    with pytest.raises(aiodat.DATError):
        evd.set_callback(None)


async def test_set_callback_refuses_a_coroutine_function(ep_pair: Any, loop_errors: List[dict]) -> None:
    """An ``async def`` callback (or on_error, or an object with an async ``__call__``) is refused
    with InvalidParameter, changing nothing.  It used to be accepted: each batch went to a coroutine
    that nobody awaited, so its events were lost with only a RuntimeWarning."""
    evd = ep_pair.server.recv_evd

    async def on_events(events: List[Any]) -> None:
        pass

    class AsyncCallable:
        async def __call__(self, events: List[Any]) -> None:
            pass

    for fn, on_error in ((on_events, None), (AsyncCallable(), None), (list.clear, on_events)):
        with pytest.raises(aiodat.InvalidParameter, match="coroutine function"):
            evd.set_callback(fn, on_error=on_error)  # type: ignore[arg-type]
    assert evd._callback is None  # refused: the completion goes to the wait
    ep_pair.server.post_recv(ep_pair.server_lmr[0:8], "r")
    ep_pair.client.post_send(put(ep_pair.client_lmr, b"x"))
    (ev,) = await evd.wait(timeout=T)
    assert ev.ok and ev.cookie == "r"


def test_set_callback_outside_a_loop_names_what_it_needs(ia: Any) -> None:
    evd = ia.create_evd(8)
    try:
        with pytest.raises(aiodat.InvalidState, match="running event loop"):
            evd.set_callback(lambda events: None)
    finally:
        evd.close()


async def test_queued_and_software_events_reach_the_callback(ia: Any) -> None:
    evd = ia.create_evd(8, EvdFlags.SOFTWARE)
    try:
        evd.post_se("before")
        got: List[Any] = []
        evd.set_callback(lambda events: got.extend(ev.payload for ev in events))
        evd.post_se("after")
        for _ in range(20):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        assert got == ["before", "after"]
    finally:
        evd.close()


async def test_a_callback_that_raises_reaches_the_loop_handler_and_delivery_goes_on(ep_pair: Any) -> None:
    loop = asyncio.get_running_loop()
    errors: List[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        server = ep_pair.server
        got: List[int] = []

        def fn(events: List[Any]) -> None:
            got.extend(ev.cookie for ev in events)
            if len(got) == 1:
                raise ValueError("the application's callback failed")

        server.recv_evd.set_callback(fn)
        for i in range(2):
            server.post_recv(ep_pair.server_lmr[i * 8:(i + 1) * 8], cookie=i)
        for i in range(2):
            ep_pair.client.post_send(put(ep_pair.client_lmr, b"x"))
            for _ in range(300):
                if len(got) > i:
                    break
                await asyncio.sleep(0.01)
        assert got == [0, 1]
        assert len(errors) == 1 and isinstance(errors[0]["exception"], ValueError)
        assert errors[0]["evd"] is server.recv_evd and "callback" in errors[0]["message"]
    finally:
        loop.set_exception_handler(old)


async def test_a_cq_failure_reaches_on_error_and_the_callbacks_own_error_the_loop(
        ep_pair: Any, loop_errors: List[dict]) -> None:
    """A failure of the EVD itself (a failed poll, from the shim's fault switch) goes to
    on_error, which a transport uses to abort; the callback's own exception still goes to the
    loop's handler; and the completion the failed poll left behind is delivered afterwards."""
    server = ep_pair.server
    got: List[Any] = []
    failures: List[BaseException] = []

    def fn(events: List[Any]) -> None:
        got.extend(ev.cookie for ev in events)
        if len(got) == 1:
            raise ValueError("the application's callback failed")

    server.recv_evd.set_callback(fn, on_error=failures.append)
    for i in range(3):
        server.post_recv(ep_pair.server_lmr[i * 8:(i + 1) * 8], cookie=i)
    try:
        ep_pair.client.post_send(put(ep_pair.client_lmr, b"x"))
        await _until(lambda: got == [0])
        assert len(loop_errors) == 1 and isinstance(loop_errors[0]["exception"], ValueError)
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 1)  # the next wake-up's poll fails
        ep_pair.client.post_send(put(ep_pair.client_lmr, b"y"))
        await _until(lambda: failures)
        assert isinstance(failures[0], aiodat.InternalError) and "polling the CQ" in str(failures[0])
        ep_pair.client.post_send(put(ep_pair.client_lmr, b"z"))  # the next wake-up finds both
        await _until(lambda: len(got) == 3)
        assert got == [0, 1, 2] and len(failures) == 1 and len(loop_errors) == 1
        loop_errors.clear()  # (the fixture fails a test that leaves errors it did not expect)
    finally:
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 0)
        server.recv_evd.set_callback(None)


async def test_an_on_error_that_raises_reaches_the_loop_handler(ep_pair: Any, loop_errors: List[dict]) -> None:
    server = ep_pair.server

    def broken(exc: BaseException) -> None:
        raise RuntimeError("the transport's on_error failed")

    server.recv_evd.set_callback(lambda events: None, on_error=broken)
    server.post_recv(ep_pair.server_lmr[0:8])
    try:
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 1)
        ep_pair.client.post_send(put(ep_pair.client_lmr, b"x"))
        await _until(lambda: loop_errors)
        (context,) = loop_errors
        assert isinstance(context["exception"], RuntimeError) and "on_error" in context["message"]
        assert isinstance(context["exception"].__context__, aiodat.InternalError)
        loop_errors.clear()
    finally:
        lib.aiodat_inject_fault(lib.AIODAT_FAULT_POLL, 0)
        server.recv_evd.set_callback(None)


async def test_on_error_needs_a_callback_and_a_callable(ep_pair: Any) -> None:
    evd = ep_pair.server.recv_evd
    with pytest.raises(aiodat.InvalidParameter, match="on_error"):
        evd.set_callback(None, on_error=print)
    with pytest.raises(aiodat.InvalidParameter, match="on_error"):
        evd.set_callback(lambda events: None, on_error=42)  # type: ignore[arg-type]
    assert evd._callback is None  # refused calls change nothing: waits still work
    with pytest.raises(aiodat.TimeoutExpired):
        await evd.wait(timeout=0.05)


async def test_an_evd_freed_under_its_callback_tells_on_error_once(ia: Any, loop_errors: List[dict]) -> None:
    """An EVD freed while its callback is set (by itself, or with its IA) calls on_error once, from
    the loop and not from inside the free, with InvalidHandle: nothing more will come, as a task
    waiting on it would be told.  With no on_error the free is silent."""
    told: List[BaseException] = []
    evd = ia.create_evd(8)
    evd.set_callback(lambda events: None, on_error=told.append)
    evd.free()
    assert told == []  # not from inside the free
    await _until(lambda: told)
    await asyncio.sleep(0.05)
    assert len(told) == 1 and isinstance(told[0], aiodat.InvalidHandle) and "callback" in str(told[0])
    silent = ia.create_evd(8)
    silent.set_callback(lambda events: None)
    silent.free()
    await asyncio.sleep(0.05)  # (loop_errors fails the test if anything reached the loop's handler)


async def _until(condition: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the callback EVD"
        await asyncio.sleep(0.01)


async def test_connection_events_reach_a_callback(ia: Any) -> None:
    """A connect EVD with a callback gets the peer's DISCONNECTED through it."""
    pair = await make_ep_pair(ia)
    try:
        got: List[Any] = []
        pair.server.connect_evd.set_callback(got.extend)
        await pair.client.disconnect()
        for _ in range(500):
            if got:
                break
            await asyncio.sleep(0.01)
        assert [ev.type for ev in got] == [aiodat.EventType.CONNECTION_EVENT_DISCONNECTED]
    finally:
        pair.close()


# -- busy polling ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, True, 1.5, 10_000_000])
def test_busy_poll_us_must_be_a_sane_int(ia: Any, value: Any) -> None:
    with pytest.raises(aiodat.InvalidParameter, match="busy_poll_us"):
        ia.create_evd(8, busy_poll_us=value)


async def ping_pong(pair: Pair, rounds: int, tick: Optional[List[int]] = None) -> List[bytes]:
    """Both sides as tasks of one loop, each awaiting its recv EVD."""
    a, b = pair.eps
    la, lb = pair.lmrs

    async def echo() -> None:
        for _ in range(rounds):
            (ev,) = await b.recv_evd.wait(timeout=T)
            assert ev.ok, ev
            data = bytes(lb.memoryview()[2048:2048 + ev.transferred_length])
            b.post_recv(lb[2048:2056])
            b.post_send(put(lb, data.upper()))

    got = []
    b.post_recv(lb[2048:2056])
    task = asyncio.ensure_future(echo())
    for i in range(rounds):
        a.post_recv(la[2048:2056])
        a.post_send(put(la, b"p%04d" % i))
        (ev,) = await a.recv_evd.wait(timeout=T)
        assert ev.ok, ev
        got.append(bytes(la.memoryview()[2048:2048 + ev.transferred_length]))
    await asyncio.wait_for(task, T)
    return got


# -- NAPI arming: the loop's poller (aiodat/poller.py) ----------------------------------------
async def test_a_ping_pong_in_one_loop_settles_into_polling(ia: Any) -> None:
    """Plain waits, no busy polling: once both sides keep each other busy, the loop's poller finds
    each reply at the next turn and the receive CQs are (almost) never armed again (an armed CQ
    costs a channel event, a read and a re-arm per message).  When the traffic stops, the poller arms both
    CQs after its idle turns, and a message much later still wakes a wait."""
    pair = await Pair(ia).connect()
    try:
        (a, b), (la, lb) = pair.eps, pair.lmrs
        recv_a, recv_b = a.recv_evd, b.recv_evd
        rounds, warmup = 50, 10

        async def echo() -> None:
            for i in range(rounds):
                (ev,) = await recv_b.wait(timeout=T)
                assert ev.ok, ev
                if i + 1 < rounds:
                    b.post_recv(lb[2048:2056])
                b.post_send(put(lb, b"pong"))

        b.post_recv(lb[2048:2056])
        task = asyncio.ensure_future(echo())
        for i in range(rounds):
            if i == warmup:  # by now the CQs went from armed to polled
                before = recv_a._rearms, recv_b._rearms
            a.post_recv(la[2048:2056], cookie=i)
            a.post_send(put(la, b"ping"))
            (ev,) = await recv_a.wait(timeout=T)
            assert ev.ok and ev.cookie == i, ev
        await asyncio.wait_for(task, T)
        # an arm per message without the poller; now one now and then, when rxe finished a send in
        # its kernel thread a few turns later instead of inside the post
        arms = recv_a._rearms - before[0], recv_b._rearms - before[1]
        assert max(arms) <= (rounds - warmup) // 4, f"CQs armed {arms} times in {rounds - warmup} round trips"
        for _ in range(10):
            await asyncio.sleep(0)
        assert not recv_a._unarmed and not recv_b._unarmed, "idle CQs must end armed"
        b.post_recv(pair.lmrs[1][0:8], cookie="late")
        waiter = asyncio.ensure_future(recv_b.wait(timeout=T))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        a.post_send(put(pair.lmrs[0], b"late"))
        (ev,) = await waiter
        assert ev.ok and ev.cookie == "late"
    finally:
        pair.close()


async def test_a_callback_reply_in_one_loop_comes_in_the_same_turn(ia: Any) -> None:
    """Both sides answer from callbacks, in one process: rxe completes the peer's receive inside
    the post, and the poller delivers it in the same turn of the loop, so 60 round trips take far
    fewer turns than round trips (a wake-up per message would take at least two per round trip)."""
    pair = await Pair(ia).connect()
    try:
        (a, b), (la, lb) = pair.eps, pair.lmrs
        rounds, seen = 60, []
        done: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()

        def on_b(events: List[Any]) -> None:
            for ev in events:
                assert ev.ok, ev
                b.post_recv(lb[2048:2056])
                b.post_send(put(lb, b"pong"))

        def on_a(events: List[Any]) -> None:
            for ev in events:
                assert ev.ok, ev
                seen.append(ev.cookie)
                if len(seen) == rounds:
                    done.set_result(None)
                else:
                    a.post_recv(la[2048:2056], cookie=len(seen))
                    a.post_send(put(la, b"ping"))

        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while not done.done():
                turns += 1
                await asyncio.sleep(0)

        a.recv_evd.set_callback(on_a)
        b.recv_evd.set_callback(on_b)
        b.post_recv(lb[2048:2056])
        a.post_recv(la[2048:2056], cookie=0)
        counter = asyncio.ensure_future(count_turns())
        a.post_send(put(la, b"ping"))
        await asyncio.wait_for(done, T)
        await counter
        assert seen == list(range(rounds))
        assert turns < rounds, f"{rounds} round trips took {turns} turns of the loop"
    finally:
        pair.close()


async def tick(turns: List[int]) -> None:
    """Count the loop's turns into turns[0]: a task that yields once per turn, until cancelled."""
    while True:
        turns[0] += 1
        await asyncio.sleep(0)


spinning_waits = pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"),
                                    reason="a wait spins only where Task.cancelling exists (Python 3.11+)")


async def hot_recv_evd(pair: Pair) -> Any:
    """The server's receive EVD right after a wake-up, which leaves its CQ unarmed with the loop's
    poller (for the poller's idle turns); a receive with the cookie "next" is posted."""
    b, evd = pair.eps[1], pair.eps[1].recv_evd
    b.post_recv(pair.lmrs[1][0:8], cookie="warm")
    waiter = asyncio.ensure_future(evd.wait(timeout=T))
    await asyncio.sleep(0)  # it sleeps, its CQ armed; the completion wakes it through the channel
    pair.eps[0].post_send(put(pair.lmrs[0], b"warm"))
    (ev,) = await waiter
    assert ev.ok and ev.cookie == "warm" and evd._unarmed
    b.post_recv(pair.lmrs[1][0:8], cookie="next")
    return evd


@spinning_waits
async def test_an_awaited_ping_pong_in_one_loop_takes_one_turn_per_round_trip(ia: Any) -> None:
    """A wait on a CQ the poller holds spins: its task yields its turn and looks again itself,
    with no wake-up through its Future.  So the reply, which rxe completes inside the peer's post, is
    found by the waiting task later in the same turn, and a round trip takes one turn of the loop
    (two with a Future per message: the poller finds it, then the woken task runs)."""
    pair = await Pair(ia).connect()
    try:
        (a, b), (la, lb) = pair.eps, pair.lmrs
        rounds = 60
        turns = [0]

        async def echo() -> None:
            for i in range(rounds):
                (ev,) = await b.recv_evd.wait(timeout=T)
                assert ev.ok, ev
                if i + 1 < rounds:
                    b.post_recv(lb[2048:2056])
                b.post_send(put(lb, b"pong"))

        await ping_pong(pair, 2)  # both CQs are with the poller from here on
        b.post_recv(lb[2048:2056])
        task = asyncio.ensure_future(echo())
        counter = asyncio.ensure_future(tick(turns))
        for i in range(rounds):
            a.post_recv(la[2048:2056], cookie=i)
            a.post_send(put(la, b"ping"))
            (ev,) = await a.recv_evd.wait(timeout=T)
            assert ev.ok and ev.cookie == i, ev
        spent = turns[0]
        await asyncio.wait_for(task, T)
        counter.cancel()
        await asyncio.gather(counter, return_exceptions=True)
        assert spent < 1.5 * rounds, f"{rounds} round trips took {spent} turns of the loop"
    finally:
        pair.close()


@spinning_waits
async def test_a_task_cancelled_while_its_wait_spins_frees_the_evd_at_once(
        ia: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As for a sleeping wait (tests/test_evd.py): after task.cancel() another task may wait on the
    EVD at once, even before the cancelled one has run again, and nothing is lost."""
    monkeypatch.setattr(aiodat.poller, "IDLE_TURNS", 1000)  # the CQ stays with the poller throughout
    pair = await Pair(ia).connect()
    try:
        evd = await hot_recv_evd(pair)
        first = asyncio.ensure_future(evd.wait(timeout=T))
        await asyncio.sleep(0)
        assert evd._waiter_task is first and evd.query().waiting and evd._unarmed
        with pytest.raises(aiodat.InvalidState):
            evd.set_callback(lambda events: None)
        second = asyncio.ensure_future(evd.wait(timeout=T))  # its first step is queued now ...
        first.cancel()  # ... ahead of the cancelled task's next turn
        assert not evd.query().waiting
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert evd.query().waiting and not second.done() and evd._waiter_task is second
        pair.eps[0].post_send(put(pair.lmrs[0], b"x"))
        (ev,) = await asyncio.wait_for(second, T)
        assert ev.ok and ev.cookie == "next"
        with pytest.raises(asyncio.CancelledError):
            await first
    finally:
        pair.close()


@spinning_waits
async def test_a_spinning_wait_sleeps_once_the_poller_arms_the_cq(ia: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing comes: the wait spins only for the poller's idle turns, then sleeps on its Future
    (the CQ armed), so a long wait costs no CPU; its timeout still fires, and a late message
    wakes the next wait."""
    monkeypatch.setattr(aiodat.poller, "IDLE_TURNS", 10)  # (the default could arm it before the wait)
    pair = await Pair(ia).connect()
    try:
        evd = await hot_recv_evd(pair)
        assert evd._unarmed
        cpu, wall = time.process_time(), time.monotonic()
        with pytest.raises(aiodat.TimeoutExpired):
            await evd.wait(timeout=0.5)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert wall >= 0.5 and cpu < 0.5 * wall, f"the wait used {cpu:.3f} s of CPU in {wall:.3f} s"
        assert not evd._unarmed and evd._waiter_task is None
        waiter = asyncio.ensure_future(evd.wait(timeout=T))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        pair.eps[0].post_send(put(pair.lmrs[0], b"late"))
        (ev,) = await waiter
        assert ev.ok and ev.cookie == "next"
    finally:
        pair.close()


@spinning_waits
async def test_an_evd_freed_under_a_spinning_wait_fails_it(ia: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiodat.poller, "IDLE_TURNS", 1000)
    pair = await Pair(ia).connect()
    try:
        evd = await hot_recv_evd(pair)
        waiter = asyncio.ensure_future(evd.wait(timeout=T))
        await asyncio.sleep(0)
        assert evd._waiter_task is waiter and evd._unarmed
    finally:
        pair.close()
    with pytest.raises(aiodat.InvalidHandle):
        await asyncio.wait_for(waiter, T)


async def test_a_busy_polling_ping_pong_in_one_loop_takes_no_interrupts(ia: Any) -> None:
    """Both sides busy-poll in one loop (each yields to the other between turns).  With a
    budget far above a round trip the receive CQs are armed only the first time."""
    pair = await Pair(ia, busy_poll_us=500_000).connect()
    try:
        recv_a, recv_b = pair.eps[0].recv_evd, pair.eps[1].recv_evd
        got = await ping_pong(pair, 40)
        assert got == [b"P%04d" % i for i in range(40)]
        # the creation's arm, and at most one more each (a wait that slept before the peer ran)
        assert recv_a._rearms <= 2 and recv_b._rearms <= 2, (recv_a._rearms, recv_b._rearms)
    finally:
        pair.close()


async def test_other_tasks_run_while_a_wait_busy_polls(ia: Any) -> None:
    pair = await Pair(ia, busy_poll_us=300_000).connect()
    try:
        ticks = [0]
        task = asyncio.ensure_future(tick(ticks))
        evd = pair.eps[0].recv_evd
        with pytest.raises(aiodat.TimeoutExpired):
            await evd.wait(timeout=0.2)  # nothing comes: it spins, yielding, then times out
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert ticks[0] > 10
    finally:
        pair.close()


async def test_a_busy_poll_ends_armed_and_a_late_completion_wakes_the_wait(ia: Any) -> None:
    """A short budget runs out, the wait arms the CQ (lazily) and sleeps; a completion much later
    wakes it.  Twice, so the second wait also arms after the first wake-up left the CQ unarmed."""
    pair = await Pair(ia, busy_poll_us=200).connect()
    try:
        a, b = pair.eps
        for i in range(2):
            b.post_recv(pair.lmrs[1][0:8], cookie=i)
            waiter = asyncio.ensure_future(b.recv_evd.wait(timeout=T))
            await asyncio.sleep(0.3)
            assert not waiter.done()
            a.post_send(put(pair.lmrs[0], b"late"))
            (ev,) = await waiter
            assert ev.ok and ev.cookie == i
    finally:
        pair.close()


async def test_a_cancelled_busy_poll_frees_the_evd(ia: Any) -> None:
    pair = await Pair(ia, busy_poll_us=1_000_000).connect()
    try:
        evd = pair.eps[1].recv_evd
        waiter = asyncio.ensure_future(evd.wait(timeout=T))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        pair.eps[1].post_recv(pair.lmrs[1][0:8], cookie="after")
        pair.eps[0].post_send(put(pair.lmrs[0], b"x"))
        (ev,) = await evd.wait(timeout=T)
        assert ev.cookie == "after"
    finally:
        pair.close()


async def test_a_callback_evd_can_busy_poll(ia: Any) -> None:
    pair = await Pair(ia, busy_poll_us=100_000).connect()
    try:
        a, b = pair.eps
        got: List[Any] = []
        b.recv_evd.set_callback(got.extend)
        for i in range(5):
            b.post_recv(pair.lmrs[1][i * 8:(i + 1) * 8], cookie=i)
        for i in range(5):
            a.post_send(put(pair.lmrs[0], b"x"))
            await asyncio.sleep(0.02)
        for _ in range(300):
            if len(got) == 5:
                break
            await asyncio.sleep(0.01)
        assert [ev.cookie for ev in got] == list(range(5))
        b.recv_evd.set_callback(None)
        await asyncio.sleep(0.2)  # the poller stops and leaves the CQ to the waits
        b.post_recv(pair.lmrs[1][0:8], cookie="wait")
        a.post_send(put(pair.lmrs[0], b"y"))
        (ev,) = await b.recv_evd.wait(timeout=T)
        assert ev.cookie == "wait"
    finally:
        pair.close()


async def test_a_list_of_one_segment_posts_like_a_bare_one(ep_pair: Any) -> None:
    ep_pair.server.post_recv([ep_pair.server_lmr[0:16]], cookie="r")
    ep_pair.client.post_send([put(ep_pair.client_lmr, b"one segment")], cookie="s")
    (ev,) = await ep_pair.server.recv_evd.wait(timeout=T)
    assert ev.cookie == "r" and ev.transferred_length == len(b"one segment")
    (sent,) = await ep_pair.client.request_evd.wait(timeout=T)
    assert sent.cookie == "s" and sent.ok


def test_an_unarmed_cq_left_by_a_closed_loop_is_polled_by_the_next(rdma_device: Any) -> None:
    """An object may move to a new loop once its first loop is closed.  A CQ that loop's poller
    still held unarmed must be taken over by the new loop's poller as soon as the new loop
    watches it: here an awaited bind, whose completion no wait or callback asks for, completes."""
    with aiodat.open_ia(rdma_device.name) as ia:
        first = asyncio.new_event_loop()

        async def busy_then_stop() -> Any:
            pair = await make_ep_pair(ia)
            pair.client.post_recv(pair.client_lmr[0:8])
            pair.server.post_send(put(pair.server_lmr, b"one"), cookie="sent")
            (ev,) = await pair.server.request_evd.wait(timeout=T)  # the wake-up leaves the CQ unarmed
            assert ev.cookie == "sent" and ev.ok
            return pair

        try:
            pair = first.run_until_complete(busy_then_stop())
        finally:
            first.close()
        try:
            assert pair.server.request_evd._unarmed, "the test needs the CQ left unarmed by the closed loop"

            async def bind_on_a_new_loop() -> int:
                exposed = pair.pz.register(bytearray(4096), aiodat.Privileges.LOCAL_WRITE
                                           | aiodat.Privileges.MW_BIND)
                rmr = pair.pz.create_rmr()
                return await asyncio.wait_for(rmr.bind(exposed[0:1024], aiodat.Privileges.REMOTE_READ,
                                                       pair.server), T)

            assert asyncio.run(bind_on_a_new_loop()) > 0
        finally:
            pair.close()


# -- a callback whose loop was closed ----------------------------------------------------------
def _run_on_new_loop(aiodat_loop: str, coro: Any) -> Any:
    """Run ``coro`` on a fresh loop of the kind under test, then close that loop."""
    from aiodat.testing.plugin import _loop_factory

    loop = _loop_factory(aiodat_loop)()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_post_se_after_the_callbacks_loop_closed_reaches_the_next_callback(rdma_device: Any,
                                                                           aiodat_loop: str) -> None:
    """Once the loop a callback was set in is closed, that callback serves nobody: post_se queues
    the event (from no loop, or from the next one) and the next set_callback delivers it.  post_se
    used to refuse, saying the EVD was "served by another event loop"."""
    from turns import until

    with aiodat.open_ia(rdma_device.name) as ia:
        evd = ia.create_evd(8, EvdFlags.SOFTWARE)
        first: List[Any] = []

        async def set_it() -> None:
            evd.set_callback(first.extend)

        _run_on_new_loop(aiodat_loop, set_it())
        evd.post_se("outside")  # no loop runs
        got: List[Any] = []

        async def on_the_next_loop() -> None:
            evd.post_se("inside")
            evd.set_callback(got.extend)
            evd.post_se("after")
            await until(lambda: len(got) == 3, "the three events reached the new callback")

        _run_on_new_loop(aiodat_loop, on_the_next_loop())
        assert [ev.payload for ev in got] == ["outside", "inside", "after"] and first == []


def test_a_delivery_left_scheduled_on_a_closed_loop_does_not_stop_the_next(rdma_device: Any,
                                                                           aiodat_loop: str) -> None:
    """An event pushed while the callback's loop was open but not running schedules a delivery
    that never runs once that loop is closed.  The EVD used to believe a delivery was still
    scheduled, and the next loop's set_callback never got the event, nor any later one."""
    from aiodat.evd import report_internal_error
    from aiodat.testing.plugin import _loop_factory
    from turns import until

    with aiodat.open_ia(rdma_device.name) as ia:
        evd = ia.async_evd
        first = _loop_factory(aiodat_loop)()
        try:
            async def set_it() -> None:
                evd.set_callback(lambda events: None)

            first.run_until_complete(set_it())
            # (an async event, as the device's would be, dispatched while the loop is stopped)
            report_internal_error(ia, RuntimeError("test"), "standing in for a device event")
        finally:
            first.close()
        got: List[Any] = []

        async def on_the_next_loop() -> None:
            evd.set_callback(got.extend)
            await until(lambda: len(got) == 1, "the queued event reached the new callback")
            report_internal_error(ia, RuntimeError("test 2"), "a later one")
            await until(lambda: len(got) == 2, "the later event reached the new callback")
            evd.set_callback(None)

        _run_on_new_loop(aiodat_loop, on_the_next_loop())
        assert [ev.type for ev in got] == [aiodat.EventType.ASYNC_ERROR_PROVIDER_INTERNAL_ERROR] * 2


def test_a_connection_event_after_the_callbacks_loop_closed_reaches_the_next_callback(
        rdma_device: Any, aiodat_loop: str) -> None:
    """The peer's DREQ arrives on a new loop, for an EP whose connect EVD has a callback of a loop
    since closed.  Pushing its DISCONNECTED used to call call_soon on the closed loop (RuntimeError,
    reported on the async EVD) and leave a delivery marked scheduled for ever: the next
    set_callback never got the event."""
    from turns import until

    with aiodat.open_ia(rdma_device.name) as ia:
        first: List[Any] = []

        async def connect() -> Any:
            pair = await make_ep_pair(ia)
            pair.server.connect_evd.set_callback(first.extend)
            return pair

        pair = _run_on_new_loop(aiodat_loop, connect())
        try:
            got: List[Any] = []

            async def disconnect_on_the_next_loop() -> None:
                await pair.client.disconnect(timeout=T)
                await until(lambda: pair.server.state is aiodat.EPState.DISCONNECTED, "the server saw the DREQ",
                            turns=100000)
                pair.server.connect_evd.set_callback(got.extend)
                await until(lambda: got, "DISCONNECTED reached the new callback")
                pair.server.connect_evd.set_callback(None)

            _run_on_new_loop(aiodat_loop, disconnect_on_the_next_loop())
            assert [ev.type for ev in got] == [aiodat.EventType.CONNECTION_EVENT_DISCONNECTED] and first == []
        finally:
            pair.close()
