"""A full EVD never strands aiodat's own work, on real rxe (docs/events.md, "Capacity and overflow").

DTO completions wait in the CQ while their EVD is full, until the application takes events.  Two
of aiodat's own steps cannot wait for that: the drain marker of a graceful disconnect (the DREQ
goes when it completes) and the completions an EP's close or reset must claim before its QP goes
(after it, no EP owns them).  Both poll a full EVD all the same; what they poll past ``qlen`` is
queued over it and reported as an overflow, as for an awaited ``rmr.bind``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, List

import pytest

from aiodat import EvdFlags

pytestmark = pytest.mark.rxe

T = 30.0  # generous bound for every wait: the QEMU guest runs under TCG


async def _connected(ia: Any, pz: Any, client_evd: Any = None, server_kw: Any = None) -> Any:
    server = ia.create_ep(pz, **(server_kw or {}))
    client = ia.create_ep(pz, request_evd=client_evd) if client_evd is not None else ia.create_ep(pz)
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    connecting = asyncio.ensure_future(client.connect(ia.address, psp.port, timeout=T))
    await (await cr_evd.wait_one(timeout=T)).cr.accept(server, timeout=T)
    await asyncio.wait_for(connecting, T)
    return client, server


async def test_a_graceful_disconnect_is_not_held_up_by_a_full_request_evd(ia: Any, loop_errors: List[dict]) -> None:
    """Four signalled sends complete into a request EVD of two events nobody takes; the graceful
    disconnect's drain marker completes behind them.  Its completion is polled past the full EVD,
    so the DREQ goes at once; it used to wait in the CQ until the drain timer (``timeout``) sent
    the DREQ anyway.  The sends' events are all there, two of them over ``qlen``."""
    pz = ia.create_pz()
    request_evd = ia.create_evd(2, EvdFlags.DTO)
    client, server = await _connected(ia, pz, client_evd=request_evd)
    inbox = pz.register(bytearray(4 * 64))
    for i in range(4):
        server.post_recv(inbox[i * 64:(i + 1) * 64], cookie=f"r{i}")
    out = pz.register(bytearray(64))
    for i in range(4):
        client.post_send(out[0:8], cookie=f"s{i}")
    for _ in range(4):
        assert (await server.recv_evd.wait_one(timeout=T)).ok  # every send has completed by now
    started = time.monotonic()
    await client.disconnect(timeout=T)
    assert time.monotonic() - started < T / 2, "the DREQ waited for the drain timer"
    events = [request_evd.dequeue() for _ in range(5)]
    assert [event.cookie for event in events[:4]] == ["s0", "s1", "s2", "s3"] and events[4] is None
    assert request_evd.overflow_count == 2  # (s2 and s3)
    assert request_evd._awaited == 0


async def test_closing_an_srq_ep_claims_its_receive_from_a_full_evd(ia: Any, loop_errors: List[dict]) -> None:
    """A message landed in a buffer an EP took from its SRQ, and its shared recv EVD is full (one
    software event, unread).  Closing the EP claims the completion all the same: the SRQ counts the
    buffer back and its event is queued over ``qlen``.  With no room it used to be left in the CQ,
    where no EP claims it once the QP is gone: the SRQ counted the buffer as posted for ever, and
    its LMR could not be freed."""
    pz = ia.create_pz()
    srq = ia.create_srq(pz, 16)
    pool = pz.register(bytearray(4 * 64))
    srq.post_recv_batch((pool[i * 64:(i + 1) * 64], f"b{i}") for i in range(4))
    shared = ia.create_evd(1, EvdFlags.DTO | EvdFlags.SOFTWARE)
    client, server = await _connected(ia, pz, server_kw={"recv_evd": shared, "srq": srq})
    shared.post_se("filler")  # the EVD is full
    client.post_send(pz.register(bytearray(8))[0:8], cookie="s")
    assert (await client.request_evd.wait_one(timeout=T)).ok  # the message is in an SRQ buffer
    server.close()
    assert shared.overflow_count == 1
    assert srq.query().outstanding_dto_count == 4  # three posted, one queued on the EVD
    first, second = shared.dequeue(), shared.dequeue()
    assert first is not None and first.payload == "filler"
    assert second is not None and second.cookie == "b0" and second.ok
    assert srq.query().outstanding_dto_count == 3
    client.close()
    srq.close()
    pool.free()  # no buffer of it counts as posted any more
