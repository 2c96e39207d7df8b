"""One Shared Receive Queue serving many client connections, refilled on its low watermark.

    python examples/srq_server.py --clients 8 --messages 50

The server listens on a PSP, accepts every connection onto an EP that receives
from one SRQ, and all those EPs share one recv EVD.  It never posts a receive
to an EP: a small pool of buffers lives on the SRQ, each completion hands its
buffer back to a free list, and when the SRQ runs low (``set_lw`` armed,
``await srq.low_watermark()`` resolves) the free buffers go back onto the SRQ
in one batch and the watermark is armed again (the device disarms it after
each event; see docs/srq.md).  After each refill it prints the SRQ's counters
(dat_srq_query) the way ``aiodat query`` prints attributes.

The clients run in the same process (``--clients N``), on their own IA of
the same device, and each sends ``--messages`` numbered messages.  The script
checks that every message arrived, in order per connection, and exits 0.

Needs an RDMA device: ``aiodat rxe run -- python examples/srq_server.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import struct
import sys
from typing import Dict, List, Optional

import aiodat
from aiodat import EvdFlags, EventType

MSG = struct.Struct("!II")  # (client number, sequence number)
BUF = 64  # bytes per receive buffer


def print_counters(srq: aiodat.SRQ, title: str) -> None:
    """The SRQ's dat_srq_query parameters, one ``name  value`` per line; unknown is DAT_VALUE_UNKNOWN."""
    param = srq.query()
    print(f"{title}")
    for name in ("state", "max_recv_dtos", "max_recv_iov", "low_watermark",
                 "available_dto_count", "outstanding_dto_count"):
        value = getattr(param, name)
        if value is None:
            value = "DAT_SRQ_LW_DEFAULT" if name == "low_watermark" else "DAT_VALUE_UNKNOWN"
        elif isinstance(value, aiodat.SRQState):
            value = f"DAT_SRQ_STATE_{value.value}"
        print(f"    {name:<24}{value}")
    print(f"    {'attached_eps':<24}{len(srq.eps)}")


class Server:
    """The SRQ, its buffers, the accepting task, the receiving task and the refilling task."""

    def __init__(self, ia: aiodat.IA, srq_size: int, low_watermark: int, expected: int) -> None:
        self.ia = ia
        self.pz = ia.create_pz()
        self.srq = ia.create_srq(self.pz, srq_size)
        self.low_watermark = low_watermark
        self.pool = self.pz.register(bytearray(srq_size * BUF))
        self.free: List[int] = []  # buffer slots not on the SRQ
        self.freed = asyncio.Event()
        self.recv_evd = ia.create_evd(2 * srq_size, EvdFlags.DTO)
        self.cr_evd = ia.create_evd(16, EvdFlags.CR)
        self.psp = ia.create_psp_any(self.cr_evd)
        self.expected = expected
        self.received: Dict[int, List[int]] = {}
        self.errors: List[str] = []
        self.refills = 0
        self.srq.post_recv_batch((self.pool[i * BUF:(i + 1) * BUF], i) for i in range(srq_size))

    async def accept_forever(self) -> None:
        async for event in self.cr_evd:
            if event.type is EventType.CONNECTION_REQUEST:
                ep = self.ia.create_ep(self.pz, recv_evd=self.recv_evd, srq=self.srq)
                await event.cr.accept(ep)

    async def receive_all(self) -> None:
        total = 0
        while total < self.expected:
            for event in await self.recv_evd.wait(1):
                slot = event.cookie
                if not event.ok:
                    self.errors.append(f"receive into slot {slot} failed: {event.status}")
                    total += 1
                    continue
                data = bytes(self.pool.memoryview()[slot * BUF:slot * BUF + MSG.size])
                client, seq = MSG.unpack(data)
                self.received.setdefault(client, []).append(seq)
                self.free.append(slot)  # its buffer can go back on the SRQ
                total += 1
            self.freed.set()

    async def refill_forever(self) -> None:
        self.srq.set_lw(self.low_watermark)  # arm for one event
        while True:
            await self.srq.low_watermark()  # the device has disarmed the watermark now
            while not self.free:  # buffers come back as their completions are processed
                self.freed.clear()
                await self.freed.wait()
            slots, self.free = self.free, []
            self.srq.post_recv_batch((self.pool[s * BUF:(s + 1) * BUF], s) for s in slots)
            self.srq.set_lw(self.low_watermark)  # re-arm for the next event
            self.refills += 1
            print_counters(self.srq, f"low watermark #{self.refills}: refilled {len(slots)} buffers, re-armed")


async def client(device: str, address: str, port: int, number: int, messages: int) -> None:
    """Connect, send ``messages`` numbered messages, wait for their completions, disconnect."""
    with aiodat.open_ia(device) as ia:
        pz = ia.create_pz()
        lmr = pz.register(bytearray(messages * MSG.size))
        ep = ia.create_ep(pz)
        await ep.connect(address, port, timeout=30)
        view = lmr.memoryview()
        for seq in range(messages):
            off = seq * MSG.size
            view[off:off + MSG.size] = MSG.pack(number, seq)
            ep.post_send(lmr[off:off + MSG.size], cookie=seq)
        done = 0
        while done < messages:
            for event in await ep.request_evd.wait(1, timeout=60):
                event.raise_for_status()
                done += 1
        await ep.disconnect()


async def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("AIODAT_RXE_DEVICE"),
                        help="IA name (default: $AIODAT_RXE_DEVICE or the first provider)")
    parser.add_argument("--clients", type=int, default=8, help="client connections to run (default 8)")
    parser.add_argument("--messages", type=int, default=50, help="messages per client (default 50)")
    parser.add_argument("--srq-size", type=int, default=32, help="buffers on the SRQ (default 32)")
    parser.add_argument("--low-watermark", type=int, default=8, help="refill below this many (default 8)")
    args = parser.parse_args(argv)
    device = args.device
    if device is None:
        providers = aiodat.list_providers()
        if not providers:
            print("no RDMA device; run under `aiodat rxe run -- python examples/srq_server.py`", file=sys.stderr)
            return 2
        device = providers[0].name
    expected = args.clients * args.messages
    with aiodat.open_ia(device) as ia:
        server = Server(ia, args.srq_size, args.low_watermark, expected)
        print(f"listening on {server.psp.address}:{server.psp.port}, one SRQ for {args.clients} clients")
        print_counters(server.srq, "srq created")
        background = [asyncio.ensure_future(server.accept_forever()),
                      asyncio.ensure_future(server.refill_forever())]
        receiving = asyncio.ensure_future(server.receive_all())
        clients = [client(device, server.psp.address, server.psp.port, n, args.messages)
                   for n in range(args.clients)]
        try:
            await asyncio.gather(*clients)
            await asyncio.wait_for(receiving, 60)
        finally:
            for task in background + [receiving]:
                task.cancel()
            await asyncio.gather(*background, receiving, return_exceptions=True)
        print_counters(server.srq, "srq at the end")
        lost = [n for n in range(args.clients) if server.received.get(n) != list(range(args.messages))]
        print(f"received {sum(len(v) for v in server.received.values())} of {expected} messages from "
              f"{len(server.received)} clients, {server.refills} refills on the low watermark")
        for err in server.errors:
            print(f"error: {err}")
        if lost or server.errors:
            print(f"FAILED: clients {lost} lost messages or received them out of order")
            return 1
        print("every message arrived, in order per connection")
    return 0


if __name__ == "__main__":
    if os.environ.get("AIODAT_LOOP") == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    sys.exit(asyncio.run(main()))
