"""The README's setup and test commands are exactly what CI runs."""

from __future__ import annotations

from tests.conftest import REPO


def _ci_commands() -> list[str]:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return [lines[i + 1].strip() for i, line in enumerate(lines) if line.strip() in ("# setup", "# test")]


def test_ci_runs_the_readme_commands() -> None:
    readme = (REPO / "README.md").read_text()
    setup, test = _ci_commands()
    assert setup.startswith("pip install") and "constraints.txt" in setup
    assert test.startswith("python -m pytest")
    assert f"```\n{setup}\n```" in readme
    assert f"```\n{test}\n```" in readme


def test_ci_installs_into_a_fresh_virtual_environment_as_the_readme_says() -> None:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    venv = lines[lines.index("# venv") + 1]
    assert venv.startswith("python3 -m venv ") and venv.endswith('. "$venv/bin/activate"')
    assert lines.index("# venv") < lines.index("# setup")
    readme = (REPO / "README.md").read_text()
    assert "python3 -m venv .venv && . .venv/bin/activate" in readme


def test_constraints_pin_the_cpu_stack() -> None:
    pins = (REPO / "constraints.txt").read_text()
    for pin in ("torch==2.13.0", "hydra-core==1.3.8", "omegaconf==2.3.1", "sqlalchemy<2"):
        assert pin in pins
