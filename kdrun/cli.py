"""The ``kdrun`` command: Hydra composes and validates the config, then one run executes.

Only light modules are imported at start-up so configuration mistakes are reported in about a
second; torch, transformers and datasets load after the checks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from kdrun.config import register_configs

register_configs()

# Errors a user can fix from the message alone: printed without a traceback.
_USER_ERRORS: tuple[type[BaseException], ...] = ()


def _user_errors() -> tuple[type[BaseException], ...]:
    global _USER_ERRORS
    if not _USER_ERRORS:
        from kdrun.data.sources import DataError
        from kdrun.models import ModelUnavailableError
        from kdrun.run import ConfigError
        from kdrun.trainer import TrainingDiverged

        _USER_ERRORS = (ConfigError, DataError, ModelUnavailableError, TrainingDiverged, KeyError, ValueError)
    return _USER_ERRORS


@hydra.main(version_base="1.3", config_path="pkg://kdrun.conf", config_name="config")
def _main(cfg: DictConfig) -> float | None:
    from kdrun.run import run

    hc = HydraConfig.get()
    run_dir = Path(cfg.output_dir) if cfg.output_dir else Path(hc.runtime.output_dir)
    if hc.mode == RunMode.MULTIRUN and cfg.logger.group is None:
        with open_dict(cfg):  # group the jobs of one sweep together in wandb
            cfg.logger.group = Path(hc.sweep.dir).name
    try:
        summary = run(cfg, run_dir)
    except _user_errors() as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"kdrun: error: {msg}", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN:
            raise
        sys.exit(2)
    metrics = next(iter(summary["student"]["metrics"].values()))
    # The return value is what sweepers (Optuna) optimise: the task's main dev metric.
    return float(metrics[cfg.task.main_metric])


def main() -> None:
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _main()


__all__ = ["main", "OmegaConf"]
