"""The prepared GPU check: throughput, exactness, host syncs, the fp16 skip and whole runs, in one JSON.

A list of named checks run in order, each under its own time budget and its own try/except (one
failure or timeout never loses the others); each returns its figures and a pass/fail:

1. throughput: per objective (logit, ckd, mgskd, tinybert, minilm; stage 0) the tokens/s of kdrun's
   own training step (kdrun.app.doctor_steps.EngineStep: teacher forward, student forward and
   backward, optimizer step; gradient-norm recording off) at the papers' shape: a BERT-base-shaped
   teacher (12 x 768, random weights) into a 4 x 312 student, batches of 32 x 128 tokens, bf16
   autocast on CUDA. Three modes of the step's forward region (kdrun.engine.compiled): eager,
   compiled (train.compile=true: student forward, teacher forward and loss as one graph) and
   graphed (train.cuda_graphs=true: that graph under CUDA graphs; CUDA only). A timed block of N steps is
   synchronised once before and once after, with no host read inside it. Each row also has the
   model FLOPs per step (formula in the JSON), the fraction of the device's bf16 dense peak (known
   devices only) and the ATen ops of one step (kdrun.runtime.ops.OpCounter via step_ops).
2. exactness: CKD's and MGSKD's loss and gradients of one engine step on the device (fp32, TF32
   on) against an fp64 CPU reference on the same random models and batch, eager and compiled.
3. syncs: 20 training steps under torch.cuda.set_sync_debug_mode; every sync is recorded with where
   it happened and whether it ran inside a kdrun.runtime.syncs.host_section (CUDA only).
4. fp16: the fused optimizer skips a step whose gradients overflow, with no host read (CUDA only).
5. runs: tiny ``python -m kdrun`` runs with train.device=auto (quickstart in bf16 and fp16, SQuAD and
   Wikipedia when the data exist, DynaBERT, teacher.store=on), kdrun-export of the GPU-trained
   student, and kdrun-doctor.

On the GPU machine (about 8 minutes):

    python scripts/gpu_check.py [--out docs/data/gpu/<date>-<device>.json]

then commit the JSON and put the printed table in docs/results.md. ``--fast``: tiny shapes and models
on any device, CUDA-only checks recorded as skipped and one tiny run (about a minute on a 2-core CPU;
used by the tests). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = Path(os.environ.get("KDRUN_DATA") or REPO.parent / "shared" / "data")
OBJECTIVES = ("logit", "ckd", "mgskd", "tinybert", "minilm")
FAST_COMPILED = ("logit", "ckd")  # --fast: the compiled rows taken (a compile costs seconds on a CPU)
# bf16 dense tensor-core peaks (TFLOP/s, no sparsity) by device name; None for any other device
PEAKS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
FLOPS_FORMULA = ("step = fwd(teacher) + 3 * fwd(student); fwd(model) = 2 * P * B * n + 4 * L * B * n^2 * d, "
                 "P = weights of the model's Linear layers, B x n = batch x tokens, L = layers, d = hidden; "
                 "the loss terms' own arithmetic is not counted")
EXACT_OBJECTIVES = ("ckd", "mgskd")
EXACT_TOL = {"loss_rel": 1e-2, "grad_norm_rel": 2e-2}  # TF32 keeps 10 mantissa bits (about 1e-3 per matmul)


class Timeout(Exception):
    pass


@dataclass
class Ctx:
    fast: bool
    device: str  # "cuda" or "cpu"
    tmp: Path
    meta: dict[str, Any]
    budget: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)


# ---------------------------------------------------------------------------------------- helpers

def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.machine()} ({os.cpu_count()} cores)"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def peak_tflops(name: str) -> float | None:
    """The bf16 dense peak of a known device (H100 SXM / HBM3 989, H100 PCIe 756, H200 989, A100 312)."""
    for key, value in PEAKS:
        if key.lower() in name.lower():
            return value
    return None


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise Timeout in this thread after ``seconds`` (a check's own budget)."""
    def fire(signum, frame):
        raise Timeout(f"over its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


def compile_backend(ctx: Ctx) -> str:
    """inductor on CUDA (as train.compile=true runs); aot_eager in --fast mode (traced, no C++ build)."""
    return "aot_eager" if ctx.fast else "inductor"


def use_mode(step: Any, mode: str, backend: str) -> None:
    """Run the engine step's forward region eager, compiled or graphed, as train.compile /
    train.cuda_graphs run it (kdrun.engine.compiled.StepForward)."""
    from kdrun.engine.compiled import StepForward

    step.loop.forward = StepForward(step.parts, step.loop.plan, mode, backend)


def reset_compiler() -> None:
    """Forget earlier compiled graphs: each compiled row starts as a fresh process would. (A graph
    compiled for an earlier objective's models can otherwise be reused without the feature hooks a
    later one needs, e.g. TinyBERT's Q/K capture after CKD's.)"""
    import torch

    torch._dynamo.reset()


def engine_step(cfg: Any, setup: Any, precision: str, ctx: Ctx, stage: int = 0) -> Any:
    """kdrun's engine step for the objective's ``stage`` on fresh random models at ``setup``'s shape."""
    from kdrun.app.doctor_steps import EngineStep, objective_models

    plans, models = objective_models(cfg, setup.teacher, setup.student, setup.vocab)
    return EngineStep(models, plans[stage], precision, ctx.device, cfg.train, ctx.tmp, record_grads=False)


def papers_setup(ctx: Ctx) -> Any:
    from kdrun.app.doctor_steps import QUICK_OPS, OpsSetup

    return QUICK_OPS if ctx.fast else OpsSetup()


# ------------------------------------------------------------------------------------ 1. throughput

def matmul_params(model: Any) -> int:
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(model: Any, shape: Any, batch: int, tokens: int) -> float:
    return 2.0 * matmul_params(model) * batch * tokens + 4.0 * shape.layers * batch * tokens ** 2 * shape.hidden


def step_flops(step: Any, setup: Any) -> float:
    flops = 3 * forward_flops(step.parts.student, setup.student, setup.batch, setup.tokens)
    if step.parts.teacher is not None:
        flops += forward_flops(step.parts.teacher, setup.teacher, setup.batch, setup.tokens)
    return flops


def timed_steps(step: Any, batch: dict, device: str, warmup: int, steps: int) -> float:
    """Seconds per step over ``steps`` steps after ``warmup``; one sync before and one after the block."""
    for _ in range(warmup):
        step(batch)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(batch)
    sync(device)
    return (time.perf_counter() - t0) / steps


def throughput_row(cfg: Any, mode: str, ctx: Ctx) -> dict[str, Any]:
    from kdrun.app.doctor_steps import fixed_batch
    from kdrun.engine.trainer import to_device

    setup = papers_setup(ctx)
    step = engine_step(cfg, setup, "bf16" if ctx.device == "cuda" else "no", ctx)
    flops = step_flops(step, setup)
    if mode != "eager":
        reset_compiler()
        use_mode(step, mode, compile_backend(ctx))
    batch = to_device(fixed_batch(setup.batch, setup.tokens, setup.vocab, ragged=False), step.parts.accelerator.device)
    steps, warmup = (2, 1) if ctx.fast else (20, 3)
    t0 = time.perf_counter()
    per_step = timed_steps(step, batch, ctx.device, warmup if mode == "eager" else warmup + 1, steps)
    tokens = setup.batch * setup.tokens
    peak = peak_tflops(ctx.meta["device"]) if ctx.device == "cuda" else None
    achieved = flops / per_step / 1e12
    return {"status": "pass", "tokens_per_s": tokens / per_step, "ms_per_step": per_step * 1e3, "timed_steps": steps,
            "model_tflop_per_step": flops / 1e12, "achieved_tflop_s": achieved,
            "peak_fraction": achieved / peak if peak else None, "seconds_with_warmup": time.perf_counter() - t0}


def ops_row(cfg: Any, ctx: Ctx) -> dict[str, Any]:
    from kdrun.app.doctor_steps import step_ops

    ops = step_ops(cfg, papers_setup(ctx), device=ctx.device)
    return {"ops": ops.count, "top": ops.by_name.most_common(5)}


def guarded(fn: Callable[[], dict], ctx: Ctx, floor: float) -> dict[str, Any]:
    """``fn()``'s row, or a failure row; skipped when less than ``floor`` seconds of the budget are left."""
    if ctx.left() < floor:
        return skipped(f"out of the check's budget ({ctx.left():.0f} s left)")
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a row's failure (a Timeout too) is recorded; the rows before it are kept
        return {"status": "fail", "error": f"{type(e).__name__}: {e}"[:500],
                "traceback": traceback.format_exc()[-2000:]}


def check_throughput(ctx: Ctx) -> dict[str, Any]:
    from kdrun.app.doctor_steps import compose_objectives

    setup = papers_setup(ctx)
    cfgs = compose_objectives(list(OBJECTIVES))
    rows: dict[str, dict[str, Any]] = {n: {} for n in OBJECTIVES}
    modes = ("eager", "compiled", "graphed")
    for name in OBJECTIVES:  # every objective's eager row and op count first: a slow compile cannot cost those
        rows[name]["eager"] = guarded(lambda n=name: throughput_row(cfgs[n], "eager", ctx), ctx, 5)
        rows[name]["aten_ops"] = guarded(lambda n=name: ops_row(cfgs[n], ctx), ctx, 5)
    for name in OBJECTIVES:  # then both compiled modes objective by objective, in OBJECTIVES' order
        for mode in modes[1:]:
            if mode == "graphed" and ctx.device != "cuda":
                rows[name][mode] = skipped("CUDA graphs need CUDA")
            elif mode == "compiled" and ctx.fast and name not in FAST_COMPILED:
                rows[name][mode] = skipped(f"compiled only for {', '.join(FAST_COMPILED)} in --fast mode")
            else:
                rows[name][mode] = guarded(lambda n=name, m=mode: throughput_row(cfgs[n], m, ctx), ctx, 20)
    ok = all(r[m]["status"] != "fail" for r in rows.values() for m in modes) and \
        all(r["eager"]["status"] == "pass" for r in rows.values())
    return {"passed": ok, "shape": {"teacher": asdict(setup.teacher), "student": asdict(setup.student),
                                    "batch": setup.batch, "tokens": setup.tokens, "vocab": setup.vocab},
            "precision": "bf16" if ctx.device == "cuda" else "fp32", "compile_backend": compile_backend(ctx),
            "flops_formula": FLOPS_FORMULA, "peak_bf16_tflop_s": peak_tflops(ctx.meta["device"]),
            "rows": rows}


# ------------------------------------------------------------------------------------ 2. exactness

def loss_and_grads(cfg: Any, device: str, dtype: Any, ctx: Ctx, backend: str | None) -> tuple[float, Any]:
    """One fp32 (or fp64) engine step of the objective's stage 0 on tiny random models: its loss and the
    student's gradients (flattened, fp64 on the CPU) as the optimizer sees them."""
    import torch

    from kdrun.app.doctor_steps import (
        QUICK_TEACHER,
        TINY_STUDENT,
        TINY_TEACHER,
        EngineStep,
        Shape,
        fixed_batch,
        objective_models,
    )
    from kdrun.engine.trainer import to_device

    t_shape, s_shape = (QUICK_TEACHER, Shape(2, 64, 4, 128)) if ctx.fast else (TINY_TEACHER, TINY_STUDENT)
    plans, models = objective_models(cfg, t_shape, s_shape)
    models = {k: None if m is None else m.to(dtype) for k, m in models.items()}
    step = EngineStep(models, plans[0], "no", device, cfg.train, ctx.tmp, record_grads=False)
    if step.parts.teacher is not None:
        step.parts.teacher = step.parts.teacher.to(dtype)  # EngineStep casts it to the precision's dtype
    if backend is not None:
        reset_compiler()
        use_mode(step, "compiled", backend)
    seen: list[Any] = []

    def grab(optimizer, args, kwargs):
        # a parameter the loss does not reach counts as a zero gradient (compiled graphs may give it zeros)
        seen.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
                               for g in optimizer.param_groups for p in g["params"]]).to("cpu", torch.float64))

    step.loop.optimizer.register_step_pre_hook(grab)
    torch.manual_seed(0)
    loss = float(step(to_device(fixed_batch(4, 16, 100), step.parts.accelerator.device)))
    return loss, seen[0]


def compare(got: tuple[float, Any], ref: tuple[float, Any]) -> dict[str, Any]:
    g, r = got[1], ref[1]
    diff = (g - r).abs()
    row = {"loss": got[0], "ref_loss": ref[0], "loss_abs_diff": abs(got[0] - ref[0]),
           "loss_rel_diff": abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-12),
           "grad_max_abs_diff": float(diff.max()), "grad_max_rel_diff": float((diff / r.abs().clamp_min(1e-6)).max()),
           "grad_norm_rel_diff": float(diff.norm() / r.norm().clamp_min(1e-30)), "grad_count": g.numel()}
    row["status"] = "pass" if row["loss_rel_diff"] <= EXACT_TOL["loss_rel"] and \
        row["grad_norm_rel_diff"] <= EXACT_TOL["grad_norm_rel"] else "fail"
    return row


@contextlib.contextmanager
def tf32(device: str):
    import torch

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def write_reference(path: Path, fast: bool) -> None:
    """The fp64 CPU reference of every exactness objective, saved to ``path`` (run in its own process
    without CUDA: kdrun's accelerator keeps the first device a process chose)."""
    import torch

    from kdrun.app.doctor_steps import compose_objectives

    with tempfile.TemporaryDirectory(prefix="kdrun-gpu-check-ref-") as tmp:
        ctx = Ctx(fast, "cpu", Path(tmp), {})
        refs = {n: loss_and_grads(cfg, "cpu", torch.float64, ctx, None)
                for n, cfg in compose_objectives(list(EXACT_OBJECTIVES)).items()}
    torch.save(refs, path)


def reference(ctx: Ctx) -> dict[str, tuple[float, Any]]:
    import torch

    path = ctx.tmp / "reference.pt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference", str(path), *(["--fast"] if ctx.fast else [])]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(5.0, ctx.left() - 5),
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if p.returncode:
        raise RuntimeError(f"the fp64 reference process exited with {p.returncode}: {p.stderr[-800:]}")
    return torch.load(path, weights_only=True)


def check_exactness(ctx: Ctx) -> dict[str, Any]:
    import torch

    from kdrun.app.doctor_steps import compose_objectives

    cfgs = compose_objectives(list(EXACT_OBJECTIVES))
    refs = reference(ctx)
    rows: dict[str, dict[str, Any]] = {}
    for name, cfg in cfgs.items():
        ref = refs[name]
        rows[name] = {}
        for mode, backend in (("eager", None), ("compiled", compile_backend(ctx))):
            def row(cfg=cfg, backend=backend, ref=ref):
                with tf32(ctx.device):
                    return compare(loss_and_grads(cfg, ctx.device, torch.float32, ctx, backend), ref)
            rows[name][mode] = guarded(row, ctx, 3)
    return {"passed": all(r["status"] == "pass" for m in rows.values() for r in m.values()),
            "against": "fp64 on the CPU (its own process), same random models (seeded) and batch (4 x 16, ragged)",
            "device_precision": "fp32, TF32 matmuls on" if ctx.device == "cuda" else "fp32",
            "tolerance": EXACT_TOL, "compile_backend": compile_backend(ctx), "rows": rows}


# ---------------------------------------------------------------------------------------- 3. syncs

@contextlib.contextmanager
def sync_log(events: list[dict[str, Any]]):
    """Every CUDA sync as a warning (torch.cuda.set_sync_debug_mode("warn")), recorded with whether it
    ran inside a kdrun host section and its innermost frame outside torch."""
    import torch

    from kdrun.runtime.syncs import in_host_section

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and not f.filename.endswith(("warnings.py", "gpu_check.py", "contextlib.py"))]
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
        events.append({"host_section": in_host_section(), "where": where, "in_kdrun": "/kdrun/" in where})

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def check_syncs(ctx: Ctx) -> dict[str, Any]:
    from kdrun.app.doctor_steps import QUICK_TEACHER, TINY_STUDENT, OpsSetup, compose_objectives, fixed_batch
    from kdrun.engine.trainer import to_device

    if ctx.device != "cuda":
        return {"passed": True, **skipped("torch.cuda.set_sync_debug_mode needs CUDA")}
    setup = OpsSetup(QUICK_TEACHER if ctx.fast else OpsSetup().teacher, TINY_STUDENT, 16, 64, 1000)
    rows = {}
    for name, cfg in compose_objectives(["ckd", "mgskd"]).items():
        step = engine_step(cfg, setup, "bf16", ctx)
        batch = to_device(fixed_batch(16, 64, 1000), step.parts.accelerator.device)
        step(batch)  # the optimizer's lazy state
        sync(ctx.device)
        events: list[dict[str, Any]] = []
        with sync_log(events):
            for _ in range(20):
                step(batch)
        sync(ctx.device)
        outside = [e for e in events if not e["host_section"]]
        rows[name] = {"steps": 20, "syncs": len(events), "outside_host_sections": len(outside),
                      "outside_in_kdrun": sum(e["in_kdrun"] for e in outside),
                      "where": sorted({e["where"] for e in outside})[:10]}
    return {"passed": all(r["outside_in_kdrun"] == 0 for r in rows.values()), "precision": "bf16",
            "debug_mode": "warn: every sync recorded with its place ('error' stops at the first, transformers' own)",
            "rule": "no sync outside a kdrun host section from kdrun's own code (transformers' mask check listed)",
            "rows": rows}


# ----------------------------------------------------------------------------------------- 4. fp16

def check_fp16(ctx: Ctx) -> dict[str, Any]:
    """A step whose scaled gradients overflow (initial loss scale 2^100): the fused optimizer skips it
    reading the scaler's inf flag on the device, the weights stay, the scale drops, no sync outside a
    host section."""
    import torch

    from kdrun.app.doctor_steps import QUICK_OPS, compose_objectives, fixed_batch
    from kdrun.engine.trainer import to_device

    if ctx.device != "cuda":
        return {"passed": True, **skipped("the fused optimizer's on-device inf check needs CUDA")}
    cfg = compose_objectives(["logit"])["logit"]
    step = engine_step(cfg, QUICK_OPS, "fp16", ctx)
    step.parts.accelerator.precision.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 100)
    batch = to_device(fixed_batch(4, 16, 100), step.parts.accelerator.device)
    before = [p.detach().clone() for p in step.parts.student.parameters()]
    fused = bool(getattr(step.loop.optimizer, "_step_supports_amp_scaling", False))
    sync(ctx.device)
    events: list[dict[str, Any]] = []
    with sync_log(events):
        step(batch)
    sync(ctx.device)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, step.parts.student.parameters()))
    scale = step.parts.accelerator.precision.loss_scale()
    outside = [e for e in events if not e["host_section"] and e["in_kdrun"]]
    return {"passed": fused and unchanged and scale < 2.0 ** 100 and not outside, "fused_optimizer": fused,
            "weights_unchanged": unchanged, "scale_after": scale, "scale_before": 2.0 ** 100,
            "syncs": len(events), "kdrun_syncs_outside_host_sections": [e["where"] for e in outside]}


# ----------------------------------------------------------------------------------------- 5. runs

TINY = ["teacher=tiny_random", "student=tiny_random", "logger=none", "teacher.finetune.epochs=1",
        "train.eval_batch_size=64"]
TINY_TOY = [*TINY, "task=toy", "task.toy.num_train=48", "task.toy.num_validation=24", "train.epochs=1"]
DYNABERT = [*TINY, "task=toy", "task.toy.num_train=48", "task.toy.num_validation=24", "objective=dynabert_ckd",
            "student=truncated", "student.num_layers=4", "objective.params.widths=[1.0,0.5]",
            "objective.params.depths=[1.0,0.5]", "objective.params.width_epochs=1",
            "objective.params.depth_epochs=1", "objective.params.batch_size=16"]
QUICK = ["experiment=quickstart", "logger=none", "task.toy.num_train=200", "task.toy.num_validation=64"]


def run_specs(ctx: Ctx) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each tiny run, or (name, []) for a run left out, in order."""
    if ctx.fast:
        return [("tiny_toy", [*TINY_TOY, "objective=logit"])]
    squad, wiki = DATA / "squad" / "dev-v1.1.json", sorted((DATA / "wikipedia").glob("wiki_*"))
    specs = [("quickstart_bf16", [*QUICK, "train.precision=bf16"]),
             ("quickstart_fp16", [*QUICK, "train.precision=fp16"])]
    if squad.exists():
        specs.append(("squad_tiny", [*TINY, "task=squad", f"task.data_dir={squad.parent}", "task.split_by_article=4",
                                     "task.max_train_samples=64", "task.max_eval_samples=32",
                                     "task.max_seq_length=128", "task.doc_stride=32", "train.epochs=1",
                                     "objective=logit"]))
    general = [f"task.data_files={wiki[0]}"] if wiki else []
    specs.append(("general_tiny", [*TINY, "task=wikipedia" if wiki else "task=text_corpus", *general,
                                   "task.validation_percent=10", "task.max_seq_length=64",
                                   "task.max_train_samples=256", "objective=mlm_ckd", "train.epochs=1"]))
    specs += [("dynabert_tiny", DYNABERT), ("teacher_store", [*TINY_TOY, "objective=ckd", "teacher.store=on"])]
    return specs


def subprocess_row(cmd: list[str], ctx: Ctx, cap: float) -> dict[str, Any]:
    timeout = max(5.0, min(cap, ctx.left() - 5))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "KDRUN_CACHE_DIR": str(ctx.tmp / "cache")})
    except subprocess.TimeoutExpired:
        return {"status": "fail", "error": f"timed out after {timeout:.0f} s", "cmd": shlex.join(cmd[1:])}
    row = {"status": "pass" if p.returncode == 0 else "fail", "rc": p.returncode,
           "seconds": time.perf_counter() - t0, "cmd": shlex.join(cmd[1:])}
    if p.returncode:
        row["stderr_tail"] = p.stderr[-1500:]
    return row


def kdrun_run(name: str, overrides: list[str], ctx: Ctx) -> dict[str, Any]:
    run_dir = ctx.tmp / "runs" / name
    row = subprocess_row([sys.executable, "-m", "kdrun", *overrides, "train.device=auto",
                          f"cache_dir={ctx.tmp / 'cache'}", f"hydra.run.dir={run_dir}"], ctx, 150)
    results = run_dir / "results.json"
    if row["status"] == "pass" and not (results.exists() and (run_dir / "student").is_dir()):
        row["status"], row["error"] = "fail", "no results.json or student/"
    if row["status"] == "pass":
        row["student_metrics"] = (json.loads(results.read_text()).get("student") or {}).get("metrics")
        row["run_dir"] = str(run_dir)
    return row


def export_row(run: dict[str, Any], ctx: Ctx) -> dict[str, Any]:
    if run.get("status") != "pass":
        return skipped("the GPU-trained quickstart run did not finish")
    out = ctx.tmp / "export"
    row = subprocess_row([sys.executable, "-c", "import sys; from kdrun.app.export import main; sys.exit(main())",
                          run["run_dir"], "--format", "onnx",
                          "--max-rows", "64", "--out", str(out)], ctx, 120)
    row["files"] = sorted(p.name for p in out.glob("*")) if out.is_dir() else []
    if row["status"] == "pass" and not any(f.endswith(".onnx") for f in row["files"]):
        row["status"], row["error"] = "fail", "no .onnx file written"
    if (out / "export.json").exists():  # the export's own comparison with the PyTorch student
        row["export"] = json.loads((out / "export.json").read_text())
    return row


def doctor_row(ctx: Ctx) -> dict[str, Any]:
    out = ctx.tmp / "doctor.json"
    row = subprocess_row([sys.executable, "-c", "import sys; from kdrun.app.doctor import main; sys.exit(main())",
                          "--out", str(out)], ctx, 240)
    if out.exists():
        row["doctor"] = json.loads(out.read_text())
    return row


def check_runs(ctx: Ctx) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for name, overrides in run_specs(ctx):
        rows[name] = guarded(lambda n=name, o=overrides: kdrun_run(n, o, ctx), ctx, 10)
    if ctx.fast:
        for name in ("quickstart_bf16", "quickstart_fp16", "squad_tiny", "general_tiny", "dynabert_tiny",
                     "teacher_store", "export", "doctor"):
            rows[name] = skipped("left out in --fast mode")
    else:
        if not (DATA / "squad" / "dev-v1.1.json").exists():
            rows["squad_tiny"] = skipped(f"no SQuAD v1.1 dev file under {DATA}")
        rows["export"] = guarded(lambda: export_row(rows["quickstart_bf16"], ctx), ctx, 10)
        rows["doctor"] = guarded(lambda: doctor_row(ctx), ctx, 20)
    return {"passed": all(r["status"] != "fail" for r in rows.values()), "rows": rows}


# ------------------------------------------------------------------------------------------ driver

# (name, function, budget in seconds on the GPU, in --fast mode); the GPU budgets add up to 460 s
CHECKS: list[tuple[str, Callable[[Ctx], dict], float, float]] = [
    ("throughput", check_throughput, 210, 45),
    ("exactness", check_exactness, 35, 20),
    ("syncs", check_syncs, 25, 10),
    ("fp16", check_fp16, 10, 10),
    ("runs", check_runs, 180, 60),
]


def run_check(name: str, fn: Callable[[Ctx], dict], budget: float, ctx: Ctx) -> dict[str, Any]:
    """The check's figures, ``status`` (pass / fail / skipped) and seconds; an exception or a timeout is a fail."""
    ctx.budget, ctx.started = budget, time.perf_counter()
    try:
        with alarm(budget + 10):  # the check's own sub-budgets come first; this stops a stuck one
            out = fn(ctx)
        out.setdefault("status", "pass" if out.pop("passed") else "fail")
        out.pop("passed", None)
    except Exception as e:  # noqa: BLE001 - recorded; the next check still runs
        out = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:800], "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = time.perf_counter() - ctx.started
    out["budget_s"] = budget
    return {"check": name, **out, "meta": ctx.meta}


def meta(argv: list[str]) -> dict[str, Any]:
    import torch

    return {"device": device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join([sys.executable, "scripts/gpu_check.py", *argv])}


def headline(r: dict[str, Any]) -> str:
    """One cell's summary of a check."""
    if r.get("error"):
        return r["error"][:70]
    if r.get("reason"):
        return r["reason"][:70]
    rows = r.get("rows", {})
    if r["check"] == "throughput":
        return ", ".join(f"{n} {v['eager'].get('tokens_per_s', 0):,.0f}" for n, v in rows.items()) + " tok/s eager"
    if r["check"] == "exactness":
        return ", ".join(f"{n} {m}: {v.get('grad_norm_rel_diff', float('nan')):.1e}"
                         for n, ms in rows.items() for m, v in ms.items()) + " (grad rel diff)"
    if r["check"] == "runs":
        return ", ".join(f"{n} {v['status']}" for n, v in rows.items() if v["status"] != "skipped") or "-"
    return json.dumps({k: v for k, v in r.items() if k not in ("check", "status", "meta", "seconds", "budget_s")})[:70]


def throughput_table(r: dict[str, Any]) -> list[str]:
    lines = ["", "| objective | mode | tokens/s | ms/step | TFLOP/s | of peak | ATen ops |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, modes in r.get("rows", {}).items():
        ops = modes.get("aten_ops", {}).get("ops", "-")
        for mode in ("eager", "compiled", "graphed"):
            v = modes.get(mode, {})
            if v.get("status") != "pass":
                lines.append(f"| {name} | {mode} | {v.get('status', '-')} | | | | {ops} |")
                continue
            frac = f"{v['peak_fraction']:.1%}" if v.get("peak_fraction") is not None else "-"
            lines.append(f"| {name} | {mode} | {v['tokens_per_s']:,.0f} | {v['ms_per_step']:.1f} | "
                         f"{v['achieved_tflop_s']:.3g} | {frac} | {ops} |")
    return lines


def table(results: list[dict[str, Any]]) -> str:
    m = results[0]["meta"]
    lines = [f"{m['device']} · torch {m['torch']} · {m['date']}", "", "| check | status | seconds | figures |",
             "|---|---|---:|---|"]
    lines += [f"| {r['check']} | {r['status']} | {r['seconds']:.1f} | {headline(r)} |" for r in results]
    return "\n".join(lines + throughput_table(results[0]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="tiny shapes and one tiny run (CPU, tests)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default docs/data/gpu/<date>-<device>.json)")
    ap.add_argument("--checks", default=",".join(c[0] for c in CHECKS), help="comma-separated subset, in order")
    ap.add_argument("--reference", type=Path, default=None, help=argparse.SUPPRESS)  # the exactness check's fp64 run
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.reference is not None:
        write_reference(args.reference, args.fast)
        return 0
    import torch

    info = meta(argv)
    out = args.out or REPO / "docs" / "data" / "gpu" / f"{info['date'][:10]}-{slug(info['device'])}.json"
    wanted = args.checks.split(",")
    with tempfile.TemporaryDirectory(prefix="kdrun-gpu-check-") as tmp:
        ctx = Ctx(args.fast, "cuda" if torch.cuda.is_available() else "cpu", Path(tmp), info)
        results = []
        for name, fn, budget, fast_budget in CHECKS:
            if name in wanted:
                print(f"[{name}] ...", flush=True)
                results.append(run_check(name, fn, fast_budget if args.fast else budget, ctx))
                print(f"[{name}] {results[-1]['status']} in {results[-1]['seconds']:.1f} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": info, "fast": args.fast, "checks": results}, indent=1, default=str))
    print(table(results))
    print(f"wrote {out}")
    return 1 if any(r["status"] == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
