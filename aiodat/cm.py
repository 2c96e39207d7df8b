"""Connections: the rdma_cm event channel on the loop, PSPs, CRs, connect/accept/reject/disconnect.

Each IA owns one rdma_cm event channel.  Its fd is non-blocking and watched by
the running loop; on a wake-up the shim copies each event out of librdmacm
(type, status, private data, the cm_id) and acks it at once, and
:meth:`CMChannel.dispatch` routes it by cm_id to its owner:

* a PSP's listening id: CONNECT_REQUEST becomes a :class:`CR` on the PSP's cr_evd;
* an EP's id: address and route resolution drive the active side on to
  rdma_connect; ESTABLISHED, REJECTED, UNREACHABLE, DISCONNECTED (a DREQ from
  the peer, or the DREP to ours) become DAT connection events.

A connection event goes to the task awaiting that outcome (``await
ep.connect()``, ``await cr.accept()``, ``await ep.disconnect()``) if there is
one, otherwise to the EP's connect_evd: the ``*_nowait`` forms leave every
outcome on the EVD, as DAT does.

The QP stays aiodat's (created in ep.py and moved to INIT at once, so receives
can be posted before connecting) and is never handed to librdmacm: aiodat
follows librdmacm's QP-less flow.  rdma_connect and rdma_accept carry the QP
number; the shim's ``aiodat_cm_ready_qp`` moves the QP through INIT, RTR and
RTS with the attributes rdma_cm negotiated (``rdma_init_qp_attr``, the call
librdmacm itself makes) plus the EP's own transport settings, the passive side
before rdma_accept, the active side on CONNECT_RESPONSE, which it then answers
with rdma_establish.  aiodat moves the QP to ERR itself where librdmacm would
(before a DREQ, on the peer's DREQ).
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import ipaddress
import os
import socket
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Set, Tuple, Union

from aiodat._fdwatch import FdWatch
from aiodat._handle import Handle, Raw, fail_waiter
from aiodat._lib import ffi, lib
from aiodat.errors import (
    AcceptCompletionError,
    ConnectionRejected,
    ConnectionTimedOut,
    NonPeerRejected,
    ConnQualInUse,
    HostNotFound,
    InvalidAddress,
    InvalidHandle,
    InvalidParameter,
    InvalidState,
    QueueFull,
    TimeoutExpired,
    Unreachable,
    error_from_errno,
    shown,
)
from aiodat.epattr import EPState, ServiceType
from aiodat.evd import EVD, AsyncEvent, ConnectionEvent, ConnectionRequestEvent, EvdFlags, EventType, is_timeout
from aiodat.evd import report_internal_error  # noqa: F401  (it lived here; loop callbacks of cm.py use it)

if TYPE_CHECKING:
    from aiodat.ep import EP
    from aiodat.ia import IA

#: private data limits through rdma_cm on InfiniBand/RoCE: the IB CM's REQ, REP and REJ
#: private data (92, 196, 148 bytes) less rdma_cm's 36-byte header in the REQ.  Private data
#: is raw: the caller's bytes go on the wire as given, and the receiver gets what the CM
#: delivered, which on IB/RoCE is always the full size, zero-filled past what was sent.
CONNECT_PRIVATE_DATA_MAX = 56
ACCEPT_PRIVATE_DATA_MAX = 196
REJECT_PRIVATE_DATA_MAX = 148

# enum rdma_cm_event_type
(ADDR_RESOLVED, ADDR_ERROR, ROUTE_RESOLVED, ROUTE_ERROR, CONNECT_REQUEST, CONNECT_RESPONSE,
 CONNECT_ERROR, UNREACHABLE, REJECTED, ESTABLISHED, DISCONNECTED, DEVICE_REMOVAL,
 MULTICAST_JOIN, MULTICAST_ERROR, ADDR_CHANGE, TIMEWAIT_EXIT) = range(16)

_CONSUMER_REJECT = 28  # IB_CM_REJ_CONSUMER_DEFINED: the peer application said no
_ETIMEDOUT = 110
_RESOLVE_MS = 2000


def _key(cm_id: Any) -> int:
    return int(ffi.cast("uintptr_t", cm_id))


def _private(data: Union[bytes, bytearray, memoryview, None], limit: int, what: str) -> bytes:
    """The caller's private data, checked against the CM's limit; sent exactly as given."""
    if data is None:
        return b""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidParameter(f"{what} private data must be bytes, not {type(data).__name__}")
    try:
        data = bytes(data)
    except ValueError as exc:  # a released memoryview
        raise InvalidParameter(f"{what} private data cannot be read: {exc}") from None
    if len(data) > limit:
        raise InvalidParameter(
            f"{what} private data is {len(data)} bytes; the CM carries at most {limit} "
            f"(max_private_data_size)"
        )
    return data


def check_timeout(timeout: Any, name: str = "timeout") -> Optional[float]:
    """A connection call's timeout (``name`` in the error): None, or seconds > 0 (inf included) as
    the loop's timer takes them, as a float.  NaN, an int no float holds and a non-number are
    refused here, before anything starts: in the timer they would fail (uvloop: ValueError;
    asyncio: OverflowError) or fire at once (asyncio: NaN) after the request, REP or DREQ had gone."""
    if timeout is None:
        return None
    if not (is_timeout(timeout) and timeout > 0):  # (a wait's test, which allows 0)
        raise InvalidParameter(f"{name} must be None or > 0 seconds, got {shown(timeout)}")
    return float(timeout)


def check_port(port: Any, lowest: int = 0) -> int:
    """A port as an int between ``lowest`` (0 where listening picks one, 1 to connect) and 65535;
    anything else, a bool or a float included, is InvalidParameter naming it."""
    if not isinstance(port, int) or isinstance(port, bool) or not lowest <= port <= 0xFFFF:
        raise InvalidParameter(f"port must be an int between {lowest} and 65535, got {shown(port)}")
    return port


def _sockaddr(host: str, port: int, family: int = 0) -> Any:
    """A numeric IPv4 or IPv6 address (``"fe80::1%netdev"`` for a scoped one) as a sockaddr.

    A host name is resolved here, blocking, but only where no event loop runs in this thread
    (a plain script's ``connect_nowait``): in a running loop it is refused, since the loop
    would wait on DNS.  The awaitable paths resolve names first with :func:`resolve_host`,
    off the loop.
    """
    if not isinstance(host, str):
        raise InvalidParameter(f"host must be an IP address string, not {type(host).__name__}")
    _refuse_nul(host)
    check_port(port)
    try:
        encoded = host.encode()
    except UnicodeError:  # (a lone surrogate: no address or name has one)
        raise InvalidAddress(f"host {host!r} is not an address or a host name") from None
    addr = ffi.new("struct sockaddr_storage *")
    err = lib.aiodat_sockaddr(encoded, port, addr)
    if err == errno.ENODEV:  # a numeric IPv6 address whose scope names no interface here
        raise InvalidAddress(f"host {host!r}: no network interface {host.partition('%')[2]!r} here "
                             "(the IPv6 scope after '%' names an interface or its index)")
    if err:
        if asyncio._get_running_loop() is not None:
            raise InvalidAddress(
                f"host {host!r} is not a numeric address, and looking it up here would block the running "
                f"event loop: pass the address, or use the awaitable call (await ep.connect(...)), which "
                f"looks names up off the loop")
        try:  # a host name, with no loop to block: resolve it the ordinary way
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise _not_found(host, exc) from None
        same = [info for info in infos if info[0] == family]  # (``family``'s first, as resolve_host)
        host = str((same or infos)[0][4][0])
        lib.aiodat_sockaddr(host.encode(), port, addr)
    return addr


def _refuse_nul(host: str) -> None:
    """C and getaddrinfo read a host only up to a NUL: "10.0.0.1\0junk" must not reach 10.0.0.1."""
    if "\0" in host:
        raise InvalidAddress(f"host {host!r} has a NUL character in it")


def _not_found(host: str, exc: Exception) -> HostNotFound:
    """A failed lookup of ``host`` (a socket.gaierror too, as asyncio raises for the same host)."""
    return HostNotFound(f"cannot resolve host {host!r}: {exc}", errno=exc.errno if isinstance(exc, OSError) else None)


@functools.lru_cache(maxsize=256)  # every connect asks (twice) about the same few peers
def _is_numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host.partition("%")[0])
        return True
    except ValueError:
        return False


async def resolve_host(host: str, family: int = 0, timeout: Optional[float] = None) -> str:
    """``host`` as a numeric address: a name is looked up with ``loop.getaddrinfo``, off the loop.

    ``family`` (socket.AF_INET or AF_INET6) prefers addresses of the IA's own family.  A lookup
    longer than ``timeout`` seconds raises TimeoutExpired.
    """
    if not isinstance(host, str):
        raise InvalidParameter(f"host must be an IP address or host name string, not {type(host).__name__}")
    _refuse_nul(host)
    if _is_numeric(host):
        return host
    lookup = asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    try:
        infos = await (lookup if timeout is None else asyncio.wait_for(lookup, timeout))
    except asyncio.TimeoutError:
        raise TimeoutExpired(f"looking up the address of {host!r} took more than {timeout} s") from None
    except (OSError, UnicodeError) as exc:
        raise _not_found(host, exc) from None
    same = [info for info in infos if info[0] == family]
    return str((same or infos)[0][4][0])


async def resolve_within(host: str, family: int, timeout: Optional[float]) -> Tuple[str, Optional[float]]:
    """:func:`resolve_host` as the first part of a call bounded by ``timeout``: the address, and
    what is left of the timeout for the rest (a connect's or a resolution's own timer)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    address = await resolve_host(host, family, timeout)
    if timeout is None or _is_numeric(host):  # (nothing was looked up)
        return address, timeout
    return address, max(timeout - (loop.time() - started), 1e-3)


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _check_family(ia: "IA", host: str) -> None:
    """rdma_cm binds a connection to the IA's address, so the peer must have the same family."""
    if ia.address and isinstance(host, str) and _is_numeric(host) and _family(host) != _family(ia.address):
        want = "IPv6" if _family(host) == socket.AF_INET6 else "IPv4"
        of_family = [a for a in ia.addresses if _family(a) == _family(host)]
        raise InvalidAddress(f"{host} is {want} but the IA's address {ia.address} is not; open the IA "
                             f"with address= one of its {want} addresses: {', '.join(of_family) or 'none'}")


def _ip(host: str) -> Any:
    """A numeric host as an ipaddress object: its scope dropped, an IPv4-mapped IPv6 one as IPv4."""
    addr = ipaddress.ip_address(host.partition("%")[0])
    return getattr(addr, "ipv4_mapped", None) or addr


def loopback_kind(host: str) -> Optional[str]:
    """"a loopback" or "the unspecified" for such a numeric address (IPv4-mapped too), else None:
    rdma_cm sends both through its loopback path, never through a device to a peer."""
    if not (isinstance(host, str) and _is_numeric(host)):
        return None
    addr = _ip(host)
    return "a loopback" if addr.is_loopback else "the unspecified" if addr.is_unspecified else None


def refuse_loopback(host: str, own: Iterable[str], use: str) -> None:
    """InvalidAddress for a loopback or unspecified peer that is none of the ``own`` addresses (a
    device on ``lo`` may be one).  On rxe (kernel 6.1) a connect to 127.0.0.1 never completed, and
    one to ::1 stopped every later connect of the device, other processes' too, until reboot."""
    kind = loopback_kind(host)
    if kind and not any(_is_numeric(a) and _ip(a) == _ip(host) for a in own):
        raise InvalidAddress(f"{host} is {kind} address, which RDMA does not reach (it goes through a device, "
                             f"not the loopback interface): use {use}")


def check_peer(ia: "IA", host: str) -> None:
    """A peer's numeric address: no loopback one (refuse_loopback), and of the IA's family."""
    refuse_loopback(host, ia.addresses, f"the device's own address, {ia.address}")
    _check_family(ia, host)  # (after: another family's address would not help a loopback one)


def listen_address(ia: "IA", port: int) -> Any:
    """The sockaddr a PSP binds: the IA's own address, never the wildcard (which would take every device's requests)."""
    return _sockaddr(require_address(ia, "listen on"), port)


def require_address(ia: "IA", doing: str) -> str:
    """The IA's address, which rdma_cm binds or routes from.  Without one rdma_cm would pick a
    route, and so a device, by the destination alone: perhaps another device than the EP's, where
    the connection then fails late and obscurely.  InvalidAddress up front instead."""
    if not ia.address:
        raise InvalidAddress(f"{ia.name} has no IP address to {doing}: give one of its netdevs an address "
                             f"(RoCE: the Ethernet netdev; InfiniBand: its IPoIB netdev)")
    return ia.address


def _address(sa: Any) -> Optional[Tuple[str, int]]:
    if sa == ffi.NULL:
        return None
    host = ffi.new("char[64]")
    port = ffi.new("uint16_t *")
    if lib.aiodat_sockaddr_str(sa, host, 64, port):
        return None
    return ffi.string(host).decode(), port[0]


def request_addresses(ev: Any) -> Tuple[Optional[Tuple[str, int]], Optional[Tuple[str, int]]]:
    """(local, remote) (host, port) of a CONNECT_REQUEST event (the shim formatted them as it
    copied the event out), or Nones where rdma_cm had none."""
    local, remote = ffi.string(ev.local_host), ffi.string(ev.remote_host)
    return ((local.decode(), ev.local_port) if local else None,
            (remote.decode(), ev.remote_port) if remote else None)


def cm_addresses(cm_id: Any) -> Tuple[Optional[Tuple[str, int]], Optional[Tuple[str, int]]]:
    """(local, remote) (host, port) of a cm_id, or Nones when it has none."""
    if cm_id == ffi.NULL:
        return None, None
    return _address(lib.rdma_get_local_addr(cm_id)), _address(lib.rdma_get_peer_addr(cm_id))


_SETTLE_RETRY_S = 0.5  # a BROKEN owed whose payment failed other than for memory: tried again this much later


class CMChannel:
    """An IA's rdma_cm event channel, watched by the loop, and the routing of its events."""

    def __init__(self, ia: "IA") -> None:
        self._ia = ia
        self.channel = lib.rdma_create_event_channel()
        if self.channel == ffi.NULL:
            raise error_from_errno(ffi.errno, "creating the rdma_cm event channel (is rdma_ucm loaded?)")
        self._raw = Raw(self.channel, lib.rdma_destroy_event_channel, "rdma_cm event channel")
        #: cm_id -> the weak route to its Connection, PSP, CR or datagram resolution (see _Route)
        self._routes: Dict[int, _Route] = {}
        self._buf = ffi.new("struct aiodat_cm_event *")
        self._sockaddrs: Dict[Tuple[str, int], Any] = {}  # numeric addresses used: their sockaddrs
        # Connections owed a BROKEN whose push failed (owe_broken), oldest first: a list through
        # their own slots, so recording a debt allocates nothing; and the payment scheduled, if any
        self._owed_first: Optional[Connection] = None
        self._owed_last: Optional[Connection] = None
        self._settle_call: Optional[asyncio.Handle] = None
        # the loop keeps the channel (its fd) while it watches it, even if the IA is dropped
        self.watch = FdWatch(self.channel.fd, self._on_readable, "rdma_cm event channel", keep=self._raw)

    def create_id(self, owner: Any, port_space: int) -> Any:
        """A new cm_id on this channel, routed to ``owner``."""
        idp = ffi.new("struct rdma_cm_id **")
        if lib.rdma_create_id(self.channel, idp, ffi.NULL, port_space):
            raise error_from_errno(ffi.errno, "creating an rdma_cm id")
        self.own_id(owner, idp[0])
        return idp[0]

    def source(self) -> Any:
        """The ``struct sockaddr *`` connections leave from: the IA's address (InvalidAddress
        without one; the callers have already refused such an IA, naming what they do)."""
        return self.sockaddr(require_address(self._ia, "connect from"), 0)

    def sockaddr(self, host: str, port: int) -> Any:
        """``host:port`` as a ``struct sockaddr *`` that owns its storage (rdma_cm copies it; the
        caller holds the pointer across the call).  A numeric one is kept: a program connects to
        the same few peers again and again; a name is looked up each time."""
        key = (host, port) if type(host) is str and type(port) is int else None  # (else _sockaddr says why not)
        addr = self._sockaddrs.get(key) if key is not None else None
        if addr is None:
            storage = _sockaddr(host, port, _family(self._ia.address or ""))
            # Not ffi.cast: a cast does not keep ``storage`` alive, so an address not kept here (an
            # int-subclass port, a str-subclass host, a name) was freed before rdma_cm read it, and a
            # cleared cache freed one a caller still held.  A pointer from a buffer keeps the buffer.
            addr = ffi.from_buffer("struct sockaddr *", ffi.buffer(storage))
            if key is not None and _is_numeric(host):
                if len(self._sockaddrs) >= 256:
                    self._sockaddrs.clear()
                self._sockaddrs[key] = addr
        return addr

    def own_id(self, owner: Any, cm_id: Any) -> None:
        """Route ``cm_id``'s events to ``owner`` (held weakly); if the owner is dropped unclosed,
        the id is destroyed.  Passing an id on (a CR's to its EP) keeps its Raw."""
        key = _key(cm_id)
        old = self._routes.get(key)
        raw = old.raw if old is not None else Raw(cm_id, lib.rdma_destroy_id, "cm_id", self._raw)
        self._routes[key] = _Route(owner, key, raw, self._routes)

    def owner(self, cm_id: Any) -> Any:
        """The object ``cm_id``'s events go to, or None (none, or dropped)."""
        route = self._routes.get(_key(cm_id))
        return route() if route is not None else None

    def destroy_id(self, cm_id: Any) -> None:
        """Forget and destroy a cm_id (any QP must already be detached)."""
        if cm_id != ffi.NULL:
            route = self._routes.pop(_key(cm_id), None)
            if route is not None:
                route.raw.release()
            else:
                lib.rdma_destroy_id(cm_id)

    def drain(self) -> None:
        """Dispatch every pending event, one at a time (an id may die while dispatching)."""
        self.settle()  # (a BROKEN owed goes before any later event of its EP; none, almost always)
        while self.channel != ffi.NULL:
            got = lib.aiodat_cm_get_events(self.channel, ffi.NULL, self._buf, 1)
            if got <= 0:
                return
            try:
                self.dispatch(self._buf)
            except Exception as exc:  # never into the loop, never stopping the other events
                report_internal_error(self._ia, exc, f"dispatching rdma_cm event {_event_name(self._buf.event)}")

    def _on_readable(self) -> None:
        if not self._ia.closed:
            self.drain()

    def dispatch(self, ev: Any) -> None:
        """Route one copied-out event to the PSP, CR or EP that owns its cm_id."""
        kind = ev.event
        plen = ev.private_data_len
        pdata = bytes(ffi.buffer(ev.private_data, plen)) if plen else b""  # raw, as the CM delivered it
        if kind == CONNECT_REQUEST:
            psp = self.owner(ev.listen_id)
            if isinstance(psp, PSP) and not psp.closed:
                psp._on_request(ev.id, pdata, ev.responder_resources, ev.initiator_depth, request_addresses(ev))
            elif hasattr(psp, "_on_cm_request") and not psp.closed:  # a datagram PSP (datagram.py)
                psp._on_cm_request(ev, pdata)
            else:
                lib.rdma_reject(ev.id, ffi.NULL, 0)
                lib.rdma_destroy_id(ev.id)
            return
        if kind == DEVICE_REMOVAL or kind == ADDR_CHANGE:
            etype = EventType.ASYNC_DEVICE_REMOVAL if kind == DEVICE_REMOVAL else EventType.ASYNC_ADDRESS_CHANGE
            evd = self._ia.async_evd
            obj = self.owner(ev.id)
            if isinstance(obj, Connection):
                obj = obj.ep
            elif hasattr(obj, "device_removed"):  # a datagram resolution or multicast join (datagram.py)
                if kind == DEVICE_REMOVAL:
                    obj.device_removed()
                obj = obj.subject()
            evd._push(AsyncEvent(etype, evd, obj=obj, reason=_event_name(kind)))
            return
        owner = self.owner(ev.id)
        if isinstance(owner, Connection):
            _ep_event(owner.ep, kind, ev.status, pdata)
        elif hasattr(owner, "_on_cm_event"):  # UD resolution or multicast join (datagram.py)
            owner._on_cm_event(ev, pdata)
        elif ev.ah != ffi.NULL:  # an address handle nobody is left to take
            lib.ibv_destroy_ah(ev.ah)

    # -- BROKEN events owed (cm.broken) ----------------------------------------------
    def owe_broken(self, conn: "Connection", reason: str) -> None:
        """``conn``'s connect EVD is owed a BROKEN (``reason``) whose push failed and that nothing
        else retries (the device's QP_FATAL): record it and schedule its payment.  The record
        allocates nothing (slots, and a list through them), so memory pressure cannot lose it; if
        the scheduling fails, the channel's next drain pays it (a CM event, a dequeue's or a timed
        wait's look) or the device's next async event."""
        if conn.owed_broken is None:
            conn.owed_next = None
            if self._owed_last is None:
                self._owed_first = conn
            else:
                self._owed_last.owed_next = conn
            self._owed_last = conn
        conn.owed_broken = reason
        self._settle_soon(0.0)

    def forget_broken(self, conn: "Connection") -> None:
        """Drop ``conn``'s debt (paid, or its EP was reset or freed): a walk of a list that is
        almost always empty, allocating nothing."""
        conn.owed_broken = None
        prev, at = None, self._owed_first
        while at is not None and at is not conn:
            prev, at = at, at.owed_next
        if at is None:
            return
        if prev is None:
            self._owed_first = conn.owed_next
        else:
            prev.owed_next = conn.owed_next
        if self._owed_last is conn:
            self._owed_last = prev
        conn.owed_next = None

    def settle(self) -> None:
        """Pay every BROKEN owed, oldest first.  Never raises (it runs in loop callbacks and
        drains): one that fails stays owed, with the rest, and is tried again at the loop's next
        turn after a MemoryError (memory comes back), else after _SETTLE_RETRY_S, reported (a
        failure that comes every time must not keep the CPU busy)."""
        while self._owed_first is not None:
            conn = self._owed_first
            try:
                _pay_broken(conn)
            except Exception as exc:
                memory = isinstance(exc, MemoryError)
                self._settle_soon(0.0 if memory else _SETTLE_RETRY_S)
                if not memory:
                    try:
                        report_internal_error(self._ia, exc, "pushing a CONNECTION_EVENT_BROKEN owed")
                    except Exception:  # (the retry stays scheduled)
                        pass
                return
            self.forget_broken(conn)

    def _settle_soon(self, delay: float) -> None:
        """Schedule ``settle`` on the loop watching the channel, one at a time (none without an
        open loop: the next drain pays then)."""
        loop = self.watch._loop
        if self._settle_call is not None or loop is None or loop.is_closed():
            return
        try:
            self._settle_call = (loop.call_soon(self._settle_due) if not delay
                                 else loop.call_later(delay, self._settle_due))
        except Exception:  # (memory again: the next drain pays)
            pass

    def _settle_due(self) -> None:
        self._settle_call = None
        if not self._ia.closed:
            self.settle()

    def destroy(self) -> None:
        """Stop watching and destroy the channel (every id is gone by now)."""
        self.watch.detach()
        if self._settle_call is not None:
            self._settle_call.cancel()
            self._settle_call = None
        for route in list(self._routes.values()):
            owner = route()
            if isinstance(owner, Connection):
                owner = owner.ep
            if isinstance(owner, Handle):
                owner.close()
            elif owner is not None and hasattr(owner, "fail"):  # a datagram resolution or join (datagram.py)
                owner.fail(InvalidHandle("the IA was closed while a datagram resolution or multicast join waited"))
        while self._owed_first is not None:  # (their EPs were closed above: this only lets go)
            self.forget_broken(self._owed_first)
        if self.channel != ffi.NULL:
            self._raw.release()
            self.channel = ffi.NULL


class _Route(weakref.ref):
    """A cm_id's route to its owner: a weak reference whose callback destroys the id when the
    owner is dropped unclosed (no loop or channel object needed).  One plain weak reference
    per id, not a finalizer and a weak dictionary entry: an id is made per connection."""

    __slots__ = ("key", "raw", "routes")

    def __new__(cls, owner: Any, key: int, raw: Raw, routes: Dict[int, "_Route"]) -> "_Route":
        return super().__new__(cls, owner, _drop_route)

    def __init__(self, owner: Any, key: int, raw: Raw, routes: Dict[int, "_Route"]) -> None:
        super().__init__(owner, _drop_route)  # type: ignore[call-arg]  # (typeshed: ref has no __init__)
        self.key, self.raw, self.routes = key, raw, routes


def _drop_route(route: _Route) -> None:
    """The owner of a route died: destroy its id, unless the id has moved on to another owner."""
    if route.routes.get(route.key) is route:
        del route.routes[route.key]
        route.raw.release()


def _event_name(kind: int) -> str:
    return ffi.string(lib.rdma_event_str(kind)).decode()


# -- the connection state of an EP ---------------------------------------------------


class _Drain:
    """A graceful disconnect's drain under way (``conn.drain``, compared by identity: a later
    reset, free or DREQ forgets it) and the DREP ``timeout`` its caller asked for (or, where that
    caller gave none, the first call that joined it with one: _join_disconnect)."""

    __slots__ = ("timeout",)

    def __init__(self, timeout: Optional[float]) -> None:
        self.timeout = timeout


class Connection:
    """The connection state an EP owns (``ep._conn``): its DAT state, rdma_cm id, the waiting
    connect/accept/disconnect future and the timers.  Only this module changes it.

    It is also the owner of the EP's cm_id in the channel's routing table, so events
    reach the EP without this module importing ep.py.
    """

    __slots__ = ("ep", "state", "cm_id", "waiter", "timer", "pending_private", "drain", "drain_timer",
                 "resolutions", "owed_broken", "owed_next", "__weakref__")

    def __init__(self, ep: "EP") -> None:
        self.ep = ep
        self.state = EPState.UNCONNECTED
        self.cm_id: Any = ffi.NULL
        #: the future of an awaited connect/accept/disconnect; None: outcomes go to the connect EVD
        self.waiter: Optional["asyncio.Future[ConnectionEvent]"] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.pending_private = b""  # the connect private data, sent once the route is resolved
        self.drain: Optional[_Drain] = None  # the graceful disconnect under way, if any
        self.drain_timer: Optional[asyncio.TimerHandle] = None
        #: a UD EP's datagram resolutions and multicast joins under way (datagram.py): the EP's
        #: close fails them (each has ``fail(exc)``), so no task waits on an EP that is gone
        self.resolutions: Optional[Set[Any]] = None
        #: the reason of a BROKEN owed to the connect EVD (CMChannel.owe_broken), and the next
        #: connection owed one
        self.owed_broken: Optional[str] = None
        self.owed_next: Optional[Connection] = None

    def __repr__(self) -> str:
        return f"<aiodat.cm.Connection {self.state.value}>"


def broken(ep: "EP", reason: str, retried: bool = True) -> None:
    """The device reported the EP's QP broken: the EP is in error; tell the connect EVD.
    ``retried``: a failure here is retried (a failed completion's: it stays in its EVD's backlog
    and breaks the EP again); False for the device's async event, which nothing retries: a BROKEN
    it could not push is owed (CMChannel.owe_broken) and this returns.  A UD EP, never connected,
    breaks from UNCONNECTED: its QP in ERR takes no more datagrams until ``reset()``.  An EP being
    closed or reset, whose old QP's completions are polled on the way, breaks no more."""
    if ep._closed or ep._resetting:
        return
    conn = ep._conn
    if conn.state in (EPState.CONNECTED, EPState.DISCONNECT_PENDING) or (ep._ud and conn.state is EPState.UNCONNECTED):
        # The state changes last: a MemoryError before leaves it, and the retry pushes the BROKEN
        # again.  A push that failed after its append gives a duplicate BROKEN, better than a
        # lost one.
        event = None
        try:
            evd = ep.connect_evd
            event = ConnectionEvent(EventType.CONNECTION_EVENT_BROKEN, evd, ep, reason=reason)
            evd._push(event)
        except BaseException as exc:
            if retried:
                raise
            # No retry: the EP must not stay CONNECTED for ever, and the BROKEN is owed (paid
            # later, once), unless it was queued before the push failed (its wake-up's failure).
            conn.state = EPState.ERROR
            if event is None or not _queued_last(event):
                ep._ia._cm.owe_broken(conn, reason)
            if not isinstance(exc, Exception):  # (a KeyboardInterrupt goes on; the debt is recorded)
                raise
            return
        conn.state = EPState.ERROR


def _queued_last(event: ConnectionEvent) -> bool:
    """Whether ``event`` is the last event of its EVD's queue: a push that raised after its
    append (read by identity, allocating nothing)."""
    queue = event.evd._queue if event.evd is not None else None
    return bool(queue) and queue[-1] is event


def _pay_broken(conn: Connection) -> None:
    """Push the BROKEN ``conn`` owes (CMChannel.settle forgets the debt then); raises with it
    still owed, unless the push failed after its event was queued (a second would be a duplicate)."""
    ep = conn.ep
    evd = ep.connect_evd
    event = ConnectionEvent(EventType.CONNECTION_EVENT_BROKEN, evd, ep, reason=conn.owed_broken or "")
    try:
        evd._push(event)
    except BaseException:
        if not _queued_last(event):
            raise


def reset(ep: "EP") -> None:
    """EP.reset: the QP was recreated; the EP may connect again."""
    _cancel_timer(ep)
    if ep._conn.owed_broken is not None:  # the program has moved on: a late BROKEN would seem the next connection's
        ep._ia._cm.forget_broken(ep._conn)
    ep._conn.state = EPState.UNCONNECTED


def freed(ep: "EP") -> None:
    """EP.free/close: a task waiting on the connection learns the EP is gone."""
    conn = ep._conn
    if conn.owed_broken is not None:  # no event for an EP that is gone (and the channel lets go of it)
        ep._ia._cm.forget_broken(conn)
    waiter, conn.waiter = conn.waiter, None
    fail_waiter(waiter, InvalidHandle("the EP was freed while a connection call waited on it"))
    pending, conn.resolutions = conn.resolutions, None
    for resolution in list(pending or ()):
        resolution.fail(InvalidHandle("the EP was freed while a datagram resolution or multicast join waited on it"))


# -- the active side and the events of an EP ---------------------------------------


def _check_rc(ep: "EP", doing: str) -> None:
    """Connections are RC's: a UD endpoint has none (it resolves its peers instead)."""
    if ep.attrs.service_type is not ServiceType.RC:
        raise InvalidParameter(f"only RC endpoints {doing}; UD endpoints have no connection (they use "
                               f"resolve_datagram, and reset() after an error)")


def _check_can_connect(ep: "EP") -> None:
    ep._check()
    _check_rc(ep, "connect")
    if ep._conn.state is not EPState.UNCONNECTED:
        hint = " (call ep.reset() first)" if ep._conn.state in (EPState.DISCONNECTED, EPState.ERROR) else ""
        raise InvalidState(f"cannot connect an EP in state {ep._conn.state.value}{hint}")


def start_connect(ep: "EP", host: str, port: int, private_data: bytes, timeout: Optional[float],
                  waiter: Optional["asyncio.Future[ConnectionEvent]"]) -> None:
    """Resolve, route and connect; the outcome goes to ``waiter`` or the connect EVD."""
    _check_can_connect(ep)
    require_address(ep._ia, "connect from")
    check_peer(ep._ia, host)
    check_port(port, lowest=1)  # (port 0 is a listener's "pick one", never a peer's)
    pdata = _private(private_data, CONNECT_PRIVATE_DATA_MAX, "connect")
    timeout = check_timeout(timeout)
    ia = ep._ia
    cm = ia._cm
    dst = cm.sockaddr(host, port)
    if not _is_numeric(host):  # (a name, looked up here as no loop runs: the address it gave)
        check_peer(ia, (_address(dst) or ("",))[0])
    src = cm.source()  # (before the cm_id: an InvalidAddress here must not leave one behind)
    ia._attach_loop()  # (InvalidState if another loop owns the IA: before anything is sent)
    cm_id = cm.create_id(ep._conn, lib.RDMA_PS_TCP)
    resolve_ms = int(min(timeout, _RESOLVE_MS / 1000) * 1000) if timeout else _RESOLVE_MS
    if lib.rdma_resolve_addr(cm_id, src, dst, resolve_ms):
        err = ffi.errno
        cm.destroy_id(cm_id)
        raise error_from_errno(err, f"resolving {host}:{port}")
    ep._conn.cm_id = cm_id
    ep._conn.pending_private = pdata
    ep._conn.waiter = waiter
    ep._conn.state = EPState.ACTIVE_CONNECTION_PENDING
    _start_timer(ep, timeout, EventType.CONNECTION_EVENT_TIMED_OUT, f"connect to {host}:{port}")


def _start_timer(ep: "EP", timeout: Optional[float], etype: EventType, what: str) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop: rdma_cm's own retries bound the wait
    if timeout is not None:
        ep._conn.timer = loop.call_later(timeout, _timed_out, ep, ep._conn.cm_id, etype,
                                         f"{what} timed out after {f'{timeout:.3f}'.rstrip('0').rstrip('.')}s")


def _cancel_timer(ep: "EP") -> None:
    conn = ep._conn
    if conn.timer is not None:
        conn.timer.cancel()
        conn.timer = None
    if conn.drain_timer is not None:
        conn.drain_timer.cancel()
        conn.drain_timer = None
    conn.drain = None


def _timed_out(ep: "EP", cm_id: Any, etype: EventType, reason: str) -> None:
    if ep.closed or ep._conn.cm_id != cm_id:
        return
    if etype is EventType.CONNECTION_EVENT_TIMED_OUT and ep._conn.state is EPState.CONNECTED:
        return
    if etype is EventType.CONNECTION_EVENT_DISCONNECTED and ep._conn.state is EPState.DISCONNECTED:
        return
    # Give up on the peer: drop the id (the QP goes to ERR, flushing its requests).
    _drop_connection(ep)
    ep._conn.state = EPState.DISCONNECTED
    _notify(ep, etype, reason=reason)


def _send_conn(ep: "EP", cm_id: Any, accept: bool, pdata: bytes, responder: int, initiator: int) -> int:
    """rdma_connect (or rdma_accept) for the EP's QP (the QP-less flow) with its transport settings,
    in one C call.  0, or the errno."""
    a = ep.attrs
    if lib.aiodat_cm_connect(cm_id, accept, pdata, len(pdata), responder, initiator, a.retry_count,
                             a.rnr_retry, ep.qp_num, ep.srq is not None):
        return ffi.errno
    return 0


def _ready_qp(ep: "EP", cm_id: Any, responder: int = -1, initiator: int = -1) -> int:
    """The EP's QP through INIT, RTR and RTS as rdma_cm negotiated it, with the EP's RNR timer
    and ACK timeout (-1: the CM's RDMA read depths).  0; an errno with the QP in ERR; or minus
    an errno when the cm_id refused the first step, the QP untouched."""
    a, ia = ep.attrs, ep._ia
    return lib.aiodat_cm_ready_qp(cm_id, ep._qp, responder, initiator, a.min_rnr_timer,
                                  -1 if a.ack_timeout is None else a.ack_timeout, ia.port, ia._link_layer)


def _ep_event(ep: "EP", kind: int, status: int, pdata: bytes) -> None:
    """What an event on an EP's cm_id does."""
    cm_id = ep._conn.cm_id
    if kind == ADDR_RESOLVED:
        if lib.rdma_resolve_route(cm_id, _RESOLVE_MS):
            _fail_connect(ep, EventType.CONNECTION_EVENT_UNREACHABLE, f"rdma_resolve_route: errno {ffi.errno}")
        return
    if kind == ROUTE_RESOLVED:
        err = _send_conn(ep, cm_id, False, ep._conn.pending_private, ep.attrs.max_rdma_read_in,
                         ep.attrs.max_rdma_read_out)
        if err:
            _fail_connect(ep, EventType.CONNECTION_EVENT_UNREACHABLE, f"rdma_connect: errno {err}")
        return
    if kind == CONNECT_RESPONSE:  # the REP: ready the QP, then the RTU (rdma_establish)
        err = abs(_ready_qp(ep, cm_id))
        if err:
            lib.rdma_reject(cm_id, ffi.NULL, 0)
            _fail_connect(ep, EventType.CONNECTION_EVENT_UNREACHABLE,
                          f"readying the QP for the connection: {os.strerror(err)}")
        elif lib.rdma_establish(cm_id):
            err = ffi.errno
            ep._to_error(check=False)
            _fail_connect(ep, EventType.CONNECTION_EVENT_UNREACHABLE, f"rdma_establish: {os.strerror(err)}")
        else:
            _established(ep, pdata)
        return
    if kind in (ADDR_ERROR, ROUTE_ERROR, UNREACHABLE, CONNECT_ERROR):
        etype = (EventType.CONNECTION_EVENT_TIMED_OUT if status == -_ETIMEDOUT
                 else EventType.CONNECTION_EVENT_UNREACHABLE)
        if ep._conn.state is EPState.PASSIVE_CONNECTION_PENDING:
            etype = EventType.CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR
        _fail_connect(ep, etype, f"{_event_name(kind)} (status {status})")
        return
    if kind == REJECTED:
        if ep._conn.state is EPState.PASSIVE_CONNECTION_PENDING:  # our REP went, the peer gave up: DAT's
            _fail_connect(ep, EventType.CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR,  # failed-accept outcome
                          f"the peer rejected the accepted connection (reason {status})", pdata)
            return
        etype = (EventType.CONNECTION_EVENT_PEER_REJECTED if status == _CONSUMER_REJECT
                 else EventType.CONNECTION_EVENT_NON_PEER_REJECTED)
        _fail_connect(ep, etype, f"rejected (reason {status})", pdata)
        return
    if kind == ESTABLISHED:  # the passive side's RTU arrived
        _established(ep, pdata)
        return
    if kind == DISCONNECTED:
        draining = ep._conn.drain is not None  # our DREQ had not gone yet: this is the peer's
        accepting = ep._conn.state is EPState.PASSIVE_CONNECTION_PENDING  # (its DREQ overtook its RTU)
        _cancel_timer(ep)
        if ep._conn.state in (EPState.CONNECTED, EPState.ERROR) or draining or accepting:
            _disconnect(ep)  # the peer's DREQ: our QP to ERR, flushing what is posted, and the DREP
        ep._conn.state = EPState.DISCONNECTED
        if accepting:
            _notify(ep, EventType.CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR, pdata,
                    "the peer disconnected before the connection was established")
        else:
            _notify(ep, EventType.CONNECTION_EVENT_DISCONNECTED, pdata)
        return
    # TIMEWAIT_EXIT, multicast: nothing to do here


def _established(ep: "EP", pdata: bytes) -> None:
    _cancel_timer(ep)
    ep._conn.state = EPState.CONNECTED
    _notify(ep, EventType.CONNECTION_EVENT_ESTABLISHED, pdata)


def _disconnect(ep: "EP") -> int:
    """What librdmacm's rdma_disconnect does for a QP of its own: QP to ERR, then DREQ (or DREP). 0 or errno."""
    ep._to_error(check=False)
    return ffi.errno if lib.rdma_disconnect(ep._conn.cm_id) else 0


def _fail_connect(ep: "EP", etype: EventType, reason: str, pdata: bytes = b"") -> None:
    _cancel_timer(ep)
    # QP to ERR, as a timed-out or cancelled attempt does: receives posted before the connect
    # flush (in INIT or RTS they would wait for ever, with no event)
    ep._to_error(check=False)
    ep._conn.state = EPState.DISCONNECTED
    _notify(ep, etype, pdata, reason)


def _notify(ep: "EP", etype: EventType, pdata: bytes = b"", reason: str = "") -> None:
    """A connection event of ``ep``: to the task awaiting the outcome if there is one, else to the
    connect EVD.  The waiter's event names the EP's own connect EVD only if it was made already
    (None otherwise: it is made only if the event must go there, see _await_outcome)."""
    waiter = ep._conn.waiter
    if waiter is not None and not waiter.done():
        ep._conn.waiter = None
        waiter.set_result(ConnectionEvent._made(etype, ep._connect_evd, ep, pdata, reason))
    else:
        evd = ep.connect_evd
        evd._push(ConnectionEvent._made(etype, evd, ep, pdata, reason))


def _outcome(ep: "EP", event: ConnectionEvent, what: str) -> bytes:
    """Turn the event that ended a connect/accept into a return value or the DAT error."""
    t = event.type
    if t is EventType.CONNECTION_EVENT_ESTABLISHED:
        return event.private_data
    if t is EventType.CONNECTION_EVENT_PEER_REJECTED:
        raise ConnectionRejected(f"{what}: the peer rejected the connection", private_data=event.private_data)
    if t is EventType.CONNECTION_EVENT_NON_PEER_REJECTED:
        raise NonPeerRejected(f"{what}: rejected by the peer's CM ({event.reason}); "
                              f"is anything listening there?", private_data=event.private_data)
    if t is EventType.CONNECTION_EVENT_TIMED_OUT:  # (aiodat's own timer's reason names the connect already)
        raise ConnectionTimedOut(event.reason if event.reason.startswith(what) else f"{what}: {event.reason}")
    if t is EventType.CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR:
        raise AcceptCompletionError(f"{what}: the connection did not complete ({event.reason})")
    raise Unreachable(f"{what}: {event.type.name} ({event.reason})")


async def _await_outcome(ep: "EP", fut: "asyncio.Future[ConnectionEvent]") -> ConnectionEvent:
    try:
        return await fut
    except asyncio.CancelledError:
        # The outcome may have arrived just before the cancellation reached the task: it was
        # handed to the future, not the EVD.  Never lose it: it goes to the connect EVD.
        if fut.done() and not fut.cancelled() and fut.exception() is None and not ep.closed:
            event = fut.result()
            if event.evd is None:  # made for the waiter before the EP had its own connect EVD
                event = dataclasses.replace(event, evd=ep.connect_evd)
            event.evd._push(event)
        raise
    finally:
        if ep._conn.waiter is fut:
            ep._conn.waiter = None


async def connect(ep: "EP", host: str, port: int, private_data: bytes, timeout: Optional[float]) -> bytes:
    """``await ep.connect(...)``: see :meth:`aiodat.EP.connect`."""
    _check_can_connect(ep)
    require_address(ep._ia, "connect from")
    check_port(port, lowest=1)
    timeout = check_timeout(timeout)
    host, timeout = await resolve_within(host, _family(ep._ia.address or ""), timeout)
    fut: "asyncio.Future[ConnectionEvent]" = asyncio.get_running_loop().create_future()
    start_connect(ep, host, port, private_data, timeout, fut)
    try:
        event = await _await_outcome(ep, fut)
    except asyncio.CancelledError:
        _abandon(ep)
        raise
    return _outcome(ep, event, f"connect to {host}:{port}")


def _abandon(ep: "EP") -> None:
    """A cancelled connect/accept: drop the half-made connection so the EP is not left pending."""
    if not ep.closed and ep._conn.state in (EPState.ACTIVE_CONNECTION_PENDING, EPState.PASSIVE_CONNECTION_PENDING):
        _cancel_timer(ep)
        _drop_connection(ep)
        ep._conn.state = EPState.DISCONNECTED


# -- disconnect ----------------------------------------------------------------

#: how long ``disconnect_nowait(graceful=True)`` lets posted requests complete before the DREQ
GRACEFUL_DRAIN_TIMEOUT = 10.0
_DRAIN_RETRY = 0.001  # the send queue was full: try the drain marker again this much later


def start_disconnect(ep: "EP", graceful: bool, waiter: Optional["asyncio.Future[ConnectionEvent]"],
                     timeout: Optional[float] = None) -> None:
    """Tear the connection down; DISCONNECTED follows on the DREP (to ``waiter`` or the connect EVD).

    Abrupt: QP to ERR at once (posted requests flush), then the DREQ.  Graceful:
    the EP stops taking posts (DISCONNECT_PENDING), and once every request
    already on the send queue has completed (bounded by ``timeout``, or
    GRACEFUL_DRAIN_TIMEOUT without one) the QP goes to ERR and the DREQ goes,
    as rsockets' shutdown does: the peer has every byte before the DREQ.
    """
    ep._check()
    _check_rc(ep, "disconnect")
    timeout = check_timeout(timeout)  # (refused before anything is torn down, in every state)
    conn = ep._conn
    if conn.state in (EPState.ACTIVE_CONNECTION_PENDING, EPState.PASSIVE_CONNECTION_PENDING):
        _abandon(ep)
        _notify(ep, EventType.CONNECTION_EVENT_DISCONNECTED,
                reason="disconnected before the connection was established")
        return
    if conn.state is EPState.DISCONNECT_PENDING:
        _join_disconnect(ep, graceful, waiter, timeout)
        return
    if conn.state is EPState.ERROR:
        graceful = False  # the QP broke: nothing posted on it completes any more; the DREQ goes at once
        # The break may have overtaken a disconnect under way: as in DISCONNECT_PENDING, one
        # awaiting task at a time (else the first one's waiter was overwritten and never woken).
        if waiter is not None and conn.waiter is not None and not conn.waiter.done():
            raise InvalidState("a task already awaits this EP's disconnect")
    elif conn.state is not EPState.CONNECTED:
        raise InvalidState(f"cannot disconnect an EP in state {conn.state.value}")
    try:
        loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
    except RuntimeError:
        loop = None  # nothing would drain the CQ: the DREQ goes at once
    drain = graceful and bool(ep._send_q) and loop is not None
    # The loop must watch the channel (and, to drain, the request EVD): InvalidState if another
    # loop owns them, raised here, before the QP goes to ERR or the DREQ goes.
    if drain and loop is not None:  # (drain implies a loop)
        ep.request_evd._attach(loop)  # (its IA's fds too)
    else:
        ep._ia._attach_loop()
    if not graceful:
        ep._to_error()
    if drain:
        _start_drain(ep, loop, timeout or GRACEFUL_DRAIN_TIMEOUT, timeout, waiter)  # type: ignore[arg-type]
        return
    inherited = None
    if conn.state is EPState.ERROR:
        # A disconnect the break overtook ends with this one: its drain stops (the DREQ goes now),
        # its DREP timer gives way to this call's (it stays if this call has no timeout), and a
        # task awaiting it keeps waiting for this call's DREP.
        kept_timer = None
        if timeout is None:
            kept_timer, conn.timer = conn.timer, None
            if kept_timer is None and conn.drain is not None:
                timeout = conn.drain.timeout  # (a drain had not started its DREP timer yet)
        _cancel_timer(ep)
        conn.timer = kept_timer
        if waiter is None and conn.waiter is not None and not conn.waiter.done():
            waiter = inherited = conn.waiter
    conn.waiter = waiter
    conn.state = EPState.DISCONNECT_PENDING
    err = _disconnect(ep)
    if err:
        _cancel_timer(ep)
        conn.state = EPState.DISCONNECTED
        if inherited is not None:  # the task awaiting the earlier disconnect: it is over
            _notify(ep, EventType.CONNECTION_EVENT_DISCONNECTED, reason=f"rdma_disconnect failed: {os.strerror(err)}")
        conn.waiter = None  # the caller gets the error: later events go to the connect EVD
        raise error_from_errno(err, "rdma_disconnect")
    _start_timer(ep, timeout, EventType.CONNECTION_EVENT_DISCONNECTED, "waiting for the DREP")


def _start_drain(ep: "EP", loop: asyncio.AbstractEventLoop, drain_timeout: float, timeout: Optional[float],
                 waiter: Optional["asyncio.Future[ConnectionEvent]"]) -> None:
    """Graceful disconnect, first half: a signalled zero-length RDMA write goes behind every posted
    request (wr.py's DrainMarker); its completion, or ``drain_timeout``, sends the DREQ."""
    conn = ep._conn
    token = _Drain(timeout)  # this drain; a later reset/free/DREQ from the peer forgets it

    def finish(_status: Optional[str] = None) -> None:
        if conn.drain is not token:
            return
        conn.drain = None
        if conn.drain_timer is not None:
            conn.drain_timer.cancel()
            conn.drain_timer = None
        if not ep.closed and conn.state in (EPState.DISCONNECT_PENDING, EPState.ERROR):
            _send_dreq(ep, token.timeout)  # (an awaited call that joined may have set it: see _join_disconnect)

    def post_marker() -> None:
        if conn.drain is not token or ep.closed:
            return
        try:
            ep._post_drain_marker(lambda status: loop.call_soon(finish, status))
        except QueueFull:  # no room behind the posted requests yet: a completion will make some
            loop.call_later(_DRAIN_RETRY, post_marker)
        except Exception:  # the QP cannot take it (it broke): nothing more will complete
            loop.call_soon(finish)

    conn.drain = token
    post_marker()  # still CONNECTED here: the post is accepted
    conn.waiter = waiter
    conn.state = EPState.DISCONNECT_PENDING  # no new posts from here on
    conn.drain_timer = loop.call_later(drain_timeout, finish)
    # (start_disconnect attached the request EVD, and with it the IA, to the loop: it must drain
    # the CQ for the marker's completion to be seen, and read the DREP from the channel)


def _join_disconnect(ep: "EP", graceful: bool, waiter: Optional["asyncio.Future[ConnectionEvent]"],
                     timeout: Optional[float]) -> None:
    """A disconnect while one is under way (DISCONNECT_PENDING): an awaited call takes its outcome
    (one task at a time: the first awaited call may have been cancelled, or the disconnect started
    with disconnect_nowait), and an abrupt one cuts a graceful drain short (QP to ERR, the DREQ now).

    The disconnect under way keeps its own bound on the wait for the DREP; where it has none (it
    started with disconnect_nowait), ``timeout`` becomes it.  So a call's bound is never dropped:
    an awaited call with a timeout returns by then, even if the peer never answers the DREQ."""
    conn = ep._conn
    if waiter is not None:
        if conn.waiter is not None and not conn.waiter.done():
            raise InvalidState("a task already awaits this EP's disconnect")
        conn.waiter = waiter
    drain = conn.drain
    if drain is not None and drain.timeout is None:
        drain.timeout = timeout  # (the drain's end sends the DREQ with it)
    if not graceful and drain is not None:
        conn.drain = None  # (the drain's completion or timer then does nothing)
        if conn.drain_timer is not None:
            conn.drain_timer.cancel()
            conn.drain_timer = None
        _send_dreq(ep, drain.timeout)
    elif drain is None and conn.timer is None:
        # the DREQ went with no bound (disconnect_nowait): this call's is the wait's bound now
        _start_timer(ep, timeout, EventType.CONNECTION_EVENT_DISCONNECTED, "waiting for the DREP")


def _send_dreq(ep: "EP", timeout: Optional[float]) -> None:
    """Graceful disconnect, second half: QP to ERR, DREQ, and the wait for the DREP."""
    conn = ep._conn
    conn.state = EPState.DISCONNECT_PENDING
    err = _disconnect(ep)
    if err:
        _cancel_timer(ep)
        conn.state = EPState.DISCONNECTED
        _notify(ep, EventType.CONNECTION_EVENT_DISCONNECTED, reason=f"rdma_disconnect failed: {os.strerror(err)}")
        return
    _start_timer(ep, timeout, EventType.CONNECTION_EVENT_DISCONNECTED, "waiting for the DREP")


async def disconnect(ep: "EP", graceful: bool, timeout: Optional[float]) -> None:
    """``await ep.disconnect()``: see :meth:`aiodat.EP.disconnect`."""
    ep._check()
    _check_rc(ep, "disconnect")
    check_timeout(timeout)
    if ep._conn.state in (EPState.DISCONNECTED, EPState.UNCONNECTED) and not ep.closed:
        return  # already down (the peer may have disconnected first)
    fut: "asyncio.Future[ConnectionEvent]" = asyncio.get_running_loop().create_future()
    start_disconnect(ep, graceful, fut, timeout)
    if fut.done() or ep._conn.waiter is not fut:
        return
    await _await_outcome(ep, fut)


def _drop_connection(ep: "EP") -> None:
    """Disconnect if needed and destroy the EP's cm_id, leaving the QP (in ERR if it was connected) to the EP."""
    cm_id = ep._conn.cm_id
    if cm_id == ffi.NULL:
        return
    if ep._conn.state in (EPState.CONNECTED, EPState.DISCONNECT_PENDING, EPState.PASSIVE_CONNECTION_PENDING,
                     EPState.ACTIVE_CONNECTION_PENDING):
        _disconnect(ep)
    ep._conn.cm_id = ffi.NULL
    ep._ia._cm.destroy_id(cm_id)


def detach_cm_id(ep: "EP") -> None:
    """Used by EP.reset/free: end any connection and destroy the EP's cm_id."""
    _cancel_timer(ep)
    # a disconnect awaited when the QP broke (ERROR, which reset allows) would wait for ever
    waiter, ep._conn.waiter = ep._conn.waiter, None
    fail_waiter(waiter, InvalidState("the EP was reset while a connection call waited on it"))
    _drop_connection(ep)


async def connect_pair(client: "EP", server: "EP", timeout: Optional[float] = 30.0) -> "PSP":
    """Connect two unconnected EPs of one IA to each other through a PSP on a free port.

    A loopback pair for tests, benchmarks and examples: the server side accepts
    the first request on ``server`` while ``client`` connects.  Returns the PSP;
    free it and its ``cr_evd`` when no more pairs are wanted.
    """
    ia = client.ia
    cr_evd = ia.create_evd(4, EvdFlags.CR)
    try:
        psp = PSP(ia, 0, cr_evd, 16)
    except BaseException:  # (e.g. InvalidState: another thread's loop serves this IA)
        cr_evd._discard()  # (close() would be refused from this thread too; no loop has seen it)
        raise

    async def accept() -> None:
        event = await cr_evd.wait_one(timeout=timeout)
        assert isinstance(event, ConnectionRequestEvent)  # (a CR EVD takes nothing else)
        await event.cr.accept(server, timeout=timeout)

    acceptor = asyncio.ensure_future(accept())
    try:
        await client.connect(psp.address, psp.port, timeout=timeout)
        await acceptor
    except BaseException:
        acceptor.cancel()
        await asyncio.gather(acceptor, return_exceptions=True)
        psp.close()
        cr_evd.close()
        raise
    return psp


# -- the passive side ---------------------------------------------------------------


class Listener(Handle):
    """A listening rdma_cm id bound to the IA's address: what PSPs and datagram service points share."""

    _close_rank = 0  # before PZs and EVDs: stop new requests first
    _parent_holds = True  # listens until freed, like a listening socket, even if the program drops it

    def _listen(self, ia: "IA", addr: Any, port: int, port_space: int, backlog: int, what: str) -> None:
        """Bind and listen on ``port`` (0: one the provider picks); sets ``port`` and ``address``."""
        self._ia = ia
        self._cm_id = ffi.NULL
        try:  # (InvalidState if another loop owns the IA: before the port is taken)
            ia._attach_loop()
        except BaseException:
            self._discard()
            raise
        try:
            self._cm_id = ia._cm.create_id(self, port_space)
        except BaseException:  # (else the half-made listener stays the IA's, and keeps its cr_evd in use)
            self._discard()
            raise
        if lib.rdma_bind_addr(self._cm_id, ffi.cast("struct sockaddr *", addr)):
            err = ffi.errno
            self._discard()
            if err == 98:  # EADDRINUSE
                raise ConnQualInUse(f"{what} {port} is already listened on ({ia.address})")
            raise error_from_errno(err, f"binding {what} {port}")
        if lib.rdma_listen(self._cm_id, backlog):
            err = ffi.errno
            self._discard()
            raise error_from_errno(err, f"listening on {what} {port}")
        bound = _address(lib.rdma_get_local_addr(self._cm_id))
        #: the port (connection qualifier) listened on
        self.port: int = bound[1] if bound else port
        assert ia.address is not None  # (the caller's sockaddr came from listen_address, which checks)
        #: the address listened on
        self.address: str = ia.address

    def free(self) -> None:
        """Stop listening (dat_psp_free); requests not yet answered are rejected."""
        self._check()
        self.close()

    def _release(self) -> None:
        self._ia._cm.destroy_id(self._cm_id)
        self._cm_id = ffi.NULL

    def __repr__(self) -> str:
        return f"<aiodat.{type(self).__name__} port={getattr(self, 'port', '?')}{' closed' if self._closed else ''}>"


class PSP(Listener):
    """A Public Service Point: listens on a port for connection requests (dat_psp_create)."""

    _kind = "psp"

    def __init__(self, ia: "IA", port: int, cr_evd: "EVD", backlog: int) -> None:
        ia._check()
        if not isinstance(cr_evd, EVD):
            raise InvalidParameter(f"cr_evd must be an EVD, not {type(cr_evd).__name__}")
        cr_evd._check()
        if cr_evd._ia is not ia:
            raise InvalidParameter("cr_evd belongs to another IA")
        if not cr_evd.streams & EvdFlags.CR:
            raise InvalidParameter("cr_evd does not accept the CR (connection request) stream")
        if not isinstance(backlog, int) or isinstance(backlog, bool) or not 1 <= backlog <= 0x7FFFFFFF:  # (a C int)
            raise InvalidParameter(f"backlog must be an int between 1 and {0x7FFFFFFF}, got {backlog!r}")
        addr = listen_address(ia, port)
        super().__init__(ia)
        self.cr_evd = cr_evd
        self._listen(ia, addr, port, lib.RDMA_PS_TCP, backlog, "port")

    def _on_request(self, cm_id: Any, pdata: bytes, responder: int, initiator: int,
                    addresses: Tuple[Optional[Tuple[str, int]], Optional[Tuple[str, int]]]) -> None:
        cr = CR(self, cm_id, pdata, responder, initiator, addresses)
        self.cr_evd._push(ConnectionRequestEvent._made(self.cr_evd, cr, self))

    def query(self) -> Dict[str, Any]:
        """Return the PSP's parameters (dat_psp_query): ia, port, address, cr_evd."""
        self._check()
        return {"ia": self._ia, "port": self.port, "address": self.address, "cr_evd": self.cr_evd}


#: why rdma_cm refuses to answer a request: the kernel drops the events of a request not yet
#: accepted, so a peer's give-up shows only when the accept is refused
_GONE = ("the connection request is gone: most likely its peer gave it up before it was answered (its "
         "connect timed out or was cancelled, or its process ended)")


class CR(Handle):
    """A connection request (DAT_CR_HANDLE): answer it with :meth:`accept` or :meth:`reject`, once."""

    _kind = "cr"

    def __init__(self, psp: PSP, cm_id: Any, pdata: bytes, responder: int, initiator: int,
                 addresses: Tuple[Optional[Tuple[str, int]], Optional[Tuple[str, int]]]) -> None:
        super().__init__(psp)
        self.psp = psp
        self._ia = psp._ia
        self._cm_id = cm_id
        self._responder = responder
        self._initiator = initiator
        #: the private data the CM delivered with the request, raw from offset 0 (on IB/RoCE
        #: the whole 56-byte field, zero-filled past what the peer sent)
        self.private_data: bytes = pdata
        local, remote = addresses
        #: the peer's (host, port)
        self.remote_address: Optional[Tuple[str, int]] = remote
        #: our (host, port) the request arrived on
        self.local_address: Optional[Tuple[str, int]] = local
        self._ia._cm.own_id(self, cm_id)

    def accept_nowait(self, ep: "EP", private_data: bytes = b"") -> None:
        """Accept on ``ep`` (dat_cr_accept); ESTABLISHED arrives on the EP's connect_evd."""
        self._accept(ep, private_data, None)

    async def accept(self, ep: "EP", private_data: bytes = b"", timeout: Optional[float] = 10.0) -> None:
        """Accept on ``ep`` and return once the connection is ESTABLISHED.

        ``private_data`` (at most 196 bytes on IB/RoCE) goes on the wire exactly
        as given; the peer receives the CM's zero-filled 196-byte block.
        """
        fut: "asyncio.Future[ConnectionEvent]" = asyncio.get_running_loop().create_future()
        self._accept(ep, private_data, fut, timeout)
        try:
            event = await _await_outcome(ep, fut)
        except asyncio.CancelledError:
            _abandon(ep)
            raise
        _outcome(ep, event, "accept")

    def _accept(self, ep: "EP", private_data: bytes, waiter: Any, timeout: Optional[float] = None) -> None:
        self._check()
        self._refuse_foreign_thread("accept")  # (as reject: before the REP; check_loop lets a loop-less thread by)
        timeout = check_timeout(timeout)  # before the REP goes: a bad one leaves the CR answerable
        if not isinstance(getattr(ep, "_conn", None), Connection):  # an EP (ep.py is above this module)
            raise InvalidParameter(f"accept needs an EP, not {type(ep).__name__}")
        _check_can_connect(ep)
        if ep._ia is not self._ia:
            raise InvalidParameter("the EP belongs to another IA")
        pdata = _private(private_data, ACCEPT_PRIVATE_DATA_MAX, "accept")
        self._ia._cm.watch.check_loop()  # the outcome comes through the channel: InvalidState if another loop owns it
        responder = min(ep.attrs.max_rdma_read_in, self._initiator)
        initiator = min(ep.attrs.max_rdma_read_out, self._responder)
        # The QP must be ready (RTS) before the REP goes: the peer may send once it has it.
        # A failure from here on leaves the QP in ERR, so the EP ends DISCONNECTED (reset() reuses it).
        err = _ready_qp(ep, self._cm_id, responder, initiator)
        if err < 0:  # the request's id took no QP: the QP was not touched
            self.close()
            raise AcceptCompletionError(f"accept: {_GONE} ({os.strerror(-err)}); nothing was sent and the EP is "
                                        "unchanged")
        if err == errno.EXDEV:
            raise InvalidParameter("accepting on an EP of another device than the request's")
        if not err:
            err = _send_conn(ep, self._cm_id, True, pdata, responder, initiator)
        if err:
            ep._to_error(check=False)  # (rdma_accept failed with the QP in RTS: its receives must flush)
            ep._conn.state = EPState.DISCONNECTED
            if err == errno.EINVAL:  # (every argument was checked above)
                self.close()
                raise AcceptCompletionError(f"accept: {_GONE} (rdma_cm: EINVAL); the request is closed, the EP "
                                            "DISCONNECTED (ep.reset() makes it reusable)")
            raise error_from_errno(err, "accepting the connection (rdma_accept)")
        # The request's cm_id now belongs to the EP.
        ep._conn.cm_id, self._cm_id = self._cm_id, ffi.NULL
        self._ia._cm.own_id(ep._conn, ep._conn.cm_id)
        ep._conn.waiter = waiter
        ep._conn.state = EPState.PASSIVE_CONNECTION_PENDING
        self.close()
        _start_timer(ep, timeout, EventType.CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR, "accept")

    def reject(self, private_data: bytes = b"") -> None:
        """Refuse the request (dat_cr_reject); the peer's connect fails with ConnectionRejected.

        ``private_data`` (at most 148 bytes on IB/RoCE) is sent as given; the
        peer's ``ConnectionRejected.private_data`` is the CM's zero-filled block.
        """
        self._check()
        # Another thread is refused before the REJ, not by the close() after it: that left the CR
        # open with no cm_id, and the next accept or reject crashed on it.
        self._refuse_foreign_thread("reject")
        pdata = _private(private_data, REJECT_PRIVATE_DATA_MAX, "reject")
        keep = ffi.new("char[]", pdata) if pdata else ffi.NULL
        lib.rdma_reject(self._cm_id, keep, len(pdata))
        self._ia._cm.destroy_id(self._cm_id)
        self._cm_id = ffi.NULL  # answered: _release must not refuse it a second time
        self.close()

    def _release(self) -> None:
        if self._cm_id != ffi.NULL:  # never answered: refuse it
            lib.rdma_reject(self._cm_id, ffi.NULL, 0)
            self._ia._cm.destroy_id(self._cm_id)
            self._cm_id = ffi.NULL

    def __repr__(self) -> str:
        return f"<aiodat.CR from {self.remote_address}{' answered' if self._closed else ''}>"
