"""kdrun-doctor's engine checks: tiny BERTs and fixed batches, one step of kdrun's own engine per
objective and precision (EngineStep), and the judgement of each mixed-precision step against fp32."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# Tolerance of a mixed-precision step's loss against the fp32 step's on the same models and batch:
# |loss - fp32| <= rel * |fp32| + abs. bf16 keeps 8 bits of mantissa (relative rounding 4e-3 per
# value), fp16 11 bits; a forward pass accumulates several such roundings.
TOLERANCE = {"bf16": (5e-2, 1e-3), "fp16": (5e-2, 1e-3)}
PRECISION_LABEL = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
FP16_RETRIES = 8  # optimizer steps the fp16 scaler may skip (inf gradients) while it lowers its scale


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    ffn: int


# The precision check's models: one width for all objectives (alp, pkd, distilbert need equal widths,
# minilm and tinybert equal heads), divisible by minilmv2's 12 and MGSKD's 64 relation heads.
TINY_TEACHER, TINY_STUDENT = Shape(4, 192, 4, 384), Shape(2, 192, 4, 384)
BERT_BASE, STUDENT_4_312 = Shape(12, 768, 12, 3072), Shape(4, 312, 12, 1200)
QUICK_TEACHER, QUICK_STUDENT = Shape(2, 64, 4, 128), Shape(1, 32, 4, 64)


# ------------------------------------------------------------------------------- models and batches

def bert(shape: Shape, vocab: int, seed: int, dropout: float = 0.0) -> torch.nn.Module:
    """A randomly initialised BERT classifier (2 labels) through kdrun's own model builder."""
    from kdrun.models.loading import random_classifier

    torch.manual_seed(seed)
    cfg = SimpleNamespace(family="bert", hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                          num_attention_heads=shape.heads, intermediate_size=shape.ffn, dropout=dropout)
    return random_classifier(cfg, vocab, 2)


def fixed_batch(size: int, tokens: int, vocab: int, seed: int = 0, ragged: bool = True) -> dict[str, torch.Tensor]:
    """A batch of random token ids (rows of decreasing length when ``ragged``), labels, row indices and
    [start, end) spans of two tokens (MGSKD's span level)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(tokens, max(4, tokens // 2), size).round().long() if ragged else \
        torch.full((size,), tokens)
    mask = (torch.arange(tokens)[None] < lengths[:, None]).long()
    ids = torch.randint(5, vocab, (size, tokens), generator=g) * mask
    ids[:, 0] = 2
    starts = torch.arange(1, tokens - 1, 2)[: max(3, min(8, (tokens - 2) // 2))]
    spans = torch.stack([starts, starts + 2], -1).expand(size, -1, -1).clone()
    spans[spans[..., 1] > lengths[:, None]] = -1  # past the row's end: padding
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "labels": torch.arange(size) % 2, "idx": torch.arange(size), "spans": spans}


def set_attention(model: torch.nn.Module, plans: list[Any], role: str) -> None:
    """Eager attention when some stage reads attention probabilities, as a run sets it."""
    from kdrun.models.loading import set_attn_implementation

    needs = frozenset().union(*(getattr(p, f"{role}_needs") for p in plans))
    set_attn_implementation(model, "attentions" in needs)


# ------------------------------------------------------------------------------ the engine's step

_ACCELERATORS: dict[tuple[str, str], Any] = {}


def accelerator(device: str, precision: str):
    """kdrun's accelerator (one per device and precision; Accelerate's own mixed precision stays off),
    set to step the optimizer after every micro-batch. Accelerate keeps the accumulation count in a
    process-wide state that the last Accelerator made sets (a run's with
    ``train.gradient_accumulation_steps=2`` would otherwise make the checked step skip the optimizer)."""
    from kdrun.runtime.precision import make_kd_accelerator

    key = (device, precision)
    if key not in _ACCELERATORS:
        _ACCELERATORS[key] = make_kd_accelerator(device != "cuda", precision)
    acc = _ACCELERATORS[key]
    acc.gradient_accumulation_steps, acc.step = 1, 0
    return acc


@dataclass
class StepResult:
    loss: float
    loss_finite: bool
    grads_finite: bool
    grad_norm: float
    skipped: int  # optimizer steps the fp16 scaler skipped before one ran with finite gradients


class EngineStep:
    """kdrun's training step (kdrun.engine.trainer.train_step) on fresh copies of the models for one stage
    and precision: the stage's strategy, optimizer, loss scaler and non-finite watch."""

    def __init__(self, models: dict[str, Any], plan: Any, precision: str, device: str, train_cfg: Any,
                 run_dir: Path, teacher_dtype: str = "auto", record_grads: bool = True):
        from kdrun.app.models import cast_teacher
        from kdrun.engine.trainer import FiniteWatch, PlainStep, make_optimizer

        acc = accelerator(device, precision)
        acc.precision = acc.precision.fresh()  # a new loss scale for every step checked
        teacher = models["teacher"]
        if teacher is not None:  # in the training precision's dtype, as a run keeps it (teacher.dtype=auto)
            teacher = cast_teacher(copy.deepcopy(teacher), teacher_dtype, acc.precision).to(acc.device).eval()
            teacher.requires_grad_(False)
        self.parts = SimpleNamespace(accelerator=acc, student=copy.deepcopy(models["student"]).to(acc.device).train(),
                                     teacher=teacher, objective=copy.deepcopy(models["objective"]).to(acc.device),
                                     world_size=1, rank=0, train_cfg=train_cfg, run_dir=run_dir)
        self.state = SimpleNamespace(global_step=0, stage_step=0, batch_in_epoch=0, epoch=0)
        self.loop = SimpleNamespace(plan=plan, optimizer=make_optimizer(self.parts, plan), watch=FiniteWatch(),
                                    teacher_table=None, store=None, share_params=None, log_every=10**9,
                                    total_steps=10**9)
        self.loop.strategy = self._strategy_step(plan) or PlainStep()
        self.grads: list[tuple[bool, float]] = []
        if record_grads:  # a host read of the gradient norm before every optimizer step
            self.loop.optimizer.register_step_pre_hook(self._record_grads)

    def _strategy_step(self, plan: Any):
        """The step loop of the stage's strategy (kdrun/engine/strategies.py) as the strategy checks it
        (StageStrategy.checked_plan), or None for plain steps."""
        from kdrun.engine.strategies import strategy_of

        strategy = strategy_of(plan.cfg)
        if strategy is None:
            return None
        with contextlib.redirect_stdout(io.StringIO()):
            return strategy.start(self.parts, strategy.checked_plan(plan), self.state)

    def _record_grads(self, optimizer, args, kwargs) -> None:
        grads = [p.grad.detach().float() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        self.grads.append((math.isfinite(norm), norm))

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One training step on ``batch`` (already on the device); the detached loss."""
        from kdrun.engine.trainer import train_step

        loss, _ = train_step(self.parts, self.loop, batch, self.state)
        self.state.global_step += 1
        self.state.stage_step += 1
        return loss

    def _stepped(self, batch: dict[str, torch.Tensor]) -> tuple[float, bool, float]:
        """(loss, gradients finite, gradient norm) of one step; a step whose optimizer was not called
        (a scaler skipping a non-fused optimizer) counts as one with non-finite gradients."""
        seen = len(self.grads)
        loss = float(self(batch))
        finite, norm = self.grads[-1] if len(self.grads) > seen else (False, math.inf)
        return loss, finite, norm

    def checked(self, batch: dict[str, torch.Tensor], retries: int = 0) -> StepResult:
        """One step and what it did; with ``retries`` the step is repeated while the fp16 scaler
        skips it for inf gradients (it lowers its scale each time)."""
        loss, finite, norm = self._stepped(batch)
        skipped = 0
        while not finite and skipped < retries:
            skipped += 1
            _, finite, norm = self._stepped(batch)
        return StepResult(loss, math.isfinite(loss), finite, norm, skipped)


# -------------------------------------------------------------------------------- objectives

def task_objectives() -> dict[str, Any]:
    """The composed config of every objective under kdrun's conf/objective/ that runs on a labelled
    task (kdrun's own preflight rule: some term reads labels or task logits, none reads masked-LM
    outputs)."""
    from importlib.resources import files

    from kdrun.engine.objective import plan_stages
    from kdrun.errors import ConfigError
    from kdrun.tasks.classification import check_labelled_objective

    names = sorted(p.name[:-5] for p in files("kdrun.conf").joinpath("objective").iterdir()
                   if p.name.endswith(".yaml"))
    out = {}
    for name, cfg in compose_objectives(names).items():
        try:
            check_labelled_objective(cfg, plan_stages(cfg.objective))
        except ConfigError:
            continue
        out[name] = cfg
    return out


def compose_objectives(names: list[str]) -> dict[str, Any]:
    """The config ``kdrun objective=<name>`` composes, for each name."""
    from kdrun.config import compose_each

    return dict(zip(names, compose_each([[f"objective={n}", "logger=none"] for n in names])))


def precisions_for(device: str) -> list[str]:
    """fp32 first (the reference), then the mixed precisions the device can run."""
    from kdrun.runtime.precision import native_bf16

    if device == "cuda":
        return ["no", *(["bf16"] if native_bf16() else []), "fp16"]
    return ["no", "bf16", "fp16"]


def objective_models(cfg: Any, teacher_shape: Shape = TINY_TEACHER, student_shape: Shape = TINY_STUDENT,
                     vocab: int = 100) -> tuple[list[Any], dict[str, Any]]:
    """The objective's stages, random teacher and student (tiny by default), and its loss module (seeded)."""
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.engine.strategies import strategies_used
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec

    plans = plan_stages(cfg.objective)
    teacher = bert(teacher_shape, vocab, seed=1)
    # a stage strategy may train the teacher's own copy (e.g. at several widths and depths)
    copies = any(s.student_is_teacher_copy for s in strategies_used(plans))
    student = copy.deepcopy(teacher) if copies else bert(student_shape, vocab, seed=2)
    set_attention(teacher, plans, "teacher")
    set_attention(student, plans, "student")
    torch.manual_seed(3)
    objective = Objective(plans, MappingSpec.from_config(cfg.mapping, seed=0), 2, describe(student), describe(teacher),
                          balance=cfg.objective.balance, balance_alpha=cfg.objective.balance_alpha)  # as a run's
    uses_teacher = any(p.uses_teacher for p in plans)
    return plans, {"teacher": teacher if uses_teacher else None, "student": student, "objective": objective}


def step_results(cfg: Any, device: str, precisions: list[str], run_dir: Path) -> dict[str, list[StepResult]]:
    """Per precision, one engine step of every stage (fresh models each) on the same batch."""
    from kdrun.engine.trainer import to_device

    plans, models = objective_models(cfg)
    batch = fixed_batch(4, 16, 100)
    out: dict[str, list[StepResult]] = {}
    for prec in precisions:
        rows = []
        for plan in plans:
            step = EngineStep(models, plan, prec, device, cfg.train, run_dir)
            torch.manual_seed(0)
            rows.append(step.checked(to_device(batch, step.parts.accelerator.device),
                                     FP16_RETRIES if prec == "fp16" else 0))
        out[prec] = rows
    return out


@dataclass(frozen=True)
class OpsSetup:
    """The shape an op count is taken at: the papers' (a BERT-base teacher, a 4x312 student, 32x128)."""

    teacher: Shape = BERT_BASE
    student: Shape = STUDENT_4_312
    batch: int = 32
    tokens: int = 128
    vocab: int = 30522


QUICK_OPS = OpsSetup(QUICK_TEACHER, Shape(2, 64, 4, 128), 4, 16, 100)  # tiny (tests, --fast); widths / 64


def step_ops(cfg: Any, setup: OpsSetup = OpsSetup(), stage: int = 0, device: str = "cpu", chunks: str = "cuda"):
    """The ATen ops (kdrun.runtime.ops.OpCounter) of one eager fp32 training step of the objective's
    ``stage`` through kdrun's engine (EngineStep: forward passes, backward, optimizer step; gradient-norm
    recording off), counted on the second step so the optimizer's lazy state is not in it. The angle
    kernel chunks its work as on ``chunks`` (default cuda: the launches of a GPU step, whatever runs it)."""
    from kdrun.engine.trainer import to_device
    from kdrun.losses.angle_kernel import chunked_as
    from kdrun.runtime.ops import OpCounter

    plans, models = objective_models(cfg, setup.teacher, setup.student, setup.vocab)
    with tempfile.TemporaryDirectory(prefix="kdrun-ops-") as tmp:
        step = EngineStep(models, plans[stage], "no", device, cfg.train, Path(tmp), record_grads=False)
        batch = to_device(fixed_batch(setup.batch, setup.tokens, setup.vocab), step.parts.accelerator.device)
        torch.manual_seed(0)
        with chunked_as(chunks):
            step(batch)
            with OpCounter() as ops:
                step(batch)
    return ops


def rel_diff(got: float, ref: float) -> float:
    return abs(got - ref) / max(abs(ref), 1e-12)


def judge(prec: str, rows: list[StepResult], ref: list[StepResult]) -> tuple[bool, float, str]:
    """(passed, largest relative loss difference over the stages, why it failed)."""
    diffs = [rel_diff(r.loss, f.loss) for r, f in zip(rows, ref)]
    worst = max(diffs)
    if not all(r.loss_finite for r in rows):
        return False, worst, "non-finite loss"
    if not all(r.grads_finite for r in rows):
        return False, worst, "non-finite gradients"
    rtol, atol = TOLERANCE.get(prec, (0.0, 0.0))
    if prec != "no" and any(abs(r.loss - f.loss) > rtol * abs(f.loss) + atol for r, f in zip(rows, ref)):
        return False, worst, "loss outside the tolerance"
    return True, worst, ""


def step_detail(prec: str, rows: list[StepResult], ref: list[StepResult], worst: float, why: str) -> str:
    """The printed outcome of one (objective, precision) row."""
    rtol, atol = TOLERANCE.get(prec, (0.0, 0.0))
    tol = f"tol rel {rtol:g} + abs {atol:g}" if prec != "no" else "reference"
    grads = "finite" if all(r.grads_finite for r in rows) else "NOT finite"
    skipped = sum(r.skipped for r in rows)
    more = f" (+{len(rows) - 1} stage(s))" if len(rows) > 1 else ""
    return (f"loss {rows[0].loss:.6g} vs fp32 {ref[0].loss:.6g}{more}, rel diff {worst:.2e} ({tol}), grads {grads}"
            + (f", scaler skipped {skipped} step(s)" if skipped else "") + (f": {why}" if why else ""))


def stage_data(rows: list[StepResult], ref: list[StepResult]) -> list[dict[str, Any]]:
    return [{"loss": r.loss, "fp32_loss": f.loss, "rel_diff": rel_diff(r.loss, f.loss), "grad_norm": r.grad_norm,
             "fp32_grad_norm": f.grad_norm, "grads_finite": r.grads_finite, "scaler_skipped": r.skipped}
            for r, f in zip(rows, ref)]


def check_objective(report: Any, name: str, cfg: Any, device: str, precisions: list[str], run_dir: Path) -> None:
    results = step_results(cfg, device, precisions, run_dir)
    ref = results["no"]
    for prec in precisions:
        rows = results[prec]
        ok, worst, why = judge(prec, rows, ref)
        rtol, atol = TOLERANCE.get(prec, (0.0, 0.0))
        report.add(f"step {name} {PRECISION_LABEL[prec]}", "pass" if ok else "fail",
                   step_detail(prec, rows, ref, worst, why), objective=name, precision=PRECISION_LABEL[prec],
                   rel_diff=worst, rtol=rtol, atol=atol, grads_finite=all(r.grads_finite for r in rows),
                   scaler_skipped=sum(r.skipped for r in rows), stages=stage_data(rows, ref))


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with ``n`` intra-op CPU threads (tiny models only lose time to thread hand-offs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_precision_steps(report: Any, device: str) -> None:
    precisions = precisions_for(device)
    cfgs = report.guarded("objectives", task_objectives) or {}
    names = list(cfgs)
    report.add("objectives", "info", f"{len(names)} run on labelled tasks: {', '.join(names)}; precisions "
               + ", ".join(PRECISION_LABEL[p] for p in precisions), objectives=names,
               precisions=[PRECISION_LABEL[p] for p in precisions])
    with tempfile.TemporaryDirectory(prefix="kdrun-doctor-") as tmp, torch_threads(1):
        for name in names:
            report.guarded(f"step {name}", lambda n=name: check_objective(report, n, cfgs[n], device, precisions,
                                                                         Path(tmp)))
