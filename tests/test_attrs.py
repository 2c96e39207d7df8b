"""aiodat.attrs: the dat_ia_query result built from verbs query dicts (values of the rxe sample)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict

import pytest
from pure_modules import load as _load


A = _load("attrs")
E = _load("errors")

NODE_GUID = 0x7802A6FFFE139A74  # "7802:a6ff:fe13:9a74" in tests/data/rxe-devinfo-6.1.txt

# struct ibv_device_attr of rxe0, from tests/data/rxe-devinfo-6.1.txt, as the C struct holds it
DEVICE_ATTR: Dict[str, Any] = {
    "fw_ver": "0.0.0",
    "node_guid": A.guid_to_be64(NODE_GUID),  # __be64 read as uint64_t
    "sys_image_guid": A.guid_to_be64(NODE_GUID),
    "max_mr_size": 0xFFFFFFFFFFFFFFFF,
    "page_size_cap": 0xFFFFF000,
    "vendor_id": 0xFFFFFF,
    "vendor_part_id": 0,
    "hw_ver": 0x0,
    "max_qp": 1048560,
    "max_qp_wr": 1048576,
    "device_cap_flags": 0x01223C76,
    "max_sge": 32,
    "max_sge_rd": 32,
    "max_cq": 1048576,
    "max_cqe": 32767,
    "max_mr": 524287,
    "max_pd": 1048576,
    "max_qp_rd_atom": 128,
    "max_ee_rd_atom": 0,
    "max_res_rd_atom": 258048,
    "max_qp_init_rd_atom": 128,
    "max_ee_init_rd_atom": 0,
    "atomic_cap": 1,
    "max_ee": 0,
    "max_rdd": 0,
    "max_mw": 524287,
    "max_raw_ipv6_qp": 0,
    "max_raw_ethy_qp": 0,
    "max_mcast_grp": 8192,
    "max_mcast_qp_attach": 56,
    "max_total_mcast_qp_attach": 458752,
    "max_ah": 32767,
    "max_fmr": 0,
    "max_map_per_fmr": 0,
    "max_srq": 917503,
    "max_srq_wr": 1048576,
    "max_srq_sge": 27,
    "max_pkeys": 64,
    "local_ca_ack_delay": 15,
    "phys_port_cnt": 1,
}

# struct ibv_port_attr of rxe0 port 1, from the same sample
PORT_ATTR: Dict[str, Any] = {
    "state": 4,
    "max_mtu": 5,
    "active_mtu": 3,
    "gid_tbl_len": 1024,
    "port_cap_flags": 0x00010000,
    "max_msg_sz": 0x800000,
    "bad_pkey_cntr": 0,
    "qkey_viol_cntr": 0,
    "pkey_tbl_len": 1,
    "lid": 0,
    "sm_lid": 0,
    "lmc": 0,
    "max_vl_num": 1,
    "sm_sl": 0,
    "subnet_timeout": 0,
    "init_type_reply": 0,
    "active_width": 1,
    "active_speed": 1,
    "phys_state": 5,
    "link_layer": 2,
    "flags": 0,
    "port_cap_flags2": 0,
}

GIDS = ["fe80::7802:a6ff:fe13:9a74", "::ffff:169.254.77.1"]

# Every attribute seed 000 (dat_ia_query(3DAT)) lists, as the DAT member name in snake_case.
SEED_IA_ATTRS = [
    "adapter_name",  # Adapter name
    "vendor_name",  # Vendor name
    "hardware_version_major",  # HW version major
    "hardware_version_minor",  # HW version minor
    "firmware_version_major",  # Firmware version major
    "firmware_version_minor",  # Firmware version minor
    "ia_address_ptr",  # IA_address_ptr
    "max_eps",  # Max EPs
    "max_dto_per_ep",  # Max DTOs per EP
    "max_rdma_read_per_ep_in",  # Max incoming RDMA Reads per EP
    "max_rdma_read_per_ep_out",  # Max outgoing RDMA Reads per EP
    "max_evds",  # Max EVDs
    "max_evd_qlen",  # Max EVD queue size
    "max_iov_segments_per_dto",  # Max IOV segments per DTO
    "max_lmrs",  # Max LMRs
    "max_lmr_block_size",  # Max LMR block size
    "max_lmr_virtual_address",  # Mac LMR VA
    "max_pzs",  # Max PZs
    "max_mtu_size",  # Max MTU size (DAT 1.x name of max_message_size)
    "max_message_size",
    "max_rdma_size",  # Max RDMA size
    "max_rmrs",  # Max RMRs
    "max_rmr_target_address",  # Max RMR target address
    "num_transport_attr",  # Num transport attributes
    "transport_attr",  # Transport-specific attributes
    "num_vendor_attr",  # Num vendor attributes
    "vendor_attr",  # Vendor-specific attributes
]
SEED_PROVIDER_ATTRS = [
    "provider_name",  # Provider name
    "provider_version_major",  # Provider version major
    "provider_version_minor",  # Provider version minor
    "dapl_version_major",  # DAPL API version major
    "dapl_version_minor",  # DAPL API version minor
    "lmr_mem_types_supported",  # LMR memory types supported
    "iov_ownership_on_return",  # IOV ownership
    "dat_qos_supported",  # QOS supported
    "completion_flags_supported",  # Completion flags supported
    "is_thread_safe",  # Thread safety
    "max_private_data_size",  # Max private data size
    "supports_multipath",  # Multipathing support
    "ep_creator",  # EP creator for PSP
    "pz_support",  # PZ support
    "optimal_buffer_alignment",  # Optimal Buffer Alignment
    "evd_stream_merging_supported",  # EVD stream merging support
    "num_provider_specific_attr",  # Num provider attributes
    "provider_specific_attr",  # Provider-specific attributes
]
# members DAT 1.2 / 2.0 (dat.h, udat.h) add beyond the seed
DAT2_IA_ATTRS = [
    "ia_address", "max_srqs", "max_ep_per_srq", "max_recv_per_srq", "max_iov_segments_per_rdma_read",
    "max_iov_segments_per_rdma_write", "max_rdma_read_in", "max_rdma_read_out",
    "max_rdma_read_per_ep_in_guaranteed", "max_rdma_read_per_ep_out_guaranteed", "zb_supported",
    "extension_supported", "extension_version",
]
DAT2_PROVIDER_ATTRS = [
    "srq_supported", "srq_watermarks_supported", "srq_ep_pz_difference_supported", "srq_info_supported",
    "ep_recv_info_supported", "lmr_sync_req", "dto_async_return_guaranteed", "rdma_write_for_rdma_read_req",
    "rdma_read_lmr_rmr_context_exposure", "rmr_scope_supported", "is_signal_safe", "ha_supported",
    "ha_loadbalancing",
]


def build(**over: Any) -> Any:
    kwargs: Dict[str, Any] = dict(
        ia_name="rxe0",
        device_name="rxe0",
        port_num=1,
        device_attr=dict(DEVICE_ATTR),
        port_attr=dict(PORT_ATTR),
        gids=list(GIDS),
        ia_address="169.254.77.1",
        provider_consts=A.default_provider_consts("0.1.0"),
    )
    kwargs.update(over)
    return A.build_ia_query(**kwargs)


@pytest.fixture(scope="module")
def q() -> Any:
    return build()


def test_every_seed_attribute_exists(q: Any) -> None:
    for name in SEED_IA_ATTRS + DAT2_IA_ATTRS:
        assert hasattr(q.ia_attr, name), name
    for name in SEED_PROVIDER_ATTRS + DAT2_PROVIDER_ATTRS:
        assert hasattr(q.provider_attr, name), name


def test_ia_attr_values_from_the_device(q: Any) -> None:
    ia = q.ia_attr
    assert ia.adapter_name == "rxe0"
    assert ia.vendor_name is None  # rxe's vendor_id 0xffffff names no vendor: DAT_VALUE_UNKNOWN
    assert (ia.hardware_version_major, ia.hardware_version_minor) == (0, None)
    assert (ia.firmware_version_major, ia.firmware_version_minor) == (0, 0)
    assert ia.ia_address == ia.ia_address_ptr == "169.254.77.1"
    assert ia.max_eps == 1048560
    assert ia.max_dto_per_ep == 1048576
    assert ia.max_rdma_read_per_ep_in == ia.max_rdma_read_per_ep == 128
    assert ia.max_rdma_read_per_ep_out == 128
    assert ia.max_evds == 1048576
    assert ia.max_evd_qlen == 32767
    assert ia.max_iov_segments_per_dto == 32
    assert ia.max_lmrs == 524287
    assert ia.max_lmr_block_size == 0xFFFFFFFFFFFFFFFF
    assert ia.max_lmr_virtual_address == ia.max_rmr_target_address == 2**64 - 1
    assert ia.max_pzs == 1048576
    assert ia.max_message_size == ia.max_mtu_size == ia.max_rdma_size == 0x800000
    assert ia.max_rmrs == 524287
    assert ia.max_srqs == 917503
    assert ia.max_ep_per_srq == 1048560
    assert ia.max_recv_per_srq == 1048576
    assert ia.max_iov_segments_per_rdma_read == ia.max_iov_segments_per_rdma_write == 32
    assert ia.max_rdma_read_in == 258048
    assert ia.max_rdma_read_out is None
    assert ia.zb_supported is False
    assert ia.extension_supported == "DAT_EXTENSION_NONE"
    assert ia.num_vendor_attr == len(ia.vendor_attr) > 0
    assert dict(ia.vendor_attr)["vendor_id"] == "0xffffff"
    assert ia.num_transport_attr == len(ia.transport_attr.named_attrs())


def test_transport_attr_holds_every_verbs_field(q: Any) -> None:
    ta = q.ia_attr.transport_attr
    for name in A.DEVICE_ATTR_FIELDS:
        if name in ("node_guid", "sys_image_guid"):
            assert getattr(ta, name) == NODE_GUID  # the GUID number, be64toh applied
        else:
            assert getattr(ta, name) == DEVICE_ATTR[name], name
    for name in A.PORT_ATTR_FIELDS:
        assert getattr(ta.port, name) == PORT_ATTR[name], name
    assert ta.device_name == "rxe0" and ta.port_num == ta.port.port_num == 1
    assert ta.node_guid_str == ta.sys_image_guid_str == "7802:a6ff:fe13:9a74"
    assert ta.device_cap_flags_names == (
        "BAD_PKEY_CNTR", "BAD_QKEY_CNTR", "AUTO_PATH_MIG", "CHANGE_PHY_PORT", "UD_AV_PORT_ENFORCE",
        "PORT_ACTIVE_EVENT", "SYS_IMAGE_GUID", "RC_RNR_NAK_GEN", "SRQ_RESIZE", "MEM_WINDOW",
        "MEM_MGT_EXTENSIONS", "MEM_WINDOW_TYPE_2B",
    )
    assert ta.atomic_cap_name == "ATOMIC_HCA"
    assert ta.port.state_name == "PORT_ACTIVE"
    assert ta.port.phys_state_name == "LINK_UP"
    assert (ta.port.max_mtu_bytes, ta.port.active_mtu_bytes) == (4096, 1024)
    assert ta.port.link_layer_name == "Ethernet"
    assert ta.port.active_width_name == "1X" and ta.port.active_speed_name == "2.5 Gbps"
    assert ta.port.port_cap_flags_names == ("CM_SUP",)
    assert ta.port.port_cap_flags2_names == ()
    assert ta.gids == tuple(GIDS)
    assert [g.index for g in ta.gid_table] == [0, 1]
    named = dict(ta.named_attrs())
    assert named["node_guid"] == "7802:a6ff:fe13:9a74"
    assert named["port_max_msg_sz"] == str(0x800000)
    assert named["gid[1]"] == "::ffff:169.254.77.1"


def test_provider_attr_defaults(q: Any) -> None:
    pa = q.provider_attr
    assert pa.provider_name == "aiodat"
    assert (pa.provider_version_major, pa.provider_version_minor) == (0, 1)
    assert (pa.dapl_version_major, pa.dapl_version_minor) == (2, 0)
    assert pa.lmr_mem_types_supported == frozenset({"DAT_MEM_TYPE_VIRTUAL"})
    assert pa.iov_ownership_on_return == "DAT_IOV_CONSUMER"
    assert "DAT_QOS_BEST_EFFORT" in pa.dat_qos_supported
    assert pa.completion_flags_supported >= {
        "DAT_COMPLETION_SUPPRESS_FLAG", "DAT_COMPLETION_UNSIGNALLED_FLAG",
        "DAT_COMPLETION_SOLICITED_WAIT_FLAG", "DAT_COMPLETION_BARRIER_FENCE_FLAG",
    }
    assert pa.is_thread_safe is False
    assert pa.max_private_data_size == 56  # rdma_cm REQ private data on IB/RoCE, raw
    assert pa.ep_creator == "DAT_PSP_CREATES_EP_NEVER"
    assert pa.pz_support == "DAT_PZ_UNIQUE"
    assert pa.optimal_buffer_alignment > 0 and 256 % pa.optimal_buffer_alignment == 0
    assert all(all(row) for row in pa.evd_stream_merging_supported)
    assert pa.can_merge("DAT_EVD_DTO_FLAG", "DAT_EVD_CONNECTION_FLAG")
    with pytest.raises(E.InvalidParameter):
        pa.can_merge("DTO", "CONN")
    assert pa.srq_supported is True
    assert pa.srq_watermarks_supported == A.SRQ_WATERMARK_LOW
    assert pa.rdma_write_for_rdma_read_req is False  # InfiniBand/RoCE
    # rxe has MEM_WINDOW and MEM_WINDOW_TYPE_2B, but aiodat's windows are type 2, used through
    # the binding QP alone (it used to say ANY, from the device's flags)
    assert pa.rmr_scope_supported == "DAT_RMR_SCOPE_EP"
    assert pa.ha_loadbalancing == "DAT_HA_LB_NONE"
    assert pa.num_provider_specific_attr == len(pa.provider_specific_attr)
    assert dict(pa.provider_specific_attr)["max_private_data_size_accept"] == "196"


def test_as_dict_is_json(q: Any) -> None:
    d = q.as_dict()
    back = json.loads(json.dumps(d))
    assert back == d
    ia, pa = d["ia_attr"], d["provider_attr"]
    for name in SEED_IA_ATTRS + DAT2_IA_ATTRS:
        if name not in ("ia_address_ptr", "max_mtu_size"):  # aliases are not repeated
            assert name in ia, name
    for name in SEED_PROVIDER_ATTRS + DAT2_PROVIDER_ATTRS:
        assert name in pa, name
    assert ia["max_rdma_read_out"] is None
    assert ia["num_transport_attr"] == q.ia_attr.num_transport_attr
    assert ia["vendor_attr"]["node_guid"] == "7802:a6ff:fe13:9a74"
    ta = ia["transport_attr"]
    assert ta["max_qp"] == 1048560
    assert ta["node_guid_str"] == "7802:a6ff:fe13:9a74"
    assert ta["atomic_cap_name"] == "ATOMIC_HCA"
    assert "MEM_WINDOW" in ta["device_cap_flags_names"]
    assert ta["port"]["state_name"] == "PORT_ACTIVE"
    assert ta["port"]["active_mtu_bytes"] == 1024
    assert ta["port"]["link_layer_name"] == "Ethernet"
    assert ta["gids"] == GIDS
    assert ta["gid_table"][0] == {"index": 0, "gid": GIDS[0], "gid_type": None}
    assert pa["iov_ownership_on_return"] == "DAT_IOV_CONSUMER"
    assert pa["lmr_mem_types_supported"] == ["DAT_MEM_TYPE_VIRTUAL"]
    assert pa["completion_flags_supported"] == sorted(pa["completion_flags_supported"])
    assert pa["evd_stream_merging_supported"]["DAT_EVD_DTO_FLAG"]["DAT_EVD_ASYNC_FLAG"] is True
    assert pa["provider_specific_attr"]["max_private_data_size_reject"] == "148"
    assert pa["num_provider_specific_attr"] == 3


def test_results_are_frozen(q: Any) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.ia_attr.max_eps = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.provider_attr.is_thread_safe = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.ia_attr.transport_attr.port.state = 1
    assert hash(q.ia_attr.transport_attr.port) == hash(q.ia_attr.transport_attr.port)


def test_missing_or_unknown_keys_name_the_key() -> None:
    dev = dict(DEVICE_ATTR)
    del dev["max_srq_sge"]
    with pytest.raises(E.InvalidParameter, match="max_srq_sge"):
        build(device_attr=dev)
    port = dict(PORT_ATTR, bogus=1)
    with pytest.raises(E.InvalidParameter, match="bogus"):
        build(port_attr=port)
    with pytest.raises(ValueError, match="max_qp"):
        build(device_attr=dict(DEVICE_ATTR, max_qp="lots"))
    with pytest.raises(E.InvalidParameter, match="ep_creatr"):
        build(provider_consts={"ep_creatr": "DAT_PSP_CREATES_EP_NEVER"})
    with pytest.raises(E.InvalidParameter, match="DAT_IOV_CONSUMER"):
        build(provider_consts={"iov_ownership_on_return": "consumer"})
    with pytest.raises(E.InvalidParameter, match="DAT_COMPLETION_FANCY_FLAG"):
        build(provider_consts={"completion_flags_supported": {"DAT_COMPLETION_FANCY_FLAG"}})
    with pytest.raises(E.InvalidParameter, match=r"completion_flags_supported'\] must be a set of names"):
        build(provider_consts={"completion_flags_supported": [["unhashable"]]})  # (was a bare TypeError)
    with pytest.raises(E.InvalidParameter, match="GID"):
        build(gids=["not-a-gid"])


def test_provider_consts_override_and_defaults() -> None:
    q = build(provider_consts={"is_thread_safe": True, "max_private_data_size": 64})
    assert q.provider_attr.is_thread_safe is True
    assert q.provider_attr.max_private_data_size == 64
    assert q.provider_attr.provider_name == "aiodat"  # missing keys take the defaults
    assert set(A.default_provider_consts("1.2.3")) == set(A.PROVIDER_CONST_KEYS)
    consts = A.default_provider_consts("1.2.3")
    assert (consts["provider_version_major"], consts["provider_version_minor"]) == (1, 2)
    merged = build(provider_consts={"evd_stream_merging_supported": False}).provider_attr
    assert merged.can_merge("DAT_EVD_DTO_FLAG", "DAT_EVD_DTO_FLAG")  # the diagonal is always 1
    assert not merged.can_merge("DAT_EVD_DTO_FLAG", "DAT_EVD_CR_FLAG")


def test_device_limits_shape_provider_attrs() -> None:
    no_srq = build(device_attr=dict(DEVICE_ATTR, max_srq=0))
    assert no_srq.provider_attr.srq_supported is False
    assert no_srq.provider_attr.srq_watermarks_supported == 0
    assert no_srq.ia_attr.max_srqs == 0
    type1_only = build(device_attr=dict(DEVICE_ATTR, device_cap_flags=1 << 17))
    assert type1_only.provider_attr.rmr_scope_supported is None  # aiodat allocates type-2 windows only
    type2_only = build(device_attr=dict(DEVICE_ATTR, device_cap_flags=1 << 24))
    assert type2_only.provider_attr.rmr_scope_supported == "DAT_RMR_SCOPE_EP"
    no_mw = build(device_attr=dict(DEVICE_ATTR, max_mw=0))
    assert no_mw.provider_attr.rmr_scope_supported is None
    iwarp = build(transport="iWARP")
    assert iwarp.provider_attr.rdma_write_for_rdma_read_req is True
    assert iwarp.ia_attr.transport_attr.transport == "iWARP"


def test_value_decoding() -> None:
    mlx = build(device_attr=dict(DEVICE_ATTR, vendor_id=0x02C9, fw_ver="16.35.2000", hw_ver=0x10))
    assert mlx.ia_attr.vendor_name == "Mellanox Technologies"
    assert (mlx.ia_attr.firmware_version_major, mlx.ia_attr.firmware_version_minor) == (16, 35)
    assert mlx.ia_attr.hardware_version_major == 0x10
    nofw = build(device_attr=dict(DEVICE_ATTR, fw_ver=""))
    assert (nofw.ia_attr.firmware_version_major, nofw.ia_attr.firmware_version_minor) == (None, None)
    raw_guid = build(device_attr=dict(DEVICE_ATTR, node_guid=NODE_GUID.to_bytes(8, "big")))
    assert raw_guid.ia_attr.transport_attr.node_guid_str == "7802:a6ff:fe13:9a74"
    assert A.guid_from_be64(A.guid_to_be64(NODE_GUID)) == NODE_GUID
    unknown_flag = build(device_attr=dict(DEVICE_ATTR, device_cap_flags=(1 << 1) | (1 << 31)))
    assert unknown_flag.ia_attr.transport_attr.device_cap_flags_names == ("BAD_PKEY_CNTR", "0x80000000")
    ib_port = build(port_attr=dict(PORT_ATTR, link_layer=0, active_width=2, active_speed=32, state=1))
    port = ib_port.ia_attr.transport_attr.port
    assert (port.link_layer_name, port.active_width_name, port.active_speed_name, port.state_name) == (
        "InfiniBand", "4X", "25.0 Gbps", "PORT_DOWN",
    )


def test_gid_forms() -> None:
    raw = bytes.fromhex("fe800000000000007802a6fffe139a74")
    q = build(gids=[raw, b"\0" * 16, "fe80:0000:0000:0000:0000:0000:0000:0001"])
    table = q.ia_attr.transport_attr.gid_table
    assert [(g.index, g.gid) for g in table] == [(0, "fe80::7802:a6ff:fe13:9a74"), (2, "fe80::1")]
    sparse = build(gids=[(3, "fe80::1", "RoCE v2"), (7, "::ffff:10.0.0.1")])
    assert [(g.index, g.gid, g.gid_type) for g in sparse.ia_attr.transport_attr.gid_table] == [
        (3, "fe80::1", "RoCE v2"), (7, "::ffff:10.0.0.1", None),
    ]
    assert A.normalize_gid("::FFFF:169.254.77.1") == "::ffff:169.254.77.1"
    assert build(ia_address=None).ia_attr.ia_address is None
