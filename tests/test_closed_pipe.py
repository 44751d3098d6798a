"""Every console command of pyproject.toml ends quietly when its reader goes away: no traceback, no
"--- Logging error ---" from a logging handler, and status 0 or 141 (a process that SIGPIPE ended).

Each command runs as its console script would (its pyproject.toml entry point, so the test does not
depend on what is installed) in a shell pipe into ``head -n0``, which closes the pipe at once: every
write fails, whatever the size of the output (``head -1`` may read a short output whole)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import pyproject
from test_sweeps import env_for

from tests.conftest import TINY, TOY

SCRIPTS = pyproject()["project"]["scripts"]
TINY_SWEEP = ["-m", *TINY, *TOY, "task.toy.num_train=32", "task.toy.num_validation=16", "objective=finetune",
              "seed=1,2", "train.epochs=1", "report.cost=false"]
CASES = [(name, ["--help"]) for name in sorted(SCRIPTS)] + [("kdrun-cache", ["list"]), ("kdrun", TINY_SWEEP)]


def through_closed_pipe(tmp: Path, name: str, args: list[str]) -> tuple[int, str]:
    """The command's exit status and stderr, its stdout piped into ``head -n0``."""
    module, function = SCRIPTS[name].split(":")
    program = f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"
    cmd = shlex.join([sys.executable, "-c", program, *args])
    (tmp / "cache").mkdir(exist_ok=True)
    r = subprocess.run(["bash", "-c", f"{cmd} | head -n0; echo ${{PIPESTATUS[0]}}"], cwd=tmp, env=env_for(tmp),
                       capture_output=True, text=True, timeout=300)
    return int(r.stdout.strip()), r.stderr


@pytest.mark.parametrize("name,args", CASES, ids=[f"{n} {a[0]}" for n, a in CASES])
def test_pipe_closed_early_every_command_ends_quietly(tmp_path: Path, name: str, args: list[str]) -> None:
    status, err = through_closed_pipe(tmp_path, name, args)
    assert "Traceback" not in err and "Logging error" not in err and "Broken pipe" not in err, err
    assert status in (0, 141), err


def test_pipe_every_console_script_is_wrapped() -> None:
    from kdrun.app import commands

    wrapped = {name: f"kdrun.app.commands:{name.removeprefix('kdrun-')}" for name in commands.MAINS}
    assert SCRIPTS == {"kdrun": "kdrun.cli:main", **wrapped}
