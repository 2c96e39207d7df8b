"""One stream echo, nothing else: a client sends ``--size``-byte messages one at a time and waits
for each reply from a server in a child process.  A developer's tool for tracing the round
trip (``bench/syscall_timeline.py``), run where rxe is::

    aiodat rxe run -- .venv/bin/python bench/echo_pair.py [--transport rdma|tcp] [--loop uvloop] [--messages 400]

``rdma`` is aiodat's streams on the device's address, ``tcp`` asyncio's own streams on
127.0.0.1.  Prints the mean round trip of the timed messages (after 30 untimed ones).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from streams_wakeups import run, streams_api  # (bench/ is this script's directory: first on sys.path)


async def serve(args: argparse.Namespace) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                writer.write(await reader.readexactly(args.size))
        except asyncio.IncompleteReadError:  # the client is done
            writer.close()

    server = await streams_api(args.transport).start_server(echo, args.host, 0)
    print("port", server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    server.close()


async def client(args: argparse.Namespace, port: int) -> float:
    reader, writer = await streams_api(args.transport).open_connection(args.host, port)
    payload = b"x" * args.size
    for _ in range(30):
        writer.write(payload)
        await reader.readexactly(args.size)
    start = time.perf_counter()
    for _ in range(args.messages):
        writer.write(payload)
        await reader.readexactly(args.size)
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed / args.messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--host", default=None, help="default: $AIODAT_RXE_ADDR for rdma, 127.0.0.1 for tcp")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host is None:
        args.host = os.environ["AIODAT_RXE_ADDR"] if args.transport == "rdma" else "127.0.0.1"
    if args.serve:
        run(serve(args), args.loop)
        return 0
    child = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline().split()[1])  # type: ignore[union-attr]
        rt = run(client(args, port), args.loop)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait()
    print(f"{args.transport} {args.loop}: round trip {rt * 1e6:.0f} us (mean of {args.messages})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
