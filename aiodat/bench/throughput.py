"""``aiodat bench bandwidth``: streaming RDMA write, read or send with batched posts, beside
``ib_write_bw`` / ``ib_read_bw`` / ``ib_send_bw -R``; also the engine of :mod:`aiodat.bench.msgrate`."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from aiodat.errors import InvalidState

from .harness import device_and_address, run_on_loop
from .peer import accept_one, finish_child, kill_child, start_child
from .perftest import PerftestResult, run_perftest_pair
from . import stats
from .rounds import Comparison, _num

#: perftest's tool for each operation
BW_TOOLS = {"write": "ib_write_bw", "read": "ib_read_bw", "send": "ib_send_bw"}


@dataclass
class BandwidthSample:
    """aiodat's streaming run: how many ``size``-byte operations, how long."""

    op: str
    size: int
    iters: int
    seconds: float

    @property
    def mib_per_s(self) -> float:
        """Bandwidth in MiB/s (perftest's "MB/sec" are 2**20 bytes)."""
        return self.size * self.iters / self.seconds / (1 << 20)

    @property
    def mpps(self) -> float:
        """Operations per second, in millions (perftest's MsgRate[Mpps])."""
        return self.iters / self.seconds / 1e6


@dataclass
class BandwidthReport:
    """What :func:`bandwidth` and :func:`rate` measured: aiodat beside perftest's ``_bw`` tool."""

    device: str
    address: str
    loop: str
    op: str
    size: int
    depth: int
    batch: int
    aiodat: BandwidthSample
    perftest: Optional[PerftestResult] = None
    kind: str = "bandwidth"
    processes: int = 1

    def ratio(self) -> Optional[float]:
        """aiodat / perftest: bandwidth (MB/sec average) or, for ``rate``, message rate (Mpps)."""
        res = self.perftest
        if res is None or not res.ok:
            return None
        if self.kind == "rate":
            return stats.ratio(self.aiodat.mpps, res.value("MsgRate[Mpps]"))
        return stats.ratio(self.aiodat.mib_per_s, res.value("BW_average[MB/sec]"))

    def as_dict(self) -> Dict[str, Any]:
        """The figures as a JSON-serialisable dict (``--json``)."""
        res = self.perftest
        return {"kind": self.kind, "device": self.device, "address": self.address, "loop": self.loop,
                "op": self.op, "size": self.size, "depth": self.depth, "batch": self.batch,
                "iters": self.aiodat.iters, "processes": self.processes,
                "aiodat": {"MB_per_s": self.aiodat.mib_per_s, "Mpps": self.aiodat.mpps,
                           "seconds": self.aiodat.seconds},
                "perftest": None if res is None else {
                    "tool": res.tool, "args": list(res.args), "ok": res.ok, "error": res.error or None,
                    "MB_per_s": res.value("BW_average[MB/sec]"), "Mpps": res.value("MsgRate[Mpps]")},
                "ratio": self.ratio()}

    def format(self) -> str:
        """The human-readable report ``aiodat bench bandwidth`` / ``rate`` prints."""
        tool = BW_TOOLS[self.op]
        lines = [
            f"aiodat bench {self.kind}: {self.device} ({self.address}), loop={self.loop}, op={self.op}, "
            f"size={self.size} B, iters={self.aiodat.iters}, depth={self.depth}, batch={self.batch}, "
            f"{self.processes} process(es)",
            f"  {'what':<36}{'MB/s':>10}{'Mpps':>10}",
            f"  {'aiodat (batched posts, evd.wait)':<36}{self.aiodat.mib_per_s:>10.2f}{self.aiodat.mpps:>10.4f}",
        ]
        res = self.perftest
        if res is not None:
            label = f"{tool} -R"
            if res.ok:
                # a figure perftest did not print (or printed as inf) is n/a, as a missing figure is
                # in every other report's table, never 0: a 0 read as a measured figure (no ratio is
                # taken to it)
                lines.append(f"  {label:<36}{_figure(res.value('BW_average[MB/sec]'), 10, 2)}"
                             f"{_figure(res.value('MsgRate[Mpps]'), 10, 4)}")
            else:
                lines.append(f"  {label:<36}  not measured: {res.error}")
            ratio = self.ratio()
            what = "message rate" if self.kind == "rate" else "bandwidth"
            lines.append(f"ratio (aiodat / {tool} {what}): " + (f"{ratio:.2f}" if ratio is not None else "n/a"))
        return "\n".join(lines)


def _figure(value: Optional[float], width: int, digits: int) -> str:
    """A peer's figure in a column of ``width``: ``n/a`` when it is missing or not finite."""
    return _num(value if value is not None and math.isfinite(value) else None, width, digits)


def check_args(op: str, size: int, depth: int, iters: int, batch: int, srq: bool = False) -> None:
    """ValueError unless ``op`` is known, the counts are ints >= 1, ``batch <= depth`` and an SRQ
    (which holds receives) comes with ``send``."""
    if op not in BW_TOOLS:
        raise ValueError(f"op must be one of {sorted(BW_TOOLS)}, got {op!r}")
    if srq and op != "send":
        raise ValueError(f"an SRQ holds receives: srq needs op send, got {op!r}")
    for name, value in (("size", size), ("depth", depth), ("iters", iters), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if batch > depth:
        raise ValueError(f"batch ({batch}) cannot exceed depth ({depth})")


def pattern(size: int) -> bytes:
    """The bytes every ``size``-byte message of a bandwidth run carries."""
    return bytes(i & 0xFF for i in range(size))


def setup_side(ia: Any, op: str, size: int, depth: int, server: bool, busy_poll_us: Optional[int] = None,
               srq: bool = False, pool: bool = False) -> Tuple[Any, Any, Any, List[Any]]:
    """One side of a bandwidth run: its EP (on one DTO EVD, made with ``busy_poll_us`` when given), the EVD,
    the buffer and its message segments: one, or with ``pool`` ``depth`` slices of their own, one per
    request in flight, as a server that answers from a pool of buffers posts.  ``srq``: a receiving
    server's EP takes its receives from an SRQ of the same depth (``ep.srq``), as ``ib_send_bw
    --use-srq`` does.  A receive's cookie is the index of its segment."""
    from aiodat import EPAttr, EvdFlags, Privileges

    pz = ia.create_pz()
    dev = ia.query().ia_attr.transport_attr
    reads = min(16, dev.max_qp_init_rd_atom, dev.max_qp_rd_atom)
    recv_depth = 2 * depth if op == "send" else 1
    # min_rnr_timer 1 (0.01 ms): a Python receiver reposts more slowly than rxe delivers, and
    # perftest's own QPs are set up the same way (docs/performance-history.md, "The RNR timer")
    attrs = EPAttr(max_request_dtos=depth, max_recv_dtos=recv_depth, max_rdma_read_in=reads,
                   max_rdma_read_out=reads, min_rnr_timer=1)
    qlen = (recv_depth if server else depth) + 8
    if busy_poll_us is None:
        evd = ia.create_evd(qlen, EvdFlags.DTO)
    else:
        evd = ia.create_evd(qlen, EvdFlags.DTO, busy_poll_us=busy_poll_us)
    shared = ia.create_srq(pz, recv_depth) if srq and server and op == "send" else None
    ep = ia.create_ep(pz, recv_evd=evd, request_evd=evd, srq=shared, attrs=attrs)
    slices = depth if pool else 1
    buf = bytearray(size * slices)
    if (op == "read") == server:  # the side whose bytes travel holds the pattern
        buf[:] = pattern(size) * slices
    lmr = pz.register(buf, Privileges.LOCAL_WRITE | Privileges.REMOTE_WRITE | Privileges.REMOTE_READ)
    segs = [lmr[size * i:size * (i + 1)] for i in range(slices)]
    if server and op == "send":
        (shared if shared is not None else ep).post_recv_batch(
            [(segs[i % slices], i % slices) for i in range(recv_depth)])
    return ep, evd, buf, segs


async def receive(ep: Any, evd: Any, segs: List[Any], total: int) -> float:
    """Receive ``total`` messages, reposting each receive as it completes into the segment it took
    (its cookie; to the EP's SRQ, if it has one); the time of the last."""
    poster = ep.srq if ep.srq is not None else ep
    refill = [(seg, i) for i, seg in enumerate(segs)]  # a receive's item, by its cookie
    only = refill[0] if len(segs) == 1 else None
    got = 0
    while got < total:
        events = await evd.wait(1, timeout=120)
        for ev in events:
            if ev.status != "IBV_WC_SUCCESS":
                raise RuntimeError(f"a receive failed: {ev.status}")
        got += len(events)
        # (kept posted for the next run on this EP)
        items = [only] * len(events) if only else [refill[ev.cookie] for ev in events]
        try:
            poster.post_recv_batch(items)
        except InvalidState:
            if got < total:
                raise  # after the last message a sender in another process may already have disconnected
    return time.perf_counter()


async def sink_process(device: str, op: str, size: int, depth: int, total: int, srq: bool = False,
                       pool: bool = False) -> None:
    """The child of a two-process bandwidth run: accept one connection (handing the client its
    buffer in the accept private data), receive ``total`` messages if ``op`` is send (through an
    SRQ with ``srq``, into a pool of ``depth`` slices with ``pool``), wait for the disconnect and
    check the bytes that landed (in every slice)."""
    from aiodat import EventType, open_ia

    with open_ia(device) as ia:
        server, evd, buf, segs = setup_side(ia, op, size, depth, server=True, srq=srq, pool=pool)
        await accept_one(ia, server, segs[0].lmr.remote().to_bytes())
        if op == "send":
            await receive(server, evd, segs, total)
        while (await server.connect_evd.wait_one(timeout=600)).type is not EventType.CONNECTION_EVENT_DISCONNECTED:
            pass
        if op != "read" and bytes(buf) != pattern(size) * len(segs):
            raise AssertionError(f"the {op} bandwidth run moved other bytes than it should have")


async def bandwidth_stream(device: str, address: str, op: str = "write", size: int = 65536, depth: int = 64,
                           iters: int = 1000, batch: int = 16, warmup: Optional[int] = None,
                           processes: int = 1, loop_name: str = "asyncio", mode: str = "await",
                           busy_poll_us: int = 50, srq: bool = False, pool: bool = False) -> BandwidthSample:
    """Stream ``iters`` ``size``-byte operations from a client EP to a server EP of one IA.

    Up to ``depth`` requests are in flight.  They are posted ``batch`` at a
    time in one crossing into C (``post_rdma_write_batch`` / ``_read_batch`` /
    ``post_send_batch``), all but the last of each batch with
    ``CompletionFlags.SUPPRESS``, so each batch costs one completion and one
    wake-up.  For ``send`` the server keeps ``2 * depth`` receives posted and
    reposts them in batches (``post_recv_batch``) as they complete; with ``srq``
    it posts them to an SRQ its EP receives from.  With ``pool`` each side's
    requests take turns over ``depth`` slices of their own (an RDMA request to its
    own slice of the peer's buffer), as a server answering from a pool of buffers
    posts them.  The data is checked at the end, in every slice.

    ``processes=1``: both EPs in this process, on one loop; for ``send`` the
    time runs until the server has received the last message.
    ``processes=2``: the server is a child process (``python -m aiodat.bench
    sink``, same loop kind), as perftest runs its two sides, so receiving and
    sending each have a CPU; the time runs until the last request completes
    (for a send, the peer has acknowledged it: it is in its receive queue).

    ``mode`` is how the sending side learns of its completions: ``await``
    (``await evd.wait()``), ``callback`` (``evd.set_callback``: the callback
    posts the next batches) or ``busypoll`` (its EVD made with
    ``busy_poll_us``, then ``await evd.wait()``).
    """
    from aiodat import CompletionFlags, RemoteRegion, open_ia
    from aiodat.cm import connect_pair

    check_args(op, size, depth, iters, batch, srq)
    if processes not in (1, 2):
        raise ValueError(f"processes must be 1 or 2, got {processes!r}")
    if mode not in ("await", "callback", "busypoll"):
        raise ValueError(f"mode must be await, callback or busypoll, got {mode!r}")
    warmup = min(depth * 2, iters) if warmup is None else warmup
    with open_ia(device) as ia:
        client, c_evd, c_buf, c_segs = setup_side(ia, op, size, depth, server=False, pool=pool,
                                                  busy_poll_us=busy_poll_us if mode == "busypoll" else None)
        child = None
        if processes == 1:
            server, s_evd, s_buf, s_segs = setup_side(ia, op, size, depth, server=True, srq=srq, pool=pool)
            await connect_pair(client, server)  # cm.py shortens the RNR timer of every new connection
            remote = s_segs[0].lmr.remote()
        else:
            child, port = await start_child(["sink", device, op, str(size), str(depth), str(warmup + iters),
                                              *(["srq"] if srq else []), *(["pool"] if pool else [])], loop_name)
            try:
                remote = RemoteRegion.from_bytes(await client.connect(address, port, timeout=30))
            except BaseException:
                await kill_child(child)
                raise

        # n requests in one call, only the last signalled: its cookie says how many it completes
        suppress, signal = CompletionFlags.SUPPRESS, CompletionFlags.DEFAULT
        batch_post = {"write": client.post_rdma_write_batch, "read": client.post_rdma_read_batch,
                      "send": client.post_send_batch}[op]
        # each request's (segment, [remote]): one pair for all, or a slice each in turn
        pairs = [(seg, remote[size * i:size * (i + 1)]) if op != "send" else (seg,) for i, seg in enumerate(c_segs)]
        turn = [0]  # the pool's next slice
        if len(pairs) == 1:
            def post(n: int) -> int:
                return batch_post([(*pairs[0], None)] * (n - 1) + [(*pairs[0], n)], suppress, signal)
        else:
            # a batch's items are made once per (first slice, size) and then reused, so that the
            # benchmark's own Python stays out of the figure, as with one buffer (a list multiplied)
            made: Dict[Tuple[int, int], List[Tuple[Any, ...]]] = {}

            def post(n: int) -> int:
                first = turn[0]
                turn[0] = (first + n) % len(pairs)
                items = made.get((first, n))
                if items is None:
                    picks = [pairs[(first + j) % len(pairs)] for j in range(n)]
                    items = made[first, n] = [(*pick, None) for pick in picks[:-1]] + [(*picks[-1], n)]
                return batch_post(items, suppress, signal)

        async def stream(total: int) -> Tuple[float, float]:
            recv_task = None
            if op == "send" and child is None:
                recv_task = asyncio.ensure_future(receive(server, s_evd, s_segs, total))
            start = time.perf_counter()
            if mode == "callback":
                await stream_callback(total)
                end = time.perf_counter()
                if recv_task is not None:
                    end = await recv_task
                return start, end
            posted = completed = 0
            while completed < total:
                while posted < total and posted - completed < depth:
                    n = min(batch, total - posted, depth - (posted - completed))
                    post(n)
                    posted += n
                for ev in await c_evd.wait(1, timeout=120):
                    if not ev.ok:
                        raise RuntimeError(f"{op} failed: {ev.status}")
                    completed += ev.cookie
            end = time.perf_counter()
            if recv_task is not None:
                end = await recv_task
            return start, end

        def stream_callback(total: int) -> "asyncio.Future[None]":
            done: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
            state = [0, 0]  # posted, completed

            def fill() -> None:
                posted, completed = state
                while posted < total and posted - completed < depth:
                    n = min(batch, total - posted, depth - (posted - completed))
                    post(n)
                    posted += n
                state[0] = posted

            def on_events(events: Any) -> None:
                try:
                    for ev in events:
                        if not ev.ok:
                            raise RuntimeError(f"{op} failed: {ev.status}")
                        state[1] += ev.cookie
                    if state[1] >= total:
                        if not done.done():
                            done.set_result(None)
                        return
                    fill()
                except BaseException as exc:
                    if not done.done():
                        done.set_exception(exc)

            c_evd.set_callback(on_events)
            done.add_done_callback(lambda _f: c_evd.set_callback(None))
            fill()
            return done

        try:
            if warmup:
                await stream(warmup)
            start, end = await stream(iters)
            expected = pattern(size) * len(c_segs)
            if (op == "read" or child is None) and bytes(c_buf if op == "read" else s_buf) != expected:
                raise AssertionError(f"the {op} bandwidth run moved other bytes than it should have")
            await client.disconnect()
        except BaseException:  # (a failure or Ctrl-C: the child would wait for a disconnect that never comes)
            if child is not None:
                await kill_child(child)
            raise
        finally:
            if child is not None:
                await finish_child(child)
        if child is not None and child.returncode != 0:
            raise RuntimeError(f"the receiving process failed (exit status {child.returncode})")
    return BandwidthSample(op, size, iters, end - start)


def run_bw_perftest(op: str, size: int, depth: int, iters: int, device: str, address: str,
                    timeout: float, extra: Sequence[str] = (), figure: Optional[str] = None) -> PerftestResult:
    """perftest's ``_bw`` tool for ``op`` with the same size, iterations and depth as aiodat's run,
    and ``extra`` options: ``-e`` sleeps on the completion channel, as ``await evd.wait()`` does,
    instead of polling; ``-l N`` posts N requests per ``ibv_post_send``, as a batch post does.
    ``figure``: the column that counts (run_perftest_pair retries once when it is unusable)."""
    return run_perftest_pair(BW_TOOLS[op], ["-s", str(size), "-n", str(iters), "-t", str(depth), *extra],
                             device=device, address=address, timeout=timeout, figure=figure)


def compare_streaming(kind: str, op: str, size: int, depth: int, iters: int, loop: str, *, batch: int,
                      repeat: int = 3, modes: Sequence[str] = ("await",), busy_poll_us: int = 50,
                      perftest: bool = True, device: Optional[str] = None, address: Optional[str] = None,
                      timeout: float = 300.0, processes: int = 2, srq: bool = False, pool: bool = False,
                      progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """``repeat`` rounds of aiodat's streaming ``op`` in each of ``modes``, then perftest's ``_bw`` tool with
    the same size, depth and iterations; ``kind`` "rate" compares Mpps, "bandwidth" MB/s (2**20 bytes).
    ``srq``: the receiving side takes its receives from an SRQ, and perftest runs with ``--use-srq``.
    ``pool``: each side's requests take turns over ``depth`` buffers of their own (perftest, which
    has no such mode, posts from one buffer as always)."""
    from aiodat import DATError

    check_args(op, size, depth, iters, batch, srq)
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    for mode in modes:
        if mode not in ("await", "callback", "busypoll"):
            raise ValueError(f"mode must be await, callback or busypoll, got {mode!r}")
    device, address = device_and_address(device, address)
    tool = BW_TOOLS[op]
    unit = "Mpps" if kind == "rate" else "MB/s"
    column = "MsgRate[Mpps]" if kind == "rate" else "BW_average[MB/sec]"  # perftest's figure
    report = Comparison(f"aiodat bench {kind}", {"device": device, "address": address, "loop": loop, "op": op,
                                                 "size": size, "iters": iters, "depth": depth, "batch": batch,
                                                 "processes": processes, "srq": srq, "pool": pool}, repeat,
                        title=f"{'message rate' if kind == 'rate' else 'bandwidth'} ({unit}; MB = 2**20 bytes "
                              f"as perftest's), higher is better")
    labels = {"await": "aiodat await (evd.wait)", "callback": "aiodat callback (set_callback)",
              "busypoll": f"aiodat busypoll (busy_poll_us={busy_poll_us})"}
    for mode in modes:
        report.figure(f"aiodat_{mode}", labels[mode], unit)
    # For the message rate, also perftest sleeping on its completion channel (like with like for
    # await), and perftest posting ``batch`` requests per call (like with like for a batch post:
    # plain perftest rings rxe's doorbell, a system call, once per message).  The target is
    # against plain ``-R``.
    perftests: Dict[str, List[str]] = {"perftest": []}
    if kind == "rate":
        perftests.update(perftest_event=["-e"], perftest_list=["-l", str(batch)])
    if srq:
        perftests = {key: [*extra, "--use-srq"] for key, extra in perftests.items()}
    if perftest:
        for key, extra in perftests.items():
            report.figure(key, " ".join([tool, "-R", *extra]), unit)
        for mode in modes:
            report.compare(f"aiodat_{mode}", "perftest", f"{mode} / {tool}")
        if kind == "rate":
            if "await" in modes:
                report.compare("aiodat_await", "perftest_event", f"await / {tool} -e")
            for mode in modes:
                report.compare(f"aiodat_{mode}", "perftest_list", f"{mode} / {tool} -l {batch}")
    for r in range(repeat):
        for mode in modes:
            if progress:
                progress(f"round {r + 1}: aiodat {mode}")
            fig = report.figures[f"aiodat_{mode}"]
            try:
                sample = run_on_loop(loop, lambda: bandwidth_stream(
                    device, address, op, size, depth, iters, batch, processes=processes, loop_name=loop,
                    mode=mode, busy_poll_us=busy_poll_us, srq=srq, pool=pool))
                fig.record(sample.mpps if kind == "rate" else sample.mib_per_s)
            except (DATError, RuntimeError, AssertionError, AttributeError, TypeError) as exc:
                fig.record(None, f"{type(exc).__name__}: {exc}")
        for key, extra in perftests.items() if perftest else ():
            if progress:
                progress(f"round {r + 1}: {' '.join([tool, *extra])}")
            # (perftest wants the iterations a multiple of its post list: a rate, so round them up)
            n = -(-iters // batch) * batch if key == "perftest_list" else iters
            res = run_bw_perftest(op, size, depth, n, device, address, timeout, extra, figure=column)
            report.figures[key].record(res.value(column) if res.ok else None, res.error or None)
    return report


def bandwidth(op: str = "write", size: int = 65536, depth: int = 64, iters: int = 1000, loop: str = "asyncio",
              *, batch: int = 16, repeat: int = 3, modes: Sequence[str] = ("await", "callback", "busypoll"),
              busy_poll_us: int = 50, perftest: bool = True, device: Optional[str] = None,
              address: Optional[str] = None, timeout: float = 300.0, processes: int = 2, srq: bool = False,
              pool: bool = False, progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """``aiodat bench bandwidth``: aiodat's streaming ``op`` (write, read, send) beside ``ib_<op>_bw -R``,
    same device, size, depth and iteration count, one after the other, ``repeat`` rounds; ratios of MB/s
    per round and their median.  ``srq`` (send only): the receiver posts to an SRQ, perftest runs with
    ``--use-srq``.  ``pool``: each side's requests take turns over ``depth`` buffers of their own."""
    return compare_streaming("bandwidth", op, size, depth, iters, loop, batch=batch, repeat=repeat, modes=modes,
                             busy_poll_us=busy_poll_us, perftest=perftest, device=device, address=address,
                             timeout=timeout, processes=processes, srq=srq, pool=pool, progress=progress)
