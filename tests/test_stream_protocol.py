"""Issue 14 item 3: the aiodat stream protocol core (aiodat.streams.protocol), without a device.

StreamCore is sans-IO: these tests drive two cores against each other through
a simulated wire (receive slots that must be posted before a send lands, an
RDMA-writable window, in-order send completions) and check what the protocol
promises: the sender never exceeds the receiver's posted slots, credits come
back, the window is used as a ring and released (a window write never lands on
bytes not yet read, nor reuses staged bytes the device may still read), bytes
arrive whole and in order, EOF
comes last, and malformed input is refused with a clear error.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Any, Deque, List, Tuple

import pytest

from aiodat.errors import ConnectionBroken, InvalidParameter, ModelNotSupported
from aiodat.streams.protocol import (
    FLAG_RELEASE,
    FLAG_WRAP,
    HEADER,
    MAX_WINDOWS,
    MSG_CREDIT,
    MSG_DATA,
    MSG_EOF,
    MSG_WINDOW,
    PARAMS,
    VERSION,
    Header,
    Message,
    PeerParams,
    StreamConfig,
    StreamCore,
    StreamProtocolError,
    WindowDesc,
    decode_header,
    encode_header,
    encode_params,
    parse_params,
    split_kwds,
)

# -- a simulated wire ----------------------------------------------------------------------------------


class RNR(AssertionError):
    """A send arrived where the receiver had no posted receive slot (receiver-not-ready)."""


class Side:
    """One end: a StreamCore, its receive slots and window, and what its application got."""

    def __init__(self, cfg: StreamConfig, peer_cfg: StreamConfig) -> None:
        window = WindowDesc(0x10000, peer_cfg.window_size, 0x77) if peer_cfg.window_size else None
        self.cfg = cfg
        self.core = StreamCore(cfg, PeerParams(peer_cfg.recv_depth, peer_cfg.buffer_size, window))
        self.slots = [bytearray(cfg.buffer_size) for _ in range(cfg.slots)]
        self.send_slots = bytearray(cfg.buffer_size * cfg.slots)  # take_data copies a DATA send here
        self.posted: Deque[int] = deque(range(cfg.slots))  # receives are consumed in posting order
        self.window = bytearray(cfg.window_size)
        self.unread: Deque[Tuple[int, int]] = deque()  # window parts written into ours and not yet read
        self.staged: Deque[Tuple[int, int]] = deque()  # our staging parts the device may still read
        self.arrived: Deque[Tuple[int, int]] = deque()  # receive completions not yet processed
        self.send_queue: List[Tuple[Tuple[str, int], bool]] = []  # (cookie, signalled) in posting order
        self.got = bytearray()
        self.eof = False
        self.types_sent: List[int] = []
        self.wire_sent: List[bytes] = []  # every send's bytes, in order
        #: use the common-case steps as the transport does (take_data, on_data/data_consumed)
        self.fast = True
        self.fast_steps = 0  # sends and receives that took the common-case steps


def transmit(a: Side, b: Side, limit: int = 10 ** 9) -> int:
    """Post everything a's core allows; each send lands in one of b's posted slots at once."""
    n = 0
    while n < limit:
        data = a.core.take_data(a.send_slots, 0, a.cfg.buffer_size) if a.fast else None
        if data is not None:  # the transport's first step: one small write in one DATA send
            slot, length, signalled = data
            at = slot * a.cfg.buffer_size
            wire = bytes(a.send_slots[at:at + length])
            land(b, wire)
            a.send_queue.append((("s", slot), signalled))
            a.types_sent.append(MSG_DATA)
            a.wire_sent.append(wire)
            a.fast_steps += 1
            assert a.core.next_send() is None  # what the transport's _flush relies on after take_data
            n += 1
            continue
        send = a.core.next_send()
        if send is None:
            break
        if send.window_write:
            part = (send.offset, send.offset + send.length)
            overlaps = [p for p in list(b.unread) + list(a.staged) if p[0] < part[1] and part[0] < p[1]]
            assert not overlaps, f"window write {part} over {overlaps} (unread by the peer or still staged)"
            assert len(a.staged) < MAX_WINDOWS + 1
            assert bool(send.header[1] & FLAG_WRAP) == (send.offset == 0)
            a.core.copy_pending(memoryview(b.window)[part[0]:part[1]], send.length)  # the RDMA write
            b.unread.append(part)
            a.staged.append(part)
            a.send_queue.append((("w", 0), False))
        wire = bytearray(send.wire_length)
        wire[:HEADER.size] = send.header
        if send.type == MSG_DATA:
            a.core.copy_pending(memoryview(wire)[HEADER.size:], send.length)
        land(b, wire)
        a.send_queue.append((send.cookie, send.signalled))
        a.types_sent.append(send.type)
        a.wire_sent.append(bytes(wire))
        a.core.sent(send)
        n += 1
    return n


def land(b: Side, wire: bytes) -> None:
    """A send's bytes land in b's oldest posted receive slot."""
    if not b.posted:
        raise RNR(f"a {wire[0]} message found no posted receive slot")
    slot = b.posted.popleft()
    b.slots[slot][:len(wire)] = wire
    b.arrived.append((slot, len(wire)))


def complete_sends(a: Side) -> None:
    """The device completes a's sends in order; only signalled ones produce a completion."""
    for cookie, signalled in a.send_queue:
        if signalled:
            a.core.on_send_complete(cookie)
    # everything posted before the last signalled send is done; keep the tail
    last = max((i for i, (_, s) in enumerate(a.send_queue) if s), default=-1)
    for cookie, _ in a.send_queue[:last + 1]:
        if cookie == ("w", 0):
            a.staged.popleft()  # the write completed: the device is done with its staged bytes
    del a.send_queue[:last + 1]


def deliver(b: Side, message: Message) -> None:
    if message.type == MSG_DATA:
        b.got += b.slots[message.slot][HEADER.size:HEADER.size + message.length]
    elif message.type == MSG_WINDOW:
        part = (message.offset, message.offset + message.length)
        assert b.unread and b.unread[0] == part, f"WINDOW read at {part}, written {list(b.unread)}"
        b.got += b.window[part[0]:part[1]]
        b.unread.popleft()
    elif message.type == MSG_EOF:
        assert not b.eof, "EOF delivered twice"
        b.eof = True
    if message.type != MSG_CREDIT:
        assert not b.eof or message.type == MSG_EOF, "data after EOF"
    b.posted.append(b.core.consumed(message))


def process(b: Side, limit: int = 10 ** 9) -> None:
    """b's transport handles its receive completions."""
    while b.arrived and limit:
        slot, length = b.arrived.popleft()
        n = b.core.on_data(slot, b.slots[slot], 0, length) if b.fast else -1
        if n >= 0:  # the transport's common case: DATA handed over with no Message made
            assert not b.eof, "data after EOF"
            b.got += b.slots[slot][HEADER.size:HEADER.size + n]
            b.core.data_consumed(slot, n)
            b.posted.append(slot)
            b.fast_steps += 1
            limit -= 1
            continue
        message = b.core.on_received(slot, b.slots[slot][:HEADER.size], length)
        if message is not None:
            deliver(b, message)
        limit -= 1
    while True:
        held = b.core.next_held()
        if held is None:
            break
        deliver(b, held)


def pair(**kw: int) -> Tuple[Side, Side]:
    cfg = StreamConfig(**kw).validate()
    return Side(cfg, cfg), Side(cfg, cfg)


# -- headers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtype,flags,credits,length", [
    (MSG_DATA, 0, 0, 5), (MSG_DATA, FLAG_RELEASE, 65535, 0), (MSG_WINDOW, 0, 3, 262144),
    (MSG_CREDIT, FLAG_RELEASE, 8, 0), (MSG_EOF, 0, 1, 0),
])
def test_header_round_trip(mtype: int, flags: int, credits: int, length: int) -> None:
    raw = encode_header(mtype, flags, credits, length)
    assert len(raw) == HEADER.size == 8
    assert raw[0] == mtype and raw[1] == flags  # network order, type first
    assert decode_header(raw + bytes(length), HEADER.size + length) == Header(mtype, flags, credits, length)


@pytest.mark.parametrize("raw,received,match", [
    (encode_header(MSG_DATA, 0, 0, 0)[:7], 7, "7-byte message is shorter than the 8-byte header"),
    (b"", 0, "0-byte message"),
    (encode_header(9, 0, 0, 0), 8, "unknown message type 9"),
    (encode_header(0, 0, 0, 0), 8, "unknown message type 0"),
    (encode_header(MSG_DATA, 0x80, 0, 0), 8, "unknown flags 0x80"),
    (encode_header(MSG_DATA, 0, 0, 100) + bytes(50), 58, "DATA says 100 payload bytes but the message is 58"),
    (encode_header(MSG_CREDIT, 0, 1, 4), 8, "CREDIT with a payload length of 4"),
    (encode_header(MSG_EOF, 0, 0, 1), 8, "EOF with a payload length of 1"),
])
def test_malformed_headers_are_refused(raw: bytes, received: int, match: str) -> None:
    with pytest.raises(StreamProtocolError, match=match) as info:
        decode_header(raw, received)
    assert isinstance(info.value, ConnectionBroken) and isinstance(info.value, ConnectionResetError)


def test_header_with_unknown_type_breaks_the_connection_in_the_core() -> None:
    a, b = pair()
    slot = b.posted.popleft()
    b.slots[slot][:8] = encode_header(7, 0, 0, 0)
    with pytest.raises(StreamProtocolError, match="unknown message type 7"):
        b.core.on_received(slot, b.slots[slot][:8], 8)


# -- connection parameters -------------------------------------------------------------------------------


def test_params_round_trip_with_and_without_window() -> None:
    cfg = StreamConfig(buffer_size=4096, recv_depth=8, window_size=65536)
    win = WindowDesc(0x7F00_1234_5000, 65536, 0xABCD)
    data = encode_params(cfg, win)
    assert len(data) == PARAMS.size + 20 == 30
    assert data[:2] == b"AS" and data[2] == VERSION == 2
    assert parse_params(data) == PeerParams(8, 4096, win)
    # the CM pads private data with zeros: ignored
    assert parse_params(data + bytes(26)) == PeerParams(8, 4096, win)
    bare = encode_params(StreamConfig(window_size=0))
    assert len(bare) == PARAMS.size == 10
    assert parse_params(bare + bytes(46)) == PeerParams(16, 16384, None)


@pytest.mark.parametrize("data,match", [
    (b"AS\x01", "3 bytes, expected 10"),
    (PARAMS.pack(b"XX", 1, 0, 16, 16384), "magic b'XX'"),
    (PARAMS.pack(b"AS", 3, 0, 16, 16384), "protocol version 2 .*version 3"),
    (PARAMS.pack(b"AS", 1, 0, 16, 16384), "protocol version 2 .*version 1"),  # one window at a time
    (PARAMS.pack(b"AS", 2, 0, 0, 16384), "credits 0"),
    (PARAMS.pack(b"AS", 2, 0, 16, 8), "slot 8"),
    (PARAMS.pack(b"AS", 2, 1, 16, 16384) + bytes(5), "announce a window but are only 15 bytes"),
])
def test_bad_params_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(InvalidParameter, match=match):
        parse_params(data)


def test_split_kwds() -> None:
    cfg, rest = split_kwds({"buffer_size": 4096, "ssl": None, "family": 0, "whatever": 1, "busy_poll_us": 50})
    assert cfg == StreamConfig(buffer_size=4096, busy_poll_us=50) and rest == {"whatever": 1}
    with pytest.raises(ModelNotSupported, match="ssl=True"):
        split_kwds({"ssl": True})
    with pytest.raises(InvalidParameter, match="recv_depth"):
        split_kwds({"recv_depth": 1})


def test_sizes_each_in_range_but_too_much_memory_together_are_refused() -> None:
    """Each size is checked alone, and their sum too: 1 MiB slots, 4096 credits and a 1 GiB window
    would register about 10 GiB per connection (a MemoryError, or seconds zeroing it on the loop)."""
    with pytest.raises(InvalidParameter, match="would register 10747904000 bytes"):
        split_kwds({"buffer_size": 1 << 20, "recv_depth": 4096, "window_size": 1 << 30})
    assert split_kwds({"buffer_size": 1 << 20, "recv_depth": 512, "window_size": 1 << 30})[0].memory < 1 << 32


# -- credits and the send window -------------------------------------------------------------------------


def test_sender_stops_at_the_peers_credits_and_resumes_when_they_return() -> None:
    a, b = pair(recv_depth=4, window_size=0, buffer_size=64)
    a.core.write(bytes(range(256)) * 10)  # 2560 bytes, 56 per DATA message
    assert transmit(a, b) == 4  # one message per credit, no more
    assert a.core.credits == 0 and a.core.next_send() is None
    assert a.core.buffered == 2560 - 4 * 56
    process(b)  # b consumes the four: owes 4, threshold is 2 -> a CREDIT message
    assert b.core.owed == 4
    credit = b.core.next_send()
    assert credit is not None and credit.type == MSG_CREDIT and credit.credits == 4 and not credit.takes_credit
    assert transmit(b, a) == 1 and b.core.owed == 0
    process(a)
    assert a.core.credits == 4
    assert transmit(a, b) == 4


def test_credits_below_the_threshold_wait_for_a_message_to_ride_on() -> None:
    a, b = pair(recv_depth=8, window_size=0)  # threshold 4
    a.core.write(b"x" * 10)
    transmit(a, b)
    process(b)
    assert b.core.owed == 1 and b.core.next_send() is None  # 1 < 4: no CREDIT message
    b.core.write(b"reply")
    send = b.core.next_send()
    assert send is not None and send.type == MSG_DATA and send.credits == 1  # piggybacked
    transmit(b, a)
    process(a)
    assert a.core.credits == 8 and a.got == b"reply" and b.got == b"x" * 10


def test_returning_credits_never_granted_is_a_protocol_error() -> None:
    a, b = pair(recv_depth=4)
    slot = a.posted.popleft()
    a.slots[slot][:8] = encode_header(MSG_CREDIT, 0, 1, 0)  # a holds all 4 already
    with pytest.raises(StreamProtocolError, match="returned 1 credits while we hold 4 of the 4"):
        a.core.on_received(slot, a.slots[slot][:8], 8)


def test_a_message_into_a_slot_that_is_not_posted_is_refused() -> None:
    a, b = pair()
    a.core.write(b"hi")
    transmit(a, b)
    slot, length = b.arrived[0]
    b.core.pause_reading()
    assert b.core.on_received(slot, b.slots[slot][:8], length) is None  # held, slot in use
    with pytest.raises(StreamProtocolError, match=f"receive slot {slot}, which is not posted"):
        b.core.on_received(slot, b.slots[slot][:8], length)
    with pytest.raises(StreamProtocolError, match="not posted"):
        b.core.on_received(b.cfg.slots, b.slots[0][:8], 8)


def test_large_writes_use_the_window_once_until_released() -> None:
    a, b = pair(buffer_size=4096, recv_depth=8, window_size=65536, rdma_threshold=16384)
    data = random.Random(1).randbytes(200_000)
    a.core.write(data)
    first = a.core.next_send()
    assert first is not None and first.type == MSG_WINDOW and first.window_write and first.length == 65536
    assert first.wire_length == HEADER.size  # the payload goes by RDMA write, not in the send
    transmit(a, b, limit=1)
    assert not a.core.window_free
    assert a.core.next_send() is None  # window busy: the bulk bytes wait for it, not go in slot-sized DATA
    transmit(a, b)
    assert a.types_sent.count(MSG_WINDOW) == 1 and a.types_sent.count(MSG_DATA) == 0
    process(b)  # consumes the WINDOW: the window is released with b's next message
    send = b.core.next_send()
    assert send is not None and send.release and send.header[1] & FLAG_RELEASE
    transmit(b, a)
    process(a)
    assert not a.core.window_free  # released, but the device may still read the staged bytes
    complete_sends(a)  # ... until the write completed
    assert a.core.window_free
    for _ in range(200):
        transmit(a, b), process(b), transmit(b, a), process(a), complete_sends(a), complete_sends(b)
    assert bytes(b.got) == data and a.core.buffered == 0
    assert a.types_sent.count(MSG_WINDOW) >= 2
    assert a.core.stats["window_writes"] == a.types_sent.count(MSG_WINDOW)
    assert a.core.stats["bytes_sent"] == b.core.stats["bytes_received"] == len(data)


def test_two_window_writes_in_flight_fill_the_window_as_a_ring() -> None:
    """The reader copies one window write out while the next is written: two in flight, each after
    the one before, one release per write read (two in one header), and a write that no longer fits
    before the end starts over at 0 (FLAG_WRAP) once the oldest write there is released and completed."""
    a, b = pair(buffer_size=4096, recv_depth=8, window_size=65536, rdma_threshold=16384)
    data = random.Random(2).randbytes(90_000)

    def window_write(expected: tuple) -> None:
        send = a.core.next_send()
        assert send is not None and send.type == MSG_WINDOW and (send.offset, send.length) == expected
        assert bool(send.header[1] & FLAG_WRAP) == (send.offset == 0)
        assert transmit(a, b) == 1

    def release(count: int) -> None:
        send = b.core.next_send()
        assert send is not None and send.type == MSG_CREDIT and send.release == count
        assert send.header[1] & 0x03 == count
        transmit(b, a)
        process(a)

    a.core.write(data[:20_000])
    window_write((0, 20_000))
    a.core.write(data[20_000:40_000])
    window_write((20_000, 20_000))
    a.core.write(data[40_000:60_000])
    assert a.core.windows_in_flight == MAX_WINDOWS == 2
    assert a.core.next_send() is None  # 25 536 bytes free, but two writes in flight
    process(b, limit=1)  # the reader took the first write out
    release(1)
    assert a.core.next_send() is None  # released, but not completed: the device may read the staged bytes
    complete_sends(a)
    assert a.core.windows_in_flight == 1
    window_write((40_000, 20_000))
    process(b, limit=1)  # the second write read: the oldest in flight is now at 40 000
    release(1)
    complete_sends(a)
    a.core.write(data[60_000:])
    window_write((0, 30_000))  # 5 536 bytes left before the end: from 0 up to the oldest write
    process(b)  # the third and fourth writes read
    release(2)
    complete_sends(a)
    assert a.core.window_free and bytes(b.got) == data
    stats = a.core.stats
    assert (stats["window_writes"], stats["window_writes_overlapped"], stats["window_wraps"]) == (4, 3, 1)


def test_window_protocol_errors_are_named() -> None:
    a, b = pair(buffer_size=4096, recv_depth=8, window_size=65536, rdma_threshold=16384)
    with pytest.raises(StreamProtocolError, match="released 1 window writes while 0 were unreleased"):
        a.core.on_received(0, encode_header(MSG_CREDIT, FLAG_RELEASE, 0, 0), 8)
    with pytest.raises(StreamProtocolError, match="the WRAP flag on a DATA message"):
        a.core.on_received(0, encode_header(MSG_DATA, FLAG_WRAP, 0, 0), 8)
    assert a.core.on_received(0, encode_header(MSG_WINDOW, FLAG_WRAP, 0, 60_000), 8) is not None
    # without FLAG_WRAP a write follows the previous one: 60 000 + 10 000 is past the end
    with pytest.raises(StreamProtocolError, match="WINDOW of 10000 bytes at offset 60000 into a window of 65536"):
        a.core.on_received(1, encode_header(MSG_WINDOW, 0, 0, 10_000), 8)


@pytest.mark.parametrize("seed", range(3))
def test_mixed_writes_arrive_in_order_and_a_changed_buffer_does_not_change_them(seed: int) -> None:
    """Large bytes objects are kept by reference, small writes and mutable buffers are copied at
    write(): whatever mix is written arrives in order, and changing a buffer after write() is not seen."""
    rng = random.Random(seed)
    a, b = pair(buffer_size=4096, recv_depth=8, window_size=65536, rdma_threshold=16384)
    expected = bytearray(b"hello")
    a.core.write(b"hello")  # alone: a DATA message
    transmit(a, b)
    for _ in range(60):
        kind = rng.choice(["small", "large", "bytearray", "memoryview"])
        data = rng.randbytes(rng.randint(1, 100) if kind == "small" else rng.randint(16384, 90000))
        if kind == "bytearray":
            mutable = bytearray(data)
            a.core.write(mutable)
            mutable[:] = bytes(len(mutable))  # the caller reuses its buffer at once
        elif kind == "memoryview":
            a.core.write(memoryview(bytearray(data)))
        else:
            a.core.write(data)
        expected += data
        assert a.core.buffered <= len(expected) - len(b.got)
        if rng.random() < 0.5:
            transmit(a, b), process(b), transmit(b, a), process(a), complete_sends(a), complete_sends(b)
    for _ in range(400):
        transmit(a, b), process(b), transmit(b, a), process(a), complete_sends(a), complete_sends(b)
    assert bytes(b.got) == bytes(expected) and a.core.buffered == 0
    assert a.core.stats["window_writes"] > 0 and a.core.stats["data_msgs"] > 0


def test_below_the_threshold_or_with_a_small_window_bytes_go_as_data() -> None:
    a, b = pair(buffer_size=4096, recv_depth=8, window_size=65536, rdma_threshold=16384)
    a.core.write(bytes(70_000))
    first = a.core.next_send()
    assert first is not None and first.type == MSG_WINDOW
    a.core.sent(first)
    a.core.discard()
    a.core.write(b"x" * 100)  # a small write while the window is busy leaves at once
    small = a.core.next_send()
    assert small is not None and small.type == MSG_DATA and small.length == 100
    # a window smaller than the threshold is not worth waiting for: bulk goes as DATA
    c, _ = pair(buffer_size=4096, recv_depth=8, window_size=8192, rdma_threshold=16384)
    c.core.write(bytes(50_000))
    send = c.core.next_send()
    assert c.core.window_length == 8192 and send is not None and send.type == MSG_DATA


def test_window_length_is_the_smaller_of_the_two_and_zero_disables_it() -> None:
    big, small = StreamConfig(window_size=1 << 20), StreamConfig(window_size=65536)
    assert StreamCore(small, PeerParams(16, 16384, WindowDesc(0, 1 << 20, 1))).window_length == 65536
    assert StreamCore(big, PeerParams(16, 16384, WindowDesc(0, 65536, 1))).window_length == 65536
    off = StreamCore(StreamConfig(window_size=0), PeerParams(16, 16384, WindowDesc(0, 65536, 1)))
    off.write(bytes(1 << 20))
    send = off.next_send()
    assert off.window_length == 0 and send is not None and send.type == MSG_DATA


def test_window_message_into_no_window_is_refused() -> None:
    cfg = StreamConfig(window_size=0)
    core = StreamCore(cfg, PeerParams(16, 16384, None))
    with pytest.raises(StreamProtocolError, match="WINDOW of 100 bytes at offset 0 into a window of 0"):
        core.on_received(0, encode_header(MSG_WINDOW, 0, 0, 100), 8)
    with pytest.raises(StreamProtocolError, match="WINDOW of 0 bytes at offset 0 into a window of 0"):
        core.on_received(0, encode_header(MSG_WINDOW, 0, 0, 0), 8)


def test_send_completions_free_every_earlier_slot_and_signal_sparingly() -> None:
    a, b = pair(recv_depth=20, window_size=0, buffer_size=64)  # 25 slots: one send in 19 signalled
    a.core.write(bytes(56 * 20))
    assert transmit(a, b) == 20
    signalled = [s for _, s in a.send_queue]
    assert 0 < sum(signalled) < len(signalled)  # most sends are unsignalled
    assert a.core.free_send_slots == a.cfg.slots - 20
    complete_sends(a)
    freed = a.cfg.slots - 20 + (max(i for i, s in enumerate(signalled) if s) + 1)
    assert a.core.free_send_slots == freed
    a.core.on_send_complete(("s", 999))  # a stray completion changes nothing
    assert a.core.free_send_slots == freed


# -- flow control under a slow reader ----------------------------------------------------------------------


@pytest.mark.parametrize("fast", [True, False], ids=["common-case-steps", "general-steps"])
@pytest.mark.parametrize("seed", range(6))
def test_flow_control_never_overruns_posted_slots(seed: int, fast: bool) -> None:
    """Random writes both ways, a reader that pauses and lags: no send ever meets an empty receive
    queue, credit-taking messages never occupy more than recv_depth slots, and every byte arrives in
    order; driven as the transport drives the core (take_data and on_data first), and with only
    next_send/sent and on_received/consumed."""
    rng = random.Random(seed)
    kw = rng.choice([dict(recv_depth=4, buffer_size=64, window_size=4096, rdma_threshold=200),
                     dict(recv_depth=16, buffer_size=1024, window_size=8192, rdma_threshold=3000),
                     dict(recv_depth=5, buffer_size=128, window_size=0)])
    a, b = pair(**kw)
    a.fast = b.fast = fast
    out = {id(a): bytearray(), id(b): bytearray()}
    for step in range(600):
        for side, peer in ((a, b), (b, a)):
            if rng.random() < 0.3 and not side.core.eof_requested:
                chunk = rng.randbytes(rng.randint(1, 5000))
                side.core.write(chunk)
                out[id(side)] += chunk
            transmit(side, peer)
            # the receiver's slots: credit-taking messages never exceed what it granted
            in_slots = [peer.slots[s][0] for s, _ in peer.arrived] + [m.type for m in peer.core.held]
            assert sum(t != MSG_CREDIT for t in in_slots) <= peer.cfg.recv_depth
            assert sum(t == MSG_CREDIT for t in in_slots) <= peer.cfg.extra_slots
            assert side.core.credits >= 0
        for side in (a, b):
            if rng.random() < 0.2:
                side.core.pause_reading()
            elif rng.random() < 0.5:
                side.core.resume_reading()
            if rng.random() < 0.6:
                process(side, limit=rng.randint(1, 6))
            if rng.random() < 0.7:
                complete_sends(side)
    for side in (a, b):
        side.core.write_eof()
    for _ in range(2000):
        for side, peer in ((a, b), (b, a)):
            side.core.resume_reading()
            transmit(side, peer)
            process(peer)
            complete_sends(side)
        if a.eof and b.eof and a.core.is_flushed() and b.core.is_flushed():
            break
    assert bytes(b.got) == bytes(out[id(a)]) and bytes(a.got) == bytes(out[id(b)])
    assert a.eof and b.eof and a.core.is_flushed() and b.core.is_flushed()


@pytest.mark.parametrize("seed", range(4))
def test_common_case_steps_send_what_the_general_steps_send(seed: int) -> None:
    """take_data and on_data/data_consumed are next_send/copy/sent and on_received/consumed for the
    common case: two pairs driven alike, one each way, put the same bytes on the wire (headers,
    credits returned, which sends are signalled) and end in the same state."""
    rng = random.Random(seed)
    fast_pair, general_pair = pair(recv_depth=4, buffer_size=256, window_size=4096, rdma_threshold=1000), \
        pair(recv_depth=4, buffer_size=256, window_size=4096, rdma_threshold=1000)
    for side in general_pair:
        side.fast = False
    for step in range(400):
        size, which, lag = rng.choice([1, 7, 100, 248, 249, 600, 2000]), rng.random(), rng.randint(0, 3)
        for (a, b) in (fast_pair, general_pair):
            (a if which < 0.5 else b).core.write(bytes([step % 251]) * size)
            transmit(a, b)
            transmit(b, a)
            process(a, limit=lag)
            process(b, limit=lag)
            if step % 3 == 0:
                complete_sends(a)
                complete_sends(b)
    for f, g in zip(fast_pair, general_pair):
        assert f.wire_sent == g.wire_sent and f.types_sent == g.types_sent
        assert [s for _, s in f.send_queue] == [s for _, s in g.send_queue]
        assert bytes(f.got) == bytes(g.got)
        assert (f.core.credits, f.core.owed, f.core.free_send_slots, f.core.stats) == \
            (g.core.credits, g.core.owed, g.core.free_send_slots, g.core.stats)
    assert min(side.fast_steps for side in fast_pair) > 50  # the common case was taken, and often


def test_common_case_steps_leave_everything_else_to_the_general_ones() -> None:
    """take_data and on_data change nothing when the case is not theirs."""
    a, b = pair(recv_depth=4, buffer_size=64, window_size=4096, rdma_threshold=200)

    def take() -> Any:
        return a.core.take_data(a.send_slots, 0, 64)

    assert take() is None  # nothing pending
    a.core.write(b"x" * 100)  # more than one DATA message holds
    assert take() is None and a.core.buffered == 100
    a.core.discard()
    a.core.write(b"ab")
    a.core.write(bytearray(b"cd"))  # one chunk still: small writes are gathered
    data = a.core.take_data(a.send_slots, 0, 64)
    assert data is not None and data[1] == HEADER.size + 4 and a.core.buffered == 0
    at = data[0] * 64
    assert bytes(a.send_slots[at:at + data[1]]) == HEADER.pack(MSG_DATA, 0, 0, 4) + b"abcd"
    a.core.write(b"tail")
    a.core.write_eof()  # EOF is due: the general steps send the data, then EOF
    assert take() is None
    wire = bytearray(HEADER.pack(MSG_EOF, 0, 0, 0))
    assert b.core.on_data(0, wire, 0, len(wire)) == -1  # not DATA
    wire = bytearray(HEADER.pack(MSG_DATA, FLAG_RELEASE, 0, 0))
    assert b.core.on_data(0, wire, 0, len(wire)) == -1  # a release to take
    wire = bytearray(HEADER.pack(MSG_DATA, 0, 0, 50))
    assert b.core.on_data(0, wire, 0, 20) == -1  # says more than arrived
    b.core.pause_reading()
    wire = bytearray(HEADER.pack(MSG_DATA, 0, 0, 2)) + b"hi"
    assert b.core.on_data(0, wire, 0, len(wire)) == -1  # paused: held by on_received
    b.core.resume_reading()
    assert b.core.on_data(99, wire, 0, len(wire)) == -1  # no such slot
    assert b.core.credits == 4 and b.core.owed == 0
    assert b.core.on_data(0, wire, 0, len(wire)) == 2
    assert b.core.on_data(0, wire, 0, len(wire)) == -1  # the slot is not posted again yet
    b.core.data_consumed(0, 2)
    assert b.core.owed == 1 and b.core.stats["bytes_received"] == 2


def test_paused_reader_holds_messages_and_their_credits() -> None:
    a, b = pair(recv_depth=4, window_size=0, buffer_size=64)
    b.core.pause_reading()
    a.core.write(b"0123456789" * 30)
    transmit(a, b)
    process(b)
    assert b.got == b"" and b.core.owed == 0  # held: no credits go back
    assert transmit(a, b) == 0  # and a cannot send more
    b.core.resume_reading()
    process(b)
    assert b.got == (b"0123456789" * 30)[:4 * 56] and b.core.owed == 4


def test_credit_messages_are_taken_even_while_paused() -> None:
    a, b = pair(recv_depth=4, window_size=0, buffer_size=64)
    a.core.write(bytes(56 * 4))
    transmit(a, b)
    process(b)
    transmit(b, a)  # a CREDIT message
    a.core.pause_reading()
    slot, length = a.arrived.popleft()
    message = a.core.on_received(slot, a.slots[slot][:8], length)
    assert message is not None and message.type == MSG_CREDIT and a.core.credits == 4


# -- EOF and the end of a connection -----------------------------------------------------------------------


def test_eof_follows_the_data_and_needs_a_credit() -> None:
    a, b = pair(recv_depth=4, window_size=0, buffer_size=64)
    a.core.write(bytes(56 * 4 + 10))
    a.core.write_eof()
    with pytest.raises(RuntimeError, match="write_eof"):
        a.core.write(b"late")
    transmit(a, b)
    assert MSG_EOF not in a.types_sent and a.core.credits == 0  # data first, and EOF waits for a credit
    for _ in range(5):
        process(b), transmit(b, a), process(a), transmit(a, b), complete_sends(a)
    assert a.types_sent[-1] == MSG_EOF and a.types_sent.count(MSG_EOF) == 1
    assert b.eof and len(b.got) == 56 * 4 + 10
    assert a.core.is_flushed()


def test_not_flushed_until_the_eof_send_completed() -> None:
    a, b = pair()
    a.core.write(b"data")
    a.core.write_eof()
    transmit(a, b)
    assert a.core.eof_sent and not a.core.is_flushed()
    assert a.send_queue[-1][1]  # the EOF send is signalled
    complete_sends(a)
    assert a.core.is_flushed()


def test_data_after_eof_is_a_protocol_error() -> None:
    a, b = pair()
    a.core.write_eof()
    transmit(a, b)
    process(b)
    assert b.eof and b.core.eof_received
    slot = b.posted.popleft()
    with pytest.raises(StreamProtocolError, match="DATA after EOF"):
        b.core.on_received(slot, encode_header(MSG_DATA, 0, 0, 0), 8)
    # credits may still come after EOF
    assert b.core.on_received(slot, encode_header(MSG_CREDIT, 0, 0, 0), 8) is not None


def test_held_eof_still_counts_when_the_peer_disconnects() -> None:
    a, b = pair()
    b.core.pause_reading()
    a.core.write(b"last words")
    a.core.write_eof()
    transmit(a, b)
    process(b)
    assert b.got == b"" and not b.eof
    # the peer disconnects: the transport forces out the held messages, in order, EOF last
    forced = []
    while (m := b.core.next_held(force=True)) is not None:
        forced.append(m.type)
    assert forced == [MSG_DATA, MSG_EOF]
    assert b.core.disconnect_error(broken=False, closing=False) is None


def test_disconnect_outcome() -> None:
    core = StreamCore(StreamConfig(), PeerParams(16, 16384, None))
    assert "closed by the peer without EOF" in core.disconnect_error(broken=False, closing=False)
    assert core.disconnect_error(broken=False, closing=True) is None  # our DREQ crossed the peer's
    assert "broke" in core.disconnect_error(broken=True, closing=True)
    core.on_received(0, encode_header(MSG_EOF, 0, 0, 0), 8)
    assert core.disconnect_error(broken=False, closing=False) is None
    assert "broke" in core.disconnect_error(broken=True, closing=False)
    # bytes written here and never sent are lost: a reset, however politely the peer went
    core.write(b"unsent")
    assert "with 6 bytes written here not yet sent" in core.disconnect_error(broken=False, closing=False)
    assert "with 6 bytes written here not yet sent" in core.disconnect_error(broken=False, closing=True)


def test_a_stale_send_cannot_be_committed() -> None:
    core = StreamCore(StreamConfig(), PeerParams(16, 16384, None))
    core.write(b"abc")
    send = core.next_send()
    assert send is not None
    core.sent(send)
    with pytest.raises(RuntimeError, match="stale Send"):
        core.sent(send)


def test_the_c_state_refuses_bad_arguments_and_changes_nothing() -> None:
    """StreamState's C steps (aiodat/_shim/streamcore.c) check what they are given: a destination that
    cannot hold the send slot, a buffer they cannot read, a header outside it, a slot that does not
    exist, and a core whose containers are gone all raise, naming the problem, with the state as it was."""
    from aiodat._shim._streamcore import StreamState

    a, b = pair(recv_depth=4, buffer_size=64, window_size=0)
    a.core.write(b"hello")
    before = (a.core.credits, a.core.buffered, a.core.free_send_slots, dict(a.core.stats))
    with pytest.raises(TypeError, match="bytearray"):
        a.core.take_data(bytes(len(a.send_slots)), 0, 64)
    with pytest.raises(ValueError, match="does not fit"):
        a.core.take_data(bytearray(64), 32, 64)  # the slot runs past the end
    with pytest.raises(ValueError, match="does not fit"):
        a.core.take_data(a.send_slots, 0, 8)  # a slot smaller than the message
    for base, size in ((2 ** 62, 64), (0, 2 ** 62), (-1, 64)):  # (no overflow on the way to the check)
        with pytest.raises(ValueError, match="does not fit"):
            a.core.take_data(a.send_slots, base, size)
    assert (a.core.credits, a.core.buffered, a.core.free_send_slots, dict(a.core.stats)) == before
    assert a.core.take_data(a.send_slots, 0, 64) is not None
    wire = bytearray(HEADER.pack(MSG_DATA, 0, 0, 2)) + b"hi"
    with pytest.raises(TypeError, match="bytes or a bytearray"):
        b.core.on_data(0, memoryview(wire), 0, len(wire))
    with pytest.raises(ValueError, match="does not fit"):
        b.core.on_data(0, wire, len(wire) - 4, len(wire))
    with pytest.raises(IndexError, match="no receive slot 99"):
        b.core.data_consumed(99, 2)
    with pytest.raises(TypeError, match="bytes object"):
        b.core.write_bytes(bytearray(b"x"))
    assert b.core.credits == 4 and b.core.owed == 0 and b.core.on_data(0, wire, 0, len(wire)) == 2
    del b.core._free_slots  # a subclass that broke its state: an error, not a crash
    with pytest.raises(RuntimeError, match="not set up"):
        b.core.data_consumed(0, 2)
    bare = StreamState()
    for call in (lambda: bare.take_data(bytearray(64), 0, 64), lambda: bare.on_data(0, wire, 0, 10),
                 lambda: bare.write_bytes(b"x"), lambda: bare.data_consumed(0, 1)):
        with pytest.raises(RuntimeError, match="not set up"):
            call()
    with pytest.raises(AttributeError):
        bare._chunks  # noqa: B018 (unset: an AttributeError, as for any attribute)
    with pytest.raises(TypeError):
        bare.eof_requested = 1  # a flag is a bool


def test_bytes_from_keep_from_on_are_kept_by_reference_and_smaller_ones_copied() -> None:
    """protocol._KEEP_FROM and the C write_bytes' KEEP_FROM are one rule: a bytes write from that size
    on is kept as it is until sent (immutable: no copy), a smaller one copied into the core's buffer."""
    from aiodat.streams import protocol

    big, small = bytes(protocol._KEEP_FROM), bytes(protocol._KEEP_FROM - 1)
    a, _ = pair(window_size=0)
    a.core.write(big)
    assert a.core._chunks[-1] is big
    a, _ = pair(window_size=0)
    a.core.write(small)
    assert a.core._chunks[-1] is not small and type(a.core._chunks[-1]) is bytearray
    assert a.core.buffered == len(small)


def test_only_asyncios_own_reader_gets_views_of_the_receive_slots() -> None:
    """The transport hands data_received a view of the receive slot (reused once it returns) only where
    asyncio's own StreamReaderProtocol feeds asyncio's own StreamReader, which copies the bytes.  A
    StreamReader subclass overriding feed_data (or a feed_data set on the reader) used to get views
    too, and what it kept changed under it; it gets bytes now, as from asyncio's transports, and so
    do a data_received rebound on the protocol and a protocol without a reader it can see."""
    import asyncio

    from aiodat.streams.transport import _takes_views

    class Tap(asyncio.StreamReader):
        def feed_data(self, data: bytes) -> None:
            super().feed_data(data)

    class Subclass(asyncio.StreamReaderProtocol):
        pass

    class Broken(asyncio.StreamReaderProtocol):
        def __init__(self) -> None:  # (never calls super().__init__: no _stream_reader to read)
            pass

    loop = asyncio.new_event_loop()
    try:
        kept = asyncio.StreamReader(loop=loop), Tap(loop=loop), asyncio.StreamReader(loop=loop)
        plain, tap, patched = kept  # (held: the protocols hold their readers weakly)
        patched.feed_data = lambda data: None  # type: ignore[method-assign]
        assert _takes_views(asyncio.StreamReaderProtocol(plain, loop=loop))
        assert _takes_views(Subclass(plain, loop=loop))  # (asyncio's data_received, asyncio's reader)
        assert _takes_views(asyncio.StreamReaderProtocol(None, loop=loop))  # (no reader: data dropped)
        assert not _takes_views(asyncio.StreamReaderProtocol(tap, loop=loop))
        assert not _takes_views(asyncio.StreamReaderProtocol(patched, loop=loop))
        rebound = asyncio.StreamReaderProtocol(plain, loop=loop)
        rebound.data_received = lambda data: None  # type: ignore[method-assign]
        assert not _takes_views(rebound)
        assert not _takes_views(Broken())
        assert not _takes_views(asyncio.Protocol())
    finally:
        loop.close()
