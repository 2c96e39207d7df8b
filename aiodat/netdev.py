"""The IP addresses of an RDMA port: its network devices and their addresses.

rdma_cm names a port by an IP address of a network device bound to it, not by
a GID, so an IA needs the addresses of its port's netdevs:

* RoCE (rxe, mlx5 on Ethernet, ...): every GID table entry names the netdev it
  came from (``/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/ndevs/<index>``),
  VLAN and macvlan netdevs on top of the port included;
* InfiniBand: the GIDs are ``fe80::<GUID>``, not IP addresses; the IP addresses
  are those of the port's IPoIB netdevs (``ib0``, pkey children ``ib0.8001``),
  found as the netdevs whose parent device has this RDMA device and whose
  ``dev_port`` is the port's (0-based).

The addresses of each netdev come from ``getifaddrs`` (the shim's
``aiodat_if_addresses``): IPv4 first, then global IPv6, then link-local IPv6
with its ``%netdev`` scope.  When sysfs tells nothing (a container without it,
say), the IPv4 addresses in the GID table are the fallback.
"""
from __future__ import annotations

import ipaddress
import os
from typing import Iterable, List, Mapping, Optional, Sequence

from aiodat._lib import ffi, lib

def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # an empty GID slot reads EINVAL; a missing file is "unknown"
        return ""


def _unique(items: Iterable[str]) -> List[str]:
    seen: List[str] = []
    for item in items:
        if item and item not in seen:
            seen.append(item)
    return seen


def port_netdevs(device: str, port: int, sysfs: str = "/sys", indexes: Optional[Iterable[int]] = None) -> List[str]:
    """The network devices bound to ``device`` port ``port``, in GID table order (RoCE) or name order (IPoIB).

    ``indexes`` are the valid GID indexes when the caller knows them: only those
    are read (a RoCE table has hundreds of empty slots, each a sysfs read).
    """
    ndevs = os.path.join(sysfs, "class/infiniband", device, "ports", str(port), "gid_attrs", "ndevs")
    if indexes is None:
        try:
            indexes = sorted(int(i) for i in os.listdir(ndevs) if i.isdigit())
        except OSError:
            indexes = []
    names = _unique(_read(os.path.join(ndevs, str(i))) for i in indexes)
    if names:
        return names
    net = os.path.join(sysfs, "class/net")
    try:
        candidates = sorted(os.listdir(net))
    except OSError:
        return []
    ipoib = []
    for name in candidates:  # IPoIB: its parent device carries this RDMA device
        if not os.path.isdir(os.path.join(net, name, "device", "infiniband", device)):
            continue
        dev_port = _read(os.path.join(net, name, "dev_port")) or "0"
        if dev_port.isdigit() and int(dev_port) + 1 == port:
            ipoib.append(name)
    return ipoib


def netdev_addresses(netdev: str) -> List[str]:
    """The IP addresses of ``netdev``: IPv4, then global IPv6, then link-local IPv6 (``fe80::..%netdev``)."""
    size = 4096
    while True:
        buf = ffi.new("char[]", size)
        err = lib.aiodat_if_addresses(netdev.encode(), buf, size)
        if err != 28:  # ENOSPC: a netdev with very many addresses
            break
        size *= 4
    if err:
        return []
    return order_addresses(ffi.string(buf).decode().split())


def _rank(address: str) -> int:
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 4:
        return 0
    return 2 if ip.is_link_local else 1


def order_addresses(addresses: Sequence[str]) -> List[str]:
    """IPv4 first, then global IPv6, then link-local IPv6, each group in the order given."""
    return sorted(_unique(addresses), key=_rank)


def ipv4_of_gids(gids: Sequence[str]) -> List[str]:
    """The IPv4 addresses in a RoCE GID table (its IPv4-mapped GIDs)."""
    out = []
    for gid in gids:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped
        if mapped is not None:
            out.append(str(mapped))
    return _unique(out)


def port_addresses(device: str, port: int, gids: Mapping[int, str]) -> List[str]:
    """Every IP address rdma_cm can use on ``device`` port ``port``, the preferred one first.

    ``gids`` maps the port's valid GID table indexes to their GIDs.
    """
    found: List[str] = []
    for netdev in port_netdevs(device, port, indexes=sorted(gids)):
        found.extend(netdev_addresses(netdev))
    return order_addresses(found) if found else ipv4_of_gids(list(gids.values()))


def same_address(a: str, b: str) -> bool:
    """Whether two address strings name the same address (``::1`` and ``0::1``; IPv6 scopes compared by text)."""
    try:
        ha, _, sa = a.partition("%")
        hb, _, sb = b.partition("%")
        return ipaddress.ip_address(ha) == ipaddress.ip_address(hb) and (sa == sb or not sa or not sb)
    except ValueError:
        return a == b
