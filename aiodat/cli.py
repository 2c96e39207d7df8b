"""The ``aiodat`` command (also ``python -m aiodat``).

Subcommands::

    aiodat devices                      the RDMA device ports, like ibv_devices (+ state, link layer, GIDs)
    aiodat query [NAME] [--json]        every attribute of ia.query() (dat_ia_query)
    aiodat rxe status | run [...] -- CMD   the rxe test bed (aiodat.testbed)
    aiodat ping HOST PORT [--count N]   send/recv round trips to an echo server
    aiodat ping --server PORT           answer pings (an echo server)
    aiodat bench latency [...]          aiodat's ping-pong beside pyverbs and ib_send_lat -R (-e)
    aiodat bench rate|bandwidth [...]   streaming sends / RDMA writes beside ib_send_bw / ib_write_bw -R
    aiodat bench streams [...]          aiodat streams vs rstream and asyncio TCP (throughput, round trips)
    aiodat bench connect [...]          connection set-up beside cmtime
    aiodat bench soak [...]             many connections for a while: errors, fd and RSS growth
    aiodat bench dask [...]             a Dask worker-to-worker transfer, rdma:// beside tcp://

Exit status: 0 success, 1 failure (no device, a DAT error, ...), 2 usage
error, 130 interrupted (Ctrl-C).  See docs/cli.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

NO_DEVICE = (
    "no RDMA device on this machine; run aiodat where one is up, e.g. on Soft-RoCE with "
    "`aiodat rxe run -- aiodat {command}` (boots a QEMU guest when the host kernel has no rxe)"
)

#: largest ping message (bytes); the echo server posts receives of this size
PING_MAX = 4096
#: largest RDMA message (bytes): 2**31, InfiniBand's and rxe's max_msg_sz; a bench --size above it cannot run
MSG_MAX = 1 << 31
#: aiodat.poller.MAX_BUSY_POLL_US (not imported: --help must work without the compiled shim)
BUSY_POLL_MAX = 1_000_000


def _int_in(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an int from ``low`` to ``high``, so a value out of range is a usage error
    naming the flag and the value (argparse prints the usage, exit status 2)."""
    def parse(text: str) -> int:
        value = int(text)  # (ValueError: argparse says "invalid int value")
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be >= {low}, got {value}" if high is None else f"must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _positive_float(text: str) -> float:
    """An argparse ``type``: a finite float > 0 (float() alone takes "nan" and "inf")."""
    value = float(text)
    if not _positive(value):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


_positive_float.__name__ = "float"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiodat", description="asyncio-native RDMA (DAT/uDAPL over rdma-core): tools and benchmarks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sub.add_parser("devices", help="list the RDMA device ports (like ibv_devices, with state and GIDs)",
                   description="List the RDMA device ports open_ia() can open: name, device, port, state, "
                               "link layer, node GUID and GIDs.")

    q = sub.add_parser("query", help="print every attribute of ia.query()",
                       description="Open the IA and print every attribute dat_ia_query returns.")
    q.add_argument("name", nargs="?", default=None,
                   help="IA name (rxe0, rxe0:1); default $AIODAT_RXE_DEVICE or the first device")
    q.add_argument("--json", action="store_true", help="print IAQuery.as_dict() as JSON")

    r = sub.add_parser("rxe", help="the rxe test bed: status, run -- CMD", add_help=False,
                       description="Delegates to aiodat.testbed (see `aiodat rxe --help`).")
    r.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("ping", help="send/recv round trips to an echo server (or be one with --server)",
                       description="Connect to HOST:PORT over rdma_cm, send COUNT messages and print each "
                                   "round trip; with --server PORT, echo every message back.")
    p.add_argument("host", nargs="?", help="the server's address")
    p.add_argument("port", nargs="?", type=int, help="the server's port")
    p.add_argument("--server", metavar="PORT", type=int, default=None, help="listen on PORT and echo")
    p.add_argument("--count", "-c", type=_int_in(1), default=5, help="messages to send (default 5)")
    p.add_argument("--size", "-s", type=_int_in(1, PING_MAX), default=64,
                   help=f"message size in bytes (1..{PING_MAX}, default 64)")
    p.add_argument("--device", "-d", default=None, help="IA name (default: $AIODAT_RXE_DEVICE or the first)")

    b = sub.add_parser("bench", help="benchmarks beside perftest", description="Benchmarks.")
    bsub = b.add_subparsers(dest="bench", metavar="BENCHMARK")
    bsub.required = True
    lat = bsub.add_parser(
        "latency", help="send/recv ping-pong vs pyverbs and ib_send_lat -R (-e)",
        description="aiodat's send/recv ping-pong in one process (await, callback and busypoll modes) beside "
                    "the same ping-pong written with pyverbs (event and poll mode) and ib_send_lat -R -e / "
                    "ib_send_lat -R, same size and iterations, in the same run.  Figures are round-trip "
                    "medians (us; perftest's half round trips doubled); ratios are aiodat / peer within a "
                    "round, and the median of the rounds.")
    lat.add_argument("--size", "-s", type=_int_in(1, MSG_MAX), default=64, help="message size in bytes (default 64)")
    lat.add_argument("--iters", "-n", type=_int_in(1), default=1000, help="measured iterations (default 1000)")
    lat.add_argument("--mode", action="append", choices=("await", "callback", "busypoll"), default=None,
                     help="aiodat's way to wait: await (evd.wait), callback (evd.set_callback), busypoll "
                          "(create_evd(busy_poll_us=N)); repeat the flag for several (default: all three)")
    lat.add_argument("--busy-poll-us", type=_int_in(0, BUSY_POLL_MAX), default=50,
                     help="busy_poll_us of --mode busypoll (default 50)")
    lat.add_argument("--processes", type=int, choices=(1, 2), default=1,
                     help="1: client and server in one process (default); 2: aiodat's server in a child process")
    lat.add_argument("--no-perftest", action="store_true", help="skip ib_send_lat")
    lat.add_argument("--no-pyverbs", action="store_true", help="skip the pyverbs ping-pong")
    _common_bench_args(lat)
    st = bsub.add_parser(
        "streams", help="aiodat streams vs rstream (rsockets) and asyncio TCP (throughput, round trips)",
        description="The same asyncio-streams code over aiodat (RDMA) and over asyncio (TCP), beside librdmacm's "
                    "rstream, in one guest: throughput of WRITE_SIZE writes + drain() and the median round "
                    "trip of SIZE-byte requests/responses; ratios aiodat / peer per round and their median.  "
                    "The servers run in a child process, as rstream's (--processes 1: on the client's loop).  "
                    "--two-hosts (inside `aiodat rxe run --hosts 2`): the servers run on host B, rstream's "
                    "too, aiodat, rstream and asyncio TCP over the same virtio link.")
    st.add_argument("--write-size", type=_int_in(1), default=65536, help="bytes per write (default 65536)")
    st.add_argument("--total", type=_int_in(1), default=8 << 20, help="bytes to send for throughput (default 8 MiB)")
    st.add_argument("--size", "-s", type=_int_in(1), default=64, help="request/response size (default 64)")
    st.add_argument("--iters", "-n", type=_int_in(1), default=1000, help="measured round trips (default 1000)")
    st.add_argument("--no-rstream", action="store_true", help="skip rstream")
    st.add_argument("--processes", type=int, choices=(1, 2), default=2,
                    help="2 (default): the aiodat and TCP servers are a child process, as rstream's server is; "
                         "1: client and server on one loop")
    st.add_argument("--two-hosts", action="store_true",
                    help="servers on host B of `aiodat rxe run --hosts 2`, client here (aiodat vs rstream and "
                         "asyncio TCP over the link)")
    st.add_argument("--busy-poll-us", type=_int_in(0, BUSY_POLL_MAX), default=1000,
                    help="also run aiodat with this busy_poll_us stream option on both sides, as rstream spins "
                         "before it sleeps (default 1000; 0: not run)")
    _common_bench_args(st)
    bw = bsub.add_parser(
        "bandwidth", help="RDMA write/read or send bandwidth vs ib_write_bw/ib_read_bw/ib_send_bw -R",
        description="aiodat streams SIZE-byte operations with up to DEPTH in flight, posted in batches "
                    "(one crossing into C per batch, one completion per batch), then runs the perftest "
                    "tool with the same size, depth and iterations; per round, and the median ratio.")
    bw.add_argument("--op", choices=("write", "read", "send"), default="write", help="operation (default write)")
    bw.add_argument("--size", "-s", type=_int_in(1, MSG_MAX), default=65536, help="bytes per operation (default 65536)")
    bw.add_argument("--depth", "-t", type=_int_in(1), default=64, help="requests in flight (default 64)")
    bw.add_argument("--iters", "-n", type=_int_in(1), default=1000, help="operations (default 1000)")
    bw.add_argument("--batch", type=_int_in(1), default=16, help="requests per batch post (default 16)")
    rt = bsub.add_parser(
        "rate", help="small-message send rate vs ib_send_bw -R (polling), -R -e (events) and -R -l BATCH",
        description="aiodat's send message rate (SIZE-byte sends, DEPTH in flight, batched posts) beside "
                    "ib_send_bw -R, ib_send_bw -R -e (sleeping on its completion channel, as an awaited "
                    "EVD does) and ib_send_bw -R -l BATCH (posting BATCH requests per call, as a batch post "
                    "does) with the same size, depth and iterations; Mpps per round, median ratios.")
    rt.add_argument("--size", "-s", type=_int_in(1, MSG_MAX), default=64, help="bytes per message (default 64)")
    rt.add_argument("--depth", "-t", type=_int_in(1), default=128, help="sends in flight (default 128)")
    rt.add_argument("--iters", "-n", type=_int_in(1), default=20000, help="messages (default 20000)")
    rt.add_argument("--batch", type=_int_in(1), default=32, help="sends per batch post (default 32)")
    for sp in (bw, rt):
        sp.add_argument("--mode", action="append", choices=("await", "callback", "busypoll"), default=None,
                        help="how the sender learns of completions (default: all three)")
        sp.add_argument("--busy-poll-us", type=_int_in(0, BUSY_POLL_MAX), default=50,
                        help="busy_poll_us of --mode busypoll (default 50)")
        sp.add_argument("--no-perftest", action="store_true", help="measure aiodat only")
        sp.add_argument("--srq", action="store_true",
                        help="the receiver takes its receives from an SRQ (srq.post_recv_batch), and perftest "
                             "runs with --use-srq (sends only)")
        sp.add_argument("--pool", action="store_true",
                        help="each side's requests take turns over DEPTH buffers of their own, as a server "
                             "answering from a pool of buffers posts them (perftest posts from one buffer)")
        sp.add_argument("--processes", type=int, choices=(1, 2), default=2,
                        help="2 (default): the receiving side is a child process, as perftest runs its two "
                             "sides; 1: both sides on one loop")
        _common_bench_args(sp)
    cn = bsub.add_parser(
        "connect", help="connection set-up rate vs cmtime",
        description="aiodat connects N EP pairs at once (connect + accept), then disconnects and frees them; "
                    "beside cmtime -c N in the same run.  Per-connection times (us) and ratios.")
    cn.add_argument("--connections", "-c", type=_int_in(1), default=100, help="connections (default 100, as cmtime)")
    cn.add_argument("--mode", action="append", choices=("await", "callback"), default=None,
                    help="await: a task per connection awaiting connect/accept/disconnect; callback: both sides "
                         "driven from EVD callbacks (connect_nowait, accept_nowait), as cmtime drives its "
                         "connections from one event handler; repeat the flag for both (default: both)")
    cn.add_argument("--no-cmtime", action="store_true", help="measure aiodat only")
    cn.add_argument("--processes", type=int, choices=(1, 2), default=2,
                    help="2 (default): the accepting side is a child process, as cmtime runs its server; "
                         "1: both sides on one loop")
    _common_bench_args(cn)
    so = bsub.add_parser(
        "soak", help="many connections doing mixed operations for a while; checks nothing grows",
        description="CONNECTIONS connections on one device doing send/recv ping-pong, RDMA write + "
                    "read-back, fetch-add and occasional reconnects for SECONDS; prints throughput, "
                    "p50/p99 latency, open fds and RSS every INTERVAL seconds.  Exit status 1 if an "
                    "operation failed or fds/RSS grew.")
    so.add_argument("--seconds", type=_positive_float, default=60.0, help="how long (default 60)")
    so.add_argument("--connections", "-c", type=_int_in(1), default=16, help="connections (default 16)")
    so.add_argument("--interval", type=_positive_float, default=5.0, help="reporting interval in seconds (default 5)")
    so.add_argument("--timeout", type=_positive_float, default=30.0,
                    help="bound on each connect, disconnect and completion wait, in seconds (default 30)")
    so.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop", help="event loop (default uvloop)")
    so.add_argument("--device", "-d", default=None, help="IA name (default: $AIODAT_RXE_DEVICE or the first)")
    so.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_bench_dask(bsub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``aiodat`` command line; return the exit status."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # `aiodat query | head`: the reader left; no traceback, nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (or the flush at exit fails again)
        os.close(devnull)
        return 1


def _main(args_list: List[str]) -> int:
    if args_list and args_list[0] == "rxe":
        from aiodat import testbed

        return testbed.main(args_list[1:])
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: 2 on a usage error, 0 after --help
        return int(exc.code or 0)
    try:
        if args.command == "devices":
            return cmd_devices()
        if args.command == "query":
            return cmd_query(args.name, args.json)
        if args.command == "ping":
            return cmd_ping(parser, args)
        if args.command == "bench" and args.bench == "streams":
            return cmd_bench_streams(args)
        if args.command == "bench" and args.bench in ("bandwidth", "rate"):
            return cmd_bench_bandwidth(args)
        if args.command == "bench" and args.bench == "dask":
            return cmd_bench_dask(args)
        if args.command == "bench" and args.bench == "soak":
            return cmd_bench_soak(args)
        if args.command == "bench" and args.bench == "connect":
            return cmd_bench_connect(args)
        if args.command == "bench":
            return cmd_bench_latency(args)
    except ImportError as exc:
        _err(f"aiodat: {exc}")
        return 1
    except KeyboardInterrupt:
        _err("aiodat: interrupted")
        return 130
    parser.print_usage(sys.stderr)
    return 2


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _providers() -> List[Any]:
    from aiodat import list_providers

    return list_providers()


# -- devices -------------------------------------------------------------------------


def _node_guid(device: str) -> str:
    from aiodat import DATError, open_ia

    try:
        with open_ia(device) as ia:
            return str(ia.query().ia_attr.transport_attr.node_guid_str)
    except (DATError, AttributeError):
        return "-"


def cmd_devices() -> int:
    """``aiodat devices``: one line per device port, then its GIDs (index as in the GID table)."""
    providers = _providers()
    if not providers:
        _err("aiodat devices: " + NO_DEVICE.format(command="devices"))
        return 1
    guids: Dict[str, str] = {}
    print(f"    {'name':<12} {'device':<12} {'port':>4}  {'state':<13} {'link layer':<11} node GUID")
    print(f"    {'-' * 12} {'-' * 12} {'-' * 4}  {'-' * 13} {'-' * 11} {'-' * 16}")
    for p in providers:
        if p.device not in guids:
            guids[p.device] = _node_guid(p.device)
        print(f"    {p.name:<12} {p.device:<12} {p.port:>4}  {p.state:<13} {p.link_layer:<11} {guids[p.device]}")
        for index, gid in zip(p.gid_indexes, p.gids):
            print(f"        GID[{index}] {gid}")
    return 0


# -- query ---------------------------------------------------------------------------


def default_device() -> Optional[str]:
    """The port ``$AIODAT_RXE_DEVICE`` or ``$AIODAT_RXE_ADDR`` names, else the first provider's name
    (whatever its state: ``query`` shows it), else None.

    Read as the benchmarks and the pytest plugin read them (:func:`aiodat.ia.environment_port`):
    a variable that names no active port raises :class:`aiodat.ProviderNotFound` naming it, its
    value and the ports there are.
    """
    from aiodat.ia import ADDRESS_ENV, DEVICE_ENV, environment_port

    if os.environ.get(DEVICE_ENV) or os.environ.get(ADDRESS_ENV):
        found = environment_port()
        if found is not None:
            return found.name
    providers = _providers()
    return providers[0].name if providers else None


def _print_tree(value: Any, indent: int = 0) -> None:
    pad = "  " * indent
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict) and item:
                print(f"{pad}{key}:")
                _print_tree(item, indent + 1)
            elif isinstance(item, list) and item and isinstance(item[0], dict):
                print(f"{pad}{key}:")
                for entry in item:
                    print(f"{pad}  - " + ", ".join(f"{k}={v}" for k, v in entry.items()))
            else:
                print(f"{pad}{key}: {_scalar(item)}")
    else:
        print(f"{pad}{_scalar(value)}")


def _scalar(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "(none)"
    if isinstance(value, dict):
        return "(none)"
    return str(value)


def cmd_query(name: Optional[str], as_json: bool) -> int:
    """``aiodat query [NAME] [--json]``: dat_ia_query on NAME (default: the test bed's or the first device)."""
    from aiodat import DATError, open_ia

    try:
        name = name or default_device()
    except DATError as exc:  # the environment names no port here
        _err(f"aiodat query: {exc}")
        return 1
    if name is None:
        _err("aiodat query: " + NO_DEVICE.format(command="query"))
        return 1
    try:
        with open_ia(name) as ia:
            result = ia.query().as_dict()
    except DATError as exc:
        _err(f"aiodat query: {exc}")
        return 1
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=False))
    else:
        print(f"IA {name}")
        _print_tree(result, 0)
    return 0


# -- ping ----------------------------------------------------------------------------


async def ping_server(device: str, port: int, max_clients: Optional[int] = None, ready: Any = None) -> None:
    """Listen on ``port`` and echo every message of every client; stop after ``max_clients`` clients."""
    from aiodat import EventType, EvdFlags, Privileges, open_ia

    with open_ia(device) as ia:
        pz = ia.create_pz()
        cr_evd = ia.create_evd(16, EvdFlags.CR)
        psp = ia.create_psp(port, cr_evd)
        print(f"aiodat ping: listening on {ia.address}:{psp.port}", flush=True)  # (port 0: the one picked)
        if ready is not None:
            ready.set_result(None)
        tasks = set()

        async def echo(cr: Any) -> None:
            evd = ia.create_evd(32, EvdFlags.DTO | EvdFlags.CONNECTION)
            ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd, connect_evd=evd)
            rbuf, sbuf = bytearray(PING_MAX), bytearray(PING_MAX)
            rlmr, slmr = pz.register(rbuf, Privileges.DEFAULT), pz.register(sbuf, Privileges.DEFAULT)
            try:
                ep.post_recv(rlmr[0:PING_MAX])
                await cr.accept(ep)
                async for ev in evd:
                    if ev.type != EventType.DTO_COMPLETION or not ev.ok:
                        break  # DISCONNECTED, or a receive flushed by it
                    if ev.operation.value != "recv":
                        continue
                    n = ev.transferred_length
                    sbuf[:n] = rbuf[:n]
                    ep.post_recv(rlmr[0:PING_MAX])
                    ep.post_send(slmr[0:n])
            finally:
                ep.free()
                evd.free()
                rlmr.free()
                slmr.free()

        served = 0
        try:
            while max_clients is None or served < max_clients:
                event = await cr_evd.wait_one()
                served += 1
                task = asyncio.ensure_future(echo(event.cr))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()


async def ping_client(device: str, host: str, port: int, count: int, size: int) -> List[float]:
    """Connect to an echo server, send ``count`` messages of ``size`` bytes; return the round trips (us)."""
    from aiodat import EvdFlags, Privileges, open_ia

    with open_ia(device) as ia:
        pz = ia.create_pz()
        evd = ia.create_evd(32, EvdFlags.DTO)
        ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd)
        sbuf, rbuf = bytearray(size), bytearray(size)
        slmr, rlmr = pz.register(sbuf, Privileges.DEFAULT), pz.register(rbuf, Privileges.DEFAULT)
        await ep.connect(host, port, timeout=10)
        rtts = []
        for i in range(count):
            sbuf[:] = bytes((i + j) & 0xFF for j in range(size))
            ep.post_recv(rlmr[0:size])
            start = time.perf_counter()
            ep.post_send(slmr[0:size])
            got_recv = False
            while not got_recv:
                for ev in await evd.wait(timeout=10):
                    ev.raise_for_status()
                    got_recv = got_recv or ev.operation.value == "recv"
            rtt = (time.perf_counter() - start) * 1e6
            if rbuf != sbuf:
                raise RuntimeError(f"message {i}: the echo differs from what was sent")
            rtts.append(rtt)
            print(f"{size} bytes from {host}:{port}: seq={i} rtt={rtt:.1f} us", flush=True)
        await ep.disconnect()
        return rtts


def cmd_ping(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``aiodat ping HOST PORT`` / ``aiodat ping --server PORT``."""
    from aiodat import DATError

    usage = "usage: aiodat ping HOST PORT [--count N] [--size N] | aiodat ping --server PORT\n"
    if args.server is None and (args.host is None or args.port is None):
        _err(usage + "aiodat ping: error: HOST and PORT are required (or --server PORT)")
        return 2
    if args.server is not None and (args.host is not None or args.port is not None):
        _err(usage + "aiodat ping: error: --server PORT listens: it takes no HOST or PORT")
        return 2
    for what, port, lowest in (("PORT", args.port, 1), ("--server PORT", args.server, 0)):  # (0: pick a free one)
        if port is not None and not lowest <= port <= 65535:
            _err(usage + f"aiodat ping: error: {what} must be between {lowest} and 65535, got {port}")
            return 2
    try:
        device = args.device or default_device()
    except DATError as exc:  # the environment names no port here
        _err(f"aiodat ping: {exc}")
        return 1
    if device is None:
        _err("aiodat ping: " + NO_DEVICE.format(command="ping ..."))
        return 1
    try:
        if args.server is not None:
            asyncio.run(ping_server(device, args.server))
            return 0
        rtts = asyncio.run(ping_client(device, args.host, args.port, args.count, args.size))
    except (DATError, RuntimeError) as exc:
        _err(f"aiodat ping: {exc}")
        return 1
    rtts.sort()
    print(f"{len(rtts)} round trips: min {rtts[0]:.1f} us, median {rtts[len(rtts) // 2]:.1f} us, "
          f"max {rtts[-1]:.1f} us")
    return 0


# -- bench ---------------------------------------------------------------------------


def _run_bench(name: str, args: argparse.Namespace, run: Callable[[], Any],
               errors: Tuple[Type[BaseException], ...] = ()) -> int:
    """Check --loop, run one benchmark and print its report (text, or JSON with --json).

    Exit status: 0, or 1 when the benchmark failed (a DATError or one of ``errors``) or its
    report says it is not ok (``report.ok``: the soak's checks; a comparison missing a figure
    of aiodat's).
    """
    from aiodat import DATError

    if getattr(args, "loop", None) == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            _err(f"{name}: --loop uvloop needs uvloop (pip install uvloop)")
            return 1
    failures: Tuple[Type[BaseException], ...] = (DATError, *errors)  # (mypy takes no starred tuple in except)
    try:
        report = run()
    except failures as exc:
        _err(f"{name}: {exc}")
        return 1
    except (MemoryError, OverflowError, OSError, ValueError) as exc:  # e.g. --iters or --depth too large here
        _err(f"{name}: {type(exc).__name__}: {exc or 'out of memory'} (smaller --size, --iters or --depth?)"
             if isinstance(exc, (MemoryError, OverflowError)) else f"{name}: {type(exc).__name__}: {exc}")
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.format())
    return 0 if getattr(report, "ok", True) else 1


def _common_bench_args(sp: argparse.ArgumentParser) -> None:
    """--loop, --repeat, --device and --json, shared by the comparisons."""
    sp.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop (default asyncio)")
    sp.add_argument("--repeat", type=_int_in(1), default=3,
                    help="rounds: every figure is taken N times and each ratio is the median of the rounds' "
                         "ratios (default 3)")
    sp.add_argument("--device", "-d", default=None, help="IA name (default: $AIODAT_RXE_DEVICE or the first)")
    sp.add_argument("--json", action="store_true", help="print the figures as JSON")
    sp.add_argument("--progress", action="store_true", help="say on stderr what runs, as it starts")


def _progress(args: argparse.Namespace) -> Optional[Callable[[str], None]]:
    """Progress lines on stderr (``--progress``), else None."""
    if not getattr(args, "progress", False):
        return None
    return lambda what: print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """``aiodat bench latency``: see :func:`aiodat.bench.bench_latency`."""
    from aiodat import bench

    modes = tuple(dict.fromkeys(args.mode)) if args.mode else bench.MODES
    return _run_bench("aiodat bench latency", args, lambda: bench.bench_latency(
        args.size, args.iters, args.loop, repeat=args.repeat, modes=modes, busy_poll_us=args.busy_poll_us,
        perftest=not args.no_perftest, pyverbs=not args.no_pyverbs, processes=args.processes,
        device=args.device, progress=_progress(args)), (RuntimeError, AssertionError))


def cmd_bench_bandwidth(args: argparse.Namespace) -> int:
    """``aiodat bench bandwidth`` / ``aiodat bench rate``: see :func:`aiodat.bench.bandwidth` and ``rate``."""
    from aiodat import bench

    name = f"aiodat bench {args.bench}"
    if args.batch > args.depth:  # (each value's own range is checked by the parser)
        _err(f"{name}: error: --batch ({args.batch}) cannot exceed --depth ({args.depth})")
        return 2
    if args.srq and args.bench == "bandwidth" and args.op != "send":
        _err(f"{name}: error: --srq holds receives: it needs --op send")
        return 2
    modes = tuple(dict.fromkeys(args.mode)) if args.mode else bench.MODES
    common = dict(batch=args.batch, repeat=args.repeat, modes=modes, busy_poll_us=args.busy_poll_us,
                  perftest=not args.no_perftest, device=args.device, processes=args.processes, srq=args.srq,
                  pool=args.pool,
                  progress=_progress(args))
    if args.bench == "rate":
        def run() -> Any:
            return bench.rate(args.size, args.depth, args.iters, args.loop, **common)
    else:
        def run() -> Any:
            return bench.bandwidth(args.op, args.size, args.depth, args.iters, args.loop, **common)
    return _run_bench(name, args, run, (RuntimeError, AssertionError))


def cmd_bench_streams(args: argparse.Namespace) -> int:
    """``aiodat bench streams``: see :func:`aiodat.bench.streams`."""
    from aiodat import bench

    if args.total < args.write_size:
        _err(f"aiodat bench streams: error: --total ({args.total}) must be at least --write-size ({args.write_size})")
        return 2
    if args.two_hosts:
        from aiodat.testbed import hosts

        if not hosts.available():
            _err("aiodat bench streams: --two-hosts runs inside `aiodat rxe run --hosts 2 -- aiodat bench "
                 "streams --two-hosts`")
            return 1
    return _run_bench("aiodat bench streams", args, lambda: bench.streams(
        args.write_size, args.total, args.size, args.iters, args.loop, repeat=args.repeat, device=args.device,
        rstream=not args.no_rstream, two_hosts=args.two_hosts, processes=args.processes,
        busy_poll_us=args.busy_poll_us, progress=_progress(args)),
        (RuntimeError, AssertionError))


def cmd_bench_connect(args: argparse.Namespace) -> int:
    """``aiodat bench connect``: see :func:`aiodat.bench.connect`."""
    from aiodat import bench

    return _run_bench("aiodat bench connect", args, lambda: bench.connect(
        args.connections, args.loop, repeat=args.repeat, cmtime=not args.no_cmtime, device=args.device,
        processes=args.processes, modes=tuple(dict.fromkeys(args.mode)) if args.mode else bench.CONNECT_MODES,
        progress=_progress(args)), (RuntimeError, AssertionError))


def cmd_bench_soak(args: argparse.Namespace) -> int:
    """``aiodat bench soak``: see :func:`aiodat.bench.soak`."""
    from aiodat import bench

    return _run_bench("aiodat bench soak", args, lambda: bench.soak(
        args.seconds, args.connections, args.loop, interval=args.interval, device=args.device,
        timeout=args.timeout))


def _positive(value: float) -> bool:
    """Finite and > 0 (argparse's float() takes "nan" and "inf")."""
    return math.isfinite(value) and value > 0


# -- bench dask (issue 16): kept in one place so the other bench edits do not meet it ----------


def _add_bench_dask(bsub: Any) -> None:
    """The ``aiodat bench dask`` subparser."""
    dk = bsub.add_parser(
        "dask", help="Dask worker-to-worker transfer over rdma:// vs tcp:// (needs aiodat[dask])",
        description="A LocalCluster with two workers per protocol on the device's address: an array of SIZE "
                    "bytes made on worker A is consumed on worker B, REPEAT times; prints the median time, "
                    "MB/s and the rdma:// / tcp:// ratio.")
    dk.add_argument("--size", "-s", type=_int_in(1), default=64 << 20, help="bytes per transfer (default 64 MiB)")
    dk.add_argument("--repeat", "-n", type=_int_in(1), default=3, help="transfers per protocol (default 3)")
    dk.add_argument("--processes", action="store_true", help="workers in processes of their own (default: threads)")
    dk.add_argument("--protocol", choices=("rdma", "tcp"), action="append", default=None,
                    help="measure only this protocol (repeatable; default both)")
    dk.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop (default asyncio)")
    dk.add_argument("--device", "-d", default=None, help="IA name (default: $AIODAT_RXE_DEVICE or the first)")
    dk.add_argument("--json", action="store_true", help="print the figures as JSON")


def cmd_bench_dask(args: argparse.Namespace) -> int:
    """``aiodat bench dask``: see :func:`aiodat.bench.dask.dask_transfer`."""
    try:
        from aiodat.bench.dask import dask_transfer
        import distributed  # noqa: F401
    except ImportError as exc:
        _err(f"aiodat bench dask: needs distributed and numpy (pip install aiodat[dask]): {exc}")
        return 1
    return _run_bench("aiodat bench dask", args, lambda: dask_transfer(
        args.size, args.repeat, args.loop, args.processes, args.device,
        protocols=tuple(args.protocol or ("rdma", "tcp"))), (AssertionError, OSError))


# (last: main() needs every function above, e.g. `python aiodat/cli.py ...`)
if __name__ == "__main__":
    sys.exit(main())
