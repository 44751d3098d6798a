"""kdrun-doctor: a self-check to run on a (GPU) node before a sweep.

    kdrun-doctor [--quick] [--out kdrun-doctor.json]

Checks, one printed line each: the torch / CUDA build and devices and what ``train.precision=auto``
becomes; an all-reduce across the visible GPUs (NCCL, with two or more of them) or between two CPU
processes (gloo); one training step of each student kind (truncated first) built as a run builds it,
in every precision, asserting fp32 master weights and no update lost to rounding
(kdrun.app.doctor_students); one training step of every objective that runs on a labelled task, through kdrun's
own engine (kdrun.engine.trainer.train_step), in every precision that applies, each loss compared with the
fp32 one; and throughput and peak memory of a bert_base-shaped teacher distilled into a 4-layer,
312-wide student (random weights, no download) with logit KD and with CKD. Everything is also
written to a JSON file. Exit status 0 when every check that applies passed, 1 otherwise.
``--quick`` shrinks the throughput models to a tiny shape (CPU, tests).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import os
import resource
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from kdrun.runtime.cache import write_json_atomic

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


# ------------------------------------------------------------------------------------- the report

@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip | info
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


class Report:
    """The checks made so far; each is printed as it is added."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(self, name: str, status: str, detail: str, **data: Any) -> Check:
        check = Check(name, status, detail, data)
        self.checks.append(check)
        print(check.line, flush=True)
        return check

    def guarded(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or a failed check naming the exception."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the doctor reports every failure and goes on
            self.add(name, "fail", f"{type(e).__name__}: {e}".splitlines()[0][:300])
            return None

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def to_dict(self, **meta: Any) -> dict[str, Any]:
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "fail", "skip", "info")}
        return {"ok": self.ok, **meta, "counts": counts,
                "checks": [{**asdict(c), "line": c.line} for c in self.checks]}


# -------------------------------------------------------------------------------- the environment

def check_environment(report: Report) -> str:
    """Versions, devices, native bf16 and the ``auto`` precision; returns the device type."""
    from kdrun.runtime.precision import native_bf16, resolve_precision

    cuda = torch.cuda.is_available()
    report.add("torch", "info", f"torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}",
               torch=torch.__version__, cuda_build=torch.version.cuda)
    report.add("cuda", "info", f"CUDA available: {'yes' if cuda else 'no'}"
               + (f", {torch.cuda.device_count()} device(s)" if cuda else ""),
               available=cuda, device_count=torch.cuda.device_count() if cuda else 0)
    for i in range(torch.cuda.device_count() if cuda else 0):
        cap = torch.cuda.get_device_capability(i)
        report.add(f"device {i}", "info", f"{torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}",
                   device_name=torch.cuda.get_device_name(i), capability=list(cap))
    device = "cuda" if cuda else "cpu"
    bf16 = native_bf16()
    report.add("native bf16", "info", "yes" if bf16 else ("no" if cuda else "no (CUDA is absent)"), native_bf16=bf16)
    auto = resolve_precision("auto", device)
    report.add("train.precision=auto", "info", f"resolves to {PRECISION_LABEL[auto]} on {device}",
               resolves_to=PRECISION_LABEL[auto], device=device)
    return device


# ------------------------------------------------------------------------------------ collectives

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, world: int, backend: str, port: int, timeout_s: float) -> None:
    """One process of the all-reduce check: every rank adds rank + 1; all must see the sum."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t)
        want = world * (world + 1) / 2
        if not bool((t == want).all()):
            raise RuntimeError(f"rank {rank}: all-reduce gave {t[0].item()}, expected {want}")
    finally:
        dist.destroy_process_group()


def run_allreduce(backend: str, world: int, timeout_s: float = 120.0) -> float:
    """Spawn ``world`` processes that all-reduce a tensor; raises on a wrong sum or a hang. Seconds."""
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.start_processes(_allreduce_worker, args=(world, backend, _free_port(), timeout_s), nprocs=world,
                             join=False, start_method="spawn")
    deadline = t0 + timeout_s + 30
    while not ctx.join(timeout=1.0):
        if time.perf_counter() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{backend} all-reduce of {world} processes did not finish in {timeout_s + 30:.0f}s")
    return time.perf_counter() - t0


def check_collectives(report: Report, device: str) -> None:
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if gpus >= 2:
        _allreduce_check(report, "nccl", gpus)
        return
    why = "CUDA is absent" if device != "cuda" else "only one GPU is visible"
    report.add("NCCL all-reduce", "skip", f"skipped, {why}", reason=why)
    _allreduce_check(report, "gloo", 2)


def _allreduce_check(report: Report, backend: str, world: int) -> None:
    name = f"{backend} all-reduce"

    def go() -> None:
        secs = run_allreduce(backend, world)
        want = world * (world + 1) / 2
        report.add(name, "pass", f"{world} processes, every rank got the sum {want:g} ({secs:.1f}s)",
                   backend=backend, processes=world, seconds=round(secs, 2))

    report.guarded(name, go)


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

_ACCELERATORS: dict[str, Any] = {}


def accelerator(device: str, precision: str):
    """kdrun's accelerator (one per precision; Accelerate's own mixed precision stays off)."""
    from kdrun.runtime.precision import make_kd_accelerator

    if precision not in _ACCELERATORS:
        _ACCELERATORS[precision] = make_kd_accelerator(device != "cuda", precision)
    return _ACCELERATORS[precision]


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
        from kdrun.app.run import cast_teacher
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
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from kdrun.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="kdrun.conf", version_base="1.3"):
        return {n: compose(config_name="config", overrides=[f"objective={n}", "logger=none"]) for n in names}


def precisions_for(device: str) -> list[str]:
    """fp32 first (the reference), then the mixed precisions the device can run."""
    from kdrun.runtime.precision import native_bf16

    if device == "cuda":
        return ["no", *(["bf16"] if native_bf16() else []), "fp16"]
    return ["no", "bf16", "fp16"]


def objective_models(cfg: Any) -> tuple[list[Any], dict[str, Any]]:
    """The objective's stages, tiny random teacher and student, and its loss module (seeded)."""
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.engine.strategies import strategies_used
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec

    plans = plan_stages(cfg.objective)
    teacher = bert(TINY_TEACHER, 100, seed=1)
    # a stage strategy may train the teacher's own copy (e.g. at several widths and depths)
    copies = any(s.student_is_teacher_copy for s in strategies_used(plans))
    student = copy.deepcopy(teacher) if copies else bert(TINY_STUDENT, 100, seed=2)
    set_attention(teacher, plans, "teacher")
    set_attention(student, plans, "student")
    torch.manual_seed(3)
    objective = Objective(plans, MappingSpec.from_config(cfg.mapping, seed=0), 2, describe(student), describe(teacher))
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


def check_objective(report: Report, name: str, cfg: Any, device: str, precisions: list[str], run_dir: Path) -> None:
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


def check_precision_steps(report: Report, device: str) -> None:
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


# -------------------------------------------------------------------------------------- throughput

def peak_rss() -> int:
    """This process's peak resident set in bytes: Linux's VmHWM where there is one (a process
    started by fork + exec inherits its parent's ``ru_maxrss``, not its VmHWM), else getrusage."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated on the GPU since the last reset, or the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss()


def bench_worker(objective: str, teacher: Shape, student: Shape, batch: int, tokens: int, vocab: int,
                 steps: int, warmup: int, threads: int | None = None) -> dict[str, Any]:
    """Throughput of ``steps`` engine steps in the ``auto`` precision (run in a fresh process, so the
    peak resident set is this configuration's own); ``threads``: torch's CPU threads (None: its default)."""
    if threads:
        torch.set_num_threads(threads)
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec
    from kdrun.runtime.precision import resolve_precision

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = compose_objectives([objective])[objective]
    plans = plan_stages(cfg.objective)
    t, s = bert(teacher, vocab, seed=1), bert(student, vocab, seed=2, dropout=0.1)
    set_attention(t, plans, "teacher")
    set_attention(s, plans, "student")
    obj = Objective(plans, MappingSpec.from_config(cfg.mapping, seed=0), 2, describe(s), describe(t))
    prec = resolve_precision("auto", device)
    with tempfile.TemporaryDirectory(prefix="kdrun-doctor-") as tmp:
        step = EngineStep({"teacher": t, "student": s, "objective": obj}, plans[0], prec, device, cfg.train, Path(tmp))
        return _time_steps(step, fixed_batch(batch, tokens, vocab, ragged=False), steps, warmup) | {
            "precision": PRECISION_LABEL[prec], "device": device}


def _time_steps(step: EngineStep, batch: dict[str, torch.Tensor], steps: int, warmup: int) -> dict[str, Any]:
    from kdrun.engine.trainer import to_device

    dev = step.parts.accelerator.device
    batch = to_device(batch, dev)
    for _ in range(warmup):
        step(batch)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    before = peak_memory(dev)
    t0 = time.perf_counter()
    losses = [step(batch) for _ in range(steps)]
    sync()
    secs = (time.perf_counter() - t0) / steps
    tokens = int(batch["attention_mask"].sum())
    return {"step_ms": secs * 1e3, "tokens_per_s": tokens / secs, "peak_bytes": peak_memory(dev),
            "peak_bytes_before_steps": before, "loss_finite": all(math.isfinite(float(x)) for x in losses)}


def run_in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def bench_setup(quick: bool, device: str) -> dict[str, Any]:
    """The throughput check's models, batch and steps (fewer steps of the full shape on a CPU)."""
    if quick:
        return {"teacher": QUICK_TEACHER, "student": QUICK_STUDENT, "batch": 8, "tokens": 32, "vocab": 1000,
                "steps": 4, "warmup": 2, "threads": 1}
    steps, warmup = (10, 3) if device == "cuda" else (3, 1)
    return {"teacher": BERT_BASE, "student": STUDENT_4_312, "batch": 32, "tokens": 128, "vocab": 30522,
            "steps": steps, "warmup": warmup, "threads": None}


def bench_detail(r: dict[str, Any], setup: dict[str, Any]) -> str:
    t, s = setup["teacher"], setup["student"]
    mem = "peak GPU memory" if r["device"] == "cuda" else "peak RSS"
    return (f"{r['tokens_per_s']:.0f} tokens/s, step {r['step_ms']:.1f} ms, {mem} {r['peak_bytes'] / 2**20:.0f} MiB "
            f"(teacher {t.layers}x{t.hidden} -> student {s.layers}x{s.hidden}, batch {setup['batch']}x"
            f"{setup['tokens']}, {r['precision']}, teacher forward included)"
            + ("" if r["loss_finite"] else ": loss NaN/inf"))


def check_throughput(report: Report, quick: bool, device: str) -> None:
    setup = bench_setup(quick, device)
    args = [setup[k] for k in ("teacher", "student", "batch", "tokens", "vocab", "steps", "warmup", "threads")]
    for objective in ("logit", "ckd"):
        name = f"throughput {objective}"
        r = report.guarded(name, lambda o=objective: run_in_fresh_process(bench_worker, o, *args))
        if r is not None:
            data = {**setup, "teacher": asdict(setup["teacher"]), "student": asdict(setup["student"]), **r}
            report.add(name, "pass" if r["loss_finite"] else "fail", bench_detail(r, setup), objective=objective,
                       **data)


# --------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kdrun-doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="kdrun-doctor.json", help="JSON report (default: ./kdrun-doctor.json)")
    ap.add_argument("--quick", action="store_true", help="tiny throughput models (CPU, tests)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from kdrun.app.doctor_students import check_student_kinds

    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    report = Report()
    device = check_environment(report)
    check_collectives(report, device)
    check_student_kinds(report, device, precisions_for(device))
    check_precision_steps(report, device)
    check_throughput(report, args.quick, device)
    out = Path(args.out)
    write_json_atomic(out, report.to_dict(quick=args.quick, device=device, seconds=round(time.perf_counter() - t0, 1),
                                          argv=sys.argv[1:] if argv is None else list(argv)))
    c = report.to_dict()["counts"]
    verdict = "all checks passed" if report.ok else f"{c['fail']} check(s) FAILED"
    print(f"kdrun-doctor: {verdict} ({c['pass']} passed, {c['fail']} failed, {c['skip']} skipped); "
          f"report: {out}", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    from kdrun.app.doctor import main as _main  # the workers are pickled by reference to kdrun.app.doctor

    sys.exit(_main())
