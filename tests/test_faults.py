"""Issue 7: faults between two real hosts (two QEMU guests, each with its own rxe device).

Run with ``aiodat rxe run --hosts 2 -- env AIODAT_REQUIRE_DEVICE=1 python -m pytest -m hosts2 tests/test_faults.py``
(once per loop: ``--aiodat-loop asyncio`` / ``uvloop``).  The test runs on host A; the peer program
(tests/fault_peer.py) runs on host B through :mod:`aiodat.testbed.hosts`, on the same loop.
Faults: SIGKILL of the peer, tc netem packet loss, delay and reordering on both directions, the link down, a listener
whose link is down.  Each test states what must hold; the bounds are the ones docs/reliability.md names.
Measured figures are appended as JSON lines to ``$AIODAT_FIGURES`` when that is set.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from typing import Any, AsyncIterator, Dict, List

import pytest

import aiodat
from aiodat import EPAttr, EPState, EventType, EvdFlags, Privileges
from aiodat.testbed import hosts

# two_hosts (tests/conftest.py): skipped outside a two-host test bed, AIODAT_LOOP set for the peer
pytestmark = [pytest.mark.hosts2, pytest.mark.usefixtures("two_hosts")]

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_peer.py")
#: The bound docs/reliability.md names: the survivor of a SIGKILLed peer hears of it within this.
PEER_LOSS_BOUND = 10.0
#: A connect to a host whose link is down fails with a clear error within its timeout plus this slack.
CONNECT_TIMEOUT = 10.0
CONNECT_SLACK = 5.0
#: Longest wait for the broken connection to be reported once the link is down.
BROKEN_BOUND = 60.0
RDMA_SIZE = 64 << 20
STREAM_SIZE = 16 << 20
CHUNK = 1 << 20
#: Packet loss lasts at most this long in the loss tests (the rest of the transfer runs loss-free).
LOSS_WINDOW = float(os.environ.get("AIODAT_LOSS_WINDOW", "60"))
T = 60.0
#: scripts/test.sh runs each loss rate in one of its two-host passes: both loops meet loss (1% on
#: asyncio, 5% on uvloop) in half the minutes (each test is 30-65 s here); by hand, both rates run
LOSS_RATES = [pytest.param(1, marks=pytest.mark.asyncio_pass_only), pytest.param(5, marks=pytest.mark.uvloop_pass_only)]

_ports = iter(range(18500 + (os.getpid() % 200) * 10, 65000))


def figure(name: str, **values: Any) -> None:
    """Record a measured figure (for docs/reliability.md) and print it."""
    line = json.dumps({"test": name, "loop": os.environ.get("AIODAT_LOOP", "?"), **values})
    print(line)
    path = os.environ.get("AIODAT_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.fixture
async def peers() -> AsyncIterator[List[hosts.RemoteProcess]]:
    """Processes started on host B; killed after the test, and the link restored on both hosts."""
    started: List[hosts.RemoteProcess] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
    for h in (0, 1):
        await hosts.clear_netem(h)
        await hosts.link(h, True)
    for p in started:
        try:
            await p.wait_async(30)
        except TimeoutError:
            pass
    await _port_active(30)


async def _port_active(timeout: float) -> None:
    """Wait until our rxe port is ACTIVE again (after a link down/up)."""
    path = "/sys/class/infiniband/%s/ports/1/state" % os.environ["AIODAT_RXE_DEVICE"]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(path) as f:
            if "ACTIVE" in f.read():
                return
        await asyncio.sleep(0.1)
    raise AssertionError("port not ACTIVE after %g s" % timeout)


def start_peer(peers: List[hosts.RemoteProcess], *args: Any) -> hosts.RemoteProcess:
    p = hosts.start_on(1, [sys.executable, PEER] + [str(a) for a in args],
                       env={"AIODAT_LOOP": os.environ["AIODAT_LOOP"]})
    peers.append(p)
    return p


@pytest.fixture
def ia() -> Any:
    handle = aiodat.open_ia(os.environ["AIODAT_RXE_DEVICE"])
    yield handle
    handle.close()


async def wait_type(evd: Any, types: Any, timeout: float) -> Any:
    """The first event of one of ``types`` on ``evd`` (others are skipped) within ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError("no %s within %g s" % (types, timeout))
        ev = await evd.wait_one(timeout=left)
        if ev.type in types:
            return ev


# ---------------------------------------------------------------------------
# the peer process is SIGKILLed mid-transfer


async def _accept_flood(ia: Any, pz: Any, cr_evd: Any, lmr: Any, peers: List[hosts.RemoteProcess],
                        port: int) -> Any:
    flood = start_peer(peers, "flood", hosts.address(0), port)
    ev = await wait_type(cr_evd, (EventType.CONNECTION_REQUEST,), T)
    assert ev.cr.private_data == b"flood".ljust(56, b"\0")
    ep = ia.create_ep(pz, attrs=EPAttr(max_recv_dtos=64, max_request_dtos=64))
    for i in range(32):
        ep.post_recv(lmr[i * 4096:(i + 1) * 4096], cookie=i)
    await ev.cr.accept(ep, timeout=T)
    await flood.wait_output("FLOODING", T)
    return ep, flood


async def test_peer_killed_mid_transfer(ia: Any, peers: List[hosts.RemoteProcess]) -> None:
    """SIGKILL of the peer: DISCONNECTED or BROKEN within PEER_LOSS_BOUND, every outstanding request
    completes (flushed), no waiter hangs, and the PSP accepts a new connection that works."""
    pz = ia.create_pz()
    lmr = pz.register(bytearray(64 * 4096), Privileges.ALL)
    cr_evd = ia.create_evd(8, EvdFlags.CR)
    port = next(_ports)
    ia.create_psp(port, cr_evd)
    ep, flood = await _accept_flood(ia, pz, cr_evd, lmr, peers, port)

    outstanding = {"recv": 32, "send": 0}
    received = 0
    flushed = {"recv": 0, "send": 0}
    bad: List[str] = []
    stop_reposting = asyncio.Event()

    async def consume_recvs() -> None:
        nonlocal received
        while outstanding["recv"]:
            for e in await ep.recv_evd.wait(timeout=T):
                outstanding["recv"] -= 1
                if e.ok:
                    received += 1
                    if not stop_reposting.is_set() and ep.state is EPState.CONNECTED:
                        try:
                            ep.post_recv(lmr[e.cookie * 4096:(e.cookie + 1) * 4096], cookie=e.cookie)
                            outstanding["recv"] += 1
                        except aiodat.DATError:
                            stop_reposting.set()
                elif e.flushed:
                    flushed["recv"] += 1
                else:
                    bad.append(e.status)

    consumer = asyncio.ensure_future(consume_recvs())
    while received < 64:  # mid-transfer: the flood is arriving
        await asyncio.sleep(0.05)
        assert not consumer.done(), consumer
    # requests of our own in flight when the peer dies (the peer reposts its receives, so they may
    # complete, or be flushed, or fail with a transport error once the peer's QP is gone)
    for i in range(8):
        ep.post_send(lmr[(40 + i) * 4096:(40 + i) * 4096 + 64], cookie=("s", i))
        outstanding["send"] += 1
    t0 = time.monotonic()
    flood.kill()
    # receives posted as the peer dies: at most the flood's 8 sends in flight can still fill them,
    # so some must be flushed (a loaded host may leave the consumer behind, with every earlier
    # receive already filled when the peer dies)
    for i in range(48, 64):
        ep.post_recv(lmr[i * 4096:(i + 1) * 4096], cookie=i)
        outstanding["recv"] += 1
    ev = await wait_type(ep.connect_evd, (EventType.CONNECTION_EVENT_DISCONNECTED,
                                         EventType.CONNECTION_EVENT_BROKEN), PEER_LOSS_BOUND)
    detected = time.monotonic() - t0
    stop_reposting.set()
    assert ep.state in (EPState.DISCONNECTED, EPState.ERROR)
    await asyncio.wait_for(consumer, PEER_LOSS_BOUND)  # no waiter hangs: every receive completed
    send_status: Dict[str, int] = {}
    while outstanding["send"]:
        for e in await ep.request_evd.wait(timeout=PEER_LOSS_BOUND):
            outstanding["send"] -= 1
            send_status[e.status] = send_status.get(e.status, 0) + 1
    flushed_all = time.monotonic() - t0
    assert not bad, bad
    assert flushed["recv"] >= 1, "the posted receives were not flushed"
    assert set(send_status) <= {"IBV_WC_SUCCESS", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_RETRY_EXC_ERR"}, send_status
    assert (await flood.wait_async(T)).rc == 137  # it really died of SIGKILL
    figure("peer_killed", event=ev.type.name, detect_s=round(detected, 3), all_flushed_s=round(flushed_all, 3),
           recv_flushed=flushed["recv"], sends=send_status)
    ep.free()

    # the survivor accepts a new connection, and data flows on it
    ep2, flood2 = await _accept_flood(ia, pz, cr_evd, lmr, peers, port)
    e = await ep2.recv_evd.wait_one(timeout=T)
    assert e.ok and e.transferred_length == 4096
    flood2.kill()
    await wait_type(ep2.connect_evd, (EventType.CONNECTION_EVENT_DISCONNECTED,
                                      EventType.CONNECTION_EVENT_BROKEN), PEER_LOSS_BOUND)


# ---------------------------------------------------------------------------
# packet loss


async def _connect_server(ia: Any, pz: Any, peers: List[hosts.RemoteProcess], size: int) -> Any:
    port = next(_ports)
    srv = start_peer(peers, "server", port, size)
    await srv.wait_output("READY", T)
    ep = ia.create_ep(pz, attrs=EPAttr(max_recv_dtos=8, max_request_dtos=64))
    ctl = pz.register(bytearray(4096), Privileges.ALL)
    ep.post_recv(ctl[0:64], cookie="sum")
    reply = await ep.connect(hosts.address(1), port, timeout=T)
    return ep, ctl, aiodat.RemoteRegion.from_bytes(reply), srv


async def _remote_sum(ep: Any, ctl: Any) -> bytes:
    ctl.memoryview()[1024:1028] = b"SUM?"
    ep.post_send(ctl[1024:1028], cookie="sum?")
    (await ep.request_evd.wait_one(timeout=T)).raise_for_status()
    e = (await ep.recv_evd.wait_one(timeout=T)).raise_for_status()
    assert e.transferred_length == 32
    return bytes(ctl.memoryview()[0:32])


async def _lossy(loss: int) -> None:
    await hosts.netem(0, loss=loss)
    await hosts.netem(1, loss=loss)


async def _lossless() -> None:
    await hosts.clear_netem(0)
    await hosts.clear_netem(1)


@pytest.mark.parametrize("loss", LOSS_RATES)
async def test_rdma_write_under_packet_loss(ia: Any, peers: List[hosts.RemoteProcess], loss: int) -> None:
    """A 64 MiB RDMA write (1 MiB writes, 8 in flight) with ``loss`` % of the packets dropped in
    both directions for its first LOSS_WINDOW seconds (all of it if it finishes sooner; the rest
    runs loss-free so the test ends in bounded time under TCG): every write completes, and either
    all succeed and the peer's sha256 of the 64 MiB equals ours, or a failure is reported (an error
    completion and the connection no longer CONNECTED).  Never a success with different data."""
    pz = ia.create_pz()
    ep, ctl, remote, _ = await _connect_server(ia, pz, peers, RDMA_SIZE)
    assert remote.length == RDMA_SIZE
    data = bytearray(os.urandom(RDMA_SIZE))
    src = pz.register(data, Privileges.ALL)
    await _lossy(loss)
    lossy = True
    t0 = time.monotonic()
    under_loss = (0, 0.0)
    failed: List[str] = []
    last_progress = t0
    window, posted, done = 8, 0, 0
    nchunks = RDMA_SIZE // CHUNK
    try:
        while done < nchunks and not failed:
            while posted < nchunks and posted - done < window:
                off = posted * CHUNK
                ep.post_rdma_write(src[off:off + CHUNK], remote[off:off + CHUNK], cookie=posted)
                posted += 1
            try:  # short waits, so the loss window ends on time even when nothing completes
                events = await ep.request_evd.wait(timeout=5)
                last_progress = time.monotonic()
            except aiodat.TimeoutExpired:
                events = []
                assert time.monotonic() - last_progress < BROKEN_BOUND + LOSS_WINDOW, \
                    "no write completed (neither success nor error) for too long: a hang"
            for e in events:
                done += 1
                if not e.ok:
                    failed.append(e.status)
            if lossy and time.monotonic() - t0 > LOSS_WINDOW:
                under_loss = (done, time.monotonic() - t0)
                await _lossless()
                lossy = False
        while done < posted:  # after a failure the rest complete too (flushed)
            for e in await ep.request_evd.wait(timeout=BROKEN_BOUND):
                done += 1
                if not e.ok:
                    failed.append(e.status)
    finally:
        if lossy:
            under_loss = (done, time.monotonic() - t0)
            await _lossless()
    elapsed = time.monotonic() - t0
    mib, secs = under_loss[0] * CHUNK >> 20, under_loss[1]
    if failed:
        assert ep.state is not EPState.CONNECTED, "a write failed but the connection still claims CONNECTED"
        figure("rdma_write_loss", loss=loss, outcome="reported", statuses=sorted(set(failed)),
               mib_under_loss=mib, seconds=round(elapsed, 2))
        return
    digest = await _remote_sum(ep, ctl)
    assert digest == hashlib.sha256(data).digest(), "RDMA write reported success but the data differs"
    figure("rdma_write_loss", loss=loss, outcome="intact", mib_under_loss=mib, lossy_s=round(secs, 2),
           mb_s_under_loss=round(mib * 1.048576 / secs, 2) if secs else None, total_s=round(elapsed, 2))
    await ep.disconnect(timeout=T)


@pytest.mark.parametrize("loss", LOSS_RATES)
async def test_streams_under_packet_loss(ia: Any, peers: List[hosts.RemoteProcess], loss: int) -> None:
    """A STREAM_SIZE transfer over aiodat streams (open_connection, 1 MiB writes + drain) with
    ``loss`` % packet loss both ways for its first LOSS_WINDOW seconds: the peer's sha256 and byte
    count match what we wrote, or the failure is raised to the writer/reader (a DATError or a
    ConnectionError); never a short or corrupted stream reported as complete."""
    port = next(_ports)
    srv = start_peer(peers, "stream-server", port)
    await srv.wait_output("READY", T)
    payload = os.urandom(STREAM_SIZE)
    await _lossy(loss)
    lossy = True
    t0 = time.monotonic()
    under_loss = (0, 0.0)
    sent = 0
    try:
        reader, writer = await aiodat.open_connection(hosts.address(1), port, ia=ia)
        for off in range(0, STREAM_SIZE, CHUNK):
            writer.write(payload[off:off + CHUNK])
            await asyncio.wait_for(writer.drain(), BROKEN_BOUND)
            sent = off + CHUNK
            if lossy and time.monotonic() - t0 > LOSS_WINDOW:
                under_loss = (sent, time.monotonic() - t0)
                await _lossless()
                lossy = False
        writer.write_eof()
        line = await asyncio.wait_for(reader.readline(), BROKEN_BOUND)
        writer.close()
    except (aiodat.DATError, ConnectionError, OSError) as e:
        figure("streams_loss", loss=loss, outcome="reported", error=repr(e), seconds=round(time.monotonic() - t0, 2))
        return
    finally:
        if lossy:
            under_loss = (sent, time.monotonic() - t0)
            await _lossless()
    elapsed = time.monotonic() - t0
    digest, count = line.decode().split()
    assert int(count) == STREAM_SIZE and digest == hashlib.sha256(payload).hexdigest()
    mib, secs = under_loss[0] >> 20, under_loss[1]
    figure("streams_loss", loss=loss, outcome="intact", mib_under_loss=mib, lossy_s=round(secs, 2),
           mb_s_under_loss=round(under_loss[0] / secs / 1e6, 2) if secs else None, total_s=round(elapsed, 2))


# ---------------------------------------------------------------------------
# delay and reordering


async def _probe_rtt(ep: Any, src: Any, remote: Any) -> float:
    """Seconds for one 64-byte RDMA write to complete (a request and its ACK)."""
    t = time.monotonic()
    ep.post_rdma_write(src[0:64], remote[0:64], cookie="probe")
    (await ep.request_evd.wait_one(timeout=T)).raise_for_status()
    return time.monotonic() - t


def _counter(name: str) -> int:
    """One of our rxe port's hw_counters."""
    path = "/sys/class/infiniband/%s/ports/1/hw_counters/%s" % (os.environ["AIODAT_RXE_DEVICE"], name)
    with open(path) as f:
        return int(f.read())


async def test_rdma_write_with_delay_and_reordering(ia: Any, peers: List[hosts.RemoteProcess]) -> None:
    """netem delay on both hosts is real (a write's round trip grows by at least twice the minimum
    delay).  With delay, jitter and 2% reordering both ways during a 4 MiB RDMA write (64 KiB
    writes, 4 in flight), the responder NAKs each gap (our rcvd_seq_err counter grows) and the
    sender resends from it; each such NAK costs one of the write's retries.  Either every write
    succeeds and the peer's sha256 equals ours, or a write runs out of retries and the failure is
    reported (an error completion, the EP no longer CONNECTED).  Never a success with other data."""
    size, chunk, delay, jitter = 4 << 20, 64 << 10, 10.0, 5.0
    pz = ia.create_pz()
    ep, ctl, remote, _ = await _connect_server(ia, pz, peers, size)
    data = bytearray(os.urandom(size))
    src = pz.register(data, Privileges.ALL)
    # The floor of a round trip without netem.  Ten probes, not three: on a noisy host the least of
    # three was once 0.14 ms above the floor the delayed probes then rode on (stop 35's CI).
    base = min([await _probe_rtt(ep, src, remote) for _ in range(10)])
    failed: List[str] = []
    try:
        for h in (0, 1):
            await hosts.netem(h, delay_ms=delay, jitter_ms=jitter)
        delayed = min([await _probe_rtt(ep, src, remote) for _ in range(3)])
        assert delayed >= base + 2 * (delay - jitter) / 1000, (base, delayed)
        for h in (0, 1):  # netem reorders by sending 2% of the packets at once, the rest delayed
            await hosts.netem(h, delay_ms=delay, jitter_ms=jitter, reorder=2)
        seq_errors = _counter("rcvd_seq_err")
        t0 = time.monotonic()
        posted = done = 0
        while done < posted or (posted < size // chunk and not failed):
            while posted < size // chunk and posted - done < 4 and not failed:
                off = posted * chunk
                ep.post_rdma_write(src[off:off + chunk], remote[off:off + chunk], cookie=posted)
                posted += 1
            for e in await ep.request_evd.wait(timeout=BROKEN_BOUND):
                done += 1
                if not e.ok:
                    failed.append(e.status)
        elapsed = time.monotonic() - t0
        seq_errors = _counter("rcvd_seq_err") - seq_errors
    finally:
        await hosts.clear_netem(0)
        await hosts.clear_netem(1)
    facts = dict(seq_naks=seq_errors, base_rtt_ms=round(base * 1000, 1), delayed_rtt_ms=round(delayed * 1000, 1))
    assert seq_errors > 0, "netem reordered nothing the transport noticed"
    if failed:
        assert ep.state is not EPState.CONNECTED, "a write failed but the connection still claims CONNECTED"
        figure("delay_reorder", outcome="reported", statuses=sorted(set(failed)), mib_done=done * chunk >> 20,
               **facts)
        return
    assert await _remote_sum(ep, ctl) == hashlib.sha256(data).digest(), "the data differs after reordering"
    figure("delay_reorder", outcome="intact", mib=size >> 20, seconds=round(elapsed, 2), **facts)
    await ep.disconnect(timeout=T)


# ---------------------------------------------------------------------------
# the link goes down for longer than the transport's retry budget


async def test_link_down_beyond_retry_budget(ia: Any, peers: List[hosts.RemoteProcess]) -> None:
    """The link cut (100% loss both ways) for longer than the transport's retry budget, with a write in flight: the
    write completes in error (retries exhausted) within BROKEN_BOUND, the connection is reported
    broken on the connect EVD and the EP leaves CONNECTED.  Our own link down and up: PORT_ERROR
    then PORT_ACTIVE on the async EVD.
    After both links are up again a new connection works and moves data intact."""
    pz = ia.create_pz()
    ep, ctl, remote, _ = await _connect_server(ia, pz, peers, 1 << 20)
    src = pz.register(bytearray(b"x" * (1 << 20)), Privileges.ALL)
    ep.post_rdma_write(src[0:4096], remote[0:4096], cookie="before")
    assert (await ep.request_evd.wait_one(timeout=T)).ok
    budget = ep.query()  # the QP's retry count and ACK timeout, as the device reports them
    assert budget.retry_count == ep.attrs.retry_count == 6, budget
    # 1. the cable is cut (100% loss both ways): retries run out.  (Not `ip link set down` on the
    # peer under traffic: its virtio NIC stops draining the QEMU stream socket, and our QEMU then
    # stalls, guest and all; see docs/testbed.md.)
    await hosts.netem(0, loss=100)
    await hosts.netem(1, loss=100)
    t0 = time.monotonic()
    ep.post_rdma_write(src[0:CHUNK], remote[0:CHUNK], cookie="during")
    try:
        # the default budget, EPAttr(retry_count=6) with the CM's ACK timeout: about 7 timeouts
        e = await ep.request_evd.wait_one(timeout=BROKEN_BOUND)
        failed_after = time.monotonic() - t0
        assert not e.ok and e.cookie == "during" and e.status == "IBV_WC_RETRY_EXC_ERR", e
        ev = await wait_type(ep.connect_evd, (EventType.CONNECTION_EVENT_BROKEN,
                                             EventType.CONNECTION_EVENT_DISCONNECTED), 5)
        assert ep.state in (EPState.ERROR, EPState.DISCONNECTED)
    finally:
        await hosts.clear_netem(0)
        await hosts.clear_netem(1)
    exhausted = {"retry_exhausted_s": round(failed_after, 2), "status": e.status, "event": ev.type.name,
                 "retry_count": budget.retry_count, "ack_timeout": budget.ack_timeout,
                 "budget_s": round((budget.retry_count + 1) * 4.096e-6 * 2 ** budget.ack_timeout, 2)}
    # 2. our own link down and up (no traffic in flight): the port reports both.  The broken EP is
    # freed afterwards, and freeing it must not take long.
    await hosts.link(0, False)
    port_err = await wait_type(ia.async_evd, (EventType.ASYNC_PORT_ERROR,), T)
    await hosts.link(0, True)
    active = await wait_type(ia.async_evd, (EventType.ASYNC_PORT_ACTIVE,), T)
    assert port_err.port == active.port == ia.port
    await _port_active(T)
    t1 = time.monotonic()
    ep.free()
    free_s = time.monotonic() - t1
    figure("link_down", free_s=round(free_s, 2), **exhausted)
    # 3. a new connection works
    ep2, ctl2, remote2, _ = await _connect_server(ia, pz, peers, 1 << 20)
    src.memoryview()[0:8] = b"afterup!"
    ep2.post_rdma_write(src[0:4096], remote2[0:4096], cookie="after")
    assert (await ep2.request_evd.wait_one(timeout=T)).ok
    ctl2.memoryview()[1024:1044] = b"SUM?" + (0).to_bytes(8, "big") + (4096).to_bytes(8, "big")
    ep2.post_send(ctl2[1024:1044], cookie="sum?")
    (await ep2.request_evd.wait_one(timeout=T)).raise_for_status()
    (await ep2.recv_evd.wait_one(timeout=T)).raise_for_status()
    assert bytes(ctl2.memoryview()[0:32]) == hashlib.sha256(bytes(src.memoryview()[0:4096])).digest()
    await ep2.disconnect(timeout=T)


# ---------------------------------------------------------------------------
# connecting to a host that is not there


async def test_connect_while_listener_link_down(ia: Any, peers: List[hosts.RemoteProcess]) -> None:
    """The listener's host unreachable (the cable cut: 100% loss both ways): connect raises a
    DAT connection error (Unreachable or ConnectionTimedOut) within CONNECT_TIMEOUT +
    CONNECT_SLACK; nothing hangs.  (Not `ip link set down` on the listener: while our side
    sends, its virtio NIC stops draining the QEMU stream socket and our QEMU stalls, guest
    and all; see docs/testbed.md.)"""
    port = next(_ports)
    srv = start_peer(peers, "server", port, 4096)
    await srv.wait_output("READY", T)
    await hosts.netem(0, loss=100)
    await hosts.netem(1, loss=100)
    pz = ia.create_pz()
    ep = ia.create_ep(pz)
    t0 = time.monotonic()
    with pytest.raises((aiodat.Unreachable, aiodat.ConnectionTimedOut, aiodat.TimeoutExpired)) as info:
        await asyncio.wait_for(ep.connect(hosts.address(1), port, timeout=CONNECT_TIMEOUT),
                               CONNECT_TIMEOUT + CONNECT_SLACK)
    took = time.monotonic() - t0
    assert ep.state is not EPState.CONNECTED
    figure("connect_link_down", error=type(info.value).__name__, seconds=round(took, 2))
    await hosts.clear_netem(0)
    await hosts.clear_netem(1)
    ep.free()


async def test_connect_nothing_listening(ia: Any, peers: List[hosts.RemoteProcess]) -> None:
    """The peer host is up but nothing listens on the port: a rejection, quickly."""
    pz = ia.create_pz()
    ep = ia.create_ep(pz)
    t0 = time.monotonic()
    with pytest.raises(aiodat.ConnectionRejected):
        await ep.connect(hosts.address(1), next(_ports), timeout=CONNECT_TIMEOUT)
    figure("connect_no_listener", seconds=round(time.monotonic() - t0, 2))
    ep.free()
