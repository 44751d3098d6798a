"""One kdrun run: validate → data → teacher → student → stages → outputs."""

from __future__ import annotations

import json
import os
import time
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
from kdrun.app.models import build_student, load_teacher
from kdrun.app.outputs import count_forwards, write_outputs
from kdrun.app.preflight import ConfigError, RunPlan, preflight
from kdrun.report.summary import print_summary

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


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Execute one configured run in ``run_dir``; returns the results written to results.json.

    The run holds ``run_dir``'s lock throughout (a second process fails at once, or waits with
    resume=wait), copies its output into ``cli.log`` and, if it fails, writes ``error.json``.
    """
    from kdrun.runtime.threads import registered_run

    with registered_run():  # counts among the machine's live runs while it runs (see kdrun.runtime.threads)
        return _locked_run(cfg, run_dir)


def _locked_run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    from contextlib import nullcontext

    from kdrun.runtime.locks import run_dir_lock
    from kdrun.runtime.logs import disk_full, record_failure, tee_output
    from kdrun.runtime.preemption import Interrupted

    main = _is_main_rank()
    progress: dict[str, Any] = {"phase": "config"}
    try:  # nothing is created for a config that cannot run (Hydra's run directory, if any, gets error.json)
        pre = preflight(cfg)
    except Exception as e:
        if main and run_dir.is_dir():
            record_failure(run_dir, e, progress)
        raise
    with run_dir_lock(run_dir, wait=cfg.resume == "wait") if main else nullcontext():
        with tee_output(run_dir / "cli.log", enabled=main):
            try:
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
                if main:
                    state = progress.pop("state", None)
                    if state is not None:
                        progress.update(stage=state.stage, step=state.global_step)
                    record_failure(run_dir, full or e, progress)
                if full is not None:
                    raise full from e
                raise


def _run(cfg: DictConfig, run_dir: Path, pre: RunPlan, progress: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    results_path = run_dir / "results.json"
    if results_path.exists() and cfg.resume:
        print(f"[kdrun] {results_path} exists: this run is complete (resume=false to redo it)")
        summary = json.loads(results_path.read_text())
        print_summary(summary)
        print(f"outputs: {run_dir}")
        return summary
    if _is_main_rank():
        (run_dir / "error.json").unlink(missing_ok=True)  # of an earlier attempt
    progress["phase"] = "setup"
    session = start_session(cfg, run_dir, pre, t_start)
    data, models, parts = build_parts(session, progress)
    progress["phase"] = "stages"
    state, stages_s = train_stages(session, parts, progress)
    progress["phase"] = "outputs"
    return write_outputs(session, data, models, parts, state, stages_s)
