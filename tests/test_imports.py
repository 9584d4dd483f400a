"""The package map of docs/packages.md, checked on the source: which package may import
which, no import circle between modules, and imports inside functions only where they
guard an optional dependency. Read from the AST, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Package -> the qkv packages it may import (besides itself). Top-level modules count as
# packages of their own name.
MAY_IMPORT = {
    "cache": set(), "bars": set(), "limits": set(), "threads": set(), "allocations": set(),
    "core": {"cache"},
    # qkv.weighting: the public face of core.weighting, as qkv.attention is of the engines.
    "weighting": {"core"},
    "engines": {"core", "cache"},
    "distributed": {"engines", "core"},
    "integrations": {"engines", "core"},
    "data": {"cache", "limits"},
    "nn": {"engines", "core", "distributed", "limits"},
    "models": {"nn", "engines", "core", "distributed", "data", "bars", "cache", "limits"},
    "interp": {"models", "nn", "engines", "core", "distributed", "data", "bars", "cache",
               "limits"},
    "train": {"models", "nn", "engines", "core", "distributed", "data", "bars", "cache",
              "limits", "threads", "allocations"},
    "lab": {"train", "models", "nn", "engines", "core", "distributed", "data", "bars", "cache",
            "limits", "threads", "allocations", "viz"},
    "viz": {"train", "models", "nn", "engines", "core", "distributed", "data", "bars", "cache",
            "limits", "threads", "allocations"},
}
# The command modules, which may import everything.
COMMANDS = {"cli", "run_commands", "model_commands", "chat", "__main__"}
# Modules that import an optional dependency when they load: the only qkv modules another
# module may import inside a function.
OPTIONAL = {
    "qkv.viz.plots": "matplotlib",
    "qkv.viz.heatmap": "matplotlib",
    "qkv.engines.triton.function": "triton",
}


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (SRC / "qkv").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _targets(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The qkv modules an ``from X import a, b`` loads: X.a where that is a module, else X."""
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + int(is_package)]
        where = ".".join(base + ([node.module] if node.module else []))
    else:
        where = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{where}.{alias.name}"
        target = sub if sub in MODULES else where
        if target in MODULES and target not in out:
            out.append(target)
    return out


def _imports_of(module: str, is_package: bool, tree: ast.AST) -> list[tuple[str, bool, int]]:
    """(imported qkv module, inside a function, line) for each import in ``tree``."""
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom):
                found.extend((t, inner, child.lineno)
                             for t in _targets(module, is_package, child))
            elif isinstance(child, ast.Import):
                found.extend((a.name, inner, child.lineno) for a in child.names
                             if a.name in MODULES)
            visit(child, inner)

    visit(tree, False)
    return found


def _imports() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of a qkv module."""
    return [(module, *found)
            for module, (path, is_package) in MODULES.items()
            for found in _imports_of(module, is_package,
                                     ast.parse(path.read_text(encoding="utf-8")))]


IMPORTS = _imports()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qkv"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_no_import_circle_between_modules():
    edges: dict[str, set[str]] = {}
    for importer, imported, _, _ in IMPORTS:
        edges.setdefault(importer, set()).add(imported)
    assert _cycles(edges) == []


def test_each_package_imports_only_the_packages_below_it():
    wrong = sorted(
        f"{importer} imports {imported} (line {line})"
        for importer, imported, _, line in IMPORTS
        if _package(importer) in MAY_IMPORT and _package(imported) != _package(importer)
        and _package(imported) not in MAY_IMPORT[_package(importer)]
    )
    assert wrong == []
    known = set(MAY_IMPORT) | COMMANDS | {"qkv"}
    assert {_package(m) for m in MODULES} <= known, "a new package needs its row in MAY_IMPORT"


def test_imports_inside_functions_only_guard_optional_dependencies():
    nested = sorted(f"{importer}:{line} imports {imported}"
                    for importer, imported, inside, line in IMPORTS
                    if inside and imported not in OPTIONAL)
    assert nested == []


@pytest.mark.parametrize("module, dependency", sorted(OPTIONAL.items()))
def test_the_optional_modules_really_load_their_dependency(module, dependency):
    """Each module kept behind a function-level import loads its dependency at import time,
    itself or through a qkv module it imports at the top."""
    def loads(name: str, seen: set[str]) -> bool:
        seen.add(name)
        tree = ast.parse(MODULES[name][0].read_text(encoding="utf-8"))
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level \
                else []
            if any(n.split(".")[0] == dependency for n in names):
                return True
        return any(loads(target, seen) for importer, target, inside, _ in IMPORTS
                   if importer == name and not inside and target not in seen)

    assert loads(module, set())


def test_the_checker_finds_circles_and_resolves_relative_imports():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    node = ast.parse("from ..core import masks, attention").body[0]
    assert _targets("qkv.nn.attention", False, node) == ["qkv.core.masks", "qkv.core"]
    node = ast.parse("from . import ops").body[0]
    assert _targets("qkv.engines", True, node) == ["qkv.engines.ops"]
    tree = ast.parse("import qkv.cache\ndef f():\n    from ..core import masks\n")
    assert _imports_of("qkv.nn", True, tree) == [("qkv.cache", False, 1),
                                                 ("qkv.core.masks", True, 3)]
