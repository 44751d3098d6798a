"""A sweep with and without the teacher-output store, in one invocation: wall time and teacher forwards.

    python scripts/bench_store.py --glue <GLUE dir>           # SST-2, mini_glue settings, 3 seeds x 4 objectives
    python scripts/bench_store.py --fast                      # tiny models on the toy task (the tests)

Each run of the sweep is its own ``kdrun`` process, as in a multirun: first every (objective, seed)
with ``teacher.store=off`` (the teacher runs for every batch of every epoch), then the same runs
with ``teacher.store=on`` starting from an empty store (the sweep pays for building it). The
teacher is fine-tuned once beforehand and shared (the cache's other kinds are linked into the
bench's cache; only ``teacher_outputs`` starts empty). Prints per mode the wall time of the sweep,
the teacher's forward rows (``teacher_forward`` in each results.json), the store entries built,
and the speed-up. The students' dev scores are printed per mode as a check that both sweeps train
the same students (fp16 store: equal to rounding, not bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FAST = ["task=toy", "task.toy.num_train=160", "task.toy.num_validation=64", "teacher=tiny_random",
        "student=tiny_random", "teacher.finetune.epochs=1", "logger=none"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--glue", help="GLUE root (its SST-2/ directory is used)")
    p.add_argument("--out", default="outputs/bench_store")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/kdrun"), help="the cache holding the teacher")
    p.add_argument("--objectives", default="logit,tinybert,minilm,ckd")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--teacher-max-train-samples", default="8000",
                   help="the SST-2 teacher's training rows (task.teacher_max_train_samples)")
    p.add_argument("--fast", action="store_true", help="tiny models on the toy task, 2 objectives x 2 seeds")
    p.add_argument("--extra", action="append", default=[], help="any further kdrun override (repeatable)")
    args = p.parse_args(argv)
    if args.fast:
        args.objectives, args.seeds = "logit,minilm", "1,2"
    elif not args.glue:
        p.error("--glue is required (or --fast)")
    return args


def base_overrides(args: argparse.Namespace) -> list[str]:
    if args.fast:
        return [*FAST, *args.extra]
    return ["experiment=mini_glue", "task=sst2", f"task.data_dir={Path(args.glue) / 'SST-2'}",
            f"task.teacher_max_train_samples={args.teacher_max_train_samples}", *args.extra]


def bench_cache(args: argparse.Namespace, out: Path) -> Path:
    """A cache sharing every kind of ``--cache`` but an empty ``teacher_outputs``."""
    cache, src = out / "cache", Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    src.mkdir(parents=True, exist_ok=True)
    for kind in ("teachers", "tokenized", "chunkers", "augmented"):
        (src / kind).mkdir(exist_ok=True)
        if not (cache / kind).exists():
            (cache / kind).symlink_to((src / kind).resolve(), target_is_directory=True)
    return cache


def kdrun(overrides: list[str], check: bool = True) -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", *overrides], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"kdrun {' '.join(overrides)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def sweep(args: argparse.Namespace, mode: str, cache: Path, out: Path) -> dict:
    t0, rows, scores = time.perf_counter(), 0, []
    for objective in args.objectives.split(","):
        for seed in args.seeds.split(","):
            run_dir = out / mode / f"{objective}-{seed}"
            kdrun([*base_overrides(args), f"objective={objective}", f"seed={seed}", f"teacher.store={mode}",
                   f"cache_dir={cache}", f"output_dir={run_dir}"])
            res = json.loads((run_dir / "results.json").read_text())
            rows += res["teacher_forward"]["rows"]
            sel = res["student"]["selected"]
            scores.append(sel["value"] if sel["value"] is not None else float("nan"))
        print(f"[bench_store] {mode}: {objective} done ({time.perf_counter() - t0:.0f}s)", flush=True)
    built = [p for p in (cache / "teacher_outputs").glob("*") if p.is_dir() and not p.name.startswith(".")]
    return {"wall_s": time.perf_counter() - t0, "teacher_rows": rows, "entries": len(built),
            "runs": len(scores), "score": statistics.fmean(scores)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    cache = bench_cache(args, out)
    print("[bench_store] the teacher (fine-tuned once, shared by both sweeps)", flush=True)
    kdrun([*base_overrides(args), "objective=logit", "seed=0", "teacher.store=off", f"cache_dir={cache}",
           f"output_dir={out / 'teacher'}", "train.stop_after_steps=1"], check=False)  # stops after one step
    res = {mode: sweep(args, mode, cache, out) for mode in ("off", "on")}
    print(f"\n{'store':6} {'runs':>5} {'wall s':>8} {'teacher fwd rows':>17} {'entries':>8} {'mean dev':>9}")
    for mode, r in res.items():
        print(f"{mode:6} {r['runs']:>5} {r['wall_s']:>8.1f} {r['teacher_rows']:>17} {r['entries']:>8} "
              f"{r['score']:>9.4f}")
    speedup = res["off"]["wall_s"] / res["on"]["wall_s"]
    print(f"speed-up of the sweep with the store: {speedup:.2f}x; teacher forward rows "
          f"{res['off']['teacher_rows']} -> {res['on']['teacher_rows']}")
    (out / "bench_store.json").write_text(json.dumps({**res, "speedup": speedup}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
