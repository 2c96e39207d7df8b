"""Issue 12: aiodat against rdmacm-utils' C programs, aiodat playing each role.

Each test runs the unmodified C program from /usr/bin on the test bed's rxe device and plays
the other side of its protocol with aiodat's public API.  A test fails when the program exits
non-zero, reports an error, or times out, or when a byte or a length differs.

* ``rdma_server`` / ``rdma_client`` (rdma_create_ep, inline sends): one 16-byte message each
  way.  The programs send their zero-filled static buffer, so we receive into 0xff-filled
  memory and check it came back 16 zeros; their accept and connect carry no private data, so
  the CM's blocks are all zeros.
* ``ucmatose`` with 3 connections: the server side sends -C messages of -S bytes on every
  connection, the client side receives them all and answers with as many, then the server
  disconnects every connection.  ucmatose does not look at the bytes (it sends uninitialised
  memory) nor at completion statuses, so we check every completion, every length, and that a
  send or receive the C side could not take would have stalled it (it exits 0 only after
  counting all of them).
* ``udaddy`` (UD over SIDR): the client resolves the server's QP with a SIDR REQ and sends -C
  datagrams with its QP number as immediate data; the server answers to that QP number with
  as many.  Both roles.
* ``mckey`` (multicast): the receiver joins the group and counts -C datagrams; the sender joins
  and sends them (immediate data: its QP number).  Both roles.

rping and the plain librdmacm peer with private data both ways are in test_interop_c.py.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from typing import Any, List, Optional

import pytest

import aiodat
from aiodat import EPAttr, EventType, EvdFlags, Privileges, ServiceType
from aiodat.datagram import GRH_SIZE

pytestmark = pytest.mark.rxe

T = 120.0  # every wait: under TCG the C programs busy-poll on the guest's two vCPUs beside us


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} (rdmacm-utils) is needed: scripts/bootstrap.sh installs it"
    return path


class Peer:
    """A C program running as a child process: its stdout read line by line, its exit checked.

    ``async with Peer(...)`` kills it on the way out if it is still running.
    """

    def __init__(self, *args: str, line_buffered: bool = False) -> None:
        # stdout into a pipe is block-buffered in C: stdbuf -oL when a test must see a line early
        self.name = args[0].rsplit("/", 1)[-1]
        self.args = (tool("stdbuf"), "-oL", *args) if line_buffered else args
        self.proc: Any = None
        self.lines: List[str] = []

    async def __aenter__(self) -> "Peer":
        self.proc = await asyncio.create_subprocess_exec(*self.args, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.PIPE)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def line(self, prefix: str) -> str:
        """Read up to the first line that starts with ``prefix``."""
        while True:
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), T)
            except asyncio.TimeoutError:
                raise AssertionError(f"{self.name} printed no {prefix!r} within {T}s: {self.lines}") from None
            if not raw:
                raise AssertionError(f"{self.name} ended without printing {prefix!r}: "
                                     f"{self.lines} {(await self.proc.stderr.read()).decode()}")
            self.lines.append(raw.decode().rstrip("\n"))
            if self.lines[-1].startswith(prefix):
                return self.lines[-1]

    async def finish(self) -> List[str]:
        """Wait for the program to exit; assert it exited 0; return all it printed."""
        try:
            await asyncio.wait_for(self.proc.wait(), T)  # (they print little: no pipe fills up)
        except asyncio.TimeoutError:
            self.proc.kill()
        out, err = await self.proc.communicate()
        self.lines.extend(out.decode().splitlines())
        assert self.proc.returncode == 0, f"{self.name} exited {self.proc.returncode} (-9: still running " \
                                          f"after {T}s, killed): {self.lines} {err.decode()}"
        return self.lines

    async def listening(self, port: int) -> None:
        """Wait until the program's rdma_cm id listens on ``port`` (`rdma resource show cm_id`)."""
        deadline = asyncio.get_running_loop().time() + T
        while asyncio.get_running_loop().time() < deadline:
            show = await asyncio.create_subprocess_exec(tool("rdma"), "-j", "resource", "show", "cm_id",
                                                        stdout=asyncio.subprocess.PIPE)
            out, _ = await show.communicate()
            if any(i.get("pid") == self.proc.pid and i.get("state") == "LISTEN"
                   and i.get("src-addr", "").endswith(f":{port}") for i in json.loads(out or b"[]")):
                return
            if self.proc.returncode is not None:
                await self.finish()  # says why it ended
                raise AssertionError(f"{self.name} ended before listening: {self.lines}")
            await asyncio.sleep(0.2)
        raise AssertionError(f"{self.name} did not listen on port {port} within {T}s")


def free_port(ia: Any) -> int:
    """A port of rdma_cm's TCP port space nothing listens on: the one a throwaway PSP got."""
    evd = ia.create_evd(1, EvdFlags.CR)
    psp = ia.create_psp_any(evd)
    port = psp.port
    psp.free()
    evd.free()
    return port


async def completions(evd: Any, count: int) -> List[Any]:
    """The next ``count`` events of ``evd``, each a successful DTO completion."""
    events = []
    for _ in range(count):
        event = await evd.wait_one(timeout=T)
        assert event.type is EventType.DTO_COMPLETION, event
        events.append(event.raise_for_status())
    return events


async def peer_disconnected(ep: Any) -> None:
    event = await ep.connect_evd.wait_one(timeout=T)
    assert event.type is EventType.CONNECTION_EVENT_DISCONNECTED, event


# -- rdma_server / rdma_client: one 16-byte message each way ----------------------------

MSG = 16  # both programs register, post and send exactly 16 bytes
OURS = b"aiodat says hi!\n"


async def test_aiodat_client_against_rdma_server(ia: Any) -> None:
    port = free_port(ia)
    async with Peer(tool("rdma_server"), "-s", ia.address, "-p", str(port)) as server:
        await server.listening(port)  # it accepts one connection only: no probing connects
        pz = ia.create_pz()
        reply = pz.register(bytearray(b"\xff" * MSG))
        ep = ia.create_ep(pz)
        ep.post_recv(reply, cookie="reply")
        # rdma_accept(id, NULL): no private data, so the REP's block is all zeros, from offset 0
        assert await ep.connect(ia.address, port, timeout=T) == bytes(196)
        ep.post_send(pz.register(bytearray(OURS)), cookie="hello")
        await completions(ep.request_evd, 1)
        (got,) = await completions(ep.recv_evd, 1)  # it answers only after receiving ours
        assert got.transferred_length == MSG and bytes(reply.memoryview()) == bytes(MSG)  # its inline send
        await peer_disconnected(ep)  # it disconnects once its send completed
        assert (await server.finish())[-1] == "rdma_server: end 0"


async def test_rdma_client_against_aiodat_server(ia: Any) -> None:
    cr_evd = ia.create_evd(4, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    pz = ia.create_pz()
    request = pz.register(bytearray(b"\xff" * MSG))
    ep = ia.create_ep(pz)
    ep.post_recv(request, cookie="request")  # it sends the moment it is connected
    async with Peer(tool("rdma_client"), "-s", ia.address, "-p", str(psp.port)) as client:
        cr = (await cr_evd.wait_one(timeout=T)).cr
        assert cr.private_data == bytes(56)  # rdma_connect(id, NULL): the CM's zeros only
        await cr.accept(ep, timeout=T)
        (got,) = await completions(ep.recv_evd, 1)
        assert got.transferred_length == MSG and bytes(request.memoryview()) == bytes(MSG)
        ep.post_send(pz.register(bytearray(OURS)), cookie="reply")
        await completions(ep.request_evd, 1)
        await peer_disconnected(ep)  # it disconnects once it has our reply
        assert (await client.finish())[-1] == "rdma_client: end 0"


# -- ucmatose: several connections, -C messages of -S bytes each way on each ------------

CONNS, COUNT, SIZE = 3, 4, 100


@dataclass
class Side:
    """An EP and its memory: ``receives`` slots of SIZE bytes posted, and a SIZE-byte message."""

    ep: Any
    slots: List[Any]
    message: Any

    @classmethod
    def make(cls, ia: Any, pz: Any, receives: int = 0, attrs: Any = None) -> "Side":
        ep = ia.create_ep(pz, attrs=attrs)
        lmr = pz.register(bytearray(SIZE * (receives + 1)), Privileges.LOCAL_WRITE)
        slots = [lmr[i * SIZE:(i + 1) * SIZE] for i in range(receives)]
        post = ep.post_recv_datagram if ep.attrs.service_type is ServiceType.UD else ep.post_recv
        for i, slot in enumerate(slots):  # posted before connecting, as the C programs do
            post(slot, cookie=i)
        message = lmr[receives * SIZE:]
        message.memoryview()[:] = bytes(range(SIZE))
        return cls(ep, slots, message)


async def receive_all(side: Side) -> None:
    got = await completions(side.ep.recv_evd, COUNT)
    assert [(e.cookie, e.transferred_length) for e in got] == [(i, SIZE) for i in range(COUNT)]


async def send_all(side: Side) -> None:
    for i in range(COUNT):
        side.ep.post_send(side.message, cookie=i)
    await completions(side.ep.request_evd, COUNT)  # each taken by a receive the C side posted


def ucmatose_args(port: int) -> List[str]:
    return ["-p", str(port), "-c", str(CONNS), "-C", str(COUNT), "-S", str(SIZE)]


async def test_aiodat_clients_against_ucmatose_server(ia: Any) -> None:
    port = free_port(ia)
    # no -s: ucmatose is the server, bound to -b
    async with Peer(tool("ucmatose"), "-b", ia.address, *ucmatose_args(port)) as server:
        await server.listening(port)
        pz = ia.create_pz()
        sides = [Side.make(ia, pz, receives=COUNT) for _ in range(CONNS)]
        await asyncio.gather(*(side.ep.connect(ia.address, port, timeout=T) for side in sides))
        # once all are up it sends on each; we answer on each only after receiving everything,
        # as its client does; then it disconnects every connection
        for side in sides:
            await receive_all(side)
        await asyncio.gather(*(send_all(side) for side in sides))
        for side in sides:
            await peer_disconnected(side.ep)
        printed = await server.finish()
        assert "data transfers complete" in printed and printed[-1] == "return status 0"


async def test_ucmatose_clients_against_aiodat_server(ia: Any) -> None:
    cr_evd = ia.create_evd(CONNS, EvdFlags.CR)
    psp = ia.create_psp_any(cr_evd)
    pz = ia.create_pz()
    # -s names the server: ucmatose is the client, connecting CONNS times
    async with Peer(tool("ucmatose"), "-s", ia.address, *ucmatose_args(psp.port)) as client:
        sides = []
        for _ in range(CONNS):
            request = await cr_evd.wait_one(timeout=T)
            sides.append(Side.make(ia, pz, receives=COUNT))
            await request.cr.accept(sides[-1].ep, timeout=T)
        # the server side sends first, then takes the client's answers, then disconnects
        await asyncio.gather(*(send_all(side) for side in sides))
        for side in sides:
            await receive_all(side)
        await asyncio.gather(*(side.ep.disconnect(timeout=T) for side in sides))
        printed = await client.finish()  # it exits once every connection is disconnected
        assert "data transfers complete" in printed and printed[-1] == "return status 0"


# -- udaddy (UD over SIDR) and mckey (multicast) ----------------------------------------

UD = EPAttr(service_type=ServiceType.UD, max_recv_iov=2)  # the GRH in a segment of its own
UDADDY_PORT = 7174  # udaddy has no option for the port: its -p picks the port space


async def receive_datagrams(side: Side, sender_qpn: Optional[int] = None) -> int:
    """COUNT datagrams of SIZE bytes, each carrying its sender's QP number as immediate data
    (udaddy and mckey do that); returns the sender's QP number."""
    got = await completions(side.ep.recv_evd, COUNT)
    senders = {e.src_qp for e in got}
    assert len(senders) == 1 and (sender_qpn is None or senders == {sender_qpn}), senders
    assert [(e.cookie, e.transferred_length - GRH_SIZE, e.imm_data) for e in got] == \
        [(i, SIZE, e.src_qp) for i, e in enumerate(got)]
    return got[0].src_qp


async def send_datagrams(side: Side, to: Any) -> None:
    for i in range(COUNT):  # our QP number as immediate data, as udaddy and mckey send theirs
        side.ep.post_send_to(side.message, to, cookie=i, imm_data=side.ep.qp_num)
    await completions(side.ep.request_evd, COUNT)


COUNTS = ["-C", str(COUNT), "-S", str(SIZE)]


async def test_aiodat_client_against_udaddy_server(ia: Any) -> None:
    async with Peer(tool("udaddy"), "-b", ia.address, *COUNTS) as server:
        await server.listening(UDADDY_PORT)
        side = Side.make(ia, ia.create_pz(), receives=COUNT, attrs=UD)
        ah = await side.ep.resolve_datagram(ia.address, UDADDY_PORT, timeout=T)  # SIDR REQ, its REP
        assert ah.private_data == bytes(136)  # it accepts with no private data
        # it answers to the QP number our immediate data names, at the address our GRH gives
        await send_datagrams(side, ah)
        assert await receive_datagrams(side, sender_qpn=ah.remote_qpn) == ah.remote_qpn
        printed = await server.finish()
        assert "data transfers complete" in printed and printed[-1] == "return status 0"


async def test_udaddy_client_against_aiodat_server(ia: Any) -> None:
    side = Side.make(ia, ia.create_pz(), receives=COUNT, attrs=UD)
    psp = side.ep.serve_datagram(UDADDY_PORT)
    async with Peer(tool("udaddy"), "-s", ia.address, *COUNTS) as client:
        client_qpn = await receive_datagrams(side)
        assert psp.requests == 1 and psp.peers[0][1] == bytes(180)  # its SIDR REQ, no private data
        # aiodat cannot yet make an address handle from a received datagram's GRH (udaddy's
        # ibv_create_ah_from_wc; docs/datapath.md says so), so reach the client through an AH
        # resolved to our own service: on the one-host test bed its path is the client's path,
        # and the QP number a send goes to is a field of the work request, not of the AH.
        reply = await side.ep.resolve_datagram(ia.address, psp.port, timeout=T)
        reply.remote_qpn = client_qpn
        await send_datagrams(side, reply)
        printed = await client.finish()  # it exits only after receiving COUNT datagrams
        assert "data transfers complete" in printed and printed[-1] == "return status 0"


async def test_mckey_sender_to_aiodat_receiver(ia: Any) -> None:
    group = "239.12.0.1"
    side = Side.make(ia, ia.create_pz(), receives=COUNT, attrs=UD)
    joined = await side.ep.join_multicast(group, timeout=T)  # attached before mckey sends (3 s after its join)
    async with Peer(tool("mckey"), "-s", "-m", group, "-b", ia.address, *COUNTS) as sender:
        await receive_datagrams(side)
        printed = await sender.finish()
        assert f"mckey: joined dgid: ::ffff:{group} mlid 0x0 sl 0" in printed
        assert printed[-1] == "return status 0"
    await joined.leave()


async def test_aiodat_sender_to_mckey_receiver(ia: Any) -> None:
    group = "239.12.0.2"
    async with Peer(tool("mckey"), "-m", group, "-b", ia.address, *COUNTS, line_buffered=True) as receiver:
        # its receives are posted before it joins: once it says joined, it takes what we send
        assert await receiver.line("mckey: joined") == f"mckey: joined dgid: ::ffff:{group} mlid 0x0 sl 0"
        side = Side.make(ia, ia.create_pz(), attrs=UD)
        joined = await side.ep.join_multicast(group, timeout=T)
        assert joined.address_handle.remote_qkey == 0x01234567  # RDMA_UDP_QKEY, as mckey's QP has
        await send_datagrams(side, joined)
        printed = await receiver.finish()  # it exits only after counting COUNT datagrams
        assert "data transfers complete" in printed and printed[-1] == "return status 0"
        await joined.leave()
