"""A small line-based key-value store written for asyncio streams, runnable over TCP or RDMA.

The service and its client use nothing but ``open_connection`` / ``start_server``
and the StreamReader/StreamWriter they return.  ``--transport tcp`` takes them
from :mod:`asyncio`, ``--transport rdma`` from :mod:`aiodat`; nothing else
differs.

Protocol (one command per line, one reply per command)::

    SET key value      -> OK
    GET key            -> VALUE value        | NOTFOUND
    DEL key            -> OK                 | NOTFOUND
    PUT key nbytes\\n<nbytes raw bytes>  -> OK   (binary values of any size)
    FETCH key          -> DATA nbytes\\n<nbytes raw bytes> | NOTFOUND
    KEYS               -> KEYS k1 k2 ...
    QUIT               -> BYE   (then the server closes the connection)
    anything else      -> ERR <what was wrong>

Run it::

    python examples/kvstore.py demo --transport tcp
    aiodat rxe run -- python examples/kvstore.py demo --transport rdma
    python examples/kvstore.py serve --transport rdma --host 169.254.77.1 --port 7000
    python examples/kvstore.py client --transport rdma --host 169.254.77.1 --port 7000 "SET a 1" "GET a"
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
from types import ModuleType
from typing import Any, Coroutine, Dict, List, Optional, Sequence

MAX_LINE = 1 << 16


def streams_module(transport: str) -> ModuleType:
    """The module providing open_connection/start_server: asyncio for "tcp", aiodat for "rdma"."""
    if transport == "tcp":
        return asyncio
    if transport == "rdma":
        import aiodat

        return aiodat
    raise ValueError(f"transport must be 'tcp' or 'rdma', not {transport!r}")


class KVStore:
    """The store and its connection handler (``client_connected_cb`` of start_server)."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client until QUIT or EOF."""
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break  # the client closed: EOF
                if not line.endswith(b"\n"):
                    break  # EOF in the middle of a line
                reply = await self._command(line.rstrip(b"\r\n"), reader)
                writer.write(reply)
                await writer.drain()
                if reply == b"BYE\n":
                    break
        except (ConnectionResetError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass

    async def _command(self, line: bytes, reader: asyncio.StreamReader) -> bytes:
        parts = line.split(b" ", 2)
        cmd = parts[0].upper()
        if cmd == b"SET" and len(parts) == 3:
            self.data[parts[1].decode()] = parts[2]
            return b"OK\n"
        if cmd == b"GET" and len(parts) == 2:
            value = self.data.get(parts[1].decode())
            return b"NOTFOUND\n" if value is None else b"VALUE " + value + b"\n"
        if cmd == b"DEL" and len(parts) == 2:
            return b"OK\n" if self.data.pop(parts[1].decode(), None) is not None else b"NOTFOUND\n"
        if cmd == b"PUT" and len(parts) == 3 and parts[2].isdigit():
            self.data[parts[1].decode()] = await reader.readexactly(int(parts[2]))
            return b"OK\n"
        if cmd == b"FETCH" and len(parts) == 2:
            value = self.data.get(parts[1].decode())
            return b"NOTFOUND\n" if value is None else b"DATA %d\n" % len(value) + value
        if cmd == b"KEYS" and len(parts) == 1:
            return b" ".join([b"KEYS", *(k.encode() for k in sorted(self.data))]) + b"\n"
        if cmd == b"QUIT":
            return b"BYE\n"
        return b"ERR unknown command or wrong arguments: " + line[:64] + b"\n"


class KVClient:
    """A client over any (reader, writer) pair from open_connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, streams: ModuleType, host: str, port: int) -> "KVClient":
        """Connect with ``streams.open_connection`` (asyncio or aiodat)."""
        reader, writer = await streams.open_connection(host, port)
        return cls(reader, writer)

    async def command(self, line: str) -> bytes:
        """Send one text command and return its reply line (without the newline)."""
        self.writer.write(line.encode() + b"\n")
        await self.writer.drain()
        return (await self.reader.readline()).rstrip(b"\n")

    async def set(self, key: str, value: str) -> bool:
        return await self.command(f"SET {key} {value}") == b"OK"

    async def get(self, key: str) -> Optional[bytes]:
        reply = await self.command(f"GET {key}")
        return reply[6:] if reply.startswith(b"VALUE ") else None

    async def delete(self, key: str) -> bool:
        return await self.command(f"DEL {key}") == b"OK"

    async def keys(self) -> List[str]:
        return [k.decode() for k in (await self.command("KEYS")).split()[1:]]

    async def put(self, key: str, value: bytes) -> bool:
        self.writer.write(f"PUT {key} {len(value)}\n".encode())
        self.writer.write(value)
        await self.writer.drain()
        return (await self.reader.readline()) == b"OK\n"

    async def fetch(self, key: str) -> Optional[bytes]:
        self.writer.write(f"FETCH {key}\n".encode())
        await self.writer.drain()
        head = await self.reader.readline()
        if not head.startswith(b"DATA "):
            return None
        return await self.reader.readexactly(int(head[5:]))

    async def quit(self) -> bytes:
        reply = await self.command("QUIT")
        self.writer.close()
        await self.writer.wait_closed()
        return reply


async def serve(streams: ModuleType, host: str, port: int) -> None:
    """Run the store until interrupted."""
    store = KVStore()
    server = await streams.start_server(store.handle, host, port)
    print("serving on", server.sockets[0].getsockname(), flush=True)
    async with server:
        await server.serve_forever()


async def demo(streams: ModuleType, host: str) -> int:
    """Start a store on a free port, run a client session against it, print what happened."""
    store = KVStore()
    server = await streams.start_server(store.handle, host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = await KVClient.connect(streams, host, port)
        print("SET greeting:", await client.set("greeting", "hello world"))
        print("GET greeting:", await client.get("greeting"))
        print("GET missing:", await client.get("missing"))
        blob = os.urandom(1 << 20)
        print("PUT blob (1 MiB):", await client.put("blob", blob))
        fetched = await client.fetch("blob")
        ok = fetched is not None and hashlib.sha256(fetched).digest() == hashlib.sha256(blob).digest()
        print("FETCH blob sha256 matches:", ok)
        print("KEYS:", " ".join(await client.keys()))
        print("DEL greeting:", await client.delete("greeting"))
        print("QUIT:", (await client.quit()).decode())
    print("demo done over", "aiodat (RDMA)" if streams is not asyncio else "asyncio (TCP)")
    return 0 if ok else 1


async def client_main(streams: ModuleType, host: str, port: int, commands: Sequence[str]) -> None:
    client = await KVClient.connect(streams, host, port)
    for line in commands:
        print((await client.command(line)).decode())
    await client.quit()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("serve", "client", "demo"))
    parser.add_argument("commands", nargs="*", help="client mode: commands to send")
    parser.add_argument("--transport", choices=("tcp", "rdma"), default="tcp")
    parser.add_argument("--host", default=None, help="default: 127.0.0.1 for tcp, $AIODAT_RXE_ADDR for rdma")
    parser.add_argument("--port", type=int, default=7000)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args(argv)
    streams = streams_module(args.transport)
    host = args.host or ("127.0.0.1" if args.transport == "tcp" else os.environ.get("AIODAT_RXE_ADDR"))
    if host is None:
        parser.error("--host is needed for rdma (or run under `aiodat rxe run`, which sets AIODAT_RXE_ADDR)")
    coro: Coroutine[Any, Any, Any]
    if args.mode == "serve":
        coro = serve(streams, host, args.port)
    elif args.mode == "client":
        coro = client_main(streams, host, args.port, args.commands)
    else:
        coro = demo(streams, host)
    if args.loop == "uvloop":
        import uvloop

        return uvloop.run(coro) or 0
    return asyncio.run(coro) or 0


if __name__ == "__main__":
    sys.exit(main())
