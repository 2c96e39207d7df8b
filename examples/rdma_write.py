"""RDMA write: a client writes straight into a buffer the server exposes; the server verifies it.

    python examples/rdma_write.py [--size BYTES] [--chunk BYTES]

The server registers a buffer with REMOTE_WRITE and hands its RemoteRegion
(address, length, rkey: 20 bytes) to the client in the accept private data.
The client writes its data in chunks, batched into one crossing into C, with
only the last write signalled, then a zero-length RDMA write with immediate
data (the number of bytes written) that completes a receive on the server:
the server's CPU took no part in the transfer until that notification.
Run it where an RDMA device is up, e.g. `aiodat rxe run -- python examples/rdma_write.py`.
"""
import argparse
import asyncio
import hashlib
import os

import aiodat
from aiodat import CompletionFlags, DTOOp, EPAttr, EvdFlags, Privileges


def default_device() -> str:
    """$AIODAT_RXE_DEVICE (set by `aiodat rxe run`) or the first RDMA device."""
    providers = aiodat.list_providers()
    if not os.environ.get("AIODAT_RXE_DEVICE") and not providers:
        raise SystemExit("no RDMA device here; try: aiodat rxe run -- python examples/rdma_write.py")
    return os.environ.get("AIODAT_RXE_DEVICE") or providers[0].name


def content(size: int) -> bytes:
    """What the client writes: reproducible, so the server can check it on its own."""
    block = hashlib.sha256(b"aiodat").digest() * 128  # 4 KiB
    return (block * (size // len(block) + 1))[:size]


async def server(ia: aiodat.IA, cr_evd: aiodat.EVD, size: int) -> None:
    pz = ia.create_pz()
    target = bytearray(size)
    lmr = pz.register(target, Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE)
    ep = ia.create_ep(pz)
    ep.post_recv(None, cookie="done")  # completed by the client's write-with-immediate
    request = await cr_evd.wait_one()
    await request.cr.accept(ep, lmr.remote().to_bytes())
    print(f"server: exposed {size} bytes at {lmr.address:#x} rkey {lmr.rmr_context:#x}", flush=True)
    event = (await ep.recv_evd.wait_one()).raise_for_status()
    assert event.operation is DTOOp.RECV_RDMA_WRITE_IMM
    lmr.sync_rdma_write()  # DAT's lmr_sync before the CPU reads what the peer wrote
    ok = event.imm_data == size and hashlib.sha256(target).digest() == hashlib.sha256(content(size)).digest()
    print(f"server: client says it wrote {event.imm_data} bytes; contents {'verified' if ok else 'WRONG'}",
          flush=True)
    await ep.disconnect()
    pz.close()  # its EP and LMR too
    if not ok:
        raise SystemExit(1)


async def client(ia: aiodat.IA, port: int, size: int, chunk: int) -> None:
    pz = ia.create_pz()
    data = bytearray(content(size))
    lmr = pz.register(data, Privileges.LOCAL_WRITE)
    ep = ia.create_ep(pz, attrs=EPAttr(max_request_dtos=64))
    assert ia.address is not None  # (the server's PSP listens there: open_ia found an address)
    remote = aiodat.RemoteRegion.from_bytes(await ep.connect(ia.address, port))
    print(f"client: writing {size} bytes to {remote.address:#x} in {chunk}-byte chunks", flush=True)
    offsets = list(range(0, size, chunk))
    for first in range(0, len(offsets), 32):  # at most 32 in flight: the send queue holds 64
        batch = [(lmr[o:o + chunk], remote[o:o + chunk], o) for o in offsets[first:first + 32]]
        ep.post_rdma_write_batch(batch[:-1], CompletionFlags.SUPPRESS)
        ep.post_rdma_write(*batch[-1])
        (await ep.request_evd.wait_one()).raise_for_status()  # the last one: the whole batch landed
    ep.post_rdma_write(None, remote[0:0], "notify", imm_data=size)
    (await ep.request_evd.wait_one()).raise_for_status()
    await ep.connect_evd.wait_one()  # the server disconnects once it has checked the data
    pz.close()  # its EP and LMR too


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4 << 20)
    parser.add_argument("--chunk", type=int, default=64 << 10)
    args = parser.parse_args()
    with aiodat.open_ia(default_device()) as ia:
        cr_evd = ia.create_evd(4, EvdFlags.CR)
        psp = ia.create_psp_any(cr_evd)
        await asyncio.gather(server(ia, cr_evd, args.size), client(ia, psp.port, args.size, args.chunk))


if __name__ == "__main__":
    asyncio.run(main())
