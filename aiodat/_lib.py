"""Load the compiled C shim (``aiodat._shim._core``).

``ffi`` and ``lib`` are the cffi objects every other module uses.  When the
extension or the rdma-core libraries it links against are missing, importing
aiodat fails here with an ImportError that says what to install.
"""
from __future__ import annotations

INSTALL_HINT = (
    "aiodat needs rdma-core's libibverbs and librdmacm. On Debian/Ubuntu: "
    "apt-get install rdma-core ibverbs-providers libibverbs1 librdmacm1 "
    "(and libibverbs-dev librdmacm-dev to build aiodat from source), then reinstall aiodat."
)


def _load():
    try:
        from aiodat._shim import _core
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (the C shim failed to load: {exc})") from exc
    return _core.ffi, _core.lib


ffi, lib = _load()

__all__ = ["ffi", "lib", "INSTALL_HINT"]
