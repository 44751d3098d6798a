"""A run's context, built in phases: its settings (config, run directory, accelerator, plans,
identity), the data, the tracker and the engine's parts (kdrun.app.run calls them in order)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kdrun.app.preflight import ConfigError, RunPlan
from kdrun.config import without_non_identity
from kdrun.engine.optim import without_default_optim
from kdrun.engine.strategies import stage_identity
from kdrun.runtime.cache import content_hash


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


@dataclass
class Session:
    """What every phase after preflight shares."""

    cfg: DictConfig
    run_dir: Path
    pre: RunPlan  # preflight's result: plans, model refs, uses_teacher, mapping, the task kind
    accelerator: Any
    resolved: dict[str, Any]
    config_hash: str
    t_start: float
    tracker: Any = None
    # The teacher's forward passes while distilling (store builds, logit tables, live batches).
    teacher_forwards: dict[str, int] = field(default_factory=lambda: {"batches": 0, "rows": 0})

    def needs(self, role: str) -> frozenset[str]:
        """What the objective's stages read from the student's or the teacher's forward pass."""
        return frozenset().union(*(getattr(p, f"{role}_needs") for p in self.pre.plans))


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


def start_session(cfg: DictConfig, run_dir: Path, pre: RunPlan, t_start: float) -> Session:
    """Seed, build the accelerator and create the run directory (resume=false moved an earlier run
    aside before: kdrun.app.run)."""
    from kdrun.runtime.threads import apply_threads

    apply_threads(cfg.train.num_threads)  # before the first tensor operation
    from transformers.utils import logging as hf_logging

    from kdrun.engine.trainer import seed_everything

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # transformers' per-load bars ("Loading weights"); kdrun's own stay
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    config_hash = run_config_hash(resolved)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.train.seed)
    accelerator = make_accelerator(cfg.train)
    accelerator.wait_for_everyone()
    return Session(cfg, run_dir, pre, accelerator, resolved, config_hash, t_start)


def load_data(session: Session) -> RunData:
    """Load and tokenise the task as its kind does (with the teacher's tokenizer: students share its
    vocabulary)."""
    from kdrun.models import loading as M

    t0 = time.perf_counter()
    cfg, task, refs = session.cfg, session.cfg.task, session.pre.refs
    tok_ref = next(refs[k] for k in ("teacher", "teacher_tokenizer", "student", "student_tokenizer") if k in refs)
    tokenizer = M.load_tokenizer(tok_ref)
    tok_hash = M.tokenizer_fingerprint(tokenizer)
    span_extractor = None
    if "spans" in session.needs("student") | session.needs("teacher"):  # MGSKD: multi-piece words + phrases
        from kdrun.strategies.phrases import span_extractor_for

        span_extractor = span_extractor_for(cfg.spans, tokenizer, cfg.cache_dir)
    kd = session.pre.kind.load_data(cfg, tokenizer, tok_hash, session.pre.plans, span_extractor)
    data = RunData(kd.data_hash, tokenizer, tok_hash, kd.train, kd.eval, kd.collator)
    if any(p.cfg["data"] == "augmented" for p in session.pre.plans):  # evaluation stays on the original dev set
        data.augmented, data.aug_info = _augmented_data(cfg, kd.raw[task.train_split], tokenizer, tok_hash,
                                                        span_extractor)
    data.seconds = time.perf_counter() - t0
    return data


def _augmented_data(cfg: DictConfig, train_raw, tokenizer, tok_hash: str, span_extractor) -> tuple[Any, dict]:
    """The tokenised augmented training set (built or from the cache) and what it is."""
    import datasets as hf_datasets

    from kdrun.strategies.augment import get_augmented
    from kdrun.tasks.data.batches import tokenize_splits

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
    from kdrun.runtime.tracking import WANDB_ID_FILE, Tracker, wandb_run_id

    cfg = session.cfg
    run_name = cfg.run_name or f"{cfg.task.name}-{cfg.objective.name}-{cfg.student.name}"
    main, run_id = session.accelerator.is_main_process, None
    if main and cfg.logger.name == "wandb" and cfg.logger.mode != "disabled":
        # the same wandb run for every attempt at this directory's run (another configuration's run was
        # refused, resume=false moved the old run and its id aside)
        resuming = bool(cfg.resume) and (has_checkpoint(session.run_dir) or (session.run_dir / WANDB_ID_FILE).is_file())
        run_id = wandb_run_id(session.run_dir, run_name, session.config_hash, resuming=resuming)
    return Tracker(session.run_dir, cfg.logger, session.resolved, run_name, enabled=main, run_id=run_id)


def make_parts(session: Session, data: RunData, models: Models):
    """The trainer's view of the run (the student's train settings, the run's data and tracker)."""
    from kdrun.engine.trainer import RunParts

    cfg, acc, kind = session.cfg, session.accelerator, session.pre.kind
    return RunParts(accelerator=acc, student=models.student, teacher=models.teacher, objective=models.objective,
                    train_data=data.train, eval_data=data.eval, collator=data.collator,
                    metric_fn=kind.metric_fn(cfg.task, data.eval), main_metric=cfg.task.main_metric,
                    selection_splits=cfg.task.selection_splits, selection_threshold=cfg.task.selection_threshold,
                    evaluator=kind.evaluator(), train_cfg=cfg.train,
                    tracker=session.tracker, run_dir=session.run_dir, config_hash=session.config_hash,
                    log_every=cfg.logger.log_every_steps, rank=acc.process_index, world_size=acc.num_processes,
                    augmented_data=data.augmented, store=store_settings(cfg, data), kind=kind)


def store_settings(cfg: DictConfig, data: RunData):
    """The teacher-output store's settings (teacher.store*) and the parts of its key the trainer
    cannot see (tokenizer, max length, the teacher's dtype, the task kind)."""
    from kdrun.engine.teacher_store import StoreSettings

    return StoreSettings(mode=cfg.teacher.store, dtype=cfg.teacher.store_dtype, max_gb=cfg.teacher.store_max_gb,
                         cache_dir=cfg.cache_dir, wait_timeout_s=cfg.cache_wait_timeout_s,
                         key={"tokenizer": data.tok_hash, "max_len": cfg.task.max_seq_length,
                              "data_key": data.data_hash, "augmentation": (data.aug_info or {}).get("key"),
                              "teacher_dtype": cfg.teacher.dtype, "kind": cfg.task.kind})
