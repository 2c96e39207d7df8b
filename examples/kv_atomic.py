"""A counter shared by several clients with RDMA fetch-and-add (and a compare-and-swap "set if").

    python examples/kv_atomic.py [--clients 4] [--increments 100]

The server registers one 8-byte word per key with REMOTE_ATOMIC and hands the
table's RemoteRegion to each client in the accept private data; after that
the server's CPU does nothing: every client adds to the counter with
``post_fetch_add`` (the responder's adapter does the read-modify-write
atomically), and learns the value before its own add.  At the end the server
checks that the counter equals clients x increments and that every client saw
distinct values (no increment was lost or duplicated).  Key 1 is claimed
once with ``post_compare_swap`` (0 -> the client's id): exactly one client wins.

The word is in the server's byte order; the value returned to a client is in
the client's byte order (see docs/datapath.md).
Run it where an RDMA device is up, e.g. `aiodat rxe run -- python examples/kv_atomic.py`.
"""
import argparse
import asyncio
import os
import sys
from typing import List, Tuple

import aiodat
from aiodat import EvdFlags, Privileges

KEYS = 2  # key 0: the shared counter; key 1: a "leader" slot claimed with compare-and-swap


def default_device() -> str:
    """$AIODAT_RXE_DEVICE (set by `aiodat rxe run`) or the first RDMA device."""
    providers = aiodat.list_providers()
    if not os.environ.get("AIODAT_RXE_DEVICE") and not providers:
        raise SystemExit("no RDMA device here; try: aiodat rxe run -- python examples/kv_atomic.py")
    return os.environ.get("AIODAT_RXE_DEVICE") or providers[0].name


async def client(ia: aiodat.IA, port: int, me: int, increments: int) -> Tuple[List[int], bool]:
    pz = ia.create_pz()
    result = pz.register(bytearray(8), Privileges.LOCAL_WRITE)
    ep = ia.create_ep(pz)
    assert ia.address is not None  # (the server's PSP listens there: open_ia found an address)
    table = aiodat.RemoteRegion.from_bytes(await ep.connect(ia.address, port))
    counter, leader = table[0:8], table[8:16]
    seen = []
    for _ in range(increments):
        ep.post_fetch_add(result[0:8], counter, 1)
        (await ep.request_evd.wait_one()).raise_for_status()
        seen.append(int.from_bytes(result.memoryview(), sys.byteorder))
    ep.post_compare_swap(result[0:8], leader, compare=0, swap=me)
    (await ep.request_evd.wait_one()).raise_for_status()
    won = int.from_bytes(result.memoryview(), sys.byteorder) == 0
    await ep.disconnect()
    pz.close()  # its EP and LMR too
    return seen, won


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--increments", type=int, default=100)
    args = parser.parse_args()
    with aiodat.open_ia(default_device()) as ia:
        pz = ia.create_pz()
        words = bytearray(8 * KEYS)
        table = pz.register(words, Privileges.LOCAL_WRITE | Privileges.REMOTE_ATOMIC)
        cr_evd = ia.create_evd(args.clients, EvdFlags.CR)
        psp = ia.create_psp_any(cr_evd)

        served: List[aiodat.EP] = []  # (held until closed below: an EP dropped unclosed warns)

        async def serve() -> None:
            for _ in range(args.clients):
                request = await cr_evd.wait_one()
                served.append(ia.create_ep(pz))
                await request.cr.accept(served[-1], table.remote().to_bytes())

        acceptor = asyncio.ensure_future(serve())
        results = await asyncio.gather(*(client(ia, psp.port, me, args.increments)
                                         for me in range(1, args.clients + 1)))
        await acceptor
        for ep in served:  # (each client disconnected before it returned)
            ep.close()
        total = int.from_bytes(words[0:8], sys.byteorder)
        leader = int.from_bytes(words[8:16], sys.byteorder)
        seen = sorted(v for values, _ in results for v in values)
        expected = args.clients * args.increments
        winners = [me for me, (_, won) in enumerate(results, 1) if won]
        print(f"counter = {total} (expected {expected}); values seen by clients distinct and complete: "
              f"{seen == list(range(expected))}; leader = client {leader} (winners {winners})")
        if total != expected or seen != list(range(expected)) or winners != [leader]:
            raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
