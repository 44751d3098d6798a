"""What kdrun adds to the submitit launchers (``launcher=submitit_local`` / ``slurm`` / ``packed``) in
the submitting process.

* **Finished jobs are not submitted again.** Each job's directory is named by its overrides, so
  before launching, the jobs whose directory already holds this configuration's ``results.json``
  (the same ``config_hash``) are answered from it
  (their main dev metric is what a sweeper such as Optuna reads) and only the others are
  submitted: rerunning a finished SLURM sweep queues nothing.
* **Clusters without accounting.** submitit follows SLURM jobs with ``sacct``; where accounting
  is disabled (``AccountingStorageType=accounting_storage/none``, common on small clusters) every
  poll printed a warning for as long as the jobs ran. kdrun's watcher notices this once, says so
  in one line and follows the jobs with ``squeue`` instead (completion itself is read from the
  result files either way).
* **Packed local jobs.** ``launcher=packed`` is submitit's local launcher with a ``jobs_at_once``
  setting: its unfinished jobs go to :mod:`kdrun.runtime.packing`, which runs that many at a time.

:func:`install` patches the plugin's ``launch`` and submitit's SLURM watcher in the submitting
process only; the jobs run the plugin unchanged.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

_INSTALLED: dict[str, bool] = {}


def job_identity(launcher: Any, overrides: Sequence[str], identity: Callable[[dict], str]) -> tuple[Path, str | None]:
    """A sweep job's directory and its config's identity (``identity`` of the resolved job config;
    None if it does not resolve: the job itself reports why)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)  # ${hydra:...} in the names resolve against this job
        out = OmegaConf.select(cfg, "output_dir")
        path = Path(str(out)) if out else Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        task_cfg = cfg.copy()
        with open_dict(task_cfg):
            del task_cfg["hydra"]
        try:
            found = identity(OmegaConf.to_container(task_cfg, resolve=True))
        except Exception:  # noqa: BLE001 - the job reports its own config error
            found = None
    finally:
        HydraConfig.instance().cfg = saved
    return path, found


def finished_return(run_dir: Path, overrides: Sequence[str]):
    """A JobReturn for a job whose results.json exists: its main dev metric, as the job returns it."""
    from hydra.core.utils import JobReturn, JobStatus

    res = json.loads((run_dir / "results.json").read_text())
    main = res["config"]["task"]["main_metric"]
    value = float(next(iter(res["student"]["metrics"].values()))[main])
    return JobReturn(overrides=list(overrides), working_dir=str(run_dir), status=JobStatus.COMPLETED,
                     _return_value=value)


def _finished_as(run_dir: Path, identity: str) -> bool:
    """Whether ``run_dir`` holds this configuration's complete run (another configuration's run is
    submitted, and the job refuses it: kdrun.app.identity)."""
    try:
        return json.loads((run_dir / "results.json").read_text()).get("config_hash") == identity
    except (OSError, ValueError):
        return False


def _skipping_launch(original, identity_of: Callable[[dict], str]):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        done, todo = {}, []
        for i, overrides in enumerate(job_overrides):
            run_dir, identity = job_identity(self, overrides, identity_of)
            if identity is not None and _finished_as(run_dir, identity):
                done[i] = finished_return(run_dir, overrides)
            else:
                todo.append(i)
        if done:
            print(f"[kdrun] {len(done)} of {len(job_overrides)} jobs already have results (reported, not "
                  f"submitted); submitting {len(todo)}", flush=True)
        submit = partial(original, self)
        if "jobs_at_once" in self.params:  # launcher=packed; a bad setting is refused before any job
            from kdrun.runtime.packing import packed_submit

            submit = packed_submit(self)
        launched = submit([job_overrides[i] for i in todo], initial_job_idx) if todo else []
        out = dict(done) | dict(zip(todo, launched))
        return [out[i] for i in range(len(job_overrides))]

    launch._kdrun = True
    return launch


def _squeue_info(job_ids: Sequence[str]) -> dict[str, dict[str, str]]:
    """State of SLURM jobs (array tasks expanded) from squeue; jobs it no longer lists are done."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%N", "-j", ",".join(job_ids)],
                         capture_output=True, text=True)
    info: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines():
        jid, state, nodes = (line.split("|") + ["", ""])[:3]
        m = re.fullmatch(r"(\d+)_\[(.+)\]", jid)  # a pending array: 12_[0-3,5]
        ids = [jid] if m is None else [f"{m[1]}_{k}" for part in m[2].split("%")[0].split(",")
                                       for k in _expand(part)]
        for one in ids:
            info[one] = {"JobID": one, "State": state, "NodeList": nodes}
    return info


def _expand(part: str) -> range:
    a, _, b = part.partition("-")
    return range(int(a), int(b or a) + 1)


def _watcher_class():
    from submitit.core import logger
    from submitit.slurm.slurm import SlurmInfoWatcher

    class AccountingAwareWatcher(SlurmInfoWatcher):
        """submitit's SLURM watcher, falling back to squeue (once, quietly) without accounting."""

        use_squeue = False

        def update(self) -> None:
            if not self.use_squeue:
                probe = self._make_command()
                if probe is None:
                    return
                run = subprocess.run(probe, capture_output=True)
                if run.returncode == 0:
                    self._num_calls += 1
                    self._output = run.stdout
                    self._info_dict.update(self.read_info(run.stdout))
                    return self._after_update()
                if b"accounting storage is disabled" not in run.stderr.lower():
                    return super().update()
                self.use_squeue = True
                logger.get_logger().info("SLURM accounting is disabled: following the jobs with squeue")
                print("[kdrun] SLURM accounting (sacct) is disabled on this cluster: following the jobs with "
                      "squeue", flush=True)
            pending = sorted(self._registered - self._finished)
            if not pending:
                return
            self._num_calls += 1
            info = _squeue_info(sorted({j.split("_")[0] for j in pending}))
            for job_id in pending:  # a job squeue no longer lists has ended; its result file tells how
                self._info_dict[job_id] = info.get(job_id, {"JobID": job_id, "State": "COMPLETED"})
            self._after_update()

        def _after_update(self) -> None:
            import time

            self._last_status_check = time.time()
            for job_id in self._registered - self._finished:
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

    return AccountingAwareWatcher


def install(identity_of: Callable[[dict], str]) -> None:
    """Patch the submitit launcher plugin and watcher in this (submitting) process; idempotent.
    ``identity_of``: a resolved job config's identity (kdrun.app.context.run_config_hash)."""
    if _INSTALLED:
        return
    _INSTALLED["done"] = True
    from hydra.core.plugins import Plugins

    try:
        from submitit.slurm.slurm import SlurmJob
    except ImportError:  # the plugin is an optional extra
        return
    # Hydra loads plugin modules itself (not always through sys.modules): patch the classes it uses.
    for name, cls in Plugins.instance().class_name_to_class.items():
        if name.startswith("hydra_plugins.hydra_submitit_launcher."):
            for base in cls.__mro__:
                if base.__name__ == "BaseSubmititLauncher" and not getattr(base.launch, "_kdrun", False):
                    base.launch = _skipping_launch(base.launch, identity_of)
    SlurmJob.watcher = _watcher_class()(delay_s=SlurmJob.watcher._delay_s)
