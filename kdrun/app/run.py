"""One kdrun run: validate → data → teacher → student → stages → outputs."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kdrun.app.context import (
    Models,
    RunData,
    Session,
    load_data,
    make_accelerator,
    make_parts,
    make_tracker,
    run_config_hash,
    start_session,
)
from kdrun.app.identity import PROVENANCE, check_identity, move_aside, recorded_run, write_record
from kdrun.app.models import build_student, load_teacher
from kdrun.app.outputs import write_outputs
from kdrun.app.preflight import ConfigError, RunPlan, preflight
from kdrun.models.features import count_forwards
from kdrun.report.summary import print_summary
from kdrun.runtime.provenance import provenance

__all__ = ["ConfigError", "preflight", "run", "make_accelerator", "run_config_hash", "build_parts", "open_run"]


# --------------------------------------------------------------------------------------- helpers


def build_parts(session: Session, progress: dict[str, Any] | None = None) -> tuple[RunData, Models, Any]:
    """The phases after start_session, in order: the data, the tracker, the teacher, the student and the
    engine's parts (``progress["phase"]`` names the one running, for error.json)."""
    progress = {} if progress is None else progress
    progress["phase"] = "data"
    data = load_data(session)
    session.tracker = make_tracker(session)
    progress["phase"] = "teacher"
    teacher = load_teacher(session, data)
    progress["phase"] = "student"
    models = build_student(session, data, teacher)
    return data, models, make_parts(session, data, models)


def open_run(cfg: DictConfig, run_dir: Path) -> tuple[Session, RunData, Models, Any]:
    """A run's context up to its stages (checked config, session, data, models, engine parts), as
    :func:`run` builds it: for tools that drive the engine themselves (kdrun-doctor, benchmarks)."""
    session = start_session(cfg, run_dir, preflight(cfg), time.perf_counter())
    return (session, *build_parts(session))


def train_stages(session: Session, parts, progress: dict[str, Any] | None = None) -> tuple[Any, float]:
    """Run the objective's stages in order, resuming from checkpoints/last when present."""
    from kdrun.engine.checkpoints import rewind_metrics_log, seed_for_rank
    from kdrun.engine.trainer import train_resumably
    from kdrun.runtime.preemption import Interrupted

    t0, run_dir, acc = time.perf_counter(), session.run_dir, session.accelerator

    def resumed(state, ckpt: Path) -> None:
        if acc.is_main_process:
            rewind_metrics_log(run_dir)
            session.tracker.replay()  # wandb: the rows a killed attempt's service may not have written
        print(f"[kdrun] resuming at stage {state.stage} step {state.global_step} from {ckpt}")

    def fresh() -> None:
        seed_for_rank(session.cfg.train.seed, acc.process_index)  # per-process dropout
        if acc.is_main_process:  # lines a killed attempt logged before any checkpoint
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)

    if parts.teacher is not None:
        count_forwards(parts.teacher, session.teacher_forwards)
    try:
        state = train_resumably(parts, session.pre.plans, run_dir, session.config_hash, accelerator=acc,
                                resume=bool(session.cfg.resume), on_resume=resumed, on_fresh=fresh,
                                progress=progress)
    except Interrupted:
        session.tracker.finish()
        raise
    return state, time.perf_counter() - t0


def _is_main_rank() -> bool:
    """Rank 0 of a data-parallel run (torchrun, accelerate, submitit tasks), or a single process."""
    return int(os.environ.get("RANK", "0")) == 0


def run(cfg: DictConfig, run_dir: Path, hydra_files: dict[str, str] | None = None) -> dict[str, Any]:
    """Execute one configured run in ``run_dir``; returns the results written to results.json.

    Before anything is written, the run's identity is compared with the run the directory holds
    (kdrun.app.identity): another configuration's run is refused and left as it is; this
    configuration's complete run is reported (appended to ``cli.log``), a partial one resumed. The
    run holds ``run_dir``'s lock while it trains (a second process fails at once, or waits with
    resume=wait), copies its output into ``cli.log`` and, if it fails, writes ``error.json``.
    ``hydra_files``: the ``.hydra/`` files (name → text) to keep with a new run.
    """
    from kdrun.runtime.threads import registered_run

    with registered_run():  # counts among the machine's live runs while it runs (see kdrun.runtime.threads)
        return _checked_run(cfg, run_dir, hydra_files)


@dataclass
class _Identity:
    resolved: dict[str, Any]
    config_hash: str


def _identity(cfg: DictConfig, run_dir: Path) -> _Identity | None:
    """The config's identity; None when it cannot be resolved (preflight reports why), which is an
    error at once when ``run_dir`` holds a run (nothing of it may change)."""
    from omegaconf import OmegaConf

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        return _Identity(resolved, run_config_hash(resolved))
    except Exception:
        if recorded_run(run_dir) is not None:
            raise
        return None


def _checked_run(cfg: DictConfig, run_dir: Path, hydra_files: dict[str, str] | None) -> dict[str, Any]:
    identity = _identity(cfg, run_dir)
    if identity is not None and cfg.resume:
        recorded = check_identity(run_dir, identity.config_hash, identity.resolved)  # raises: another config's run
        if recorded is not None and recorded.state == "complete":
            return _report_complete(cfg, run_dir, identity, hydra_files)
    return _locked_run(cfg, run_dir, identity, hydra_files)


def _report_complete(cfg: DictConfig, run_dir: Path, identity: _Identity,
                     hydra_files: dict[str, str] | None) -> dict[str, Any]:
    """A rerun of a complete run: its table again; the one change is the section appended to cli.log.
    Waits (resume=wait) or fails while another process holds the directory, as a training run would."""
    from contextlib import nullcontext

    from kdrun.runtime.locks import run_dir_lock

    main = _is_main_rank()
    with run_dir_lock(run_dir, wait=cfg.resume == "wait", claim=False) if main else nullcontext():
        recorded = check_identity(run_dir, identity.config_hash, identity.resolved)  # the holder may have changed it
        if recorded is not None and recorded.state == "complete":
            return _print_complete(run_dir, main)
    return _locked_run(cfg, run_dir, identity, hydra_files)


def _print_complete(run_dir: Path, main: bool) -> dict[str, Any]:
    from kdrun.runtime.logs import tee_output

    with tee_output(run_dir / "cli.log", enabled=main):
        results_path = run_dir / "results.json"
        print(f"[kdrun] {results_path} exists: this run is complete (resume=false to redo it)")
        summary = json.loads(results_path.read_text())
        print_summary(summary)
        print(f"outputs: {run_dir}")
    return summary


def _locked_run(cfg: DictConfig, run_dir: Path, identity: _Identity | None,
                hydra_files: dict[str, str] | None) -> dict[str, Any]:
    from contextlib import nullcontext

    from kdrun.runtime.locks import run_dir_lock
    from kdrun.runtime.logs import tee_output

    main, moved = _is_main_rank(), None
    with run_dir_lock(run_dir, wait=cfg.resume == "wait") if main else nullcontext():
        if main and identity is not None:
            if cfg.resume:  # again under the lock: a run that held it may have finished meanwhile
                recorded = check_identity(run_dir, identity.config_hash, identity.resolved)
                if recorded is not None and recorded.state == "complete":
                    return _print_complete(run_dir, main)
            else:
                moved = move_aside(run_dir)
        with tee_output(run_dir / "cli.log", enabled=main):
            if moved is not None:
                print(f"[kdrun] resume=false: the run that was in {run_dir} moved to {moved}", flush=True)
            return _recorded_run(cfg, run_dir, identity, hydra_files, main)


def _recorded_run(cfg: DictConfig, run_dir: Path, identity: _Identity | None, hydra_files: dict[str, str] | None,
                  main: bool) -> dict[str, Any]:
    """Check the config, record a new run, train; a failure before the run completes writes error.json."""
    from kdrun.runtime.logs import disk_full, record_failure
    from kdrun.runtime.preemption import Interrupted
    from kdrun.runtime.provenance import set_current_run

    progress: dict[str, Any] = {"phase": "config"}
    set_current_run(run_dir)  # cache entries built from here on name this run
    try:
        pre = preflight(cfg)
        if main and identity is not None and not (run_dir / PROVENANCE).exists():
            write_record(run_dir, provenance(identity.config_hash, identity.resolved), hydra_files)
        result = _run(cfg, run_dir, pre, progress)
        if main and cfg.cache_max_gb:  # a bounded cache: least recently used entries go
            from kdrun.runtime.cache_cli import evict_to_size

            evict_to_size(cfg.cache_dir, cfg.cache_max_gb)
        return result
    except Interrupted as e:  # checkpointed (student or teacher): a rerun or requeue resumes
        print(f"[kdrun] {e}", flush=True)
        raise
    except Exception as e:
        full = disk_full(e, {"output_dir": run_dir, "cache_dir": Path(cfg.cache_dir).expanduser()})
        if main and not (run_dir / "results.json").exists():  # only a run that did not complete
            state = progress.pop("state", None)
            if state is not None:
                progress.update(stage=state.stage, step=state.global_step)
            record_failure(run_dir, full or e, progress)
        if full is not None:
            raise full from e
        raise
    finally:
        set_current_run(None)


def _run(cfg: DictConfig, run_dir: Path, pre: RunPlan, progress: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    if _is_main_rank():
        (run_dir / "error.json").unlink(missing_ok=True)  # of an earlier attempt
    progress["phase"] = "setup"
    session = start_session(cfg, run_dir, pre, t_start)
    data, models, parts = build_parts(session, progress)
    progress["phase"] = "stages"
    state, stages_s = train_stages(session, parts, progress)
    progress["phase"] = "outputs"
    return write_outputs(session, data, models, parts, state, stages_s)
