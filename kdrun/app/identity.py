"""A run directory holds one run: the identity check made before anything is written there.

A directory's run is recorded by ``provenance.json`` (written once, when the run starts: the
config's identity hash, the composed config, the command, versions), and, for runs of earlier
kdrun versions, by ``results.json`` or the checkpoint's ``state.json``. A command whose identity
(:func:`kdrun.app.context.run_config_hash`) differs from the recorded one is refused in one line
naming the keys that differ, and nothing in the directory changes; ``resume=false`` moves the old
run aside (into ``previous/<time>/``) and starts over.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdrun.errors import UserError
from kdrun.runtime.provenance import PREVIOUS, PROVENANCE

_KEPT = {".kdrun.lock", PREVIOUS}  # what stays in place when a run is moved aside


class RunDirTaken(UserError):
    """The run directory holds a run of another configuration."""


@dataclass(frozen=True)
class Recorded:
    """The run a directory holds: ``state`` complete / partial / failed / unfinished, its identity
    hash and composed config (None when not recorded) and the file that told."""

    state: str
    config_hash: str | None
    config: dict[str, Any] | None
    source: Path


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _checkpoint_state(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    for name in ("last", "last.old"):  # last.old: a swap cut short, which the resume puts back
        path = run_dir / "checkpoints" / name / "state.json"
        state = _read_json(path)
        if state is not None:
            return path, state
    return None


def recorded_run(run_dir: Path) -> Recorded | None:
    """What ``run_dir`` holds, or None when it holds no run (absent, empty, or only the record of a
    command whose config never passed its checks)."""
    prov_path = run_dir / PROVENANCE
    prov = _read_json(prov_path) or {}
    results = _read_json(run_dir / "results.json")
    if results is not None:
        return Recorded("complete", results.get("config_hash"), results.get("config") or prov.get("config"),
                        run_dir / "results.json")
    ckpt = _checkpoint_state(run_dir)
    if ckpt is not None:
        return Recorded("partial", ckpt[1].get("config_hash"), prov.get("config"), ckpt[0])
    if prov:
        state = "failed" if (run_dir / "error.json").exists() else "unfinished"
        return Recorded(state, prov.get("config_hash"), prov.get("config"), prov_path)
    return None


def differing_keys(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The identity keys whose values differ (dotted, sorted): (key, old value, new value)."""
    from kdrun.config import without_non_identity
    from kdrun.report.results import flatten

    a, b = flatten(without_non_identity(old)), flatten(without_non_identity(new))
    missing = object()
    diff = [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]
    # Another choice of a group (objective.name ckd -> logit) says it all: its other keys are left out.
    renamed = {k[: -len(".name")] for k, _, _ in diff if k.endswith(".name")}

    def under_renamed(key: str) -> bool:
        group = key[: -len(".name")] if key.endswith(".name") else key
        return any(group.startswith(r + ".") for r in renamed)

    return [d for d in diff if not under_renamed(d[0])]


def _show(value: Any) -> str:
    from enum import Enum

    value = value.value if isinstance(value, Enum) else value  # the schema's choices, as spelt in configs
    text = "(absent)" if not isinstance(value, (str, int, float, bool, tuple, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_difference(recorded: Recorded, resolved: dict[str, Any], shown: int = 4) -> str:
    """The differing keys in a few words: ``objective.name: 'ckd' -> 'logit', ... (+3 more)``."""
    if recorded.config is None:
        return f"its configuration is not recorded beyond its hash (in {recorded.source.name})"
    diff = differing_keys(recorded.config, resolved)
    if not diff:
        return "no key differs: the identity of a configuration is defined differently by the kdrun that wrote it"
    parts = [f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in diff[:shown]]
    more = f" (+{len(diff) - shown} more)" if len(diff) > shown else ""
    return ", ".join(parts) + more


def check_identity(run_dir: Path, config_hash: str, resolved: dict[str, Any]) -> Recorded | None:
    """The run ``run_dir`` holds when it is this configuration's (or None when it holds none); raise
    :class:`RunDirTaken` when it is another configuration's."""
    recorded = recorded_run(run_dir)
    if recorded is None or recorded.config_hash == config_hash:
        return recorded
    raise RunDirTaken(
        f"{run_dir} holds a {recorded.state} run of another configuration ({describe_difference(recorded, resolved)}); "
        "nothing was changed: run this one in another directory (hydra.run.dir=..., or hydra.sweep.dir=... "
        "with -m), or rerun with resume=false to move the old run into "
        f"{run_dir / PREVIOUS}/ and start over")


def move_aside(run_dir: Path) -> Path | None:
    """Move the run ``run_dir`` holds (every entry but the lock and earlier moved runs) into
    ``previous/<time>/``; None when there is nothing to move."""
    entries = [p for p in run_dir.iterdir() if p.name not in _KEPT] if run_dir.is_dir() else []
    if not entries:
        return None
    dest = run_dir / PREVIOUS / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    for entry in entries:
        os.replace(entry, dest / entry.name)
    return dest


def write_record(run_dir: Path, record: dict[str, Any], hydra_files: dict[str, str] | None) -> None:
    """Record a new run in ``run_dir``: ``provenance.json`` and (under Hydra) ``.hydra/``'s config,
    hydra and overrides files, each written atomically and never again."""
    from kdrun.runtime.cache import write_json_atomic, write_text_atomic

    for name, text in (hydra_files or {}).items():
        (run_dir / ".hydra").mkdir(exist_ok=True)
        write_text_atomic(run_dir / ".hydra" / name, text)
    write_json_atomic(run_dir / PROVENANCE, record)
