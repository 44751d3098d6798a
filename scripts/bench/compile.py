"""Compiled against eager training steps, per objective, in one run: tokens/s of each and the ratio.

Each objective's first stage runs kdrun's own engine step (kdrun.app.doctor_steps.EngineStep:
teacher forward, student forward and backward, optimizer step; gradient-norm recording off) on
random models, once with the forward region eager and once compiled as ``train.compile=true``
compiles it (kdrun.engine.compiled: student forward, teacher forward and loss as one graph;
``--backend``, inductor by default). The compiled side's first steps (the compilation) are not
timed; the compile time is printed beside. Both sides run the same batches, and the losses of the
timed steps are compared.

    python scripts/bench/compile.py [--objectives logit,ckd] [--teacher 6x384] [--student 3x384]
                                    [--batch 32] [--tokens 128] [--steps 10] [--json out.json]

Default shape: the CPU study's (a 6 x 384 teacher, as all-MiniLM-L6-v2, into a 3 x 384 student,
batches of 32 x 128). ``--fast``: tiny models and the aot_eager backend (seconds; used by the tests).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kdrun.runtime import harness

harness.offline()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--objectives", default="logit,ckd")
    p.add_argument("--teacher", default="6x384", help="layers x hidden (heads: hidden / 64)")
    p.add_argument("--student", default="3x384")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--json", default=None)
    p.add_argument("--fast", action="store_true")
    args = p.parse_args(argv)
    if args.fast:
        args.teacher, args.student, args.batch, args.tokens, args.steps, args.backend = \
            "2x64", "1x64", 4, 16, 2, "aot_eager"
    return args


def shape(text: str):
    from kdrun.app.doctor_steps import Shape

    layers, hidden = (int(x) for x in text.split("x"))
    return Shape(layers, hidden, max(1, hidden // 64), 4 * hidden)


def side(cfg, args: argparse.Namespace, mode: str) -> dict:
    """One side's timings: compile seconds (the first steps), seconds per timed step, its losses."""
    import torch

    from kdrun.app.doctor_steps import EngineStep, fixed_batch, objective_models
    from kdrun.engine.compiled import StepForward

    torch._dynamo.reset()
    plans, models = objective_models(cfg, shape(args.teacher), shape(args.student))
    step = EngineStep(models, plans[0], "no", "cpu", cfg.train, Path("."), record_grads=False)
    step.loop.forward = StepForward(step.parts, plans[0], mode, args.backend)
    batch = fixed_batch(args.batch, args.tokens, 100, ragged=False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    step(batch)  # the first step: the compilation on the compiled side, lazy optimizer state on both
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    losses = [float(step(batch)) for _ in range(args.steps)]
    per_step = (time.perf_counter() - t0) / args.steps
    return {"first_step_s": first, "s_per_step": per_step, "tokens_per_s": args.batch * args.tokens / per_step,
            "losses": losses, "compilations": step.loop.forward.compilations}


def main(argv: list[str] | None = None) -> int:
    import torch

    from kdrun.app.doctor_steps import compose_objectives

    args = parse_args(argv)
    names = args.objectives.split(",")
    cfgs = compose_objectives(names)
    rows = {}
    print(f"teacher {args.teacher}, student {args.student}, batch {args.batch} x {args.tokens}, "
          f"{torch.get_num_threads()} threads, backend {args.backend}, {args.steps} timed steps per side")
    print(f"{'objective':<10} {'eager tok/s':>12} {'compiled tok/s':>15} {'ratio':>6} {'compile s':>10} "
          f"{'max |loss diff|':>16}")
    for name in names:
        eager, compiled = side(cfgs[name], args, "eager"), side(cfgs[name], args, "compiled")
        diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
        ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
        rows[name] = {"eager": eager, "compiled": compiled, "ratio": ratio, "max_loss_diff": diff}
        print(f"{name:<10} {eager['tokens_per_s']:>12,.0f} {compiled['tokens_per_s']:>15,.0f} {ratio:>5.2f}x "
              f"{compiled['first_step_s']:>10.1f} {diff:>16.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
