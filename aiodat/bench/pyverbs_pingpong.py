"""The Python peer of ``aiodat bench latency``: the same send/recv ping-pong written with rdma-core's own
binding (Debian's python3-pyverbs), one process, run by path under the system Python:

    /usr/bin/python3 aiodat/bench/pyverbs_pingpong.py --device rxe0 --address 169.254.77.1 \\
        --size 64 --iters 1000 --mode event|poll

It prints one JSON line: ``{"mode", "size", "iters", "rtt_us": [...sorted round trips...]}``.

Like aiodat's ping-pong (:func:`aiodat.bench.latency.latency_pingpong`): client and server are two RC
QPs of one device in this process, each with one CQ for its sends and receives; each side posts its
next receive before it sends; one send in ``--signal-every`` is signalled; an iteration's time runs
from one send to the next.  The QPs are connected by hand (INIT, RTR, RTS) with the device's GID for
``--address`` (RoCEv2, as rdma_cm would pick), which needs no second thread for rdma_cm's blocking
calls.  Two ways to wait for a completion:

* ``event``: block on the CQ's completion channel (``get_cq_event``, ``ack_events``, ``req_notify``,
  then poll), as ``ib_send_lat -e`` does;
* ``poll``: spin on ``poll`` (busy polling), as ``ib_send_lat`` does.

This file imports nothing from aiodat (pyverbs is installed for the system Python only, aiodat's
extension for the venv's), so aiodat runs it as a child process by path; see
:mod:`aiodat.bench.pyverbs_peer`.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import time
from typing import Any, List, Optional, Sequence


def _gid_index(ctx: Any, port: int, address: Optional[str]) -> int:
    """The index of the port's GID that maps ``address`` (IPv4-mapped, RoCEv2), else the first usable one."""
    want = ipaddress.IPv4Address(address) if address else None
    first = None
    for index in range(ctx.query_port(port).gid_tbl_len):
        try:
            raw = str(ctx.query_gid(port, index)).replace(":", "")
        except Exception:  # an unused slot
            continue
        if not raw.strip("0"):
            continue
        gid = ipaddress.IPv6Address(int(raw, 16))
        if want is not None and gid.ipv4_mapped == want:
            return index
        if first is None:
            first = index
    if first is None:
        raise SystemExit(f"pyverbs_pingpong: port {port} has no GID")
    return first


class Side:
    """One end of the ping-pong: a CQ (and its channel in event mode), an RC QP, a send and a receive MR."""

    def __init__(self, ctx: Any, pd: Any, size: int, depth: int, event: bool) -> None:
        from pyverbs import enums as e
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.mr import MR
        from pyverbs.qp import QP, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR

        self.channel = CompChannel(ctx) if event else None
        self.cq = CQ(ctx, 4 * depth, None, self.channel, 0)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0))
        self.send_mr = MR(pd, size, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = MR(pd, size, e.IBV_ACCESS_LOCAL_WRITE)
        # work requests built once and reposted, as aiodat's benchmark reuses its segments
        self.recv_wr = RecvWR(wr_id=1, num_sge=1, sg=[SGE(self.recv_mr.buf, size, self.recv_mr.lkey)])
        sge = SGE(self.send_mr.buf, size, self.send_mr.lkey)
        self.send_quiet = SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=0)
        self.send_signalled = SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge],
                                     send_flags=e.IBV_SEND_SIGNALED)
        if event:
            self.cq.req_notify()

    def connect(self, ctx: Any, port: int, gid_index: int, remote_qpn: int) -> None:
        """INIT -> RTR -> RTS towards ``remote_qpn`` on the same device."""
        from pyverbs import enums as e
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.port_num = port
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        self.qp.to_init(attr)
        gr = GlobalRoute(dgid=ctx.query_gid(port, gid_index), sgid_index=gid_index)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=port)
        attr.path_mtu = ctx.query_port(port).active_mtu
        attr.dest_qp_num = remote_qpn
        attr.rq_psn = 0
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 1  # as aiodat's benchmark EPs (min_rnr_timer=1)
        self.qp.to_rtr(attr)
        attr.sq_psn = 0
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)

    def wait_recv_event(self) -> None:
        """Sleep on the completion channel until this side's receive has completed."""
        cq, channel = self.cq, self.channel
        assert channel is not None  # (the event mode's wait: its CQ has a channel)
        while True:
            n, wcs = cq.poll(8)
            if self._consume(n, wcs):
                return
            channel.get_cq_event(cq)
            cq.ack_events(1)
            cq.req_notify()

    def wait_recv_poll(self) -> None:
        """Spin on the CQ until this side's receive has completed."""
        cq = self.cq
        while True:
            n, wcs = cq.poll(8)
            if n and self._consume(n, wcs):
                return

    @staticmethod
    def _consume(n: int, wcs: Sequence[Any]) -> bool:
        got = False
        for wc in wcs[:n]:
            if wc.status != 0:
                raise SystemExit(f"pyverbs_pingpong: a work request failed, status {wc.status}")
            if wc.wr_id == 1:
                got = True
        return got


def pingpong(device: str, address: Optional[str], size: int, iters: int, warmup: int, mode: str,
             signal_every: int, port: int = 1) -> List[float]:
    """Run the ping-pong; the sorted round trips (us) of the ``iters`` measured iterations."""
    from pyverbs.device import Context
    from pyverbs.pd import PD

    event = mode == "event"
    depth = 4 * signal_every
    with Context(name=device) as ctx:
        pd = PD(ctx)
        gid_index = _gid_index(ctx, port, address)
        client, server = Side(ctx, pd, size, depth, event), Side(ctx, pd, size, depth, event)
        client.connect(ctx, port, gid_index, server.qp.qp_num)
        server.connect(ctx, port, gid_index, client.qp.qp_num)
        pattern = bytes(i & 0xFF for i in range(size))
        client.send_mr.write(pattern, size)
        wait_client = client.wait_recv_event if event else client.wait_recv_poll
        wait_server = server.wait_recv_event if event else server.wait_recv_poll
        total = warmup + iters
        stamps = [0] * (total + 1)
        clock = time.perf_counter_ns
        server.qp.post_recv(server.recv_wr)
        for i in range(total):
            send = client.send_signalled if i % signal_every == 0 else client.send_quiet
            client.qp.post_recv(client.recv_wr)  # the reply's receive, before the send
            stamps[i] = clock()
            client.qp.post_send(send)
            wait_server()
            if i + 1 < total:
                server.qp.post_recv(server.recv_wr)  # the next request's receive, before the reply
            server.qp.post_send(server.send_signalled if i % signal_every == 0 else server.send_quiet)
            wait_client()
        stamps[total] = clock()
        if server.recv_mr.read(size, 0) != pattern:
            raise SystemExit("pyverbs_pingpong: the server received other bytes than the client sent")
    return sorted((stamps[i + 1] - stamps[i]) / 1000.0 for i in range(warmup, total))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the arguments, run the ping-pong, print the JSON line."""
    p = argparse.ArgumentParser(description="pyverbs send/recv ping-pong in one process (aiodat's Python peer)")
    p.add_argument("--device", required=True)
    p.add_argument("--address", default=None, help="the IPv4 address whose GID the QPs use")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--mode", choices=("event", "poll"), default="event")
    p.add_argument("--signal-every", type=int, default=16)
    args = p.parse_args(argv)
    if args.size < 1 or args.iters < 1 or args.signal_every < 1:
        p.error("--size, --iters and --signal-every must be >= 1")
    warmup = min(100, max(2, args.iters // 10)) if args.warmup is None else args.warmup
    rtts = pingpong(args.device, args.address, args.size, args.iters, warmup, args.mode, args.signal_every)
    print(json.dumps({"mode": args.mode, "size": args.size, "iters": args.iters, "rtt_us": rtts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
