"""aiodat.devinfo: parsing `ibv_devinfo -v` output (sample: rxe on Linux 6.1)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pure_modules import load as _load

SAMPLE = Path(__file__).resolve().parent / "data" / "rxe-devinfo-6.1.txt"


D = _load("devinfo")
A = _load("attrs")


@pytest.fixture(scope="module")
def rxe() -> Any:
    devices = D.parse_devinfo(SAMPLE.read_text())
    assert [d.name for d in devices] == ["rxe0"]
    return devices[0]


def test_device_fields(rxe: Any) -> None:
    assert rxe.transport == "InfiniBand" and rxe.transport_type == 0
    a = rxe.attr
    assert a["fw_ver"] == "0.0.0"
    assert A.guid_from_be64(a["node_guid"]) == 0x7802A6FFFE139A74  # stored as the C struct holds it
    assert A.format_guid(A.guid_from_be64(a["sys_image_guid"])) == "7802:a6ff:fe13:9a74"
    assert a["vendor_id"] == 0xFFFFFF and a["vendor_part_id"] == 0 and a["hw_ver"] == 0
    assert a["phys_port_cnt"] == 1
    assert a["max_mr_size"] == 0xFFFFFFFFFFFFFFFF
    assert a["page_size_cap"] == 0xFFFFF000
    assert a["max_qp"] == 1048560 and a["max_qp_wr"] == 1048576
    assert a["device_cap_flags"] == 0x01223C76
    assert a["max_sge"] == a["max_sge_rd"] == 32
    assert a["max_cqe"] == 32767
    assert a["max_res_rd_atom"] == 258048
    assert a["atomic_cap"] == 1
    assert a["max_mcast_qp_attach"] == 56
    assert a["max_srq"] == 917503 and a["max_srq_sge"] == 27
    assert a["local_ca_ack_delay"] == 15
    assert "max_map_per_fmr" not in a  # ibv_devinfo prints it only when max_fmr != 0
    assert set(a) <= set(A.DEVICE_ATTR_FIELDS)
    assert set(A.DEVICE_ATTR_FIELDS) - set(a) == {"max_map_per_fmr"}


def test_cap_flags_and_extras(rxe: Any) -> None:
    assert rxe.device_cap_flags_names == (
        "BAD_PKEY_CNTR", "BAD_QKEY_CNTR", "AUTO_PATH_MIG", "CHANGE_PHY_PORT", "UD_AV_PORT_ENFORCE",
        "PORT_ACTIVE_EVENT", "SYS_IMAGE_GUID", "RC_RNR_NAK_GEN", "SRQ_RESIZE", "MEM_WINDOW",
        "MEM_MGT_EXTENSIONS", "MEM_WINDOW_TYPE_2B",
    )
    assert rxe.raw["rc_odp_caps"] == "NO SUPPORT"
    assert rxe.raw["device_cap_flags_ex"] == "0x1223C76"
    assert rxe.raw["rss_caps.rx_hash_fields_mask"] == "0x0"
    assert rxe.raw["packet_pacing_caps.qp_rate_limit_max"] == "0kbps"
    assert rxe.raw["num_comp_vectors"] == "2"
    assert "tag matching not supported" in rxe.raw


def test_port_fields(rxe: Any) -> None:
    assert list(rxe.ports) == [1]
    port = rxe.ports[1]
    p = port.attr
    assert p["state"] == 4  # PORT_ACTIVE (4)
    assert p["max_mtu"] == 5 and p["active_mtu"] == 3  # 4096 (5), 1024 (3)
    assert p["lid"] == 0 and p["sm_lid"] == 0 and p["lmc"] == 0
    assert p["link_layer"] == 2  # Ethernet
    assert p["max_msg_sz"] == 0x800000
    assert p["port_cap_flags"] == 0x00010000 and p["port_cap_flags2"] == 0
    assert p["max_vl_num"] == 1
    assert p["pkey_tbl_len"] == 1 and p["gid_tbl_len"] == 1024
    assert p["active_width"] == 1 and p["active_speed"] == 1
    assert p["phys_state"] == 5
    assert set(A.PORT_ATTR_FIELDS) - set(p) == {"flags"}  # never printed
    assert port.raw["port_lid"] == "0"
    assert [(g.index, g.gid, g.gid_type) for g in port.gids] == [
        (0, "fe80::7802:a6ff:fe13:9a74", "RoCE v2"),
        (1, "::ffff:169.254.77.1", "RoCE v2"),
    ]


def test_parse_devinfo_device_shape() -> None:
    device, ports = D.parse_devinfo_device(SAMPLE.read_text())
    assert device["max_pd"] == 1048576
    assert ports[1]["gid_tbl_len"] == 1024
    assert D.parse_devinfo_device(SAMPLE.read_text(), "rxe0")[0] == device
    with pytest.raises(LookupError, match="rxe0"):
        D.parse_devinfo_device(SAMPLE.read_text(), "mlx5_0")


def test_query_built_from_the_sample_matches_it(rxe: Any) -> None:
    device = dict(rxe.attr, max_map_per_fmr=0)
    port = dict(rxe.ports[1].attr, flags=0)
    q = A.build_ia_query(
        ia_name="rxe0",
        device_name="rxe0",
        port_num=1,
        device_attr=device,
        port_attr=port,
        gids=[(g.index, g.gid, g.gid_type) for g in rxe.ports[1].gids],
        ia_address="169.254.77.1",
        provider_consts={},
    )
    ta = q.ia_attr.transport_attr
    assert D.diff_transport_attr(ta, rxe) == []
    assert ta.node_guid_str == "7802:a6ff:fe13:9a74"
    assert q.ia_attr.max_message_size == 0x800000
    bad = A.build_ia_query(
        ia_name="rxe0", device_name="rxe0", port_num=1,
        device_attr=dict(device, max_qp=7), port_attr=dict(port, active_mtu=4),
        gids=["fe80::1"], ia_address=None, provider_consts={},
    )
    diff = D.diff_transport_attr(bad.ia_attr.transport_attr, rxe)
    assert any(line.startswith("max_qp:") for line in diff)
    assert any("active_mtu" in line for line in diff)
    assert any("gids" in line for line in diff)


MULTI = """\
hca_id:\tmlx5_0
\ttransport:\t\t\tInfiniBand (0)
\tfw_ver:\t\t\t\t16.35.2000
\tnode_guid:\t\t\t0c42:a103:0065:d2e4
\tsys_image_guid:\t\t\t0c42:a103:0065:d2e4
\tvendor_id:\t\t\t0x02c9
\tvendor_part_id:\t\t\t4119
\thw_ver:\t\t\t\t0x0
\tboard_id:\t\t\tMT_0000000080
\tphys_port_cnt:\t\t\t2
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t4096 (5)
\t\t\tsm_lid:\t\t\t1
\t\t\tport_lid:\t\t7
\t\t\tport_lmc:\t\t0x00
\t\t\tlink_layer:\t\tInfiniBand

\t\tport:\t2
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t1024 (3)
\t\t\tsm_lid:\t\t\t0
\t\t\tport_lid:\t\t0
\t\t\tport_lmc:\t\t0x00
\t\t\tlink_layer:\t\tInfiniBand
\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0c42:a103:0065:d2e5

hca_id:\trxe_eth1
\ttransport:\t\t\tInfiniBand (0)
\tnode_guid:\t\t\t0000:0000:0000:0001
\tsys_image_guid:\t\t\t0000:0000:0000:0001
\tvendor_id:\t\t\t0xffffff
\tvendor_part_id:\t\t\t0
\thw_ver:\t\t\t\t0x0
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t1024 (3)
\t\t\tsm_lid:\t\t\t0
\t\t\tport_lid:\t\t0
\t\t\tport_lmc:\t\t0x00
\t\t\tlink_layer:\t\tEthernet

"""


def test_several_devices_and_ports_non_verbose() -> None:
    mlx, rxe = D.parse_devinfo(MULTI)
    assert mlx.name == "mlx5_0" and rxe.name == "rxe_eth1"
    assert mlx.attr["fw_ver"] == "16.35.2000"
    assert mlx.attr["vendor_id"] == 0x02C9 and mlx.attr["vendor_part_id"] == 4119
    assert A.guid_from_be64(mlx.attr["node_guid"]) == 0x0C42A1030065D2E4
    assert mlx.raw["board_id"] == "MT_0000000080"
    assert sorted(mlx.ports) == [1, 2]
    assert mlx.ports[1].attr == {
        "state": 4, "max_mtu": 5, "active_mtu": 5, "sm_lid": 1, "lid": 7, "lmc": 0, "link_layer": 1,
    }
    assert mlx.ports[2].attr["state"] == 1
    # an IB GID is printed in raw hex; it is kept in inet_ntop form
    assert [g.gid for g in mlx.ports[2].gids] == ["fe80::c42:a103:65:d2e5"]
    assert mlx.ports[2].gids[0].gid_type is None
    assert "fw_ver" not in rxe.attr  # not printed when empty
    assert rxe.ports[1].attr["link_layer"] == 2
    assert D.parse_devinfo("") == []
