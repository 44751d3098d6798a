"""ATen ops dispatched by one training step of each objective, as a table with the ratio to logit KD.

Each objective's first stage runs two eager fp32 steps of kdrun's own engine
(kdrun.app.doctor_steps.step_ops: forward passes, backward, optimizer step, gradient-norm recording
off) on random models at the papers' shape: a BERT-base-shaped teacher (12 x 768) distilled into a
4 x 312 student, batches of 32 x 128 tokens (ragged); the second step is counted with
kdrun.runtime.ops.OpCounter (views and other metadata-only ops left out). The angle kernel chunks
its work as on a GPU (``--chunks cuda``, the default), so the count is the kernels a GPU step
launches, whatever runs the count. On a GPU such a step is bound by kernel launches: the ratio to
logit KD is what a relation objective costs over it.

    python scripts/bench/count_ops.py [--fast] [--objectives logit,ckd,...] [--chunks cuda|cpu] [--json out.json]

``--fast``: tiny models (2 x 64 teacher, 2 x 64 student, 4 x 16 tokens; seconds, used by the tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kdrun.runtime import harness

harness.offline()

OBJECTIVES = ("finetune", "logit", "minilm", "tinybert", "mgskd", "ckd", "ckd_official")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--fast", action="store_true", help="tiny models (seconds)")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated; logit is always added")
    ap.add_argument("--chunks", choices=("cuda", "cpu"), default="cuda", help="the angle kernel's chunking")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    return ap.parse_args(argv)


def count(names: list[str], fast: bool, chunks: str) -> dict[str, dict]:
    """{objective: {"ops": count, "top": [(op, count) x 5], "seconds": wall time}}."""
    from kdrun.app.doctor_steps import QUICK_OPS, OpsSetup, compose_objectives, step_ops

    setup = QUICK_OPS if fast else OpsSetup()
    cfgs = compose_objectives(names)
    out = {}
    for name in names:
        t0 = time.perf_counter()
        ops = step_ops(cfgs[name], setup, chunks=chunks)
        out[name] = {"ops": ops.count, "top": ops.by_name.most_common(5), "seconds": time.perf_counter() - t0}
    return out


def table(rows: dict[str, dict]) -> str:
    logit = rows["logit"]["ops"]
    lines = ["| objective | ops per step | × logit |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['ops']:,} | {r['ops'] / logit:.2f} |" for name, r in rows.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(dict.fromkeys(["logit", *[n for n in args.objectives.split(",") if n]]))
    from kdrun.app.doctor_steps import QUICK_OPS, OpsSetup

    s = QUICK_OPS if args.fast else OpsSetup()
    print(f"ATen ops per training step (stage 0, fp32, eager): teacher {s.teacher.layers}x{s.teacher.hidden}, "
          f"student {s.student.layers}x{s.student.hidden}, batch {s.batch}x{s.tokens}, angle kernel chunked as "
          f"on {args.chunks}", flush=True)
    rows = count(names, args.fast, args.chunks)
    print(table(rows))
    for name, r in rows.items():
        print(f"{name}: {r['seconds']:.1f}s; most dispatched: " + ", ".join(f"{o} x{c}" for o, c in r["top"]))
    if args.json:
        args.json.write_text(json.dumps({"fast": args.fast, "chunks": args.chunks, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
