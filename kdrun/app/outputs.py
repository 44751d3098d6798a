"""What a finished run writes: the kept student, results.json (metrics, timings, versions, cost)
and the tracker's summary."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any

from omegaconf import DictConfig

from kdrun.app.context import Models, RunData, Session
from kdrun.report.summary import print_summary
from kdrun.runtime.cache import staging_dir, write_json_atomic
from kdrun.runtime.provenance import git_commit, main_versions


def write_outputs(session: Session, data: RunData, models: Models, parts, state, stages_s: float) -> dict[str, Any]:
    """Evaluate the kept student and write it, results.json and the tracker's summary."""
    from kdrun.engine.trainer import evaluate, finalize_best

    acc = session.accelerator
    acc.wait_for_everyone()  # the main process may still be writing the best checkpoint
    finalize_best(parts)
    final_metrics = evaluate(parts, models.student)
    from kdrun.engine.strategies import after_run

    added = after_run(parts, session.pre.plans)  # what the stages' strategies add (e.g. sub-networks' metrics)
    summary = _summary(session, data, models, state, final_metrics, stages_s)
    for _, entries in added:
        summary.update(entries)
    if acc.is_main_process:
        if session.cfg.report.cost:
            summary["cost"] = measure_cost(session, data, models)
        with staging_dir(session.run_dir / "student") as tmp:
            student = saved_student(acc.unwrap_model(models.student), session.cfg.student.dtype)
            for key, value in session.pre.kind.model_config(session.cfg.task).items():  # e.g. the class names
                setattr(student.config, key, value)
            student.save_pretrained(tmp)
            save_tokenizer(data.tokenizer, tmp, session.cfg.task.max_seq_length)
            from kdrun.report.card import write_card

            write_card(tmp, summary)
        session.tracker.summary({f"final/{s}/{k}": v for s, m in final_metrics.items() for k, v in m.items()})
        hint = session.tracker.finish()
        write_json_atomic(session.run_dir / "results.json", summary)
        if not session.cfg.train.keep_checkpoints:  # the run is complete: nothing left to resume
            shutil.rmtree(session.run_dir / "checkpoints", ignore_errors=True)
        print_summary(summary)
        for strategy, entries in added:
            strategy.report(entries, session.run_dir)
        print(f"outputs: {session.run_dir}")
        if hint:
            print(f"wandb (offline): {hint}")
    return summary


# Keys of tokenizer_config.json that describe how this run loaded the tokenizer, not the tokenizer.
LOCAL_TOKENIZER_KEYS = ("local_files_only", "is_local", "cache_dir", "force_download", "token", "proxies")


def save_tokenizer(tokenizer, directory, max_length: int) -> None:
    """Save the tokenizer beside the student, its tokenizer_config.json without this run's loading
    state and with the run's ``max_length`` (task.max_seq_length)."""
    import json
    from pathlib import Path

    tokenizer.save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in LOCAL_TOKENIZER_KEYS}
    path.write_text(json.dumps({**config, "max_length": max_length}, indent=2, ensure_ascii=False) + "\n")


def saved_student(student, dtype: str):
    """The student as written: its fp32 training weights, or a copy cast to ``student.dtype``."""
    import copy

    import torch

    target = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    return student if target is None else copy.deepcopy(student).to(target)


def measure_cost(session: Session, data: RunData, models: Models) -> dict[str, Any]:
    """results.json's ``cost`` (kdrun.report.cost): the student and the teacher on the run's device and
    first dev split; a failure is recorded, never fatal."""
    import torch

    from kdrun.report.cost import run_cost

    acc, cfg = session.accelerator, session.cfg
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.student.dtype)
    print(f"[kdrun] measuring the student's and the teacher's size, latency and throughput on {acc.device} "
          "(report.cost=false skips it)", flush=True)
    try:
        return run_cost(acc.unwrap_model(models.student), models.teacher, next(iter(data.eval.values())),
                        cfg.train.eval_batch_size, data.tokenizer.pad_token_id, str(acc.device), dtype,
                        acc.precision.autocast)
    except Exception as e:  # noqa: BLE001 - the scores stand without the cost figures
        print(f"[kdrun] warning: cost not measured: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def _best_value(cfg: DictConfig, state) -> float | None:
    """The selected metric's value (the trainer's score is sign * value, see trainer.main_score)."""
    from kdrun.tasks.kinds import metric_sign

    return None if state.best_metric is None else metric_sign(cfg.task.main_metric) * state.best_metric


def _summary(session: Session, data: RunData, models: Models, state, final_metrics: dict,
             stages_s: float) -> dict[str, Any]:
    from kdrun.tasks.baselines import run_baseline

    cfg, plans = session.cfg, session.pre.plans
    aug = None
    if data.aug_info:
        aug = {k: v for k, v in data.aug_info.items() if k != "settings"} | {
            "stages": [p.name for p in plans if p.cfg["data"] == "augmented"]}
    return {
        "task": cfg.task.name,
        "objective": cfg.objective.name,
        "teacher": {**models.teacher_info, "name": cfg.teacher.name, "info": models.teacher_arch},
        "student": {"name": cfg.student.name, "info": models.student_info, "metrics": final_metrics,
                    "selected": {"stage": state.best_stage, "step": state.best_step,
                                 "metric": cfg.task.main_metric, "value": _best_value(cfg, state)}},
        "stages": state.stage_results,
        "evals": state.evals,
        "layer_pairs": models.objective.layer_pairs,
        "teacher_forward": dict(session.teacher_forwards),
        "augmentation": aug,
        "data": {"train_rows": len(data.train), "eval_rows": {s: len(d) for s, d in data.eval.items()}},
        "baseline": run_baseline(cfg.task, data.train, data.eval),
        "timings": {"total_s": time.perf_counter() - session.t_start, "data_s": data.seconds,
                    "teacher_s": models.teacher_s, "stages_s": stages_s},
        "config": session.resolved,
        "config_hash": session.config_hash,
        "versions": main_versions(),
        "git_sha": (git_commit() or {}).get("commit"),
        "git_dirty": (git_commit() or {}).get("dirty"),
        "device": str(session.accelerator.device),
        "processes": session.accelerator.num_processes,
        "precision": session.accelerator.precision.name,
        "command": " ".join(sys.argv),
        "run_dir": str(session.run_dir.resolve()),
    }


# -------------------------------------------------------------------------------------------- run
