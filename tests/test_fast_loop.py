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


def test_a_module_with_a_shared_set_up_runs_in_one_worker() -> None:
    """The suite's distribution (tests/conftest.py): under two workers the tests of a module that defines
    a module-scoped fixture (tests/test_import_structure.py) all run in one worker, so the fixture is made
    once, while another module's tests are sent singly; tests/slow.txt's seconds (the order) are read."""
    import re
    import subprocess
    import sys

    from tests.conftest import makes_shared_setups, slow_test_seconds

    assert makes_shared_setups(REPO / "tests" / "test_import_structure.py")
    assert makes_shared_setups(REPO / "tests" / "test_cluster.py")  # the SLURM cluster: one worker starts it
    assert not makes_shared_setups(REPO / "tests" / "test_fast_loop.py")
    seconds = slow_test_seconds()
    quickstart = seconds["tests/test_cli_runs.py::test_every_objective_learns_in_the_quickstart"]
    assert quickstart == max(seconds.values()) > 60  # the longest: sent first
    singles = [f"tests/test_fast_loop.py::{n}" for n in ("test_every_listed_slow_test_exists",
                                                          "test_readme_gives_the_fast_loop_beside_the_full_command")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider",
                        "tests/test_import_structure.py", *singles], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (tests/test_\w+\.py)::", r.stdout, re.M)
    shared = [worker for worker, module in ran if module == "tests/test_import_structure.py"]
    assert len(shared) == 5 and len(set(shared)) == 1, ran
    assert len(ran) == 7, r.stdout[-3000:]
