"""The ``kdrun`` command: Hydra composes and validates the config, then one run executes.

Only light modules are imported at start-up, so the mistakes Hydra and the config schema catch (an
unknown group, option or key, a value of the wrong type) are reported in about a second. torch loads
when the run starts, before kdrun's own checks (preflight: task, objective, models); datasets loads
during them and transformers after them.
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
from kdrun.runtime.pipes import quiet_on_closed_pipe

register_configs()

# Whether the task function was entered (an error before it is Hydra's: composition, the run
# directory) and whether a sweep job failed with a user error: they decide the exit status.
_STATUS = {"started": False, "user_error": False}


@hydra.main(version_base="1.3", config_path="pkg://kdrun.conf", config_name="config")
def _main(cfg: DictConfig) -> float | None:
    from kdrun.app.run import run

    hc = HydraConfig.get()
    run_dir = Path(cfg.output_dir) if cfg.output_dir else Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and cfg.logger.group is None:
        with open_dict(cfg):  # group the jobs of one sweep together in wandb
            cfg.logger.group = Path(hc.sweep.dir).name
    _STATUS["started"] = True
    from kdrun.runtime.threads import register_run

    register_run()  # early: jobs started together all count each other when choosing threads
    _setup_submitit_distributed()
    try:
        summary = run(cfg, run_dir, _hydra_files(cfg, hc))  # writes error.json when it fails
    except UserError as e:  # fixable from the message alone; anything else is a bug and keeps its traceback
        print(f"kdrun: error: {e}", file=sys.stderr)
        if multirun:  # the other jobs of the sweep still run; the sweep's exit status is 2
            _STATUS["user_error"] = True
            raise
        sys.exit(2)
    metrics = next(iter(summary["student"]["metrics"].values()))
    # The return value is what sweepers (Optuna) optimise: the task's main dev metric.
    return float(metrics[cfg.task.main_metric])


def _hydra_files(cfg: DictConfig, hc: DictConfig) -> dict[str, str]:
    """What Hydra keeps in ``.hydra/`` (its ``hydra.output_subdir``, off in kdrun's config): kdrun writes
    it once, with a new run, after checking the directory's run (kdrun.app.identity)."""
    return {"config.yaml": OmegaConf.to_yaml(cfg),
            "hydra.yaml": OmegaConf.to_yaml({"hydra": OmegaConf.to_container(hc, resolve=False)}),
            "overrides.yaml": OmegaConf.to_yaml(list(hc.overrides.task))}


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


def sweep_preset_error(overrides: list[str]) -> str | None:
    """A sweep preset is the grid of one objective (its ``sweep.objective``) and no longer chooses
    it: the one-line error when the command's objective is another, else None."""
    from kdrun.config import compose_each

    preset = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "sweep"), None)
    if preset is None or "," in preset:
        return None
    fixed = [o for o in overrides if "," not in o.split("=", 1)[-1] and not o.lstrip("+~").startswith("hydra.")]
    chosen = next((o.split("=", 1)[1].split(",") for o in overrides if o.split("=", 1)[0] == "objective"), [None])
    rest = [o for o in fixed if not o.startswith("objective=")]
    for cfg in compose_each([rest + ([] if objective is None else [f"objective={objective}"]) for objective in chosen]):
        wanted = (cfg.sweep or {}).get("objective")
        if wanted and cfg.objective.name != wanted:
            return (f"kdrun: error: sweep={preset} is the grid of objective={wanted} and does not choose it; "
                    f"this command's objective is {cfg.objective.name}: add objective={wanted}")
    return None


def _exit_for(error: Exception, full_traceback: bool) -> None:
    """Report an error that escaped Hydra and exit with kdrun's status: 2 for a mistake the user
    fixes (a bad override, an unwritable run directory, a user error in a sweep job), 1 for anything
    else (a bug: its traceback is printed)."""
    import traceback

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(error, BrokenPipeError):  # the reader went away (kdrun ... | head): main ends quietly
        raise error
    before_task = not _STATUS["started"]  # Hydra's own work: composing the config, the run directory
    user = _STATUS["user_error"] or (before_task and isinstance(error, (OSError, HydraException,
                                                                        OmegaConfBaseException)))
    if full_traceback or not user:
        traceback.print_exc()
    elif isinstance(error, OSError) and not isinstance(error, HydraException) and error.filename:
        print(f"kdrun: error: cannot write the run directory: {error.strerror}: {error.filename}; choose a "
              "writable place with hydra.run.dir=... (hydra.sweep.dir=... with -m) or KDRUN_OUTPUT_DIR=...",
              file=sys.stderr)
    elif not _STATUS["user_error"] and (line := _composition_line(error)):
        print(f"kdrun: error: {line}", file=sys.stderr)
    elif not _STATUS["user_error"]:  # as Hydra prints them; a sweep job printed its own error already
        print(str(error), file=sys.stderr)
        if isinstance(error.__cause__, OmegaConfBaseException):
            print(str(error.__cause__), file=sys.stderr)
        hint = stage_strategy_hint(f"{error} {error.__cause__}")
        if hint:
            print(hint, file=sys.stderr)
    sys.exit(2 if user else 1)


def _composition_line(error: Exception) -> str | None:
    """Hydra's error for an unknown option, group or key, or a value of the wrong type, in one line
    with the closest valid choices (kdrun.app.composition_errors); None for any other error."""
    from functools import partial

    from kdrun.app import composition_errors as ce

    if stage_strategy_hint(f"{error} {error.__cause__}"):
        return None
    overrides = _command_overrides(sys.argv[1:])
    return ce.one_line(error, ce.config_groups(), partial(ce.keys_at, overrides=overrides))


def stage_strategy_hint(message: str) -> str | None:
    """What to do when a stage sets a stage strategy's block in an objective that did not choose it."""
    import re

    from kdrun.config import stage_option_keys

    found = re.search(r"Key '(\w+)' not in 'StageConfig'", message)
    if not found or found.group(1) not in stage_option_keys():
        return None
    key = found.group(1)
    return (f"kdrun: hint: a stage's '{key}' block belongs to the stage strategy '{key}', which the objective must "
            f"choose: add '- override /stage_strategy@_global_.stage_strategy: {key}' to its defaults list "
            f"(conf/objective/dynabert.yaml does), or stage_strategy={key} on the command line")


def _refuse_added_schema_keys(overrides: list[str]) -> None:
    """Exit with one line for a ``+key=value`` outside the free-form dictionaries: Hydra would add
    the key and kdrun ignore it (kdrun.app.composition_errors.plus_key)."""
    if not any(o.startswith("+") for o in overrides):
        return
    from kdrun.app.composition_errors import plus_key_error

    line = plus_key_error(overrides)
    if line:
        print(f"kdrun: error: {line}", file=sys.stderr)
        sys.exit(2)


def _run_identity(resolved: dict) -> str:
    """A resolved run config's identity (imported when a launcher asks: torch loads with it)."""
    from kdrun.app.context import run_config_hash

    return run_config_hash(resolved)


@quiet_on_closed_pipe  # a closed pipe (kdrun ... | head) ends it quietly, with status 141
def main() -> None:
    _main_with_exit()


def _main_with_exit() -> None:
    full_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises; _exit_for reports
    if "KDRUN_SWEEP_NAME" not in os.environ:
        # Jobs (also submitit's subprocesses and SLURM jobs, which inherit the environment) name the
        # multirun directory from the command line, so a rerun of the same sweep finds it again.
        from kdrun.config import sweep_name

        os.environ["KDRUN_SWEEP_NAME"] = sweep_name(_command_overrides(sys.argv[1:]))
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        from kdrun.runtime.launching import install

        error = sweep_preset_error(_command_overrides(sys.argv[1:]))
        if error:
            print(error, file=sys.stderr)
            sys.exit(2)

        install(_run_identity)  # submitit launchers: skip finished jobs, follow SLURM jobs without accounting
    _refuse_added_schema_keys(_command_overrides(sys.argv[1:]))
    try:
        _main()
    except Exception as e:
        _exit_for(e, full_traceback)


__all__ = ["main", "OmegaConf"]
