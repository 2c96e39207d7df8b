"""Issue 7: nothing grows over many open/close cycles (one host, real rxe).

Measured: open fds (/proc/self/fd), the device's resources as the kernel counts them
(``rdma resource show``: pd, cq, qp, cm_id, mr), and RSS (/proc/self/status VmRSS).
A warm-up round comes first so that one-off allocations (the rdma_cm channel, the loop's
selector, Python's caches) are in the baseline; the bounds are in the asserts.
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import time
from typing import Any, Dict

import pytest

import aiodat
from aiodat import EvdFlags, Privileges

pytestmark = pytest.mark.rxe

CONNECTIONS = 200
LMR_CYCLES = 10_000
#: RSS may grow by at most this much over the whole loop (allocator slack, not per-cycle growth).
#: Under AddressSanitizer (scripts/asan.sh) freed memory sits in ASan's quarantine, so RSS is not
#: a leak measure there: only fds and the kernel's counts are checked.
RSS_SLACK = (1 << 60) if "libasan" in os.environ.get("LD_PRELOAD", "") else 8 << 20


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    with open("/proc/self/status") as f:
        m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    assert m
    return int(m.group(1)) * 1024


def kernel_resources(device: str) -> Dict[str, int]:
    """pd/cq/qp/cm_id/mr counts of ``device`` (all processes: the test is alone on its host)."""
    if not shutil.which("rdma"):
        return {}
    out = subprocess.run(["rdma", "resource", "show", device], stdout=subprocess.PIPE, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(pd|cq|qp|cm_id|mr|srq)\s+(\d+)", out)}


def figure(name: str, **values: Any) -> None:
    import json

    line = json.dumps({"test": name, **values})
    print(line)
    path = os.environ.get("AIODAT_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


async def _one_connection(ia: Any, pz: Any, cr_evd: Any, psp: Any, lmr: Any) -> None:
    import asyncio

    client, server = ia.create_ep(pz), ia.create_ep(pz)
    server.post_recv(lmr[0:64], cookie="r")

    async def accept() -> None:
        ev = await cr_evd.wait_one(timeout=30)
        await ev.cr.accept(server, timeout=30)

    acceptor = asyncio.ensure_future(accept())
    await client.connect(psp.address, psp.port, timeout=30)
    await acceptor
    client.post_send(lmr[64:72], cookie="s")
    (await client.request_evd.wait_one(timeout=30)).raise_for_status()
    (await server.recv_evd.wait_one(timeout=30)).raise_for_status()
    await client.disconnect(timeout=30)
    await server.connect_evd.wait_one(timeout=30)  # DISCONNECTED on the passive side
    client.free()
    server.free()


async def test_connections_open_close_do_not_leak(rdma_device: Any) -> None:
    """200 connections (connect, one send, disconnect, free): fds, kernel QPs/CQs/cm_ids/MRs and RSS
    return to their level after the first few."""
    before = kernel_resources(rdma_device.name)  # the kernel's own (QP1, its CQ and PD) are counted too
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pz = ia.create_pz()
        lmr = pz.register(bytearray(4096), Privileges.ALL)
        cr_evd = ia.create_evd(8, EvdFlags.CR)
        psp = ia.create_psp_any(cr_evd)
        for _ in range(5):  # warm-up
            await _one_connection(ia, pz, cr_evd, psp, lmr)
        gc.collect()
        fd0, rss0, res0 = fds(), rss(), kernel_resources(rdma_device.name)
        t0 = time.monotonic()
        for _ in range(CONNECTIONS):
            await _one_connection(ia, pz, cr_evd, psp, lmr)
        took = time.monotonic() - t0
        gc.collect()
        fd1, rss1, res1 = fds(), rss(), kernel_resources(rdma_device.name)
        figure("connections_leak", n=CONNECTIONS, seconds=round(took, 2), ms_per_conn=round(took / CONNECTIONS * 1e3, 1),
               fds=[fd0, fd1], rss_kib=[rss0 >> 10, rss1 >> 10], kernel=[res0, res1])
        assert fd1 <= fd0, f"open fds grew from {fd0} to {fd1} over {CONNECTIONS} connections"
        assert res1 == res0, f"kernel resources changed: {res0} -> {res1}"
        assert rss1 - rss0 <= RSS_SLACK, f"RSS grew by {(rss1 - rss0) >> 10} KiB over {CONNECTIONS} connections"
    finally:
        ia.close()
    assert kernel_resources(rdma_device.name) == before, "closing the IA did not release everything"


@pytest.mark.loop_independent
def test_lmr_register_free_does_not_leak(rdma_device: Any) -> None:
    """10,000 register/free cycles (4 KiB and 1 MiB buffers, alternating): MR count, fds and RSS are
    where they started."""
    ia = aiodat.open_ia(rdma_device.name)
    try:
        pz = ia.create_pz()
        small, big = bytearray(4096), bytearray(1 << 20)
        for _ in range(50):
            pz.register(small, Privileges.ALL).free()
        gc.collect()
        fd0, rss0, res0 = fds(), rss(), kernel_resources(rdma_device.name)
        t0 = time.monotonic()
        for i in range(LMR_CYCLES):
            lmr = pz.register(big if i % 2 else small, Privileges.ALL)
            assert lmr.rmr_context
            lmr.free()
        took = time.monotonic() - t0
        gc.collect()
        fd1, rss1, res1 = fds(), rss(), kernel_resources(rdma_device.name)
        figure("lmr_leak", n=LMR_CYCLES, seconds=round(took, 2), us_per_cycle=round(took / LMR_CYCLES * 1e6, 1),
               fds=[fd0, fd1], rss_kib=[rss0 >> 10, rss1 >> 10], kernel=[res0, res1])
        assert fd1 <= fd0
        assert res1 == res0, f"kernel resources changed: {res0} -> {res1}"
        assert rss1 - rss0 <= RSS_SLACK, f"RSS grew by {(rss1 - rss0) >> 10} KiB over {LMR_CYCLES} cycles"
        assert not pz._children, "freed LMRs are still children of the PZ"
    finally:
        ia.close()
