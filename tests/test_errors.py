"""aiodat.errors: one exception class per DAT return code, each also a Python built-in."""
from __future__ import annotations

import errno
import pickle

import pytest
from pure_modules import load as _load


E = _load("errors")

# (class name, DAT code, the built-in it must also be)
TABLE = [
    ("Abort", "DAT_ABORT", RuntimeError),
    ("ConnQualInUse", "DAT_CONN_QUAL_IN_USE", OSError),
    ("InsufficientResources", "DAT_INSUFFICIENT_RESOURCES", MemoryError),
    ("InternalError", "DAT_INTERNAL_ERROR", RuntimeError),
    ("InvalidHandle", "DAT_INVALID_HANDLE", ValueError),
    ("InvalidParameter", "DAT_INVALID_PARAMETER", ValueError),
    ("InvalidState", "DAT_INVALID_STATE", RuntimeError),
    ("LengthError", "DAT_LENGTH_ERROR", ValueError),
    ("ModelNotSupported", "DAT_MODEL_NOT_SUPPORTED", NotImplementedError),
    ("ProviderNotFound", "DAT_PROVIDER_NOT_FOUND", LookupError),
    ("PrivilegesViolation", "DAT_PRIVILEGES_VIOLATION", PermissionError),
    ("ProtectionViolation", "DAT_PROTECTION_VIOLATION", PermissionError),
    ("QueueEmpty", "DAT_QUEUE_EMPTY", LookupError),
    ("QueueFull", "DAT_QUEUE_FULL", BufferError),
    ("TimeoutExpired", "DAT_TIMEOUT_EXPIRED", TimeoutError),
    ("ProviderAlreadyRegistered", "DAT_PROVIDER_ALREADY_REGISTERED", ValueError),
    ("ProviderInUse", "DAT_PROVIDER_IN_USE", RuntimeError),
    ("InvalidAddress", "DAT_INVALID_ADDRESS", ValueError),
    ("InterruptedCall", "DAT_INTERRUPTED_CALL", InterruptedError),
    ("ConnQualUnavailable", "DAT_CONN_QUAL_UNAVAILABLE", OSError),
    ("PortInUse", "DAT_PORT_IN_USE", OSError),
    ("CommNotSupported", "DAT_COMM_NOT_SUPPORTED", NotImplementedError),
    ("NotImplementedByProvider", "DAT_NOT_IMPLEMENTED", NotImplementedError),
    ("ConnectionRejected", "DAT_CONNECTION_EVENT_PEER_REJECTED", ConnectionRefusedError),
    ("NonPeerRejected", "DAT_CONNECTION_EVENT_NON_PEER_REJECTED", ConnectionRefusedError),
    ("Unreachable", "DAT_CONNECTION_EVENT_UNREACHABLE", ConnectionError),
    ("ConnectionBroken", "DAT_CONNECTION_EVENT_BROKEN", ConnectionResetError),
    ("ConnectionTimedOut", "DAT_CONNECTION_EVENT_TIMED_OUT", TimeoutError),
    ("AcceptCompletionError", "DAT_CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR", ConnectionError),
]

# every DAT_RETURN_TYPE of uDAPL 1.2/2.0 except DAT_SUCCESS and kDAPL's DAT_RESERVED_LMR
DAT_RETURN_CODES = [
    "DAT_ABORT", "DAT_CONN_QUAL_IN_USE", "DAT_INSUFFICIENT_RESOURCES", "DAT_INTERNAL_ERROR",
    "DAT_INVALID_HANDLE", "DAT_INVALID_PARAMETER", "DAT_INVALID_STATE", "DAT_LENGTH_ERROR",
    "DAT_MODEL_NOT_SUPPORTED", "DAT_PROVIDER_NOT_FOUND", "DAT_PRIVILEGES_VIOLATION",
    "DAT_PROTECTION_VIOLATION", "DAT_QUEUE_EMPTY", "DAT_QUEUE_FULL", "DAT_TIMEOUT_EXPIRED",
    "DAT_PROVIDER_ALREADY_REGISTERED", "DAT_PROVIDER_IN_USE", "DAT_INVALID_ADDRESS",
    "DAT_INTERRUPTED_CALL", "DAT_CONN_QUAL_UNAVAILABLE", "DAT_PORT_IN_USE",
    "DAT_COMM_NOT_SUPPORTED", "DAT_NOT_IMPLEMENTED",
]


@pytest.mark.parametrize("name, code, builtin", TABLE)
def test_class_is_dat_error_and_builtin(name: str, code: str, builtin: type) -> None:
    cls = getattr(E, name)
    assert issubclass(cls, E.DATError)
    assert issubclass(cls, builtin)
    assert cls.code == code
    assert E.ERRORS_BY_CODE[code] is cls
    assert name in E.__all__
    assert cls.__doc__ and code in cls.__doc__
    exc = cls(f"{name} happened because of a test")
    assert isinstance(exc, E.DATError) and isinstance(exc, builtin)
    assert str(exc) == f"{name} happened because of a test"
    assert exc.code == code
    assert exc.errno is None and exc.subtype is None and exc.status is None
    assert code in repr(exc) and name in repr(exc)
    with pytest.raises(builtin):
        raise exc


def test_every_dat_return_code_has_a_class() -> None:
    for code in DAT_RETURN_CODES:
        cls = E.ERRORS_BY_CODE[code]
        assert cls.code == code
        assert cls.type_value is not None and cls.type_value & 0x3FFF0000 == cls.type_value


def test_type_values_are_the_dat_numbers() -> None:
    assert E.InvalidHandle.type_value == 0x00050000
    assert E.TimeoutExpired.type_value == 0x000F0000
    assert E.NotImplementedByProvider.type_value == 0x3FFF0000
    assert E.ConnectionRejected.type_value is None  # an event, not a return code


def test_builtin_except_clauses_catch_them() -> None:
    with pytest.raises(TimeoutError):
        raise E.TimeoutExpired("evd.wait: 0.5 s passed without an event")
    try:
        raise E.TimeoutExpired("evd.wait timed out")
    except TimeoutError as exc:
        assert exc.code == "DAT_TIMEOUT_EXPIRED"
    with pytest.raises(ValueError, match="EP is closed"):
        raise E.InvalidHandle("EP is closed", subtype="DAT_INVALID_HANDLE_EP")
    with pytest.raises(LookupError):
        raise E.ProviderNotFound("no IA named 'mlx9'")
    with pytest.raises(MemoryError):
        raise E.InsufficientResources("ibv_create_qp: out of QPs", subtype="DAT_RESOURCE_TEP")
    with pytest.raises(ConnectionError):
        raise E.ConnectionBroken("peer vanished")
    with pytest.raises(TimeoutError):
        raise E.ConnectionTimedOut("connect to 10.0.0.2:4000 timed out")
    with pytest.raises(E.TimeoutExpired):
        raise E.ConnectionTimedOut("connect timed out")
    with pytest.raises(E.ConnQualInUse):
        raise E.PortInUse("port 4791 in use")
    with pytest.raises(E.ConnectionRejected):
        raise E.NonPeerRejected("no listener on port 7")


def test_connection_rejected_carries_private_data() -> None:
    exc = E.ConnectionRejected("peer rejected", private_data=bytearray(b"busy"), reason=28)
    assert exc.private_data == b"busy" and type(exc.private_data) is bytes
    assert exc.reason == 28
    assert isinstance(exc, ConnectionRefusedError)
    assert E.ConnectionRejected("rejected").private_data == b""


def test_attributes_and_oserror_semantics() -> None:
    exc = E.ConnQualInUse("listening on port 4000", errno=errno.EADDRINUSE)
    assert isinstance(exc, OSError)
    assert exc.errno == errno.EADDRINUSE
    assert exc.strerror == "Address already in use"
    assert str(exc) == "listening on port 4000"  # never OSError's "[Errno 98] ..." form
    assert exc.args == ("listening on port 4000",)
    exc2 = E.InvalidState("EP not connected", subtype="DAT_INVALID_STATE_EP_UNCONNECTED", errno=errno.ENOTCONN)
    assert exc2.subtype == "DAT_INVALID_STATE_EP_UNCONNECTED"
    assert exc2.errno == errno.ENOTCONN
    assert "DAT_INVALID_STATE_EP_UNCONNECTED" in E.SUBTYPES["DAT_INVALID_STATE"]
    assert "DAT_INVALID_HANDLE_EP" in E.SUBTYPES["DAT_INVALID_HANDLE"]


def test_message_is_required_and_base_is_abstract() -> None:
    with pytest.raises(TypeError):
        E.DATError("what")
    with pytest.raises(TypeError):
        E.InvalidParameter("")
    with pytest.raises(TypeError):
        E.InvalidParameter()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        E.InvalidParameter("bad", errno="EINVAL")  # type: ignore[arg-type]


def test_dto_error() -> None:
    exc = E.DTOError("RDMA write to 0x7f00 failed", status="IBV_WC_REM_ACCESS_ERR", vendor_err=0x88, cookie=17)
    assert isinstance(exc, OSError) and isinstance(exc, E.DATError)
    assert exc.status == "IBV_WC_REM_ACCESS_ERR"
    assert exc.vendor_err == 0x88 and exc.cookie == 17
    assert exc.code == exc.dto_status == "DAT_DTO_ERR_REMOTE_ACCESS"
    assert E.DTOError("flushed", status=5).status == "IBV_WC_WR_FLUSH_ERR"
    assert E.DTOError("flushed", status=5).code == "DAT_DTO_ERR_FLUSHED"
    assert E.DTOError("rnr", status="IBV_WC_RNR_RETRY_EXC_ERR").code == "DAT_DTO_ERR_RECEIVER_NOT_READY"
    assert E.DTOError("explicit", dto_status="DAT_DTO_ERR_PARTIAL_PACKET").code == "DAT_DTO_ERR_PARTIAL_PACKET"
    assert E.ERRORS_BY_CODE["DAT_DTO_ERR_REMOTE_ACCESS"] is E.DTOError
    assert len(E.WC_STATUS_NAMES) == 24 and E.WC_STATUS_NAMES[10] == "IBV_WC_REM_ACCESS_ERR"
    assert set(E.DTO_STATUS_BY_WC_STATUS) == set(E.WC_STATUS_NAMES)
    assert E.dto_status_from_wc("IBV_WC_RETRY_EXC_ERR") == "DAT_DTO_ERR_TRANSPORT"
    assert E.dto_status_from_wc(1) == "DAT_DTO_ERR_LOCAL_LENGTH"
    assert E.dto_status_from_wc(999) == "DAT_DTO_ERR_TRANSPORT"
    with pytest.raises(OSError):
        raise exc


@pytest.mark.parametrize(
    "err, cls",
    [
        (errno.ENOMEM, "InsufficientResources"),
        (errno.ENOSPC, "InsufficientResources"),
        (errno.EAGAIN, "InsufficientResources"),
        (errno.EINVAL, "InvalidParameter"),
        (errno.ENOENT, "InvalidParameter"),
        (errno.EADDRINUSE, "ConnQualInUse"),
        (errno.EADDRNOTAVAIL, "InvalidAddress"),
        (errno.ETIMEDOUT, "TimeoutExpired"),
        (errno.ECONNREFUSED, "ConnectionRejected"),
        (errno.ECONNRESET, "ConnectionBroken"),
        (errno.ENETUNREACH, "Unreachable"),
        (errno.EHOSTUNREACH, "Unreachable"),
        (errno.ENODEV, "ProviderNotFound"),
        (errno.EACCES, "PrivilegesViolation"),
        (errno.EPERM, "PrivilegesViolation"),
        (errno.EBUSY, "InvalidState"),
        (errno.EBADF, "InvalidHandle"),
        (errno.EINTR, "InterruptedCall"),
        (errno.ENOSYS, "NotImplementedByProvider"),
        (errno.EOPNOTSUPP, "NotImplementedByProvider"),
        (errno.EMSGSIZE, "LengthError"),
        (errno.EIO, "InternalError"),
    ],
)
def test_error_from_errno(err: int, cls: str) -> None:
    exc = E.error_from_errno(err, "ibv_reg_mr of 4096 bytes")
    assert type(exc) is getattr(E, cls)
    assert exc.errno == err
    msg = str(exc)
    assert msg.startswith("ibv_reg_mr of 4096 bytes failed: ")
    assert __import__("os").strerror(err) in msg
    assert errno.errorcode[err] in msg


def test_the_kernels_enotsupp_is_named_and_not_supported() -> None:
    """524, the kernel's ENOTSUPP (rxe's rdma_join_multicast of an IPv6 group), is not in libc's table."""
    exc = E.error_from_errno(524, "rdma_join_multicast")
    assert type(exc) is E.NotImplementedByProvider and exc.errno == 524
    assert str(exc) == "rdma_join_multicast failed: operation not supported (the kernel's ENOTSUPP) (ENOTSUPP)"


def test_error_from_errno_details() -> None:
    exc = E.error_from_errno(-errno.ENOMEM, "ibv_create_cq")  # verbs -errno returns are accepted
    assert isinstance(exc, E.InsufficientResources) and exc.errno == errno.ENOMEM
    assert exc.subtype == "DAT_RESOURCE_MEMORY"
    assert E.error_from_errno(errno.EHOSTUNREACH, "resolve").subtype == "DAT_INVALID_ADDRESS_UNREACHABLE"
    odd = E.error_from_errno(errno.EPROTO, "rdma_get_cm_event", default=E.Abort)
    assert type(odd) is E.Abort and "rdma_get_cm_event failed" in str(odd)
    timeout = E.error_from_errno(errno.ETIMEDOUT, "rdma_resolve_route")
    assert isinstance(timeout, TimeoutError) and timeout.errno == errno.ETIMEDOUT
    with pytest.raises(TypeError):
        E.error_from_errno("ENOMEM", "x")  # type: ignore[arg-type]


def test_pickle_round_trip_keeps_details() -> None:
    for exc in (
        E.error_from_errno(errno.EADDRINUSE, "binding port 4000"),
        E.InvalidHandle("LMR is closed", subtype="DAT_INVALID_HANDLE_LMR"),
        E.ConnectionRejected("rejected", private_data=b"x", reason=28),
        E.DTOError("send failed", status="IBV_WC_LOC_LEN_ERR", vendor_err=3, cookie="c"),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc)
        assert (str(back), back.code, back.errno, back.subtype, back.status) == (
            str(exc), exc.code, exc.errno, exc.subtype, exc.status,
        )
    assert pickle.loads(pickle.dumps(E.ConnectionRejected("r", private_data=b"pd"))).private_data == b"pd"
