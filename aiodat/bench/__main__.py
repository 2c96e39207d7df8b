"""The child of a two-process benchmark (started by ``aiodat bench``, see :mod:`aiodat.bench.peer`):

``python -m aiodat.bench pong DEVICE ADDRESS SIZE TOTAL [MODE BUSY_POLL_US] LOOP``: the server of a ping-pong;
``python -m aiodat.bench sink DEVICE OP SIZE DEPTH TOTAL [srq] [pool] LOOP``: the receiving side of a bandwidth run;
``python -m aiodat.bench stream-server rdma|tcp HOST PORT [BUSY_POLL_US] LOOP``: the streams server (a child, or on host B);
``python -m aiodat.bench acceptor DEVICE CONNECTIONS [await|callback] LOOP``: the accepting side of a connect cycle.
"""
from __future__ import annotations

import sys
from typing import Sequence

from .connect import acceptor_process
from .harness import run_on_loop
from .latency import pong_process
from .streams_vs_tcp import stream_server_process
from .throughput import sink_process


def main(argv: Sequence[str]) -> int:
    """Run the child named by ``argv[0]``; 2 with a usage line for anything else."""
    if len(argv) in (6, 8) and argv[0] == "pong":
        device, address, size, total = argv[1:5]
        mode, busy = (argv[5], int(argv[6])) if len(argv) == 8 else ("await", 0)
        run_on_loop(argv[-1], lambda: pong_process(device, address, int(size), int(total), mode, busy))
        return 0
    if len(argv) in (5, 6) and argv[0] == "stream-server":
        transport, host, port, loop_name = argv[1], argv[2], argv[3], argv[-1]
        busy = int(argv[4]) if len(argv) == 6 else 0
        run_on_loop(loop_name, lambda: stream_server_process(transport, host, int(port), busy))
        return 0
    if 7 <= len(argv) <= 9 and argv[0] == "sink" and argv[6:-1] in ([], ["srq"], ["pool"], ["srq", "pool"]):
        _, device, op, size, depth, total = argv[:6]
        srq, pool = "srq" in argv[6:-1], "pool" in argv[6:-1]
        run_on_loop(argv[-1], lambda: sink_process(device, op, int(size), int(depth), int(total), srq, pool))
        return 0
    if len(argv) in (4, 5) and argv[0] == "acceptor":
        device, connections, loop_name = argv[1], argv[2], argv[-1]
        mode = argv[3] if len(argv) == 5 else "await"
        run_on_loop(loop_name, lambda: acceptor_process(device, int(connections), mode=mode))
        return 0
    print("usage: python -m aiodat.bench pong DEVICE ADDRESS SIZE TOTAL [MODE BUSY_POLL_US] LOOP\n"
          "       python -m aiodat.bench sink DEVICE OP SIZE DEPTH TOTAL [srq] [pool] LOOP\n"
          "       python -m aiodat.bench stream-server rdma|tcp HOST PORT [BUSY_POLL_US] LOOP\n"
          "       python -m aiodat.bench acceptor DEVICE CONNECTIONS [await|callback] LOOP  (children of aiodat bench)")
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent reports it, not each child
        sys.exit(130)
