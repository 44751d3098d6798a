"""The fast inner loop (`python -m pytest -q -m "not slow"`): every test tests/slow.txt names exists,
so a renamed slow test cannot fall back into the fast loop unnoticed, and the README documents it."""

from __future__ import annotations

import ast

from tests.conftest import REPO, slow_test_ids


def _test_functions(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_every_listed_slow_test_exists() -> None:
    missing = []
    for node_id in sorted(slow_test_ids()):
        path, _, name = node_id.partition("::")
        if not (REPO / path).exists() or name not in _test_functions(REPO / path):
            missing.append(node_id)
    assert not missing, f"tests/slow.txt names tests that do not exist: {missing}"


def test_readme_gives_the_fast_loop_beside_the_full_command() -> None:
    readme = (REPO / "README.md").read_text()
    assert 'python -m pytest -q -m "not slow"' in readme and "python -m pytest -q\n" in readme
