"""A work queue takes no more requests than its completion queue holds, on real rxe.

rxe frees a send or receive queue slot as it writes the completion, not when the completion is
polled, so it took any number of posts whose completions nobody had taken yet: past the EP's
``max_request_dtos`` (``max_recv_dtos``, an SRQ's ``max_recv_dtos``) the CQ, sized for that many
(cqsize.py), overran.  Its completions were lost (IBV_EVENT_CQ_ERR on the async EVD), their
LMRs stayed counted (``lmr.free()`` refused for good) and a task waiting for one hung.  Now such
a post raises QueueFull with nothing posted, as a device that frees its slots at poll time
(mlx5) refuses it, and goes through once the completions are taken (docs/datapath.md).
"""
from __future__ import annotations

import asyncio
from typing import Any, List

import pytest

import aiodat
from aiodat import CompletionFlags, EvdFlags
from aiodat.cm import connect_pair
from aiodat.testing.plugin import make_ep_pair
from completions import take

pytestmark = pytest.mark.rxe


def _no_cq_overrun(ia: Any) -> None:
    event = ia.async_evd.dequeue()
    assert event is None, f"the device reported {event}"


@pytest.mark.parametrize("how", ["single", "batch", "batch-each", "rdma-read"])
async def test_requests_past_max_request_dtos_are_refused_until_completions_are_taken(
        ia: Any, loop_errors: List[dict], how: str) -> None:
    pair = await make_ep_pair(ia)
    try:
        client, lmr, remote = pair.client, pair.client_lmr, pair.server_lmr.remote()
        limit = client.attrs.max_request_dtos
        post = client.post_rdma_read if how == "rdma-read" else client.post_rdma_write
        if how in ("single", "rdma-read"):
            for i in range(limit):
                post(lmr[0:8], remote[0:8], i)
            await asyncio.sleep(0.2)  # (rxe has completed them all: its queue would take more)
            with pytest.raises(aiodat.QueueFull, match=f"{limit} of max_request_dtos={limit} places held; a request"):
                post(lmr[0:8], remote[0:8], "one too many")
        else:
            # a batch longer than the room: what fits goes, as a device posts until its queue is full
            items = [(lmr[0:8] if how == "batch" else lmr[8 * i:8 * i + 8], remote[0:8], i)
                     for i in range(limit + 1)]
            with pytest.raises(aiodat.QueueFull, match=f"posted {limit} of {limit + 1}"):
                client.post_rdma_write_batch(items)
            await asyncio.sleep(0.2)
            with pytest.raises(aiodat.QueueFull, match="posted 0 of 1"):
                client.post_rdma_write_batch(items[:1])
        events = await take(client.request_evd, limit)
        assert [event.cookie for event in events] == list(range(limit))  # none lost
        post(lmr[0:8], remote[0:8], "after")  # room again
        assert (await take(client.request_evd, 1))[0].cookie == "after"
        _no_cq_overrun(ia)
        assert client.request_evd.dequeue() is None
        lmr.free()  # nothing left counted on it (it was refused for good)
    finally:
        pair.close()


async def test_a_suppressed_batch_is_one_entry_of_the_limit(ia: Any, loop_errors: List[dict]) -> None:
    """A batch of requests all suppressed but the last makes one completion: it takes one place, so
    a run longer than ``max_request_dtos`` goes while a place is free, and QueueFull counts places."""
    pair = await make_ep_pair(ia)
    try:
        client, lmr, remote = pair.client, pair.client_lmr, pair.server_lmr.remote()
        n = 3 * client.attrs.max_request_dtos
        local, there = lmr[0:8], remote[0:8]  # (the very same segment in every item: one run)
        items = [(local, there, i) for i in range(n)]
        for _ in range(2):
            assert client.post_rdma_write_batch(items, CompletionFlags.SUPPRESS,
                                                last_flags=CompletionFlags.DEFAULT) == n
        limit = client.attrs.max_request_dtos
        await asyncio.sleep(1.0)  # (rxe has written the runs: its queue takes the singles)
        for i in range(limit - 2):
            client.post_rdma_write(local, there, f"single {i}")
        # the refusal names the limit and the places held, and counts the runs' requests apart
        with pytest.raises(aiodat.QueueFull, match=rf"{limit} of max_request_dtos={limit} places held "
                                                   rf"\({2 * n + limit - 2} requests: a suppressed batch"):
            client.post_rdma_write(local, there, "one too many")
        cookies = [event.cookie for event in await take(client.request_evd, limit)]
        assert cookies == [n - 1, n - 1] + [f"single {i}" for i in range(limit - 2)]
        _no_cq_overrun(ia)
    finally:
        pair.close()


async def test_receives_past_max_recv_dtos_are_refused_until_completions_are_taken(
        ia: Any, loop_errors: List[dict]) -> None:
    """Receives completed but not taken hold their places: re-posting them ran the receive CQ over."""
    pair = await make_ep_pair(ia)
    try:
        client, server = pair.client, pair.server
        limit = server.attrs.max_recv_dtos
        assert server.post_recv_batch([(pair.server_lmr[0:8], i) for i in range(limit)]) == limit
        for i in range(limit):
            client.post_send(pair.client_lmr[0:8], i)
        await take(client.request_evd, limit)  # every receive has completed at the server
        with pytest.raises(aiodat.QueueFull, match=f"{limit} of max_recv_dtos={limit} places held; a request"):
            server.post_recv(pair.server_lmr[0:8], "one too many")
        with pytest.raises(aiodat.QueueFull, match="posted 0 of 1"):
            server.post_recv_batch([(pair.server_lmr[0:8], "one too many")])
        assert [event.cookie for event in await take(server.recv_evd, limit)] == list(range(limit))
        server.post_recv(pair.server_lmr[0:8], "after")
        client.post_send(pair.client_lmr[0:8], "after")
        assert (await take(server.recv_evd, 1))[0].cookie == "after"
        _no_cq_overrun(ia)
    finally:
        pair.close()


async def test_srq_buffers_past_max_recv_dtos_are_refused_until_completions_are_taken(
        ia: Any, loop_errors: List[dict]) -> None:
    pz = ia.create_pz()
    try:
        srq = ia.create_srq(pz, 16, 2)
        limit = srq.query().max_recv_dtos  # (what the device made: it may round up)
        lmr = pz.register(bytearray(4096))
        client, server = ia.create_ep(pz), ia.create_ep(pz, srq=srq)
        psp = await connect_pair(client, server)
        assert srq.post_recv_batch([(lmr[0:8], i) for i in range(limit)]) == limit
        for i in range(limit):
            client.post_send(lmr[64:72], i)
        await take(client.request_evd, limit)
        with pytest.raises(aiodat.QueueFull, match="posted 0 of 1"):
            srq.post_recv(lmr[0:8], "one too many")
        with pytest.raises(aiodat.QueueFull, match="posted 0 of 1"):
            srq.post_recv([lmr[0:4], lmr[4:8]], "one too many, general path")
        assert [event.cookie for event in await take(server.recv_evd, limit)] == list(range(limit))
        srq.post_recv(lmr[0:8], "after")
        client.post_send(lmr[64:72], "after")
        assert (await take(server.recv_evd, 1))[0].cookie == "after"
        _no_cq_overrun(ia)
        psp.free()
        psp.cr_evd.free()
    finally:
        pz.close()


async def test_an_evd_shared_by_two_eps_holds_both_limits(ia: Any, loop_errors: List[dict]) -> None:
    """Two EPs on one request EVD, each filled to its limit and not reaped: every completion arrives."""
    pz = ia.create_pz()
    try:
        shared = ia.create_evd(8, EvdFlags.DTO | EvdFlags.RMR_BIND)
        lmr = pz.register(bytearray(4096), aiodat.Privileges.ALL)
        pairs, servers = [], []  # (the servers held: a dropped one's QP would go, and its peer break)
        for _ in range(2):
            client, server = ia.create_ep(pz, request_evd=shared), ia.create_ep(pz)
            servers.append(server)
            pairs.append((client, await connect_pair(client, server)))
        limit = pairs[0][0].attrs.max_request_dtos
        for k, (client, _) in enumerate(pairs):
            for i in range(limit):
                client.post_rdma_write(lmr[0:8], lmr.remote()[8:16], (k, i))
            with pytest.raises(aiodat.QueueFull):
                client.post_rdma_write(lmr[0:8], lmr.remote()[8:16], "one too many")
        events = await take(shared, 2 * limit)
        assert sorted(event.cookie for event in events) == sorted((k, i) for k in range(2) for i in range(limit))
        _no_cq_overrun(ia)
        for _, psp in pairs:
            psp.free()
            psp.cr_evd.free()
    finally:
        pz.close()
