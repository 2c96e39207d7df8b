"""An SRQ's receives in C, on rxe: the batch post on one segment (aiodat/_shim/posts.c,
srq_post_recv_batch) and the receive completion of an EP on an SRQ (completions.c, srq_event).

Each test puts the C path beside the general Python path it mirrors (srq.py's post_recv_batch
and wr.py's _completion_event): a list of items on the very same one segment takes C, a generator of the same
items the general path, and the two must record the same SRQ entries and in-flight counts, give
the same events, refuse the same misuse with the same error, and record exactly what went when
the SRQ refuses a batch part way."""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest

import aiodat.srq
from aiodat import EPState, InvalidHandle, InvalidParameter, ProtectionViolation, QueueFull
from aiodat.cm import connect_pair
from aiodat.evd import EVD
from aiodat.srq import SRQState

pytestmark = pytest.mark.rxe

T = 30.0


def counting(monkeypatch: pytest.MonkeyPatch) -> Tuple[List[int], List[int]]:
    """Count the general paths' steps: srq.py's as_segments (the post) and the completions
    EVD._queue_one turns into events (Python's side of a poll)."""
    posts, completions = [0], []
    real_segments, real_queue = aiodat.srq.as_segments, EVD._queue_one

    def counted_segments(*args: Any, **kwargs: Any) -> Any:
        posts[0] += 1
        return real_segments(*args, **kwargs)

    def counted_queue(self: EVD, ep: Any, wc: Any, queue: Any) -> bool:
        completions.append(wc[0])
        return real_queue(self, ep, wc, queue)

    monkeypatch.setattr(aiodat.srq, "as_segments", counted_segments)
    monkeypatch.setattr(EVD, "_queue_one", counted_queue)
    return posts, completions


async def connected(ia: Any, srq: Any, pz: Any) -> Tuple[Any, Any]:
    """A client EP connected to a server EP that receives from ``srq``."""
    server = ia.create_ep(pz, srq=srq)
    client = ia.create_ep(pz)
    psp = await connect_pair(client, server)
    psp.close()
    psp.cr_evd.close()
    assert server.state is EPState.CONNECTED
    return client, server


def recorded(srq: Any, before: set) -> List[Tuple[int, Any, Any]]:
    """The SRQ's entries posted since ``before`` (its wr_ids then), wr_ids counted from the first."""
    new = sorted(k for k in srq._posted if k not in before)
    return [(k - new[0], *srq._posted[k]) for k in new]


@pytest.mark.parametrize("n", [1, 70])
async def test_an_srq_batch_records_and_completes_as_the_general_path(ia: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      n: int) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 2 * n + 4)
    lmr = pz.register(bytearray(4096))
    seg = lmr[0:64]
    posts, completions = counting(monkeypatch)
    seen = []
    for form in (list, iter):  # C, then the general path
        before, inflight, steps = set(srq._posted), lmr._inflight, posts[0]
        assert srq.post_recv_batch(form([(seg, f"r{i}") for i in range(n)])) == n
        seen.append((recorded(srq, before), lmr._inflight - inflight, posts[0] > steps))
    assert seen[0][2] is False and seen[1][2] is True, "the list took C, the generator Python"
    assert seen[0][:2] == seen[1][:2] and seen[0][1] == n and len(seen[0][0]) == n
    assert seen[0][0][0] == (0, "r0", (seg,))
    steps = posts[0]
    srq.post_recv(seg, "single")  # one receive is a batch of one: C too
    assert posts[0] == steps and srq.query().outstanding_dto_count == 2 * n + 1

    client, server = await connected(ia, srq, pz)
    out = pz.register(bytearray(64))
    client.post_send(out[0:8], "first")  # the SRQ's first completion on this EP: srq.py notes its EVD
    (first,) = await server.recv_evd.wait(1, timeout=T)
    assert first.cookie == "r0" and first.ok
    first_recv = [wr_id for wr_id in completions if wr_id & 1]
    assert len(first_recv) == 1
    sent = out[0:8]  # (the very same segment: one run, one place of the client's max_request_dtos)
    assert client.post_send_batch([(sent, i) for i in range(2 * n)], aiodat.CompletionFlags.SUPPRESS,
                                  aiodat.CompletionFlags.DEFAULT) == 2 * n
    received: List[Any] = []
    while len(received) < 2 * n:
        received += await server.recv_evd.wait(timeout=T)
    cookies = [e.cookie for e in received]
    assert cookies == [f"r{i}" for i in range(1, n)] + [f"r{i}" for i in range(n)] + ["single"]
    assert all(e.ok and e.ep is server and e.transferred_length == 8 for e in received)
    recv_ids = [wr_id for wr_id in completions if wr_id & 1]
    assert recv_ids == first_recv, "every receive after the first became its event in C"
    assert not srq._posted and lmr._inflight == 0
    await client.request_evd.wait(2, timeout=T)
    await client.disconnect()
    for obj in (client, server, srq, lmr, out, pz):
        obj.free()


async def test_an_srq_batch_on_a_pool_records_and_completes_as_the_general_path(
        ia: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool: each receive into a slice of its own, over two LMRs taken in turn (an SRQ refilled
    with the buffers its completions gave back)."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 64)
    pools = (pz.register(bytearray(64 * 16)), pz.register(bytearray(64 * 16)))
    items = [(pools[i % 2][64 * i:64 * i + 64], i) for i in range(16)]
    posts, completions = counting(monkeypatch)
    seen = []
    for form in (list, iter):
        before, steps = set(srq._posted), posts[0]
        inflight = [lmr._inflight for lmr in pools]
        assert srq.post_recv_batch(form(items)) == 16
        seen.append((recorded(srq, before), [lmr._inflight - i for lmr, i in zip(pools, inflight)], posts[0] > steps))
    assert [s[2] for s in seen] == [False, True], "the list took C, the generator Python"
    assert seen[0][:2] == seen[1][:2] and seen[0][1] == [8, 8]
    assert seen[0][0][3] == (6, 3, (items[3][0],))
    client, server = await connected(ia, srq, pz)
    out = pz.register(bytearray(64))
    client.post_send_batch([(out[0:8], i) for i in range(32)], aiodat.CompletionFlags.SUPPRESS,
                           aiodat.CompletionFlags.DEFAULT)
    received: List[Any] = []
    while len(received) < 32:
        received += await server.recv_evd.wait(timeout=T)
    assert sorted(e.cookie for e in received) == sorted(list(range(16)) * 2)
    assert not srq._posted and pools[0]._inflight == pools[1]._inflight == 0
    await client.request_evd.wait(1, timeout=T)
    await client.disconnect()
    for obj in (client, server, srq, *pools, out, pz):
        obj.free()


async def test_an_srq_batch_the_srq_refuses_part_way_records_what_went(ia: Any) -> None:
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 8)
    lmr = pz.register(bytearray(4096))
    seg = lmr[0:64]
    n = 128
    with pytest.raises(QueueFull, match=r"the SRQ is full: \d+ of max_recv_dtos=\d+ buffers held.*posted (\d+) of 128") as info:
        srq.post_recv_batch([(seg, i) for i in range(n)])
    went = int(str(info.value).split("posted ")[1].split(" ")[0])
    assert 8 <= went < n
    assert sorted(cookie for cookie, _ in srq._posted.values()) == list(range(went))
    assert lmr._inflight == went and srq.query().outstanding_dto_count == went
    client, server = await connected(ia, srq, pz)
    out = pz.register(bytearray(64))
    client.post_send_batch([(out[0:8], i) for i in range(went)], aiodat.CompletionFlags.SUPPRESS,
                           aiodat.CompletionFlags.DEFAULT)
    received: List[Any] = []
    while len(received) < went:
        received += await server.recv_evd.wait(timeout=T)
    assert [e.cookie for e in received] == list(range(went))
    assert not srq._posted and lmr._inflight == 0
    await client.disconnect()
    for obj in (client, server, srq, lmr, out, pz):
        obj.free()


MISUSE: List[Tuple[str, type, str]] = [
    ("closed SRQ", InvalidHandle, "srq is closed"),
    ("freed LMR", InvalidHandle, "lmr is closed"),
    ("LMR of another PZ", ProtectionViolation, "another PZ"),
    ("SRQ in error", aiodat.InvalidState, "the SRQ is in error"),
    ("items not pairs", InvalidParameter, r"\(segments, cookie\) pairs"),
]


@pytest.mark.parametrize("pool", [False, True], ids=["one segment", "a pool"])
@pytest.mark.parametrize("case,error,match", MISUSE, ids=[m[0] for m in MISUSE])
async def test_misuse_of_an_srq_batch_is_refused_recording_nothing(ia: Any, case: str, error: type,
                                                                   match: str, pool: bool) -> None:
    """The list (C's shape) and the generator (the general path's) give the same error, and
    neither records anything; ``a pool``: each item its own slice, the bad one third."""
    pz, other = ia.create_pz(), ia.create_pz()
    srq = ia.create_srq(pz, 16)
    lmr = (other if case == "LMR of another PZ" else pz).register(bytearray(256))
    seg = lmr[0:64]
    items: List[Any] = [(seg, i) for i in range(4)]
    if case == "closed SRQ":
        srq.free()
    elif case == "freed LMR":
        lmr.free()
    elif case == "SRQ in error":
        srq._state = SRQState.ERROR  # (what IBV_EVENT_SRQ_ERR does; rxe cannot be made to raise it)
    elif case == "items not pairs":
        items = [(seg,)] * 4
    good = pz.register(bytearray(256))
    if pool:
        items = [(good[64 * i:64 * i + 64], i) for i in range(4)][:2] + [items[2]] + [(good[192:256], 3)]
    for form in (list, iter):  # type: Callable[[Any], Any]
        with pytest.raises(error, match=match):
            srq.post_recv_batch(form(items))
        assert not srq._posted and lmr._inflight == 0 and good._inflight == 0
    if case == "SRQ in error":
        srq._state = SRQState.OPERATIONAL
    for obj in (srq, lmr, good, pz, other):
        if not obj.closed:
            obj.free()
