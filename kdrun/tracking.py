"""Run tracking: ``metrics.jsonl`` always, Weights & Biases when the logger group asks for it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Tracker:
    """Appends one JSON object per ``log`` call to metrics.jsonl and mirrors it to wandb."""

    def __init__(self, run_dir: Path, logger_cfg: Any, config: dict[str, Any], run_name: str,
                 enabled: bool = True):
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
                name=run_name,
                config=config,
                dir=str(run_dir),
                mode=logger_cfg.mode,
                resume="allow",
                id=config.get("_run_id"),
                reinit="finish_previous",
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
