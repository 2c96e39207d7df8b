"""Echo server: accept each client on a new EP and send every message back.

    python examples/echo_server.py [--host ADDR] [--port 7471] [--clients N]

--host is one of the device's IP addresses (default $AIODAT_RXE_ADDR, else the
device's first address): the IA is opened on it, so the PSP listens there; an
address the device lacks ends the server with a message naming the ones it has.
Run it where an RDMA device is up, e.g. `aiodat rxe run -- python examples/demo.py`.
"""
import argparse
import asyncio
import os
from typing import List, Optional, Sequence

import aiodat
from aiodat import EvdFlags, Privileges

SIZE = 4096  # the largest message a client may send


def default_device() -> str:
    """$AIODAT_RXE_DEVICE (set by `aiodat rxe run`) or the first RDMA device."""
    providers = aiodat.list_providers()
    if not os.environ.get("AIODAT_RXE_DEVICE") and not providers:
        raise SystemExit("no RDMA device here; try: aiodat rxe run -- python examples/demo.py")
    return os.environ.get("AIODAT_RXE_DEVICE") or providers[0].name


async def echo(ia: aiodat.IA, pz: aiodat.PZ, cr: aiodat.CR) -> None:
    """Serve one client: one EVD takes its receives, sends and connection events."""
    evd = ia.create_evd(16, EvdFlags.DTO | EvdFlags.CONNECTION)
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd, connect_evd=evd)
    rbuf, sbuf = bytearray(SIZE), bytearray(SIZE)
    rlmr, slmr = pz.register(rbuf), pz.register(sbuf, Privileges.DEFAULT)
    ep.post_recv(rlmr[0:SIZE])
    await cr.accept(ep)
    print(f"server: client {cr.remote_address} connected", flush=True)
    async for ev in evd:  # until DISCONNECTED (or a receive it flushed)
        if not isinstance(ev, aiodat.DTOCompletionEvent) or not ev.ok:  # (a mixed EVD: narrow the event)
            break
        if ev.operation is aiodat.DTOOp.RECV:
            n = ev.transferred_length
            sbuf[:n] = rbuf[:n]
            ep.post_recv(rlmr[0:SIZE])  # the next receive goes up before the reply
            ep.post_send(slmr[0:n])
    print(f"server: client {cr.remote_address} gone", flush=True)
    # free what this client had: a server that runs on would otherwise hold each one's until it exits
    ep.free()
    rlmr.free()
    slmr.free()
    evd.free()


async def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("AIODAT_RXE_ADDR"),
                        help="the device's IP address to listen on (default: its first)")
    parser.add_argument("--port", type=int, default=7471)
    parser.add_argument("--clients", type=int, default=0, help="exit after serving N clients (0: forever)")
    args = parser.parse_args(argv)
    device = default_device()
    try:
        ia = aiodat.open_ia(device, address=args.host or None)  # the PSP listens on ia.address
    except aiodat.InvalidParameter as e:  # --host is not one of the device's addresses
        raise SystemExit(f"server: cannot listen on --host {args.host}: {e}") from None
    with ia:
        pz = ia.create_pz()
        cr_evd = ia.create_evd(16, EvdFlags.CR)
        ia.create_psp(args.port, cr_evd)
        print(f"server: listening on {ia.address}:{args.port}", flush=True)
        clients: List["asyncio.Future[None]"] = []
        while not args.clients or len(clients) < args.clients:
            request = await cr_evd.wait_one()
            clients.append(asyncio.ensure_future(echo(ia, pz, request.cr)))
        await asyncio.gather(*clients)


if __name__ == "__main__":
    asyncio.run(main())
