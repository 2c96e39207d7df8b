"""How low can a Python ping-pong go on this device?  A developer's tool, run where rxe is:

    aiodat rxe run -- .venv/bin/python bench/latency_floor.py [--iters 1000] [--rounds 2]

It runs the send/recv ping-pong of ``aiodat bench latency`` (2-byte messages,
the next receive posted before each send, one send in 16 signalled) in
several ways, one after the other in the same guest, and prints each p50 half
round trip beside ``ib_send_lat -R -e``'s typical from the same round:

* ``aiodat``: ``aiodat.bench.latency_pingpong``, the benchmark itself;
* ``raw loop``: aiodat only sets the connection up; the hot loop calls the
  shim directly (``aiodat_post_recv1``, ``aiodat_post_send1``,
  ``aiodat_cq_drain``) and sleeps on the completion channel through the event
  loop (``add_reader`` and a future), with as little Python as it can: the
  floor of any asyncio design that posts and polls through cffi;
* ``raw poll``: the same calls with no event loop at all, blocking in
  ``select.poll`` on the completion channel: the floor of Python itself;
* ``tcp loop``: the same ping-pong over TCP on loopback, both ends asyncio
  ``Protocol`` objects on one loop whose ``data_received`` answers at once:
  the floor of a TCP design, what issue 16's "small requests cost no more
  than TCP loopback" compares against;
* ``aiodat posts`` and ``aiodat wait``: the raw loop with aiodat's
  ``ep.post_recv``/``ep.post_send`` in place of the raw posts, or with
  ``await evd.wait()`` in place of the raw wait: which of the two costs more.

So aiodat's own cost is ``aiodat`` minus ``raw loop``, the event loop's is
``raw loop`` minus ``raw poll``, and what Python costs over C is ``raw poll``
minus perftest.  One process: both sides are tasks on one loop; two: the pong
side is a child process (``python bench/latency_floor.py --child ...``).
"""
from __future__ import annotations

import argparse
import asyncio
import select
import subprocess
import sys
import time
from typing import Any, List, Optional

from aiodat import CompletionFlags, DTOOp, open_ia
from aiodat._lib import ffi, lib
from aiodat.bench import SIGNAL_EVERY, device_and_address, latency_pingpong, percentile, run_on_loop, run_perftest_pair
from aiodat.bench.latency import endpoint
from aiodat.bench.peer import accept_one
from aiodat.cm import connect_pair
from aiodat.evd import _WC

clock = time.perf_counter_ns
WR_SEND, SEND_SIGNALED = 2, 2


class RawSide:
    """One side of the ping-pong over the shim, on an EP and EVD that aiodat set up.

    ``aiodat_posts``/``aiodat_wait`` put aiodat's own posts or wait back in.
    """

    def __init__(self, ep: Any, evd: Any, send_seg: Any, recv_seg: Any, *,
                 aiodat_posts: bool = False, aiodat_wait: bool = False) -> None:
        if aiodat_posts:
            flags = (CompletionFlags.DEFAULT, CompletionFlags.SUPPRESS)
            self.post_recv = lambda: ep.post_recv(recv_seg)  # type: ignore[method-assign]
            self.post_send = lambda i: ep.post_send(  # type: ignore[method-assign]
                send_seg, None, flags[0] if i % SIGNAL_EVERY == 0 else flags[1])
        if aiodat_wait:
            self.wait_loop = lambda: self._aiodat_wait(evd)  # type: ignore[method-assign]
            self.use_loop = lambda: None  # type: ignore[method-assign]
        else:
            evd._watch.detach()  # this side reads the channel itself
        self.channel, self.cq, self.qp = evd._channel, evd._cq, ep._qp
        self.fd = self.channel.fd
        self.wcs = ffi.new("struct aiodat_wc[]", 64)
        self.wc_bytes = ffi.buffer(self.wcs)
        self.nevents = ffi.new("int[3]")  # channel events read, arm errno, completions copied
        self.send = (send_seg.address, send_seg.length, send_seg.lmr_context)
        self.recv = (recv_seg.address, recv_seg.length, recv_seg.lmr_context)
        self.recvs = 0
        self.next_id = 1000
        self.fut: Optional[asyncio.Future[None]] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.poller: Any = None

    def _drain(self, channel: Any) -> None:
        got = lib.aiodat_cq_drain(channel, self.cq, 0, self.wcs, 64, self.nevents)
        for wc in _WC.iter_unpack(self.wc_bytes[0:got * _WC.size]):
            self.recvs += wc[0] & 1  # odd wr_ids are receives

    def use_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.fd, self._on_readable)

    def _on_readable(self) -> None:
        self._drain(self.channel)
        fut = self.fut
        if self.recvs and fut is not None and not fut.done():
            fut.set_result(None)

    async def wait_loop(self) -> None:
        while not self.recvs:
            self._drain(ffi.NULL)
            if not self.recvs:
                self.fut = self.loop.create_future()  # type: ignore[union-attr]
                await self.fut
                self.fut = None
        self.recvs -= 1

    async def _aiodat_wait(self, evd: Any) -> None:
        while True:
            for event in await evd.wait():
                if event.operation is DTOOp.RECV:
                    return

    def wait_poll(self) -> None:
        if self.poller is None:
            self.poller = select.poll()
            self.poller.register(self.fd, select.POLLIN)
        while not self.recvs:
            self._drain(ffi.NULL)
            if not self.recvs:
                self.poller.poll()
                self._drain(self.channel)
        self.recvs -= 1

    def post_recv(self) -> None:
        self.next_id += 1
        lib.aiodat_post_recv1(self.qp, self.next_id * 2 + 1, *self.recv)

    def post_send(self, i: int) -> None:
        self.next_id += 1
        lib.aiodat_post_send1(self.qp, self.next_id * 2, WR_SEND, SEND_SIGNALED if i % SIGNAL_EVERY == 0 else 0,
                              0, *self.send, 0, 0)


async def pong(side: RawSide, total: int, poll: bool) -> None:
    for i in range(total):
        if poll:
            side.wait_poll()
        else:
            await side.wait_loop()
        if i + 1 < total:
            side.post_recv()
        side.post_send(i)


async def ping(side: RawSide, total: int, poll: bool) -> List[int]:
    stamps = [0] * (total + 1)
    for i in range(total):
        side.post_recv()
        stamps[i] = clock()
        side.post_send(i)
        if poll:
            side.wait_poll()
        else:
            await side.wait_loop()
    stamps[total] = clock()
    return stamps


async def run_raw(device: str, address: str, total: int, processes: int, poll: bool, loop_name: str,
                  **aiodat_parts: bool) -> float:
    """p50 half round trip (us) of the raw ping-pong (``aiodat_parts``: see RawSide, one process)."""
    with open_ia(device) as ia:
        pz = ia.create_pz()
        c_ep, c_evd, c_send, c_recv, _bufs = endpoint(ia, pz, 2, True)
        child = task = None
        if processes == 1:
            s_ep, s_evd, s_send, s_recv, _sbufs = endpoint(ia, pz, 2, False)
            s_ep.post_recv(s_recv)
            await connect_pair(c_ep, s_ep)
            server = RawSide(s_ep, s_evd, s_send, s_recv, **aiodat_parts)
            server.use_loop()
            task = asyncio.ensure_future(pong(server, total, False))
        else:
            child = subprocess.Popen([sys.executable, __file__, "--child", device, str(total), loop_name,
                                      "poll" if poll else "loop"], stdout=subprocess.PIPE)
            assert child.stdout is not None
            port = int(child.stdout.readline().split()[1])
            await c_ep.connect(address, port, timeout=30)
        client = RawSide(c_ep, c_evd, c_send, c_recv, **aiodat_parts)
        if not poll:
            client.use_loop()
        stamps = await ping(client, total, poll)
        if task is not None:
            await task
        if child is not None and child.wait(60) != 0:
            raise RuntimeError("the pong process failed")
    warmup = total // 11
    half = sorted((stamps[i + 1] - stamps[i]) / 2000.0 for i in range(warmup, total))
    return percentile(half, 50)


class _TcpSide(asyncio.Protocol):
    """One end of the TCP ping-pong: the pong end answers each message; the ping end counts replies."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.transport: Any = None
        self.fut: Optional[asyncio.Future[None]] = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(6, 1, 1)  # TCP_NODELAY, as asyncio sets it

    def data_received(self, data: bytes) -> None:
        if self.answer:
            self.transport.write(data)
        elif self.fut is not None and not self.fut.done():
            self.fut.set_result(None)


async def run_tcp(total: int) -> float:
    """p50 half round trip (us) of a 2-byte ping-pong over TCP loopback, both ends on this loop."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _TcpSide(True), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _t, client = await loop.create_connection(lambda: _TcpSide(False), "127.0.0.1", port)
    stamps = [0] * (total + 1)
    for i in range(total):
        client.fut = loop.create_future()
        stamps[i] = clock()
        client.transport.write(b"pp")
        await client.fut
    stamps[total] = clock()
    client.transport.close()
    server.close()
    await server.wait_closed()
    warmup = total // 11
    half = sorted((stamps[i + 1] - stamps[i]) / 2000.0 for i in range(warmup, total))
    return percentile(half, 50)


async def child_main(device: str, total: int, poll: bool) -> None:
    with open_ia(device) as ia:
        pz = ia.create_pz()
        ep, evd, send_seg, recv_seg, _bufs = endpoint(ia, pz, 2, False)
        ep.post_recv(recv_seg)
        await accept_one(ia, ep)
        side = RawSide(ep, evd, send_seg, recv_seg)
        if not poll:
            side.use_loop()
        await pong(side, total, poll)
        await asyncio.sleep(0.2)  # let the last reply leave before the client disconnects


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        device, total, loop_name, how = sys.argv[2:6]
        run_on_loop(loop_name, lambda: child_main(device, int(total), how == "poll"))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    device, address = device_and_address()
    total = args.iters + args.iters // 10
    for rnd in range(1, args.rounds + 1):
        res = run_perftest_pair("ib_send_lat", ["-s", "2", "-n", str(args.iters), "-e"],
                                device=device, address=address, timeout=300)
        typical = res.value("t_typical[usec]")
        print(f"round {rnd}: ib_send_lat -R -e typical {typical} us")
        rows = []
        for loop_name in ("uvloop", "asyncio"):
            sample = run_on_loop(loop_name, lambda: latency_pingpong(device, address, 2, args.iters,
                                                                     loop_name=loop_name))
            rows.append((f"aiodat, {loop_name}, 1 process", sample.p50))
            for procs in (1, 2):
                p50 = run_on_loop(loop_name, lambda: run_raw(device, address, total, procs, False, loop_name))
                rows.append((f"raw loop, {loop_name}, {procs} process{'es' if procs > 1 else ''}", p50))
            rows.append((f"tcp loop, {loop_name}, 1 process", run_on_loop(loop_name, lambda: run_tcp(total))))
        p50 = run_on_loop("asyncio", lambda: run_raw(device, address, total, 2, True, "asyncio"))
        rows.append(("raw poll, no loop, 2 processes", p50))
        for part in ("aiodat_posts", "aiodat_wait"):
            p50 = run_on_loop("uvloop", lambda: run_raw(device, address, total, 1, False, "uvloop", **{part: True}))
            rows.append((f"{part.replace('_', ' ')}, uvloop, 1 process", p50))
        for name, p50 in rows:
            ratio = f"{p50 / typical:.2f}x" if typical else "n/a"
            print(f"  {name:34s} p50 {p50:7.1f} us  {ratio}", flush=True)


if __name__ == "__main__":
    main()
