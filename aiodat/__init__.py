"""aiodat: asyncio-native RDMA with the DAT/uDAPL object model over rdma-core.

Open an Interface Adapter with :func:`open_ia` (names from
:func:`list_providers`), then create from it Protection Zones, registered
memory (LMRs), Event Dispatchers, Endpoints, Public Service Points and Shared
Receive Queues.  Every DAT wait is an awaitable on the running event loop.
"""
from aiodat.errors import *  # noqa: F401,F403  (every DAT return code, as exception classes)
from aiodat.errors import DATError  # noqa: F401

from aiodat._version import __version__  # noqa: E402,F401

from aiodat.attrs import IAAttr, IAQuery, ProviderAttr, TransportAttr  # noqa: E402
from aiodat.cm import CR, PSP  # noqa: E402
from aiodat.ep import EP, CompletionFlags, EPAttr, EPParam, EPState, ServiceType  # noqa: E402
from aiodat.evd import (  # noqa: E402
    EVD,
    AsyncEvent,
    ConnectionEvent,
    ConnectionRequestEvent,
    DTOCompletionEvent,
    DTOOp,
    Event,
    EventType,
    EvdFlags,
    EVDParam,
    RMRBindEvent,
    SoftwareEvent,
)
from aiodat.ia import IA, PZ, Provider, list_providers, open_ia  # noqa: E402
from aiodat.memory import LMR, RMR, LMRParam, Privileges, RemoteRegion, RMRParam, Segment  # noqa: E402
from aiodat.srq import SRQ, SRQParam, SRQState  # noqa: E402
from aiodat.ep import EPRecvInfo  # noqa: E402
from aiodat.streams import open_connection, start_server  # noqa: E402
from aiodat._handle import fork_support  # noqa: E402

__all__ = [
    "__version__", "list_providers", "open_ia", "Provider", "IA", "PZ", "IAQuery", "IAAttr",
    "ProviderAttr", "TransportAttr", "LMR", "LMRParam", "RMR", "RMRParam", "Segment", "RemoteRegion", "Privileges",
    "EVD", "EVDParam", "EvdFlags", "Event", "EventType", "DTOOp", "DTOCompletionEvent", "RMRBindEvent",
    "ConnectionEvent", "ConnectionRequestEvent", "SoftwareEvent", "AsyncEvent", "EP", "EPAttr",
    "EPParam", "EPState", "ServiceType", "CompletionFlags", "PSP", "CR", "DATError",
    "SRQ", "SRQParam", "SRQState", "EPRecvInfo",
    "open_connection", "start_server", "fork_support",
]
__all__ += [name for name in dir() if name[0].isupper() and name not in __all__
            and isinstance(globals()[name], type) and issubclass(globals()[name], DATError)]
