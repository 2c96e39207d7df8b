"""Issue 4: RDMA write/read, immediates, atomics, scatter/gather, completion flags and LMR extras on real rxe."""
from __future__ import annotations

import asyncio
import zlib
import sys
import time
from typing import Any

import pytest

import aiodat
from aiodat import CompletionFlags, DTOOp, EPAttr, EventType, Privileges
from aiodat.testing.plugin import make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # generous bound for every wait: the QEMU guest runs under TCG


async def one(evd: Any) -> Any:
    """The next event of ``evd`` (a DTO completion)."""
    event = await evd.wait_one(timeout=T)
    assert event.type is EventType.DTO_COMPLETION, event
    return event


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


async def test_rdma_write_gathers_segments_byte_for_byte(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_iov=3))
    src = p.client_lmr.memoryview()
    src[0:4096] = pattern(4096, 1)
    segs = [p.client_lmr[0:100], p.client_lmr[1000:1300], p.client_lmr[4000:4096]]
    p.client.post_rdma_write(segs, p.server_lmr.remote()[10:600], cookie="w")
    ev = (await one(p.client.request_evd)).raise_for_status()
    assert (ev.cookie, ev.operation, ev.transferred_length, ev.ep) == ("w", DTOOp.RDMA_WRITE, 496, p.client)
    dst = bytes(p.server_lmr.memoryview())
    expected = bytes(src[0:100]) + bytes(src[1000:1300]) + bytes(src[4000:4096])
    assert dst[10:506] == expected
    assert dst[:10] == bytes(10) and dst[506:] == bytes(4096 - 506)  # nothing outside the target
    assert p.server.recv_evd.dequeue() is None  # a plain write is silent at the peer


async def test_rdma_write_with_immediate_completes_peer_receive(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    p.server_lmr.memoryview()[0:16] = b"R" * 16
    p.server.post_recv(p.server_lmr[0:16], cookie="rx")
    p.client_lmr.memoryview()[0:64] = pattern(64, 3)
    p.client.post_rdma_write(p.client_lmr[0:64], p.server_lmr.remote()[1024:1088], "w", imm_data=0xDEADBEEF)
    (await one(p.client.request_evd)).raise_for_status()
    rx = (await one(p.server.recv_evd)).raise_for_status()
    assert rx.operation is DTOOp.RECV_RDMA_WRITE_IMM
    assert rx.imm_data == 0xDEADBEEF and rx.cookie == "rx" and rx.transferred_length == 64
    mv = p.server_lmr.memoryview()
    assert bytes(mv[1024:1088]) == pattern(64, 3)
    assert bytes(mv[0:16]) == b"R" * 16  # the receive's own buffer is not written


async def test_send_with_immediate(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    p.server.post_recv(p.server_lmr[0:128], cookie="rx")
    p.client_lmr.memoryview()[0:5] = b"hello"
    p.client.post_send(p.client_lmr[0:5], "tx", imm_data=7)
    (await one(p.client.request_evd)).raise_for_status()
    rx = (await one(p.server.recv_evd)).raise_for_status()
    assert (rx.operation, rx.imm_data, rx.transferred_length) == (DTOOp.RECV, 7, 5)
    assert bytes(p.server_lmr.memoryview()[0:5]) == b"hello"
    with pytest.raises(aiodat.InvalidParameter, match="32-bit"):
        p.client.post_rdma_write(p.client_lmr[0:5], p.server_lmr.remote(), imm_data=2**32)


async def test_rdma_read_scatters_into_segments(ia: Any) -> None:
    p = await make_ep_pair(ia, 8192, EPAttr(max_request_iov=4))
    p.server_lmr.memoryview()[:] = pattern(8192, 5)
    segs = [p.client_lmr[0:10], p.client_lmr[100:3100], p.client_lmr[5000:5001], p.client_lmr[8000:8192]]
    p.client.post_rdma_read(segs, p.server_lmr.remote()[2000:], cookie="r")
    ev = (await one(p.client.request_evd)).raise_for_status()
    assert (ev.operation, ev.transferred_length) == (DTOOp.RDMA_READ, 3203)
    want = pattern(8192, 5)[2000:2000 + 3203]
    mv = p.client_lmr.memoryview()
    got = bytes(mv[0:10]) + bytes(mv[100:3100]) + bytes(mv[5000:5001]) + bytes(mv[8000:8192])
    assert got == want
    assert bytes(mv[10:100]) == bytes(90)


async def test_fetch_add_and_compare_swap_byte_order(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    remote_word = p.server_lmr.memoryview()[64:72]
    remote_word[:] = (5).to_bytes(8, sys.byteorder)
    target = p.server_lmr.remote()[64:72]
    result = p.client_lmr[8:16]

    p.client.post_fetch_add(result, target, 10, cookie="fa")
    ev = (await one(p.client.request_evd)).raise_for_status()
    assert (ev.operation, ev.cookie, ev.transferred_length) == (DTOOp.FETCH_ADD, "fa", 8)
    # the original value lands in the local segment in the initiator's (host) byte order on rxe
    assert int.from_bytes(result.memoryview(), sys.byteorder) == 5
    assert int.from_bytes(remote_word, sys.byteorder) == 15

    p.client.post_fetch_add(result, target, -20)  # wraps mod 2**64
    (await one(p.client.request_evd)).raise_for_status()
    assert int.from_bytes(result.memoryview(), sys.byteorder) == 15
    assert int.from_bytes(remote_word, sys.byteorder) == 2**64 - 5

    p.client.post_compare_swap(result, target, compare=1, swap=99, cookie="miss")
    ev = (await one(p.client.request_evd)).raise_for_status()
    assert ev.operation is DTOOp.COMPARE_SWAP
    assert int.from_bytes(result.memoryview(), sys.byteorder) == 2**64 - 5  # original returned, no swap
    assert int.from_bytes(remote_word, sys.byteorder) == 2**64 - 5

    p.client.post_compare_swap(result, target, compare=2**64 - 5, swap=0x0102030405060708, cookie="hit")
    (await one(p.client.request_evd)).raise_for_status()
    assert int.from_bytes(result.memoryview(), sys.byteorder) == 2**64 - 5
    assert int.from_bytes(remote_word, sys.byteorder) == 0x0102030405060708


async def test_errors_raised_before_posting(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_iov=2))
    c, remote = p.client, p.server_lmr.remote()
    with pytest.raises(aiodat.LengthError, match="only 100 bytes"):
        c.post_rdma_write(p.client_lmr[0:101], remote[0:100])
    with pytest.raises(aiodat.LengthError):
        c.post_rdma_read([p.client_lmr[0:60], p.client_lmr[100:160]], remote[0:100])
    three = [p.client_lmr[0:1], p.client_lmr[1:2], p.client_lmr[2:3]]
    for post in (c.post_rdma_write, c.post_rdma_read):
        with pytest.raises(aiodat.InvalidParameter, match="at most 2 segment"):
            post(three, remote)
    with pytest.raises(aiodat.InvalidParameter, match="at most 2 segment"):
        c.post_send(three)
    with pytest.raises(aiodat.InvalidParameter, match="not 8-byte aligned"):
        c.post_fetch_add(p.client_lmr[0:8], remote[4:12], 1)
    with pytest.raises(aiodat.InvalidParameter, match="not 8-byte aligned"):
        c.post_compare_swap(p.client_lmr[0:8], remote[9:17], 0, 1)
    with pytest.raises(aiodat.InvalidParameter, match="exactly one 8-byte"):
        c.post_fetch_add(p.client_lmr[0:4], remote[0:8], 1)
    with pytest.raises(aiodat.LengthError, match="atomic needs 8"):
        c.post_fetch_add(p.client_lmr[0:8], remote[0:4], 1)
    with pytest.raises(aiodat.InvalidParameter, match="RemoteRegion"):
        c.post_rdma_write(p.client_lmr[0:8], (remote.address, 8, remote.rmr_context))
    with pytest.raises(aiodat.InvalidParameter, match="add must be"):
        c.post_fetch_add(p.client_lmr[0:8], remote[0:8], 2**64)
    # nothing was posted by any of these
    assert c.query().outstanding_requests == 0
    await asyncio.sleep(0.1)
    assert c.request_evd.dequeue() is None


async def test_read_iov_limit_is_max_request_iov(ia: Any) -> None:
    # the RDMA read limit is min(max_request_iov, the device's max_sge_rd)
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_iov=32))
    assert p.client._read_iov_limit() == min(32, ia._device_attr.max_sge_rd)
    segs = [p.client_lmr[i * 8:i * 8 + 8] for i in range(32)]
    p.server_lmr.memoryview()[0:256] = pattern(256, 9)
    p.client.post_rdma_read(segs, p.server_lmr.remote()[0:256])
    (await one(p.client.request_evd)).raise_for_status()
    assert bytes(p.client_lmr.memoryview()[0:256]) == pattern(256, 9)


@pytest.mark.parametrize("fault", ["wrong_key", "out_of_range", "no_remote_write"])
async def test_remote_access_errors_name_the_status(ia: Any, fault: str) -> None:
    p = await make_ep_pair(ia, 4096)
    remote = p.server_lmr.remote()
    if fault == "wrong_key":
        remote = aiodat.RemoteRegion(remote.address, remote.length, remote.rmr_context ^ 0x5A5A00)
    elif fault == "out_of_range":
        remote = aiodat.RemoteRegion(remote.address + 4096 - 8, 4096, remote.rmr_context)
    else:
        read_only = p.pz.register(bytearray(4096), Privileges.LOCAL_WRITE | Privileges.REMOTE_READ)
        remote = read_only.remote()
    p.client.post_rdma_write(p.client_lmr[0:64], remote, cookie=fault)
    ev = await one(p.client.request_evd)
    assert not ev.ok and ev.status == "IBV_WC_REM_ACCESS_ERR"
    with pytest.raises(aiodat.DTOError, match="IBV_WC_REM_ACCESS_ERR") as info:
        ev.raise_for_status()
    assert info.value.cookie is None or info.value.cookie == fault
    assert bytes(p.server_lmr.memoryview()) == bytes(4096)  # nothing was written


async def test_suppress_gives_no_event_on_success_but_reports_failure(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    p.client_lmr.memoryview()[0:8] = b"ABCDEFGH"
    p.client.post_rdma_write(p.client_lmr[0:8], p.server_lmr.remote(), "quiet", CompletionFlags.SUPPRESS)
    p.client.post_rdma_write(p.client_lmr[0:4], p.server_lmr.remote()[100:], "loud")
    events = await p.client.request_evd.wait(1, timeout=T)
    assert [e.cookie for e in events] == ["loud"]
    await asyncio.sleep(0.2)
    assert p.client.request_evd.dequeue() is None
    assert bytes(p.server_lmr.memoryview()[0:8]) == b"ABCDEFGH"  # the suppressed write did happen
    assert p.client.query().outstanding_requests == 0  # retired by the later completion
    # a failing suppressed request still completes, with its status
    bad = aiodat.RemoteRegion(p.server_lmr.address, 64, p.server_lmr.rmr_context ^ 0x100)
    p.client.post_rdma_write(p.client_lmr[0:8], bad, "bad", CompletionFlags.SUPPRESS)
    ev = await one(p.client.request_evd)
    assert ev.cookie == "bad" and ev.status == "IBV_WC_REM_ACCESS_ERR"


async def test_unsignalled_is_queued_without_waking_a_waiter(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    evd = p.client.request_evd
    waiter = asyncio.ensure_future(evd.wait(1, timeout=T))
    await asyncio.sleep(0.05)
    p.client.post_rdma_write(p.client_lmr[0:8], p.server_lmr.remote(), "u", CompletionFlags.UNSIGNALLED)
    await asyncio.sleep(1.0)  # ample time for the write to complete under TCG
    assert not waiter.done()  # queued but it did not wake the waiter
    assert evd.query().queued == 1
    p.client.post_rdma_write(p.client_lmr[8:16], p.server_lmr.remote()[8:], "s")
    events = await asyncio.wait_for(waiter, T)
    assert [e.cookie for e in events] == ["u", "s"]  # delivered with the next notifying event
    assert all(e.ok for e in events)
    # dequeue() returns an unsignalled completion too
    p.client.post_rdma_write(p.client_lmr[0:8], p.server_lmr.remote(), "u2", CompletionFlags.UNSIGNALLED)
    deadline = time.monotonic() + T
    ev = None
    while ev is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        ev = evd.dequeue()
    assert ev is not None and ev.cookie == "u2" and ev.ok


async def test_solicited_wait_ends_early_only_on_solicited(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    rx = p.server.recv_evd
    for i in range(4):
        p.server.post_recv(p.server_lmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    p.client_lmr.memoryview()[0:4] = b"ping"
    waiter = asyncio.ensure_future(rx.wait(3, timeout=T, solicited_only=True))
    await asyncio.sleep(0.05)
    p.client.post_send(p.client_lmr[0:4], "a")  # not solicited
    await asyncio.sleep(1.0)
    assert not waiter.done()  # one unsolicited receive (threshold 3) does not end it
    p.client.post_send(p.client_lmr[0:4], "b", CompletionFlags.SOLICITED_WAIT)
    events = await asyncio.wait_for(waiter, T)
    assert [e.cookie for e in events] == ["r0", "r1"]  # ended below threshold by the solicited one
    # the EVD is armed for solicited completions now: another unsolicited one does not end a wait
    waiter = asyncio.ensure_future(rx.wait(3, timeout=T, solicited_only=True))
    await asyncio.sleep(0.05)
    p.client.post_send(p.client_lmr[0:4], "c")
    await asyncio.sleep(1.0)
    assert not waiter.done()
    p.client.post_send(p.client_lmr[0:4], "d", CompletionFlags.SOLICITED_WAIT)
    events = await asyncio.wait_for(waiter, T)
    assert [e.cookie for e in events] == ["r2", "r3"]
    for _ in range(4):
        await one(p.client.request_evd)


async def test_solicited_wait_that_returns_at_once_leaves_the_next_wait_plain(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    rx = p.server.recv_evd
    for i in range(4):
        p.server.post_recv(p.server_lmr[i * 64:(i + 1) * 64], cookie=f"r{i}")
    p.client.post_send(p.client_lmr[0:4], "a")
    assert [e.cookie for e in await rx.wait(1, timeout=T)] == ["r0"]  # the EVD is on the loop, armed for all
    p.client.post_send(p.client_lmr[0:4], "b")
    await asyncio.sleep(1.0)  # the reader callback queues r1 and re-arms
    # r1 is queued already: this solicited wait returns without sleeping
    assert [e.cookie for e in await rx.wait(1, timeout=T, solicited_only=True)] == ["r1"]
    # A plain wait for two unsolicited receives must wake on both.  Were the EVD still in
    # solicited mode, the first one's drain would re-arm the CQ for solicited completions
    # only and the second would never raise an event (no timeout here to rescue it).
    waiter = asyncio.ensure_future(rx.wait(2))
    await asyncio.sleep(0.05)
    p.client.post_send(p.client_lmr[0:4], "c")
    await asyncio.sleep(1.0)  # c's drain (and re-arm) happens before d is sent
    assert not waiter.done()
    p.client.post_send(p.client_lmr[0:4], "d")
    try:
        events = await asyncio.wait_for(waiter, T)
    finally:
        waiter.cancel()
    assert [e.cookie for e in events] == ["r2", "r3"]
    for _ in range(4):
        await one(p.client.request_evd)


async def test_barrier_fence_sends_what_a_read_fetched(ia: Any) -> None:
    p = await make_ep_pair(ia, 1 << 16)
    p.server_lmr.memoryview()[0:32768] = pattern(32768, 11)
    stage = p.client_lmr[0:32768]
    # read remote [0:32K) into the staging area, then write the staging area to remote [32K:64K):
    # without the fence the write may go out before the read data has landed
    p.client.post_rdma_read(stage, p.server_lmr.remote()[0:32768], "read")
    p.client.post_rdma_write(stage, p.server_lmr.remote()[32768:], "write", CompletionFlags.BARRIER_FENCE)
    events = await p.client.request_evd.wait(2, timeout=T)
    assert [e.cookie for e in events] == ["read", "write"] and all(e.ok for e in events)
    assert bytes(p.server_lmr.memoryview()[32768:]) == pattern(32768, 11)


async def test_batch_writes_64mib_checksum(ia: Any) -> None:
    size, chunk = 64 << 20, 1 << 20
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_dtos=128))
    src = bytearray(size)
    for i in range(0, size, 1 << 16):  # cheap, position-dependent content
        src[i:i + 16] = i.to_bytes(8, "little") * 2
    src_lmr = p.pz.register(src, Privileges.LOCAL_WRITE)
    dst_lmr = p.pz.register(bytearray(size), Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE
                            | Privileges.REMOTE_READ)
    remote = dst_lmr.remote()
    items = [(src_lmr[o:o + chunk], remote[o:o + chunk], o) for o in range(0, size, chunk)]
    # post in batches of 16, only the last of each batch signalled: in two calls, or in one with last_flags
    done = 0
    for b in range(0, len(items), 16):
        batch = items[b:b + 16]
        if b % 32:
            assert p.client.post_rdma_write_batch(batch, CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT) == 16
        else:
            assert p.client.post_rdma_write_batch(batch[:-1], CompletionFlags.SUPPRESS) == len(batch) - 1
            assert p.client.post_rdma_write_batch(batch[-1:]) == 1
        ev = (await one(p.client.request_evd)).raise_for_status()
        assert ev.cookie == batch[-1][2]
        done += len(batch)
    assert done == size // chunk
    assert zlib.crc32(dst_lmr.memoryview()) == zlib.crc32(src)
    # and the last 16 MiB back with one batch of reads
    back_size = 16 << 20
    back = p.pz.register(bytearray(back_size), Privileges.LOCAL_WRITE)
    base = size - back_size
    reads = [(back[o:o + chunk], remote[base + o:base + o + chunk], o) for o in range(0, back_size, chunk)]
    assert p.client.post_rdma_read_batch(reads) == 16
    events = await p.client.request_evd.wait(16, timeout=T)
    assert [e.cookie for e in events] == [r[2] for r in reads]
    assert all(e.ok and e.transferred_length == chunk for e in events)
    assert zlib.crc32(back.memoryview()) == zlib.crc32(memoryview(src)[base:])


async def test_batch_of_one_buffer_signals_only_the_last(ia: Any) -> None:
    """32 sends of one segment in one call with last_flags: one completion (the last cookie), which
    retires the other 31; 32 receives into one segment in one call complete in order."""
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_dtos=64, max_recv_dtos=64))
    seg = p.client_lmr[0:64]
    p.client_lmr.memoryview()[0:64] = bytes(range(64))
    assert p.server.post_recv_batch([(p.server_lmr[0:64], i) for i in range(32)]) == 32
    assert p.client.post_send_batch([(seg, i) for i in range(32)], CompletionFlags.SUPPRESS,
                                    last_flags=CompletionFlags.DEFAULT) == 32
    ev = (await one(p.client.request_evd)).raise_for_status()
    assert ev.cookie == 31 and ev.transferred_length == 64
    received = await p.server.recv_evd.wait(32, timeout=T)
    assert [e.cookie for e in received] == list(range(32)) and all(e.ok for e in received)
    assert bytes(p.server_lmr.memoryview()[0:64]) == bytes(range(64))
    assert p.client.query().outstanding_requests == 0 and p.server.query().outstanding_recvs == 0
    assert p.client.request_evd.dequeue() is None  # the 31 suppressed sends produced nothing
    with pytest.raises(aiodat.InvalidParameter, match="last_flags"):
        p.client.post_send_batch([(seg, 0)], CompletionFlags.SUPPRESS, last_flags="signal")
    # items that are not (segments, cookie) pairs: a clear error, and nothing posted
    for bad in ([seg], [(seg, 1, 2)], 5, [(seg, 0), (seg,)]):
        with pytest.raises(aiodat.InvalidParameter, match="pairs"):
            p.client.post_send_batch(bad)
        with pytest.raises(aiodat.InvalidParameter, match="pairs"):
            p.server.post_recv_batch(bad)
    assert p.client.query().outstanding_requests == 0 and p.server.query().outstanding_recvs == 0
    # receives into one segment object (one scatter list for all), from a generator
    rseg = p.server_lmr[64:128]
    assert p.server.post_recv_batch((rseg, f"r{i}") for i in range(8)) == 8
    assert p.client.post_send_batch([(seg, i) for i in range(8)]) == 8
    received = await p.server.recv_evd.wait(8, timeout=T)
    assert [e.cookie for e in received] == [f"r{i}" for i in range(8)] and all(e.ok for e in received)
    assert [e.cookie for e in await p.client.request_evd.wait(8, timeout=T)] == list(range(8))
    assert bytes(p.server_lmr.memoryview()[64:128]) == bytes(range(64))
    p.client_lmr.free()  # nothing of it is in flight any more


async def test_a_failure_inside_a_batch_gives_each_request_its_event(ia: Any) -> None:
    """A batch on one segment with all but the last suppressed is one send-queue entry (wr.SendRun).
    Retired whole by a later request's completion; and when its first write fails (a wrong rkey)
    and the other 7 are flushed, each comes back with its own cookie, in order; nothing stays in flight."""
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_dtos=64))
    seg, good = p.client_lmr[0:64], p.server_lmr.remote()
    suppress = CompletionFlags.SUPPRESS
    assert p.client.post_rdma_write_batch([(seg, good, i) for i in range(8)], suppress, suppress) == 8
    p.client.post_rdma_write(seg, good, "after")
    assert p.client.query().outstanding_requests == 9
    ev = (await one(p.client.request_evd)).raise_for_status()
    assert ev.cookie == "after" and p.client.query().outstanding_requests == 0
    bad = aiodat.RemoteRegion(good.address, good.length, good.rmr_context ^ 0x5A5A00)
    assert p.client.post_rdma_write_batch([(seg, bad, i) for i in range(8)], suppress,
                                          CompletionFlags.DEFAULT) == 8
    assert p.client.query().outstanding_requests == 8
    events: list = []
    while len(events) < 8:
        events += await p.client.request_evd.wait(timeout=T)
    assert [e.cookie for e in events] == list(range(8))
    assert events[0].status == "IBV_WC_REM_ACCESS_ERR"
    assert all(e.status == "IBV_WC_WR_FLUSH_ERR" for e in events[1:])
    assert p.client.query().outstanding_requests == 0
    p.client_lmr.free()  # nothing of it is in flight any more


async def test_lmr_same_buffer_twice_and_sync(ia: Any) -> None:
    p = await make_ep_pair(ia, 4096)
    buf = bytearray(4096)
    a = p.pz.register(buf, Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE)
    b = p.pz.register(buf, Privileges.LOCAL_WRITE | Privileges.REMOTE_READ)
    assert a.address == b.address and a.rmr_context != b.rmr_context
    # write through one registration, read back through the other
    p.client_lmr.memoryview()[0:32] = pattern(32, 4)
    a.sync_rdma_write()
    p.client.post_rdma_write(p.client_lmr[0:32], a.remote()[0:32])
    (await one(p.client.request_evd)).raise_for_status()
    b.sync_rdma_read()
    p.client.post_rdma_read(p.client_lmr[100:132], b.remote()[0:32])
    (await one(p.client.request_evd)).raise_for_status()
    assert bytes(buf[0:32]) == pattern(32, 4) == bytes(p.client_lmr.memoryview()[100:132])
    a.free()
    assert bytes(b.memoryview()[0:32]) == pattern(32, 4)  # the other registration still works
    with pytest.raises(aiodat.InvalidHandle):
        a.sync_rdma_read()
    with pytest.raises(aiodat.InvalidHandle):
        a.sync_rdma_write()


def test_max_lmr_block_size_is_honoured(ia: Any) -> None:
    # rxe's max_mr_size is 2**64-1, beyond any buffer: lower the IA's copy of the device
    # attributes (aiodat's own model, not verbs) to see the limit enforced before ibv_reg_mr
    pz = ia.create_pz()
    real = ia._device_attr.max_mr_size
    assert ia.query().ia_attr.max_lmr_block_size in (real, None)  # None: DAT_VALUE_UNKNOWN
    ia._device_attr.max_mr_size = 4096
    try:
        with pytest.raises(aiodat.LengthError, match="max_lmr_block_size 4096"):
            pz.register(bytearray(4097))
        assert pz.register(bytearray(4096)).length == 4096
    finally:
        ia._device_attr.max_mr_size = real
