"""Echo client: connect, send N messages, check each echo and print its round-trip time.

    python examples/echo_client.py [--host ADDR] [--port 7471] [--count 10] [--size 64]
"""
import argparse
import asyncio
import os
import statistics
import sys
import time

import aiodat
from aiodat import DTOOp, EvdFlags


def default_device() -> str:
    """$AIODAT_RXE_DEVICE (set by `aiodat rxe run`) or the first RDMA device."""
    providers = aiodat.list_providers()
    if not os.environ.get("AIODAT_RXE_DEVICE") and not providers:
        raise SystemExit("no RDMA device here; try: aiodat rxe run -- python examples/demo.py")
    return os.environ.get("AIODAT_RXE_DEVICE") or providers[0].name


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("AIODAT_RXE_ADDR"), help="the server's address")
    parser.add_argument("--port", type=int, default=7471)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--size", type=int, default=64, help="bytes per message (1..4096)")
    args = parser.parse_args()
    # (checked before anything is sent: a message larger than the server's 4096-byte receive buffer
    # failed both sides with a completion error, and --count 0 ended in a traceback from min())
    if not 1 <= args.size <= 4096:
        parser.error(f"--size {args.size}: must be 1 to 4096 (the echo server's receive buffer)")
    if args.count < 1:
        parser.error(f"--count {args.count}: must be at least 1")
    with aiodat.open_ia(default_device()) as ia:
        host = args.host or ia.address
        pz = ia.create_pz()
        evd = ia.create_evd(16, EvdFlags.DTO)  # receives and sends of the EP
        ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd)
        sbuf, rbuf = bytearray(args.size), bytearray(args.size)
        slmr, rlmr = pz.register(sbuf), pz.register(rbuf)
        await ep.connect(host, args.port, timeout=10)
        rtts = []
        for i in range(args.count):
            sbuf[:] = (f"message {i} ".encode() * args.size)[:args.size]
            ep.post_recv(rlmr[0:args.size])
            start = time.perf_counter()
            ep.post_send(slmr[0:args.size])
            echoed = False
            while not echoed:  # the send's completion and the echo's come to the same EVD
                for ev in await evd.wait(timeout=10):
                    echoed |= ev.raise_for_status().operation is DTOOp.RECV
            rtts.append((time.perf_counter() - start) * 1e6)
            if rbuf != sbuf:
                print(f"client: echo {i} differs from the message sent", file=sys.stderr)
                return 1
            print(f"client: {args.size} bytes echoed from {host}:{args.port} seq={i} rtt={rtts[-1]:.1f} us",
                  flush=True)
        await ep.disconnect()
    print(f"client: {args.count} echoes verified; rtt min {min(rtts):.1f} us, "
          f"median {statistics.median(rtts):.1f} us, max {max(rtts):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
