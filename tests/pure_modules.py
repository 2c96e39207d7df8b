"""Load aiodat's pure-Python modules (errors, attrs, devinfo) even before the C extension is built.

Their unit tests need no device and no compiled shim, so they run first on a new machine.
"""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> Any:
    """Import aiodat.<name>.  If the package itself cannot be imported (its C
    extension not built yet), load the pure-Python module without running
    aiodat/__init__, under a stand-in package that re-raises the reason."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        importlib.import_module("aiodat")
    except ImportError as exc:
        reason = exc
        stub = types.ModuleType("aiodat", f"stand-in: aiodat could not be imported ({reason})")
        stub.__path__ = [str(ROOT / "aiodat")]  # type: ignore[attr-defined]

        def __getattr__(attr: str) -> Any:
            raise ImportError(f"aiodat could not be imported ({reason}); only pure-Python modules are loaded")

        stub.__getattr__ = __getattr__  # type: ignore[attr-defined]
        sys.modules["aiodat"] = stub
    return importlib.import_module(f"aiodat.{name}")
