"""One kdrun run: validate → data → teacher → student → stages → outputs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kdrun.app.preflight import ConfigError, preflight
from kdrun.config import without_non_identity
from kdrun.engine.optim import without_default_optim
from kdrun.engine.strategies import stage_identity
from kdrun.runtime.cache import content_hash, staging_dir, write_json_atomic

__all__ = ["ConfigError", "preflight", "run", "make_accelerator", "run_config_hash"]


# --------------------------------------------------------------------------------------- helpers

def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("kdrun", "torch", "transformers", "datasets", "evaluate", "accelerate", "hydra-core", "wandb"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _start_over(run_dir: Path) -> None:
    """resume=false in a used run directory: keep the old result as results.previous.json, drop the
    old checkpoints and metrics log so nothing of the old run mixes into the new one."""
    import shutil

    if (run_dir / "results.json").exists():
        os.replace(run_dir / "results.json", run_dir / "results.previous.json")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    (run_dir / "wandb_id.txt").unlink(missing_ok=True)  # a fresh start is a new wandb run (kdrun.runtime.tracking)


def run_config_hash(resolved: dict[str, Any]) -> str:
    """Identity of a run's configuration for its checkpoints: everything that changes the result
    (kdrun.config.NON_IDENTITY_KEYS do not: tracking, reporting, device, ``resume``...)."""
    keep = without_non_identity(resolved)
    keep["train"] = without_default_optim(keep.get("train", {}))
    if not (keep.get("task") or {}).get("imports", True):  # no task.imports: as before the key existed
        keep["task"] = {k: v for k, v in keep["task"].items() if k != "imports"}
    objective = keep.get("objective") or {}  # default optimizers leave the checkpoints of older runs valid
    if objective.get("stages"):
        keep["objective"] = {**objective, "stages": [stage_identity(without_default_optim(s))
                                                     for s in objective["stages"]]}
    for role in ("teacher", "student"):
        if (keep.get(role) or {}).get("finetune"):
            keep[role] = {**keep[role], "finetune": without_default_optim(keep[role]["finetune"])}
    return content_hash(keep)


def make_accelerator(train_cfg: Any):
    """The run's accelerator: device and processes from Accelerate, precision from kdrun.runtime.precision
    (``acc.precision``: autocast dtype and the run's one gradient scaler)."""
    import torch
    from accelerate.utils import DistributedDataParallelKwargs

    from kdrun.runtime.precision import make_kd_accelerator, resolve_precision

    cpu = train_cfg.device == "cpu" or (train_cfg.device == "auto" and not torch.cuda.is_available())
    if train_cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    precision = resolve_precision(train_cfg.precision, "cpu" if cpu else "cuda")
    # Buffers are constant; whether DDP must tolerate parameters without gradients is decided per
    # stage (kdrun.engine.trainer.wrap_for_stage), this is only the first wrap.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
    return make_kd_accelerator(cpu, precision, tf32=getattr(train_cfg, "tf32", "auto"), kwargs_handlers=[ddp],
                               gradient_accumulation_steps=train_cfg.gradient_accumulation_steps)


def _print_table(summary: dict[str, Any]) -> None:
    from kdrun.tasks.baselines import describe, noise_warnings, split_values, table_cells

    base = summary.get("baseline")
    rows = [("model", "split", "metric", "value", "baseline", "SE")]
    for who in ("teacher", "student"):
        for split, metrics in (summary[who].get("metrics") or {}).items():
            for k, v in metrics.items():
                rows.append((who, split, k, f"{v:.4f}", *table_cells(base, split, k)))
    rows = rows if split_values(base) else [r[:4] for r in rows]  # corpus / QA: no baseline columns
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = "  ".join("-" * w for w in widths)
    print("\n" + "  ".join(c.ljust(w) for c, w in zip(rows[0], widths)))
    print(line)
    for r in rows[1:]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    for note in filter(None, [describe(base), *noise_warnings(summary)]):
        print(note)
    from kdrun.report.cost import cost_lines

    for line in cost_lines(summary.get("cost")):
        print(line)
    t = summary["timings"]
    teacher = summary["teacher"]
    if teacher.get("path") or teacher.get("source"):
        how = "cache hit" if teacher.get("cached") else teacher.get("source", "fine-tuned and cached")
        print(f"\nteacher: {how} ({teacher.get('path') or 'random'})")
    else:
        print("\nteacher: none (the objective uses no teacher)")
    print(f"wall time {t['total_s']:.1f}s (teacher {t['teacher_s']:.1f}s, distillation {t['stages_s']:.1f}s)")


# ------------------------------------------------------------------------------------------ phases

@dataclass
class Session:
    """What every phase after preflight shares."""

    cfg: DictConfig
    run_dir: Path
    pre: dict[str, Any]  # preflight's result: plans, model refs, uses_teacher, mapping
    accelerator: Any
    resolved: dict[str, Any]
    config_hash: str
    t_start: float
    tracker: Any = None
    # The teacher's forward passes while distilling (store builds, logit tables, live batches).
    teacher_forwards: dict[str, int] = field(default_factory=lambda: {"batches": 0, "rows": 0})

    def needs(self, role: str) -> frozenset[str]:
        """What the objective's stages read from the student's or the teacher's forward pass."""
        return frozenset().union(*(getattr(p, f"{role}_needs") for p in self.pre["plans"]))


@dataclass
class RunData:
    """The tokenised task data and what identifies it."""

    data_hash: str
    tokenizer: Any
    tok_hash: str
    train: Any
    eval: dict[str, Any]
    collator: Any
    augmented: Any = None
    aug_info: dict[str, Any] | None = None
    seconds: float = 0.0


@dataclass
class Models:
    """The teacher (None when the objective uses none) and the student with its objective."""

    teacher: Any
    teacher_info: dict[str, Any]
    teacher_s: float
    student: Any = None
    objective: Any = None
    student_info: dict[str, Any] | None = None
    teacher_arch: dict[str, Any] | None = None  # M.describe of the teacher


def start_session(cfg: DictConfig, run_dir: Path, pre: dict[str, Any], t_start: float) -> Session:
    """Seed, build the accelerator and prepare the run directory (start over when resume=false)."""
    from kdrun.runtime.threads import apply_threads

    apply_threads(cfg.train.num_threads)  # before the first tensor operation
    from transformers.utils import logging as hf_logging

    from kdrun.engine.trainer import seed_everything

    hf_logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    config_hash = run_config_hash(resolved)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.train.seed)
    accelerator = make_accelerator(cfg.train)
    if not cfg.resume and accelerator.is_main_process:
        _start_over(run_dir)
    accelerator.wait_for_everyone()
    return Session(cfg, run_dir, pre, accelerator, resolved, config_hash, t_start)


def load_data(session: Session) -> RunData:
    """Load and tokenise the task as its kind does (with the teacher's tokenizer: students share its
    vocabulary)."""
    from kdrun.models import loading as M
    from kdrun.tasks.kinds import kind_of

    t0 = time.perf_counter()
    cfg, task, refs = session.cfg, session.cfg.task, session.pre["refs"]
    tok_ref = next(refs[k] for k in ("teacher", "teacher_tokenizer", "student", "student_tokenizer") if k in refs)
    tokenizer = M.load_tokenizer(tok_ref)
    tok_hash = M.tokenizer_fingerprint(tokenizer)
    span_extractor = None
    if "spans" in session.needs("student") | session.needs("teacher"):  # MGSKD: multi-piece words + phrases
        from kdrun.strategies.phrases import span_extractor_for

        span_extractor = span_extractor_for(cfg.spans, tokenizer, cfg.cache_dir)
    kd = kind_of(task).load_data(cfg, tokenizer, tok_hash, session.pre["plans"], span_extractor)
    data = RunData(kd.data_hash, tokenizer, tok_hash, kd.train, kd.eval, kd.collator)
    if any(p.cfg["data"] == "augmented" for p in session.pre["plans"]):  # evaluation stays on the original dev set
        data.augmented, data.aug_info = _augmented_data(cfg, kd.raw[task.train_split], tokenizer, tok_hash,
                                                        span_extractor)
    data.seconds = time.perf_counter() - t0
    return data


def _augmented_data(cfg: DictConfig, train_raw, tokenizer, tok_hash: str, span_extractor) -> tuple[Any, dict]:
    """The tokenised augmented training set (built or from the cache) and what it is."""
    import datasets as hf_datasets

    from kdrun.strategies.augment import get_augmented
    from kdrun.tasks.data.pipeline import tokenize_splits

    aug_raw, aug_info = get_augmented(cfg.augmentation, train_raw, cfg.task.name, cfg.cache_dir,
                                      device=cfg.train.device)
    print(f"[kdrun] augmented training set: {aug_info['rows']} rows from {len(train_raw)} "
          f"({'cache' if aug_info['cached'] else 'built'}: {aug_info['path']})")
    aug_cols = [c for c in ("text_a", "text_b", "label", "idx") if c in aug_raw.column_names]
    aug_data = tokenize_splits(hf_datasets.DatasetDict({"train": aug_raw.select_columns(aug_cols)}), tokenizer,
                               cfg.task.max_seq_length, spans=span_extractor, span_splits=["train"],
                               cache_dir=cfg.cache_dir, cache_key=f"aug-{aug_info['key']}-{tok_hash}")["train"]
    return aug_data, aug_info


def make_tracker(session: Session):
    """metrics.jsonl (and wandb when configured), on the main process only."""
    from kdrun.engine.checkpoints import has_checkpoint
    from kdrun.runtime.tracking import Tracker, wandb_run_id

    cfg = session.cfg
    run_name = cfg.run_name or f"{cfg.task.name}-{cfg.objective.name}-{cfg.student.name}"
    main, run_id = session.accelerator.is_main_process, None
    if main and cfg.logger.name == "wandb" and cfg.logger.mode != "disabled":  # the same wandb run only on a resume
        resuming = bool(cfg.resume) and has_checkpoint(session.run_dir)
        run_id = wandb_run_id(session.run_dir, run_name, session.config_hash, resuming=resuming)
    return Tracker(session.run_dir, cfg.logger, session.resolved, run_name, enabled=main, run_id=run_id)


def make_parts(session: Session, data: RunData, models: Models):
    """The trainer's view of the run (the student's train settings, the run's data and tracker)."""
    from kdrun.engine.trainer import RunParts
    from kdrun.tasks.kinds import kind_of

    cfg, acc = session.cfg, session.accelerator
    kind = kind_of(cfg.task)
    return RunParts(accelerator=acc, student=models.student, teacher=models.teacher, objective=models.objective,
                    train_data=data.train, eval_data=data.eval, collator=data.collator,
                    metric_fn=kind.metric_fn(cfg.task, data.eval), main_metric=cfg.task.main_metric,
                    selection_splits=cfg.task.selection_splits, selection_threshold=cfg.task.selection_threshold,
                    evaluator=kind.evaluator(), train_cfg=cfg.train,
                    tracker=session.tracker, run_dir=session.run_dir, config_hash=session.config_hash,
                    log_every=cfg.logger.log_every_steps, rank=acc.process_index, world_size=acc.num_processes,
                    augmented_data=data.augmented, store=store_settings(cfg, data))


def store_settings(cfg: DictConfig, data: RunData):
    """The teacher-output store's settings (teacher.store*) and the parts of its key the trainer
    cannot see (tokenizer, max length, the teacher's dtype, the task kind)."""
    from kdrun.engine.teacher_store import StoreSettings

    return StoreSettings(mode=cfg.teacher.store, dtype=cfg.teacher.store_dtype, max_gb=cfg.teacher.store_max_gb,
                         cache_dir=cfg.cache_dir, wait_timeout_s=cfg.cache_wait_timeout_s,
                         key={"tokenizer": data.tok_hash, "max_len": cfg.task.max_seq_length,
                              "data_key": data.data_hash, "augmentation": (data.aug_info or {}).get("key"),
                              "teacher_dtype": cfg.teacher.dtype, "kind": cfg.task.kind})


def load_teacher(session: Session, data: RunData) -> Models:
    """The frozen teacher: teacher.checkpoint, or fine-tuned on the task (cached); None without one."""
    from kdrun.app.teacher import fine_tune_teacher, get_teacher, teacher_cache_key, teacher_train_data
    from kdrun.engine.trainer import evaluate
    from kdrun.models import loading as M
    from kdrun.runtime.cache import wait_for_entry
    from kdrun.tasks.kinds import kind_of

    t0 = time.perf_counter()
    cfg, acc, refs = session.cfg, session.accelerator, session.pre["refs"]
    if not session.pre["uses_teacher"]:
        return Models(None, {}, time.perf_counter() - t0)
    kind = kind_of(cfg.task)
    tc, num_labels, head = cfg.teacher, cfg.task.num_labels, kind.head(session.pre["plans"], "teacher")
    need_attn = "attentions" in session.needs("teacher")
    if not kind.fine_tunes_teacher:  # e.g. task-agnostic distillation: the pre-trained teacher as it is
        teacher = acc.prepare_model(kind.pretrained_teacher(cfg, refs.get("teacher"), session.pre["plans"],
                                                            data.tokenizer, need_attn), evaluation_mode=True)
        info = {"cached": False, "path": refs.get("teacher"),
                "source": f"pre-trained, not fine-tuned (task.kind={kind.name})"}
    elif tc.checkpoint:
        teacher = acc.prepare_model(M.load_classifier(refs["teacher"], num_labels, need_attentions=need_attn,
                                                      head=head), evaluation_mode=True)
        info = {"cached": False, "path": refs["teacher"], "source": "teacher.checkpoint",
                "metrics": evaluate(make_parts(session, data, Models(None, {}, 0.0, student=teacher)), teacher)}
    else:
        def new_teacher():
            if tc.kind == "random":
                return M.random_classifier(tc, len(data.tokenizer), num_labels,
                                           pad_token_id=data.tokenizer.pad_token_id, head=head)
            return M.load_classifier(refs["teacher"], num_labels, dropout=tc.dropout, head=head)

        # the teacher's own rows (task.teacher_max_train_samples) and their hash; the run's by default
        teacher_hash, teacher_rows = teacher_train_data(cfg, data.data_hash, data.train, data.tokenizer)
        key = teacher_cache_key(cfg, refs.get("teacher", "random"), teacher_hash, data.tok_hash,
                                acc.precision.name)
        if acc.num_processes > 1 and not acc.is_main_process:  # rank 0 fine-tunes; the others reuse its entry
            wait_for_entry(cfg.cache_dir, "teachers", key, timeout_s=cfg.cache_wait_timeout_s)
        teacher, info = get_teacher(
            cfg.cache_dir, key,
            lambda out: fine_tune_teacher(out, new_teacher, cfg, acc, teacher_rows(), data.eval, data.tokenizer),
            lambda path: M.load_classifier(path, num_labels, need_attentions=need_attn, head=head),
        )
        teacher = acc.prepare_model(teacher, evaluation_mode=True)
        print(f"[kdrun] teacher {'from cache' if info['cached'] else 'trained and cached'}: {info['path']}")
    M.set_attn_implementation(acc.unwrap_model(teacher), need_attn)
    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher.eval()
    arch = M.describe(acc.unwrap_model(teacher))
    # Kept in its stored dtype (fp32) until the student is built: a truncated student copies these
    # weights and must start from them, not from a bf16/fp16 cast (see frozen_teacher).
    return Models(acc.unwrap_model(teacher), info, time.perf_counter() - t0, teacher_arch=arch)


def frozen_teacher(session: Session, teacher):
    """The teacher as it runs while distilling: cast to ``teacher.dtype`` and compiled when asked.
    Called after the student is built, so no student ever copies a cast teacher."""
    if teacher is None:
        return None
    return compiled(session, cast_teacher(teacher, session.cfg.teacher.dtype, session.accelerator.precision))


def cast_teacher(teacher, dtype: str, precision):
    """The frozen teacher in ``teacher.dtype`` (``auto``: the training precision's dtype, so a
    mixed-precision run keeps no fp32 copy of it and its features need no casts)."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype == "auto":
        target = precision.dtype or torch.float32
    elif dtype in dtypes:
        target = dtypes[dtype]
    else:
        raise ConfigError(f"teacher.dtype={dtype!r} is not one of auto, {', '.join(dtypes)}")
    return teacher.to(target)


def compiled(session: Session, model):
    """``model`` under torch.compile when train.compile is set (kdrun's feature hooks are
    registered on the original modules, so they stay in place)."""
    if not session.cfg.train.compile:
        return model
    import torch

    return torch.compile(model, backend=session.cfg.train.compile_backend)


def build_student(session: Session, data: RunData, models: Models) -> Models:
    """The student (re-seeded: a teacher cache hit or miss must not change it) and the objective."""
    from kdrun.engine.objective import Objective
    from kdrun.engine.trainer import seed_everything
    from kdrun.models import loading as M
    from kdrun.models.adaptors import check_features

    cfg, acc = session.cfg, session.accelerator
    seed_everything(cfg.train.seed)
    # fp32 master weights whatever the teacher's or the checkpoint's dtype: autocast runs the
    # forward in bf16/fp16, the parameters, their gradients and the optimizer state stay fp32.
    student = _new_student(session, data, models.teacher).float()
    models.teacher = frozen_teacher(session, models.teacher)
    if cfg.student.dropout is not None and cfg.student.kind == "truncated":
        for m in student.modules():
            if m.__class__.__name__ == "Dropout":
                m.p = cfg.student.dropout
    M.set_attn_implementation(student, "attentions" in session.needs("student"))
    teacher = acc.unwrap_model(models.teacher) if models.teacher is not None else None
    check_features(session.pre["plans"], student, teacher)
    models.student_info = M.describe(student)
    models.objective = Objective(session.pre["plans"], session.pre["mapping"], cfg.task.num_labels,
                                 models.student_info, models.teacher_arch, balance=cfg.objective.balance,
                                 balance_alpha=cfg.objective.balance_alpha)
    # Several processes: the trainer wraps the student in DDP per stage (kdrun.engine.trainer.wrap_for_stage).
    student = compiled(session, student)
    models.student = acc.prepare_model(student) if acc.num_processes == 1 else student.to(acc.device)
    models.objective.to(acc.device)
    return models


def _new_student(session: Session, data: RunData, teacher):
    from kdrun.models import loading as M
    from kdrun.tasks.kinds import kind_of

    cfg, sc, refs = session.cfg, session.cfg.student, session.pre["refs"]
    head = kind_of(cfg.task).head(session.pre["plans"], "student")
    if sc.kind == "truncated":
        if sc.source == "teacher":
            if teacher is None:
                raise ConfigError("student=truncated with source=teacher needs a teacher")
            base = session.accelerator.unwrap_model(teacher)
        else:
            base = M.load_classifier(refs["student"], cfg.task.num_labels, head=head)
        student = M.truncate_layers(base, sc.num_layers)
        for p in student.parameters():
            p.requires_grad_(True)
        return student
    if sc.kind == "random":
        return M.random_classifier(sc, len(data.tokenizer), cfg.task.num_labels,
                                   pad_token_id=data.tokenizer.pad_token_id, head=head)
    student = M.load_classifier(refs["student"], cfg.task.num_labels, dropout=sc.dropout, head=head)
    if M.tokenizer_fingerprint(M.load_tokenizer(refs["student"])) != data.tok_hash:
        raise ConfigError(
            f"student '{sc.name}' and teacher '{cfg.teacher.name}' use different vocabularies; "
            "kdrun feeds both the same token ids — choose models with the same tokenizer")
    return student


def train_stages(session: Session, parts, progress: dict[str, Any] | None = None) -> tuple[Any, float]:
    """Run the objective's stages in order, resuming from checkpoints/last when present."""
    from kdrun.engine.checkpoints import rewind_metrics_log, seed_for_rank
    from kdrun.engine.trainer import TrainState, checkpoint_dir, load_checkpoint_state, restore_models, run_stage
    from kdrun.runtime.preemption import Interrupted, PreemptionGuard

    t0 = time.perf_counter()
    run_dir = session.run_dir
    state = load_checkpoint_state(run_dir, session.config_hash, session.accelerator) if session.cfg.resume else None
    ckpt = checkpoint_dir(run_dir)
    if state is not None:
        restore_models(parts, ckpt)
        if session.accelerator.is_main_process:
            rewind_metrics_log(run_dir)
        print(f"[kdrun] resuming at stage {state.stage} step {state.global_step} from {ckpt}")
    else:
        state = TrainState()
        seed_for_rank(session.cfg.train.seed, session.accelerator.process_index)  # per-process dropout
        if session.accelerator.is_main_process:  # lines a killed attempt logged before any checkpoint
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    if progress is not None:  # error.json says how far a failed run got
        progress["state"] = state
    resume_from = ckpt if state.global_step > 0 or state.stage > 0 else None
    if parts.teacher is not None:
        count_forwards(parts.teacher, session.teacher_forwards)
    try:
        with PreemptionGuard() as guard:
            parts.guard = guard
            for plan in session.pre["plans"][state.stage:]:
                run_stage(parts, plan, state, resume_from)
                resume_from = None
    except Interrupted:
        session.tracker.finish()
        raise
    return state, time.perf_counter() - t0


def count_forwards(model, counts: dict[str, int]) -> None:
    """Count ``model``'s forward passes and rows into ``counts`` (results.json ``teacher_forward``)."""
    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts["batches"] += 1
        counts["rows"] += int(ids.shape[0]) if ids is not None else 0

    getattr(model, "_orig_mod", model).register_forward_pre_hook(hook, with_kwargs=True)


def write_outputs(session: Session, data: RunData, models: Models, parts, state, stages_s: float) -> dict[str, Any]:
    """Evaluate the kept student and write it, results.json and the tracker's summary."""
    from kdrun.engine.trainer import evaluate, finalize_best

    acc = session.accelerator
    acc.wait_for_everyone()  # the main process may still be writing the best checkpoint
    finalize_best(parts)
    final_metrics = evaluate(parts, models.student)
    from kdrun.engine.strategies import after_run

    added = after_run(parts, session.pre["plans"])  # what the stages' strategies add (e.g. sub-networks' metrics)
    summary = _summary(session, data, models, state, final_metrics, stages_s)
    for _, entries in added:
        summary.update(entries)
    if acc.is_main_process:
        if session.cfg.report.cost:
            summary["cost"] = measure_cost(session, data, models)
        with staging_dir(session.run_dir / "student") as tmp:
            saved_student(acc.unwrap_model(models.student), session.cfg.student.dtype).save_pretrained(tmp)
            data.tokenizer.save_pretrained(tmp)
            from kdrun.report.card import write_card

            write_card(tmp, summary)
        session.tracker.summary({f"final/{s}/{k}": v for s, m in final_metrics.items() for k, v in m.items()})
        hint = session.tracker.finish()
        write_json_atomic(session.run_dir / "results.json", summary)
        _print_table(summary)
        for strategy, entries in added:
            strategy.report(entries, session.run_dir)
        print(f"outputs: {session.run_dir}")
        if hint:
            print(f"wandb (offline): {hint}")
    return summary


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

    cfg, plans = session.cfg, session.pre["plans"]
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
        "versions": _versions(),
        "git_sha": _git_sha(),
        "device": str(session.accelerator.device),
        "processes": session.accelerator.num_processes,
        "precision": session.accelerator.precision.name,
        "command": " ".join(sys.argv),
    }


# -------------------------------------------------------------------------------------------- run

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


def _run(cfg: DictConfig, run_dir: Path, pre: dict[str, Any], progress: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    results_path = run_dir / "results.json"
    if results_path.exists() and cfg.resume:
        print(f"[kdrun] {results_path} exists: this run is complete (resume=false to redo it)")
        summary = json.loads(results_path.read_text())
        _print_table(summary)
        print(f"outputs: {run_dir}")
        return summary
    if _is_main_rank():
        (run_dir / "error.json").unlink(missing_ok=True)  # of an earlier attempt
    progress["phase"] = "setup"
    session = start_session(cfg, run_dir, pre, t_start)
    progress["phase"] = "data"
    data = load_data(session)
    session.tracker = make_tracker(session)
    progress["phase"] = "teacher"
    teacher = load_teacher(session, data)
    progress["phase"] = "student"
    models = build_student(session, data, teacher)
    parts = make_parts(session, data, models)
    progress["phase"] = "stages"
    state, stages_s = train_stages(session, parts, progress)
    progress["phase"] = "outputs"
    return write_outputs(session, data, models, parts, state, stages_s)
