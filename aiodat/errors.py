"""DAT return codes as Python exceptions.

Every DAT return code (``DAT_RETURN_TYPE`` of uDAPL 1.2/2.0) is one exception
class here, and each class also derives from the nearest Python built-in, so
ordinary ``except`` clauses work::

    try:
        await ep.connect(addr, port, timeout=1.0)
    except TimeoutError:          # catches aiodat.TimeoutExpired
        ...
    except ConnectionRefusedError as e:   # catches aiodat.ConnectionRejected
        print(e.private_data)

The table (DAT code -> class -> built-in base):

=====================================  ===========================  ==========================
DAT code                               class                        built-in base
=====================================  ===========================  ==========================
DAT_ABORT                              Abort                        RuntimeError
DAT_CONN_QUAL_IN_USE                   ConnQualInUse                OSError (EADDRINUSE)
DAT_INSUFFICIENT_RESOURCES             InsufficientResources        MemoryError
DAT_INTERNAL_ERROR                     InternalError                RuntimeError
DAT_INVALID_HANDLE                     InvalidHandle                ValueError
DAT_INVALID_PARAMETER                  InvalidParameter             ValueError
DAT_INVALID_STATE                      InvalidState                 RuntimeError
DAT_LENGTH_ERROR                       LengthError                  ValueError
DAT_MODEL_NOT_SUPPORTED                ModelNotSupported            NotImplementedError
DAT_PROVIDER_NOT_FOUND                 ProviderNotFound             LookupError
DAT_PRIVILEGES_VIOLATION               PrivilegesViolation          PermissionError
DAT_PROTECTION_VIOLATION               ProtectionViolation          PermissionError
DAT_QUEUE_EMPTY                        QueueEmpty                   LookupError
DAT_QUEUE_FULL                         QueueFull                    BufferError
DAT_TIMEOUT_EXPIRED                    TimeoutExpired               TimeoutError
DAT_PROVIDER_ALREADY_REGISTERED        ProviderAlreadyRegistered    ValueError
DAT_PROVIDER_IN_USE                    ProviderInUse                RuntimeError
DAT_INVALID_ADDRESS                    InvalidAddress               ValueError
DAT_INTERRUPTED_CALL                   InterruptedCall              InterruptedError
DAT_CONN_QUAL_UNAVAILABLE              ConnQualUnavailable          OSError (EADDRNOTAVAIL)
DAT_PORT_IN_USE                        PortInUse                    ConnQualInUse
DAT_COMM_NOT_SUPPORTED                 CommNotSupported             NotImplementedError
DAT_NOT_IMPLEMENTED                    NotImplementedByProvider     NotImplementedError
=====================================  ===========================  ==========================

DAT has no *return code* for a rejected, unreachable, broken or timed-out
connection, nor for a failed work request: it reports those as events
(``DAT_CONNECTION_EVENT_*``) and as a DTO completion status
(``DAT_DTO_ERR_*``).  The awaitable forms of aiodat raise them, so they are
exceptions too; their ``code`` is the DAT event or status name:

==========================================  ======================  ==========================
DAT event / status                          class                   built-in base
==========================================  ======================  ==========================
DAT_CONNECTION_EVENT_PEER_REJECTED          ConnectionRejected      ConnectionRefusedError
DAT_CONNECTION_EVENT_NON_PEER_REJECTED      NonPeerRejected         ConnectionRejected
DAT_CONNECTION_EVENT_UNREACHABLE            Unreachable             ConnectionError
DAT_CONNECTION_EVENT_BROKEN                 ConnectionBroken        ConnectionResetError
DAT_CONNECTION_EVENT_TIMED_OUT              ConnectionTimedOut      TimeoutExpired
DAT_CONNECTION_EVENT_ACCEPT_COMPLETION_...  AcceptCompletionError   ConnectionError
DAT_DTO_ERR_* / DAT_RMR_OPERATION_FAILED    DTOError                OSError (EIO)
==========================================  ======================  ==========================

Classes whose base is an ``OSError`` keep OSError's ``errno``/``strerror``
semantics (``errno`` is None unless the failure came from a system call);
``str(exc)`` is always the message the raiser built, never OSError's
``[Errno n] ...`` form.  The raiser writes a message that says what was wrong
(``"EP is closed"``, ``"ibv_reg_mr of 4096 bytes failed: ..."``); the base
class only stores and formats it.  Every error carries:

* ``code``: the DAT name (``"DAT_INVALID_HANDLE"``),
* ``subtype``: the DAT sub-code name or None (``"DAT_INVALID_HANDLE_EP"``),
* ``errno``: the system errno or None,
* ``status``: the ``ibv_wc_status`` name of a failed work completion, or None.
"""
from __future__ import annotations

import errno as _errno
import os
import socket as _socket
from typing import Any, ClassVar, Dict, Optional, Tuple, Type, Union

__all__ = [
    "DATError",
    "Abort",
    "ConnQualInUse",
    "InsufficientResources",
    "InternalError",
    "InvalidHandle",
    "InvalidParameter",
    "InvalidState",
    "LengthError",
    "ModelNotSupported",
    "ProviderNotFound",
    "PrivilegesViolation",
    "ProtectionViolation",
    "QueueEmpty",
    "QueueFull",
    "TimeoutExpired",
    "ProviderAlreadyRegistered",
    "ProviderInUse",
    "InvalidAddress",
    "HostNotFound",
    "InterruptedCall",
    "ConnQualUnavailable",
    "PortInUse",
    "CommNotSupported",
    "NotImplementedByProvider",
    "ConnectionRejected",
    "NonPeerRejected",
    "Unreachable",
    "ConnectionBroken",
    "ConnectionTimedOut",
    "AcceptCompletionError",
    "DTOError",
    "ERRORS_BY_CODE",
    "SUBTYPES",
    "WC_STATUS_NAMES",
    "DTO_STATUS_BY_WC_STATUS",
    "dto_status_from_wc",
    "error_from_errno",
]


def shown(value: Any) -> str:
    """``repr(value)`` for an error message; an int too long for ``repr`` (more than 4300 digits,
    Python's limit) by its size, and anything whose ``repr`` raises by its type, so that building
    the message cannot fail in its turn (and lose what it was reporting)."""
    try:
        return repr(value)
    except Exception:
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"


def _strerror(err: Optional[int]) -> Optional[str]:
    if err is None:
        return None
    try:
        return os.strerror(err)
    except (ValueError, OverflowError):
        return f"unknown error {err}"


class DATError(Exception):
    """Base of every aiodat error: a DAT return code (or DAT failure event) as an exception.

    ``DATError`` itself is abstract; raise one of its subclasses, passing a
    message that names what was wrong.  Keyword arguments:

    * ``errno``: the system errno behind the failure, if a system call or verbs
      call failed (int), else None;
    * ``subtype``: the DAT sub-code name (``DAT_RETURN_SUBTYPE``), e.g.
      ``"DAT_INVALID_HANDLE_EP"`` or ``"DAT_INVALID_STATE_EP_UNCONNECTED"``;
      :data:`SUBTYPES` lists the ones DAT defines for each code;
    * ``status``: the ``ibv_wc_status`` name of a failed work completion
      (``"IBV_WC_REM_ACCESS_ERR"``), else None.

    ``str(exc)`` is the message; ``repr(exc)`` adds the code and details.
    """

    #: the DAT return code (or event/status) name this class stands for
    code: ClassVar[str] = ""
    #: the DAT_RETURN_TYPE value of ``code`` (the 0x3fff0000 bits), None for event-based classes
    type_value: ClassVar[Optional[int]] = None

    message: str
    subtype: Optional[str]
    status: Optional[str]
    errno: Optional[int]
    strerror: Optional[str]  # set (OSError's own slot) on the OSError-based classes only

    def __init__(
        self,
        message: str,
        *,
        errno: Optional[int] = None,
        subtype: Optional[str] = None,
        status: Optional[str] = None,
    ) -> None:
        if type(self) is DATError:
            raise TypeError("DATError is abstract: raise one of its subclasses (see aiodat.errors)")
        if not isinstance(message, str) or not message:
            raise TypeError(f"{type(self).__name__} needs a message saying what was wrong, got {message!r}")
        if errno is not None and not isinstance(errno, int):
            raise TypeError(f"errno must be an int or None, got {errno!r}")
        if subtype is not None and not isinstance(subtype, str):
            raise TypeError(f"subtype must be a DAT sub-code name or None, got {subtype!r}")
        super().__init__(message)
        self.message = message
        self.subtype = subtype
        self.status = status
        # For OSError-based classes this sets OSError's own errno/strerror slots.
        self.errno = errno
        if isinstance(self, OSError):
            self.strerror = _strerror(errno)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        parts = [repr(self.message), f"code={self.code!r}"]
        if self.subtype is not None:
            parts.append(f"subtype={self.subtype!r}")
        if self.errno is not None:
            parts.append(f"errno={_errno.errorcode.get(self.errno, self.errno)}")
        if self.status is not None:
            parts.append(f"status={self.status!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __reduce__(self) -> Tuple[Any, ...]:
        # OSError keeps errno in a C slot, outside __dict__: carry it explicitly.
        state = dict(self.__dict__)
        state["errno"] = self.errno
        if isinstance(self, OSError):
            state["strerror"] = self.strerror
        return (type(self), (self.message,), state)

    def __setstate__(self, state: Optional[Dict[str, Any]]) -> None:
        for key, value in (state or {}).items():
            setattr(self, key, value)


# --- the DAT return codes -------------------------------------------------


class Abort(DATError, RuntimeError):
    """DAT_ABORT: the operation was aborted because its IA was closed or its EVD destroyed."""

    code = "DAT_ABORT"
    type_value = 0x00010000


class ConnQualInUse(DATError, OSError):
    """DAT_CONN_QUAL_IN_USE: the connection qualifier (port) is already in use.

    An OSError like ``bind()``'s EADDRINUSE; ``errno`` is EADDRINUSE when the
    failure came from rdma_cm, else None.
    """

    code = "DAT_CONN_QUAL_IN_USE"
    type_value = 0x00020000


class InsufficientResources(DATError, MemoryError):
    """DAT_INSUFFICIENT_RESOURCES: the operation failed for lack of memory or device resources.

    Subtypes name the resource: DAT_RESOURCE_MEMORY, DAT_RESOURCE_TEP (QP),
    DAT_RESOURCE_TEVD (CQ), DAT_RESOURCE_MEMORY_REGION, DAT_RESOURCE_SRQ, ...
    """

    code = "DAT_INSUFFICIENT_RESOURCES"
    type_value = 0x00030000


class InternalError(DATError, RuntimeError):
    """DAT_INTERNAL_ERROR: the provider (aiodat or the layers below it) failed unexpectedly."""

    code = "DAT_INTERNAL_ERROR"
    type_value = 0x00040000


class InvalidHandle(DATError, ValueError):
    """DAT_INVALID_HANDLE: the object is closed (or not of the right kind).

    A ValueError, like Python's "I/O operation on closed file".  The subtype
    names the object kind: DAT_INVALID_HANDLE_EP, DAT_INVALID_HANDLE_LMR, ...
    """

    code = "DAT_INVALID_HANDLE"
    type_value = 0x00050000


class InvalidParameter(DATError, ValueError):
    """DAT_INVALID_PARAMETER: an argument is invalid (subtype DAT_INVALID_ARGn names which)."""

    code = "DAT_INVALID_PARAMETER"
    type_value = 0x00060000


class InvalidState(DATError, RuntimeError):
    """DAT_INVALID_STATE: the object is in the wrong state for the operation.

    Subtypes such as DAT_INVALID_STATE_EP_UNCONNECTED or
    DAT_INVALID_STATE_PZ_IN_USE say which state.
    """

    code = "DAT_INVALID_STATE"
    type_value = 0x00070000


class LengthError(DATError, ValueError):
    """DAT_LENGTH_ERROR: a buffer is too small for the data (or a length exceeds a limit)."""

    code = "DAT_LENGTH_ERROR"
    type_value = 0x00080000


class ModelNotSupported(DATError, NotImplementedError):
    """DAT_MODEL_NOT_SUPPORTED: the requested model (e.g. an EP attribute combination) is not supported."""

    code = "DAT_MODEL_NOT_SUPPORTED"
    type_value = 0x00090000


class ProviderNotFound(DATError, LookupError):
    """DAT_PROVIDER_NOT_FOUND: no registered provider (device port) has that IA name."""

    code = "DAT_PROVIDER_NOT_FOUND"
    type_value = 0x000A0000


class PrivilegesViolation(DATError, PermissionError):
    """DAT_PRIVILEGES_VIOLATION: the memory access needs privileges the LMR/RMR was not given.

    Subtypes: DAT_PRIVILEGES_READ, _WRITE, _RDMA_READ, _RDMA_WRITE.
    """

    code = "DAT_PRIVILEGES_VIOLATION"
    type_value = 0x000B0000


class ProtectionViolation(DATError, PermissionError):
    """DAT_PROTECTION_VIOLATION: an LMR/RMR belongs to another Protection Zone than the EP.

    Subtypes: DAT_PROTECTION_READ, _WRITE, _RDMA_READ, _RDMA_WRITE.
    """

    code = "DAT_PROTECTION_VIOLATION"
    type_value = 0x000C0000


class QueueEmpty(DATError, LookupError):
    """DAT_QUEUE_EMPTY: the EVD has no event to dequeue (the non-blocking dequeue found nothing)."""

    code = "DAT_QUEUE_EMPTY"
    type_value = 0x000D0000


class QueueFull(DATError, BufferError):
    """DAT_QUEUE_FULL: the EVD queue is full (e.g. post_se on a full EVD).

    Derives from BufferError: Python has no "queue full" built-in and
    OverflowError is arithmetic.
    """

    code = "DAT_QUEUE_FULL"
    type_value = 0x000E0000


class TimeoutExpired(DATError, TimeoutError):
    """DAT_TIMEOUT_EXPIRED: a wait ended because its timeout expired."""

    code = "DAT_TIMEOUT_EXPIRED"
    type_value: ClassVar[Optional[int]] = 0x000F0000  # (ConnectionTimedOut, an event, has None)


class ProviderAlreadyRegistered(DATError, ValueError):
    """DAT_PROVIDER_ALREADY_REGISTERED: a provider of that name is already registered."""

    code = "DAT_PROVIDER_ALREADY_REGISTERED"
    type_value = 0x00100000


class ProviderInUse(DATError, RuntimeError):
    """DAT_PROVIDER_IN_USE: the provider is in use and cannot be closed now."""

    code = "DAT_PROVIDER_IN_USE"
    type_value = 0x00110000


class InvalidAddress(DATError, ValueError):
    """DAT_INVALID_ADDRESS: the address is malformed or unsupported.

    Subtypes: DAT_INVALID_ADDRESS_UNSUPPORTED, DAT_INVALID_ADDRESS_MALFORMED.
    An address known to be unreachable raises :class:`Unreachable` instead
    (subtype DAT_INVALID_ADDRESS_UNREACHABLE), which is a ConnectionError.
    """

    code = "DAT_INVALID_ADDRESS"
    type_value = 0x00120000


class HostNotFound(InvalidAddress, _socket.gaierror):
    """DAT_INVALID_ADDRESS: a host name could not be resolved (``loop.getaddrinfo`` failed).

    Also a :class:`socket.gaierror` (an OSError), which is what asyncio's
    ``open_connection`` / ``create_connection`` raise for the same host, so code
    written for asyncio that catches ``OSError`` catches it; ``errno`` is the
    getaddrinfo error (``socket.EAI_NONAME``...).
    """

    code = "DAT_INVALID_ADDRESS"
    type_value = 0x00120000


class InterruptedCall(DATError, InterruptedError):
    """DAT_INTERRUPTED_CALL: a wait was interrupted (EINTR)."""

    code = "DAT_INTERRUPTED_CALL"
    type_value = 0x00130000


class ConnQualUnavailable(DATError, OSError):
    """DAT_CONN_QUAL_UNAVAILABLE: no connection qualifier (port) is free (psp_create_any)."""

    code = "DAT_CONN_QUAL_UNAVAILABLE"
    type_value = 0x00140000


class PortInUse(ConnQualInUse):
    """DAT_PORT_IN_USE (DAT 2.0): the IP port is in use.  A ConnQualInUse, so one except catches both."""

    code = "DAT_PORT_IN_USE"
    type_value = 0x00160000


class CommNotSupported(DATError, NotImplementedError):
    """DAT_COMM_NOT_SUPPORTED (DAT 2.0): the requested communicator/transport is not supported."""

    code = "DAT_COMM_NOT_SUPPORTED"
    type_value = 0x00170000


class NotImplementedByProvider(DATError, NotImplementedError):
    """DAT_NOT_IMPLEMENTED: aiodat does not implement this DAT operation (yet)."""

    code = "DAT_NOT_IMPLEMENTED"
    type_value = 0x3FFF0000


# --- failures DAT reports as events ---------------------------------------


class ConnectionRejected(DATError, ConnectionRefusedError):
    """The peer rejected the connection request (DAT_CONNECTION_EVENT_PEER_REJECTED).

    ``private_data`` holds the reject's private data as the CM delivered it,
    raw from offset 0 (on IB/RoCE the whole 148-byte field, zero-filled past
    what the peer sent); ``reason`` is the CM reject reason number when known (e.g. 28,
    IB_CM_REJ_CONSUMER_DEFINED), else None.
    """

    code = "DAT_CONNECTION_EVENT_PEER_REJECTED"

    private_data: bytes
    reason: Optional[int]

    def __init__(
        self,
        message: str,
        *,
        private_data: Union[bytes, bytearray, memoryview] = b"",
        reason: Optional[int] = None,
        errno: Optional[int] = None,
        subtype: Optional[str] = None,
        status: Optional[str] = None,
    ) -> None:
        super().__init__(message, errno=errno, subtype=subtype, status=status)
        self.private_data = bytes(private_data)
        self.reason = reason


class NonPeerRejected(ConnectionRejected):
    """The connection request was rejected by the transport, not the peer application.

    DAT_CONNECTION_EVENT_NON_PEER_REJECTED: no listener on that port, too many
    requests, or a CM-level reject.  A :class:`ConnectionRejected`.
    """

    code = "DAT_CONNECTION_EVENT_NON_PEER_REJECTED"


class Unreachable(DATError, ConnectionError):
    """The remote address could not be reached (DAT_CONNECTION_EVENT_UNREACHABLE).

    Also raised for DAT_INVALID_ADDRESS with subtype
    DAT_INVALID_ADDRESS_UNREACHABLE (address or route resolution failed).
    A ConnectionError: Python has no narrower built-in for EHOSTUNREACH.
    """

    code = "DAT_CONNECTION_EVENT_UNREACHABLE"


class ConnectionBroken(DATError, ConnectionResetError):
    """The connection broke (DAT_CONNECTION_EVENT_BROKEN): it was lost without a disconnect handshake."""

    code = "DAT_CONNECTION_EVENT_BROKEN"


class ConnectionTimedOut(TimeoutExpired):
    """Connection establishment timed out (DAT_CONNECTION_EVENT_TIMED_OUT).  A TimeoutExpired/TimeoutError."""

    code = "DAT_CONNECTION_EVENT_TIMED_OUT"
    type_value = None


class AcceptCompletionError(DATError, ConnectionError):
    """Accepting a connection request failed to complete (DAT_CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR)."""

    code = "DAT_CONNECTION_EVENT_ACCEPT_COMPLETION_ERROR"


#: ``enum ibv_wc_status`` names in value order (index = the C value)
WC_STATUS_NAMES: Tuple[str, ...] = (
    "IBV_WC_SUCCESS",
    "IBV_WC_LOC_LEN_ERR",
    "IBV_WC_LOC_QP_OP_ERR",
    "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR",
    "IBV_WC_WR_FLUSH_ERR",
    "IBV_WC_MW_BIND_ERR",
    "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR",
    "IBV_WC_REM_INV_REQ_ERR",
    "IBV_WC_REM_ACCESS_ERR",
    "IBV_WC_REM_OP_ERR",
    "IBV_WC_RETRY_EXC_ERR",
    "IBV_WC_RNR_RETRY_EXC_ERR",
    "IBV_WC_LOC_RDD_VIOL_ERR",
    "IBV_WC_REM_INV_RD_REQ_ERR",
    "IBV_WC_REM_ABORT_ERR",
    "IBV_WC_INV_EECN_ERR",
    "IBV_WC_INV_EEC_STATE_ERR",
    "IBV_WC_FATAL_ERR",
    "IBV_WC_RESP_TIMEOUT_ERR",
    "IBV_WC_GENERAL_ERR",
    "IBV_WC_TM_ERR",
    "IBV_WC_TM_RNDV_INCOMPLETE",
)

#: ``ibv_wc_status`` name -> DAT_DTO_COMPLETION_STATUS name (the mapping uDAPL's openib providers use)
DTO_STATUS_BY_WC_STATUS: Dict[str, str] = {
    "IBV_WC_SUCCESS": "DAT_DTO_SUCCESS",
    "IBV_WC_LOC_LEN_ERR": "DAT_DTO_ERR_LOCAL_LENGTH",
    "IBV_WC_LOC_QP_OP_ERR": "DAT_DTO_ERR_LOCAL_EP",
    "IBV_WC_LOC_EEC_OP_ERR": "DAT_DTO_ERR_LOCAL_EP",
    "IBV_WC_LOC_PROT_ERR": "DAT_DTO_ERR_LOCAL_PROTECTION",
    "IBV_WC_WR_FLUSH_ERR": "DAT_DTO_ERR_FLUSHED",
    "IBV_WC_MW_BIND_ERR": "DAT_RMR_OPERATION_FAILED",
    "IBV_WC_BAD_RESP_ERR": "DAT_DTO_ERR_BAD_RESPONSE",
    "IBV_WC_LOC_ACCESS_ERR": "DAT_DTO_ERR_LOCAL_PROTECTION",
    "IBV_WC_REM_INV_REQ_ERR": "DAT_DTO_ERR_REMOTE_RESPONDER",
    "IBV_WC_REM_ACCESS_ERR": "DAT_DTO_ERR_REMOTE_ACCESS",
    "IBV_WC_REM_OP_ERR": "DAT_DTO_ERR_REMOTE_RESPONDER",
    "IBV_WC_RETRY_EXC_ERR": "DAT_DTO_ERR_TRANSPORT",
    "IBV_WC_RNR_RETRY_EXC_ERR": "DAT_DTO_ERR_RECEIVER_NOT_READY",
    "IBV_WC_LOC_RDD_VIOL_ERR": "DAT_DTO_ERR_LOCAL_PROTECTION",
    "IBV_WC_REM_INV_RD_REQ_ERR": "DAT_DTO_ERR_REMOTE_RESPONDER",
    "IBV_WC_REM_ABORT_ERR": "DAT_DTO_ERR_REMOTE_RESPONDER",
    "IBV_WC_INV_EECN_ERR": "DAT_DTO_ERR_LOCAL_EP",
    "IBV_WC_INV_EEC_STATE_ERR": "DAT_DTO_ERR_LOCAL_EP",
    "IBV_WC_FATAL_ERR": "DAT_DTO_ERR_TRANSPORT",
    "IBV_WC_RESP_TIMEOUT_ERR": "DAT_DTO_ERR_TRANSPORT",
    "IBV_WC_GENERAL_ERR": "DAT_DTO_ERR_TRANSPORT",
    "IBV_WC_TM_ERR": "DAT_DTO_ERR_LOCAL_EP",
    "IBV_WC_TM_RNDV_INCOMPLETE": "DAT_DTO_ERR_LOCAL_EP",
}

#: the DAT_DTO_COMPLETION_STATUS names of failures (DAT 2.0 dat.h order)
DTO_ERROR_STATUSES: Tuple[str, ...] = (
    "DAT_DTO_ERR_FLUSHED",
    "DAT_DTO_ERR_LOCAL_LENGTH",
    "DAT_DTO_ERR_LOCAL_EP",
    "DAT_DTO_ERR_LOCAL_PROTECTION",
    "DAT_DTO_ERR_BAD_RESPONSE",
    "DAT_DTO_ERR_REMOTE_ACCESS",
    "DAT_DTO_ERR_REMOTE_RESPONDER",
    "DAT_DTO_ERR_TRANSPORT",
    "DAT_DTO_ERR_RECEIVER_NOT_READY",
    "DAT_DTO_ERR_PARTIAL_PACKET",
    "DAT_RMR_OPERATION_FAILED",
    "DAT_DTO_ERR_LOCAL_MM_ERROR",
)


def _wc_status_name(status: Union[str, int, None]) -> Optional[str]:
    if status is None or isinstance(status, str):
        return status
    if isinstance(status, int) and 0 <= status < len(WC_STATUS_NAMES):
        return WC_STATUS_NAMES[status]
    return f"IBV_WC_STATUS_{status}"


def dto_status_from_wc(status: Union[str, int]) -> str:
    """Return the DAT_DTO_COMPLETION_STATUS name for an ``ibv_wc_status`` (name or C value).

    ``"IBV_WC_REM_ACCESS_ERR"`` (or 10) gives ``"DAT_DTO_ERR_REMOTE_ACCESS"``;
    an unknown status gives ``"DAT_DTO_ERR_TRANSPORT"``.
    """
    name = _wc_status_name(status)
    return DTO_STATUS_BY_WC_STATUS.get(name or "", "DAT_DTO_ERR_TRANSPORT")


class DTOError(DATError, OSError):
    """A work request (DTO or RMR bind) completed in error.

    ``status`` is the ``ibv_wc_status`` name (``"IBV_WC_REM_ACCESS_ERR"``; an
    int C value is converted), ``vendor_err`` the device's vendor error code,
    ``cookie`` the DTO cookie of the failed post.  ``code`` is the DAT
    completion status (``"DAT_DTO_ERR_REMOTE_ACCESS"``), derived from
    ``status`` unless ``dto_status`` is given.  An OSError: a failed transfer
    is an I/O error.
    """

    code = "DAT_DTO_ERR_TRANSPORT"  # class default; each instance sets its own

    vendor_err: Optional[int]
    cookie: Any

    def __init__(
        self,
        message: str,
        *,
        status: Union[str, int, None] = None,
        vendor_err: Optional[int] = None,
        cookie: Any = None,
        dto_status: Optional[str] = None,
        errno: Optional[int] = None,
        subtype: Optional[str] = None,
    ) -> None:
        name = _wc_status_name(status)
        super().__init__(message, errno=errno, subtype=subtype, status=name)
        self.vendor_err = vendor_err
        self.cookie = cookie
        if dto_status is None:
            dto_status = dto_status_from_wc(name) if name is not None else type(self).code
        self.code = dto_status  # type: ignore[misc]  # per-instance DAT completion status

    @property
    def dto_status(self) -> str:
        """The DAT_DTO_COMPLETION_STATUS name of this failure (same as ``code``)."""
        return self.code


# --- tables ---------------------------------------------------------------

_CLASSES: Tuple[Type[DATError], ...] = (
    Abort,
    ConnQualInUse,
    InsufficientResources,
    InternalError,
    InvalidHandle,
    InvalidParameter,
    InvalidState,
    LengthError,
    ModelNotSupported,
    ProviderNotFound,
    PrivilegesViolation,
    ProtectionViolation,
    QueueEmpty,
    QueueFull,
    TimeoutExpired,
    ProviderAlreadyRegistered,
    ProviderInUse,
    InvalidAddress,
    InterruptedCall,
    ConnQualUnavailable,
    PortInUse,
    CommNotSupported,
    NotImplementedByProvider,
    ConnectionRejected,
    NonPeerRejected,
    Unreachable,
    ConnectionBroken,
    ConnectionTimedOut,
    AcceptCompletionError,
)

#: DAT code name -> exception class.  Holds every DAT return code, the
#: connection-event names above, and every DAT_DTO_ERR_* status (-> DTOError).
ERRORS_BY_CODE: Dict[str, Type[DATError]] = {cls.code: cls for cls in _CLASSES}
ERRORS_BY_CODE.update({name: DTOError for name in DTO_ERROR_STATUSES})

#: DAT code name -> the DAT_RETURN_SUBTYPE names DAT defines for it (dat_error.h, DAT 2.0)
SUBTYPES: Dict[str, Tuple[str, ...]] = {
    "DAT_ABORT": ("DAT_SUB_INTERRUPTED",),
    "DAT_INSUFFICIENT_RESOURCES": (
        "DAT_RESOURCE_MEMORY",
        "DAT_RESOURCE_DEVICE",
        "DAT_RESOURCE_TEP",
        "DAT_RESOURCE_TEVD",
        "DAT_RESOURCE_PROTECTION_DOMAIN",
        "DAT_RESOURCE_MEMORY_REGION",
        "DAT_RESOURCE_ERROR_HANDLER",
        "DAT_RESOURCE_CREDITS",
        "DAT_RESOURCE_SRQ",
    ),
    "DAT_INVALID_HANDLE": tuple(
        f"DAT_INVALID_HANDLE_{kind}"
        for kind in (
            "IA", "EP", "LMR", "RMR", "PZ", "PSP", "RSP", "CR", "CNO",
            "EVD_CR", "EVD_REQUEST", "EVD_RECV", "EVD_CONN", "EVD_ASYNC", "SRQ", "CSP",
        )
    )
    + tuple(f"DAT_INVALID_HANDLE{n}" for n in range(1, 11)),
    "DAT_INVALID_PARAMETER": tuple(f"DAT_INVALID_ARG{n}" for n in range(1, 11)),
    "DAT_INVALID_STATE": tuple(
        f"DAT_INVALID_STATE_{s}"
        for s in (
            "EP_UNCONNECTED", "EP_ACTCONNPENDING", "EP_PASSCONNPENDING", "EP_TENTCONNPENDING",
            "EP_CONNECTED", "EP_DISCONNECTED", "EP_RESERVED", "EP_COMPLPENDING", "EP_DISCPENDING",
            "EP_PROVIDERCONTROL", "EP_NOTREADY", "EP_RECV_WATERMARK", "EP_PZ", "EP_EVD_REQUEST",
            "EP_EVD_RECV", "EP_EVD_CONNECT", "EP_UNCONFIGURED", "EP_UNCONFRESERVED",
            "EP_UNCONFPASSIVE", "EP_UNCONFTENTATIVE", "CNO_IN_USE", "CNO_DEAD",
            "EVD_OPEN", "EVD_ENABLED", "EVD_DISABLED", "EVD_WAITABLE", "EVD_UNWAITABLE",
            "EVD_IN_USE", "EVD_CONFIG_NOTIFY", "EVD_CONFIG_SOLICITED", "EVD_CONFIG_THRESHOLD",
            "EVD_WAITER", "EVD_ASYNC", "IA_IN_USE", "LMR_IN_USE", "LMR_FREE", "PZ_IN_USE",
            "PZ_FREE", "SRQ_OPERATIONAL", "SRQ_ERROR", "SRQ_IN_USE",
        )
    ),
    "DAT_PRIVILEGES_VIOLATION": (
        "DAT_PRIVILEGES_READ", "DAT_PRIVILEGES_WRITE",
        "DAT_PRIVILEGES_RDMA_READ", "DAT_PRIVILEGES_RDMA_WRITE",
    ),
    "DAT_PROTECTION_VIOLATION": (
        "DAT_PROTECTION_READ", "DAT_PROTECTION_WRITE",
        "DAT_PROTECTION_RDMA_READ", "DAT_PROTECTION_RDMA_WRITE",
    ),
    "DAT_INVALID_ADDRESS": (
        "DAT_INVALID_ADDRESS_UNSUPPORTED",
        "DAT_INVALID_ADDRESS_UNREACHABLE",
        "DAT_INVALID_ADDRESS_MALFORMED",
    ),
    "DAT_PROVIDER_NOT_FOUND": (
        "DAT_NAME_NOT_REGISTERED",
        "DAT_MAJOR_NOT_FOUND",
        "DAT_MINOR_NOT_FOUND",
        "DAT_THREAD_SAFETY_NOT_FOUND",
    ),
}


def _errnos(*names: str) -> Tuple[int, ...]:
    return tuple(getattr(_errno, n) for n in names if hasattr(_errno, n))


# errno -> (class, subtype).  Order matters only where errno values alias
# (EWOULDBLOCK == EAGAIN, ENOTSUP == EOPNOTSUPP on Linux).
_ERRNO_TABLE: Dict[int, Tuple[Type[DATError], Optional[str]]] = {}
for _cls, _sub, _names in (
    (InsufficientResources, "DAT_RESOURCE_MEMORY", ("ENOMEM",)),
    (InsufficientResources, None, ("ENOSPC", "ENOBUFS", "EMFILE", "ENFILE", "EAGAIN", "EWOULDBLOCK")),
    (InvalidParameter, None, ("EINVAL", "EFAULT", "ENOENT", "ERANGE", "EDOM")),
    (ConnQualInUse, None, ("EADDRINUSE",)),
    (InvalidAddress, "DAT_INVALID_ADDRESS_UNSUPPORTED", ("EADDRNOTAVAIL", "EAFNOSUPPORT")),
    (TimeoutExpired, None, ("ETIMEDOUT", "ETIME")),
    (ConnectionRejected, None, ("ECONNREFUSED",)),
    (ConnectionBroken, None, ("ECONNRESET", "ECONNABORTED", "EPIPE")),
    (Unreachable, "DAT_INVALID_ADDRESS_UNREACHABLE", ("ENETUNREACH", "EHOSTUNREACH", "ENETDOWN", "EHOSTDOWN")),
    (ProviderNotFound, None, ("ENODEV", "ENXIO")),
    (PrivilegesViolation, None, ("EACCES", "EPERM")),
    (InvalidState, None, ("EBUSY", "ENOTCONN", "EISCONN", "EALREADY", "EINPROGRESS")),
    (InvalidHandle, None, ("EBADF",)),
    (InterruptedCall, None, ("EINTR",)),
    (NotImplementedByProvider, None, ("ENOSYS", "EOPNOTSUPP", "ENOTSUP", "EPROTONOSUPPORT")),
    (LengthError, None, ("EMSGSIZE", "E2BIG")),
    (QueueFull, None, ("EOVERFLOW",)),
):
    for _n in _errnos(*_names):
        _ERRNO_TABLE.setdefault(_n, (_cls, _sub))
del _cls, _sub, _names, _n
# The kernel's own ENOTSUPP (include/linux/errno.h), which some RDMA paths let out to user space
# (rdma_join_multicast of an IPv6 group on rxe): not in libc's table, so named here.
_KERNEL_ENOTSUPP = 524
_ERRNO_TABLE[_KERNEL_ENOTSUPP] = (NotImplementedByProvider, None)
_KERNEL_ERRNO_TEXT = {_KERNEL_ENOTSUPP: ("ENOTSUPP", "operation not supported (the kernel's ENOTSUPP)")}


def error_from_errno(
    errno: int,
    what: str,
    default: Type[DATError] = InternalError,
) -> DATError:
    """Return (do not raise) the DAT error for a failed system or verbs call.

    ``errno`` is the error number (a negative ``-errno`` return value is
    accepted too); ``what`` says what was being done, e.g.
    ``"ibv_reg_mr of 4096 bytes"`` or ``"resolving 10.0.0.2"``.  The message
    is ``"<what> failed: <strerror> (<ENAME>)"``.  Mapping: ENOMEM, ENOSPC,
    ENOBUFS, EAGAIN, EMFILE -> InsufficientResources; EINVAL, EFAULT, ENOENT ->
    InvalidParameter; EADDRINUSE -> ConnQualInUse; EADDRNOTAVAIL,
    EAFNOSUPPORT -> InvalidAddress; ETIMEDOUT -> TimeoutExpired; ECONNREFUSED
    -> ConnectionRejected; ECONNRESET, ECONNABORTED, EPIPE -> ConnectionBroken;
    ENETUNREACH, EHOSTUNREACH -> Unreachable; ENODEV, ENXIO ->
    ProviderNotFound; EACCES, EPERM -> PrivilegesViolation; EBUSY, ENOTCONN,
    EISCONN -> InvalidState; EBADF -> InvalidHandle; EINTR -> InterruptedCall;
    ENOSYS, EOPNOTSUPP, the kernel's ENOTSUPP (524) -> NotImplementedByProvider; EMSGSIZE, E2BIG ->
    LengthError; EOVERFLOW -> QueueFull; anything else -> ``default``.
    """
    if not isinstance(errno, int):
        raise TypeError(f"errno must be an int, got {errno!r}")
    err = abs(errno)
    cls, subtype = _ERRNO_TABLE.get(err, (default, None))
    name, text = _KERNEL_ERRNO_TEXT.get(err) or (_errno.errorcode.get(err, f"errno {err}"), _strerror(err))
    message = f"{what} failed: {text} ({name})"
    return cls(message, errno=err, subtype=subtype)
