"""Parse ``ibv_devinfo -v`` output, to check aiodat's IA query against it field by field.

:func:`parse_devinfo` turns the text into one :class:`DevinfoDevice` per
``hca_id:`` block.  Its ``attr`` dict is ``struct ibv_device_attr`` and each
port's ``attr`` dict ``struct ibv_port_attr``, keyed by the C field names and
holding the values *as the C structs hold them*, so they can be fed straight
to :func:`aiodat.attrs.build_ia_query`:

* enums are their numbers (``state: PORT_ACTIVE (4)`` -> ``4``,
  ``active_mtu: 1024 (3)`` -> ``3``, ``link_layer: Ethernet`` -> ``2``);
* hex fields are ints (``max_msg_sz: 0x800000`` -> ``8388608``);
* ``node_guid``/``sys_image_guid`` are the ``__be64`` values as a C
  ``uint64_t`` read gives them (ibv_devinfo prints ``be64toh`` of them; see
  :func:`aiodat.attrs.guid_to_be64`);
* ``port_lid``/``port_lmc`` are stored as ``lid``/``lmc``.

ibv_devinfo prints some fields only conditionally (``max_map_per_fmr`` only
when ``max_fmr`` is non-zero, ``max_srq_wr``/``max_srq_sge`` only when
``max_srq`` is, ``fw_ver`` only when non-empty) and never prints
``ibv_port_attr.flags``; those keys are then absent.  Everything else it
prints (ODP caps, RSS caps, ...) is kept as text in ``raw``.

:func:`diff_transport_attr` compares a :class:`aiodat.attrs.TransportAttr`
with a parsed device and lists every difference.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .attrs import (
    DEVICE_ATTR_FIELDS,
    PORT_ATTR_FIELDS,
    TransportAttr,
    guid_from_be64,
    guid_to_be64,
    normalize_gid,
)

__all__ = [
    "DevinfoGID",
    "DevinfoPort",
    "DevinfoDevice",
    "parse_devinfo",
    "parse_devinfo_device",
    "diff_transport_attr",
]

_LINK_LAYERS = {"InfiniBand": 1, "Ethernet": 2}
# ibv_devinfo labels that differ from the struct field names
_PORT_RENAMES = {"port_lid": "lid", "port_lmc": "lmc"}
_GID_RE = re.compile(r"^GID\[\s*(\d+)\]:\s*([0-9A-Fa-f:.]+)\s*(?:,\s*(.+?))?\s*$")
_ENUM_RE = re.compile(r"\((-?\d+)\)\s*$")
_KEY_RE = re.compile(r"^([A-Za-z0-9_ ]+?):\s*(.*)$")


@dataclass(frozen=True)
class DevinfoGID:
    """A GID line: table index, GID in ``inet_ntop`` form, type ("RoCE v2") or None."""

    index: int
    gid: str
    gid_type: Optional[str] = None


@dataclass(frozen=True)
class DevinfoPort:
    """One ``port:`` block: ``attr`` is ``struct ibv_port_attr`` (C names and values), ``raw`` the text."""

    port_num: int
    attr: Dict[str, int] = field(default_factory=dict)
    gids: Tuple[DevinfoGID, ...] = ()
    raw: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DevinfoDevice:
    """One ``hca_id:`` block of ``ibv_devinfo -v``.

    ``attr`` is ``struct ibv_device_attr`` (C names and values, see the module
    docstring), ``device_cap_flags_names`` the flag names printed under
    ``device_cap_flags``, ``ports`` the port blocks by number, ``raw`` every
    other printed line as text (sub-section keys as ``"section.key"``, flag
    lists joined by spaces).
    """

    name: str
    transport: Optional[str] = None
    transport_type: Optional[int] = None
    attr: Dict[str, Any] = field(default_factory=dict)
    device_cap_flags_names: Tuple[str, ...] = ()
    ports: Dict[int, DevinfoPort] = field(default_factory=dict)
    raw: Dict[str, str] = field(default_factory=dict)


def _enum_value(text: str) -> int:
    m = _ENUM_RE.search(text)
    if not m:
        raise ValueError(f"expected 'NAME (n)', got {text!r}")
    return int(m.group(1))


def _number(text: str) -> int:
    text = text.strip()
    if text.lower().startswith("0x"):
        return int(text, 16)
    return int(text, 10)


def _guid_text(text: str) -> int:
    return int(text.replace(":", ""), 16)


def _device_value(key: str, text: str) -> Any:
    if key == "fw_ver":
        return text
    if key in ("node_guid", "sys_image_guid"):
        return guid_to_be64(_guid_text(text))
    if key == "atomic_cap":
        return _enum_value(text)
    return _number(text)


def _port_value(key: str, text: str) -> Optional[int]:
    if key == "link_layer":
        return _LINK_LAYERS.get(text.strip())
    if _ENUM_RE.search(text):  # "PORT_ACTIVE (4)", "4096 (5)", "1X (1)", "2.5 Gbps (1)"
        return _enum_value(text)
    return _number(text)


class _Builder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: Optional[str] = None
        self.transport_type: Optional[int] = None
        self.raw: Dict[str, str] = {}
        self.flags: Dict[str, List[str]] = {}
        self.ports: Dict[int, Tuple[Dict[str, str], List[DevinfoGID]]] = {}

    def build(self) -> DevinfoDevice:
        attr: Dict[str, Any] = {}
        for key in DEVICE_ATTR_FIELDS:
            if key in self.raw:
                attr[key] = _device_value(key, self.raw[key])
        raw = {k: v for k, v in self.raw.items() if k not in attr}
        for key, names in self.flags.items():
            if key != "device_cap_flags":
                raw[key] = " ".join(names)
        ports: Dict[int, DevinfoPort] = {}
        for num, (praw, gids) in self.ports.items():
            pattr: Dict[str, int] = {}
            for label, text in praw.items():
                key = _PORT_RENAMES.get(label, label)
                if key in PORT_ATTR_FIELDS:
                    value = _port_value(key, text)
                    if value is not None:
                        pattr[key] = value
            ports[num] = DevinfoPort(num, pattr, tuple(gids), dict(praw))
        return DevinfoDevice(
            name=self.name,
            transport=self.transport,
            transport_type=self.transport_type,
            attr=attr,
            device_cap_flags_names=tuple(self.flags.get("device_cap_flags", ())),
            ports=ports,
            raw=raw,
        )


def parse_devinfo(text: str) -> List[DevinfoDevice]:
    """Parse the output of ``ibv_devinfo -v`` (or plain ``ibv_devinfo``) into one entry per device."""
    devices: List[DevinfoDevice] = []
    cur: Optional[_Builder] = None
    port: Optional[Tuple[Dict[str, str], List[DevinfoGID]]] = None
    last_key: Optional[str] = None  # the key flag lines belong to
    section: Optional[str] = None  # "tso_caps", "rss_caps", ... whose sub-keys follow

    for line in text.splitlines():
        if not line.strip():
            continue
        tabs = len(line) - len(line.lstrip("\t"))
        content = line.strip()
        if content.startswith("hca_id:"):
            if cur is not None:
                devices.append(cur.build())
            cur = _Builder(content.split(":", 1)[1].strip())
            port, last_key, section = None, None, None
            continue
        if cur is None:
            continue  # anything before the first device
        m = re.match(r"^port:\s*(\d+)$", content)
        if m and tabs <= 2:
            port = ({}, [])
            cur.ports[int(m.group(1))] = port
            last_key, section = None, None
            continue
        if port is not None:
            g = _GID_RE.match(content)
            if g:
                port[1].append(DevinfoGID(int(g.group(1)), normalize_gid(g.group(2)), g.group(3)))
                continue
            k = _KEY_RE.match(content)
            if k:
                port[0][k.group(1).strip()] = k.group(2).strip()
            continue
        if tabs >= 4:  # a flag name under the last key ("BAD_PKEY_CNTR", "Unknown flags: 0x..")
            if last_key is not None:
                cur.flags.setdefault(last_key, []).append(content)
            continue
        k = _KEY_RE.match(content)
        if not k:  # "completion_timestamp_mask not supported", "tag matching not supported"
            cur.raw[content] = ""
            last_key = None
            continue
        key, value = k.group(1).strip(), k.group(2).strip()
        if tabs >= 2 and section is not None:
            key = f"{section}.{key}"
        elif tabs == 1:
            section = key if value == "" else None
        if key == "transport":
            cur.transport = re.sub(r"\s*\(-?\d+\)\s*$", "", value)
            try:
                cur.transport_type = _enum_value(value)
            except ValueError:
                cur.transport_type = None
        else:
            cur.raw[key] = value
        last_key = key
    if cur is not None:
        devices.append(cur.build())
    return devices


def parse_devinfo_device(text: str, name: Optional[str] = None) -> Tuple[Dict[str, Any], Dict[int, Dict[str, int]]]:
    """Return ``(device attr dict, {port_num: port attr dict})`` of one device (the first, or ``name``)."""
    devices = parse_devinfo(text)
    for dev in devices:
        if name is None or dev.name == name:
            return dict(dev.attr), {n: dict(p.attr) for n, p in dev.ports.items()}
    wanted = "any device" if name is None else f"device {name!r}"
    found = ", ".join(d.name for d in devices) or "none"
    raise LookupError(f"ibv_devinfo output has no {wanted} (devices: {found})")


def diff_transport_attr(ours: TransportAttr, theirs: DevinfoDevice) -> List[str]:
    """List every difference between our TransportAttr and a parsed ibv_devinfo device.

    Compares each ibv_device_attr field ibv_devinfo printed, the decoded cap
    flag names, each ibv_port_attr field of our port, and the GID list.  An
    empty list means they agree.
    """
    out: List[str] = []
    if ours.device_name != theirs.name:
        out.append(f"device name: ours {ours.device_name!r}, ibv_devinfo {theirs.name!r}")
    for key, value in theirs.attr.items():
        mine = getattr(ours, key)
        if key in ("node_guid", "sys_image_guid"):
            value = guid_from_be64(value)  # TransportAttr holds the GUID number
        if mine != value:
            out.append(f"{key}: ours {mine!r}, ibv_devinfo {value!r}")
    if theirs.device_cap_flags_names:
        mine_names = tuple(n for n in ours.device_cap_flags_names if not n.startswith("0x"))
        theirs_names = tuple(n for n in theirs.device_cap_flags_names if not n.startswith("Unknown flags"))
        if mine_names != theirs_names:
            out.append(f"device_cap_flags names: ours {mine_names}, ibv_devinfo {theirs_names}")
    port = theirs.ports.get(ours.port.port_num)
    if port is None:
        out.append(f"port {ours.port.port_num}: not in the ibv_devinfo output")
        return out
    for key, value in port.attr.items():
        mine = getattr(ours.port, key)
        if key == "link_layer":  # ibv_devinfo prints UNSPECIFIED (0) as InfiniBand too
            mine = _LINK_LAYERS.get(ours.port.link_layer_name, mine)
        if mine != value:
            out.append(f"port {port.port_num} {key}: ours {mine!r}, ibv_devinfo {value!r}")
    their_gids = tuple(g.gid for g in port.gids)
    if port.gids and ours.gids != their_gids:
        out.append(f"port {port.port_num} gids: ours {ours.gids}, ibv_devinfo {their_gids}")
    return out
