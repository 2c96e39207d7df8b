"""IA and Provider attributes (``dat_ia_query``), built from verbs query results.

:func:`build_ia_query` turns what ``ibv_query_device`` / ``ibv_query_port`` /
``ibv_query_gid`` returned (as plain dicts, see its docstring) plus what
aiodat itself supports (``provider_consts``) into an :class:`IAQuery`:

* :class:`IAAttr`: every ``DAT_IA_ATTR`` member of seed 000 / DAT 2.0, named
  as the member in snake_case (``max_eps``, ``max_dto_per_ep``, ...);
* :class:`ProviderAttr`: every ``DAT_PROVIDER_ATTR`` member;
* :class:`TransportAttr` (``ia_attr.transport_attr``): every field of
  ``struct ibv_device_attr`` under its C name, the port's
  ``struct ibv_port_attr`` as a nested :class:`PortAttr` (``.port``), decoded
  names (cap flags, atomic_cap, port state, MTU in bytes, link layer, GUIDs
  formatted as ``ibv_devinfo`` prints them) and the port's GIDs.

Conventions:

* A value the device cannot tell is ``None`` (DAT_VALUE_UNKNOWN).
* DAT enumerations are plain strings holding the DAT constant name
  (``"DAT_IOV_CONSUMER"``); DAT unions of flags are ``frozenset``\\ s of such
  names (``{"DAT_COMPLETION_SUPPRESS_FLAG", ...}``).  The valid names are in
  the tuples ``IOV_OWNERSHIPS``, ``COMPLETION_FLAGS``, ... below.
* DAT_NAMED_ATTR arrays (vendor and provider-specific attributes) are tuples
  of :class:`NamedAttr` ``(name, value)`` pairs, values as strings.
* DAT masks are not needed: aiodat always returns every attribute.
"""
from __future__ import annotations

import dataclasses
import re
import socket
import sys
from dataclasses import dataclass
from typing import (
    Any,
    ClassVar,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from .errors import InvalidParameter

__all__ = [
    "NamedAttr",
    "GIDEntry",
    "PortAttr",
    "TransportAttr",
    "IAAttr",
    "ProviderAttr",
    "IAQuery",
    "build_ia_query",
    "default_provider_consts",
    "DEVICE_ATTR_FIELDS",
    "PORT_ATTR_FIELDS",
    "PROVIDER_CONST_KEYS",
    "EVD_STREAMS",
    "MEM_TYPES",
    "IOV_OWNERSHIPS",
    "QOS_NAMES",
    "COMPLETION_FLAGS",
    "EP_CREATORS",
    "PZ_SUPPORTS",
    "RMR_SCOPES",
    "EXTENSIONS",
    "HA_LB_NAMES",
    "DEVICE_CAP_FLAGS",
    "PORT_CAP_FLAGS",
    "PORT_CAP_FLAGS2",
    "normalize_gid",
    "format_guid",
    "guid_from_be64",
    "guid_to_be64",
]

# frozen + slots where the interpreter allows it (slots needs Python 3.10)
_DATACLASS: Dict[str, Any] = {"frozen": True}
if sys.version_info >= (3, 10):
    _DATACLASS["slots"] = True

# --- verbs names ----------------------------------------------------------

#: the fields of ``struct ibv_device_attr`` (seed 003), in C order
DEVICE_ATTR_FIELDS: Tuple[str, ...] = (
    "fw_ver", "node_guid", "sys_image_guid", "max_mr_size", "page_size_cap",
    "vendor_id", "vendor_part_id", "hw_ver", "max_qp", "max_qp_wr",
    "device_cap_flags", "max_sge", "max_sge_rd", "max_cq", "max_cqe", "max_mr",
    "max_pd", "max_qp_rd_atom", "max_ee_rd_atom", "max_res_rd_atom",
    "max_qp_init_rd_atom", "max_ee_init_rd_atom", "atomic_cap", "max_ee",
    "max_rdd", "max_mw", "max_raw_ipv6_qp", "max_raw_ethy_qp", "max_mcast_grp",
    "max_mcast_qp_attach", "max_total_mcast_qp_attach", "max_ah", "max_fmr",
    "max_map_per_fmr", "max_srq", "max_srq_wr", "max_srq_sge", "max_pkeys",
    "local_ca_ack_delay", "phys_port_cnt",
)

#: the fields of ``struct ibv_port_attr`` (ibv_query_port), in C order
PORT_ATTR_FIELDS: Tuple[str, ...] = (
    "state", "max_mtu", "active_mtu", "gid_tbl_len", "port_cap_flags",
    "max_msg_sz", "bad_pkey_cntr", "qkey_viol_cntr", "pkey_tbl_len", "lid",
    "sm_lid", "lmc", "max_vl_num", "sm_sl", "subnet_timeout", "init_type_reply",
    "active_width", "active_speed", "phys_state", "link_layer", "flags",
    "port_cap_flags2",
)
_PORT_ATTR_OPTIONAL: Tuple[str, ...] = ("active_speed_ex",)

#: ``enum ibv_device_cap_flags``: (bit, name as ibv_devinfo prints it)
DEVICE_CAP_FLAGS: Tuple[Tuple[int, str], ...] = (
    (1 << 0, "RESIZE_MAX_WR"),
    (1 << 1, "BAD_PKEY_CNTR"),
    (1 << 2, "BAD_QKEY_CNTR"),
    (1 << 3, "RAW_MULTI"),
    (1 << 4, "AUTO_PATH_MIG"),
    (1 << 5, "CHANGE_PHY_PORT"),
    (1 << 6, "UD_AV_PORT_ENFORCE"),
    (1 << 7, "CURR_QP_STATE_MOD"),
    (1 << 8, "SHUTDOWN_PORT"),
    (1 << 9, "INIT_TYPE"),
    (1 << 10, "PORT_ACTIVE_EVENT"),
    (1 << 11, "SYS_IMAGE_GUID"),
    (1 << 12, "RC_RNR_NAK_GEN"),
    (1 << 13, "SRQ_RESIZE"),
    (1 << 14, "N_NOTIFY_CQ"),
    (1 << 17, "MEM_WINDOW"),
    (1 << 18, "UD_IP_CSUM"),
    (1 << 20, "XRC"),
    (1 << 21, "MEM_MGT_EXTENSIONS"),
    (1 << 23, "MEM_WINDOW_TYPE_2A"),
    (1 << 24, "MEM_WINDOW_TYPE_2B"),
    (1 << 25, "RC_IP_CSUM"),
    (1 << 26, "RAW_IP_CSUM"),
    (1 << 29, "MANAGED_FLOW_STEERING"),
)

#: ``enum ibv_port_cap_flags``: (bit, name without the IBV_PORT_ prefix)
PORT_CAP_FLAGS: Tuple[Tuple[int, str], ...] = (
    (1 << 1, "SM"),
    (1 << 2, "NOTICE_SUP"),
    (1 << 3, "TRAP_SUP"),
    (1 << 4, "OPT_IPD_SUP"),
    (1 << 5, "AUTO_MIGR_SUP"),
    (1 << 6, "SL_MAP_SUP"),
    (1 << 7, "MKEY_NVRAM"),
    (1 << 8, "PKEY_NVRAM"),
    (1 << 9, "LED_INFO_SUP"),
    (1 << 11, "SYS_IMAGE_GUID_SUP"),
    (1 << 12, "PKEY_SW_EXT_PORT_TRAP_SUP"),
    (1 << 14, "EXTENDED_SPEEDS_SUP"),
    (1 << 15, "CAP_MASK2_SUP"),
    (1 << 16, "CM_SUP"),
    (1 << 17, "SNMP_TUNNEL_SUP"),
    (1 << 18, "REINIT_SUP"),
    (1 << 19, "DEVICE_MGMT_SUP"),
    (1 << 20, "VENDOR_CLASS_SUP"),
    (1 << 21, "DR_NOTICE_SUP"),
    (1 << 22, "CAP_MASK_NOTICE_SUP"),
    (1 << 23, "BOOT_MGMT_SUP"),
    (1 << 24, "LINK_LATENCY_SUP"),
    (1 << 25, "CLIENT_REG_SUP"),
    (1 << 26, "IP_BASED_GIDS"),
)

#: ``enum ibv_port_cap_flags2``: (bit, name without the IBV_PORT_ prefix)
PORT_CAP_FLAGS2: Tuple[Tuple[int, str], ...] = (
    (1 << 0, "SET_NODE_DESC_SUP"),
    (1 << 1, "INFO_EXT_SUP"),
    (1 << 2, "VIRT_SUP"),
    (1 << 3, "SWITCH_PORT_STATE_TABLE_SUP"),
    (1 << 4, "LINK_WIDTH_2X_SUP"),
    (1 << 5, "LINK_SPEED_HDR_SUP"),
    (1 << 10, "LINK_SPEED_NDR_SUP"),
    (1 << 12, "LINK_SPEED_XDR_SUP"),
)

_ATOMIC_CAP_NAMES = {0: "ATOMIC_NONE", 1: "ATOMIC_HCA", 2: "ATOMIC_GLOB"}
_PORT_STATE_NAMES = {
    0: "PORT_NOP", 1: "PORT_DOWN", 2: "PORT_INIT", 3: "PORT_ARMED",
    4: "PORT_ACTIVE", 5: "PORT_ACTIVE_DEFER",
}
# as ibv_devinfo prints them (its spelling)
_PHYS_STATE_NAMES = {
    1: "SLEEP", 2: "POLLING", 3: "DISABLED", 4: "PORT_CONFIGURATION TRAINNING",
    5: "LINK_UP", 6: "LINK_ERROR_RECOVERY", 7: "PHY TEST",
}
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
# ibv_devinfo shows IBV_LINK_LAYER_UNSPECIFIED (0) as InfiniBand too
_LINK_LAYER_NAMES = {0: "InfiniBand", 1: "InfiniBand", 2: "Ethernet"}
_WIDTH_NAMES = {1: "1X", 2: "4X", 4: "8X", 8: "12X", 16: "2X"}
_SPEED_NAMES = {
    1: "2.5 Gbps", 2: "5.0 Gbps", 4: "10.0 Gbps", 8: "10.0 Gbps", 16: "14.0 Gbps",
    32: "25.0 Gbps", 64: "50.0 Gbps", 128: "100.0 Gbps", 256: "200.0 Gbps",
}
_TRANSPORTS = ("InfiniBand", "iWARP", "usNIC", "usNIC UDP", "unspecified")

# ibv_device_attr.vendor_id (an IEEE OUI or a PCI vendor ID, by driver) -> vendor name.
# rxe reports 0xffffff, which is no vendor: vendor_name is then None.
_VENDOR_NAMES = {
    0x0002C9: "Mellanox Technologies",
    0x001175: "QLogic",
    0x001077: "QLogic",
    0x001425: "Chelsio Communications",
    0x008086: "Intel",
    0x0014E4: "Broadcom",
    0x0019E5: "Huawei",
    0x001D0F: "Amazon",
}

# --- DAT names ------------------------------------------------------------

#: the six DAT event streams, in the row/column order of evd_stream_merging_supported
EVD_STREAMS: Tuple[str, ...] = (
    "DAT_EVD_SOFTWARE_FLAG",
    "DAT_EVD_CR_FLAG",
    "DAT_EVD_DTO_FLAG",
    "DAT_EVD_CONNECTION_FLAG",
    "DAT_EVD_RMR_BIND_FLAG",
    "DAT_EVD_ASYNC_FLAG",
)
#: DAT_MEM_TYPE names (lmr_mem_types_supported holds a subset)
MEM_TYPES: Tuple[str, ...] = ("DAT_MEM_TYPE_VIRTUAL", "DAT_MEM_TYPE_LMR", "DAT_MEM_TYPE_SHARED_VIRTUAL")
#: DAT_IOV_OWNERSHIP names
IOV_OWNERSHIPS: Tuple[str, ...] = ("DAT_IOV_CONSUMER", "DAT_IOV_PROVIDER_NOMOD", "DAT_IOV_PROVIDER_MOD")
#: DAT_QOS names (dat_qos_supported holds a subset)
QOS_NAMES: Tuple[str, ...] = (
    "DAT_QOS_BEST_EFFORT", "DAT_QOS_HIGH_THROUGHPUT", "DAT_QOS_LOW_LATENCY",
    "DAT_QOS_ECONOMY", "DAT_QOS_PREMIUM",
)
#: DAT_COMPLETION_FLAGS names (completion_flags_supported holds a subset; DEFAULT is 0 and implied)
COMPLETION_FLAGS: Tuple[str, ...] = (
    "DAT_COMPLETION_SUPPRESS_FLAG",
    "DAT_COMPLETION_SOLICITED_WAIT_FLAG",
    "DAT_COMPLETION_UNSIGNALLED_FLAG",
    "DAT_COMPLETION_BARRIER_FENCE_FLAG",
    "DAT_COMPLETION_EVD_THRESHOLD_FLAG",
)
#: DAT_EP_CREATOR_FOR_PSP names
EP_CREATORS: Tuple[str, ...] = ("DAT_PSP_CREATES_EP_NEVER", "DAT_PSP_CREATES_EP_IFASKED", "DAT_PSP_CREATES_EP_ALWAYS")
#: DAT_PZ_SUPPORT names
PZ_SUPPORTS: Tuple[str, ...] = ("DAT_PZ_UNIQUE", "DAT_PZ_SHAREABLE")
#: DAT_RMR_SCOPE names
RMR_SCOPES: Tuple[str, ...] = ("DAT_RMR_SCOPE_EP", "DAT_RMR_SCOPE_PZ", "DAT_RMR_SCOPE_ANY")
#: DAT_EXTENSION names
EXTENSIONS: Tuple[str, ...] = ("DAT_EXTENSION_NONE", "DAT_EXTENSION_IB", "DAT_EXTENSION_IW")
#: DAT_HA_LB names
HA_LB_NAMES: Tuple[str, ...] = ("DAT_HA_LB_NONE", "DAT_HA_LB_INTERCOMM", "DAT_HA_LB_INTRACOMM")

#: SRQ watermark bits of srq_watermarks_supported (DAT_COUNT bitmask, as uDAPL documents it)
SRQ_WATERMARK_LOW = 0x001
SRQ_WATERMARK_SOFT_HIGH = 0x010
SRQ_WATERMARK_HARD_HIGH = 0x100
#: srq_info_supported bits: which dat_srq_query counters the provider can report
SRQ_INFO_AVAILABLE_DTO_COUNT = 0x01
SRQ_INFO_OUTSTANDING_DTO_COUNT = 0x10

_U64_MAX = (1 << 64) - 1


# --- small types ----------------------------------------------------------


class NamedAttr(NamedTuple):
    """One DAT_NAMED_ATTR entry: an attribute name and its value as a string."""

    name: str
    value: str


@dataclass(**_DATACLASS)
class GIDEntry:
    """One valid entry of a port's GID table.

    ``gid`` is in the text form ``inet_ntop(AF_INET6)`` gives
    (``"fe80::7802:a6ff:fe13:9a74"``, ``"::ffff:169.254.77.1"``);
    ``gid_type`` is e.g. ``"RoCE v2"`` or ``"IB/RoCE v1"`` when known, else None.
    """

    index: int
    gid: str
    gid_type: Optional[str] = None


def _flag_names(value: int, table: Tuple[Tuple[int, str], ...]) -> Tuple[str, ...]:
    names = tuple(name for bit, name in table if value & bit)
    known = 0
    for bit, _ in table:
        known |= bit
    if value & ~known:
        names += (f"0x{value & ~known:X}",)
    return names


def format_guid(guid: int) -> str:
    """Format a GUID number (host order) as ibv_devinfo does: ``"7802:a6ff:fe13:9a74"``."""
    return ":".join(f"{(guid >> shift) & 0xFFFF:04x}" for shift in (48, 32, 16, 0))


def guid_from_be64(raw: int) -> int:
    """Turn a ``__be64`` GUID read from a C struct as a host integer into the GUID number.

    ``struct ibv_device_attr`` holds ``node_guid`` in network byte order; C code
    (and cffi) reading it as ``uint64_t`` gets a byte-swapped number on
    little-endian hosts.  This is ``be64toh``.
    """
    return int.from_bytes((raw & _U64_MAX).to_bytes(8, sys.byteorder), "big")


def guid_to_be64(guid: int) -> int:
    """The inverse of :func:`guid_from_be64` (``htobe64``): the number C would read from the struct."""
    return int.from_bytes((guid & _U64_MAX).to_bytes(8, "big"), sys.byteorder)


def normalize_gid(gid: Union[str, bytes, bytearray, memoryview]) -> str:
    """Return a GID in ``inet_ntop(AF_INET6)`` text form.

    Accepts 16 raw bytes, IPv6 text, or the raw hex form ibv_devinfo prints
    for non-RoCEv2 GIDs (``"fe80:0000:0000:0000:7802:a6ff:fe13:9a74"``).
    """
    if isinstance(gid, (bytes, bytearray, memoryview)):
        raw = bytes(gid)
        if len(raw) != 16:
            raise InvalidParameter(f"a GID is 16 bytes, got {len(raw)}: {raw!r}")
    elif isinstance(gid, str):
        try:
            raw = socket.inet_pton(socket.AF_INET6, gid.strip())
        except (OSError, ValueError):
            raise InvalidParameter(f"not a GID (IPv6 notation expected): {gid!r}") from None
    else:
        raise InvalidParameter(f"a GID must be str or 16 bytes, got {type(gid).__name__}: {gid!r}")
    return socket.inet_ntop(socket.AF_INET6, raw)


# --- the attribute classes ------------------------------------------------


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _as_dict(value)
    if isinstance(value, (frozenset, set)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, NamedAttr):
        return [value.name, value.value]
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    return value


def _as_dict(obj: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in ("vendor_attr", "provider_specific_attr"):
            out[f.name] = {a.name: a.value for a in value}
        elif f.name == "evd_stream_merging_supported":
            out[f.name] = {
                row: {col: bool(value[i][j]) for j, col in enumerate(EVD_STREAMS)}
                for i, row in enumerate(EVD_STREAMS)
            }
        else:
            out[f.name] = _jsonable(value)
    for name in getattr(type(obj), "_AS_DICT_EXTRAS", ()):
        out[name] = _jsonable(getattr(obj, name))
    return out


@dataclass(**_DATACLASS)
class PortAttr:
    """One port's ``struct ibv_port_attr`` (ibv_query_port), fields under their C names and values.

    Decoded views: ``state_name`` ("PORT_ACTIVE"), ``phys_state_name``
    ("LINK_UP"), ``max_mtu_bytes``/``active_mtu_bytes`` (4096/1024),
    ``link_layer_name`` ("Ethernet"), ``active_width_name`` ("1X"),
    ``active_speed_name`` ("2.5 Gbps"), ``port_cap_flags_names`` and
    ``port_cap_flags2_names`` (``("CM_SUP", ...)``).  Names follow ibv_devinfo.
    """

    _AS_DICT_EXTRAS: ClassVar[Tuple[str, ...]] = (
        "state_name", "phys_state_name", "max_mtu_bytes", "active_mtu_bytes",
        "link_layer_name", "active_width_name", "active_speed_name",
        "port_cap_flags_names", "port_cap_flags2_names",
    )

    port_num: int
    state: int
    max_mtu: int
    active_mtu: int
    gid_tbl_len: int
    port_cap_flags: int
    max_msg_sz: int
    bad_pkey_cntr: int
    qkey_viol_cntr: int
    pkey_tbl_len: int
    lid: int
    sm_lid: int
    lmc: int
    max_vl_num: int
    sm_sl: int
    subnet_timeout: int
    init_type_reply: int
    active_width: int
    active_speed: int
    phys_state: int
    link_layer: int
    flags: int
    port_cap_flags2: int
    active_speed_ex: Optional[int] = None

    @property
    def state_name(self) -> str:
        """``ibv_port_state`` name: "PORT_ACTIVE", "PORT_DOWN", ..."""
        return _PORT_STATE_NAMES.get(self.state, f"invalid state ({self.state})")

    @property
    def phys_state_name(self) -> str:
        """Physical port state as ibv_devinfo prints it: "LINK_UP", "POLLING", ..."""
        return _PHYS_STATE_NAMES.get(self.phys_state, f"invalid physical state ({self.phys_state})")

    @property
    def max_mtu_bytes(self) -> Optional[int]:
        """``max_mtu`` in bytes (IBV_MTU_4096 -> 4096), None if the enum value is unknown."""
        return _MTU_BYTES.get(self.max_mtu)

    @property
    def active_mtu_bytes(self) -> Optional[int]:
        """``active_mtu`` in bytes (IBV_MTU_1024 -> 1024), None if the enum value is unknown."""
        return _MTU_BYTES.get(self.active_mtu)

    @property
    def link_layer_name(self) -> str:
        """"Ethernet" (RoCE or iWARP), "InfiniBand" (also for UNSPECIFIED, as ibv_devinfo) or "Unknown"."""
        return _LINK_LAYER_NAMES.get(self.link_layer, "Unknown")

    @property
    def active_width_name(self) -> str:
        """Link width as ibv_devinfo prints it: "1X", "4X", ..."""
        return _WIDTH_NAMES.get(self.active_width, f"invalid width ({self.active_width})")

    @property
    def active_speed_name(self) -> str:
        """Per-lane speed as ibv_devinfo prints it: "2.5 Gbps", "25.0 Gbps", ..."""
        return _SPEED_NAMES.get(self.active_speed, f"invalid speed ({self.active_speed})")

    @property
    def port_cap_flags_names(self) -> Tuple[str, ...]:
        """Names of the set ``ibv_port_cap_flags`` bits (unknown bits as one hex string)."""
        return _flag_names(self.port_cap_flags, PORT_CAP_FLAGS)

    @property
    def port_cap_flags2_names(self) -> Tuple[str, ...]:
        """Names of the set ``ibv_port_cap_flags2`` bits (unknown bits as one hex string)."""
        return _flag_names(self.port_cap_flags2, PORT_CAP_FLAGS2)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict of the fields and the decoded views."""
        return _as_dict(self)


@dataclass(**_DATACLASS)
class TransportAttr:
    """The transport-specific attributes of an IA: the verbs device, port and GIDs behind it.

    Every field of seed 003's ``struct ibv_device_attr`` is here under its C
    name with its C value, with one exception: ``node_guid`` and
    ``sys_image_guid`` are the GUID *numbers* (``be64toh`` applied, the value
    ibv_devinfo prints; ``node_guid_str`` is that text).  ``port`` is the
    :class:`PortAttr` of the IA's port (a nested object rather than
    ``port_``-prefixed fields); ``gid_table`` the port's valid GIDs and
    ``gids`` their text.  Decoded views: ``device_cap_flags_names``
    (``("BAD_PKEY_CNTR", ...)``, as ibv_devinfo lists them),
    ``atomic_cap_name`` ("ATOMIC_HCA").

    :meth:`named_attrs` gives the same information as DAT_NAMED_ATTR pairs
    (what ``num_transport_attr`` counts).
    """

    _AS_DICT_EXTRAS: ClassVar[Tuple[str, ...]] = (
        "port_num", "node_guid_str", "sys_image_guid_str", "device_cap_flags_names",
        "atomic_cap_name", "gids",
    )

    device_name: str
    transport: str
    fw_ver: str
    node_guid: int
    sys_image_guid: int
    max_mr_size: int
    page_size_cap: int
    vendor_id: int
    vendor_part_id: int
    hw_ver: int
    max_qp: int
    max_qp_wr: int
    device_cap_flags: int
    max_sge: int
    max_sge_rd: int
    max_cq: int
    max_cqe: int
    max_mr: int
    max_pd: int
    max_qp_rd_atom: int
    max_ee_rd_atom: int
    max_res_rd_atom: int
    max_qp_init_rd_atom: int
    max_ee_init_rd_atom: int
    atomic_cap: int
    max_ee: int
    max_rdd: int
    max_mw: int
    max_raw_ipv6_qp: int
    max_raw_ethy_qp: int
    max_mcast_grp: int
    max_mcast_qp_attach: int
    max_total_mcast_qp_attach: int
    max_ah: int
    max_fmr: int
    max_map_per_fmr: int
    max_srq: int
    max_srq_wr: int
    max_srq_sge: int
    max_pkeys: int
    local_ca_ack_delay: int
    phys_port_cnt: int
    port: PortAttr
    gid_table: Tuple[GIDEntry, ...] = ()

    @property
    def port_num(self) -> int:
        """The IA's port number (1-based)."""
        return self.port.port_num

    @property
    def node_guid_str(self) -> str:
        """``node_guid`` as ibv_devinfo prints it: "7802:a6ff:fe13:9a74"."""
        return format_guid(self.node_guid)

    @property
    def sys_image_guid_str(self) -> str:
        """``sys_image_guid`` as ibv_devinfo prints it."""
        return format_guid(self.sys_image_guid)

    @property
    def device_cap_flags_names(self) -> Tuple[str, ...]:
        """Names of the set ``ibv_device_cap_flags`` bits as ibv_devinfo lists them (unknown bits as hex)."""
        return _flag_names(self.device_cap_flags, DEVICE_CAP_FLAGS)

    @property
    def atomic_cap_name(self) -> str:
        """``ibv_atomic_cap`` name: "ATOMIC_NONE", "ATOMIC_HCA" or "ATOMIC_GLOB"."""
        return _ATOMIC_CAP_NAMES.get(self.atomic_cap, f"invalid atomic capability ({self.atomic_cap})")

    @property
    def gids(self) -> Tuple[str, ...]:
        """The port's valid GIDs in table order, ``inet_ntop`` text form."""
        return tuple(entry.gid for entry in self.gid_table)

    def named_attrs(self) -> Tuple[NamedAttr, ...]:
        """Everything here as DAT_NAMED_ATTR pairs: device fields, ``port_*`` fields, ``gid[N]``."""
        out: List[NamedAttr] = [NamedAttr("device_name", self.device_name), NamedAttr("transport", self.transport)]
        for name in DEVICE_ATTR_FIELDS:
            value = getattr(self, name)
            if name in ("node_guid", "sys_image_guid"):
                text = format_guid(value)
            elif name in ("device_cap_flags", "page_size_cap", "max_mr_size", "vendor_id", "hw_ver"):
                text = f"0x{value:x}"
            else:
                text = str(value)
            out.append(NamedAttr(name, text))
        out.append(NamedAttr("port_num", str(self.port.port_num)))
        for name in PORT_ATTR_FIELDS + _PORT_ATTR_OPTIONAL:
            value = getattr(self.port, name)
            if value is not None:
                out.append(NamedAttr(f"port_{name}", str(value)))
        for entry in self.gid_table:
            text = entry.gid if entry.gid_type is None else f"{entry.gid}, {entry.gid_type}"
            out.append(NamedAttr(f"gid[{entry.index}]", text))
        return tuple(out)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict: C fields, nested ``port``, GIDs and decoded views."""
        return _as_dict(self)


@dataclass(**_DATACLASS)
class IAAttr:
    """``DAT_IA_ATTR``: the attributes of the Interface Adapter (one device port).

    Members carry their DAT names in snake_case; ``None`` is DAT_VALUE_UNKNOWN.
    DAT's ``ia_address_ptr`` is ``ia_address`` (the IP address the IA answers
    on, as text; ``ia_address_ptr`` is an alias), DAT's DAT_NAMED_ATTR array
    ``transport_attr`` is a :class:`TransportAttr` object, and the DAT 1.x
    compatibility names ``max_mtu_size`` (= ``max_message_size``) and
    ``max_rdma_read_per_ep`` (= ``max_rdma_read_per_ep_in``) are aliases.

    How the values are derived from verbs (device = ibv_device_attr, port =
    ibv_port_attr): max_eps=max_qp, max_dto_per_ep=max_qp_wr,
    max_rdma_read_per_ep_in=max_qp_rd_atom,
    max_rdma_read_per_ep_out=max_qp_init_rd_atom, max_evds=max_cq,
    max_evd_qlen=max_cqe, max_iov_segments_per_dto=max_sge, max_lmrs=max_mr,
    max_lmr_block_size=max_mr_size, max_pzs=max_pd,
    max_message_size=max_rdma_size=port.max_msg_sz, max_rmrs=max_mw,
    max_srqs=max_srq, max_ep_per_srq=max_qp, max_recv_per_srq=max_srq_wr,
    max_iov_segments_per_rdma_read=max_sge_rd,
    max_iov_segments_per_rdma_write=max_sge, max_rdma_read_in=max_res_rd_atom,
    max_rdma_read_out=None (verbs has no IA-wide initiator limit),
    hardware_version_major=hw_ver, hardware_version_minor=None,
    firmware_version_major/minor from fw_ver "a.b[.c]" (None if not numeric),
    vendor_name from the vendor_id OUI (None if unknown; rxe has none).
    """

    _AS_DICT_EXTRAS: ClassVar[Tuple[str, ...]] = ("num_transport_attr", "num_vendor_attr")

    adapter_name: str
    vendor_name: Optional[str]
    hardware_version_major: Optional[int]
    hardware_version_minor: Optional[int]
    firmware_version_major: Optional[int]
    firmware_version_minor: Optional[int]
    ia_address: Optional[str]
    max_eps: Optional[int]
    max_dto_per_ep: Optional[int]
    max_rdma_read_per_ep_in: Optional[int]
    max_rdma_read_per_ep_out: Optional[int]
    max_evds: Optional[int]
    max_evd_qlen: Optional[int]
    max_iov_segments_per_dto: Optional[int]
    max_lmrs: Optional[int]
    max_lmr_block_size: Optional[int]
    max_lmr_virtual_address: Optional[int]
    max_pzs: Optional[int]
    max_message_size: Optional[int]
    max_rdma_size: Optional[int]
    max_rmrs: Optional[int]
    max_rmr_target_address: Optional[int]
    max_srqs: Optional[int]
    max_ep_per_srq: Optional[int]
    max_recv_per_srq: Optional[int]
    max_iov_segments_per_rdma_read: Optional[int]
    max_iov_segments_per_rdma_write: Optional[int]
    max_rdma_read_in: Optional[int]
    max_rdma_read_out: Optional[int]
    max_rdma_read_per_ep_in_guaranteed: bool
    max_rdma_read_per_ep_out_guaranteed: bool
    zb_supported: bool
    extension_supported: str
    extension_version: int
    transport_attr: TransportAttr
    vendor_attr: Tuple[NamedAttr, ...] = ()

    @property
    def ia_address_ptr(self) -> Optional[str]:
        """DAT's name for :attr:`ia_address`."""
        return self.ia_address

    @property
    def max_mtu_size(self) -> Optional[int]:
        """DAT 1.0/1.1 name ("Max MTU size") of :attr:`max_message_size`."""
        return self.max_message_size

    @property
    def max_rdma_read_per_ep(self) -> Optional[int]:
        """DAT 1.0 name of :attr:`max_rdma_read_per_ep_in`."""
        return self.max_rdma_read_per_ep_in

    @property
    def num_transport_attr(self) -> int:
        """Number of transport-specific attributes (entries of ``transport_attr.named_attrs()``)."""
        return len(self.transport_attr.named_attrs())

    @property
    def num_vendor_attr(self) -> int:
        """Number of vendor-specific attributes (entries of ``vendor_attr``)."""
        return len(self.vendor_attr)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict (see :meth:`IAQuery.as_dict`)."""
        return _as_dict(self)


@dataclass(**_DATACLASS)
class ProviderAttr:
    """``DAT_PROVIDER_ATTR``: what the provider (aiodat over this device) supports.

    Members carry their DAT 2.0 names in snake_case.  Enumerations are DAT
    constant names (str), unions of flags frozensets of names,
    ``evd_stream_merging_supported`` a 6x6 tuple of bools indexed in
    :data:`EVD_STREAMS` order (see :meth:`can_merge`).  ``srq_watermarks_supported``,
    ``srq_info_supported`` and ``ep_recv_info_supported`` are DAT_COUNT bit
    masks as in uDAPL (``SRQ_WATERMARK_LOW`` = 0x001;
    ``SRQ_INFO_AVAILABLE_DTO_COUNT`` = 0x01, ``SRQ_INFO_OUTSTANDING_DTO_COUNT`` = 0x10).

    ``max_private_data_size`` is the connect (REQ) limit of rdma_cm on
    InfiniBand/RoCE, 56 bytes, below DAT's nominal 64-byte minimum because
    the wire cannot carry more; accept (REP) carries up to 196 and reject
    (REJ) up to 148 bytes, listed in ``provider_specific_attr``.  Private data
    is raw: what the caller gives goes on the wire as is, and what arrives is
    the CM's whole block, zero-filled past what the peer sent.
    """

    _AS_DICT_EXTRAS: ClassVar[Tuple[str, ...]] = ("num_provider_specific_attr",)

    provider_name: str
    provider_version_major: int
    provider_version_minor: int
    dapl_version_major: int
    dapl_version_minor: int
    lmr_mem_types_supported: FrozenSet[str]
    iov_ownership_on_return: str
    dat_qos_supported: FrozenSet[str]
    completion_flags_supported: FrozenSet[str]
    is_thread_safe: bool
    max_private_data_size: int
    supports_multipath: bool
    ep_creator: str
    pz_support: str
    optimal_buffer_alignment: int
    evd_stream_merging_supported: Tuple[Tuple[bool, ...], ...]
    srq_supported: bool
    srq_watermarks_supported: int
    srq_ep_pz_difference_supported: bool
    srq_info_supported: int
    ep_recv_info_supported: int
    lmr_sync_req: bool
    dto_async_return_guaranteed: bool
    rdma_write_for_rdma_read_req: bool
    rdma_read_lmr_rmr_context_exposure: bool
    rmr_scope_supported: Optional[str]
    is_signal_safe: bool
    ha_supported: bool
    ha_loadbalancing: str
    provider_specific_attr: Tuple[NamedAttr, ...] = ()

    @property
    def num_provider_specific_attr(self) -> int:
        """Number of provider-specific attributes (entries of ``provider_specific_attr``)."""
        return len(self.provider_specific_attr)

    def can_merge(self, stream_a: str, stream_b: str) -> bool:
        """Whether events of the two streams (names from :data:`EVD_STREAMS`) may feed one EVD."""
        try:
            i, j = EVD_STREAMS.index(stream_a), EVD_STREAMS.index(stream_b)
        except ValueError:
            raise InvalidParameter(
                f"unknown EVD stream {stream_a!r} or {stream_b!r}; streams are {', '.join(EVD_STREAMS)}"
            ) from None
        return bool(self.evd_stream_merging_supported[i][j])

    def as_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict (see :meth:`IAQuery.as_dict`)."""
        return _as_dict(self)


@dataclass(**_DATACLASS)
class IAQuery:
    """What ``dat_ia_query`` returns: the IA attributes and the Provider attributes.

    DAT's ``ia_attr_mask``/``provider_attr_mask`` are unnecessary: aiodat
    always fills every attribute.
    """

    ia_attr: IAAttr
    provider_attr: ProviderAttr

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable dict, for ``aiodat query --json``.

        ``{"ia_attr": {...}, "provider_attr": {...}}``; each holds every field
        under its name plus the counts (``num_transport_attr``, ...).  Unknown
        values are ``null``; DAT enumerations are their constant names; flag
        unions sorted lists of names; named-attribute arrays (``vendor_attr``,
        ``provider_specific_attr``) objects ``{name: value}``;
        ``evd_stream_merging_supported`` an object ``{row_stream: {col_stream:
        bool}}``; ``ia_attr.transport_attr`` an object of the ibv_device_attr
        fields with a nested ``port`` object, ``gid_table`` (list of
        ``{"index", "gid", "gid_type"}``), ``gids`` and the decoded names.
        """
        return {"ia_attr": self.ia_attr.as_dict(), "provider_attr": self.provider_attr.as_dict()}


# --- provider constants ---------------------------------------------------

#: every key ``provider_consts`` may hold (all optional; defaults from :func:`default_provider_consts`)
PROVIDER_CONST_KEYS: Tuple[str, ...] = (
    # DAT_PROVIDER_ATTR members aiodat decides
    "provider_name", "provider_version_major", "provider_version_minor",
    "dapl_version_major", "dapl_version_minor", "lmr_mem_types_supported",
    "iov_ownership_on_return", "dat_qos_supported", "completion_flags_supported",
    "is_thread_safe", "max_private_data_size", "supports_multipath", "ep_creator",
    "pz_support", "optimal_buffer_alignment", "evd_stream_merging_supported",
    "srq_supported", "srq_watermarks_supported", "srq_ep_pz_difference_supported",
    "srq_info_supported", "ep_recv_info_supported", "lmr_sync_req",
    "dto_async_return_guaranteed", "rdma_write_for_rdma_read_req",
    "rdma_read_lmr_rmr_context_exposure", "rmr_scope_supported", "is_signal_safe",
    "ha_supported", "ha_loadbalancing", "provider_specific_attr",
    # DAT_IA_ATTR members aiodat decides
    "zb_supported", "extension_supported", "extension_version",
    "max_rdma_read_per_ep_in_guaranteed", "max_rdma_read_per_ep_out_guaranteed",
    "max_lmr_virtual_address", "max_rmr_target_address",
)


def default_provider_consts(version: str = "0.0") -> Dict[str, Any]:
    """The provider constants describing what aiodat supports, for ``version`` ("major.minor[...]").

    ``None`` for ``rdma_write_for_rdma_read_req``,
    ``rdma_read_lmr_rmr_context_exposure`` and ``rmr_scope_supported`` means
    "derive from the device" (the transport, the memory-window cap flags).
    ``srq_supported`` is further limited by the device (``max_srq > 0``).
    """
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", version or "")
    major = int(m.group(1)) if m else 0
    minor = int(m.group(2)) if m and m.group(2) else 0
    return {
        "provider_name": "aiodat",
        "provider_version_major": major,
        "provider_version_minor": minor,
        "dapl_version_major": 2,
        "dapl_version_minor": 0,
        # LMRs register Python buffers by virtual address
        "lmr_mem_types_supported": frozenset({"DAT_MEM_TYPE_VIRTUAL"}),
        # the shim copies the IOV into ibv_sge entries before ibv_post_* returns
        "iov_ownership_on_return": "DAT_IOV_CONSUMER",
        "dat_qos_supported": frozenset({"DAT_QOS_BEST_EFFORT"}),
        "completion_flags_supported": frozenset(
            {
                "DAT_COMPLETION_SUPPRESS_FLAG",
                "DAT_COMPLETION_SOLICITED_WAIT_FLAG",
                "DAT_COMPLETION_UNSIGNALLED_FLAG",
                "DAT_COMPLETION_BARRIER_FENCE_FLAG",
            }
        ),
        # objects belong to one event loop / thread
        "is_thread_safe": False,
        # rdma_cm REQ private data on IB/RoCE is 56 bytes (REP 196, REJ 148), sent raw
        "max_private_data_size": 56,
        "supports_multipath": False,
        # the consumer creates the EP and passes it to cr.accept()
        "ep_creator": "DAT_PSP_CREATES_EP_NEVER",
        # a verbs PD belongs to one device context
        "pz_support": "DAT_PZ_UNIQUE",
        # a cache line
        "optimal_buffer_alignment": 64,
        # every pair of streams can feed one EVD
        "evd_stream_merging_supported": True,
        "srq_supported": True,
        "srq_watermarks_supported": SRQ_WATERMARK_LOW,
        "srq_ep_pz_difference_supported": False,
        # aiodat counts posted-but-not-completed receives; the device cannot tell available ones
        "srq_info_supported": SRQ_INFO_OUTSTANDING_DTO_COUNT,
        "ep_recv_info_supported": 0,
        # RDMA memory is cache-coherent on the Linux platforms rdma-core runs on
        "lmr_sync_req": False,
        "dto_async_return_guaranteed": False,
        "rdma_write_for_rdma_read_req": None,
        "rdma_read_lmr_rmr_context_exposure": None,
        "rmr_scope_supported": None,
        "is_signal_safe": False,
        "ha_supported": False,
        "ha_loadbalancing": "DAT_HA_LB_NONE",
        "provider_specific_attr": (
            NamedAttr("max_private_data_size_connect", "56"),
            NamedAttr("max_private_data_size_accept", "196"),
            NamedAttr("max_private_data_size_reject", "148"),
        ),
        "zb_supported": False,
        "extension_supported": "DAT_EXTENSION_NONE",
        "extension_version": 0,
        "max_rdma_read_per_ep_in_guaranteed": True,
        "max_rdma_read_per_ep_out_guaranteed": True,
        # verbs addresses are 64-bit virtual addresses
        "max_lmr_virtual_address": _U64_MAX,
        "max_rmr_target_address": _U64_MAX,
    }


# --- the builder ----------------------------------------------------------


def _check_keys(what: str, given: Mapping[str, Any], required: Sequence[str], optional: Sequence[str] = ()) -> None:
    if not isinstance(given, Mapping):
        raise InvalidParameter(f"{what} must be a dict, got {type(given).__name__}")
    missing = [k for k in required if k not in given]
    if missing:
        raise InvalidParameter(f"{what} lacks {', '.join(missing)}")
    allowed = set(required) | set(optional)
    unknown = sorted(str(k) for k in given if k not in allowed)
    if unknown:
        raise InvalidParameter(f"{what} has unknown keys {', '.join(unknown)}")


def _int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(f"{what} must be an int, got {value!r}")
    return value


def _text(what: str, value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).split(b"\0", 1)[0].decode(errors="replace")
    if not isinstance(value, str):
        raise InvalidParameter(f"{what} must be a str, got {value!r}")
    return value


def _guid(what: str, value: Any) -> int:
    # 8 raw bytes (network order) or the __be64 as C reads it into a uint64_t
    if isinstance(value, (bytes, bytearray)):
        if len(value) != 8:
            raise InvalidParameter(f"{what} as bytes must be 8 bytes, got {len(value)}")
        return int.from_bytes(bytes(value), "big")
    return guid_from_be64(_int(what, value))


def _name(what: str, value: Any, allowed: Tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidParameter(f"{what} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _names(what: str, value: Any, allowed: Tuple[str, ...]) -> FrozenSet[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidParameter(f"{what} must be a set of names from {', '.join(allowed)}; got {value!r}")
    try:
        names = frozenset(value)
    except TypeError:  # an unhashable item
        raise InvalidParameter(f"{what} must be a set of names from {', '.join(allowed)}; got {value!r}") from None
    bad = sorted(n for n in names if n not in allowed)
    if bad:
        raise InvalidParameter(f"{what} holds unknown names {', '.join(map(repr, bad))}; allowed: {', '.join(allowed)}")
    return names


def _bool(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameter(f"{what} must be True or False, got {value!r}")
    return value


def _merging(value: Any) -> Tuple[Tuple[bool, ...], ...]:
    n = len(EVD_STREAMS)
    if isinstance(value, bool):
        return tuple(tuple(value or i == j for j in range(n)) for i in range(n))
    try:
        rows = tuple(tuple(bool(v) for v in row) for row in value)
    except TypeError:
        rows = ()
    if len(rows) != n or any(len(r) != n for r in rows):
        raise InvalidParameter(
            f"evd_stream_merging_supported must be a bool or a {n}x{n} matrix in EVD_STREAMS order, got {value!r}"
        )
    return rows


def _named_attrs(what: str, value: Any) -> Tuple[NamedAttr, ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    try:
        for name, val in items:
            out.append(NamedAttr(str(name), str(val)))
    except (TypeError, ValueError):
        raise InvalidParameter(f"{what} must be a mapping or (name, value) pairs, got {value!r}") from None
    return tuple(out)


def _gid_table(gids: Any) -> Tuple[GIDEntry, ...]:
    if isinstance(gids, (str, bytes)) or not isinstance(gids, Iterable):
        raise InvalidParameter(f"gids must be a list of GIDs, got {gids!r}")
    out: List[GIDEntry] = []
    for position, item in enumerate(gids):
        index, gid_type = position, None
        if isinstance(item, GIDEntry):
            index, gid, gid_type = item.index, item.gid, item.gid_type
        elif isinstance(item, tuple):
            if len(item) not in (2, 3):
                raise InvalidParameter(f"gids[{position}] must be a GID, (index, gid) or (index, gid, type); got {item!r}")
            index, gid = _int(f"gids[{position}] index", item[0]), item[1]
            gid_type = item[2] if len(item) == 3 else None
        else:
            gid = item
        text = normalize_gid(gid)
        if text == "::":
            continue  # an empty slot of a sparse table
        out.append(GIDEntry(index, text, gid_type))
    return tuple(out)


def _firmware(fw_ver: str) -> Tuple[Optional[int], Optional[int]]:
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", fw_ver)
    if not m:
        return None, None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) is not None else None)


def _rmr_scope(device_cap_flags: int, max_mw: int) -> Optional[str]:
    """The scope of the RMRs aiodat offers: it allocates type-2 windows only (TYPE_2A/2B), which
    only the QP that bound them may use: EP scope.  A device with type-1 windows alone (MEM_WINDOW,
    PD scope) gets no RMR from aiodat (create_rmr: NotImplementedByProvider), so None."""
    type2 = bool(device_cap_flags & ((1 << 23) | (1 << 24)))
    return "DAT_RMR_SCOPE_EP" if max_mw > 0 and type2 else None


def build_ia_query(
    *,
    ia_name: str,
    device_name: str,
    port_num: int,
    device_attr: Mapping[str, Any],
    port_attr: Mapping[str, Any],
    gids: Sequence[Any],
    ia_address: Optional[str],
    provider_consts: Mapping[str, Any],
    transport: str = "InfiniBand",
) -> IAQuery:
    """Build the ``dat_ia_query`` result for IA ``ia_name`` (device ``device_name``, port ``port_num``).

    Inputs, as the C shim reads them:

    * ``device_attr``: ``struct ibv_device_attr`` as a dict keyed by its C
      field names (:data:`DEVICE_ATTR_FIELDS`, all required) holding the C
      values: ints, ``fw_ver`` a str (bytes are decoded).  ``node_guid`` and
      ``sys_image_guid`` are the ``__be64`` fields exactly as a ``uint64_t``
      read gives them (byte-swapped on little-endian hosts; this function
      applies ``be64toh``), or 8 raw bytes.
    * ``port_attr``: ``struct ibv_port_attr`` likewise (:data:`PORT_ATTR_FIELDS`,
      all required; ``active_speed_ex`` optional), enum fields as their ints.
    * ``gids``: the port's GID table: each entry a GID string (IPv6 text or
      the raw hex form) or 16 raw bytes, its list position being its index;
      or ``(index, gid)`` / ``(index, gid, type)`` tuples for sparse tables.
      All-zero entries are skipped.
    * ``ia_address``: the IP address the IA answers on (text), or None.
    * ``provider_consts``: what aiodat supports, keys from
      :data:`PROVIDER_CONST_KEYS`; missing keys take
      :func:`default_provider_consts` values.
    * ``transport``: the device transport as ibv_devinfo names it
      ("InfiniBand", also for RoCE; "iWARP"...).  iWARP needs RDMA-write
      rights on RDMA-read sinks, which is reflected in the provider attributes.

    Malformed input raises :class:`~aiodat.errors.InvalidParameter` naming the
    offending key.  Every attribute is filled: DAT's attribute masks are
    unnecessary with aiodat; values the device cannot tell are None.
    """
    ia_name = _text("ia_name", ia_name)
    device_name = _text("device_name", device_name)
    _int("port_num", port_num)
    if ia_address is not None and not isinstance(ia_address, str):
        ia_address = str(ia_address)  # ipaddress objects
    _check_keys("device_attr (struct ibv_device_attr)", device_attr, DEVICE_ATTR_FIELDS)
    _check_keys("port_attr (struct ibv_port_attr)", port_attr, PORT_ATTR_FIELDS, _PORT_ATTR_OPTIONAL)
    _name("transport", transport, _TRANSPORTS)
    if not isinstance(provider_consts, Mapping):
        raise InvalidParameter(f"provider_consts must be a dict, got {type(provider_consts).__name__}")
    unknown = sorted(str(k) for k in provider_consts if k not in PROVIDER_CONST_KEYS)
    if unknown:
        raise InvalidParameter(f"provider_consts has unknown keys {', '.join(unknown)}")

    dev: Dict[str, Any] = {}
    for key in DEVICE_ATTR_FIELDS:
        value = device_attr[key]
        if key == "fw_ver":
            dev[key] = _text("device_attr['fw_ver']", value)
        elif key in ("node_guid", "sys_image_guid"):
            dev[key] = _guid(f"device_attr[{key!r}]", value)
        else:
            dev[key] = _int(f"device_attr[{key!r}]", value)
    prt: Dict[str, Any] = {}
    for key in PORT_ATTR_FIELDS:
        prt[key] = _int(f"port_attr[{key!r}]", port_attr[key])
    if port_attr.get("active_speed_ex") is not None:
        prt["active_speed_ex"] = _int("port_attr['active_speed_ex']", port_attr["active_speed_ex"])

    port = PortAttr(port_num=port_num, **prt)
    transport_attr = TransportAttr(
        device_name=device_name, transport=transport, port=port, gid_table=_gid_table(gids), **dev
    )

    consts = default_provider_consts()
    consts.update(provider_consts)
    iwarp = transport == "iWARP"
    if consts["rdma_write_for_rdma_read_req"] is None:
        consts["rdma_write_for_rdma_read_req"] = iwarp
    if consts["rdma_read_lmr_rmr_context_exposure"] is None:
        consts["rdma_read_lmr_rmr_context_exposure"] = iwarp
    rmr_scope = consts["rmr_scope_supported"]
    if rmr_scope is None:
        rmr_scope = _rmr_scope(dev["device_cap_flags"], dev["max_mw"])
    else:
        rmr_scope = _name("provider_consts['rmr_scope_supported']", rmr_scope, RMR_SCOPES)

    srq = _bool("provider_consts['srq_supported']", consts["srq_supported"]) and dev["max_srq"] > 0
    fw_major, fw_minor = _firmware(dev["fw_ver"])
    vendor_attr = (
        NamedAttr("device_name", device_name),
        NamedAttr("vendor_id", f"0x{dev['vendor_id']:x}"),
        NamedAttr("vendor_part_id", str(dev["vendor_part_id"])),
        NamedAttr("hw_ver", f"0x{dev['hw_ver']:X}"),
        NamedAttr("fw_ver", dev["fw_ver"]),
        NamedAttr("node_guid", format_guid(dev["node_guid"])),
        NamedAttr("sys_image_guid", format_guid(dev["sys_image_guid"])),
    )

    ia_attr = IAAttr(
        adapter_name=ia_name,
        vendor_name=_VENDOR_NAMES.get(dev["vendor_id"]),
        hardware_version_major=dev["hw_ver"],
        hardware_version_minor=None,
        firmware_version_major=fw_major,
        firmware_version_minor=fw_minor,
        ia_address=ia_address,
        max_eps=dev["max_qp"],
        max_dto_per_ep=dev["max_qp_wr"],
        max_rdma_read_per_ep_in=dev["max_qp_rd_atom"],
        max_rdma_read_per_ep_out=dev["max_qp_init_rd_atom"],
        max_evds=dev["max_cq"],
        max_evd_qlen=dev["max_cqe"],
        max_iov_segments_per_dto=dev["max_sge"],
        max_lmrs=dev["max_mr"],
        max_lmr_block_size=dev["max_mr_size"],
        max_lmr_virtual_address=_int("provider_consts['max_lmr_virtual_address']", consts["max_lmr_virtual_address"]),
        max_pzs=dev["max_pd"],
        max_message_size=prt["max_msg_sz"],
        max_rdma_size=prt["max_msg_sz"],
        max_rmrs=dev["max_mw"],
        max_rmr_target_address=_int("provider_consts['max_rmr_target_address']", consts["max_rmr_target_address"]),
        max_srqs=dev["max_srq"] if srq else 0,
        max_ep_per_srq=dev["max_qp"] if srq else 0,
        max_recv_per_srq=dev["max_srq_wr"] if srq else 0,
        max_iov_segments_per_rdma_read=dev["max_sge_rd"],
        max_iov_segments_per_rdma_write=dev["max_sge"],
        max_rdma_read_in=dev["max_res_rd_atom"],
        max_rdma_read_out=None,
        max_rdma_read_per_ep_in_guaranteed=_bool(
            "provider_consts['max_rdma_read_per_ep_in_guaranteed']", consts["max_rdma_read_per_ep_in_guaranteed"]
        ),
        max_rdma_read_per_ep_out_guaranteed=_bool(
            "provider_consts['max_rdma_read_per_ep_out_guaranteed']", consts["max_rdma_read_per_ep_out_guaranteed"]
        ),
        zb_supported=_bool("provider_consts['zb_supported']", consts["zb_supported"]),
        extension_supported=_name("provider_consts['extension_supported']", consts["extension_supported"], EXTENSIONS),
        extension_version=_int("provider_consts['extension_version']", consts["extension_version"]),
        transport_attr=transport_attr,
        vendor_attr=vendor_attr,
    )

    def c(key: str) -> Any:
        return consts[key]

    def flag(key: str) -> bool:
        return _bool(f"provider_consts[{key!r}]", consts[key])

    def count(key: str) -> int:
        return _int(f"provider_consts[{key!r}]", consts[key])

    provider_attr = ProviderAttr(
        provider_name=_text("provider_consts['provider_name']", c("provider_name")),
        provider_version_major=count("provider_version_major"),
        provider_version_minor=count("provider_version_minor"),
        dapl_version_major=count("dapl_version_major"),
        dapl_version_minor=count("dapl_version_minor"),
        lmr_mem_types_supported=_names(
            "provider_consts['lmr_mem_types_supported']", c("lmr_mem_types_supported"), MEM_TYPES
        ),
        iov_ownership_on_return=_name(
            "provider_consts['iov_ownership_on_return']", c("iov_ownership_on_return"), IOV_OWNERSHIPS
        ),
        dat_qos_supported=_names("provider_consts['dat_qos_supported']", c("dat_qos_supported"), QOS_NAMES),
        completion_flags_supported=_names(
            "provider_consts['completion_flags_supported']", c("completion_flags_supported"), COMPLETION_FLAGS
        ),
        is_thread_safe=flag("is_thread_safe"),
        max_private_data_size=count("max_private_data_size"),
        supports_multipath=flag("supports_multipath"),
        ep_creator=_name("provider_consts['ep_creator']", c("ep_creator"), EP_CREATORS),
        pz_support=_name("provider_consts['pz_support']", c("pz_support"), PZ_SUPPORTS),
        optimal_buffer_alignment=count("optimal_buffer_alignment"),
        evd_stream_merging_supported=_merging(c("evd_stream_merging_supported")),
        srq_supported=srq,
        srq_watermarks_supported=count("srq_watermarks_supported") if srq else 0,
        srq_ep_pz_difference_supported=flag("srq_ep_pz_difference_supported") and srq,
        srq_info_supported=count("srq_info_supported") if srq else 0,
        ep_recv_info_supported=count("ep_recv_info_supported"),
        lmr_sync_req=flag("lmr_sync_req"),
        dto_async_return_guaranteed=flag("dto_async_return_guaranteed"),
        rdma_write_for_rdma_read_req=flag("rdma_write_for_rdma_read_req"),
        rdma_read_lmr_rmr_context_exposure=flag("rdma_read_lmr_rmr_context_exposure"),
        rmr_scope_supported=rmr_scope,
        is_signal_safe=flag("is_signal_safe"),
        ha_supported=flag("ha_supported"),
        ha_loadbalancing=_name("provider_consts['ha_loadbalancing']", c("ha_loadbalancing"), HA_LB_NAMES),
        provider_specific_attr=_named_attrs("provider_consts['provider_specific_attr']", c("provider_specific_attr")),
    )
    return IAQuery(ia_attr=ia_attr, provider_attr=provider_attr)
