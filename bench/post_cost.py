"""What a batch post costs per buffer: a developer's tool, run in the rxe guest:

    aiodat rxe run -- .venv/bin/python bench/post_cost.py [--batch 64] [--rounds 5]

It times a batch of ``--batch`` buffers three ways, each the median over the rounds (us per
buffer): every item on the very same segment (a list: C), each item on a slice of its own (a
pool, as a server uses one; a list: C) and the same pool from a generator (the general path,
which is what a pool took before it went to C).

* Receives, ``post_recv_batch`` on an EP's receive queue and on an SRQ: a fresh queue filled
  batch by batch.  Nothing completes: it measures the post alone.
* RDMA writes, ``post_rdma_write_batch`` of 64 bytes (inline), every item to its own remote
  slice, all but the last suppressed, on a connected pair: rxe runs each write inside the post,
  so this is the post with rxe's work in it; the batch's completion is awaited untimed.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

from aiodat import CompletionFlags, EPAttr, Privileges, open_ia
from aiodat.bench import device_and_address
from aiodat.bench.harness import run_on_loop
from aiodat.cm import connect_pair

SLICE = 256
WRITE = 64


def fill(post: Callable[[Any], int], items: List[Any], batches: int, form: Callable[[Any], Any]) -> float:
    """Post ``batches`` batches of ``items`` (through ``form``); us per buffer."""
    start = time.perf_counter()
    for _ in range(batches):
        post(form(items))
    return (time.perf_counter() - start) * 1e6 / (batches * len(items))


def report(queue: str, name: str, times: List[float]) -> None:
    print(f"{queue:5} {name:34} {statistics.median(times):7.2f} us per buffer "
          f"(rounds {', '.join(f'{t:.2f}' for t in times)})", flush=True)


async def write_costs(ia: Any, pz: Any, batch: int, batches: int, rounds: int) -> None:
    """post_rdma_write_batch's cost per buffer in the three shapes, on a connected pair."""
    attrs = EPAttr(max_request_dtos=2 * batch, max_recv_dtos=1)
    client, server = ia.create_ep(pz, attrs=attrs), ia.create_ep(pz, attrs=attrs)
    psp = await connect_pair(client, server)
    local = pz.register(bytearray(WRITE * batch))
    target = pz.register(bytearray(WRITE * batch), Privileges.ALL)
    try:
        whole = target.remote()
        remotes = [whole[WRITE * i:WRITE * (i + 1)] for i in range(batch)]
        one = local[0:WRITE]
        pool = [(local[WRITE * i:WRITE * (i + 1)], remotes[i], i) for i in range(batch)]
        shapes = {"one segment, list (C)": ([(one, remotes[i], i) for i in range(batch)], list),
                  "a pool, list (C)": (pool, list), "a pool, generator (general path)": (pool, iter)}
        suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
        for name, (items, form) in shapes.items():
            times = []
            for _ in range(rounds):
                spent = 0.0
                for _ in range(batches):
                    start = time.perf_counter()
                    client.post_rdma_write_batch(form(items), suppress, signal)
                    spent += time.perf_counter() - start
                    (done,) = await client.request_evd.wait(1, timeout=30)
                    if not done.ok:
                        raise SystemExit(f"post_cost: an RDMA write failed: {done}")
                times.append(spent * 1e6 / (batches * batch))
            report("write", name, times)
    finally:
        client.free()
        server.free()
        psp.free()
        local.free()
        target.free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8, help="batches per fresh queue (default 8)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device, _ = device_and_address(None, None)
    depth = args.batch * args.batches
    with open_ia(device) as ia:
        pz = ia.create_pz()
        lmr = pz.register(bytearray(SLICE * args.batch))
        one = lmr[0:SLICE]  # the very same object in every item
        pool = [(lmr[SLICE * i:SLICE * (i + 1)], i) for i in range(args.batch)]
        shapes: Dict[str, Tuple[List[Any], Callable[[Any], Any]]] = {
            "one segment, list (C)": ([(one, i) for i in range(args.batch)], list),
            "a pool, list (C)": (pool, list),
            "a pool, generator (general path)": (pool, iter),
        }
        for queue in ("EP", "SRQ"):
            for name, (items, form) in shapes.items():
                times = []
                for _ in range(args.rounds):
                    if queue == "EP":
                        owner = ia.create_ep(pz, attrs=EPAttr(max_recv_dtos=depth, max_request_dtos=1))
                    else:
                        owner = ia.create_srq(pz, depth)
                    times.append(fill(owner.post_recv_batch, items, args.batches, form))
                    owner.free()  # (its receives are dropped with it)
                report(queue, name, times)
        run_on_loop("asyncio", lambda: write_costs(ia, pz, args.batch, args.batches, args.rounds))


if __name__ == "__main__":
    main()
