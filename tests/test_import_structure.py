"""kdrun's packages form layers: a module imports only its own layer and the layers below it, no
module takes part in an import circle, and no module reaches into another package's private
(underscored) names. Every import counts, also those inside functions: a deferred import is still a
dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "kdrun"
# Lowest first. A module of layer i may import layers 0..i.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("kdrun", "kdrun.errors", "kdrun.config")),
    ("runtime", ("kdrun.runtime",)),
    ("models", ("kdrun.models",)),
    ("tasks", ("kdrun.tasks",)),
    ("losses", ("kdrun.losses",)),
    ("engine", ("kdrun.engine",)),
    ("strategies", ("kdrun.strategies",)),
    ("report", ("kdrun.report",)),
    ("app", ("kdrun.app", "kdrun.cli", "kdrun.__main__")),
]


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}"
    return level


def _target(mods: dict[str, Path], name: str) -> str | None:
    """The kdrun module ``name`` refers to (a module, or the package of a name imported from it)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(imported kdrun module, line, imported name) for every import in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full, node.lineno, "") if full in mods else (base, node.lineno, a.name))
    resolved = []
    for name, line, what in out:
        target = _target(mods, name) if name.startswith("kdrun") else None
        if target and target != module:
            resolved.append((target, line, what))
    return resolved


@pytest.fixture(scope="module")
def graph():
    mods = module_files()
    return mods, {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_no_upward_imports(graph) -> None:
    mods, edges = graph
    bad = [f"{mods[m].relative_to(REPO)}:{line}: {m} ({LAYERS[layer_of(m)][0]}) imports {t} "
           f"({LAYERS[layer_of(t)][0]})"
           for m, targets in edges.items() for t, line, _ in targets if layer_of(t) > layer_of(m)]
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def _cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles(graph) -> None:
    _, edges = graph
    plain = {m: sorted({t for t, _, _ in targets}) for m, targets in edges.items()}
    assert not _cycles(plain), f"import circles: {_cycles(plain)}"


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def test_only_public_names_across_packages(graph) -> None:
    mods, edges = graph
    bad = []
    for m, targets in edges.items():
        own = m if mods[m].name == "__init__.py" else m.rpartition(".")[0]
        for t, line, what in targets:
            home = t if mods[t].name == "__init__.py" else t.rpartition(".")[0]
            if what.startswith("_") and not what.startswith("__") and home != own:
                bad.append(f"{mods[m].relative_to(REPO)}:{line}: {what} from {t}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    for module in module_files():
        layer_of(module)
