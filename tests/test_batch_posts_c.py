"""The batch posts on one segment in C (aiodat/_shim/posts.c: post_batch, post_recv_batch), on rxe.

A batch whose items are a list or tuple each on one segment, the very same one (and remote region)
or one of its own (a pool of buffers), is checked, posted and recorded in C.  Each test here puts
it beside post.py's general path, which takes the same items from a generator: the two must
record the same queue entries, in-flight counts and UNSIGNALLED marks, give the same events,
refuse the same misuse with the same error, and record exactly what went when the queue refuses
a batch part way."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest

import aiodat
import aiodat.post
from aiodat import CompletionFlags, DTOOp, EPAttr, QueueFull
from aiodat.testing.plugin import make_ep_pair
from aiodat.wr import SendRun

pytestmark = pytest.mark.rxe

T = 30
SUPPRESS, UNSIGNALLED, DEFAULT = CompletionFlags.SUPPRESS, CompletionFlags.UNSIGNALLED, CompletionFlags.DEFAULT


def relative(entries: List[Tuple[Any, ...]], first: int) -> List[Tuple[Any, ...]]:
    """Queue entries with wr_ids (and a run's bounds) counted from ``first``, to compare two batches."""
    out = []
    for entry in entries:
        wr_id, rest = entry[0], list(entry[1:])
        if len(entry) == 5 and type(entry[4]) is SendRun:
            rest[3] = ("run", entry[4].base - first, entry[4].last - first)
        out.append((wr_id - first, *rest))
    return out


def post_twice(ep: Any, queue: str, post: Callable[[Any], int], items: List[Any], calls: List[int]
               ) -> List[Dict[str, Any]]:
    """Post ``items`` through C (the list) and then through the general path (a generator of the same
    items); what each recorded."""
    seen = []
    for form in (list, iter):
        q = getattr(ep, queue)
        before_q, before_quiet, before_calls = len(q), set(ep._quiet), calls[0]
        lmr = items[0][0].lmr
        before_inflight = lmr._inflight
        assert post(form(items)) == len(items)
        new = list(q)[before_q:]
        first = new[0][0]
        seen.append({
            "entries": relative(new, first),
            "quiet": sorted(i - first for i in ep._quiet - before_quiet),
            "inflight": lmr._inflight - before_inflight,
            "general": calls[0] > before_calls,
        })
    assert [s.pop("general") for s in seen] == [False, True], "the list took C, the generator Python"
    return seen


async def both_batches_complete(p: Any, end: Any, n: int, flags: Any, last_flags: Any) -> None:
    """After two batches of ``n`` on the client (through C, then the general path): a signalled write
    to ``end`` behind them gives its event last, after every event of theirs (UNSIGNALLED ones do not
    wake a wait by themselves), the same for both batches, and retires what was suppressed."""
    p.client.post_rdma_write(p.client_lmr[0:8], end, "end")
    events: List[Any] = []
    while not events or events[-1].cookie != "end":
        events += await p.client.request_evd.wait(timeout=T)
    events.pop()
    last = flags if last_flags is None else last_flags
    per_batch = (n - 1) * (not flags & SUPPRESS) + (not last & SUPPRESS)
    assert len(events) == 2 * per_batch and all(e.ok for e in events)
    assert [e.cookie for e in events[:per_batch]] == [e.cookie for e in events[per_batch:]]
    assert p.client.query().outstanding_requests == 0 and not p.client._quiet


FLAGS = [(DEFAULT, None), (SUPPRESS, DEFAULT), (UNSIGNALLED, DEFAULT), (DEFAULT, UNSIGNALLED), (SUPPRESS, SUPPRESS)]


@pytest.mark.parametrize("op", ["send", "write", "read"])
@pytest.mark.parametrize("flags,last_flags", FLAGS)
@pytest.mark.parametrize("n", [1, 70])
async def test_a_send_side_batch_records_what_the_general_path_records(ia: Any, general_path_calls: List[int],
                                                                       op: str, flags: Any, last_flags: Any,
                                                                       n: int) -> None:
    """Sends, RDMA writes and RDMA reads on one segment (70: more than one chained post of 64) record
    the same entries (one wr.SendRun when all but the last are suppressed), marks and in-flight
    counts as the general path; both batches complete with the same events, the bytes arrive, and
    nothing stays in flight."""
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_dtos=160, max_recv_dtos=160))
    try:
        calls = general_path_calls
        seg = p.client_lmr[0:48]
        p.client_lmr.memoryview()[0:48] = bytes(range(48))
        p.server_lmr.memoryview()[0:48] = bytes(range(100, 148))
        remote = p.server_lmr.remote()[0:48]
        if op == "send":
            assert p.server.post_recv_batch([(p.server_lmr[64:128], f"r{i}") for i in range(2 * n)]) == 2 * n
            items: List[Any] = [(seg, i) for i in range(n)]
            post = lambda it: p.client.post_send_batch(it, flags, last_flags)  # noqa: E731
        else:
            items = [(seg, remote, i) for i in range(n)]
            batch = p.client.post_rdma_write_batch if op == "write" else p.client.post_rdma_read_batch
            post = lambda it: batch(it, flags, last_flags)  # noqa: E731
        by_c, by_python = post_twice(p.client, "_send_q", post, items, calls)
        assert by_c == by_python
        assert by_c["inflight"] == n
        expected_op = {"send": DTOOp.SEND, "write": DTOOp.RDMA_WRITE, "read": DTOOp.RDMA_READ}[op]
        assert all(e[2] is expected_op for e in by_c["entries"])
        assert len(by_c["entries"]) == (1 if n > 1 and flags & SUPPRESS else n)
        await both_batches_complete(p, p.server_lmr.remote()[256:264], n, flags, last_flags)
        assert p.client_lmr._inflight == 0
        if op == "send":
            received = await p.server.recv_evd.wait(2 * n, timeout=T)
            assert [e.cookie for e in received] == [f"r{i}" for i in range(2 * n)]
            assert bytes(p.server_lmr.memoryview()[64:112]) == bytes(range(48))
        elif op == "write":
            assert bytes(p.server_lmr.memoryview()[0:48]) == bytes(range(48))
        else:
            assert bytes(p.client_lmr.memoryview()[0:48]) == bytes(range(100, 148))
    finally:
        p.close()


@pytest.mark.parametrize("n", [1, 70])
async def test_a_receive_batch_records_what_the_general_path_records(ia: Any, general_path_calls: List[int],
                                                                     n: int) -> None:
    """Receives into one segment record the same entries and in-flight counts as the general path,
    and complete in order with their cookies."""
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_dtos=160, max_recv_dtos=160))
    try:
        calls = general_path_calls
        items = [(p.server_lmr[0:64], f"r{i}") for i in range(n)]
        items = [(items[0][0], cookie) for _, cookie in items]  # the very same segment object
        by_c, by_python = post_twice(p.server, "_recv_q", p.server.post_recv_batch, items, calls)
        assert by_c == by_python and by_c["inflight"] == n and len(by_c["entries"]) == n
        assert p.client.post_send_batch([(p.client_lmr[0:8], i) for i in range(2 * n)], SUPPRESS, DEFAULT) == 2 * n
        received = await p.server.recv_evd.wait(2 * n, timeout=T)
        assert [e.cookie for e in received] == [f"r{i}" for i in range(n)] * 2 and all(e.ok for e in received)
        assert p.server.query().outstanding_recvs == 0 and p.server_lmr._inflight == 0
        await p.client.request_evd.wait(1, timeout=T)
    finally:
        p.close()


@pytest.mark.parametrize("n", [2, 70])
async def test_a_receive_batch_on_a_pool_records_what_the_general_path_records(ia: Any,
                                                                               general_path_calls: List[int],
                                                                               n: int) -> None:
    """Receives each into a slice of its own (a pool of buffers, over two LMRs taken in turn) record
    the same entries and in-flight counts through C as through the general path, and complete in
    order with their cookies into their own slices."""
    p = await make_ep_pair(ia, 64 * 70, EPAttr(max_request_dtos=160, max_recv_dtos=160))
    second = p.pz.register(bytearray(64 * 70), aiodat.Privileges.ALL)
    try:
        calls = general_path_calls
        pools = (p.server_lmr, second)
        items = [(pools[i % 2][64 * i:64 * i + 64], f"r{i}") for i in range(n)]
        seen = []
        for form in (list, iter):
            before, steps = len(p.server._recv_q), calls[0]
            inflight = [lmr._inflight for lmr in pools]
            assert p.server.post_recv_batch(form(items)) == n
            new = list(p.server._recv_q)[before:]
            seen.append((relative(new, new[0][0]), [lmr._inflight - i for lmr, i in zip(pools, inflight)],
                         calls[0] > steps))
        assert [s[2] for s in seen] == [False, True], "the list took C, the generator Python"
        assert seen[0][:2] == seen[1][:2]
        assert seen[0][1] == [(n + 1) // 2, n // 2] and seen[0][0][1] == (2, "r1", (items[1][0],))
        payload = [bytes([i]) * 8 for i in range(2 * n)]
        for i, data in enumerate(payload):
            p.client_lmr.memoryview()[8 * i:8 * i + 8] = data
        assert p.client.post_send_batch([(p.client_lmr[8 * i:8 * i + 8], i) for i in range(2 * n)], SUPPRESS,
                                        DEFAULT) == 2 * n
        received: List[Any] = []
        while len(received) < 2 * n:
            received += await p.server.recv_evd.wait(timeout=T)
        assert [e.cookie for e in received] == [f"r{i}" for i in range(n)] * 2
        assert all(event.ok and event.transferred_length == 8 for event in received)
        for i in range(n):  # each slice holds the bytes of the second round's message to it
            assert bytes(pools[i % 2].memoryview()[64 * i:64 * i + 8]) == payload[n + i]
        assert p.server_lmr._inflight == 0 and second._inflight == 0 and not p.server._recv_q
        await p.client.request_evd.wait(1, timeout=T)
    finally:
        p.close()  # (the PZ frees the second LMR with it)


@pytest.mark.parametrize("op", ["send", "write", "read"])
@pytest.mark.parametrize("flags,last_flags", FLAGS)
@pytest.mark.parametrize("n", [2, 70])
async def test_a_send_side_batch_on_a_pool_records_what_the_general_path_records(
        ia: Any, general_path_calls: List[int], op: str, flags: Any, last_flags: Any, n: int) -> None:
    """Sends, RDMA writes and RDMA reads each from a slice of its own (a pool of buffers over two LMRs
    taken in turn), the RDMA ones each to a remote slice of its own, record the same entries (one per
    request), UNSIGNALLED marks and in-flight counts through C as through the general path; both
    batches complete with the same events, and each request's bytes land in their own slice."""
    p = await make_ep_pair(ia, 64 * 70, EPAttr(max_request_dtos=160, max_recv_dtos=160))
    second = p.pz.register(bytearray(64 * 70), aiodat.Privileges.ALL)
    aside = p.pz.register(bytearray(64), aiodat.Privileges.ALL)  # the second sends' and the last write's
    try:
        calls = general_path_calls
        pools = (p.client_lmr, second)
        local = [pools[i % 2][64 * i:64 * i + 48] for i in range(n)]
        for i, seg in enumerate(local):
            seg.lmr.memoryview()[seg.offset:seg.offset + 48] = bytes([i + 1]) * 48
            p.server_lmr.memoryview()[64 * i:64 * i + 48] = bytes([200 - i]) * 48
        if op == "send":
            assert p.server.post_recv_batch([(p.server_lmr[64 * i:64 * i + 64], f"r{i}") for i in range(n)]
                                            + [(aside[0:64], "again")] * n) == 2 * n
            items: List[Any] = [(seg, i) for i, seg in enumerate(local)]
            post = lambda it: p.client.post_send_batch(it, flags, last_flags)  # noqa: E731
        else:
            whole = p.server_lmr.remote()
            items = [(seg, whole[64 * i:64 * i + 48], i) for i, seg in enumerate(local)]
            batch = p.client.post_rdma_write_batch if op == "write" else p.client.post_rdma_read_batch
            post = lambda it: batch(it, flags, last_flags)  # noqa: E731
        seen = []
        for form in (list, iter):
            before_q, before_quiet, steps = len(p.client._send_q), set(p.client._quiet), calls[0]
            inflight = [lmr._inflight for lmr in pools]
            assert post(form(items)) == n
            new = list(p.client._send_q)[before_q:]
            first = new[0][0]
            seen.append((relative(new, first), sorted(i - first for i in p.client._quiet - before_quiet),
                         [lmr._inflight - i for lmr, i in zip(pools, inflight)], calls[0] > steps))
        assert [s[3] for s in seen] == [False, True], "the list took C, the generator Python"
        assert seen[0][:3] == seen[1][:3]
        expected_op = {"send": DTOOp.SEND, "write": DTOOp.RDMA_WRITE, "read": DTOOp.RDMA_READ}[op]
        entries, _, inflight = seen[0][:3]
        assert len(entries) == n and inflight == [(n + 1) // 2, n // 2]
        assert all(e[1] == i and e[2] is expected_op and e[3] == (local[i],) for i, e in enumerate(entries))
        await both_batches_complete(p, aside.remote()[0:8], n, flags, last_flags)
        assert p.client_lmr._inflight == 0 and second._inflight == 0
        if op == "send":
            received = await p.server.recv_evd.wait(2 * n, timeout=T)
            assert [e.cookie for e in received] == [f"r{i}" for i in range(n)] + ["again"] * n
            assert all(e.transferred_length == 48 for e in received)
        for i, seg in enumerate(local):  # each request's bytes in their own slice
            if op == "read":
                assert bytes(seg.lmr.memoryview()[seg.offset:seg.offset + 48]) == bytes([200 - i]) * 48
            else:
                assert bytes(p.server_lmr.memoryview()[64 * i:64 * i + 48]) == bytes([i + 1]) * 48
    finally:
        p.close()  # (the PZ frees the other LMRs with it)


async def test_a_batch_the_queue_refuses_part_way_records_what_went(ia: Any) -> None:
    """A batch longer than the queue has room for: QueueFull says how many went, and exactly those
    are recorded (the writes as one run, all suppressed), so they complete and retire normally."""
    p = await make_ep_pair(ia, 4096, EPAttr(max_request_dtos=16, max_recv_dtos=16))
    try:
        seg, remote = p.client_lmr[0:8], p.server_lmr.remote()[0:8]
        n = 4 * 16 + 64  # (the device may round a queue up)
        with pytest.raises(QueueFull, match=r"post_recv_batch \(posted (\d+) of 128\): the queue is full") as info:
            p.server.post_recv_batch([(p.server_lmr[0:64], i) for i in range(n)])
        went = int(str(info.value).split("posted ")[1].split(" ")[0])
        assert 16 <= went < n
        assert len(p.server._recv_q) == went and p.server_lmr._inflight == went
        with pytest.raises(QueueFull, match=r"post rdma_write batch \(posted (\d+) of 128\)") as info:
            p.client.post_rdma_write_batch([(seg, remote, i) for i in range(n)], SUPPRESS, DEFAULT)
        sent = int(str(info.value).split("posted ")[1].split(" ")[0])
        assert 16 <= sent < n
        (entry,) = p.client._send_q
        assert type(entry[4]) is SendRun and entry[1] == tuple(range(sent))
        assert p.client.query().outstanding_requests == sent and p.client_lmr._inflight == sent
        # the run has no signalled request: a later one's completion retires it
        p.client.post_rdma_write(seg, remote, "after")
        (ev,) = await p.client.request_evd.wait(1, timeout=T)
        assert ev.cookie == "after" and ev.ok and p.client.query().outstanding_requests == 0
        assert p.client.post_send_batch([(seg, i) for i in range(went)], SUPPRESS, DEFAULT) == went
        received = []
        while len(received) < went:
            received += await p.server.recv_evd.wait(timeout=T)
        assert [e.cookie for e in received] == list(range(went))
        (ev,) = await p.client.request_evd.wait(1, timeout=T)
        assert ev.cookie == went - 1
        assert p.client_lmr._inflight == 0 and p.server_lmr._inflight == 0
    finally:
        p.close()


async def test_a_pool_batch_the_queue_refuses_part_way_records_what_went(ia: Any) -> None:
    """RDMA writes each from a slice of its own, more than the queue has room for: QueueFull says how
    many went, exactly those are recorded (an entry each, the LMR counting them in flight), and they
    complete and retire normally: the last that went carries ``last_flags``, so its completion
    retires the others (a queue full of suppressed requests could take no signalled one)."""
    p = await make_ep_pair(ia, 8 * 128, EPAttr(max_request_dtos=16, max_recv_dtos=16))
    try:
        n = 4 * 16 + 64  # (the device may round a queue up)
        whole = p.server_lmr.remote()
        items = [(p.client_lmr[8 * i:8 * i + 8], whole[8 * i:8 * i + 8], i) for i in range(n)]
        with pytest.raises(QueueFull, match=r"post rdma_write batch \(posted (\d+) of 128\)") as info:
            p.client.post_rdma_write_batch(items, SUPPRESS, DEFAULT)
        went = int(str(info.value).split("posted ")[1].split(" ")[0])
        assert 16 <= went < n
        assert [(e[1], e[3]) for e in p.client._send_q] == [(i, (items[i][0],)) for i in range(went)]
        assert p.client.query().outstanding_requests == went and p.client_lmr._inflight == went
        (ev,) = await p.client.request_evd.wait(1, timeout=T)  # the last that went: it retires the others
        assert ev.cookie == went - 1 and ev.ok
        assert p.client.query().outstanding_requests == 0 and p.client_lmr._inflight == 0
        p.client.post_rdma_write(p.client_lmr[0:8], whole[0:8], "after")
        (ev,) = await p.client.request_evd.wait(1, timeout=T)
        assert ev.cookie == "after" and ev.ok
    finally:
        p.close()


@pytest.mark.parametrize("op", ["send", "write", "recv", "send-each", "write-each"])
async def test_items_emptied_during_the_post_keep_their_segment_and_cookies(ia: Any, op: str) -> None:
    """posts.c holds the batch's segments, remote regions and cookies for the whole post: Python that
    runs inside it (an LMR attribute read, from a subclass) may empty the items list, which held
    their last references.  The batch is posted and recorded intact, and carries the bytes.
    ``...-each``: every item has a Segment object of its own (over the same bytes)."""
    p = await make_ep_pair(ia)
    try:
        sender, receiver = p.client, p.server
        lmr = p.client_lmr if op != "recv" else p.server_lmr
        items: List[Any] = []

        class EmptiesTheItems(type(lmr)):  # type: ignore[misc]
            @property
            def address(self) -> int:
                items.clear()  # the list held the only references to the segment and the cookies
                return int(self.__dict__["address"])

            @address.setter
            def address(self, value: int) -> None:
                self.__dict__["address"] = value

        p.client_lmr.memoryview()[:16] = b"kept-its-segment"
        if op != "recv":
            receiver.post_recv_batch([(p.server_lmr[0:64], "r")] * 3)
        each = op.endswith("-each")
        segs = [lmr[0:16] for _ in range(3)] if each else [lmr[0:16]] * 3
        remotes = [p.server_lmr.remote()[0:16] for _ in range(3)] if each else [p.server_lmr.remote()[0:16]] * 3
        write = op.startswith("write")
        items.extend((seg, remote, [f"c{i}"]) if write else (seg, [f"c{i}"])
                     for i, (seg, remote) in enumerate(zip(segs, remotes)))
        del segs, remotes
        plain = type(lmr)
        lmr.__class__ = EmptiesTheItems
        try:
            if op.startswith("send"):
                assert sender.post_send_batch(items) == 3
            elif write:
                assert sender.post_rdma_write_batch(items) == 3
            else:
                assert receiver.post_recv_batch(items) == 3
        finally:
            lmr.__class__ = plain
        assert not items
        q = receiver._recv_q if op == "recv" else sender._send_q
        segs = [entry[2] if op == "recv" else entry[3] for entry in q][-3:]
        assert all(s[0].lmr is lmr and (s[0].offset, s[0].length) == (0, 16) for s in segs)
        if op == "recv":
            assert sender.post_send_batch([(p.client_lmr[0:16], i) for i in range(3)]) == 3
        done = await (receiver.recv_evd if op == "recv" else sender.request_evd).wait(3, timeout=T)
        assert [e.cookie for e in done] == [["c0"], ["c1"], ["c2"]]
        assert bytes(p.server_lmr.memoryview()[:16]) == b"kept-its-segment"
    finally:
        p.close()


SEND_SIDE_MISUSE = ["closed-ep", "freed-lmr", "other-pz", "bad-flags", "bad-last-flags", "unconnected", "not-pairs"]
MISUSE = ([(send, case) for send in ("send", "send-each") for case in SEND_SIDE_MISUSE]
          + [(write, case) for write in ("write", "write-each")
             for case in SEND_SIDE_MISUSE + ["short-remote", "not-a-remote"]]
          + [(recv, case) for recv in ("recv", "recv-each") for case in ["closed-ep", "freed-lmr", "other-pz",
                                                                         "not-pairs"]])


@pytest.mark.parametrize("op,case", MISUSE)
async def test_misuse_of_a_batch_on_one_segment_is_refused_recording_nothing(ia: Any, op: str, case: str) -> None:
    """Every misuse of a one-segment batch is left by C to the general path, which refuses it with the
    error it always gave: nothing is posted or recorded, nothing stays in flight.  ``...-each``: a
    batch on a segment (and remote region) of its own per item, the bad one third among good ones."""
    p = await make_ep_pair(ia)
    other_pz = ia.create_pz()
    other = other_pz.register(bytearray(64), aiodat.Privileges.ALL)
    unconnected = None
    try:
        ep = p.server if op.startswith("recv") else p.client
        lmr = p.server_lmr if op.startswith("recv") else p.client_lmr
        seg, remote, flags, last_flags = lmr[0:32], p.server_lmr.remote()[0:32], DEFAULT, None
        expected: Any = aiodat.InvalidParameter
        match = ""
        if case == "closed-ep":
            ep.close()
            expected, match = aiodat.InvalidHandle, "closed"
        elif case == "freed-lmr":
            spare = p.pz.register(bytearray(64), aiodat.Privileges.ALL)
            seg = spare[0:32]
            spare.free()
            expected, match = aiodat.InvalidHandle, "closed"
        elif case == "other-pz":
            seg = other[0:32]
            expected, match = aiodat.ProtectionViolation, "another PZ"
        elif case == "short-remote":
            remote = p.server_lmr.remote()[0:16]
            expected, match = aiodat.LengthError, "remote region is only 16 bytes"
        elif case == "not-a-remote":
            remote = (remote.address, remote.length, remote.rmr_context)
            match = "RemoteRegion"
        elif case == "bad-flags":
            flags = 99
            match = "flags must be CompletionFlags"
        elif case == "bad-last-flags":
            last_flags = "signal"
            match = "last_flags must be CompletionFlags"
        elif case == "unconnected":
            ep = unconnected = ia.create_ep(p.pz)
            expected, match = aiodat.InvalidState, "state"
        write = op.startswith("write")
        items: List[Any] = [(seg, remote, i) if write else (seg, i) for i in range(4)]
        if op.endswith("-each"):  # a pool: each item its own slice of the EP's buffer, the case's third
            whole = p.server_lmr.remote()
            items = [(lmr[64 * i:64 * i + 32], whole[64 * i:64 * i + 32], i) if write else (lmr[64 * i:64 * i + 32], i)
                     for i in range(4)]
            items[2] = (seg, remote, 2) if write else (seg, 2)
        if case == "not-pairs":
            items[2] = (seg,)
            match = "items must be"
        outstanding = len(ep._send_q) + len(ep._recv_q) if case != "closed-ep" else 0
        inflight, pool_inflight = seg.lmr._inflight, lmr._inflight
        with pytest.raises(expected, match=match):
            if op.startswith("send"):
                ep.post_send_batch(items, flags, last_flags)
            elif write:
                ep.post_rdma_write_batch(items, flags, last_flags)
            else:
                ep.post_recv_batch(items)
        if case != "closed-ep":
            assert len(ep._send_q) + len(ep._recv_q) == outstanding
        assert seg.lmr._inflight == inflight and lmr._inflight == pool_inflight
    finally:
        if unconnected is not None:
            unconnected.close()
        other.free()
        p.close()
