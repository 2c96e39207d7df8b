"""The value types of an endpoint: its attributes (EPAttr), states (EPState), service type and query results.

They sit low in the layers (see docs/architecture.md) so that every core module
can name an EP's state or attributes without importing the EP itself.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, NamedTuple

from aiodat.errors import InvalidParameter

if TYPE_CHECKING:
    from aiodat.evd import EVD
    from aiodat.ia import IA
    from aiodat.memory import PZ
    from aiodat.srq import SRQ


class EPState(enum.Enum):
    """DAT endpoint states (DAT_EP_STATE_*)."""

    UNCONNECTED = "UNCONNECTED"
    RESERVED = "RESERVED"
    PASSIVE_CONNECTION_PENDING = "PASSIVE_CONNECTION_PENDING"
    ACTIVE_CONNECTION_PENDING = "ACTIVE_CONNECTION_PENDING"
    TENTATIVE_CONNECTION_PENDING = "TENTATIVE_CONNECTION_PENDING"
    CONNECTED = "CONNECTED"
    DISCONNECT_PENDING = "DISCONNECT_PENDING"
    DISCONNECTED = "DISCONNECTED"
    ERROR = "ERROR"


class ServiceType(enum.Enum):
    """Transport service of an EP (DAT_SERVICE_TYPE): reliable connected or (aiodat) unreliable datagram."""

    RC = "RC"
    UD = "UD"


@dataclass(frozen=True)
class EPAttr:
    """Endpoint attributes (DAT_EP_ATTR): queue depths, segment limits, RDMA read depth and
    the transport settings of the QP (see docs/hardware.md for when to change them)."""

    max_recv_dtos: int = 64
    max_request_dtos: int = 64
    max_recv_iov: int = 1
    max_request_iov: int = 1
    max_rdma_read_in: int = 4
    max_rdma_read_out: int = 4
    #: sends and RDMA writes of at most this many bytes go inline (copied into the work request
    #: at post time: no DMA read of the buffer, lower latency on hardware).  None: what the
    #: device offers, up to DEFAULT_INLINE_DATA bytes (0 on a device without inline data); an
    #: int asks for exactly that much and fails if the device cannot give it.
    max_inline_data: Optional[int] = None
    service_type: ServiceType = ServiceType.RC
    #: how many times the transport resends an unacknowledged request before it fails with
    #: IBV_WC_RETRY_EXC_ERR and the connection breaks (0-7; the connecting side's value is the
    #: one both QPs use).  The default is 6, not the usual 7, because rxe retries for ever at 7.
    retry_count: int = 6
    #: the ACK timeout of this side's QP, IB-encoded: 4.096 us * 2**ack_timeout (1-31).  None
    #: keeps the connection manager's (on RoCE 19, about 2.1 s).  With retry_count it sets how
    #: long a dead link takes to be reported: about (retry_count + 1) timeouts.
    ack_timeout: Optional[int] = None
    #: how many times a send is retried after a receiver-not-ready NAK (0-7; 7: for ever, so a
    #: slow receiver stalls the sender instead of breaking the connection)
    rnr_retry: int = 7
    #: the RNR NAK delay this side asks of a sender that finds no receive posted, IB-encoded
    #: (1: 0.01 ms ... 12: 0.64 ms ... 31: 491 ms; 0: 655 ms).  12 is the usual value on
    #: hardware; the connection manager would leave 0, the longest.
    min_rnr_timer: int = 12
    #: the completion vector (interrupt) of the EP's own EVDs' CQs; None spreads EVDs over the
    #: device's vectors in turn (``ia.create_evd(comp_vector=...)`` for shared EVDs)
    comp_vector: Optional[int] = None

    def _validate(self, ia: "IA") -> None:
        if not isinstance(self.service_type, ServiceType):
            raise InvalidParameter(f"EPAttr.service_type must be a ServiceType (RC or UD), "
                                   f"got {self.service_type!r}")
        dev = ia._device_attr
        limits = {
            "max_recv_dtos": dev.max_qp_wr, "max_request_dtos": dev.max_qp_wr,
            "max_recv_iov": min(dev.max_sge, 32), "max_request_iov": min(dev.max_sge, 32),
            "max_rdma_read_in": dev.max_qp_rd_atom, "max_rdma_read_out": dev.max_qp_init_rd_atom,
        }
        limits.update(retry_count=7, rnr_retry=7, min_rnr_timer=31)
        for name, limit in limits.items():
            value = getattr(self, name)
            low = 0 if name.startswith("max_rdma_read") or name in ("retry_count", "rnr_retry", "min_rnr_timer") else 1
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= limit:
                raise InvalidParameter(f"EPAttr.{name} must be between {low} and {limit}, got {value!r}")
        optional = {"ack_timeout": (1, 31), "max_inline_data": (0, 1 << 16),
                    "comp_vector": (0, max(0, ia._context.num_comp_vectors - 1))}
        for name, (low, high) in optional.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high):
                raise InvalidParameter(f"EPAttr.{name} must be None or between {low} and {high}, got {value!r}")


class EPRecvInfo(NamedTuple):
    """What :meth:`EP.recv_query` returns; ``None`` is DAT_VALUE_UNKNOWN."""

    nbufs_allocated: Optional[int]
    bufs_alloc_span: Optional[int]


@dataclass(frozen=True)
class EPParam:
    """What :meth:`EP.query` returns (DAT_EP_PARAM)."""

    ia: "IA"
    pz: "PZ"
    state: EPState
    attrs: EPAttr
    qp_num: int
    local_address: Optional[Tuple[str, int]]
    remote_address: Optional[Tuple[str, int]]
    recv_evd: "EVD"
    request_evd: "EVD"
    connect_evd: "EVD"
    srq: Optional["SRQ"]
    outstanding_requests: int
    outstanding_recvs: int
    #: the QP's transport retry count and ACK timeout as the device reports them (None before connecting)
    retry_count: Optional[int] = None
    ack_timeout: Optional[int] = None
