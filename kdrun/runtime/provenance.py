"""Where a run came from: the exact command, kdrun's version and git commit, and the installed
packages (kept once per run in ``provenance.json``, and in ``results.json``)."""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROVENANCE = "provenance.json"  # in a run directory: written once, when it receives its run
PREVIOUS = "previous"  # <run_dir>/previous/<time>/: runs that resume=false moved aside (kdrun.app.identity)


def moved_aside(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run that ``resume=false`` moved aside (``<run>/previous/<time>``)."""
    from kdrun.runtime.locks import LOCK_NAME

    return run_dir.parent.name == PREVIOUS and (run_dir.parent.parent / LOCK_NAME).exists()


# The run directory of the run this process is executing (cache entries record who made them).
_CURRENT: dict[str, str] = {}


def set_current_run(run_dir: Path | None) -> None:
    """Name the run this process executes (None: none any more)."""
    if run_dir is None:
        _CURRENT.pop("run", None)
    else:
        _CURRENT["run"] = str(Path(run_dir).resolve())


def current_run() -> str | None:
    return _CURRENT.get("run")


_MAIN_PACKAGES = ("kdrun", "torch", "transformers", "datasets", "evaluate", "accelerate", "hydra-core", "wandb")


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)  # kdrun's code does not change while it runs: ask git once
def git_commit() -> dict[str, Any] | None:
    """kdrun's commit when it runs from a git checkout (an editable install): ``{"commit", "dirty"}``
    (dirty: tracked files changed since the commit); None for an installed package."""
    package = Path(__file__).resolve().parents[1]
    top = _git(["rev-parse", "--show-toplevel"], package)
    if top is None or Path(top).resolve() != package.parent:  # a repository that merely contains site-packages
        return None
    commit = _git(["rev-parse", "HEAD"], package)
    status = _git(["status", "--porcelain", "--untracked-files=no"], package)
    return None if not commit else {"commit": commit, "dirty": bool(status)}


def main_versions() -> dict[str, str]:
    """Python's and the main libraries' versions (results.json ``versions``)."""
    out = {"python": platform.python_version()}
    for pkg in _MAIN_PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def installed_packages() -> dict[str, str]:
    """Every installed distribution and its version, sorted by name."""
    found = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name] = dist.version
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def command_record() -> dict[str, Any]:
    """The command as typed (argv), where and when it ran."""
    return {"argv": list(sys.argv), "command": " ".join(sys.argv), "cwd": os.getcwd(),
            "host": socket.gethostname(), "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def provenance(config_hash: str, resolved: dict[str, Any]) -> dict[str, Any]:
    """``provenance.json``: written once, when a run directory receives its run."""
    return {"config_hash": config_hash, **command_record(), "kdrun": main_versions().get("kdrun"),
            "git": git_commit(), "python": platform.python_version(), "packages": installed_packages(),
            "config": resolved}
