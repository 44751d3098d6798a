"""kdrun-doctor: a self-check to run on a (GPU) node before a sweep.

    kdrun-doctor [--quick] [--out FILE]     (default: <cache dir>/kdrun-doctor.json, else a temporary directory)

Checks, one printed line each: the torch / CUDA build and devices and what ``train.precision=auto``
becomes; an all-reduce across the visible GPUs (NCCL, with two or more of them) or between two CPU
processes (gloo); one training step of each student kind (truncated first) built as a run builds it,
in every precision, asserting fp32 master weights and no update lost to rounding
(kdrun.app.doctor_students); one training step of every objective that runs on a labelled task, through kdrun's
own engine (kdrun.engine.trainer.train_step), in every precision that applies, each loss compared with the
fp32 one; and throughput and peak memory of a bert_base-shaped teacher distilled into a 4-layer, 312-wide
student (random weights, no download) with logit KD and with CKD, with the ATen ops one step dispatches
(kdrun.runtime.ops). Everything is also written to a JSON file. Exit status 0 when every check that applies
passed, 1 otherwise.
``--quick`` shrinks the throughput models to a tiny shape (CPU, tests).

    kdrun-doctor --device-check --out DIR [--fast] [--budget-s N] [--tokenizer DIR]

runs the GPU measurements of kdrun.app.device_check instead, each check in its own process group.
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any, Callable

import torch

from kdrun.app.doctor_steps import (
    BERT_BASE,
    PRECISION_LABEL,
    QUICK_STUDENT,
    QUICK_TEACHER,
    STUDENT_4_312,
    EngineStep,
    Shape,
    bert,
    check_precision_steps,
    compose_objectives,
    fixed_batch,
    precisions_for,
    set_attention,
)
from kdrun.runtime.cache import write_json_atomic
from kdrun.runtime.ops import OpCounter

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
        # no gradient-norm recording: its host read every step would time the syncs, not the step
        step = EngineStep({"teacher": t, "student": s, "objective": obj}, plans[0], prec, device, cfg.train, Path(tmp),
                          record_grads=False)
        return time_steps(step, fixed_batch(batch, tokens, vocab, ragged=False), steps, warmup) | {
            "precision": PRECISION_LABEL[prec], "device": device}


def time_steps(step: EngineStep, batch: dict[str, torch.Tensor], steps: int, warmup: int,
               count_ops: bool = True) -> dict[str, Any]:
    """Per step over ``steps`` steps after ``warmup`` (one sync before and one after the timed block, no
    host read inside it): time, tokens/s (the mask's tokens), peak memory, finite losses and, with
    ``count_ops``, the ATen ops of one more step (None without)."""
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
    ops = OpCounter() if count_ops else None
    if ops is not None:
        with ops:  # one more step, untimed: the ATen ops (kernels) a step dispatches
            step(batch)
        sync()
    tokens = int(batch["attention_mask"].sum())
    return {"step_ms": secs * 1e3, "tokens_per_s": tokens / secs, "peak_bytes": peak_memory(dev),
            "peak_bytes_before_steps": before, "loss_finite": all(math.isfinite(float(x)) for x in losses),
            "ops_per_step": ops.count if ops is not None else None}


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
    return (f"{r['tokens_per_s']:.0f} tokens/s, step {r['step_ms']:.1f} ms, {r['ops_per_step']} ATen ops, "
            f"{mem} {r['peak_bytes'] / 2**20:.0f} MiB "
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

DESCRIPTION = """\
Check a node before a sweep; one printed line per check:

  environment     the torch and CUDA build, the GPUs, native bf16, what train.precision=auto becomes
  all-reduce      NCCL across the visible GPUs (two or more), else gloo between two CPU processes
  student kinds   one training step of each kind of student (truncated, a bf16-saved pretrained
                  checkpoint, a random config, a corpus student) in each mixed precision: fp32
                  master weights, no update lost to rounding
  objectives      one training step of every objective for labelled tasks in every precision that
                  applies, each loss within 5 % of fp32's, finite gradients
  throughput      tokens/s, peak memory and ATen ops of one step distilling a BERT-base-shaped
                  teacher into a 4-layer, 312-wide student with logit KD and with CKD (random
                  weights, nothing downloaded)

Everything is also written as JSON (--out). Exit status 0 when every check that applies passed,
1 otherwise.

--device-check --out DIR runs the GPU measurements instead (docs/speed.md, "The device check"): the training
step's tokens/s eager, compiled and graphed at the papers' shape, CKD and MGSKD against an fp64
reference, real runs per step mode, tiny runs and kdrun-export; each check in its own process
group under a hard timeout and a total budget, one JSON line each in DIR/device_check.jsonl."""
REPORT_NAME = "kdrun-doctor.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kdrun-doctor", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help=f"the JSON report (default: {REPORT_NAME} in the cache directory, $KDRUN_CACHE_DIR or "
                         "~/.cache/kdrun, else in a new temporary directory; the path is printed); with "
                         "--device-check: the folder of its JSON lines (required)")
    ap.add_argument("--quick", action="store_true", help="a tiny shape for the throughput check (CPU, tests)")
    from kdrun.app.device_check import add_arguments

    add_arguments(ap)
    return ap.parse_args(argv)


def default_out() -> Path:
    """``kdrun-doctor.json`` in the cache directory when it can be written, else in a new temporary one."""
    from kdrun.runtime.cache_cli import default_cache_dir

    cache = default_cache_dir().expanduser()
    with contextlib.suppress(OSError):
        cache.mkdir(parents=True, exist_ok=True)
    if cache.is_dir() and os.access(cache, os.W_OK | os.X_OK):
        return cache / REPORT_NAME
    return Path(tempfile.mkdtemp(prefix="kdrun-doctor-")) / REPORT_NAME


def main(argv: list[str] | None = None) -> int:
    from kdrun.app.doctor_students import check_student_kinds

    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.device_check:
        from kdrun.app import device_check

        return device_check.main(args, sys.argv[1:] if argv is None else list(argv))
    t0 = time.perf_counter()
    report = Report()
    device = check_environment(report)
    check_collectives(report, device)
    check_student_kinds(report, device, precisions_for(device))
    check_precision_steps(report, device)
    check_throughput(report, args.quick, device)
    out = args.out or default_out()
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
