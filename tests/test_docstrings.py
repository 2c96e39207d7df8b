"""Every public name has a docstring: the functions and classes a module exports in ``__all__``,
and every public method, property and attribute descriptor of those classes, inherited ones
included (StreamCore's state members are the C base class's, for instance).

A dataclass's fields are described in its class docstring, so its slot members are not asked
for one of their own.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
from typing import Iterator, List, Tuple

import aiodat

_DESCRIPTORS = (types.FunctionType, property, types.MemberDescriptorType, types.GetSetDescriptorType,
                types.MethodDescriptorType, classmethod, staticmethod)


def _public_modules() -> Iterator[types.ModuleType]:
    """aiodat and each of its modules with an ``__all__``, private ones (``_shim``...) left out."""
    yield aiodat
    for info in pkgutil.walk_packages(aiodat.__path__, "aiodat."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "__all__"):
            yield module


def _doc(value: object) -> str:
    if isinstance(value, (classmethod, staticmethod)):
        value = value.__func__
    return (getattr(value, "__doc__", None) or "").strip()


def _undocumented(cls: type) -> Iterator[str]:
    for klass in cls.__mro__:
        if not klass.__module__.startswith("aiodat"):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or not isinstance(value, _DESCRIPTORS):
                continue
            if isinstance(value, types.MemberDescriptorType) and hasattr(klass, "__dataclass_fields__"):
                continue
            if not _doc(value):
                yield f"{cls.__qualname__}.{attr} (from {klass.__module__}.{klass.__qualname__})"


def _exported() -> List[Tuple[str, object]]:
    seen = set()
    found = []
    for module in _public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) not in seen and (inspect.isclass(obj) or inspect.isfunction(obj)):
                seen.add(id(obj))
                found.append((f"{module.__name__}.{name}", obj))
    return found


def test_every_exported_name_and_member_has_a_docstring() -> None:
    exported = _exported()
    assert len(exported) > 100  # the walk found the package's modules
    missing = []
    for name, obj in exported:
        if not _doc(obj):
            missing.append(name)
        if inspect.isclass(obj):
            missing.extend(_undocumented(obj))
    assert not missing, "no docstring: " + ", ".join(missing)


def test_the_check_sees_an_undocumented_c_member() -> None:
    # StreamCore's public state is the C base class's members: the check must reach them
    from aiodat.streams import StreamCore

    names = {attr for klass in StreamCore.__mro__ for attr in vars(klass)}
    assert {"nslots", "eof_sent", "stats"} <= names

    class Undocumented:
        __slots__ = ("field",)

    Undocumented.__module__ = "aiodat.example"
    assert list(_undocumented(Undocumented)) == [
        f"{Undocumented.__qualname__}.field (from aiodat.example.{Undocumented.__qualname__})"]
