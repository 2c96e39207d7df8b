"""The core's layers point down only (issue 14): an AST check of every import of aiodat.*.

Every module of the ``aiodat`` package is parsed; every ``import aiodat.x`` and
``from aiodat.x import ...`` (also inside functions, and relative imports) is
checked against :data:`LAYERS`, low to high.  An import may only go to a lower
layer, or to a module of the same layer as long as the modules of that layer
form no cycle.  Imports under ``if TYPE_CHECKING:`` are skipped (they never
run).  Modules are mapped to layers by dotted prefix (``aiodat.ep`` covers
``aiodat.ep`` and ``aiodat.ep.*``); a pattern ending in ``*`` covers every name
that starts with it, so ``aiodat.bench*`` is ``bench.py``, ``bench_streams.py``
and a future ``aiodat/bench/`` package alike.  Imports inside one component
(one pattern) are its owner's business and are not checked.  A module no
pattern covers fails the test: a new module must be given a layer here and in
docs/architecture.md.  Host-only: no device needed.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "aiodat"

#: low -> high; each layer is (name, component patterns).  Keep in step with docs/architecture.md.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("foundation", ("aiodat._shim", "aiodat._lib", "aiodat._version", "aiodat.errors")),
    ("support", ("aiodat.attrs", "aiodat._handle", "aiodat._fdwatch", "aiodat.poller", "aiodat.netdev",
                 "aiodat.devinfo",
                 "aiodat.epattr")),
    ("events", ("aiodat.evd",)),
    ("memory", ("aiodat.memory",)),
    ("connection and queues", ("aiodat.cm", "aiodat.srq", "aiodat.wr", "aiodat.cqsize")),
    ("posting", ("aiodat.post",)),
    ("endpoint", ("aiodat.ep",)),
    ("datagram", ("aiodat.datagram",)),
    ("factory", ("aiodat.ia",)),
    ("built on the core", ("aiodat.streams*", "aiodat.integrations*")),
    ("package", ("aiodat",)),
    ("tools", ("aiodat.bench*", "aiodat.testing*", "aiodat.testbed*", "aiodat.cli", "aiodat.__main__")),
]


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return module.startswith(pattern[:-1])
    return module == pattern or module.startswith(pattern + ".")


def component_of(module: str) -> Optional[Tuple[int, str]]:
    """(layer index, pattern) of a module: the longest matching pattern wins (``aiodat`` covers only itself)."""
    best: Optional[Tuple[int, str]] = None
    for index, (_name, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern == "aiodat":
                hit = module == "aiodat"
            else:
                hit = _matches(module, pattern)
            if hit and (best is None or len(pattern) > len(best[1])):
                best = (index, pattern)
    return best


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    skip: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for inner in node.body:
                    skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports_of(source: str, module: str, is_package: bool = False) -> Iterator[Tuple[str, int]]:
    """(imported aiodat module, line) for every runtime import in ``source`` of ``module``."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "aiodat" or alias.name.startswith("aiodat."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "aiodat" or base.startswith("aiodat."):
                if base == "aiodat":  # from aiodat import x: x is a submodule or a name of the package
                    for alias in node.names:
                        is_module = (ROOT / f"{alias.name}.py").exists() or (ROOT / alias.name).is_dir()
                        yield (f"aiodat.{alias.name}" if is_module else "aiodat"), node.lineno
                else:
                    yield base, node.lineno


def modules() -> Iterator[Tuple[str, pathlib.Path, bool]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        yield ".".join(parts), path, is_package


def check(sources: Dict[str, Tuple[str, str, bool]]) -> List[str]:
    """Problems of a set of modules: {module: (file name, source, is_package)} -> messages."""
    problems: List[str] = []
    same_layer: Dict[str, Set[str]] = {}  # component -> components of its layer it imports
    where: Dict[Tuple[str, str], Tuple[str, int]] = {}
    for module, (filename, source, is_package) in sorted(sources.items()):
        mine = component_of(module)
        if mine is None:
            problems.append(f"{filename}: module {module} has no layer: add it to LAYERS in tests/test_layers.py "
                            f"and to docs/architecture.md")
            continue
        for target, line in imports_of(source, module, is_package):
            theirs = component_of(target)
            if theirs is None:
                problems.append(f"{filename}:{line}: imports {target}, which has no layer")
                continue
            if theirs[1] == mine[1]:
                continue
            if theirs[0] > mine[0]:
                problems.append(f"{filename}:{line}: {module} (layer {LAYERS[mine[0]][0]!r}) imports {target} "
                                f"(layer {LAYERS[theirs[0]][0]!r}, higher): imports must point down")
            elif theirs[0] == mine[0]:
                same_layer.setdefault(mine[1], set()).add(theirs[1])
                where.setdefault((mine[1], theirs[1]), (f"{filename}:{line}", 0))
    # cycles among the components of one layer
    for start in sorted(same_layer):
        stack: List[Tuple[str, List[str]]] = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(same_layer.get(node, ())):
                if nxt == start:
                    cycle = path + [start]
                    layer = LAYERS[component_of(start.rstrip("*"))[0]][0]  # type: ignore[index]
                    hops = ", ".join(f"{a} -> {b} at {where[(a, b)][0]}" for a, b in zip(cycle, cycle[1:]))
                    message = f"import cycle inside layer {layer!r}: {hops}"
                    if message not in problems:
                        problems.append(message)
                elif nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return problems


def test_every_import_points_down() -> None:
    sources = {module: (str(path.relative_to(ROOT.parent)), path.read_text(), is_package)
               for module, path, is_package in modules()}
    assert "aiodat.ep" in sources and "aiodat.cm" in sources
    problems = check(sources)
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_checker_catches_an_upward_import() -> None:
    # a function-level import from a low module to a high one, as cm.py once imported ep.py
    source = "def f():\n    from aiodat.ep import EP\n    return EP\n"
    problems = check({"aiodat.cm": ("aiodat/cm.py", source, False)})
    assert len(problems) == 1
    assert "aiodat/cm.py:2" in problems[0] and "'connection and queues'" in problems[0] and "'endpoint'" in problems[0]


def test_checker_skips_type_checking_and_catches_relative_imports() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aiodat.ia import IA\n"
              "from . import ia\n")
    problems = check({"aiodat.evd": ("aiodat/evd.py", source, False)})
    assert len(problems) == 1 and "aiodat/evd.py:4" in problems[0] and "aiodat.ia" in problems[0]


def test_checker_catches_a_same_layer_cycle_and_an_unknown_module() -> None:
    problems = check({
        "aiodat.cm": ("aiodat/cm.py", "import aiodat.srq\n", False),
        "aiodat.srq": ("aiodat/srq.py", "from aiodat.cm import PSP\n", False),
        "aiodat.newthing": ("aiodat/newthing.py", "", False),
    })
    assert any("cycle" in p and "aiodat/cm.py:1" in p and "aiodat/srq.py:1" in p for p in problems), problems
    assert any("aiodat.newthing has no layer" in p for p in problems), problems


@pytest.mark.parametrize("module, layer", [
    ("aiodat.streams", "built on the core"), ("aiodat.streams.protocol", "built on the core"),
    ("aiodat.bench", "tools"), ("aiodat.bench_streams", "tools"), ("aiodat.bench.latency", "tools"),
    ("aiodat.testing.rxe", "tools"), ("aiodat.testbed.qemu", "tools"), ("aiodat.cli", "tools"),
    ("aiodat", "package"), ("aiodat.ep", "endpoint"), ("aiodat._shim.build_shim", "foundation"),
])
def test_packages_map_by_prefix(module: str, layer: str) -> None:
    found = component_of(module)
    assert found is not None and LAYERS[found[0]][0] == layer
