"""A quick latency check, with no perftest and no repeats: the one-process 64-byte ping-pong of
``aiodat bench latency`` in its three delivery modes (await, callback, busypoll), p50 round trip.
A developer's tool for a quiet host, where the full benchmark takes too long to repeat often:

    aiodat rxe run -- sh -c '.venv/bin/python bench/modes_pingpong.py uvloop 1000 16;
        /usr/bin/python3 aiodat/bench/pyverbs_pingpong.py --device $AIODAT_RXE_DEVICE \
        --address 169.254.77.1 --mode event'

Arguments: loop (asyncio|uvloop), iterations, one send in how many signalled (docs/performance.md
took its quiet-host table with 8; pyverbs's default is 16), and the modes to run (comma-separated,
default all three; one alone under a profiler).
"""
import asyncio, sys, time, statistics
import aiodat
from aiodat import EvdFlags, EPAttr, CompletionFlags, DTOOp
from aiodat.cm import connect_pair
from aiodat.bench.harness import device_and_address, run_on_loop

SIZE, N = 64, int(sys.argv[2]) if len(sys.argv) > 2 else 1000
SIG = int(sys.argv[3]) if len(sys.argv) > 3 else 16

def ep(ia, pz, busy):
    sb, rb = bytearray(SIZE), bytearray(SIZE)
    s = pz.register(sb)[0:SIZE]; r = pz.register(rb)[0:SIZE]
    evd = ia.create_evd(256, EvdFlags.DTO, busy_poll_us=busy)
    e = ia.create_ep(pz, recv_evd=evd, request_evd=evd, attrs=EPAttr(max_recv_dtos=64, max_request_dtos=64))
    return e, evd, s, r

async def run(mode):
    dev, addr = device_and_address(None, None)
    with aiodat.open_ia(dev) as ia:
        pz = ia.create_pz()
        busy = 1000 if mode == "busypoll" else 0
        a, ea, sa, ra = ep(ia, pz, busy); b, eb, sb, rb = ep(ia, pz, busy)
        b.post_recv(rb)
        await connect_pair(a, b)
        SIGNAL, SUP = CompletionFlags.DEFAULT, CompletionFlags.SUPPRESS
        RECV = DTOOp.RECV
        stamps = []
        if mode == "callback":
            loop = asyncio.get_running_loop(); done = loop.create_future()
            cnt = [0, 0]
            def on_b(evs):
                for ev in evs:
                    if ev.operation is RECV:
                        cnt[1] += 1
                        b.post_recv(rb); b.post_send(sb, None, SIGNAL if cnt[1] % SIG == 0 else SUP)
            def on_a(evs):
                for ev in evs:
                    if ev.operation is RECV:
                        cnt[0] += 1
                        stamps.append(time.perf_counter_ns())
                        if cnt[0] == N: done.set_result(None); return
                        a.post_recv(ra); a.post_send(sa, None, SIGNAL if cnt[0] % SIG == 0 else SUP)
            ea.set_callback(on_a); eb.set_callback(on_b)
            a.post_recv(ra); stamps.append(time.perf_counter_ns()); a.post_send(sa)
            await done
        else:
            async def pong():
                for i in range(N):
                    got = False
                    while not got:
                        for ev in await eb.wait():
                            if ev.operation is RECV: got = True
                    b.post_recv(rb); b.post_send(sb, None, SIGNAL if i % SIG == 0 else SUP)
            t = asyncio.ensure_future(pong())
            for i in range(N):
                a.post_recv(ra); stamps.append(time.perf_counter_ns())
                a.post_send(sa, None, SIGNAL if i % SIG == 0 else SUP)
                got = False
                while not got:
                    for ev in await ea.wait():
                        if ev.operation is RECV: got = True
            stamps.append(time.perf_counter_ns())
            await t
        rtt = sorted((stamps[i+1]-stamps[i])/1000 for i in range(N//10, len(stamps)-1))
        return statistics.median(rtt)

loop = sys.argv[1] if len(sys.argv) > 1 else "asyncio"
for mode in sys.argv[4].split(",") if len(sys.argv) > 4 else ("await", "callback", "busypoll"):
    print(f"{loop} {mode}: p50 RTT {run_on_loop(loop, lambda: run(mode)):.1f} us", flush=True)
