"""Issue 16: each integration is its own extra, imported only when used (host only, no device).

* ``pyproject.toml`` declares the extras ``aiohttp``, ``httpx``, ``grpclib``, ``dask`` (and
  ``integrations``, all of them);
* ``import aiodat`` imports no framework;
* each ``aiodat.integrations.X`` imports, in a fresh interpreter with warnings as errors, only
  the standard library, aiodat's own dependencies and what its extra installs (the extra's
  distributions and everything they require): ``pip install aiodat[X]`` is enough for it;
* a missing framework gives an ImportError naming the extra to install.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Dict, FrozenSet, List, Set, Tuple

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ("aiohttp", "httpx", "grpclib", "dask")
#: the top-level modules of the frameworks: none may be imported by ``import aiodat``
FRAMEWORK_MODULES = ("aiohttp", "httpx", "httpcore", "grpclib", "h2", "distributed", "dask", "google.protobuf")


def _pyproject() -> Dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: List[str]) -> Tuple[Set[str], Set[str]]:
    """(what ``requirements`` install, the optional dependencies of those, with all they require)."""
    required, frontier = _walk(requirements)
    optional: Set[str] = set()
    while frontier - optional - required:
        new = frontier - optional - required
        optional |= new
        more_required, more_optional = _walk(sorted(new))
        frontier = more_required | more_optional
    return required, optional


def _walk(requirements: List[str]) -> Tuple[Set[str], Set[str]]:
    """The distributions ``requirements`` install, transitively: markers evaluated here, a package's
    extras followed when a requirement asks for them (``aiodat[aiohttp,...]`` from pyproject.toml).
    Also returns the optional dependencies (extras not asked for) of those distributions: libraries
    import them only when they happen to be installed (httpx imports click for its CLI, distributed numpy)."""
    extras = _pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    seen: Set[Tuple[str, FrozenSet[str]]] = set()
    optional: Set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = (_norm(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if key[0] == "aiodat":
            todo += [Requirement(r) for e in req.extras for r in extras[e]]  # type: ignore[index]
            continue
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here: nothing of it can be imported either
        for r in requires:
            sub = Requirement(r)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ["", *req.extras]):
                sub.marker = None
                todo.append(sub)
            else:
                optional.add(_norm(sub.name))
    return {name for name, _ in seen}, optional


def test_the_extras_are_declared() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    for name in INTEGRATIONS:
        assert name in extras, f"pyproject.toml has no [{name}] extra"  # type: ignore[operator]
        assert extras[name], f"the [{name}] extra installs nothing"  # type: ignore[index]
    assert _norm(Requirement(extras["integrations"][0]).name) == "aiodat"  # type: ignore[index]
    assert Requirement(extras["integrations"][0]).extras == set(INTEGRATIONS)  # type: ignore[index]


def test_importing_aiodat_imports_no_framework() -> None:
    out = _run("import sys, aiodat, aiodat.streams, aiodat.integrations; "
               f"print([m for m in {FRAMEWORK_MODULES!r} if m in sys.modules])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import aiodat imported {out.stdout.strip()}"


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_each_integration_needs_only_its_extra(name: str) -> None:
    """Every distribution whose module ``import aiodat.integrations.<name>`` pulls in is installed by
    ``pip install aiodat[<name>]`` (or is an optional dependency of what it installs, imported only when
    present); the import emits no warning (run with -W error)."""
    out = _run("import sys; import aiodat; before = set(sys.modules); "
               f"import aiodat.integrations.{name}; import json; "
               "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    assert out.returncode == 0, f"import aiodat.integrations.{name} failed or warned:\n{out.stderr}"
    imported = set(json.loads(out.stdout.strip().splitlines()[-1]))
    third_party = imported - set(sys.stdlib_module_names) - {"aiodat", "_cffi_backend"}
    owners = metadata.packages_distributions()
    extras = _pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    required, optional = _closure([*_pyproject()["project"]["dependencies"], *extras[name]])  # type: ignore[misc]
    allowed = required | optional
    for module in sorted(third_party):
        dists = {_norm(d) for d in owners.get(module, [])}
        if not dists:
            continue  # not a distribution's module (an extension's private helper)
        assert dists & allowed, (f"aiodat.integrations.{name} imports {module!r} (from {sorted(dists)}), "
                                 f"which pip install aiodat[{name}] does not install")


@pytest.mark.parametrize("name, framework", [("aiohttp", "aiohttp"), ("httpx", "httpx"), ("grpclib", "grpclib")])
def test_a_missing_framework_names_the_extra(name: str, framework: str) -> None:
    """With the framework not importable, the integration's ImportError says which extra to install."""
    block = ("import sys, importlib.abc\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, fullname, path, target=None):\n"
             f"        if fullname.split('.')[0] == {framework!r}:\n"
             "            raise ImportError(f'No module named {fullname!r} (blocked)')\n"
             "sys.meta_path.insert(0, Block())\n"
             "try:\n"
             f"    import aiodat.integrations.{name}\n"
             "except ImportError as exc:\n"
             "    print(exc)\n")
    out = _run(block)
    assert out.returncode == 0, out.stderr
    assert f"pip install 'aiodat[{name}]'" in out.stdout, out.stdout


@pytest.mark.parametrize("name", ["aiohttp", "httpx", "grpclib"])
def test_public_names_have_docstrings_and_type_hints(name: str) -> None:
    """Every name in the module's ``__all__``, and every public method and property of those classes,
    has a docstring and annotated parameters and return."""
    import importlib
    import inspect

    module = importlib.import_module(f"aiodat.integrations.{name}")
    missing = []
    for public in module.__all__:
        obj = getattr(module, public)
        if not (obj.__doc__ or "").strip():
            missing.append(f"{public}: no docstring")
        for attr, value in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            func = value.fget if isinstance(value, property) else value
            if not callable(func):
                continue
            if attr != "__init__" and not (func.__doc__ or "").strip():
                missing.append(f"{public}.{attr}: no docstring")
            signature = inspect.signature(func)
            missing += [f"{public}.{attr}({p.name}): no type hint" for p in list(signature.parameters.values())[1:]
                        if p.annotation is inspect.Parameter.empty]
            if signature.return_annotation is inspect.Signature.empty:
                missing.append(f"{public}.{attr}: no return type hint")
    assert not missing, missing
