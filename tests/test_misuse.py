"""Issue 7: the public API under misuse, fuzzed with hypothesis (real rxe).

The rule every test checks: **a call either works or raises a subclass of aiodat.DATError**.
Wrong *values* of any type (str for an int, a bytes object where a writable buffer is needed,
negative or huge lengths and offsets, objects of another PZ or IA, closed objects) are DATErrors
(mostly InvalidParameter / InvalidHandle / InvalidState / LengthError / ProtectionViolation).
The one exception is Python's own argument binding: a wrong *number* of arguments or an unknown
keyword raises TypeError before any aiodat code runs (``test_wrong_arity_is_typeerror``); we do
not wrap that.  Nothing may crash the interpreter, and the module leaves no fd behind
(``test_zz_no_fds_left``, which runs last).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Iterator, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiodat
from aiodat import CompletionFlags, EPAttr, EPState, EvdFlags, Privileges

pytestmark = pytest.mark.rxe

#: examples per fuzzed test: every example is a real call into rdma-core inside a TCG guest
EXAMPLES = int(os.environ.get("AIODAT_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
FUZZ_FEW = settings(max_examples=max(1, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck),
                    database=None)

_FDS_AT_START: List[int] = []


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class World:
    """One IA with a few objects to misuse (module scope: hypothesis runs many examples)."""

    def __init__(self, name: str) -> None:
        self.ia = aiodat.open_ia(name)
        self.other_ia = aiodat.open_ia(name)
        self.pz = self.ia.create_pz()
        self.other_pz = self.ia.create_pz()
        self.foreign_pz = self.other_ia.create_pz()
        self.buf = bytearray(8192)
        self.lmr = self.pz.register(self.buf, Privileges.ALL)
        self.other_lmr = self.other_pz.register(bytearray(4096), Privileges.ALL)
        self.foreign_lmr = self.foreign_pz.register(bytearray(4096), Privileges.ALL)
        self.evd = self.ia.create_evd(16, EvdFlags.DTO)
        self.ep = self.ia.create_ep(self.pz)
        self.closed_pz = self.ia.create_pz()
        self.closed_lmr = self.closed_pz.register(bytearray(64), Privileges.ALL)
        self.closed_lmr.free()
        self.closed_pz.free()

    def close(self) -> None:
        self.ia.close()
        self.other_ia.close()


@pytest.fixture(scope="module")
def world(rdma_device: Any) -> Iterator[World]:
    import gc

    # librdmacm opens its own verbs context of a device (the uverbs fd and its async fd) the
    # first time an rdma_cm id binds to it, and keeps it for the life of the process: let that
    # happen before counting, so the count measures aiodat's fds, whatever ran before.
    with aiodat.open_ia(rdma_device.name) as warm:
        warm.create_psp_any(warm.create_evd(1, aiodat.EvdFlags.CR))
    # likewise libuv's process-wide signal pipe, opened by uvloop's first loop (this file's async
    # tests make it when it runs alone under --aiodat-loop uvloop)
    try:
        import uvloop
    except ImportError:
        pass
    else:
        uvloop.new_event_loop().close()
    gc.collect()
    _FDS_AT_START.append(fd_count())
    w = World(rdma_device.name)
    yield w
    w.close()


@pytest.fixture(scope="module")
def rdma_device() -> Any:
    from aiodat.testing.plugin import _device_or_skip

    return _device_or_skip()


def works_or_daterror(fn: Callable[..., Any], *args: Any, **kw: Any) -> Tuple[bool, Any]:
    """Call ``fn``; (True, result) if it worked, (False, exc) if it raised a DATError; fail otherwise."""
    try:
        return True, fn(*args, **kw)
    except aiodat.DATError as exc:
        assert str(exc), "a DATError without a message"
        return False, exc
    except BaseException as exc:  # noqa: B902 - the point of the test
        pytest.fail(f"{getattr(fn, '__qualname__', fn)}{args!r} raised {type(exc).__name__}: {exc} "
                    "(expected success or a DATError)")


# ---------------------------------------------------------------- strategies

junk = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(), max_size=3),
    st.just(object()), st.just(b"\x00" * 16), st.just(float("inf")),
)
ints = st.one_of(st.integers(min_value=-5, max_value=70000), st.integers(min_value=-(2**66), max_value=2**66),
                 st.sampled_from([0, 1, 4095, 4096, 4097, 8191, 8192, 8193, 2**31, 2**32, 2**63, -1]))
maybe_int = st.one_of(ints, junk)


def segments(w: World) -> st.SearchStrategy:
    good = st.builds(lambda a, b: w.lmr[a:b], st.integers(-10, 9000), st.integers(-10, 9000))
    return st.one_of(
        good, st.lists(good, max_size=40),
        st.just(w.other_lmr[0:16]), st.just(w.foreign_lmr[0:16]), st.just(w.closed_lmr),
        st.just(w.lmr), st.just([w.lmr[0:8], w.foreign_lmr[0:8]]), junk,
        st.tuples(ints, ints, ints),
    )


# ---------------------------------------------------------------- tests


@pytest.mark.loop_independent
@FUZZ
@given(buf=st.one_of(st.binary(max_size=64), st.builds(bytearray, st.integers(0, 100000)),
                     st.builds(lambda n: memoryview(bytearray(n)), st.integers(0, 4096)),
                     st.builds(lambda n: memoryview(bytearray(n)).toreadonly(), st.integers(1, 64)),
                     st.builds(lambda n: memoryview(bytearray(n))[::2], st.integers(2, 64)), junk),
       priv=st.one_of(st.sampled_from(list(Privileges)), st.integers(-3, 2**40), st.none(), junk))
def test_register_fuzz(world: World, buf: Any, priv: Any) -> None:
    ok, lmr = works_or_daterror(world.pz.register, buf, priv)
    if ok:
        assert lmr.length == memoryview(buf).nbytes
        lmr.free()


@pytest.mark.loop_independent
@FUZZ
@given(offset=maybe_int, length=st.one_of(st.none(), maybe_int), a=maybe_int, b=maybe_int)
def test_segments_and_remote_regions_fuzz(world: World, offset: Any, length: Any, a: Any, b: Any) -> None:
    ok, seg = works_or_daterror(world.lmr.segment, offset, length)
    if ok:
        assert 0 <= seg.offset if hasattr(seg, "offset") else True
        assert seg.length <= world.lmr.length
    works_or_daterror(lambda: world.lmr[a:b])
    works_or_daterror(lambda: world.lmr.remote()[a:b])
    works_or_daterror(aiodat.RemoteRegion.from_bytes, b"\x01" * (a % 40) if isinstance(a, int) else a)


def _remote_region(address: Any, length: Any, rmr_context: Any) -> Any:
    """A RemoteRegion made by hand, or None where its fields are refused (a DATError, checked)."""
    ok, region = works_or_daterror(aiodat.RemoteRegion, address, length, rmr_context)
    return region if ok else None


@pytest.mark.loop_independent
@FUZZ
@given(data=st.data(), cookie=junk, flags=st.one_of(st.sampled_from(list(CompletionFlags)), maybe_int))
def test_post_on_unconnected_ep_fuzz(world: World, data: Any, cookie: Any, flags: Any) -> None:
    ep = world.ep
    seg = data.draw(segments(world))
    remote = data.draw(st.one_of(st.just(world.lmr.remote()), st.just(world.lmr.remote()[0:8]), junk,
                                 st.builds(_remote_region, ints, ints, ints)))
    op = data.draw(st.sampled_from(["send", "recv", "write", "read", "fadd", "cswap"]))
    if op == "send":
        works_or_daterror(ep.post_send, seg, cookie, flags)
    elif op == "recv":
        works_or_daterror(ep.post_recv, seg, cookie, flags)
    elif op == "write":
        works_or_daterror(ep.post_rdma_write, seg, remote, cookie, flags)
    elif op == "read":
        works_or_daterror(ep.post_rdma_read, seg, remote, cookie, flags)
    elif op == "fadd":
        works_or_daterror(ep.post_fetch_add, seg, remote, data.draw(maybe_int), cookie)
    else:
        works_or_daterror(ep.post_compare_swap, seg, remote, data.draw(maybe_int), data.draw(maybe_int), cookie)
    assert ep.state is EPState.UNCONNECTED


@pytest.mark.loop_independent
@FUZZ
@given(qlen=maybe_int, streams=st.one_of(st.sampled_from(list(EvdFlags)), maybe_int),
       attrs=st.one_of(st.none(), junk, st.builds(EPAttr, max_recv_dtos=maybe_int, max_request_dtos=maybe_int,
                                                    max_recv_iov=maybe_int, max_rdma_read_in=maybe_int)),
       which_pz=st.sampled_from(["pz", "foreign", "closed", "junk"]), port=maybe_int)
def test_create_fuzz(world: World, qlen: Any, streams: Any, attrs: Any, which_pz: str, port: Any) -> None:
    ok, evd = works_or_daterror(world.ia.create_evd, qlen, streams)
    pz = {"pz": world.pz, "foreign": world.foreign_pz, "closed": world.closed_pz, "junk": qlen}[which_pz]
    ok2, ep = works_or_daterror(world.ia.create_ep, pz, attrs=attrs)
    if ok2:
        ep.free()
    if ok and evd.streams & EvdFlags.CR:
        ok3, psp = works_or_daterror(world.ia.create_psp, port, evd)
        if ok3:
            psp.free()
    if ok:
        evd.free()


@pytest.mark.loop_independent
@FUZZ
@given(name=st.one_of(st.text(max_size=20), junk), qlen=maybe_int)
def test_open_ia_fuzz(name: Any, qlen: Any) -> None:
    ok, ia = works_or_daterror(aiodat.open_ia, name, qlen)
    if ok:
        ia.close()


@pytest.mark.loop_independent
@FUZZ_FEW
@given(order=st.permutations(["ia", "pz", "lmr", "evd", "ep", "psp", "cr_evd", "rmr"]),
       after=st.sampled_from(["query", "free", "register", "post", "segment"]))
def test_free_in_any_order_then_use(rdma_device: Any, order: List[str], after: str) -> None:
    """Free a whole tree in every order (children before or after parents): each free works or is a
    DATError, and any use afterwards raises InvalidHandle, never a crash."""
    ia = aiodat.open_ia(rdma_device.name)
    objs = {"ia": ia}
    objs["pz"] = ia.create_pz()
    objs["lmr"] = objs["pz"].register(bytearray(4096), Privileges.ALL)
    objs["evd"] = ia.create_evd(8)
    objs["cr_evd"] = ia.create_evd(8, EvdFlags.CR)
    objs["ep"] = ia.create_ep(objs["pz"], recv_evd=objs["evd"])
    objs["psp"] = ia.create_psp_any(objs["cr_evd"])
    objs["rmr"] = objs["pz"].create_rmr()
    try:
        for name in order:
            obj = objs[name]
            works_or_daterror(obj.close if name == "ia" else obj.free)
    finally:
        ia.close()
    for name, obj in objs.items():
        assert obj.closed, name
        use = {
            "query": lambda o: o.query(),
            "free": lambda o: (o.close if o is ia else o.free)(),
            "register": lambda o: objs["pz"].register(bytearray(8)),
            "post": lambda o: objs["ep"].post_recv(objs["lmr"][0:8]),
            "segment": lambda o: objs["lmr"].segment(0, 8),
        }[after]
        if after == "query" and not hasattr(obj, "query"):
            continue  # (a PZ has no query)
        ok, exc = works_or_daterror(use, obj)
        if after != "free":
            assert not ok and isinstance(exc, aiodat.InvalidHandle), (name, after, exc)


@pytest.mark.loop_independent
def test_wrong_arity_is_typeerror(world: World) -> None:
    """Python's argument binding, not aiodat: the documented exception to the DATError rule."""
    with pytest.raises(TypeError):
        world.pz.register()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        world.ep.post_send(world.lmr[0:8], None, CompletionFlags.NONE if hasattr(CompletionFlags, "NONE") else 0,
                           "extra", "args")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        world.ia.create_evd(8, bogus_keyword=1)  # type: ignore[call-arg]


# ---------------------------------------------------------------- connection misuse (async)


async def test_connection_misuse(rdma_device: Any) -> None:
    """Oversized private data, posting on unconnected EPs, double accept, accept after reject,
    reject twice, connect twice, disconnect when not connected: each is a DATError, and the
    objects still work afterwards (a proper connection is made at the end)."""
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pz = ia.create_pz()
        lmr = pz.register(bytearray(4096), Privileges.ALL)
        cr_evd = ia.create_evd(8, EvdFlags.CR)
        psp = ia.create_psp_any(cr_evd)
        client = ia.create_ep(pz)
        server = ia.create_ep(pz)
        for bad in (b"x" * 100_000, b"x" * 257, "text", 42):
            ok, _ = works_or_daterror(client.connect_nowait, psp.address, psp.port, bad)
            assert not ok, bad
        assert client.state is EPState.UNCONNECTED
        ok, _ = works_or_daterror(client.post_send, lmr[0:8], "unconnected")
        assert not ok
        ok, _ = works_or_daterror(client.post_rdma_write, lmr[0:8], lmr.remote()[0:8])
        assert not ok
        ok, _ = works_or_daterror(client.disconnect_nowait)
        assert not ok
        for bad_host, bad_port in (("not an address", psp.port), (psp.address, -1), (psp.address, 70000),
                                   (None, psp.port), (psp.address, "port"), ([psp.address], psp.port),
                                   (psp.address, [psp.port]), (psp.address, True)):
            ok, _ = works_or_daterror(client.connect_nowait, bad_host, bad_port)
            assert not ok
        # reject, then misuse that CR
        connecting = asyncio.ensure_future(client.connect(psp.address, psp.port, timeout=30))
        ev = await cr_evd.wait_one(timeout=30)
        ok, _ = works_or_daterror(ev.cr.reject, b"y" * 100_000)
        if not ok:
            ev.cr.reject()
        assert not works_or_daterror(ev.cr.reject)[0]
        assert not works_or_daterror(ev.cr.accept_nowait, server)[0]
        with pytest.raises(aiodat.ConnectionRejected):
            await connecting
        client.reset() if client.state is not EPState.UNCONNECTED else None
        # accept twice, and with a wrong EP
        client2 = ia.create_ep(pz)
        connecting = asyncio.ensure_future(client2.connect(psp.address, psp.port, timeout=30))
        ev = await cr_evd.wait_one(timeout=30)
        assert not works_or_daterror(ev.cr.accept_nowait, "not an ep")[0]
        assert not works_or_daterror(ev.cr.accept_nowait, server, b"z" * 100_000)[0]
        await ev.cr.accept(server, timeout=30)
        assert not works_or_daterror(ev.cr.accept_nowait, server)[0]
        assert not works_or_daterror(ev.cr.reject)[0]
        await connecting
        assert not works_or_daterror(client2.connect_nowait, psp.address, psp.port)[0]
        # the connection works despite all that
        server.post_recv(lmr[0:8], "r")
        lmr.memoryview()[100:108] = b"survived"
        client2.post_send(lmr[100:108], "s")
        (await server.recv_evd.wait_one(timeout=30)).raise_for_status()
        assert bytes(lmr.memoryview()[0:8]) == b"survived"
        await client2.disconnect(timeout=30)
    finally:
        ia.close()


# ---------------------------------------------------------------- misuse around the C fast paths


async def test_the_post_fast_paths_refuse_a_freed_ep_or_lmr(rdma_device: Any) -> None:
    """A one-segment post_send/post_recv (the C hot path of _shim/posts.c) on a freed EP, or of a
    Segment whose LMR was freed, raises InvalidHandle naming the object, and posts nothing."""
    from aiodat.testing.plugin import make_ep_pair

    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = await make_ep_pair(ia)
        seg, server_seg = pair.client_lmr[0:8], pair.server_lmr[0:8]
        pair.server_lmr.free()
        for call in (pair.server.post_send, pair.server.post_recv):
            for segments in (server_seg, [server_seg]):
                with pytest.raises(aiodat.InvalidHandle, match="lmr"):
                    call(segments)
        assert not pair.server._send_q and not pair.server._recv_q
        pair.client.free()
        for call in (pair.client.post_send, pair.client.post_recv):
            for segments in (seg, [seg]):
                with pytest.raises(aiodat.InvalidHandle, match="ep"):
                    call(segments)
        assert pair.client_lmr._inflight == 0
    finally:
        ia.close()


async def test_a_hand_built_segment_is_checked_like_lmr_segment(rdma_device: Any) -> None:
    """aiodat.Segment is public: one made by hand with a foreign object for its LMR, a non-int, a
    negative offset or length, or bytes past the region is refused where it is made (InvalidParameter
    or LengthError naming what), never a raw OverflowError or AttributeError from a post, nor a
    posted request the device fails.  One made right posts and moves its bytes."""
    from aiodat import LengthError, Segment
    from aiodat.testing.plugin import make_ep_pair

    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = await make_ep_pair(ia)
        lmr = pair.client_lmr
        for args, error, words in (((object(), 0, 1), aiodat.InvalidParameter, "must be an LMR"),
                                   ((lmr, "0", 8), aiodat.InvalidParameter, "must be ints"),
                                   ((lmr, 0, True), aiodat.InvalidParameter, "must be ints"),
                                   ((lmr, -1, 8), LengthError, "outside the LMR"),
                                   ((lmr, 0, -1), LengthError, "outside the LMR"),
                                   ((lmr, 0, 2**40), LengthError, "outside the LMR"),
                                   ((lmr, lmr.length, 1), LengthError, "outside the LMR")):
            with pytest.raises(error, match=words):
                Segment(*args)
        assert not pair.client._send_q and lmr._inflight == 0
        lmr.memoryview()[0:8] = b"by hand!"
        pair.server.post_recv(pair.server_lmr[0:8])
        pair.client.post_send(Segment(lmr, 0, 8))
        assert (await pair.server.recv_evd.wait_one(timeout=10)).ok
        assert bytes(pair.server_lmr.memoryview()[0:8]) == b"by hand!"
    finally:
        ia.close()


async def test_a_bad_wait_timeout_is_refused_and_leaves_the_evd_free(rdma_device: Any) -> None:
    """NaN, or an int no float holds, is an InvalidParameter, not a wait that keeps the EVD for
    ever (the deadline failed after the wait had taken the EVD: every later wait was refused with
    InvalidState) or, on uvloop, a ValueError from its timer.  inf still waits for ever."""
    from aiodat.testing.plugin import make_ep_pair

    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = await make_ep_pair(ia)
        evd = pair.server.recv_evd
        for bad in (float("nan"), 10**400, -10**400, 10**5000, True, False):  # (10**5000: too long for repr)
            with pytest.raises(aiodat.InvalidParameter, match="timeout"):
                await evd.wait(timeout=bad)
            assert not evd.query().waiting
        with pytest.raises(aiodat.InvalidParameter, match="threshold must be .* got an int of 16610 bits"):
            await evd.wait(10**5000)
        forever = asyncio.ensure_future(evd.wait(timeout=float("inf")))
        await asyncio.sleep(0.05)
        assert not forever.done() and evd.query().waiting
        forever.cancel()
        await asyncio.gather(forever, return_exceptions=True)
        pair.server.post_recv(pair.server_lmr[0:8], "r")
        pair.client.post_send(pair.client_lmr[0:8], "s")
        (ev,) = await evd.wait(timeout=30)
        assert ev.ok and ev.cookie == "r"
    finally:
        ia.close()


async def test_a_callback_raising_cancelled_error_does_not_deafen_its_evd(rdma_device: Any,
                                                                         loop_errors: List[dict]) -> None:
    """A callback that raises CancelledError (a BaseException: say it called result() on a
    cancelled Future) is reported to the loop's exception handler with its EVD, as any exception
    of a callback, and delivery goes on.  It used to escape the channel's wake-up (or the poller's
    turn), leaving the CQ unarmed with nobody polling it: no completion was delivered again."""
    from aiodat.testing.plugin import make_ep_pair

    errors = loop_errors
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = await make_ep_pair(ia)
        got: List[Any] = []

        def on_events(events: List[Any]) -> None:
            got.extend(events)
            raise asyncio.CancelledError("from the callback")

        pair.server.recv_evd.set_callback(on_events)
        for i in range(3):
            pair.server.post_recv(pair.server_lmr[8 * i:8 * i + 8], i)
        for i in range(3):
            pair.client.post_send(pair.client_lmr[0:8], i)
            for _ in range(3000):  # each message is delivered, whichever path delivered the one before
                if len(got) > i:
                    break
                await asyncio.sleep(0.01)
            assert [ev.cookie for ev in got] == list(range(i + 1)), (i, got, errors)
            await asyncio.sleep(0.05 * i)  # the second send while the poller may hold the CQ, the third later
        assert len(errors) == 3 and all(isinstance(c.get("exception"), asyncio.CancelledError)
                                        and c.get("evd") is pair.server.recv_evd for c in errors), errors
        errors.clear()  # (expected: the fixture fails a test that leaves errors)
    finally:
        ia.close()


def test_a_callback_raising_systemexit_leaves_its_cq_polled(rdma_device: Any, aiodat_loop: str) -> None:
    """SystemExit (as KeyboardInterrupt) raised by an EVD callback goes on up out of the loop, as
    from any loop callback, both from the channel's wake-up and from the poller's turn (both C);
    and the EVD is not left deaf: when the loop runs again, the next completion is delivered.  The
    wake-up used to leave the CQ unarmed and handed to nobody, and the poller's turn swallowed it."""
    import sys

    from aiodat.testing.plugin import _loop_factory, make_ep_pair

    loop = _loop_factory(aiodat_loop)()
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = loop.run_until_complete(make_ep_pair(ia))
        got: List[Any] = []
        raised_from: List[str] = []

        def on_events(events: List[Any]) -> None:
            got.extend(events)
            for ev in events:
                if ev.cookie in (0, 2):
                    frame, names = sys._getframe(1), set()
                    while frame is not None:
                        names.add(frame.f_code.co_name)
                        frame = frame.f_back
                    raised_from.append("poller" if "_turn" in names else "wake-up" if "_on_readable" in names
                                       else "other")
                    raise SystemExit("from the callback")
                if ev.cookie == 1:  # the next message while the poller holds the CQ: its turn delivers it
                    loop.call_soon(pair.client.post_send, pair.client_lmr[0:8], 2)

        async def until(n: int) -> None:
            for _ in range(3000):
                if len(got) >= n:
                    return
                await asyncio.sleep(0.01)

        async def start() -> None:
            pair.server.recv_evd.set_callback(on_events)
            for i in range(4):
                pair.server.post_recv(pair.server_lmr[8 * i:8 * i + 8], i)
            await asyncio.sleep(0.2)  # the CQ idle and armed: the first message wakes the channel
            pair.client.post_send(pair.client_lmr[0:8], 0)
            await until(1)

        for step in (start(), until(3)):
            with pytest.raises(SystemExit, match="from the callback"):
                loop.run_until_complete(step)
            step.close()  # (left unfinished by the exit: closed, so nothing warns it was never awaited)
            if len(got) == 1:
                pair.client.post_send(pair.client_lmr[0:8], 1)
        assert raised_from == ["wake-up", "poller"], raised_from
        pair.client.post_send(pair.client_lmr[0:8], 3)
        loop.run_until_complete(until(4))
        assert [ev.cookie for ev in got] == [0, 1, 2, 3], got
    finally:
        ia.close()
        loop.close()


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"),
                    reason="a wait spins only where Task.cancelling exists (Python 3.11+)")
async def test_a_wait_in_a_task_being_cancelled_still_holds_the_evd(
        rdma_device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that waits while it is being cancelled (its clean-up awaits the EVD, or it swallowed
    the cancel) still waits: the EVD says so and refuses a second waiter, and the wait gets the
    next event.  On a CQ the poller holds, such a wait used to spin and count as gone (its task is
    cancelled): a second wait took the EVD, and the first was never woken, its timeout with it."""
    import aiodat.poller
    from aiodat.testing.plugin import make_ep_pair

    monkeypatch.setattr(aiodat.poller, "IDLE_TURNS", 1000)  # the CQ stays with the poller throughout
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = await make_ep_pair(ia)
        evd = pair.server.recv_evd
        pair.server.post_recv(pair.server_lmr[0:8], "warm")
        waiter = asyncio.ensure_future(evd.wait(timeout=30))
        await asyncio.sleep(0)  # it sleeps, its CQ armed: the completion wakes it through the channel,
        pair.client.post_send(pair.client_lmr[0:8])  # whose wake-up leaves the CQ with the poller
        (ev,) = await waiter
        assert ev.cookie == "warm" and evd._unarmed  # the CQ is with the loop's poller: waits would spin
        cleaning = asyncio.Event()

        async def cancelled_then_cleans_up() -> List[Any]:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cleaning.set()
                return await evd.wait(timeout=30)  # the clean-up: the last completion
            raise AssertionError("not cancelled")

        task = asyncio.ensure_future(cancelled_then_cleans_up())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait_for(cleaning.wait(), 30)
        await asyncio.sleep(0)
        assert evd.query().waiting and not task.done()
        with pytest.raises(aiodat.InvalidState, match="already waiting"):
            await asyncio.wait_for(evd.wait(timeout=30), 30)
        pair.server.post_recv(pair.server_lmr[0:8], "last")
        pair.client.post_send(pair.client_lmr[0:8])
        (ev,) = await asyncio.wait_for(task, 30)
        assert ev.ok and ev.cookie == "last"
        assert not evd.query().waiting
    finally:
        ia.close()


@pytest.mark.parametrize("what", ["ia.close", "ep.free"])
async def test_a_callback_may_close_its_ia_or_free_its_ep(rdma_device: Any, what: str, monkeypatch: pytest.MonkeyPatch,
                                                          loop_errors: List[dict]) -> None:
    """Inside a callback, first from the channel's wake-up and then from the poller's turn (both
    C: _completions.wakeup and turn), the callback frees its own EP (and so its EVD) or closes the
    IA: nothing reaches the loop's exception handler, the callback is not called again, and a post
    through the fast path then raises InvalidHandle."""
    import aiodat.poller
    from aiodat.testing.plugin import make_ep_pair

    monkeypatch.setattr(aiodat.poller, "IDLE_TURNS", 1000)  # the later batches come in the poller's turns
    errors = loop_errors
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pair = await make_ep_pair(ia)
        evd, got = pair.server.recv_evd, []

        def on_events(events: List[Any]) -> None:
            got.extend(ev.cookie for ev in events)
            if len(got) >= 2:
                ia.close() if what == "ia.close" else pair.server.free()

        evd.set_callback(on_events)
        for i in range(4):
            pair.server.post_recv(pair.server_lmr[8 * i:8 * i + 8], i)
        pair.client.post_send(pair.client_lmr[0:8])
        for _ in range(3000):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [0] and evd in evd._poller._hot  # the first by the wake-up; the CQ now with the poller
        if what == "ep.free":
            pair.client.post_send(pair.client_lmr[0:8])
            pair.client.post_send(pair.client_lmr[0:8])
        else:
            pair.client.post_send_batch([(pair.client_lmr[0:8], None)] * 2)
        for _ in range(100):
            await asyncio.sleep(0.01)
        assert got in ([0, 1], [0, 1, 2]) and evd.closed and pair.server.closed, got
        with pytest.raises(aiodat.InvalidHandle):
            pair.server.post_recv(pair.server_lmr[0:8])
        assert not errors, errors
    finally:
        ia.close()


def test_zz_no_fds_left(world: World) -> None:
    """Runs last: after everything above, closing the module's IAs leaves no fd open."""
    import gc

    world.close()
    gc.collect()
    assert _FDS_AT_START and fd_count() <= _FDS_AT_START[0], (fd_count(), _FDS_AT_START)

