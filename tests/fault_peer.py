"""The other side of the fault tests (tests/test_faults.py), run on host B by aiodat.testbed.hosts.

    fault_peer.py server PORT SIZE         accept connections (each in its own task); all share one
                                           SIZE-byte registered buffer (remote write allowed), advertised
                                           in the accept's private data; a send "SUM?" (optionally followed
                                           by 8-byte offset and length) is answered with the sha256 of the
                                           buffer (or that range); "BYE!" ends that connection.  Prints "READY <port>" once listening.
    fault_peer.py flood HOST PORT          connect and send 4 KiB messages as fast as credits allow,
                                           forever (to be killed); prints "FLOODING" once connected.
    fault_peer.py stream-server PORT       aiodat streams server: reads until EOF, answers the sha256
                                           hex of what it read and the byte count.  Prints "READY".

Runs under the loop named by $AIODAT_LOOP (asyncio or uvloop).
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import sys

import aiodat
from aiodat import EvdFlags, Privileges


def _loop_run(coro: "asyncio.Future") -> None:
    if os.environ.get("AIODAT_LOOP") == "uvloop":
        import uvloop

        uvloop.install()
    asyncio.run(coro)


async def server(port: int, size: int) -> None:
    ia = aiodat.open_ia(os.environ["AIODAT_RXE_DEVICE"])
    pz = ia.create_pz()
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    ia.create_psp(port, cr_evd)
    buf = bytearray(size)
    lmr = pz.register(buf, Privileges.ALL)
    print("READY %d" % port, flush=True)
    tasks = set()
    while True:
        ev = await cr_evd.wait_one()
        t = asyncio.ensure_future(_serve_one(ia, pz, ev.cr, buf, lmr))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


async def _serve_one(ia, pz, cr, buf, lmr) -> None:
    """One connection: answer SUM? with the buffer's sha256 until BYE! or the connection ends."""
    ctl = pz.register(bytearray(4096), Privileges.ALL)
    ep = ia.create_ep(pz)
    for i in range(4):
        ep.post_recv(ctl[i * 64:(i + 1) * 64], cookie=i)
    try:
        await cr.accept(ep, lmr.remote().to_bytes(), timeout=60)
    except aiodat.DATError as e:
        print("accept failed: %r" % e, flush=True)
        ep.free()
        ctl.free()
        return
    print("CONNECTED", flush=True)
    try:
        while True:
            done = await ep.recv_evd.wait_one(timeout=None)
            if not done.ok:
                print("recv completed: %s" % done.status, flush=True)
                break
            msg = bytes(ctl.memoryview()[done.cookie * 64: done.cookie * 64 + done.transferred_length])
            ep.post_recv(ctl[done.cookie * 64:(done.cookie + 1) * 64], cookie=done.cookie)
            if msg[:4] == b"SUM?":
                off, n = (int.from_bytes(msg[4:12], "big"), int.from_bytes(msg[12:20], "big")) \
                    if len(msg) >= 20 else (0, len(buf))
                ctl.memoryview()[1024:1056] = hashlib.sha256(memoryview(buf)[off:off + n]).digest()
                ep.post_send(ctl[1024:1056], cookie="sum")
                (await ep.request_evd.wait_one(timeout=60)).raise_for_status()
            elif msg == b"BYE!":
                break
    except aiodat.DATError as e:
        print("connection ended: %r" % e, flush=True)
    try:
        await ep.disconnect(timeout=10)
    except aiodat.DATError:
        pass
    ep.free()
    ctl.free()


async def flood(host: str, port: int) -> None:
    ia = aiodat.open_ia(os.environ["AIODAT_RXE_DEVICE"])
    pz = ia.create_pz()
    lmr = pz.register(bytearray(1 << 20), Privileges.ALL)
    ep = ia.create_ep(pz)
    for i in range(16):
        ep.post_recv(lmr[i * 4096:(i + 1) * 4096], cookie=i)
    await ep.connect(host, port, b"flood", timeout=60)
    print("FLOODING", flush=True)
    n = 0
    while True:
        for i in range(8):
            ep.post_send(lmr[(16 + i) * 4096:(17 + i) * 4096], cookie=n)
            n += 1
        for _ in range(8):
            (await ep.request_evd.wait_one(timeout=60)).raise_for_status()


async def stream_server(port: int) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        total = 0
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                h.update(data)
                total += len(data)
            writer.write(("%s %d\n" % (h.hexdigest(), total)).encode())
            await writer.drain()
        except (ConnectionError, aiodat.DATError, OSError) as e:
            print("stream ended: %r" % e, flush=True)
        finally:
            writer.close()

    srv = await aiodat.start_server(handle, os.environ["AIODAT_RXE_ADDR"], port)
    print("READY", flush=True)
    async with srv:
        await done


def main() -> None:
    mode = sys.argv[1]
    if mode == "server":
        _loop_run(server(int(sys.argv[2]), int(sys.argv[3])))
    elif mode == "flood":
        _loop_run(flood(sys.argv[2], int(sys.argv[3])))
    elif mode == "stream-server":
        _loop_run(stream_server(int(sys.argv[2])))
    else:
        raise SystemExit("unknown mode %r" % mode)


if __name__ == "__main__":
    main()
