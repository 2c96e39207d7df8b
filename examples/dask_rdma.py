"""Dask distributed over RDMA: a LocalCluster on ``rdma://`` moving an array between its two workers.

Nothing is imported from aiodat: distributed finds the ``rdma://`` backend through the
entry point ``pip install aiodat[dask]`` installs.  The only change against TCP is the protocol
(and a host that is an RDMA device's address).

Run it::

    aiodat rxe run -- python examples/dask_rdma.py
    python examples/dask_rdma.py --host 169.254.77.1 --size-mib 64
    python examples/dask_rdma.py --protocol tcp      # the same program over Dask's TCP
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import time

import numpy as np
from distributed import Client, LocalCluster


def make(size: int, seed: int) -> np.ndarray:
    """The data: made on one worker."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def digest(array: np.ndarray) -> str:
    """Its checksum: computed on the other worker, so the array must cross."""
    return hashlib.sha256(array.tobytes()).hexdigest()


async def main(protocol: str, host: str, size: int) -> None:
    async with LocalCluster(protocol=protocol, host=host, n_workers=2, threads_per_worker=1, processes=False,
                            asynchronous=True, dashboard_address=None) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            print(f"scheduler at {cluster.scheduler_address}")
            await client.wait_for_workers(2)
            a, b = sorted((await client.scheduler.identity(n_workers=-1))["workers"])
            print(f"workers: {a} and {b}")
            made = client.submit(make, size, 1, workers=[a], pure=False)
            await made
            t0 = time.monotonic()
            got = await client.submit(digest, made, workers=[b], pure=False)
            took = time.monotonic() - t0
            ok = got == digest(make(size, 1))
            print(f"{size >> 20} MiB from worker A to worker B over {protocol}:// in {took:.2f} s; "
                  f"checksum matches: {ok}")
            squares = await client.submit(sum, client.map(lambda x: x * x, range(10)))
            print(f"sum of squares 0..9 on the cluster = {squares}")
            if not ok or squares != 285:
                raise SystemExit("dask_rdma: wrong result")
    print(f"dask over {protocol}:// ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=("rdma", "tcp"), default="rdma")
    parser.add_argument("--host", default=os.environ.get("AIODAT_RXE_ADDR", "169.254.77.1"),
                        help="an RDMA device's IPv4 address (default $AIODAT_RXE_ADDR or 169.254.77.1)")
    parser.add_argument("--size-mib", type=int, default=64, help="array size in MiB (default 64)")
    args = parser.parse_args()
    asyncio.run(main(args.protocol, args.host, args.size_mib << 20))
