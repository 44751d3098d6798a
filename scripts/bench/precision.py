"""The quickstart under bf16 and fp16 autocast (CPU stand-ins of the GPU paths) beside fp32: the
student's dev accuracy per precision and seed, and each mixed precision's difference from fp32 with
the dev set's noise (two binomial standard errors of the fp32 accuracy).

    python scripts/bench/precision.py [--seeds 0 1] [--out DIR] [--fast]

Each run is ``kdrun experiment=quickstart train.precision=P train.seed=S logger=none``: the teacher
is fine-tuned (and cached) in the same precision, the student is the default truncated one, as a
user's run on a GPU would be. ``--fast``: tiny random models on a small toy task (tests). The runs
are forked from a process that imported kdrun's libraries once (kdrun.runtime.forkrun): the seconds
reported are the run's own (``timings.total_s`` of its results), which start after the imports.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

from kdrun.runtime import forkrun, harness

PRECISIONS = ("fp32", "bf16", "fp16")
FAST = ["teacher=tiny_random", "student.num_layers=1", "task.toy.num_train=96", "task.toy.num_validation=48",
        "teacher.finetune.epochs=1", "train.epochs=1"]


def run_one(out: Path, precision: str, seed: int, fast: bool) -> dict:
    run_dir = out / f"{precision}-seed{seed}"
    args = ["experiment=quickstart", f"train.precision={precision}", f"train.seed={seed}", "logger=none",
            f"output_dir={run_dir}", f"cache_dir={out / 'cache'}", *(FAST if fast else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    r = forkrun.run(args, env)
    if r.returncode != 0:
        raise SystemExit(f"kdrun {' '.join(args)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    res = json.loads((run_dir / "results.json").read_text())
    return {"precision": precision, "seed": seed, "accuracy": res["student"]["metrics"]["validation"]["accuracy"],
            "teacher": res["teacher"]["metrics"]["validation"]["accuracy"], "rows": res["config"]["task"]["toy"]
            ["num_validation"], "seconds": res["timings"]["total_s"]}


def table(rows: list[dict]) -> list[str]:
    by = {p: [r for r in rows if r["precision"] == p] for p in PRECISIONS}
    ref = statistics.mean(r["accuracy"] for r in by["fp32"])
    n = by["fp32"][0]["rows"]
    noise = 2 * math.sqrt(max(ref * (1 - ref), 1e-12) / n)
    lines = ["precision  student accuracy (mean ± std, n)  teacher  diff vs fp32  within noise (2 SE = "
             f"{noise:.4f})"]
    for p, rs in by.items():
        acc = [r["accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        diff = statistics.mean(acc) - ref
        teacher = statistics.mean(r["teacher"] for r in rs)
        lines.append(f"{p:9}  {statistics.mean(acc):.4f} ± {sd:.4f} (n={len(acc)})"
                     f"{'':14}{teacher:.4f}   {diff:+.4f}       {'yes' if abs(diff) <= noise else 'NO'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_precision"))
    ap.add_argument("--fast", action="store_true", help="tiny models and data (tests)")
    args = ap.parse_args(argv)
    rows = [run_one(args.out, p, s, args.fast) for s in args.seeds for p in PRECISIONS]
    lines = table(rows)
    print("\n".join(lines))
    (args.out / "bench_precision.json").write_text(json.dumps({"rows": rows, "table": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
