"""Run tracking: ``metrics.jsonl`` always, Weights & Biases when the logger group asks for it.

A run directory's wandb run id is kept in ``wandb_id.txt``: every attempt at the directory's run
(a resume from its checkpoint, or a retry of an attempt stopped before its first checkpoint)
continues the wandb run it had, while a fresh start (``resume=false``, which moves the old run and
its id aside) gets a new id. A resumed attempt logs the rows of ``metrics.jsonl`` up to its
checkpoint to wandb again (:meth:`Tracker.replay`): a killed attempt's wandb service may have
written none of them, and wandb drops the rows of steps it already holds, so each step is logged
once.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

WANDB_ID_FILE = "wandb_id.txt"
MAX_WANDB_ID = 120
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9_.-]+")  # wandb refuses :;,#?/' among others


def new_wandb_id(run_name: str, config_hash: str) -> str:
    """``<name>-<nonce>-<config hash>``: the name with every run of characters outside
    ``[A-Za-z0-9_.-]`` turned into ``_`` and cut to fit :data:`MAX_WANDB_ID` (the hash is kept
    whole), and 8 random hex digits that make each fresh start a run of its own."""
    tail = f"-{secrets.token_hex(4)}-{config_hash}"
    name = _NOT_IN_ID.sub("_", run_name).strip("_.-") or "run"
    return name[: max(1, MAX_WANDB_ID - len(tail))].rstrip("_.-") + tail


def wandb_run_id(run_dir: Path, run_name: str, config_hash: str, *, resuming: bool) -> str:
    """The wandb id for this run of ``run_dir``: the stored one when ``resuming`` (the run goes on
    from a checkpoint), else a new one; either way it is (re)written atomically to ``wandb_id.txt``."""
    from kdrun.runtime.cache import write_text_atomic

    path = run_dir / WANDB_ID_FILE
    stored = path.read_text().strip() if resuming and path.is_file() else ""
    if stored and not _NOT_IN_ID.search(stored):
        return stored
    run_id = new_wandb_id(run_name, config_hash)
    write_text_atomic(path, run_id + "\n")
    return run_id


class Tracker:
    """Appends one JSON object per ``log`` call to metrics.jsonl and mirrors it to wandb."""

    def __init__(self, run_dir: Path, logger_cfg: Any, config: dict[str, Any], run_name: str,
                 enabled: bool = True, run_id: str | None = None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.logger_cfg = logger_cfg
        if not enabled:
            return
        if logger_cfg.name == "wandb" and logger_cfg.mode != "disabled":
            import os

            os.environ.setdefault("WANDB_SILENT", "true")  # kdrun prints its own sync hint
            import wandb

            self.wandb_run = wandb.init(
                project=logger_cfg.project,
                entity=logger_cfg.entity,
                group=logger_cfg.group,
                tags=list(logger_cfg.tags) or None,
                name=run_name,  # the display name as given; the id is the sanitised one
                config={k: v for k, v in config.items() if not str(k).startswith("_")},
                dir=str(run_dir),
                mode=logger_cfg.mode,
                resume="allow",
                id=run_id,
                reinit="finish_previous",  # wandb>=0.19.9
            )

    @property
    def grad_shares(self) -> bool:
        """Whether the trainer measures per-term gradient shares for the log (``logger.grad_shares``)."""
        return self.enabled and bool(getattr(self.logger_cfg, "grad_shares", False))

    def log(self, values: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def replay(self) -> int:
        """Log metrics.jsonl's rows (rewound to the checkpoint being resumed) to wandb again, in order;
        returns how many."""
        if self.wandb_run is None or not self.path.is_file():
            return 0
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        for row in rows:
            values = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
            self.wandb_run.log(values, step=int(row["step"]))
        return len(rows)

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            for k, v in values.items():
                self.wandb_run.summary[k] = v

    def finish(self) -> str | None:
        """Close the run; returns a hint for syncing an offline wandb run, if any."""
        if self.wandb_run is None:
            return None
        run_dir = getattr(self.wandb_run, "dir", None)
        offline = self.logger_cfg.mode == "offline"
        self.wandb_run.finish()
        self.wandb_run = None
        if offline and run_dir:
            return f"wandb sync {Path(run_dir).parent}"
        return None
