"""The stream transport's steps in C (``Receiver`` and ``Sender``, aiodat/_shim/streamcore.c), host-only.

The Receiver is the stream EVD's callback (``on_events``) and takes a received DATA message from
its completion to the protocol's ``data_received``, the slot's re-post and the credit owed; the
Sender takes a small write to its post and schedules the flush; anything else goes back to the
transport's Python, which both reach through a weak reference (``owner``).  Here they are driven
with real StreamCores and real completion events (``aiodat.evd.DTOCompletionEvent``); the posts
are recording callables in place of the EP's ``post_recv``/``post_send``, and the owner records
what was left to the transport's Python (no device: the streams tests on rxe run the same steps
against a real EP and transport).  Each case checks what the step did, or that it changed
nothing.
"""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any, List, Optional, Tuple

import pytest

from aiodat._shim._streamcore import Receiver, Sender
from aiodat.errors import DATError, InvalidHandle
from aiodat.evd import DTOCompletionEvent
from aiodat.streams.protocol import HEADER, MSG_DATA, MSG_EOF, FLAG_RELEASE, PeerParams, StreamConfig, StreamCore

SIZE = 64


class Protocol:
    def __init__(self, fail: Optional[BaseException] = None) -> None:
        self.got: List[Any] = []
        self.fail = fail
        self.during: Any = None  # called inside data_received

    def data_received(self, data: Any) -> None:
        self.got.append(bytes(data) if isinstance(data, memoryview) else data)
        self.kinds = type(data)
        if self.during is not None:
            self.during()
        if self.fail is not None:
            raise self.fail


def not_hot(*args: Any) -> int:
    """The EP's C hot path (aiodat._shim._posts) saying it does not take the post: the EP's method does."""
    return -1


class Owner:
    """What the Receiver and the Sender reach of the transport (``owner()``): its protocol and
    flags, and the Python methods they leave the other cases to, recorded here."""

    def __init__(self, protocol: Any = None) -> None:
        self._protocol = protocol
        self._lost = False
        self._protocol_paused = False
        self._idle: Any = None
        self.calls: List[Tuple[Any, ...]] = []
        self.core: Any = None  # for _flush: what it finds buffered

    def _on_events(self, events: List[Any], start: int) -> None:
        self.calls.append(("_on_events", events[start:]))

    def _batch_failed(self, exc: BaseException) -> None:
        self.calls.append(("_batch_failed", exc))

    def _flush(self) -> None:
        self.calls.append(("_flush", self.core.buffered if self.core is not None else None))

    def _post_failed(self, exc: BaseException) -> None:
        self.calls.append(("_post_failed", exc))

    def _after_flush(self) -> None:
        self.calls.append(("_after_flush",))


class Stream:
    """A core, its arena of receive slots and a Receiver, as RdmaTransport builds them."""

    def __init__(self, as_view: bool = True, protocol: Optional[Protocol] = None) -> None:
        cfg = StreamConfig(recv_depth=4, buffer_size=SIZE, window_size=0).validate()
        self.core = StreamCore(cfg, PeerParams(4, SIZE, None))
        self.arena = bytearray(SIZE * cfg.slots)
        self.view = memoryview(self.arena)
        self.protocol = protocol or Protocol()
        self.owner = Owner(self.protocol)
        self.owner.core = self.core
        self.reposts: List[Tuple[Any, Any]] = []
        self.post_error: Optional[BaseException] = None
        self.segs = [f"seg{i}" for i in range(cfg.slots)]
        self.cookies = [("r", i) for i in range(cfg.slots)]
        self._qp_address = 0  # (this object is the Receiver's EP too: its post_recv records)
        self.soon: List[Any] = []  # what the Sender's call_soon got
        self.sender = Sender(self.core, bytearray(2 * SIZE * cfg.slots), SIZE * cfg.slots, SIZE, self, not_hot, [],
                             [], lambda *a: None, 1, 0, weakref.ref(self.owner), self.soon.append, DATError)
        self.receiver = Receiver(self.core, self.arena, self.view, SIZE, weakref.ref(self.owner), as_view,
                                 self, not_hot, self.segs, self.cookies, DTOCompletionEvent, DATError, self.sender)

    def post_recv(self, seg: Any, cookie: Any) -> None:
        if self.post_error is not None:
            raise self.post_error
        self.reposts.append((seg, cookie))

    def arrive(self, slot: int, payload: bytes, mtype: int = MSG_DATA, flags: int = 0, credits: int = 0,
               cookie: Any = None, status: str = "IBV_WC_SUCCESS") -> DTOCompletionEvent:
        wire = HEADER.pack(mtype, flags, credits, len(payload)) + payload
        self.arena[slot * SIZE:slot * SIZE + len(wire)] = wire
        return DTOCompletionEvent._completed(None, None, ("r", slot) if cookie is None else cookie,  # type: ignore
                                             status, len(wire), None, None, 0, None, True)

    def state(self) -> Any:
        return (self.core.credits, self.core.owed, dict(self.core.stats), list(self.reposts), list(self.protocol.got))


@pytest.mark.parametrize("as_view", [True, False])
def test_a_data_message_goes_to_the_protocol_and_its_slot_is_reposted(as_view: bool) -> None:
    s = Stream(as_view=as_view)
    s.core.write(b"x")  # take a credit, so the message can return one
    assert s.core.take_data(bytearray(SIZE * s.core.nslots), 0, SIZE) is not None
    assert s.receiver.receive(s.arrive(2, b"hello", credits=1)) is True
    assert s.protocol.got == [b"hello"] and s.protocol.kinds is (memoryview if as_view else bytes)
    assert s.reposts == [("seg2", ("r", 2))]
    assert s.core.credits == 4 and s.core.owed == 1 and s.core.stats["bytes_received"] == 5
    assert s.receiver.delivered and not s.receiver.protocol_failed


def test_anything_else_is_left_to_the_python_path_unchanged() -> None:
    s = Stream()
    before = s.state()
    others = [
        s.arrive(0, b"", mtype=MSG_EOF),  # not DATA
        s.arrive(0, b"hi", flags=FLAG_RELEASE),  # a release to take
        s.arrive(0, b"hi", cookie=("s", 0)),  # a send's completion
        s.arrive(0, b"hi", cookie="foreign"),  # a request the stream did not post
        s.arrive(0, b"hi", cookie=("r", 99)),  # no such slot
        s.arrive(0, b"hi", cookie=("r", 2 ** 80)),
        s.arrive(0, b"hi", status="IBV_WC_WR_FLUSH_ERR"),  # failed
        s.arrive(0, b"hi", credits=9),  # credits the peer never had: on_received names the error
    ]
    for event in others:
        assert s.receiver.receive(event) is False
    assert s.receiver.receive(object()) is False  # not a completion (a connection event, say)
    s.core.pause_reading()
    assert s.receiver.receive(s.arrive(0, b"hi")) is False  # paused: the Python path holds it
    s.core.resume_reading()
    s.receiver.open = False  # the transport is closing
    assert s.receiver.receive(s.arrive(0, b"hi")) is False
    assert s.state() == before and not s.receiver.delivered


def test_a_raising_data_received_propagates_and_leaves_the_slot_unposted() -> None:
    s = Stream(protocol=Protocol(fail=ValueError("app bug")))
    with pytest.raises(ValueError, match="app bug"):
        s.receiver.receive(s.arrive(1, b"hi"))
    assert s.receiver.protocol_failed and s.reposts == [] and s.core.owed == 0
    s.protocol.fail = None
    assert s.receiver.receive(s.arrive(0, b"ok")) is True and not s.receiver.protocol_failed  # (reset per call)


def test_a_failed_repost_is_the_connections_end_and_owes_nothing() -> None:
    s = Stream()
    s.post_error = InvalidHandle("the EP was freed")
    assert s.receiver.receive(s.arrive(0, b"hi")) is True  # handed over; the end comes by its event
    assert s.protocol.got == [b"hi"] and s.core.owed == 0
    s.post_error = RuntimeError("not a DAT error")
    with pytest.raises(RuntimeError):
        s.receiver.receive(s.arrive(1, b"hi"))
    assert not s.receiver.protocol_failed  # the transport tells the two apart


def test_a_connection_ended_inside_data_received_is_not_reposted() -> None:
    s = Stream()
    s.protocol.during = lambda: setattr(s.receiver, "alive", False)  # as the transport's abort() does
    assert s.receiver.receive(s.arrive(0, b"hi")) is True
    assert s.protocol.got == [b"hi"] and s.reposts == [] and s.core.owed == 0


def test_the_protocol_is_looked_up_per_message() -> None:
    s = Stream()
    other = Protocol()
    s.protocol.data_received = other.data_received  # type: ignore[method-assign]  (rebound)
    assert s.receiver.receive(s.arrive(0, b"a")) is True and other.got == [b"a"]
    third = Protocol()
    s.owner._protocol, s.receiver.as_view = third, False  # set_protocol()
    assert s.receiver.receive(s.arrive(1, b"b")) is True and third.got == [b"b"] and third.kinds is bytes
    s.owner._protocol = None
    with pytest.raises(AttributeError, match="data_received"):
        s.receiver.receive(s.arrive(2, b"c"))
    assert s.receiver.protocol_failed


def test_a_batch_taken_whole_schedules_the_flush_once() -> None:
    s = Stream()
    s.receiver.on_events([s.arrive(0, b"one"), s.arrive(1, b"two")])
    assert s.protocol.got == [b"one", b"two"] and len(s.reposts) == 2 and s.receiver.delivered
    assert s.owner.calls == []  # nothing for the transport's Python
    assert len(s.soon) == 1 and s.sender.scheduled  # the flush, after the woken reader
    s.receiver.on_events([s.arrive(2, b"three")])
    assert len(s.soon) == 1  # already scheduled
    s.soon[0]()  # the scheduled flush: nothing buffered, so the transport's _flush looks
    assert not s.sender.scheduled and s.owner.calls == [("_flush", 0)]


def test_what_data_received_writes_is_flushed_at_once() -> None:
    s = Stream()
    s.protocol.during = lambda: s.core.write(b"reply")
    s.receiver.on_events([s.arrive(0, b"request")])
    assert s.owner.calls == [("_flush", 5)] and len(s.soon) == 1


def test_the_rest_of_a_batch_goes_to_the_transports_python() -> None:
    s = Stream()
    eof, after = s.arrive(1, b"", mtype=MSG_EOF), s.arrive(2, b"later")
    s.receiver.on_events([s.arrive(0, b"first"), eof, after])
    assert s.protocol.got == [b"first"] and s.receiver.delivered  # (delivered tells _handle)
    assert s.owner.calls == [("_on_events", [eof, after])] and s.soon == []
    s.owner.calls.clear()
    s.receiver.on_events([])  # nothing delivered: a flush now, as _handle does
    assert s.owner.calls == [("_flush", 0)] and not s.receiver.delivered


def test_a_raising_data_received_goes_to_batch_failed() -> None:
    s = Stream(protocol=Protocol(fail=ValueError("app bug")))
    s.receiver.on_events([s.arrive(0, b"hi"), s.arrive(1, b"never")])
    (what, exc), = s.owner.calls
    assert what == "_batch_failed" and isinstance(exc, ValueError) and s.receiver.protocol_failed
    assert exc.__traceback__ is not None and s.protocol.got == [b"hi"] and s.soon == []

    # as asyncio's transports: any exception is the stream's, a CancelledError too ...
    s = Stream(protocol=Protocol(fail=asyncio.CancelledError()))
    s.receiver.on_events([s.arrive(0, b"hi")])
    (what, exc), = s.owner.calls
    assert what == "_batch_failed" and isinstance(exc, asyncio.CancelledError)
    # ... but SystemExit and KeyboardInterrupt, which propagate
    s = Stream(protocol=Protocol(fail=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        s.receiver.on_events([s.arrive(0, b"hi")])
    assert s.owner.calls == []


def test_a_lost_or_collected_transport_takes_nothing() -> None:
    s = Stream()
    s.receiver.alive = False
    before = s.state()
    assert s.receiver.on_events([s.arrive(0, b"hi")]) is None
    assert s.state() == before and s.owner.calls == [] and s.soon == []
    s = Stream()
    before = s.state()
    del s.owner
    gc.collect()
    assert s.receiver.on_events([s.arrive(0, b"hi")]) is None and s.receiver.receive(s.arrive(0, b"hi")) is False
    assert s.state() == before
    with pytest.raises(TypeError, match="list"):
        s.receiver.on_events((s.arrive(0, b"hi"),))


def test_bad_construction_is_refused() -> None:
    s = Stream()
    good = [s.core, s.arena, s.view, SIZE, weakref.ref(s.owner), True, s, not_hot, s.segs, s.cookies,
            DTOCompletionEvent, DATError, s.sender]
    for index, bad in ((0, object()), (1, bytes(10)), (3, 8), (4, s.owner), (7, None), (8, tuple(s.segs)),
                       (10, "type"), (12, object())):
        args = list(good)
        args[index] = bad
        with pytest.raises(TypeError, match="Receiver"):
            Receiver(*args)
    with pytest.raises(TypeError):
        Receiver(*good[:5])
    with pytest.raises(TypeError, match="positional"):
        Receiver(*good, extra=1)


class Seg:
    def __init__(self, slot: int, length: int) -> None:
        self.slot, self.length = slot, length


class Writer:
    """A core, its arena of send slots and a Sender, as RdmaTransport builds them."""

    SIGNALLED, SUPPRESS = "signalled", "suppress"

    def __init__(self) -> None:
        cfg = StreamConfig(recv_depth=4, buffer_size=SIZE, window_size=0).validate()
        self.core = StreamCore(cfg, PeerParams(4, SIZE, None))
        self.base = SIZE * cfg.slots  # the send slots follow the receive slots, as in the transport's arena
        self.arena = bytearray(2 * SIZE * cfg.slots)
        self.segs: List[Any] = [Seg(i, HEADER.size) for i in range(cfg.slots)]
        self.cookies = [("s", i) for i in range(cfg.slots)]
        self.posts: List[Tuple[Any, Any, Any]] = []
        self.made: List[Tuple[int, int]] = []
        self.post_error: Optional[BaseException] = None
        self.owner = Owner()
        self.owner.core = self.core
        self.soon: List[Any] = []  # what call_soon got
        self._qp_address = 0  # (this object is the Sender's EP too: its post_send records)
        self.sender = Sender(self.core, self.arena, self.base, SIZE, self, not_hot, self.segs, self.cookies,
                             self.slot_segment, self.SIGNALLED, self.SUPPRESS, weakref.ref(self.owner),
                             self.soon.append, DATError)

    def post_send(self, seg: Any, cookie: Any, flags: Any) -> None:
        if self.post_error is not None:
            raise self.post_error
        self.posts.append((seg, cookie, flags))

    def slot_segment(self, slot: int, wire: int) -> Any:
        self.made.append((slot, wire))
        seg = self.segs[slot] = Seg(slot, wire)
        return seg

    def wire(self, slot: int, length: int) -> bytes:
        at = self.base + slot * SIZE
        return bytes(self.arena[at:at + length])


def test_a_small_write_is_copied_into_its_slot_and_posted() -> None:
    w = Writer()
    w.core.write(b"hello")
    assert w.sender.flush() is True
    (seg, cookie, flags), = w.posts
    assert (seg.slot, seg.length, cookie) == (0, HEADER.size + 5, ("s", 0)) and w.made == [(0, 13)]
    assert flags == w.SUPPRESS  # one send in many is signalled (StreamCore's rule)
    assert w.wire(0, 13) == HEADER.pack(MSG_DATA, 0, 0, 5) + b"hello"
    assert w.core.credits == 3 and w.core.buffered == 0 and w.core.stats["data_msgs"] == 1
    w.core.on_send_complete(("s", 0))  # (slot 0 is free again, and next in line)
    w.core.write(b"world")  # the same length again: the slot's Segment is reused
    assert w.sender.flush() is True and w.made == [(0, 13)] and w.posts[-1][0] is seg


def test_anything_else_is_left_to_next_send_unchanged() -> None:
    w = Writer()
    assert w.sender.flush() is False  # nothing pending
    w.core.write(b"x" * (SIZE - HEADER.size + 1))  # more than one DATA message holds
    assert w.sender.flush() is False
    w.core.write_eof()  # EOF due
    assert w.sender.flush() is False
    assert w.posts == [] and w.core.credits == 4 and w.core.buffered == SIZE - HEADER.size + 1


def test_a_failed_post_propagates_with_the_send_committed() -> None:
    w = Writer()
    w.post_error = InvalidHandle("the EP was freed")
    w.core.write(b"hi")
    with pytest.raises(InvalidHandle):
        w.sender.flush()
    assert w.core.buffered == 0 and w.core.credits == 3  # as the Python path left it: the stream ends


def test_the_sender_refuses_bad_construction() -> None:
    w = Writer()
    good = [w.core, w.arena, w.base, SIZE, w, not_hot, w.segs, w.cookies, w.slot_segment, 1, 0,
            weakref.ref(w.owner), w.soon.append, DATError]
    for index, bad in ((0, object()), (1, bytes(8)), (2, -1), (3, 8), (5, None), (6, ()), (8, None), (11, w.owner),
                       (12, None)):
        args = list(good)
        args[index] = bad
        with pytest.raises(TypeError, match="Sender"):
            Sender(*args)
    with pytest.raises(TypeError, match="positional"):
        Sender(*good, extra=1)


def test_writes_of_one_iteration_schedule_one_flush_which_posts_them_together() -> None:
    w = Writer()
    assert w.sender.write(b"hel") == 3 and w.sender.write(b"lo") == 5
    assert len(w.soon) == 1 and w.sender.scheduled and w.posts == []
    w.soon[0]()
    (seg, cookie, flags), = w.posts
    assert w.wire(0, 13) == HEADER.pack(MSG_DATA, 0, 0, 5) + b"hello" and not w.sender.scheduled
    assert w.owner.calls == []  # posted, nobody paused or waiting: no Python at all
    with pytest.raises(TypeError):
        w.sender.write(bytearray(b"x"))  # (the transport's write() passes bytes only)
    assert w.sender.scheduled is False and len(w.soon) == 1


def test_the_scheduled_flush_leaves_the_rest_to_the_transport() -> None:
    w = Writer()
    w.owner._protocol_paused = True
    w.sender.write(b"hi")
    w.soon[-1]()
    assert len(w.posts) == 1 and w.owner.calls == [("_after_flush",)]  # resume the paused protocol
    w.owner.calls.clear()
    w.owner._protocol_paused, w.owner._idle = False, object()  # close() waits for the sends
    w.sender.write(b"hi")
    w.soon[-1]()
    assert len(w.posts) == 2 and w.owner.calls == [("_after_flush",)]
    w.owner.calls.clear()
    w.core.write_eof()  # not the C case: the transport's _flush
    w.sender.schedule()
    w.soon[-1]()
    assert w.owner.calls == [("_flush", 0)] and len(w.posts) == 2


def test_a_failed_scheduled_post_goes_to_post_failed_and_other_errors_propagate() -> None:
    w = Writer()
    w.post_error = InvalidHandle("the EP was freed")
    w.sender.write(b"hi")
    w.soon[-1]()
    (what, exc), = w.owner.calls
    assert what == "_post_failed" and exc is w.post_error
    w.post_error = RuntimeError("not a DAT error")
    w.sender.write(b"hi")
    with pytest.raises(RuntimeError):
        w.soon[-1]()
    assert len(w.owner.calls) == 1 and not w.sender.scheduled


def test_a_lost_or_collected_transport_flushes_nothing() -> None:
    w = Writer()
    w.sender.write(b"hi")
    w.owner._lost = True
    w.soon[-1]()
    assert w.posts == [] and w.owner.calls == [] and w.core.buffered == 2
    del w.owner
    gc.collect()
    w.sender.write(b"hi")
    w.soon[-1]()
    assert w.posts == [] and w.core.buffered == 4


def test_posts_take_the_eps_c_hot_path_and_its_method_for_the_rest() -> None:
    """hot(ep, ep._qp_address, ...) as post.py calls it; 0 is posted, anything else the EP's method."""
    hot_calls: List[Tuple[Any, ...]] = []
    answer = [0]

    def hot(*args: Any) -> int:
        hot_calls.append(args)
        return answer[0]
    s = Stream()
    s._qp_address = 1234
    s.receiver = Receiver(s.core, s.arena, s.view, SIZE, weakref.ref(s.owner), True, s, hot, s.segs, s.cookies,
                          DTOCompletionEvent, DATError, s.sender)
    assert s.receiver.receive(s.arrive(0, b"a")) is True
    assert hot_calls == [(s, 1234, "seg0", ("r", 0))] and s.reposts == [] and s.core.owed == 1
    answer[0] = 12  # refused (an errno): the EP's method says why, or posts
    assert s.receiver.receive(s.arrive(1, b"b")) is True and s.reposts == [("seg1", ("r", 1))]
    answer[0] = "not a number"  # type: ignore[list-item]
    assert s.receiver.receive(s.arrive(2, b"c")) is True and s.reposts[-1] == ("seg2", ("r", 2))

    w = Writer()
    w._qp_address = 99
    hot_calls.clear()
    answer[0] = 0
    w.sender = Sender(w.core, w.arena, w.base, SIZE, w, hot, w.segs, w.cookies, w.slot_segment, w.SIGNALLED,
                      w.SUPPRESS, weakref.ref(w.owner), w.soon.append, DATError)
    w.core.write(b"hi")
    assert w.sender.flush() is True and w.posts == []
    (ep, qp, seg, cookie, flags), = hot_calls
    assert (ep, qp, seg.length, cookie, flags) == (w, 99, HEADER.size + 2, ("s", 0), w.SUPPRESS)


# -- the window write's copy into the staging buffer (StreamState.copy_pending_into) -------------------


def _core_with(*writes: Any) -> StreamCore:
    core = StreamCore(StreamConfig(), PeerParams(16, 16384))
    for data in writes:
        core.write(data)
    return core


@pytest.mark.parametrize("sent", [0, 3, 20480, 20483])
def test_the_window_copy_in_c_copies_what_copy_pending_copies(sent: int) -> None:
    # a kept bytes object (from 16 KiB), a small write copied into a bytearray of ours, another kept
    # one; ``sent`` bytes of them already gone (a head part way through a kept chunk, or through ours)
    core = _core_with(bytes(range(256)) * 80, b"xyz" * 3, bytes(reversed(range(256))) * 70)
    core._consume(sent)
    for n in (1, core.buffered // 2, core.buffered):
        want = bytearray(n)
        core.copy_pending(memoryview(want), n)
        arena = bytearray(b"\xee" * (n + 10))
        assert core.copy_pending_into(arena, 7, n) is True
        assert arena[7:7 + n] == want
        assert arena[:7] == b"\xee" * 7 and arena[7 + n:] == b"\xee" * 3  # not a byte more
    assert core.buffered == 20480 + 9 + 17920 - sent  # (a copy commits nothing)


def test_the_window_copy_leaves_other_cases_to_copy_pending() -> None:
    core = _core_with(b"a" * 20000)
    arena = bytearray(30000)
    assert core.copy_pending_into(arena, 0, 20001) is False  # fewer bytes pending than asked
    core._chunks.append(memoryview(b"b" * 10))  # not a chunk write() makes: the Python path's
    core._pending += 10
    assert core.copy_pending_into(arena, 0, 20010) is False
    assert arena == bytearray(30000)  # nothing copied
    assert core.copy_pending_into(arena, 0, 20000) is True  # (the chunks it takes are checked only)
    with pytest.raises(TypeError):
        core.copy_pending_into(memoryview(arena), 0, 10)
    for offset, n in ((29995, 10), (-1, 10), (0, -1), (30001, 0)):
        with pytest.raises(ValueError):
            core.copy_pending_into(arena, offset, n)
