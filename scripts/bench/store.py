"""A sweep with and without the teacher-output store, in one invocation: wall time and teacher forwards.

    python scripts/bench/store.py --glue <GLUE dir>           # BERT-base-shaped teacher -> 4-layer/312 student
    python scripts/bench/store.py --fast                      # tiny models on the toy task (the tests)

The default setting is where the store is meant to pay: a teacher of BERT-base's shape (12 layers x
768, 12 heads; random weights fine-tuned for one epoch on a few rows: the timing does not depend on
what the weights learnt) distilled into a 4-layer, 312-wide student (TinyBERT's shape) on SST-2
(``--train-rows`` rows), a sweep of 2 objectives x 3 seeds.

Each run of the sweep is its own ``kdrun`` process, as in a multirun (with ``--fast`` forked from a
process that imported kdrun's libraries once, kdrun.runtime.forkrun): first every (objective, seed)
with ``teacher.store=off`` (the teacher runs for every batch of every epoch), then the same runs
with ``teacher.store=on`` starting from an empty store (the sweep pays for building it). The
teacher is fine-tuned once beforehand and shared (the cache's other kinds are linked into the
bench's cache; only ``teacher_outputs`` starts empty). Prints per mode the wall time of the sweep,
the teacher's forward rows (``teacher_forward`` in each results.json), the store entries built and
their size, the speed-up, and the read path's share of a stored run's step (gathering a batch from
a cold page cache, to fp32, against the run's mean step time). The students' dev scores are
printed per mode as a check that both sweeps train the same students (fp16 store: equal to
rounding, not bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from kdrun.runtime import forkrun, harness

# BERT-base's shape for the teacher, TinyBERT's 4-layer/312 for the student (random weights)
BERT_BASE = ["teacher=tiny_random", "teacher.name=bert_base_shape", "teacher.hidden_size=768",
             "teacher.num_hidden_layers=12", "teacher.num_attention_heads=12", "teacher.intermediate_size=3072",
             "teacher.finetune.epochs=1", "student=tiny_random", "student.name=tinybert4_shape",
             "student.hidden_size=312", "student.num_hidden_layers=4", "student.num_attention_heads=12",
             "student.intermediate_size=1200", "logger=none"]
FAST = ["task=toy", "task.toy.num_train=160", "task.toy.num_validation=64", "teacher=tiny_random",
        "student=tiny_random", "teacher.finetune.epochs=1", "logger=none"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--glue", help="GLUE root (its SST-2/ directory is used)")
    p.add_argument("--out", default="outputs/bench_store")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/kdrun"), help="the cache holding the teacher")
    p.add_argument("--objectives", default="logit,ckd")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--train-rows", default="4000", help="SST-2 training rows of every run (task.max_train_samples)")
    p.add_argument("--teacher-max-train-samples", default="500",
                   help="the teacher's training rows (task.teacher_max_train_samples; one epoch, for timing only)")
    p.add_argument("--fast", action="store_true", help="tiny models on the toy task, 2 objectives x 1 seed")
    p.add_argument("--extra", action="append", default=[], help="any further kdrun override (repeatable)")
    args = p.parse_args(argv)
    if args.fast:
        args.objectives, args.seeds = "logit,minilm", "1"
    elif not args.glue:
        p.error("--glue is required (or --fast)")
    return args


def base_overrides(args: argparse.Namespace) -> list[str]:
    if args.fast:
        return [*FAST, *args.extra]
    return [*BERT_BASE, "task=sst2", f"task.data_dir={Path(args.glue) / 'SST-2'}", "train.epochs=3",
            f"task.max_train_samples={args.train_rows}", "task.max_eval_samples=872",
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


def kdrun(overrides: list[str], fast: bool, check: bool = True) -> None:
    """``kdrun OVERRIDES``: a new interpreter as a user starts it, or with ``fast`` forked from a process
    that imported kdrun's libraries once (kdrun.runtime.forkrun)."""
    r = forkrun.run(overrides, None if fast else {**os.environ, "KDRUN_FORKRUN": "0"})
    if check and r.returncode != 0:
        raise SystemExit(f"kdrun {' '.join(overrides)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def sweep(args: argparse.Namespace, mode: str, cache: Path, out: Path) -> dict:
    t0, rows, scores, steps = time.perf_counter(), 0, [], []
    for objective in args.objectives.split(","):
        for seed in args.seeds.split(","):
            run_dir = out / mode / f"{objective}-{seed}"
            kdrun([*base_overrides(args), f"objective={objective}", f"seed={seed}", f"teacher.store={mode}",
                   f"cache_dir={cache}", f"output_dir={run_dir}"], args.fast)
            res = json.loads((run_dir / "results.json").read_text())
            rows += res["teacher_forward"]["rows"]
            n = sum(s.get("steps", 0) for s in res["stages"])
            steps.append(res["timings"]["stages_s"] / max(1, n))
            sel = res["student"]["selected"]
            scores.append(sel["value"] if sel["value"] is not None else float("nan"))
        print(f"[bench_store] {mode}: {objective} done ({time.perf_counter() - t0:.0f}s)", flush=True)
    built = [p for p in (cache / "teacher_outputs").glob("*") if p.is_dir() and not p.name.startswith(".")]
    return {"wall_s": time.perf_counter() - t0, "teacher_rows": rows, "entries": len(built),
            "entry_bytes": sum(f.stat().st_size for e in built for f in e.iterdir()),
            "runs": len(scores), "score": statistics.fmean(scores), "step_s": statistics.fmean(steps),
            "read_s_per_batch": read_per_batch(built, batch_size(args))}


def batch_size(args: argparse.Namespace) -> int:
    extra = [e for e in args.extra if e.startswith("objective.params.batch_size=")]
    return int(extra[-1].split("=", 1)[1]) if extra else 32


def read_per_batch(entries: list[Path], batch: int) -> float:
    """Seconds to read one training batch from the largest entry, as a run does (cold page cache,
    gathered, padded, cast to fp32); 0 without entries."""
    import torch

    from kdrun.engine.teacher_store import StoreReader, read_seconds_per_row, sample_rows

    if not entries:
        return 0.0
    big = max(entries, key=lambda e: sum(f.stat().st_size for f in e.iterdir()))
    reader = StoreReader(big)
    return read_seconds_per_row(reader, sample_rows(reader, batch), torch.device("cpu")) * batch


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    cache = bench_cache(args, out)
    print("[bench_store] the teacher (fine-tuned once, shared by both sweeps)", flush=True)
    kdrun([*base_overrides(args), "objective=logit", "seed=0", "teacher.store=off", f"cache_dir={cache}",
           f"output_dir={out / 'teacher'}", "train.stop_after_steps=1"], args.fast, check=False)  # stops after one step
    res = {mode: sweep(args, mode, cache, out) for mode in ("off", "on")}
    print(f"\n{'store':6} {'runs':>5} {'wall s':>8} {'teacher fwd rows':>17} {'entries':>8} {'MiB':>8} "
          f"{'step ms':>8} {'mean dev':>9}")
    for mode, r in res.items():
        print(f"{mode:6} {r['runs']:>5} {r['wall_s']:>8.1f} {r['teacher_rows']:>17} {r['entries']:>8} "
              f"{r['entry_bytes'] / 2**20:>8.1f} {r['step_s'] * 1e3:>8.1f} {r['score']:>9.4f}")
    speedup = res["off"]["wall_s"] / res["on"]["wall_s"]
    share = res["on"]["read_s_per_batch"] / res["on"]["step_s"] if res["on"]["step_s"] else 0.0
    print(f"speed-up of the sweep with the store: {speedup:.2f}x; teacher forward rows "
          f"{res['off']['teacher_rows']} -> {res['on']['teacher_rows']}; reading a batch from the store "
          f"({res['on']['read_s_per_batch'] * 1e3:.1f} ms, cold) is {share:.1%} of a stored run's step")
    (out / "bench_store.json").write_text(json.dumps({**res, "speedup": speedup, "read_share": share}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
