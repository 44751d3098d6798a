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
from kdrun.errors import UserError

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://kdrun.conf", config_name="config")
def _main(cfg: DictConfig) -> float | None:
    from kdrun.run import run

    hc = HydraConfig.get()
    run_dir = Path(cfg.output_dir) if cfg.output_dir else Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and cfg.logger.group is None:
        with open_dict(cfg):  # group the jobs of one sweep together in wandb
            cfg.logger.group = Path(hc.sweep.dir).name
    _setup_submitit_distributed()
    try:
        summary = run(cfg, run_dir)
    except UserError as e:  # fixable from the message alone; anything else is a bug and keeps its traceback
        msg = str(e)
        print(f"kdrun: error: {msg}", file=sys.stderr)
        if multirun:
            _record_failure(run_dir, e, msg)
            raise
        sys.exit(2)
    except Exception as e:
        if multirun:
            _record_failure(run_dir, e, str(e))
        raise
    metrics = next(iter(summary["student"]["metrics"].values()))
    # The return value is what sweepers (Optuna) optimise: the task's main dev metric.
    return float(metrics[cfg.task.main_metric])


def _record_failure(run_dir: Path, error: BaseException, message: str) -> None:
    """A failed sweep job leaves error.json (kdrun-report lists it); a rerun retries the job."""
    import traceback

    from kdrun.cache import write_json_atomic

    try:
        write_json_atomic(run_dir / "error.json", {
            "type": type(error).__name__, "message": message,
            "traceback": "".join(traceback.format_exception(error))[-8000:]})
    except OSError:
        pass


def _setup_submitit_distributed() -> None:
    """Inside a submitit job with several tasks (launcher=slurm, hydra.launcher.tasks_per_node=N),
    export torch.distributed's environment so Accelerate runs the job data-parallel."""
    if "SUBMITIT_EXECUTOR" not in os.environ and "SLURM_JOB_ID" not in os.environ:
        return
    try:
        import submitit

        env = submitit.JobEnvironment()
        if env.num_tasks > 1 and "RANK" not in os.environ:
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    except (ImportError, RuntimeError):
        return


def _command_overrides(argv: list[str]) -> list[str]:
    """The key=value overrides of a kdrun command line (Hydra's own argument parser)."""
    from hydra._internal.utils import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:  # --help and friends
        return []
    return list(args.overrides or [])


def main() -> None:
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    if "KDRUN_SWEEP_NAME" not in os.environ:
        # Jobs (also submitit's subprocesses and SLURM jobs, which inherit the environment) name the
        # multirun directory from the command line, so a rerun of the same sweep finds it again.
        from kdrun.config import sweep_name

        os.environ["KDRUN_SWEEP_NAME"] = sweep_name(_command_overrides(sys.argv[1:]))
    _main()


__all__ = ["main", "OmegaConf"]
