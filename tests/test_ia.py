"""Issue 2: the registry, open_ia/close, use after close, ia.query() against ibv_devinfo, the ImportError."""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every attribute seed 000 (dat_ia_query(3DAT)) lists, in snake case.
SEED_IA_ATTRS = [
    "adapter_name", "vendor_name", "hardware_version_major", "hardware_version_minor",
    "firmware_version_major", "firmware_version_minor", "ia_address_ptr", "max_eps", "max_dto_per_ep",
    "max_rdma_read_per_ep_in", "max_rdma_read_per_ep_out", "max_evds", "max_evd_qlen",
    "max_iov_segments_per_dto", "max_lmrs", "max_lmr_block_size", "max_lmr_virtual_address", "max_pzs",
    "max_mtu_size", "max_rdma_size", "max_rmrs", "max_rmr_target_address", "num_transport_attr",
    "transport_attr", "num_vendor_attr", "vendor_attr",
    # named in issue 2
    "max_message_size", "max_srqs", "max_recv_per_srq",
]
SEED_PROVIDER_ATTRS = [
    "provider_name", "provider_version_major", "provider_version_minor", "dapl_version_major",
    "dapl_version_minor", "lmr_mem_types_supported", "iov_ownership_on_return", "dat_qos_supported",
    "completion_flags_supported", "is_thread_safe", "max_private_data_size", "supports_multipath",
    "ep_creator", "pz_support", "optimal_buffer_alignment", "evd_stream_merging_supported",
    "num_provider_specific_attr", "provider_specific_attr",
]


# -- host-only ------------------------------------------------------------------------


def test_import_error_names_debian_packages(tmp_path: Path) -> None:
    """Without the compiled shim, ``import aiodat`` raises an ImportError saying what to apt-get install."""
    script = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "aiodat._shim._core":
                    raise ImportError("libibverbs.so.1: cannot open shared object file (simulated)")
                return None

        sys.meta_path.insert(0, Block())
        try:
            import aiodat
        except ImportError as exc:
            print("IMPORTERROR:", exc)
            sys.exit(0)
        print("imported without the shim")
        sys.exit(1)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    message = proc.stdout
    assert "IMPORTERROR:" in message
    for package in ("rdma-core", "libibverbs", "apt-get install"):
        assert package in message, message
    assert "simulated" in message  # the underlying reason is kept


def test_query_masks_are_documented_as_unnecessary() -> None:
    import aiodat

    doc = aiodat.IA.query.__doc__ or ""
    assert "mask" in doc and "unnecessary" in doc


def test_open_ia_rejects_non_string_name() -> None:
    import aiodat

    with pytest.raises(aiodat.InvalidParameter):
        aiodat.open_ia("")
    with pytest.raises(aiodat.InvalidParameter):
        aiodat.open_ia(3)  # type: ignore[arg-type]


# -- on the device ---------------------------------------------------------------------

def _device(rdma_device: Any) -> str:
    return rdma_device.name.partition(":")[0]


@pytest.mark.rxe
def test_list_providers_on_device(rdma_device: Any) -> None:
    import aiodat

    providers = aiodat.list_providers()
    device = _device(rdma_device)
    mine = [p for p in providers if p.device == device]
    assert mine, f"{device} not in {providers}"
    first = mine[0]
    assert first.name == device and first.port == 1
    assert first.state == "PORT_ACTIVE"
    assert first.link_layer == "Ethernet"  # rxe is RoCE
    mapped = {str(ipaddress.IPv6Address(g).ipv4_mapped) for g in first.gids
              if ipaddress.IPv6Address(g).ipv4_mapped is not None}
    assert rdma_device.address in mapped, first.gids
    # every name the registry gives opens, as does the explicit "dev:1" form
    for name in (first.name, f"{device}:1"):
        with aiodat.open_ia(name) as ia:
            assert ia.device_name == device and ia.port == 1
            assert ia.address == rdma_device.address


@pytest.mark.rxe
def test_unknown_name_lists_existing(rdma_device: Any) -> None:
    import aiodat

    with pytest.raises(aiodat.ProviderNotFound) as info:
        aiodat.open_ia("nosuchdev0")
    assert isinstance(info.value, LookupError)
    assert "nosuchdev0" in str(info.value)
    assert _device(rdma_device) in str(info.value)


@pytest.mark.rxe
def test_bad_port_raises(rdma_device: Any) -> None:
    import aiodat

    with pytest.raises(aiodat.ProviderNotFound) as info:
        aiodat.open_ia(f"{_device(rdma_device)}:9")
    assert "port 9" in str(info.value)
    with pytest.raises(aiodat.InvalidParameter):
        aiodat.open_ia(f"{_device(rdma_device)}:x")


@pytest.mark.rxe
def test_ro_aware_prefix(rdma_device: Any) -> None:
    import aiodat

    device = _device(rdma_device)
    with aiodat.open_ia(device) as plain, aiodat.open_ia(aiodat.ia.RO_AWARE_PREFIX + device) as ro:
        assert ro.ro_aware is True and plain.ro_aware is False
        assert ro.device_name == plain.device_name == device
        assert ro.query().ia_attr.transport_attr.node_guid == plain.query().ia_attr.transport_attr.node_guid


@pytest.mark.rxe
def test_with_closes(rdma_device: Any) -> None:
    import aiodat

    with aiodat.open_ia(rdma_device.name) as ia:
        assert not ia.closed
        assert ia.async_evd is not None and not ia.async_evd.closed
    assert ia.closed and ia.async_evd.closed


@pytest.mark.rxe
async def test_async_with_closes(rdma_device: Any) -> None:
    import aiodat

    async with aiodat.open_ia(rdma_device.name) as ia:
        assert ia.query().ia_attr.adapter_name
    assert ia.closed


@pytest.mark.rxe
def test_double_close_is_noop(rdma_device: Any) -> None:
    import aiodat

    ia = aiodat.open_ia(rdma_device.name)
    ia.create_pz()
    ia.close()
    assert ia.closed
    ia.close()  # no error, nothing happens
    assert ia.closed


@pytest.mark.rxe
async def test_every_method_after_close_raises_invalid_handle(rdma_device: Any) -> None:
    import aiodat

    ia = aiodat.open_ia(rdma_device.name)
    pz = ia.create_pz()
    evd = ia.create_evd(4)
    ia.close()
    calls = [
        ("query", lambda: ia.query()),
        ("create_pz", lambda: ia.create_pz()),
        ("create_evd", lambda: ia.create_evd(4)),
        ("create_ep", lambda: ia.create_ep(pz)),
        ("create_psp", lambda: ia.create_psp(18515, evd)),
        ("create_psp_any", lambda: ia.create_psp_any(evd)),
        ("create_srq", lambda: ia.create_srq(pz, 4)),
        ("__enter__", lambda: ia.__enter__()),
    ]
    for name, call in calls:
        with pytest.raises(aiodat.InvalidHandle):
            call()
            pytest.fail(f"ia.{name} after close did not raise")
    with pytest.raises(aiodat.InvalidHandle):
        await ia.__aenter__()
    with pytest.raises(aiodat.InvalidHandle):
        ia.async_evd.dequeue()


@pytest.mark.rxe
def test_query_has_every_seed_attribute(ia: Any) -> None:
    q = ia.query()
    for name in SEED_IA_ATTRS:
        assert hasattr(q.ia_attr, name), f"ia_attr.{name} missing"
    for name in SEED_PROVIDER_ATTRS:
        assert hasattr(q.provider_attr, name), f"provider_attr.{name} missing"
    assert q.ia_attr.adapter_name
    assert q.ia_attr.max_eps and q.ia_attr.max_evd_qlen
    assert q.provider_attr.max_private_data_size == 56


def _ibv_devinfo(device: str) -> str:
    tool = shutil.which("ibv_devinfo")
    if tool is None:
        pytest.fail("ibv_devinfo is not installed (Debian package ibverbs-utils)")
    proc = subprocess.run([tool, "-v", "-d", device], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.rxe
def test_query_equals_ibv_devinfo(ia: Any) -> None:
    from aiodat.devinfo import diff_transport_attr, parse_devinfo

    text = _ibv_devinfo(ia.device_name)
    devices = [d for d in parse_devinfo(text) if d.name == ia.device_name]
    assert len(devices) == 1, text
    dev = devices[0]
    assert len(dev.attr) > 30 and dev.ports[ia.port].attr, "ibv_devinfo output not parsed"
    q = ia.query()
    ta = q.ia_attr.transport_attr
    assert diff_transport_attr(ta, dev) == []
    # the DAT-level figures are derived from the same verbs values
    assert q.ia_attr.max_eps == dev.attr["max_qp"]
    assert q.ia_attr.max_evd_qlen == dev.attr["max_cqe"]
    assert q.ia_attr.max_pzs == dev.attr["max_pd"]
    assert q.ia_attr.max_lmrs == dev.attr["max_mr"]
    assert q.ia_attr.max_message_size == dev.ports[ia.port].attr["max_msg_sz"]
    assert {g.gid for g in dev.ports[ia.port].gids} <= set(ta.gids)


@pytest.mark.rxe
def test_gids_are_the_ports_gid_table(ia: Any) -> None:
    """The GIDs an IA reports (its query, and list_providers) are exactly the port's valid GID
    table entries as the kernel shows them in sysfs, in index order: none lost, none doubled, none
    of another port (aiodat reads the whole table in one ibv_query_gid_table call)."""
    import aiodat

    table = Path(f"/sys/class/infiniband/{ia.device_name}/ports/{ia.port}/gids")
    expected = []
    for entry in sorted(table.iterdir(), key=lambda e: int(e.name)):
        gid = ipaddress.IPv6Address(entry.read_text().strip())
        if int(gid):
            expected.append(gid)
    assert expected, f"no valid GID in {table}"
    got = [ipaddress.IPv6Address(g) for g in ia.query().ia_attr.transport_attr.gids]
    assert got == expected
    listed = [p for p in aiodat.list_providers() if p.device == ia.device_name and p.port == ia.port]
    assert [ipaddress.IPv6Address(g) for g in listed[0].gids] == expected


def _sysfs_gid_table(device: str, port: int) -> list:
    """The port's valid GID table entries as (index, GID), as the kernel shows them."""
    table = Path(f"/sys/class/infiniband/{device}/ports/{port}/gids")
    entries = [(int(e.name), ipaddress.IPv6Address(e.read_text().strip())) for e in table.iterdir()]
    return sorted((i, gid) for i, gid in entries if int(gid))


def _wait_for_gid(device: str, port: int, gid: str, present: bool) -> None:
    import time

    deadline = time.monotonic() + 30  # the kernel updates RoCE GID tables from a workqueue
    while (ipaddress.IPv6Address(gid) in {g for _, g in _sysfs_gid_table(device, port)}) != present:
        assert time.monotonic() < deadline, f"GID {gid} {'never appeared' if present else 'never went'}"
        time.sleep(0.05)


@pytest.mark.rxe
def test_gid_indexes_survive_a_hole_in_the_table(ia: Any) -> None:
    """An address removed from a RoCE netdev leaves a hole in the port's GID table; the entries
    after it keep their table index in ia.query(), list_providers() and the per-index fallback
    (which crashed: it read .raw of a cdata array).  They used to be numbered by position."""
    import aiodat
    from aiodat import ia as ia_module

    provider = next(p for p in aiodat.list_providers() if p.device == ia.device_name and p.port == ia.port)
    if provider.link_layer != "Ethernet" or os.geteuid() != 0:
        pytest.skip("needs a RoCE port and root to add addresses to its netdev (run under aiodat rxe run)")
    netdev = Path(f"/sys/class/infiniband/{ia.device_name}/ports/{ia.port}/gid_attrs/ndevs/0").read_text().strip()
    first, second = "fd5a:da7::1", "fd5a:da7::2"
    for gid in (first, second):
        subprocess.run(["ip", "-6", "addr", "add", f"{gid}/128", "dev", netdev, "nodad"], check=True)
        _wait_for_gid(ia.device_name, ia.port, gid, present=True)
    try:
        subprocess.run(["ip", "-6", "addr", "del", f"{first}/128", "dev", netdev], check=True)
        _wait_for_gid(ia.device_name, ia.port, first, present=False)
        expected = _sysfs_gid_table(ia.device_name, ia.port)
        indexes = [i for i, _ in expected]
        assert indexes != list(range(len(indexes))), f"no hole in the GID table: {expected}"
        got = [(g.index, ipaddress.IPv6Address(g.gid)) for g in ia.query().ia_attr.transport_attr.gid_table]
        assert got == expected
        listed = next(p for p in aiodat.list_providers() if p.device == ia.device_name and p.port == ia.port)
        assert list(zip(listed.gid_indexes, map(ipaddress.IPv6Address, listed.gids))) == expected
        table_len = ia._port_attr().gid_tbl_len
        one_by_one = ia_module._gids_one_by_one(ia._context, ia.port, table_len)
        assert [(i, ipaddress.IPv6Address(g)) for i, g in one_by_one.items()] == expected
    finally:
        subprocess.run(["ip", "-6", "addr", "del", f"{second}/128", "dev", netdev], check=False)


@pytest.mark.rxe
def test_unclosed_ia_warns_and_frees_fds(rdma_device: Any) -> None:
    import gc

    import aiodat

    aiodat.open_ia(rdma_device.name).close()  # librdmacm's one-time set-up happens here
    before = len(os.listdir("/proc/self/fd"))
    ia = aiodat.open_ia(rdma_device.name)
    ia.create_pz()
    ia.create_evd(4)
    assert len(os.listdir("/proc/self/fd")) > before
    with pytest.warns(ResourceWarning, match="unclosed ia"):
        del ia
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
