"""A MemoryError in the middle of a post loses nothing.

CPython's own ``_testcapi.set_nomemory(start, stop)`` makes the allocations numbered ``start`` to
``stop`` fail.  Each round fails the next allocation of one post, so the
failure lands on every step in turn: before the post, and in its bookkeeping after it.  An LMR's
in-flight count above 256 (CPython's small ints) makes each change of it allocate too.

What must hold: a post that raised posted nothing; a request the device has is counted on its LMR
(a count short would let ``lmr.free()`` take the buffer from under it) and has its entry (a
completion without one was matched to a later request), and each completion is reported once,
with its own cookie.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import gc
import traceback
import types
from typing import Any, List, Tuple

import pytest

import aiodat
import aiodat.evd
import aiodat.srq
from aiodat._lib import ffi
from aiodat.testing.plugin import make_ep_pair
from aiodat.wr import retire_requests
from completions import take

_testcapi = pytest.importorskip("_testcapi", reason="needs CPython's _testcapi (set_nomemory) to fail allocations")

pytestmark = pytest.mark.rxe

T = 30.0
ROUNDS = 40  # more than the allocations of one post
HIGH = 300  # requests held first, so that the counts are no small ints
PYTHON_ROUNDS = 1000  # at most, on the Python paths
THROUGH = 10  # rounds in a row in which the Python post got through: past its allocations


@pytest.fixture(autouse=True)
def only_the_tests_objects_collected() -> Any:
    """The run's other objects (hundreds of thousands in the whole suite) frozen for the test: the
    many collections here then look at what the test made only (under emulation each full
    collection took seconds, and the finalizer rounds ran to minutes)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def failing_the_nth_allocation(n: int, call: Any, *args: Any) -> bool:
    """Run ``call(*args)`` with its ``n``-th allocation failing: True if it raised MemoryError."""
    return raised_at(n, call, *args) is not None


def raised_at(n: int, call: Any, *args: Any) -> Any:
    """The MemoryError ``call(*args)`` raised with its ``n``-th allocation failing, or None.

    The collector is off meanwhile (_failing)."""
    _failing(n)
    try:
        call(*args)
    except (MemoryError, SystemError) as e:  # (CPython 3.11 reports a frame it could not allocate as SystemError)
        return e
    finally:
        _testcapi.remove_mem_hooks()  # (then the collector: see _failing)
        gc.enable()
    return None


def _failing(n: int) -> None:
    """From here, the ``n``-th allocation fails, with the collector off: a collection the
    allocations started would take the failure into other objects' finalizers (earlier tests'
    garbage) or the gc callbacks (CPython's, aiodat's), which can only report it (as unraisable,
    a warning at random), instead of the code under test.  The caller disarms it, inline
    (``_testcapi.remove_mem_hooks()``, then ``gc.enable()``): a call in between could take the failure."""
    gc.disable()
    _testcapi.set_nomemory(n, n + 1)


def post_one(ep: Any, how: str, seg: Any, cookie: Any) -> None:
    if how.endswith("_batch"):
        getattr(ep, how)([(seg, cookie)])
    else:
        getattr(ep, how)(seg, cookie)


@pytest.mark.parametrize("how", ["post_recv", "post_recv_batch", "post_send", "post_send_batch"])
async def test_a_post_that_runs_out_of_memory_is_counted_and_recorded(ia: Any, how: str) -> None:
    depth = HIGH + 2 * ROUNDS
    pair = await make_ep_pair(ia, attrs=aiodat.EPAttr(max_recv_dtos=depth, max_request_dtos=depth))
    try:
        sends = how.startswith("post_send")
        ep, lmr = (pair.client, pair.client_lmr) if sends else (pair.server, pair.server_lmr)
        queue, evd = (ep._send_q, ep.request_evd) if sends else (ep._recv_q, ep.recv_evd)
        seg = lmr[0:64]
        if sends:  # a receive waits for every send
            pair.server.post_recv_batch([(pair.server_lmr[0:64], None) for _ in range(depth)])
        # held first: their completions are not taken until the end, so the count stays above 256
        getattr(ep, "post_send_batch" if sends else "post_recv_batch")([(seg, ("held", i)) for i in range(HIGH)])
        failures = 0
        for n in range(ROUNDS):
            failed = failing_the_nth_allocation(n, post_one, ep, how, seg, ("round", n))
            failures += failed
            # a post that raised posted nothing; one that returned is recorded
            assert (("round", n) in [entry[1] for entry in queue]) is not failed, f"round {n}, failed: {failed}"
            # every request the EP holds an entry for is counted (more is the safe side)
            assert lmr._inflight >= len(queue), f"round {n}: {lmr._inflight} < {len(queue)}"
        assert failures, "no allocation failed: the injection did not reach the post"
        await each_request_completes_with_its_cookie(pair, sends, queue, evd, lmr)
    finally:
        pair.close()


async def each_request_completes_with_its_cookie(pair: Any, sends: bool, queue: Any, evd: Any, lmr: Any) -> None:
    """Every request the device holds is found again when it completes, with its own cookie, and
    then nothing is counted on ``lmr``."""
    expected = [entry[1] for entry in queue]
    if not sends:
        await send(pair, len(expected))
    events = await take(evd, len(expected))
    assert [e.cookie for e in events] == expected
    assert lmr._inflight == 0


async def send(pair: Any, count: int) -> None:
    """Send ``count`` messages from the client, 32 at a time."""
    src = pair.client_lmr[0:8]
    for sent in range(0, count, 32):
        batch = min(32, count - sent)
        pair.client.post_send_batch([(src, None) for _ in range(batch)])
        await take(pair.client.request_evd, batch)


# The general paths, in Python (aiodat/post.py): several segments to a request, immediate data,
# RDMA and atomics, and the batches C leaves to Python.  Each case posts ``len(cookies)`` requests;
# ``_two`` gives a fresh list of two segments (a batch of the very same list twice takes one of the
# same-segments paths, of two lists the path of a request each).  These paths allocate more than
# C's: the rounds go on until the post has got through THROUGH times in a row (some allocations'
# failures are dropped on the way: a post can get through before its last allocation is reached).
def _two(lmr: Any) -> List[Any]:
    return [lmr[0:32], lmr[32:64]]


PYTHON_PATHS = {
    # on the server (receives)
    "post_recv two segments": (1, lambda ep, lmr, remote, c: ep.post_recv(_two(lmr), c[0])),
    "post_recv_batch same segments": (2, lambda ep, lmr, remote, c: ep.post_recv_batch(
        [(segs, cookie) for segs in [_two(lmr)] for cookie in c])),
    "post_recv_batch two segments each": (2, lambda ep, lmr, remote, c: ep.post_recv_batch(
        [(_two(lmr), cookie) for cookie in c])),
    # on the client (sends, RDMA, atomics)
    "post_send two segments": (1, lambda ep, lmr, remote, c: ep.post_send(_two(lmr), c[0])),
    "post_send imm_data": (1, lambda ep, lmr, remote, c: ep.post_send(lmr[0:64], c[0], imm_data=7)),
    "post_send_batch two segments each": (2, lambda ep, lmr, remote, c: ep.post_send_batch(
        [(_two(lmr), cookie) for cookie in c])),
    "post_rdma_write": (1, lambda ep, lmr, remote, c: ep.post_rdma_write(lmr[0:64], remote, c[0])),
    "post_rdma_read": (1, lambda ep, lmr, remote, c: ep.post_rdma_read(lmr[0:64], remote, c[0])),
    "post_fetch_add": (1, lambda ep, lmr, remote, c: ep.post_fetch_add(lmr[0:8], remote[0:8], 1, c[0])),
    "post_rdma_write_batch same segments": (2, lambda ep, lmr, remote, c: ep.post_rdma_write_batch(
        [(segs, remote, cookie) for segs in [_two(lmr)] for cookie in c])),
    # (reads take one segment on rxe, max_sge_rd; items from a generator are not C's)
    "post_rdma_read_batch each": (2, lambda ep, lmr, remote, c: ep.post_rdma_read_batch(
        (lmr[0:64], remote, cookie) for cookie in c)),
}


@pytest.mark.parametrize("how", list(PYTHON_PATHS))
async def test_a_python_post_that_runs_out_of_memory_is_counted_and_recorded(ia: Any, how: str) -> None:
    per_round, post = PYTHON_PATHS[how]
    depth = HIGH + per_round * 100
    attrs = aiodat.EPAttr(max_recv_dtos=depth, max_request_dtos=depth, max_recv_iov=2, max_request_iov=2)
    pair = await make_ep_pair(ia, attrs=attrs)
    try:
        sends = not how.startswith("post_recv")
        ep, lmr = (pair.client, pair.client_lmr) if sends else (pair.server, pair.server_lmr)
        queue, evd = (ep._send_q, ep.request_evd) if sends else (ep._recv_q, ep.recv_evd)
        segs_at = 3 if sends else 2  # (the segments' place in a queue entry)
        remote = pair.server_lmr.remote()[0:64]
        if sends:  # a receive waits for every send
            pair.server.post_recv_batch([(pair.server_lmr[0:64], None) for _ in range(depth)])
        # held first (by C's paths): their completions are not taken until the end, so the count
        # stays above 256
        seg = lmr[0:64]
        getattr(ep, "post_send_batch" if sends else "post_recv_batch")([(seg, ("held", i)) for i in range(HIGH)])
        # once unhindered first: what a path makes on its first use (its cached C structures) is not
        # made again, and would push its later allocations past the rounds that reach them
        post(ep, lmr, remote, [("first", k) for k in range(per_round)])
        failures = in_a_row = n = 0
        while in_a_row < THROUGH:
            assert n < PYTHON_ROUNDS, f"the post failed all of {n} rounds"
            cookies = [("round", n, k) for k in range(per_round)]
            error = raised_at(n, post, ep, lmr, remote, cookies)
            failed = error is not None
            # a post that raised posted nothing (no entry); one that returned is recorded, each request
            queued = {entry[1] for entry in queue}
            assert [c in queued for c in cookies] == [not failed] * per_round, \
                f"round {n}: {''.join(traceback.format_exception(error)) if failed else 'no error'}"
            # every segment of every request the EP holds an entry for is counted (more is the safe side)
            uses = sum(len(entry[segs_at]) for entry in queue)
            assert lmr._inflight >= uses, f"round {n}: {lmr._inflight} < {uses}"
            failures += failed
            in_a_row = 0 if failed else in_a_row + 1
            n += 1
        assert failures, "no allocation failed: the injection did not reach the post"
        # every request the device holds is found again when it completes, with its own cookie; a
        # post that raised yet went completes too: a receive with no cookie, a send with no entry
        # (which makes no event: noted here)
        expected = [entry[1] for entry in queue]
        no_entry: List[int] = []
        plan_send = ep._plan_send  # (a completion with no entry at the head of the queue is planned)

        def noting(wr_id: int) -> Any:
            plan = plan_send(wr_id)
            if plan[0] is None:
                no_entry.append(wr_id)
            return plan

        ep._plan_send = noting
        if not sends:
            await send(pair, len(expected))
        events = await take(evd, len(expected))
        assert [e.cookie for e in events] == expected
        await asyncio.sleep(0.1)
        assert evd.dequeue() is None and not no_entry, f"completions of no request: {no_entry}"
        assert lmr._inflight == 0
        assert not ep._quiet
    finally:
        pair.close()


# -- taking completions under memory pressure (evd.py, wr.py, completions.c) -------------------
#
# The requests' completions wait in the CQ; then each round takes some of them (an EVD of qlen 4
# polls at most 4 at a time) with its n-th allocation failing, n going round.  What must hold:
# every completion comes out exactly once, in order, with its own cookie, whichever way it is
# taken (a MemoryError may reach the caller of that wait, the next one has the events), and the
# LMR's count is back to 0.

TAKE_QLEN = 4
TAKE_CYCLE = 48  # more than the allocations of one wait, dequeue or wake-up


def _taken_cookies(events: List[Any]) -> List[Any]:
    assert all(e.ok for e in events), [e.status for e in events if not e.ok]
    return [e.cookie for e in events]


async def _completions_waiting(ia: Any, sends: bool) -> Any:
    """A pair whose client (``sends``) or server has HIGH + 100 completions waiting in its CQ, of
    requests on one LMR (its count above 256 for the first 144); (pair, evd, lmr, cookies)."""
    total = HIGH + 100
    pair = await make_ep_pair(ia, attrs=aiodat.EPAttr(max_recv_dtos=total, max_request_dtos=total))
    src, dst = pair.client_lmr[0:8], pair.server_lmr[0:64]
    cookies = [("taken", i) for i in range(total)]
    if sends:
        pair.server.post_recv_batch([(dst, None) for _ in range(total)])
        pair.client.post_send_batch([(src, c) for c in cookies])
        await take(pair.server.recv_evd, total)  # received: the sends have completed too
        evd, lmr = pair.client.request_evd, pair.client_lmr
    else:
        pair.server.post_recv_batch([(dst, c) for c in cookies])
        pair.client.post_send_batch([(src, None) for _ in range(total)])
        await take(pair.client.request_evd, total)  # sent: they were received
        evd, lmr = pair.server.recv_evd, pair.server_lmr
    assert lmr._inflight == total
    evd.resize(TAKE_QLEN)
    # its channel watched by this loop first: asyncio's add_reader under a failing allocation
    # is asyncio's business (CPython's WeakValueDictionary raises a SystemError there)
    evd._attach(asyncio.get_running_loop())
    return pair, evd, lmr, cookies


def _check_taken(evd: Any, lmr: Any, taken: List[Any], cookies: List[Any], failures: int) -> None:
    assert failures, "no allocation failed: the injection did not reach the taking of completions"
    assert taken == cookies, (f"{len(taken)} of {len(cookies)} taken; missing "
                              f"{[c for c in cookies if c not in taken][:5]}, "
                              f"twice {[c for c in set(taken) if taken.count(c) > 1][:5]}")
    assert lmr._inflight == 0
    assert not evd._queue and not evd._backlog


@pytest.mark.parametrize("sends", [False, True], ids=["recv", "send"])
@pytest.mark.parametrize("max_events", [None, 2], ids=["wait", "wait_max_events"])
async def test_waits_that_run_out_of_memory_lose_no_completion(ia: Any, sends: bool,
                                                               max_events: Any) -> None:
    """``await evd.wait()``: C's wait (wait_begin: its look and its take), or with ``max_events``
    Python's (the look's rest in Python, _take)."""
    pair, evd, lmr, cookies = await _completions_waiting(ia, sends)
    try:
        taken: List[Any] = []
        failures = rounds = 0
        while len(taken) < len(cookies) and rounds < 20 * len(cookies):
            n = rounds % TAKE_CYCLE
            rounds += 1
            events: List[Any] = []
            _failing(n)
            try:
                events = await evd.wait(timeout=2.0, max_events=max_events)
            except MemoryError:
                failures += 1
            except aiodat.TimeoutExpired:
                break  # nothing more comes: some were lost
            finally:
                _testcapi.remove_mem_hooks()
                gc.enable()
            taken += _taken_cookies(events)
        _check_taken(evd, lmr, taken, cookies, failures)
    finally:
        pair.close()


@pytest.mark.parametrize("sends", [False, True], ids=["recv", "send"])
async def test_dequeues_that_run_out_of_memory_lose_no_completion(ia: Any, sends: bool) -> None:
    """``evd.dequeue()``: its drain in Python (_drain_cq, C's queue_common and _queue_backlog)."""
    pair, evd, lmr, cookies = await _completions_waiting(ia, sends)
    try:
        taken: List[Any] = []
        failures = rounds = 0
        while len(taken) < len(cookies) and rounds < 20 * len(cookies):
            n = rounds % TAKE_CYCLE
            rounds += 1
            event, failed = None, False
            _failing(n)
            try:
                event = evd.dequeue()
            except MemoryError:
                failed = True
            finally:
                _testcapi.remove_mem_hooks()
                gc.enable()
            failures += failed
            if event is not None:
                taken += _taken_cookies([event])
            elif not failed:
                break  # nothing queued, nothing polled: no more to come
        _check_taken(evd, lmr, taken, cookies, failures)
    finally:
        pair.close()


@pytest.mark.parametrize("sends", [False, True], ids=["recv", "send"])
async def test_callback_wakeups_that_run_out_of_memory_lose_no_completion(ia: Any, sends: bool) -> None:
    """``evd.set_callback(fn)``: the reader callback (C's wakeup: drain, deliver, look again), with
    its failures going to ``on_error``; what it could not deliver comes with a later delivery."""
    pair, evd, lmr, cookies = await _completions_waiting(ia, sends)
    try:
        got = _Delivered(len(cookies))
        evd.set_callback(got.deliver, on_error=got.on_error)
        failures = rounds = 0
        while rounds < 4 * len(cookies):  # (no await: the loop's poller takes no turn meanwhile)
            n = rounds % TAKE_CYCLE
            rounds += 1
            _failing(n)
            try:
                evd._on_readable()  # the channel's reader callback, as the loop calls it
            except MemoryError:
                failures += 1
            finally:
                _testcapi.remove_mem_hooks()
                gc.enable()
        failures += got.memory_errors()
        await got.all_of(cookies)  # what is left, the poller delivers
        evd.set_callback(None)
        _check_taken(evd, lmr, got.cookies(), cookies, failures)
    finally:
        pair.close()


async def test_a_wakeup_whose_arm_note_fails_loses_no_completion(ia: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """C's wakeup notes that the wake-up consumed the arm (``_unarmed``, ``_arm_error``); a failure
    there (set_nomemory cannot make it: the attributes exist, their set allocates nothing; a
    descriptor stands in) must not drop completions: it came after the drain, which had polled a
    batch into ``_wcs`` with no backlog noted, so they were lost.  Now it comes before the drain:
    nothing is polled, and the poller (or the next wake-up) takes everything."""
    pair, evd, lmr, cookies = await _completions_waiting(ia, False)
    try:
        got = _Delivered(len(cookies))
        evd.set_callback(got.deliver, on_error=got.on_error)
        failed: List[int] = []

        def get(self: Any) -> Any:
            return self.__dict__["_arm_error"]

        def set_once_failing(self: Any, value: Any) -> None:
            if self is evd and not failed:
                failed.append(1)
                raise MemoryError
            self.__dict__["_arm_error"] = value

        monkeypatch.setattr(type(evd), "_arm_error", property(get, set_once_failing), raising=False)
        woken: List[int] = []
        real_woken = evd._woken
        monkeypatch.setattr(evd, "_woken", lambda: (woken.append(1), real_woken())[1])
        evd._on_readable()  # the channel's reader callback, as the loop calls it
        assert failed and not woken, "C's wakeup did not take its common case"
        assert got.memory_errors() == 1
        await got.all_of(cookies)  # the poller delivers the rest
        evd.set_callback(None)
        _check_taken(evd, lmr, got.cookies(), cookies, 1)
    finally:
        pair.close()


class _Delivered:
    """A callback EVD's callback and on_error, which allocate nothing (a failure there would lose
    events here): what they were given."""

    def __init__(self, total: int) -> None:
        self.batches: List[Any] = [None] * (2 * total)
        self.count = [0]
        self.errors: List[Any] = [None] * (20 * total)
        self.error_count = [0]

    def deliver(self, events: List[Any]) -> None:
        self.batches[self.count[0]] = events
        self.count[0] += 1

    def on_error(self, exc: BaseException) -> None:
        self.errors[self.error_count[0]] = exc
        self.error_count[0] += 1

    def memory_errors(self) -> int:
        return sum(isinstance(e, MemoryError) for e in self.errors[:self.error_count[0]])

    def cookies(self) -> List[Any]:
        return _taken_cookies([e for b in self.batches[:self.count[0]] for e in b])

    async def all_of(self, cookies: List[Any]) -> None:
        """Until all of ``cookies`` came, for 2 s at most."""
        for _ in range(200):
            if sum(len(b) for b in self.batches[:self.count[0]]) >= len(cookies):
                return
            await asyncio.sleep(0.01)


async def test_a_callback_evds_drain_that_fails_part_way_is_taken_up_again(ia: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A callback EVD whose drain failed part way with its CQ armed (the poller's last step: arm,
    then take what came before the arm): no channel event announces what it left (its backlog,
    and what the CQ holds behind it), so the EVD drains again, delivery after delivery, until it
    has taken it all (it was left there until a new completion came, and the waiting task had)."""
    pair, evd, lmr, cookies = await _completions_waiting(ia, False)
    try:
        monkeypatch.setattr(evd, "_napi_add", lambda: None)  # no poller: what is left is the EVD's own
        # C takes none (a failure in C leaves the completion to Python, which takes it at once): a
        # failure in Python leaves it and those after it as the backlog
        monkeypatch.setattr(aiodat.evd, "_queue_common", lambda *args: (0, 0))
        got = _Delivered(len(cookies))
        evd.set_callback(got.deliver, on_error=got.on_error)
        await asyncio.sleep(0.1)  # the channel's event: its wake-up takes what the room allows
        for n in range(4 * TAKE_CYCLE):  # a round that takes 4, or fails part way
            _failing(n % TAKE_CYCLE)
            try:
                evd._napi_arm()
            finally:
                _testcapi.remove_mem_hooks()
                gc.enable()
            if evd._backlog:
                break
        assert evd._backlog and got.memory_errors(), "no drain failed part way"
        await got.all_of(cookies)
        evd.set_callback(None)
        _check_taken(evd, lmr, got.cookies(), cookies, got.memory_errors())
    finally:
        pair.close()


async def test_completions_c_cannot_look_up_stay_for_python(ia: Any) -> None:
    """C's look (EVD._poll: a wait's first look, the poller's) polled completions and could not
    read the EVD's table of EPs (no dict): it leaves them all to Python as the backlog, which takes
    them (they were lost)."""
    pair, evd, lmr, cookies = await _completions_waiting(ia, False)
    try:
        table = evd._qpn_refs
        evd._qpn_refs = types.MappingProxyType(table)
        try:
            assert evd._poll()
        finally:
            evd._qpn_refs = table
        assert len(evd._queue) == TAKE_QLEN
        assert _taken_cookies(await take(evd, len(cookies))) == cookies
        assert lmr._inflight == 0
    finally:
        pair.close()


# A batch whose queue entries a deque's extend adds part way (posts.c's prepare_batch): a deque
# allocates a block every 64 entries, so a batch of 8 begun 3 short of a block's end fails at its
# 4th entry when that allocation does.  The entries added must be taken back with the counts, else
# their later retirement lowers the LMR's count a second time (short: lmr.free() could release a
# buffer the device uses).  sys.getsizeof(deque) counts its blocks: it tells where one begins.
BATCH = 8


def _to_block_end(ep: Any, sends: bool, seg: Any, short: int) -> None:
    """Post single requests (unhindered) until the EP's queue is ``short`` entries from a block's end."""
    import sys

    queue = ep._send_q if sends else ep._recv_q
    post = ep.post_send if sends else ep.post_recv
    size = sys.getsizeof(queue)
    while sys.getsizeof(queue) == size:  # (the first entry of a new block)
        post(seg, ("pad", len(queue)))
    for _ in range(64 - 1 - short):
        post(seg, ("pad", len(queue)))


@pytest.mark.parametrize("how", ["post_recv_batch", "post_send_batch"])
async def test_a_batch_whose_queue_entries_are_added_part_way_takes_them_back(ia: Any, how: str) -> None:
    depth = HIGH + 256 + BATCH * ROUNDS
    pair = await make_ep_pair(ia, attrs=aiodat.EPAttr(max_recv_dtos=depth, max_request_dtos=depth))
    try:
        sends = how == "post_send_batch"
        ep, lmr = (pair.client, pair.client_lmr) if sends else (pair.server, pair.server_lmr)
        queue, evd = (ep._send_q, ep.request_evd) if sends else (ep._recv_q, ep.recv_evd)
        seg = lmr[0:64]
        if sends:
            pair.server.post_recv_batch([(pair.server_lmr[0:64], None) for _ in range(depth)])
        getattr(ep, how)([(seg, ("held", i)) for i in range(HIGH)])
        _to_block_end(ep, sends, seg, 3)
        failures = 0
        for n in range(ROUNDS):
            cookies = [("round", n, k) for k in range(BATCH)]
            failed = failing_the_nth_allocation(n, getattr(ep, how), [(seg, c) for c in cookies])
            failures += failed
            queued = [entry[1] for entry in queue]
            assert [c in queued for c in cookies] == [not failed] * BATCH, f"round {n}, failed: {failed}"
            assert lmr._inflight == len(queue), f"round {n}: {lmr._inflight} != {len(queue)}"
        assert failures, "no allocation failed: the injection did not reach the post"
        await each_request_completes_with_its_cookie(pair, sends, queue, evd, lmr)
    finally:
        pair.close()


# An allocation after a post's records could run a finalizer that closes or resets the EP: its
# _retire_all (wr.py) takes every entry off the queue and lowers their counts.  The post then sees
# the QP gone (still_at) and gives its records back: it must not lower the counts a second time.
# Python's collector does not run at those points today (no allocation of a collected object falls
# between the records and that look), so the finalizer is stood in for, deterministically, by a
# queue whose append / extend closes the EP right after adding.
class _ClosingQueue(collections.deque):
    ep: Any = None

    def append(self, entry: Any) -> None:
        super().append(entry)
        self.ep.close()

    def extend(self, entries: Any) -> None:
        super().extend(entries)
        self.ep.close()


@pytest.mark.parametrize("how", ["post_recv", "post_recv_batch", "post_send", "post_send_batch"])
async def test_a_post_whose_ep_is_closed_after_its_records_lowers_no_count_twice(ia: Any, how: str) -> None:
    pair = await make_ep_pair(ia)
    try:
        sends = how.startswith("post_send")
        ep, lmr = (pair.client, pair.client_lmr) if sends else (pair.server, pair.server_lmr)
        seg = lmr[0:64]
        if sends:
            pair.server.post_recv_batch([(pair.server_lmr[0:64], None) for _ in range(4)])
        getattr(ep, "post_send_batch" if sends else "post_recv_batch")([(seg, ("held", i)) for i in range(2)])
        name = "_send_q" if sends else "_recv_q"
        closing = _ClosingQueue(getattr(ep, name))
        closing.ep = ep
        setattr(ep, name, closing)
        # (the QP's Raw retires the queues it was given once the QP is gone: the stand-in's, now)
        ep._raw.then = functools.partial(retire_requests, ep._send_q, ep._recv_q, ep._quiet)
        with pytest.raises(aiodat.DATError):
            if how.endswith("_batch"):
                getattr(ep, how)([(seg, ("late", k)) for k in range(3)])
            else:
                getattr(ep, how)(seg, "late")
        assert ep._closed
        assert not getattr(ep, name)
        assert lmr._inflight == 0
    finally:
        pair.close()


# The same for an SRQ's batch (posts.c's prepare_srq_batch): a close meanwhile clears _posted and
# lowers the counts of what it held (srq.py's _release_posted).  C's records go into _posted with
# PyDict_SetItem (no method to stand in), so the close is made where C takes its last look, on its
# read of _srq_address, once C's records are there.
class _SRQClosingOnLook(aiodat.srq.SRQ):
    @property
    def _srq_address(self) -> int:
        address = self.__dict__["_srq_address"]
        if address and not self.__dict__.get("_closing") and any(
                cookie == "late" for cookie, _ in self.__dict__.get("_posted", {}).values()):
            self.__dict__["_closing"] = True
            self.close()
            return 0
        return address

    @_srq_address.setter
    def _srq_address(self, value: int) -> None:
        self.__dict__["_srq_address"] = value


async def test_an_srq_batch_whose_srq_is_closed_after_its_records_lowers_no_count_twice(ia: Any) -> None:
    pz = ia.create_pz()
    try:
        srq = ia.create_srq(pz, 8)
        lmr = pz.register(bytearray(4096))
        seg = lmr[0:64]
        srq.post_recv_batch([(seg, ("held", i)) for i in range(2)])
        srq.__class__ = _SRQClosingOnLook
        with pytest.raises(aiodat.DATError):
            srq.post_recv_batch([(seg, "late") for _ in range(3)])
        assert srq.__dict__.get("_closing") and not srq._posted
        assert lmr._inflight == 0
    finally:
        pz.close()


async def test_an_srq_closed_out_of_memory_releases_each_posted_receive_once(ia: Any) -> None:
    # Each allocation of close() fails in turn.  Wherever it fails, once the SRQ is gone (closed
    # again, or released after a close that raised before its destruction), each receive it held is taken off
    # its LMR's count once: none left counted for good (the LMR could never be freed), none twice.
    pz = ia.create_pz()
    try:
        lmr = pz.register(bytearray(4096))
        holder = ia.create_srq(pz, HIGH)
        holder.post_recv_batch([(lmr[0:64], ("held", i)) for i in range(HIGH)])  # counts above 256
        failures = through = 0
        for n in range(PYTHON_ROUNDS):
            srq = ia.create_srq(pz, 8)
            srq.post_recv_batch([(lmr[64:128], ("round", n, i)) for i in range(3)])
            assert lmr._inflight == HIGH + 3
            raw = srq._raw
            failed = failing_the_nth_allocation(n, srq.close)
            failures += failed
            through = 0 if failed else through + 1
            srq.close()  # (again: a close that raised before it began is made again; idempotent after)
            assert srq.closed
            if raw.ptr != ffi.NULL:  # a close that raised before the destruction left it to the
                assert raw.release() == 0  # finalizer: its release (CPython 3.11 can leak the
                # reference a call that could not allocate its frame held, so it is called here)
            assert lmr._inflight == HIGH, f"allocation {n} failed: {failed}"
            if through == THROUGH:
                break
        assert failures and through == THROUGH
        holder.close()
        assert lmr._inflight == 0
    finally:
        pz.close()
    # and the PD went with it: no SRQ's destruction left it counted as a user (Raw._forget had
    # lowered none when its iterator could not be made)
    assert pz._raw.ptr == ffi.NULL


async def test_a_window_bind_that_runs_out_of_memory_is_pending_and_counted_or_not_posted(ia: Any) -> None:
    # Each allocation of rmr.bind_nowait fails in turn.  A bind that raised did not go (no send
    # queue entry of its cookie); one that returned is pending on the window and counted on its
    # LMR, and completes with its own cookie.  The LMR's count is held above 256 by receives, so
    # that each change of it allocates.  (The records came after the post: a failure there left a
    # bind the device had with no pending entry and its LMR short of a count.)
    pair = await make_ep_pair(ia, attrs=aiodat.EPAttr(max_recv_dtos=HIGH))
    try:
        exposed = pair.pz.register(bytearray(4096), aiodat.Privileges.LOCAL_WRITE | aiodat.Privileges.MW_BIND)
        rmr = pair.pz.create_rmr()
        pair.server.post_recv_batch([(exposed[0:64], ("held", i)) for i in range(HIGH)])
        evd = pair.server.request_evd
        # once first: what is made on the first bind only (the flag enum's combined member, the EP's
        # work request) would take the first rounds' failures
        await rmr.bind(exposed[1024:2048], aiodat.Privileges.REMOTE_READ, pair.server)
        await rmr.unbind(pair.server)
        failures = through = 0
        for n in range(PYTHON_ROUNDS):
            cookie = ("round", n)
            failed = failing_the_nth_allocation(
                n, rmr.bind_nowait, exposed[1024:2048], aiodat.Privileges.REMOTE_READ, pair.server, cookie)
            failures += failed
            through = 0 if failed else through + 1
            went = cookie in [entry[1] for entry in pair.server._send_q]
            assert went is not failed, f"round {n}, failed: {failed}"
            assert len(rmr._pending) == went and exposed._inflight == HIGH + went, f"round {n}"
            if went:
                event = await evd.wait_one(timeout=T)
                assert (event.type, event.cookie, event.ok) == (aiodat.EventType.RMR_BIND_COMPLETION, cookie, True)
                assert rmr.bound and exposed._inflight == HIGH + 1
                await rmr.unbind(pair.server)
            assert not rmr.bound and exposed._inflight == HIGH and evd.dequeue() is None, f"round {n}"
            if through == THROUGH:
                break
        assert failures and through == THROUGH
        rmr.free()
    finally:
        pair.close()


# -- aiodat's gc callbacks under memory pressure (_handle.py, _fdwatch.py) ----------------------
#
# A collection ends with aiodat's callbacks: _handle's retries the destructions that were deferred,
# _fdwatch's lets closed loops go.  A MemoryError in one could only be reported (as unraisable: the
# warning these tests gave at random), and in _handle's it came after a retried destruction and
# before the object was marked gone: off the deferred list with its pointer, it was destroyed a
# second time by its finalizer.


def _unraisable_from(package_dir: str, seen: List[Any]) -> List[str]:
    """The unraisable exceptions among ``seen`` raised in code under ``package_dir`` (not in the
    call of a callback itself, nor in CPython's collector: their tracebacks name no frame of it)."""
    return ["".join(traceback.format_exception(u.exc_value)) for u in seen
            if any(frame.filename.startswith(package_dir) for frame in traceback.extract_tb(u.exc_traceback))]


async def test_a_collection_that_runs_out_of_memory_destroys_a_deferred_object_once(ia: Any) -> None:
    """Each allocation of a collection fails in turn (from its start: CPython's, the finalizers',
    aiodat's callbacks'), with a QP's destruction deferred (it failed until then).  After it the
    QP is destroyed and marked gone, or still deferred; aiodat's callbacks raised nothing; and in
    the end it was destroyed once."""
    import errno
    import os
    import sys

    from aiodat import _handle

    package_dir = os.path.dirname(aiodat.__file__) + os.sep
    pz = ia.create_pz()
    evd = ia.create_evd(4)
    evd._attach(asyncio.get_running_loop())  # a loop watches an fd: _fdwatch's callback has work
    unraisable: List[str] = []
    failures = through = 0
    try:
        for n in range(PYTHON_ROUNDS):
            ep = ia.create_ep(pz)
            raw, real = ep._raw, ep._raw._destroy
            allowed, destroyed = [False], [0]  # (no list grows in the destroy: it runs under the failure)

            def destroy(ptr: Any) -> int:
                if not allowed[0]:  # (the reset's own releases retry it too)
                    return errno.EINTR
                destroyed[0] += 1
                return real(ptr) if destroyed[0] == 1 else 0  # (a second destruction: counted, not made)

            raw._destroy = destroy
            gc.collect()  # earlier garbage first: the failing collection has the deferred QP to itself
            gc.disable()  # (and no other collection retries it first)
            seen: List[Any] = []
            try:
                with pytest.raises(aiodat.DATError, match="destroying the queue pair"):
                    ep.reset()
                assert any(r is raw for r in _handle._deferred) and raw.ptr != ffi.NULL
                allowed[0] = True
                hook, sys.unraisablehook = sys.unraisablehook, seen.append
                _testcapi.set_nomemory(n, n + 1)
                try:
                    gc.collect()
                except MemoryError:
                    pass
                finally:
                    _testcapi.remove_mem_hooks()
                    sys.unraisablehook = hook
            finally:
                gc.enable()
            unraisable += _unraisable_from(package_dir, seen)
            gone = raw.ptr == ffi.NULL
            assert gone or any(r is raw for r in _handle._deferred), \
                f"allocation {n}: a QP neither marked gone nor deferred ({destroyed[0]} destructions)"
            failed = not gone or bool(seen)
            failures += failed
            through = 0 if failed else through + 1
            gc.collect()  # the deferred destruction, unhindered now
            raw.release()
            assert raw.ptr == ffi.NULL and destroyed[0] == 1, f"allocation {n}: {destroyed[0]} destructions"
            if through == THROUGH:
                break
        assert failures and through == THROUGH
        assert not unraisable, f"{len(unraisable)} raised in aiodat's gc callbacks; the first:\n{unraisable[0]}"
    finally:
        evd.close()
        pz.close()
    assert pz._raw.ptr == ffi.NULL  # each QP let go of the PD once


def _collected_failing_at(n: int, held: List[Any]) -> Tuple[bool, List[Any]]:
    """Drop what ``held`` holds and collect it, the ``n``-th allocation from there failing (the
    collector off otherwise, unclosed warnings ignored): whether the failure came in the drop or
    the collection (else in a probe after them: the rounds past their allocations), and the
    unraisable exceptions reported meanwhile (a finalizer's, a gc callback's)."""
    import sys
    import warnings

    seen: List[Any] = []
    landed = "collection"
    # (the hook and the failing written out, as in the test above: a context manager's exit would
    # itself allocate while allocations fail)
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            hook, sys.unraisablehook = sys.unraisablehook, seen.append
            _testcapi.set_nomemory(n, n + 1)
            try:
                held.clear()
                gc.collect()
                landed = "probe"
                probe = [object() for _ in range(5000)]
                landed = "collection"  # (the probe went through: the failure was swallowed before it)
                del probe
            except MemoryError:
                pass
            finally:
                _testcapi.remove_mem_hooks()
                sys.unraisablehook = hook
    finally:
        gc.enable()
    return landed == "collection", seen


def _dropped_unclosed_out_of_memory(ia: Any, make: Any, kind: str) -> None:
    """Each allocation of the collection of an object ``make(pz)`` makes, dropped unclosed, fails in
    turn: no exception escapes aiodat's finalizers.  Then one collection with nothing failing gives
    the object's unclosed ResourceWarning (its finalizer calls Handle.__del__)."""
    import os
    import warnings

    package_dir = os.path.dirname(aiodat.__file__) + os.sep
    pz = ia.create_pz()
    unraisable: List[str] = []
    failures = through = 0
    try:
        for n in range(PYTHON_ROUNDS):
            held = [make(pz)]
            gc.collect()  # earlier garbage first: the failing collection has the object to itself
            failed, seen = _collected_failing_at(n, held)
            unraisable += _unraisable_from(package_dir, seen)
            failures += failed
            through = 0 if failed else through + 1
            if through == THROUGH:
                break
        assert failures and through == THROUGH
        assert not unraisable, f"{len(unraisable)} raised in aiodat's finalizers; the first:\n{unraisable[0]}"
        obj = make(pz)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            del obj
            gc.collect()
        assert [str(w.message) for w in caught if str(w.message).startswith(f"unclosed {kind} ")], \
            f"no unclosed {kind} warning: {[str(w.message) for w in caught]}"
    finally:
        gc.collect()  # (what a destruction that ran out of memory left deferred)
        pz.close()


async def test_an_ep_dropped_unclosed_out_of_memory_raises_nothing_from_its_finalizer(ia: Any) -> None:
    """Each allocation of an unclosed EP's collection fails in turn: no exception escapes aiodat's
    finalizers (EP.__del__ made a super object outside its guard: a MemoryError there was reported
    as unraisable, and the ResourceWarning lost), and the EP still warns."""
    _dropped_unclosed_out_of_memory(ia, ia.create_ep, "ep")


async def test_an_rmr_dropped_unclosed_out_of_memory_raises_nothing_from_its_finalizer(ia: Any) -> None:
    """The same for an unclosed RMR: RMR.__del__ calls Handle.__del__ directly, as EP.__del__ does
    (with super().__del__(), the super object's MemoryError escaped; without the call, the
    RMR's unclosed warning was lost)."""
    _dropped_unclosed_out_of_memory(ia, lambda pz: pz.create_rmr(), "rmr")


async def test_an_ep_dropped_unclosed_out_of_memory_leaves_none_of_its_requests_counted(ia: Any) -> None:
    """Each allocation of the collection of an unclosed EP with receives posted fails in turn, its
    LMR's count above 256 (each change of it allocates).  After it (and a collection more, for what
    a failure left to a retry) none of the EP's requests is counted on the LMR, and none was taken
    off twice.  (EP.__del__'s retirement lowered the counts one request at a time: a MemoryError
    part way left the rest counted for good, lmr.free() refused for ever.  Now a retirement that
    raises retires nothing, and the QP's Raw retires them once the QP is gone.)"""
    import os
    import weakref

    package_dir = os.path.dirname(aiodat.__file__) + os.sep
    unraisable: List[str] = []
    pz = ia.create_pz()
    stopped = [0]  # the rounds in which the finalizer's retirement raised
    leaked = 0
    try:
        lmr = pz.register(bytearray(4096))
        holder = ia.create_ep(pz, attrs=aiodat.EPAttr(max_recv_dtos=HIGH))
        holder.post_recv_batch([(lmr[0:64], ("held", i)) for i in range(HIGH)])  # counts above 256
        failures = through = 0
        for n in range(PYTHON_ROUNDS):
            ep = ia.create_ep(pz)
            ep.post_recv_batch([(lmr[64:128], ("round", n, i)) for i in range(3)])
            ep.post_recv(lmr[128:192], ("round", n))
            assert lmr._inflight == HIGH + 4
            real = ep._retire_all

            def observed(real: Any = real) -> None:
                try:
                    real()
                except BaseException:
                    stopped[0] += 1  # (a small int: nothing allocated)
                    raise

            ep._retire_all = observed
            ref = weakref.ref(ep)
            held = [ep]
            del real, observed, ep
            gc.collect()  # earlier garbage first: the failing collection has the EP to itself
            failed, seen = _collected_failing_at(n, held)
            unraisable += _unraisable_from(package_dir, seen)
            failures += failed
            through = 0 if failed else through + 1
            gc.collect()  # what a failure left to a retry
            kept = ref()
            if kept is not None:  # (CPython 3.11 can leak the reference a call that could not
                leaked += 1       # allocate its frame held: the EP was never collected)
                kept.close()
                del kept
            assert lmr._inflight == HIGH, f"allocation {n}, failed: {failed}, retirements stopped: {stopped[0]}"
            if through == THROUGH:
                break
        assert failures and through == THROUGH and stopped[0], (failures, through, stopped[0])
        assert leaked < failures, "every failing round leaked its EP: the finalizers were never tried"
        assert not unraisable, f"{len(unraisable)} raised in aiodat's finalizers; the first:\n{unraisable[0]}"
        holder.close()
        assert lmr._inflight == 0
        lmr.free()
    finally:
        gc.collect()
        pz.close()


async def test_an_rmr_whose_creation_runs_out_of_memory_leaves_no_window(ia: Any) -> None:
    """Each allocation of pz.create_rmr() fails in turn.  One that failed after ibv_alloc_mw lost the
    window: its PD could never be deallocated (EBUSY), so the PZ's close left it deferred for good.
    That took two fixes: the Python object's set-up frees the window when it fails, and the window
    comes back through a cell made before the call (cffi's object for a returned pointer is an
    allocation too, after the window exists).  Now every failed creation has freed its window at
    once, and the PZ closes."""
    import warnings

    from aiodat import _handle

    failures = through = 0
    for n in range(PYTHON_ROUNDS):
        pz = ia.create_pz()
        with warnings.catch_warnings():  # (a creation that got through: its RMR is dropped unclosed)
            warnings.simplefilter("ignore", ResourceWarning)
            error = raised_at(n, pz.create_rmr)
        failures += error is not None
        through = 0 if error is not None else through + 1
        where = "".join(traceback.format_exception(error)) if error is not None else "(no MemoryError)"
        del error  # (its traceback holds the frame of the call)
        gc.collect()  # a successful creation's RMR, dropped: its window goes with it
        pz.close()
        assert pz._raw.ptr == ffi.NULL and not any(r is pz._raw for r in _handle._deferred), \
            f"allocation {n}: the PZ's PD is still held (a memory window leaked); the failure:\n{where}"
        if through == THROUGH:
            break
    assert failures and through == THROUGH
