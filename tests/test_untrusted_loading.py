"""Files kdrun reads may come from a shared cache or another person's run: nothing it loads may run
code. Every ``torch.load`` passes ``weights_only=True``, ``numpy.load`` never allows pickles, no
module imports pickle (or its relatives), and no model is loaded with ``trust_remote_code``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(REPO / "kdrun").rglob("*.py"), *(REPO / "scripts").rglob("*.py")])
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "joblib", "shelve", "marshal", "cloudpickle"}


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``<anything>.name(...)`` or ``name(...)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                out.append(node)
    return out


def keyword(call: ast.Call, name: str):
    kw = next((k for k in call.keywords if k.arg == name), None)
    return None if kw is None else (kw.value.value if isinstance(kw.value, ast.Constant) else "dynamic")


def test_sources_are_found() -> None:
    assert len(SOURCES) > 50 and REPO / "kdrun" / "engine" / "checkpoints.py" in SOURCES


def test_no_load_can_run_code() -> None:
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(REPO)
        for call in calls(tree, "load"):
            f = call.func
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if owner == "torch" and keyword(call, "weights_only") is not True:
                problems.append(f"{where}:{call.lineno}: torch.load without weights_only=True")
            if owner in ("np", "numpy") and keyword(call, "allow_pickle") not in (None, False):
                problems.append(f"{where}:{call.lineno}: numpy.load with allow_pickle")
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            problems += [f"{where}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and keyword(call, "trust_remote_code") not in (None, False):
                problems.append(f"{where}:{call.lineno}: trust_remote_code")
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan itself: a torch.load without weights_only and a pickle import are found."""
    tree = ast.parse("import pickle\nimport torch\ntorch.load('x')\ntorch.load('y', weights_only=True)\n")
    loads = calls(tree, "load")
    assert [keyword(c, "weights_only") for c in loads] == [None, True]
    assert any(isinstance(n, ast.Import) and n.names[0].name == "pickle" for n in ast.walk(tree))
