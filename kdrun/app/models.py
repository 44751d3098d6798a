"""The run's models: the teacher (fine-tuned, cached or loaded, then frozen and cast) and the
student built from it (fp32 master weights)."""

from __future__ import annotations

import time

from kdrun.app.context import Models, RunData, Session, make_parts
from kdrun.app.preflight import ConfigError


def load_teacher(session: Session, data: RunData) -> Models:
    """The frozen teacher: teacher.checkpoint, or fine-tuned on the task (cached); None without one."""
    from kdrun.app.teacher import fine_tune_teacher, get_teacher, teacher_cache_key, teacher_train_data
    from kdrun.engine.trainer import evaluate
    from kdrun.models import loading as M
    from kdrun.runtime.cache import wait_for_entry

    t0 = time.perf_counter()
    cfg, acc, refs = session.cfg, session.accelerator, session.pre.refs
    if not session.pre.uses_teacher:
        return Models(None, {}, time.perf_counter() - t0)
    kind = session.pre.kind
    tc, num_labels, head = cfg.teacher, cfg.task.num_labels, kind.head(session.pre.plans, "teacher")
    need_attn = "attentions" in session.needs("teacher")
    if not kind.fine_tunes_teacher:  # e.g. task-agnostic distillation: the pre-trained teacher as it is
        teacher = acc.prepare_model(kind.pretrained_teacher(cfg, refs.get("teacher"), session.pre.plans,
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
    """The teacher as it runs while distilling: cast to ``teacher.dtype`` (train.compile compiles
    the step that runs it, kdrun.engine.compiled). Called after the student is built, so no student
    ever copies a cast teacher."""
    if teacher is None:
        return None
    return cast_teacher(teacher, session.cfg.teacher.dtype, session.accelerator.precision)


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
    check_features(session.pre.plans, student, teacher)
    models.student_info = M.describe(student)
    models.objective = Objective(session.pre.plans, session.pre.mapping, cfg.task.num_labels,
                                 models.student_info, models.teacher_arch, balance=cfg.objective.balance,
                                 balance_alpha=cfg.objective.balance_alpha)
    # Several processes: the trainer wraps the student in DDP per stage (kdrun.engine.trainer.wrap_for_stage).
    models.student = acc.prepare_model(student) if acc.num_processes == 1 else student.to(acc.device)
    models.objective.to(acc.device)
    return models


def _new_student(session: Session, data: RunData, teacher):
    from kdrun.models import loading as M

    cfg, sc, refs = session.cfg, session.cfg.student, session.pre.refs
    head = session.pre.kind.head(session.pre.plans, "student")
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
