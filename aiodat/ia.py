"""The registry, the Interface Adapter (dat_ia_open/close/query) and the factory of everything in it.

The IA is the top of the core layers (docs/architecture.md): ``ia.create_pz``,
``create_evd``, ``create_ep`` (a :class:`aiodat.datagram.DatagramEP` for UD),
``create_psp`` and ``create_srq`` make the objects of the lower modules.
``PZ`` lives in memory.py now and is re-exported here.

``list_providers()`` plays ``dat_registry_list_providers``: one entry per RDMA
device port.  ``open_ia(name)`` plays ``dat_ia_open``: it opens the verbs
device, the IA's async EVD (fed by the device's async fd, see evd.py) and its
rdma_cm event channel (see cm.py).  Everything else is created from the IA.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Dict, List, Literal, Mapping, MutableMapping, NamedTuple, Optional, Sequence,
                    Tuple, overload)

from aiodat._handle import Raw, RootHandle
from aiodat._lib import ffi, lib
from aiodat._version import __version__
from aiodat.attrs import build_ia_query, default_provider_consts
from aiodat.cm import PSP, CMChannel
from aiodat.datagram import DatagramEP
from aiodat.ep import EP
from aiodat.epattr import EPAttr, ServiceType
from aiodat.evd import EVD, AsyncSource, EvdFlags
from aiodat.memory import PZ
from aiodat.netdev import port_addresses, same_address
from aiodat.errors import (
    InvalidHandle,
    InvalidParameter,
    ProviderNotFound,
    error_from_errno,
)
from aiodat.srq import SRQ

if TYPE_CHECKING:
    from aiodat.attrs import IAQuery
    from aiodat.evd import (ConnectionEvent, ConnectionRequestEvent, DTOCompletionEvent, Event, RMRBindEvent,
                            SoftwareEvent)

__all__ = ["IA", "PZ", "Provider", "list_providers", "open_ia", "port_state_name", "RO_AWARE_PREFIX"]

#: the prefix an application puts before an IA name to say it copes with relaxed ordering
RO_AWARE_PREFIX = "RO_AWARE_"

_LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}


@dataclass(frozen=True)
class Provider:
    """One entry of :func:`list_providers`: a device port that ``open_ia`` can open."""

    name: str  #: the name to pass to open_ia, e.g. "rxe0" (port 1) or "rxe0:2"
    device: str  #: the verbs device name
    port: int  #: the port number (1-based)
    link_layer: str  #: "Ethernet" (RoCE), "InfiniBand" or "Unspecified"
    state: str  #: port state as ibv_devinfo prints it, e.g. "PORT_ACTIVE"
    gids: Tuple[str, ...]  #: the port's valid GIDs, IPv6 notation
    #: the IP addresses of the port's netdevs (IPoIB on InfiniBand), IPv4 first, then IPv6
    addresses: Tuple[str, ...] = ()
    #: each of ``gids``' index in the port's GID table (RoCE tables have holes)
    gid_indexes: Tuple[int, ...] = ()

    @property
    def address(self) -> Optional[str]:
        """The address ``open_ia`` picks by default (the first of ``addresses``); None if the port has none."""
        return self.addresses[0] if self.addresses else None


_PORT_STATES = ("PORT_NOP", "PORT_DOWN", "PORT_INIT", "PORT_ARMED", "PORT_ACTIVE", "PORT_ACTIVE_DEFER")


def port_state_name(state: int) -> str:
    """The ibv_port_state name of a port state, as ibv_devinfo prints it ("PORT_ACTIVE")."""
    return _PORT_STATES[state] if 0 <= state < len(_PORT_STATES) else f"PORT_STATE_{state}"


def _text(cdata: Any) -> str:
    return ffi.string(cdata).decode(errors="replace")


def _gids(context: Any, port: int, table_len: int, ports: int) -> Dict[int, str]:
    """The port's valid GIDs by table index (in index order), IPv6 notation; ``ports`` is the
    device's port count."""
    buf = ffi.new("char[64]")
    out = {}
    indexes, gids = ffi.new("int[]", max(table_len, 1)), ffi.new("union ibv_gid[]", max(table_len, 1))
    count = lib.aiodat_port_gids(context, port, table_len, ports, indexes, gids)
    if count >= 0:  # the whole table in one call
        for i in sorted(range(count), key=indexes.__getitem__):
            lib.aiodat_gid_str(gids + i, buf, 64)
            out[indexes[i]] = _text(buf)
        return out
    return _gids_one_by_one(context, port, table_len)


def _gids_one_by_one(context: Any, port: int, table_len: int) -> Dict[int, str]:
    """_gids for a kernel without the table query: ibv_query_gid, index by index."""
    buf = ffi.new("char[64]")
    out = {}
    gid = ffi.new("union ibv_gid *")
    for index in range(table_len):
        if lib.ibv_query_gid(context, port, index, gid):
            break
        if not any(gid.raw[0:16]):
            continue  # an empty slot; RoCE tables are sparse
        lib.aiodat_gid_str(gid, buf, 64)
        out[index] = _text(buf)
    return out


def _struct_dict(cdata: Any, ctype: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, field in ffi.typeof(ctype).fields:
        value = getattr(cdata, name)
        if field.type.kind == "array":
            value = _text(value)
        out[name] = value
    return out


class _DeviceList:
    """The verbs device list, freed on exit (ibv_get_device_list/free)."""

    def __enter__(self) -> List[Any]:
        count = ffi.new("int *")
        self._list = lib.ibv_get_device_list(count)
        if self._list == ffi.NULL:
            err = ffi.errno
            if err == 38:  # ENOSYS: no uverbs in this kernel at all
                return []
            raise error_from_errno(err, "listing RDMA devices")
        return [self._list[i] for i in range(count[0])]

    def __exit__(self, *exc: object) -> None:
        if self._list != ffi.NULL:
            lib.ibv_free_device_list(self._list)


def list_providers() -> List[Provider]:
    """Return one :class:`Provider` per port of every RDMA device (dat_registry_list_providers).

    The bare device name opens port 1; ``"dev:N"`` opens port N.  An empty list
    means this machine has no RDMA device (run under ``aiodat rxe run`` for one).
    """
    providers: List[Provider] = []
    with _DeviceList() as devices:
        for dev in devices:
            name = _text(lib.ibv_get_device_name(dev))
            context = lib.ibv_open_device(dev)
            if context == ffi.NULL:
                continue
            try:
                attr = ffi.new("struct ibv_device_attr *")
                if lib.ibv_query_device(context, attr):
                    continue
                for port in range(1, attr.phys_port_cnt + 1):
                    pattr = ffi.new("struct ibv_port_attr *")
                    if lib.ibv_query_port(context, port, pattr):
                        continue
                    gids = _gids(context, port, pattr.gid_tbl_len, attr.phys_port_cnt)
                    providers.append(
                        Provider(
                            name=name if port == 1 else f"{name}:{port}",
                            device=name,
                            port=port,
                            link_layer=_LINK_LAYERS.get(pattr.link_layer, str(pattr.link_layer)),
                            state=port_state_name(pattr.state),
                            gids=tuple(gids.values()),
                            addresses=tuple(port_addresses(name, port, gids)),
                            gid_indexes=tuple(gids),
                        )
                    )
            finally:
                lib.ibv_close_device(context)
    return providers


#: the environment variables that name the device (``aiodat rxe run`` sets both): see :func:`environment_port`
DEVICE_ENV, ADDRESS_ENV = "AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"


class EnvironmentPort(NamedTuple):
    """What :func:`environment_port` found: the IA name, its address, and the test bed's netdev
    (``$AIODAT_RXE_NETDEV``, only when the environment named both device and address)."""

    name: str
    address: str
    netdev: Optional[str] = None


def environment_port(environ: Optional[Mapping[str, str]] = None) -> Optional[EnvironmentPort]:
    """The device port the environment names, else the first active port with an IP address.

    The one reading of ``$AIODAT_RXE_DEVICE`` and ``$AIODAT_RXE_ADDR`` for the CLI, the
    benchmarks and the pytest plugin.  Both set (``aiodat rxe run`` sets both): taken as given,
    nothing is opened.  ``AIODAT_RXE_DEVICE`` alone: the active port of that name (``rxe0``,
    ``rxe0:1`` and ``RO_AWARE_rxe0`` all name port 1 of rxe0), with its first address;
    ``AIODAT_RXE_ADDR`` alone: the active port with that address.  Neither: the first active
    port with an address, or None when there is none.  A variable that names no active port
    with an address raises :class:`aiodat.ProviderNotFound` naming the variable, its value and
    the ports that exist (it used to be ignored, and the first port used instead).
    """
    env = os.environ if environ is None else environ
    name, addr = env.get(DEVICE_ENV) or None, env.get(ADDRESS_ENV) or None
    if name and addr:
        return EnvironmentPort(name, addr, env.get("AIODAT_RXE_NETDEV"))
    every = list_providers()
    for provider in every:
        if provider.state != "PORT_ACTIVE" or not provider.addresses:
            continue
        if name is not None:
            if _names_port(name, provider):
                return EnvironmentPort(name, provider.addresses[0])
        elif addr is not None:
            for address in provider.addresses:
                if same_address(address, addr):
                    return EnvironmentPort(provider.name, address)
        else:
            return EnvironmentPort(provider.name, provider.addresses[0])
    if name is None and addr is None:
        return None
    ports = "; ".join(f"{p.name} ({p.state}, {', '.join(p.addresses) or 'no IP address'})" for p in every)
    what = f"{DEVICE_ENV}={name}" if name is not None else f"{ADDRESS_ENV}={addr}"
    raise ProviderNotFound(f"no active port matches {what} (set in the environment); the RDMA ports here: "
                           + (ports or "none (run under `aiodat rxe run`)"))


def _names_port(name: str, provider: Provider) -> bool:
    """Whether the IA name ``name`` opens ``provider``'s port, as open_ia reads it."""
    try:
        device, port, _ = _parse_name(name)
    except InvalidParameter:  # (not an IA name: it names no port)
        return False
    return device == provider.device and port == provider.port


def _parse_name(name: str) -> Tuple[str, int, bool]:
    """Split an IA name into (device, port, ro_aware)."""
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"IA name must be a non-empty string, got {name!r}")
    ro_aware = name.startswith(RO_AWARE_PREFIX)
    if ro_aware:
        name = name[len(RO_AWARE_PREFIX):]
    device, sep, port_text = name.partition(":")
    port = 1
    if sep:
        if not (port_text.isascii() and port_text.isdecimal()) or int(port_text) < 1:  # ('²' is a digit)
            raise InvalidParameter(f"IA name {name!r}: the port after ':' must be a number >= 1")
        port = int(port_text)
    return device, port, ro_aware


def _choose_address(name: str, addresses: Sequence[str], wanted: Optional[str]) -> Optional[str]:
    """The IA's address: ``wanted`` if it is one of the port's, else the first (IPv4 before IPv6)."""
    if wanted is None:
        return addresses[0] if addresses else None
    if not isinstance(wanted, str):
        raise InvalidParameter(f"address must be an IP address string, not {type(wanted).__name__}")
    for address in addresses:
        if same_address(address, wanted):
            return address
    raise InvalidParameter(f"{wanted!r} is not an address of {name}; its netdevs have: "
                           + (", ".join(addresses) or "none (give one of its netdevs an IP address)"))


class IA(RootHandle):
    """An open Interface Adapter: one port of an RDMA device (dat_ia_open).

    Use as ``with`` / ``async with``; ``close()`` frees every object created
    from it, endpoints before event dispatchers before memory.
    """

    _kind = "ia"

    def __init__(self, name: str, async_evd_qlen: int = 8, async_evd: Optional["EVD"] = None,
                 address: Optional[str] = None) -> None:
        device, port, ro_aware = _parse_name(name)
        if not isinstance(async_evd_qlen, int) or isinstance(async_evd_qlen, bool) or async_evd_qlen < 1:
            raise InvalidParameter(f"async_evd_qlen must be an int >= 1, got {async_evd_qlen!r}")
        self._context: Any = ffi.NULL
        super().__init__(None)
        self.name = name
        #: the device and port this IA drives
        self.device_name = device
        self.port = port
        #: True when opened as RO_AWARE_<name>: the application accepts relaxed ordering
        self.ro_aware = ro_aware
        with _DeviceList() as devices:
            names = [_text(lib.ibv_get_device_name(d)) for d in devices]
            if device not in names:
                existing = [p.name for p in list_providers()]
                self._closed = True
                raise ProviderNotFound(
                    f"no RDMA device named {device!r}; open_ia accepts: "
                    + (", ".join(existing) if existing else "none (this machine has no RDMA device; "
                       "run under `aiodat rxe run`)")
                )
            self._context = lib.ibv_open_device(devices[names.index(device)])
        if self._context == ffi.NULL:
            self._closed = True
            raise error_from_errno(ffi.errno, f"opening RDMA device {device}")
        #: every verbs object of this IA holds this (through its parents): the context goes last
        self._raw = Raw(self._context, lib.ibv_close_device, "device context")
        try:
            self._device_attr = ffi.new("struct ibv_device_attr *")
            err = lib.ibv_query_device(self._context, self._device_attr)
            if err:  # (verbs returns the error number; errno may be stale)
                raise error_from_errno(err, f"querying RDMA device {device}")
            if port > self._device_attr.phys_port_cnt:
                raise ProviderNotFound(
                    f"{device} has {self._device_attr.phys_port_cnt} port(s); there is no port {port}"
                )
            pattr = self._port_attr()
            self._link_layer: int = pattr.link_layer  # a port's is fixed; readying each connection needs it
            gids = _gids(self._context, port, pattr.gid_tbl_len, self._device_attr.phys_port_cnt)
            #: every IP address of the port's netdevs (IPoIB on InfiniBand), IPv4 first
            self.addresses: Tuple[str, ...] = tuple(port_addresses(device, port, gids))
            #: the IA's address: PSPs listen on it and connections leave from it
            self.address: Optional[str] = _choose_address(name, self.addresses, address)
            # weak: an object the program dropped is routed nothing (and can be collected)
            self._qpn_owner: "MutableMapping[int, EP]" = weakref.WeakValueDictionary()  # completions, QP events
            self._valid_epattr: Optional[EPAttr] = None  # the EPAttr last validated on this device (ep.py)
            self._comp_vectors_used = -1  # EVDs take the device's completion vectors in turn
            self._cq_owner: "MutableMapping[int, EVD]" = weakref.WeakValueDictionary()  # CQ async events
            self._srq_owner: "MutableMapping[int, SRQ]" = weakref.WeakValueDictionary()  # SRQ async events
            self._async_source = AsyncSource(self)
            if async_evd is None:
                self.async_evd: EVD = EVD._create_async(self, async_evd_qlen)
            else:
                if not isinstance(async_evd, EVD) or not async_evd._is_async or async_evd.closed:
                    raise InvalidHandle("async_evd must be an open asynchronous EVD of another IA")
                if async_evd._ia.device_name != device:
                    raise InvalidHandle(
                        f"async_evd belongs to an IA of {async_evd._ia.device_name}, not {device}"
                    )
                self.async_evd = async_evd
                async_evd._sharers.add(self)  # its waits now watch this IA's async fd too
            self._cm = CMChannel(self)
        except BaseException:
            self._discard()
            raise

    # -- internals used by the other modules ------------------------------
    def _port_attr(self) -> Any:
        pattr = ffi.new("struct ibv_port_attr *")
        err = lib.ibv_query_port(self._context, self.port, pattr)
        if err:  # (verbs returns the error number; errno may be stale)
            raise error_from_errno(err, f"querying port {self.port} of {self.device_name}")
        return pattr

    def _pump(self) -> None:
        """Read whatever the CM channel and the async fd hold (no waiting)."""
        if not self._closed:
            self._cm.drain()
            self._async_source.drain()

    def _serving_loop(self) -> Any:
        """The loop that watches the IA's fds (every wait on its objects makes it watch them)."""
        cm = getattr(self, "_cm", None)  # (None while the IA is being opened)
        return cm.watch._owner if cm is not None else None

    def _attach_loop(self) -> None:
        """Let the running loop watch the IA's CM channel and async fd."""
        self._cm.watch.attach()
        self._async_source.watch.attach()

    def _release(self) -> None:
        shared = getattr(self, "async_evd", None)
        if shared is not None:
            shared._sharers.discard(self)
        if getattr(self, "_cm", None) is not None:
            self._cm.destroy()
        if getattr(self, "_async_source", None) is not None:
            self._async_source.destroy()
        if self._context != ffi.NULL:
            self._raw.release()
            self._context = ffi.NULL

    # -- DAT calls ---------------------------------------------------------
    def query(self) -> "IAQuery":
        """Return the IA and Provider attributes (dat_ia_query).

        Every attribute is returned at once, so DAT's ``ia_attr_mask`` and
        ``provider_attr_mask`` arguments are unnecessary.  Values the device
        cannot tell are None (DAT_VALUE_UNKNOWN).
        """
        self._check()
        pattr = self._port_attr()
        return build_ia_query(
            ia_name=self.name,
            device_name=self.device_name,
            port_num=self.port,
            device_attr=_struct_dict(self._device_attr, "struct ibv_device_attr"),
            port_attr=_struct_dict(pattr, "struct ibv_port_attr"),
            # (index, gid) pairs: the entries keep their table index, holes and all
            gids=list(_gids(self._context, self.port, pattr.gid_tbl_len, self._device_attr.phys_port_cnt).items()),
            ia_address=self.address,
            provider_consts=_provider_consts(__version__),
        )

    def create_pz(self) -> "PZ":
        """Create a Protection Zone (dat_pz_create)."""
        self._check()
        return PZ(self)

    # For a type checker: an EVD of one stream yields that stream's events only (see EVD)
    @overload
    def create_evd(self, qlen: int, streams: Literal[EvdFlags.DTO], comp_vector: Optional[int] = None, *,
                   busy_poll_us: int = 0) -> "EVD[DTOCompletionEvent]": ...
    @overload
    def create_evd(self, qlen: int, streams: Literal[EvdFlags.CR], comp_vector: Optional[int] = None, *,
                   busy_poll_us: int = 0) -> "EVD[ConnectionRequestEvent]": ...
    @overload
    def create_evd(self, qlen: int, streams: Literal[EvdFlags.CONNECTION], comp_vector: Optional[int] = None, *,
                   busy_poll_us: int = 0) -> "EVD[ConnectionEvent]": ...
    @overload
    def create_evd(self, qlen: int, streams: Literal[EvdFlags.RMR_BIND], comp_vector: Optional[int] = None, *,
                   busy_poll_us: int = 0) -> "EVD[RMRBindEvent]": ...
    @overload
    def create_evd(self, qlen: int, streams: Literal[EvdFlags.SOFTWARE], comp_vector: Optional[int] = None, *,
                   busy_poll_us: int = 0) -> "EVD[SoftwareEvent]": ...
    @overload
    def create_evd(self, qlen: int, streams: Optional["EvdFlags"] = None, comp_vector: Optional[int] = None, *,
                   busy_poll_us: int = 0) -> "EVD[Event]": ...

    def create_evd(self, qlen: int, streams: Optional["EvdFlags"] = None,
                   comp_vector: Optional[int] = None, *, busy_poll_us: int = 0) -> "EVD[Any]":
        """Create an Event Dispatcher of at least ``qlen`` entries fed by ``streams`` (dat_evd_create).

        ``streams`` defaults to every stream (DTO, RMR bind, connection,
        connection request, software): aiodat merges any of them in one EVD.
        ``comp_vector`` picks the completion vector (interrupt) of its CQ; by
        default EVDs are spread over the device's vectors in turn.
        ``busy_poll_us`` (like Linux's SO_BUSY_POLL): after its last
        completion the EVD keeps polling its CQ for up to that many
        microseconds before it arms the CQ and sleeps, in short slices that
        yield to the loop (see docs/events.md, "Busy polling"); an EVD of
        neither the DTO nor the RMR_BIND stream has no CQ, and refuses it.
        """
        self._check()
        return EVD(self, qlen, streams, comp_vector=comp_vector, busy_poll_us=busy_poll_us)

    def _next_comp_vector(self) -> int:
        """The next completion vector in turn, so CQs spread over the device's interrupts."""
        vectors = max(1, self._context.num_comp_vectors)
        self._comp_vectors_used += 1
        return self._comp_vectors_used % vectors

    def create_ep(
        self,
        pz: "PZ",
        recv_evd: Optional["EVD"] = None,
        request_evd: Optional["EVD"] = None,
        connect_evd: Optional["EVD"] = None,
        srq: Optional["SRQ"] = None,
        attrs: Optional["EPAttr"] = None,
    ) -> "EP":
        """Create an Endpoint (a queue pair) in ``pz`` (dat_ep_create).

        An EVD left out is created for the EP (sized from ``attrs``) and freed with it; its own
        connect EVD is made when first needed (``ep.connect_evd``, or an event with no task awaiting it).
        An EVD passed in that is shared with other EPs is grown if the queues of
        everything feeding it would not fit (docs/events.md).  With
        ``EPAttr(service_type=ServiceType.UD)`` the EP is a
        :class:`aiodat.datagram.DatagramEP`.
        """
        self._check()
        cls = DatagramEP if isinstance(attrs, EPAttr) and attrs.service_type is ServiceType.UD else EP
        return cls(self, pz, recv_evd, request_evd, connect_evd, srq, attrs)

    def create_psp(self, port: int, cr_evd: "EVD", backlog: int = 128) -> "PSP":
        """Listen for connection requests on ``port`` (dat_psp_create); they arrive on ``cr_evd``."""
        self._check()
        return PSP(self, port, cr_evd, backlog)

    def create_psp_any(self, cr_evd: "EVD", backlog: int = 128) -> "PSP":
        """Listen on a port the provider picks (dat_psp_create_any); see ``psp.port``."""
        self._check()
        return PSP(self, 0, cr_evd, backlog)

    def create_srq(
        self, pz: "PZ", max_recv_dtos: int, max_recv_iov: int = 1, low_watermark: Optional[int] = None
    ) -> "SRQ":
        """Create a Shared Receive Queue (dat_srq_create)."""
        self._check()
        return SRQ(self, pz, max_recv_dtos, max_recv_iov, low_watermark)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.device_name} port {self.port}"
        return f"<aiodat.IA {self.name!r} {state}>"


def _provider_consts(version: str) -> Dict[str, Any]:
    return default_provider_consts(version)


def open_ia(name: str, async_evd_qlen: int = 8, async_evd: Optional["EVD"] = None,
            address: Optional[str] = None) -> IA:
    """Open an Interface Adapter by name (dat_ia_open).

    The IA's ``address`` is the port's IP address rdma_cm uses: PSPs listen on
    it and connections leave from it.  By default it is the first of
    ``ia.addresses`` (the port's netdevs' addresses, IPoIB included; IPv4
    before IPv6); ``address=`` names another one (IPv6 too, link-local as
    ``"fe80::1%netdev"``), and raises InvalidParameter listing the port's
    addresses if it is not one of them.

    ``name`` comes from :func:`list_providers` (``"rxe0"``, ``"rxe0:1"``); a
    ``RO_AWARE_`` prefix is removed and marks the application as coping with
    relaxed ordering (aiodat never enables relaxed ordering otherwise, so the
    plain name always opens).  ``async_evd`` shares an existing asynchronous
    EVD of another IA of the same device instead of creating one of
    ``async_evd_qlen`` entries.  Raises :class:`aiodat.ProviderNotFound` (a
    LookupError) listing the names that exist when ``name`` is unknown.
    """
    return IA(name, async_evd_qlen, async_evd, address)
