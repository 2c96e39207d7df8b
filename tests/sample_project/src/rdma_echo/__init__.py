"""A line-echo service written against asyncio's stream API.

The same code serves TCP or RDMA: pass ``asyncio`` or ``aiodat`` as ``streams``
(aiodat's ``start_server``/``open_connection`` return asyncio's own reader and writer).
"""
from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any, List, Tuple

__all__ = ["LIMIT", "handle", "start", "echo_lines"]

#: the longest line either side buffers (asyncio's default is 64 KiB)
LIMIT = 1 << 21


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo every line back, upper-cased, until the client stops writing."""
    try:
        async for line in reader:
            writer.write(line.upper())
            await writer.drain()
    finally:
        writer.close()


async def start(streams: ModuleType, host: str) -> Tuple[Any, int]:
    """Start the service on a free port of ``host``; return (server, port)."""
    server = await streams.start_server(handle, host, 0, limit=LIMIT)
    return server, server.sockets[0].getsockname()[1]


async def echo_lines(streams: ModuleType, host: str, port: int, lines: List[bytes]) -> List[bytes]:
    """Send ``lines`` (each ending in a newline) in one write and return the service's answers."""
    reader, writer = await streams.open_connection(host, port, limit=LIMIT)
    try:
        writer.writelines(lines)
        await writer.drain()
        return [await reader.readline() for _ in lines]
    finally:
        writer.close()
        await writer.wait_closed()
