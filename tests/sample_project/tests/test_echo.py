"""The service over TCP (runs anywhere) and over RDMA (needs a device: under `aiodat rxe run`)."""
import asyncio

import pytest

import aiodat
import rdma_echo


@pytest.fixture(params=["tcp", pytest.param("rdma", marks=pytest.mark.rxe)])
def transport(request):
    """(streams module, host): asyncio on loopback, or aiodat on the RDMA device's address."""
    if request.param == "tcp":
        return asyncio, "127.0.0.1"
    return aiodat, request.getfixturevalue("rdma_device").address


async def test_echo(transport):
    streams, host = transport
    server, port = await rdma_echo.start(streams, host)
    async with server:
        lines = [b"hello\n", b"x" * 300_000 + b"\n"]
        assert await rdma_echo.echo_lines(streams, host, port, lines) == [line.upper() for line in lines]


@pytest.mark.rxe
async def test_ep_pair_message(ep_pair):
    """aiodat's own objects, through the plugin's ep_pair fixture: one send, one receive."""
    ep_pair.server.post_recv(ep_pair.server_lmr[0:64], cookie="rx")
    ep_pair.client_lmr.memoryview()[:5] = b"hello"
    ep_pair.client.post_send(ep_pair.client_lmr[0:5], cookie="tx")
    (await ep_pair.client.request_evd.wait_one(timeout=10)).raise_for_status()
    got = (await ep_pair.server.recv_evd.wait_one(timeout=10)).raise_for_status()
    assert bytes(ep_pair.server_lmr.memoryview()[:got.transferred_length]) == b"hello"
