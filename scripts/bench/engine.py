"""Training-step engine benchmark, in one run on the same batches and models:

(a) tokens/s of kdrun's training step (kdrun.engine.trainer.train_step: models under autocast, the
    objective outside it in fp32, the teacher under no_grad in the training dtype, no host read in
    the step) against a naive step written here the way it used to be done: everything under
    autocast including the loss, the teacher under inference_mode with every feature cloned,
    ``if not torch.isfinite(loss)``, ``float()`` of every term and of the loss, and
    ``int(mask.sum())`` on every step;
(b) device->host syncs per step of both, counted with kdrun.runtime.syncs.SyncCounter;
(c) the step time of every relation objective (stage 0: its relation stage) as a ratio of a
    logit-KD step (objective=logit); goal <= 1.25x.

    python scripts/bench/engine.py [--fast] [--precisions fp32,bf16] [--relations-precision fp32]
                                   [--threads N] [--json out.json]

(a) and (b) run in each of ``--precisions`` (bf16 / fp16: the models under autocast; on a CPU
without native bf16 these steps are several times slower, so they get fewer timed rounds), (c) in
``--relations-precision``. Steps are timed in rounds that alternate between the contenders, and
each one's median step time is kept, so that load from other processes hits all of them alike.
``--fast``: tiny models, a few steps (seconds; used by the tests).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from kdrun.runtime import harness

harness.offline()

import torch  # noqa: E402

from kdrun.app.doctor import EngineStep, Shape, bert, compose_objectives, fixed_batch, set_attention  # noqa: E402
from kdrun.models.features import Features, model_inputs  # noqa: E402
from kdrun.runtime.syncs import SyncCounter  # noqa: E402

RELATIONS = ("ckd", "ckd_official", "mgskd", "minilm", "tinybert")
GOAL = 1.25
PRECISIONS = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------- the setup

def sizes(fast: bool) -> dict[str, Any]:
    """Model shapes, batches and timing rounds. Widths divisible by MGSKD's 64 relation heads; equal
    head counts (MiniLM, TinyBERT's attention loss)."""
    if fast:
        return {"teacher": Shape(2, 64, 4, 128), "student": Shape(2, 64, 4, 128), "batch": 4, "tokens": 32,
                "vocab": 500, "batches": 2, "steps": 2, "rounds": 1, "warmup": 1, "sync_steps": 2,
                "half": {}}
    return {"teacher": Shape(6, 256, 4, 1024), "student": Shape(3, 128, 4, 512), "batch": 16, "tokens": 64,
            "vocab": 8000, "batches": 4, "steps": 4, "rounds": 5, "warmup": 2, "sync_steps": 4,
            "half": {"steps": 2, "rounds": 3, "warmup": 1, "sync_steps": 2}}


def make_batches(sz: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Ragged batches (rows of decreasing length, shuffled between batches), each its own seed."""
    out = []
    for i in range(sz["batches"]):
        b = fixed_batch(sz["batch"], sz["tokens"], sz["vocab"], seed=i)
        perm = torch.randperm(sz["batch"], generator=torch.Generator().manual_seed(i))
        out.append({k: v[perm] for k, v in b.items()})
    return out


def base_models(sz: dict[str, Any]) -> dict[str, torch.nn.Module]:
    return {"teacher": bert(sz["teacher"], sz["vocab"], seed=1),
            "student": bert(sz["student"], sz["vocab"], seed=2, dropout=0.1)}


def objective_of(name: str, cfg: Any, base: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(stage 0's plan, models for it): the shared models with the attention the objective needs,
    and its loss module."""
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec

    plans = plan_stages(cfg.objective)
    teacher, student = copy.deepcopy(base["teacher"]), copy.deepcopy(base["student"])
    set_attention(teacher, plans, "teacher")
    set_attention(student, plans, "student")
    torch.manual_seed(3)
    obj = Objective(plans, MappingSpec.from_config(cfg.mapping, seed=0), 2, describe(student), describe(teacher))
    return plans[0], {"teacher": teacher, "student": student, "objective": obj}


def engine(name: str, cfg: Any, base: dict[str, Any], prec: str, run_dir: Path) -> EngineStep:
    plan, models = objective_of(name, cfg, base)
    return EngineStep(models, plan, prec, "cpu", cfg.train, run_dir, record_grads=False)


# ------------------------------------------------------------------------------ the naive step

def naive_features(model: torch.nn.Module, batch: dict[str, torch.Tensor], needs: frozenset[str]) -> Features:
    out = model(**model_inputs(batch, model), output_hidden_states="hidden_states" in needs,
                output_attentions="attentions" in needs, return_dict=True)
    return Features(logits=out.logits, attention_mask=batch["attention_mask"],
                    hidden_states=tuple(out.hidden_states) if "hidden_states" in needs else None,
                    attentions=tuple(out.attentions) if "attentions" in needs else None)


def cloned(f: Features) -> Features:
    """Every feature copied out of inference mode, so the student's graph can use it."""
    return Features(logits=f.logits.clone(), attention_mask=f.attention_mask,
                    hidden_states=tuple(h.clone() for h in f.hidden_states) if f.hidden_states else None,
                    attentions=tuple(a.clone() for a in f.attentions) if f.attentions else None)


class NaiveStep:
    """The old way: one autocast region around models and loss; host reads every step."""

    def __init__(self, eng: EngineStep, prec: str):
        from kdrun.engine.trainer import make_optimizer

        self.student = copy.deepcopy(eng.parts.student)
        self.teacher = eng.parts.teacher  # the same frozen model, never modified by a step
        self.objective = copy.deepcopy(eng.parts.objective)
        self.plan, self.cfg = eng.loop.plan, eng.parts.train_cfg
        self.optimizer = make_optimizer(SimpleNamespace(student=self.student, objective=self.objective,
                                                        train_cfg=self.cfg), self.plan)
        self.dtype = DTYPES[prec]
        self.scaler = torch.amp.GradScaler("cpu") if prec == "fp16" else None
        self.step_no, self.logs = 0, {}

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast("cpu", dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            s = naive_features(self.student, batch, self.plan.student_needs)
            with torch.inference_mode():
                t = naive_features(self.teacher, batch, self.plan.teacher_needs)
            return self.objective(self.plan.index, s, cloned(t), batch, step=self.step_no)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss, values = self.forward(batch)
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss became {float(loss)} at step {self.step_no}")
        self.logs = {**{k: float(v) for k, v in values.items()}, "loss": loss.item(),
                     "tokens": int(batch["attention_mask"].sum())}
        self.update(loss)
        self.step_no += 1
        return loss.detach()

    def update(self, loss: torch.Tensor) -> None:
        params = [p for p in (*self.student.parameters(), *self.objective.parameters()) if p.requires_grad]
        if self.scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------ measuring

def timed_rounds(steps: dict[str, Callable], batches: list[dict], sz: dict[str, Any]) -> dict[str, float]:
    """Median seconds per step of each contender, timed in alternating rounds after a warmup."""
    for fn in steps.values():
        for b in batches[: sz["warmup"]]:
            fn(b)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(sz["rounds"]):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            for i in range(sz["steps"]):
                b = batches[(r * sz["steps"] + i) % len(batches)]
                t0 = time.perf_counter()
                steps[name](b)
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def syncs_per_step(fn: Callable, batches: list[dict], n: int) -> tuple[float, dict[str, int]]:
    """Syncs per step over ``n`` steps, and how many of each kind."""
    with SyncCounter() as c:
        for i in range(n):
            fn(batches[i % len(batches)])
    kinds: dict[str, int] = {}
    for name, _ in c.events:
        kinds[name] = kinds.get(name, 0) + 1
    return c.count / n, kinds


def engine_vs_naive(cfgs: dict[str, Any], base: dict, batches: list[dict], sz: dict, prec: str, objective: str,
                    run_dir: Path) -> dict[str, Any]:
    eng = engine(objective, cfgs[objective], base, prec, run_dir)
    naive = NaiveStep(eng, prec)
    sz = {**sz, **(sz["half"] if prec != "no" else {})}
    secs = timed_rounds({"kdrun": eng, "naive": naive}, batches, sz)
    tokens = statistics.mean(int(b["attention_mask"].sum()) for b in batches)
    out = {k: {"step_ms": v * 1e3, "tokens_per_s": tokens / v} for k, v in secs.items()}
    for k, fn in (("kdrun", eng), ("naive", naive)):
        out[k]["syncs_per_step"], out[k]["sync_kinds"] = syncs_per_step(fn, batches, sz["sync_steps"])
    out["speedup"] = out["kdrun"]["tokens_per_s"] / out["naive"]["tokens_per_s"]
    return out


def relation_ratios(cfgs: dict[str, Any], base: dict, batches: list[dict], sz: dict, prec: str,
                    run_dir: Path) -> dict[str, Any]:
    steps = {name: engine(name, cfgs[name], base, prec, run_dir) for name in ("logit", *RELATIONS)}
    secs = timed_rounds(steps, batches, sz)
    return {name: {"step_ms": s * 1e3, "ratio": s / secs["logit"]} for name, s in secs.items()}


# ------------------------------------------------------------------------------------- printing

def print_engine(r: dict[str, Any], objective: str, prec: str) -> None:
    print(f"\n(a) objective={objective}, {prec}: kdrun's step vs the naive step")
    print(f"{'step':<8} {'tokens/s':>10} {'ms/step':>9} {'syncs/step':>11}  sync kinds")
    for k in ("kdrun", "naive"):
        x = r[k]
        kinds = ", ".join(f"{n} x{c}" for n, c in sorted(x["sync_kinds"].items())) or "-"
        print(f"{k:<8} {x['tokens_per_s']:>10.0f} {x['step_ms']:>9.1f} {x['syncs_per_step']:>11.1f}  {kinds}")
    print(f"throughput ratio kdrun / naive: {r['speedup']:.2f}x")
    print(f"(b) {prec}, syncs per step: kdrun {r['kdrun']['syncs_per_step']:g}, naive {r['naive']['syncs_per_step']:g}")


def print_ratios(r: dict[str, Any], prec: str) -> None:
    print(f"\n(c) relation objectives, step time / logit-KD step ({prec}; goal <= {GOAL}x)")
    for name, x in r.items():
        verdict = "" if name == "logit" else ("  ok" if x["ratio"] <= GOAL else "  above goal")
        print(f"{name:<14} {x['step_ms']:>8.1f} ms  ratio {x['ratio']:.3f}x{verdict}")


def header(sz: dict[str, Any]) -> str:
    t, s = sz["teacher"], sz["student"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"teacher {t.layers}x{t.hidden} ({t.heads} heads), student {s.layers}x{s.hidden}, batches of "
            f"{sz['batch']}x{sz['tokens']} tokens (ragged), torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s), {os.cpu_count()} CPU(s), load average {load:.2f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--fast", action="store_true", help="tiny models, a few steps (seconds)")
    ap.add_argument("--precisions", default="fp32,bf16", help="precisions of (a) and (b), comma-separated")
    ap.add_argument("--relations-precision", choices=list(PRECISIONS), default="fp32")
    ap.add_argument("--objective", default="ckd", help="objective of (a) and (b) (logits / hidden states only)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 with --fast)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.precisions = args.precisions.split(",")
    if not set(args.precisions) <= set(PRECISIONS):
        ap.error(f"--precisions: choose among {', '.join(PRECISIONS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads or args.fast:  # tiny models only lose time to thread hand-offs
        torch.set_num_threads(args.threads or 1)
    sz = sizes(args.fast)
    print(header(sz), flush=True)
    cfgs = compose_objectives(sorted({"logit", args.objective, *RELATIONS}))
    base, batches = base_models(sz), make_batches(sz)
    out: dict[str, Any] = {"setup": header(sz), "engine_vs_naive": {}}
    with tempfile.TemporaryDirectory(prefix="kdrun-bench-") as tmp:
        for name in args.precisions:
            ab = engine_vs_naive(cfgs, base, batches, sz, PRECISIONS[name], args.objective, Path(tmp))
            print_engine(ab, args.objective, name)
            out["engine_vs_naive"][name] = ab
        out["relations"] = relation_ratios(cfgs, base, batches, sz, PRECISIONS[args.relations_precision], Path(tmp))
        print_ratios(out["relations"], args.relations_precision)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
