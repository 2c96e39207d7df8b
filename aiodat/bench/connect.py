"""``aiodat bench connect``: aiodat's connection set-up rate beside librdmacm's ``cmtime`` (rdmacm-utils).

cmtime's client creates N rdma_cm ids, resolves all addresses, then all
routes, makes all QPs and connects them all, each step for every connection
before the next; the server accepts them and then disconnects them.  It
prints one row per step with the wall time of the step over all connections
(and, in newer versions, a "full connect" row: first id to last connection
established); see :func:`parse_cmtime`.

aiodat's side: a PSP accepts N connections (an EP each, one shared DTO EVD)
while N client EPs connect concurrently, the same "all at once" as cmtime;
then the clients disconnect and all are freed.  Two modes, as the other
benchmarks have: ``await`` runs a task per connection on each side
(``asyncio.gather`` of ``ep.connect``; ``await cr.accept`` per request),
``callback`` drives both sides from EVD callbacks, as cmtime drives its
connections from one event handler: one shared connection EVD per side,
``connect_nowait``/``accept_nowait``/``disconnect_nowait`` and a callback
that counts the events, no task or Future per connection.  ``processes=2`` (the default) runs the
accepting side in a child process (``python -m aiodat.bench acceptor``), as
cmtime runs its server, so each side has a CPU; ``processes=1`` runs both on
one loop.  The figures are per connection, timed on the client: the connect
phase's wall time / N (beside cmtime's full connect avg/iter), and the whole
cycle (connect, disconnect, free) / N beside the sum of cmtime's full
connect, disconnect and destroy rows / N.
"""
from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .harness import device_and_address, run_on_loop
from .rounds import Comparison


@dataclass
class CmtimeResult:
    """One cmtime run (the client's table: step -> columns), or why there is none."""

    connections: int
    steps: Dict[str, Dict[str, float]] = field(default_factory=dict)
    output: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when cmtime printed its step table."""
        return not self.error and bool(self.steps)

    def connect_us(self) -> Optional[float]:
        """Per-connection set-up time (us): "full connect" total / N, else the connect steps' totals / N."""
        return cmtime_connect_us(self.steps, self.connections) if self.ok else None

    def cycle_us(self) -> Optional[float]:
        """Per-connection time of connect, disconnect and destroy (us)."""
        return cmtime_cycle_us(self.steps, self.connections) if self.ok else None


_NUM = r"-?\d+(?:\.\d+)?"
_ROW = re.compile(rf"^\s*([a-z][a-z ]*?)\s*:\s+({_NUM}(?:\s+{_NUM})*)\s*$")
#: rdmacm-utils up to 44 prints "step  total ms  max ms  min us  us / conn"
_OLD_HEADER = ["total(ms)", "max(ms)", "min(us)", "us/conn"]
_TEARDOWN = ("disconnect", "destroy", "destroy id", "destroy qp")


def parse_cmtime(output: str) -> Dict[str, Dict[str, float]]:
    """cmtime's step table: ``{step: {column: value}}``.

    Two layouts exist: rdmacm-utils 44 (Debian 12) prints ``step total ms max
    ms min us us / conn`` (columns named ``total(ms)``, ``max(ms)``,
    ``min(us)``, ``us/conn`` here) and steps from "create id" to "destroy";
    newer ones print ``step us/conn sum(us) max(us) min(us) total(us)
    avg/iter`` (names kept) and a "full connect" row.  ``total`` is the
    step's wall time over all connections.
    """
    header = None
    steps: Dict[str, Dict[str, float]] = {}
    for line in output.splitlines():
        parts = line.split()
        if parts and parts[0] == "step":
            header = _OLD_HEADER if "ms" in parts else parts[1:]
            continue
        m = _ROW.match(line)
        if header is None or not m:
            continue
        values = [float(v) for v in m.group(2).split()]
        if len(values) == len(header):
            steps[m.group(1)] = dict(zip(header, values))
    return steps


def _total(row: Dict[str, float]) -> float:
    """A step's wall time over all connections, in us, in either layout."""
    if "total(us)" in row:
        return row["total(us)"]
    return row.get("total(ms)", 0.0) * 1000.0


def cmtime_connect_us(steps: Dict[str, Dict[str, float]], connections: int) -> Optional[float]:
    """Per-connection set-up (us) from cmtime's table."""
    if connections < 1 or not steps:
        return None
    if "full connect" in steps:
        return _total(steps["full connect"]) / connections
    total = sum(_total(row) for name, row in steps.items() if name not in _TEARDOWN)
    return total / connections if total > 0 else None


def cmtime_cycle_us(steps: Dict[str, Dict[str, float]], connections: int) -> Optional[float]:
    """Per-connection set-up plus teardown (disconnect, destroy) (us) from cmtime's table."""
    setup = cmtime_connect_us(steps, connections)
    if setup is None:
        return None
    return setup + sum(_total(row) for name, row in steps.items() if name in _TEARDOWN) / connections


def run_cmtime_pair(address: str, connections: int, *, timeout: float = 300.0,
                    start_delay: float = 1.0) -> CmtimeResult:
    """Run ``cmtime -b ADDRESS -p PORT -c N`` (server) and ``cmtime -s ADDRESS -p PORT -c N`` (client).

    Never raises for a failed run: the result's ``error`` says what went wrong.
    """
    path = shutil.which("cmtime")
    if path is None:
        return CmtimeResult(connections, error="cmtime not found (install the Debian package rdmacm-utils)")
    port = str(random.randint(50000, 59999))
    deadline = time.monotonic() + timeout
    common = ["-p", port, "-c", str(connections)]
    server = subprocess.Popen([path, "-b", address, *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True)
    out, error = "", ""
    try:
        time.sleep(start_delay)
        try:
            client = subprocess.run([path, "-s", address, *common], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    timeout=max(1.0, deadline - time.monotonic()))
            out = client.stdout
            if client.returncode != 0:
                error = f"cmtime client exited with status {client.returncode}"
        except subprocess.TimeoutExpired:
            error = f"cmtime did not finish within {timeout:g} s"
    finally:
        # cmtime's server does not exit after the run (it would serve the next one): give it a moment, then stop it
        try:
            server.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
    steps = parse_cmtime(out)
    if not error and not steps:
        error = "cmtime printed no step table"
    return CmtimeResult(connections, steps, out, error)


MODES = ("await", "callback")


async def connect_cycle(device: str, connections: int, timeout: float = 120.0,
                        mode: str = "await") -> Tuple[float, float]:
    """Connect ``connections`` EP pairs at once through one PSP, then disconnect and free them all.

    Returns (connect phase, whole cycle) in seconds of wall time.
    """
    from aiodat import EPAttr, open_ia

    attrs = EPAttr(max_recv_dtos=1, max_request_dtos=1)
    with open_ia(device) as ia:
        pz, dto, cr_evd, psp = _listening_side(ia, connections)
        start = time.perf_counter()
        if mode == "callback":
            servers, served = _serve_by_callback(ia, pz, cr_evd, dto, connections, attrs)
            try:
                clients, connected = await _client_cycle_by_callback(ia, pz, dto, psp.address, psp.port,
                                                                     connections, attrs, timeout)
                await asyncio.wait_for(served, timeout)  # every server EP saw the client's DREQ
                for ep in clients + servers:
                    ep.free()
                end = time.perf_counter()
            finally:
                cr_evd.set_callback(None)
            psp.close()
            return connected - start, end - start
        acceptor = asyncio.ensure_future(_accept_all(ia, pz, cr_evd, dto, connections, attrs, timeout))
        clients = [ia.create_ep(pz, recv_evd=dto, request_evd=dto, attrs=attrs) for _ in range(connections)]
        try:
            await asyncio.gather(*(ep.connect(psp.address, psp.port, timeout=timeout) for ep in clients))
            servers = await acceptor
            connected = time.perf_counter()
            await asyncio.gather(*(ep.disconnect(timeout=timeout) for ep in clients))
            for ep in clients + servers:
                ep.free()
            end = time.perf_counter()
        finally:
            if not acceptor.done():
                acceptor.cancel()
                await asyncio.gather(acceptor, return_exceptions=True)
        psp.close()
    return connected - start, end - start


class _Tally:
    """An EVD callback (callback mode) counting connection events of one type: ``future`` is done
    once ``count`` have come, or fails at the first event that is neither that nor ``ignore``."""

    def __init__(self, want: Any, count: int, ignore: Tuple[Any, ...] = ()) -> None:
        self.future: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
        self._want, self._left, self._ignore = want, count, ignore

    def __call__(self, events: Sequence[Any]) -> None:
        for event in events:
            if event.type is self._want:
                self._left -= 1
                if self._left == 0 and not self.future.done():
                    self.future.set_result(None)
            elif event.type not in self._ignore:
                self.fail(RuntimeError(f"{event.type.name} on {event.ep!r}: {event.reason}"))

    def fail(self, exc: BaseException) -> None:
        """End the phase with ``exc`` (a step of the callback failed)."""
        if not self.future.done():
            self.future.set_exception(exc)


def _serve_by_callback(ia: Any, pz: Any, cr_evd: Any, dto: Any, connections: int,
                       attrs: Any) -> Tuple[List[Any], "asyncio.Future[None]"]:
    """Callback mode's accepting side: each request is accepted from the CR EVD's callback onto a
    new EP whose connection events go to one shared EVD.  Returns the EPs (filled as requests come)
    and a future done once every one has been disconnected by its peer."""
    from aiodat import EvdFlags, EventType

    conn_evd = ia.create_evd(2 * connections + 8, EvdFlags.CONNECTION)
    servers: List[Any] = []
    gone = _Tally(EventType.CONNECTION_EVENT_DISCONNECTED, connections,
                  ignore=(EventType.CONNECTION_EVENT_ESTABLISHED,))

    def on_requests(events: Sequence[Any]) -> None:
        for event in events:
            try:
                ep = ia.create_ep(pz, recv_evd=dto, request_evd=dto, connect_evd=conn_evd, attrs=attrs)
                servers.append(ep)
                event.cr.accept_nowait(ep)
            except Exception as exc:  # (the callback runs in the loop: the phase fails, not the loop)
                gone.fail(exc)

    conn_evd.set_callback(gone)
    cr_evd.set_callback(on_requests)
    gone.future.add_done_callback(lambda _f: conn_evd.set_callback(None))
    return servers, gone.future


async def _client_cycle_by_callback(ia: Any, pz: Any, dto: Any, address: str, port: int, connections: int,
                                    attrs: Any, timeout: float) -> Tuple[List[Any], float]:
    """Callback mode's connecting side: ``connect_nowait`` on every EP, a callback on the one shared
    connection EVD counting ESTABLISHED, then ``disconnect_nowait`` and DISCONNECTED the same way.
    Returns the EPs (to be freed) and the time the last connection was established."""
    from aiodat import EvdFlags, EventType

    conn_evd = ia.create_evd(2 * connections + 8, EvdFlags.CONNECTION)
    clients = [ia.create_ep(pz, recv_evd=dto, request_evd=dto, connect_evd=conn_evd, attrs=attrs)
               for _ in range(connections)]
    try:
        for want, step in ((EventType.CONNECTION_EVENT_ESTABLISHED,
                            lambda ep: ep.connect_nowait(address, port, timeout=timeout)),
                           (EventType.CONNECTION_EVENT_DISCONNECTED, lambda ep: ep.disconnect_nowait())):
            tally = _Tally(want, connections)
            conn_evd.set_callback(tally)
            for ep in clients:
                step(ep)
            await asyncio.wait_for(tally.future, timeout)
            if want is EventType.CONNECTION_EVENT_ESTABLISHED:
                connected = time.perf_counter()
    finally:
        conn_evd.set_callback(None)
    return clients, connected


def _listening_side(ia: Any, connections: int) -> Tuple[Any, Any, Any, Any]:
    """The accepting side's objects on ``ia``: a PZ, the DTO EVD every EP shares, the CR EVD and
    its PSP, sized for ``connections``."""
    from aiodat import EvdFlags

    pz = ia.create_pz()
    dto = ia.create_evd(4 * connections + 8, EvdFlags.DTO)
    cr_evd = ia.create_evd(connections + 8, EvdFlags.CR)
    return pz, dto, cr_evd, ia.create_psp_any(cr_evd)


async def _accept_all(ia: Any, pz: Any, cr_evd: Any, dto: Any, connections: int, attrs: Any,
                     timeout: float) -> List[Any]:
    """Accept ``connections`` requests from ``cr_evd``, each onto a new EP (all at once, as they come)."""
    servers: List[Any] = []
    accepts = []
    for _ in range(connections):
        event = await cr_evd.wait_one(timeout=timeout)
        ep = ia.create_ep(pz, recv_evd=dto, request_evd=dto, attrs=attrs)
        servers.append(ep)
        accepts.append(asyncio.ensure_future(event.cr.accept(ep, timeout=timeout)))
    await asyncio.gather(*accepts)
    return servers


async def acceptor_process(device: str, connections: int, timeout: float = 120.0, mode: str = "await") -> None:
    """The child of a two-process connect cycle: listen (``port N`` on stdout, as
    :func:`~aiodat.bench.peer.start_child` reads it), accept ``connections`` (in ``mode``), wait
    until the client has disconnected each, free them."""
    import sys

    from aiodat import EPAttr, EventType, open_ia

    attrs = EPAttr(max_recv_dtos=1, max_request_dtos=1)
    with open_ia(device) as ia:
        pz, dto, cr_evd, psp = _listening_side(ia, connections)
        sys.stdout.write(f"port {psp.port}\n")
        sys.stdout.flush()
        if mode == "callback":
            servers, served = _serve_by_callback(ia, pz, cr_evd, dto, connections, attrs)
            await asyncio.wait_for(served, timeout)
            cr_evd.set_callback(None)
        else:
            servers = await _accept_all(ia, pz, cr_evd, dto, connections, attrs, timeout)

            async def disconnected(ep: Any) -> None:
                while (await ep.connect_evd.wait_one(timeout=timeout)).type is not \
                        EventType.CONNECTION_EVENT_DISCONNECTED:
                    pass

            await asyncio.gather(*(disconnected(ep) for ep in servers))
        for ep in servers:
            ep.free()
        psp.close()


async def connect_cycle_remote(device: str, address: str, connections: int, loop_name: str,
                               timeout: float = 120.0, mode: str = "await") -> Tuple[float, float]:
    """:func:`connect_cycle` with the accepting side in a child process; timed on this (client) side."""
    from aiodat import EPAttr, EvdFlags, open_ia

    from .peer import finish_child, kill_child, start_child

    attrs = EPAttr(max_recv_dtos=1, max_request_dtos=1)
    child, port = await start_child(["acceptor", device, str(connections), mode], loop_name)
    try:
        with open_ia(device) as ia:
            pz = ia.create_pz()
            dto = ia.create_evd(4 * connections + 8, EvdFlags.DTO)
            start = time.perf_counter()
            if mode == "callback":
                clients, connected = await _client_cycle_by_callback(ia, pz, dto, address, port, connections,
                                                                     attrs, timeout)
            else:
                clients = [ia.create_ep(pz, recv_evd=dto, request_evd=dto, attrs=attrs) for _ in range(connections)]
                await asyncio.gather(*(ep.connect(address, port, timeout=timeout) for ep in clients))
                connected = time.perf_counter()
                await asyncio.gather(*(ep.disconnect(timeout=timeout) for ep in clients))
            for ep in clients:
                ep.free()
            end = time.perf_counter()
    except BaseException:  # (a failure or Ctrl-C: the child would wait up to its timeout for connections)
        await kill_child(child)
        raise
    finally:
        await finish_child(child)
    if child.returncode != 0:
        raise RuntimeError(f"the accepting process failed (exit status {child.returncode})")
    return connected - start, end - start


def connect(connections: int = 100, loop: str = "asyncio", *, repeat: int = 3, cmtime: bool = True,
            device: Optional[str] = None, address: Optional[str] = None, timeout: float = 300.0,
            processes: int = 2, modes: Sequence[str] = MODES,
            progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """``aiodat bench connect``: ``repeat`` rounds of aiodat's connect/disconnect cycle of ``connections``
    connections in each of ``modes`` (``await``, ``callback``), then ``cmtime -c connections``;
    per-connection times and their ratios."""
    from aiodat import DATError

    for name, value in (("connections", connections), ("repeat", repeat)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if processes not in (1, 2):
        raise ValueError(f"processes must be 1 or 2, got {processes!r}")
    if not modes or any(mode not in MODES for mode in modes):
        raise ValueError(f"modes must be some of {', '.join(MODES)}, got {modes!r}")
    device, address = device_and_address(device, address)
    report = Comparison("aiodat bench connect", {"device": device, "address": address, "loop": loop,
                                                 "connections": connections, "processes": processes}, repeat,
                        title="per connection, us: wall time of all connections at once / connections")
    for mode in modes:
        report.figure(f"aiodat_{mode}_connect", f"aiodat {mode}: connect+accept", "us")
        report.figure(f"aiodat_{mode}_cycle", f"aiodat {mode}: connect+disconnect+free", "us")
    if cmtime:
        c_conn = report.figure("cmtime_connect", "cmtime connect (set-up steps)", "us")
        c_cycle = report.figure("cmtime_cycle", "cmtime connect+disconnect+destroy", "us")
        for mode in modes:
            report.compare(f"aiodat_{mode}_connect", "cmtime_connect", f"aiodat {mode} / cmtime connect")
            report.compare(f"aiodat_{mode}_cycle", "cmtime_cycle", f"aiodat {mode} / cmtime whole cycle")
    for r in range(repeat):
        for mode in modes:
            if progress:
                progress(f"round {r + 1}: aiodat {mode}")
            a_conn, a_cycle = report.figures[f"aiodat_{mode}_connect"], report.figures[f"aiodat_{mode}_cycle"]
            try:
                if processes == 2:
                    conn_s, cycle_s = run_on_loop(loop, lambda: connect_cycle_remote(
                        device, address, connections, loop, mode=mode))
                else:
                    conn_s, cycle_s = run_on_loop(loop, lambda: connect_cycle(device, connections, mode=mode))
                a_conn.record(conn_s * 1e6 / connections)
                a_cycle.record(cycle_s * 1e6 / connections)
            except (DATError, RuntimeError, asyncio.TimeoutError) as exc:
                a_conn.record(None, f"{type(exc).__name__}: {exc}")
                a_cycle.record(None, f"{type(exc).__name__}: {exc}")
        if cmtime:
            if progress:
                progress(f"round {r + 1}: cmtime")
            res = run_cmtime_pair(address, connections, timeout=timeout)
            why = res.error or "cmtime's table has no time above 0"  # (n/a always comes with a reason)
            c_conn.record(res.connect_us(), why)
            c_cycle.record(res.cycle_us(), why)
    return report


__all__: Sequence[str] = ("connect", "MODES", "connect_cycle", "connect_cycle_remote", "acceptor_process",
                          "run_cmtime_pair", "parse_cmtime", "CmtimeResult",
                          "cmtime_connect_us", "cmtime_cycle_us")
