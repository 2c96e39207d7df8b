"""What a receive batch costs per buffer: a developer's tool, run in the rxe guest:

    aiodat rxe run -- .venv/bin/python bench/post_cost.py [--batch 64] [--rounds 5]

For an EP's receive queue and for an SRQ, it times ``post_recv_batch`` of ``--batch`` buffers
three ways, each the median over the rounds of a fresh queue filled batch by batch (us per
buffer): every item on the very same segment (a list: C), each item on a slice of its own (a
pool, as a server refills one; a list: C) and the same pool from a generator (the general path,
which is what a pool took before it went to C).  Nothing completes: it measures the post alone.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

from aiodat import EPAttr, open_ia
from aiodat.bench import device_and_address

SLICE = 256


def fill(post: Callable[[Any], int], items: List[Any], batches: int, form: Callable[[Any], Any]) -> float:
    """Post ``batches`` batches of ``items`` (through ``form``); us per buffer."""
    start = time.perf_counter()
    for _ in range(batches):
        post(form(items))
    return (time.perf_counter() - start) * 1e6 / (batches * len(items))


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
                print(f"{queue:4} {name:34} {statistics.median(times):7.2f} us per buffer "
                      f"(rounds {', '.join(f'{t:.2f}' for t in times)})", flush=True)


if __name__ == "__main__":
    main()
