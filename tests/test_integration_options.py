"""The integrations refuse a bad ``ia`` or timeout when they are made (no device needed).

At a request, aiohttp, httpcore and grpclib would see the error as a failed connection: aiohttp
and httpcore wrap it as a retryable connect error, and every request fails the same way later.
So the adapters check them at construction and raise aiodat's InvalidParameter naming the option."""
from __future__ import annotations

from typing import Any, Callable, Dict

import pytest

import aiodat


def _aiohttp_connector(**options: Any) -> Any:
    pytest.importorskip("aiohttp")
    from aiodat.integrations.aiohttp import RdmaConnector

    return RdmaConnector(**options)


def _aiohttp_site(**options: Any) -> Any:
    pytest.importorskip("aiohttp")
    from aiohttp import web

    from aiodat.integrations.aiohttp import RdmaSite

    return RdmaSite(web.AppRunner(web.Application()), "10.0.0.1", 0, **options)


def _grpclib_channel(**options: Any) -> Any:
    pytest.importorskip("grpclib")
    from aiodat.integrations.grpclib import RdmaChannel

    return RdmaChannel("10.0.0.1", 50051, **options)


def _httpx_backend(**options: Any) -> Any:
    pytest.importorskip("httpx")
    from aiodat.integrations.httpx import RdmaNetworkBackend

    return RdmaNetworkBackend(**options)


CASES: Dict[str, Any] = {
    "aiohttp connector, ia": (_aiohttp_connector, {"ia": 123}, "ia must be"),
    "aiohttp connector, connect_timeout": (_aiohttp_connector, {"connect_timeout": -1}, "connect_timeout"),
    "aiohttp site, accept_timeout": (_aiohttp_site, {"accept_timeout": float("nan")}, "accept_timeout"),
    "grpclib channel, ia": (_grpclib_channel, {"ia": 1.5}, "ia must be"),
    "grpclib channel, connect_timeout": (_grpclib_channel, {"connect_timeout": 0}, "connect_timeout"),
    "httpx backend, ia": (_httpx_backend, {"ia": object()}, "ia must be"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_bad_option_is_refused_at_construction(case: str) -> None:
    make: Callable[..., Any]
    make, options, named = CASES[case]
    with pytest.raises(aiodat.InvalidParameter, match=named):
        made = make(**options)
        close = getattr(made, "close", None)  # (only on the old code: it was made)
        if close is not None:
            result = close()
            if hasattr(result, "__await__"):
                await result


def _httpx_transport(**options: Any) -> Any:
    pytest.importorskip("httpx")
    from aiodat.integrations.httpx import RdmaHTTPTransport

    return RdmaHTTPTransport(**options)


@pytest.mark.parametrize("make", [_aiohttp_connector, _grpclib_channel, _httpx_backend, _httpx_transport])
async def test_a_device_name_that_opens_no_port_is_refused_at_construction(make: Callable[..., Any]) -> None:
    """Checked at a connect, every request failed as a connection error (httpx retried it)."""
    with pytest.raises(aiodat.ProviderNotFound, match="ia='nosuchdev' opens no active port"):
        make(ia="nosuchdev")


async def test_a_grpclib_server_takes_accept_timeout() -> None:
    """``RdmaServer.start(accept_timeout=...)`` reaches the stream server (it was a TypeError): a bad
    value is refused, naming it, before anything listens."""
    pytest.importorskip("grpclib")
    from aiodat.integrations.grpclib import RdmaServer

    server = RdmaServer([])
    with pytest.raises(aiodat.InvalidParameter, match="accept_timeout"):
        await server.start("10.0.0.1", 0, accept_timeout=float("nan"))
    assert server.sockets == ()


def test_httpx_names_its_own_connect_timeout() -> None:
    with pytest.raises(TypeError, match=r"httpx.Timeout\(\.\.\., connect=SECONDS\)"):
        _httpx_transport(connect_timeout=5)


async def test_dask_does_not_retry_what_retrying_cannot_mend(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RDMA device (ProviderNotFound) is FatalCommClosedError, which distributed's connect
    raises at once; it used to be a CommClosedError, retried until the connect timeout and then
    reported only as a timeout.  (The failure is aiodat's own, injected at open_connection.)"""
    pytest.importorskip("distributed")
    import asyncio

    from distributed.comm import connect
    from distributed.comm.core import FatalCommClosedError

    from aiodat.integrations import dask as rdma_dask

    async def no_device(host: str, port: int) -> Any:
        raise aiodat.ProviderNotFound("no active RDMA device with an IP address (injected)")

    monkeypatch.setattr(rdma_dask, "open_connection", no_device)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(FatalCommClosedError, match="no active RDMA device"):
        await connect("rdma://10.0.0.1:8786", timeout=20)
    assert loop.time() - started < 10


@pytest.mark.parametrize("value, limit", [("1 MiB", 1 << 20), (5, 5), ("0", 0), ("2 GB", 2_000_000_000),
                                          ("abc", None), (-3, None), (True, None), (None, None)])
def test_dask_receive_ahead_takes_a_size_and_names_the_key_otherwise(value: Any, limit: Any) -> None:
    """distributed.comm.rdma.receive-ahead: a number of bytes or a size string; anything else is
    InvalidParameter naming the key (each comm reads it when it is made)."""
    dask = pytest.importorskip("dask")
    pytest.importorskip("distributed")
    from aiodat.integrations.dask import RECEIVE_AHEAD, receive_ahead

    assert receive_ahead() == RECEIVE_AHEAD == 256 << 20
    with dask.config.set({"distributed.comm.rdma.receive-ahead": value}):
        if limit is None:
            with pytest.raises(aiodat.InvalidParameter, match="distributed.comm.rdma.receive-ahead"):
                receive_ahead()
        else:
            assert receive_ahead() == limit


@pytest.mark.parametrize("port", [8080.9, 8080.0, "80a", "", "\u00b2", True, 0, 70000, None, b"80"])
async def test_a_stream_port_of_the_wrong_kind_is_refused_at_the_call(port: Any) -> None:
    """create_connection takes a port as asyncio's does, an int or its digits as a str, and refuses
    anything else, naming the port, before it looks for a device.  It used to cut a float with int()."""
    from aiodat import streams

    with pytest.raises((aiodat.InvalidParameter, aiodat.InvalidAddress), match="port"):
        await streams.create_connection(lambda: None, "10.0.0.1", port)  # type: ignore[arg-type, return-value]
