"""Issue 13, items 3-5: fork safety, lifetimes of dropped objects, one loop per object."""
from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import threading
from typing import Any, List, Optional

import pytest

import aiodat
from aiodat.testing.plugin import make_ep_pair

pytestmark = pytest.mark.rxe

T = 30.0  # bound for every wait: the QEMU guest runs under TCG


async def exchange(pair: Any, payload: bytes) -> None:
    """One send from client to server, checked byte for byte."""
    pair.server.post_recv(pair.server_lmr[0:len(payload)], cookie="rx")
    pair.client_lmr.memoryview()[0:len(payload)] = payload
    pair.client.post_send(pair.client_lmr[0:len(payload)], cookie="tx")
    (sent,) = await pair.client.request_evd.wait(timeout=T)
    (got,) = await pair.server.recv_evd.wait(timeout=T)
    assert sent.ok and got.ok and got.transferred_length == len(payload)
    assert bytes(pair.server_lmr.memoryview()[0:len(payload)]) == payload


def child_drops_everything(objects: List[Any]) -> int:
    """In the child: every object is unusable (naming fork); dropping and collecting them, and
    closing them, touches nothing of the parent's.  Returns the exit status."""
    ia, pair, lmr = objects[0], objects[1], objects[2]
    try:
        pair.client.post_send(pair.client_lmr[0:4])
    except aiodat.InvalidState as exc:
        if "fork" not in str(exc):
            return 3
    else:
        return 2
    if not (ia.closed and lmr.closed and pair.server.closed):
        return 4
    ia.close()  # a no-op in the child
    pair.close()
    objects.clear()
    del ia, pair, lmr
    gc.collect()
    return 0


def _child_main(objects: List[Any]) -> None:  # multiprocessing's target: exits normally
    code = child_drops_everything(objects)
    objects.clear()
    gc.collect()
    if code:
        raise SystemExit(code)


async def _stream_pair(host: str) -> Any:
    received: "asyncio.Queue[bytes]" = asyncio.Queue()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line = await reader.readline()
            if not line:
                break
            writer.write(line)
            await writer.drain()
        writer.close()

    server = await aiodat.start_server(echo, host, 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await aiodat.open_connection(host, port)
    return server, reader, writer, received


async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: bytes) -> None:
    writer.write(line)
    await writer.drain()
    assert await asyncio.wait_for(reader.readline(), T) == line


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
async def test_a_forked_child_never_destroys_the_parents_objects(ia: Any, rdma_device: Any, how: str,
                                                                loop_errors: List[dict]) -> None:
    # the guest's kernel (6.1) copies pinned pages for the child: what docs/reliability.md assumes
    assert aiodat.fork_support() == "unneeded"
    pair = await make_ep_pair(ia)
    extra = pair.pz.register(bytearray(1 << 16))  # registered memory the child inherits
    await exchange(pair, b"before fork")
    server, reader, writer, _ = await _stream_pair(rdma_device.address)
    await _roundtrip(reader, writer, b"stream before fork\n")

    objects: List[Any] = [ia, pair, extra]
    if how == "os.fork":
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                code = child_drops_everything(objects)
                gc.collect()
            finally:
                os._exit(code)
        _, status = await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    else:
        process = multiprocessing.get_context("fork").Process(target=_child_main, args=(objects,))
        process.start()
        await asyncio.get_running_loop().run_in_executor(None, process.join, T)
        assert process.exitcode == 0

    # the parent's connection, memory and stream still carry data
    await exchange(pair, b"after the child exited")
    assert not extra.closed and extra.lmr_context
    await _roundtrip(reader, writer, b"stream after fork\n")
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    pair.close()


async def test_a_second_loop_in_another_thread_is_refused(ia: Any, loop_errors: List[dict]) -> None:
    """An IA belongs to the loop it first waited on: a wait from another thread's loop raises
    InvalidState at once instead of moving the fds and stranding this loop's waiters."""
    first = ia.create_evd(4)
    first.post_se("mine")
    assert [e.payload for e in await first.wait(timeout=T)] == ["mine"]  # this loop owns the IA now
    second = ia.create_evd(4)
    outcome: List[Optional[BaseException]] = []

    def other_thread() -> None:
        async def wait_there() -> None:
            await second.wait(timeout=5)

        try:
            asyncio.run(wait_there())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, thread.join, T)
    assert len(outcome) == 1 and isinstance(outcome[0], aiodat.InvalidState), outcome
    assert "belongs to the event loop" in str(outcome[0])
    # this loop still has its fds: a connection (rdma_cm channel) and a message (CQ) work
    pair = await make_ep_pair(ia)
    await exchange(pair, b"still mine")
    pair.close()
