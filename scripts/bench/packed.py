"""A seed sweep one job at a time against the same sweep packed (``launcher=packed``: several jobs
at once on one GPU; kdrun/runtime/packing.py).

    python scripts/bench/packed.py                        # 6 seeds of `experiment=quickstart`
    python scripts/bench/packed.py --seeds 8 --jobs-at-once 4 --overrides train.epochs=2
    python scripts/bench/packed.py --fast                 # tiny random models, 3 seeds, 2 at once

A first run fills the teacher cache and the teacher-output store (not timed). Then the sweep runs
twice through the same launcher, each in its own sweep directory: with
``hydra.launcher.jobs_at_once=1`` (one at a time) and with ``--jobs-at-once`` (``auto`` by
default: the GPU's free memory / ``job_memory_gb``). The script prints both wall times, their
ratio and how far the two sweeps' dev metrics are apart (thread counts and GPU kernels may change
the rounding). Take the figures on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

from kdrun.runtime import forkrun, harness

# --fast: tiny random teacher and student on a few toy sentences, the runs forked; checks the script, not for
# figures.
FAST = ["teacher=tiny_random", "student=tiny_random", "teacher.finetune.epochs=1", "train.epochs=1",
        "task.toy.num_train=64", "task.toy.num_validation=32"]


def kdrun(args: list[str], env: dict[str, str], fast: bool = False) -> tuple[float, str]:
    """Run ``kdrun ARGS``; its wall time and stdout (exits with the run's error if it fails). ``fast``:
    forked from a process that imported kdrun's libraries once (kdrun.runtime.forkrun; the launcher's
    jobs are new interpreters either way), else a new interpreter as a user starts it (KDRUN_FORKRUN=0)."""
    t0 = time.perf_counter()
    proc = forkrun.run(args, env if fast else {**env, "KDRUN_FORKRUN": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"kdrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stdout


def sweep_metrics(sweep_dir: Path) -> dict[int, float]:
    """Each job's main dev metric, by seed."""
    out = {}
    for path in sweep_dir.glob("*/results.json"):
        res = json.loads(path.read_text())
        metrics = next(iter(res["student"]["metrics"].values()))
        out[int(res["config"]["seed"])] = float(metrics[res["config"]["task"]["main_metric"]])
    return out


def device_line() -> str:
    from kdrun.runtime.packing import gpu_free_gb, usable_cores

    free = gpu_free_gb()
    gpu = "no GPU" if free is None else f"a GPU with {free:.1f} GiB free"
    return f"{gpu}, {usable_cores()} CPU cores"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--experiment", default="quickstart")
    ap.add_argument("--seeds", type=int, default=6, help="jobs in the sweep: seed=1..N")
    ap.add_argument("--jobs-at-once", default="auto", help="hydra.launcher.jobs_at_once of the packed sweep")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra key=value overrides for every job")
    ap.add_argument("--workdir", type=Path, default=None, help="outputs and cache (default: a temporary dir)")
    ap.add_argument("--fast", action="store_true", help="tiny random models, 3 seeds, 2 at once (seconds)")
    args = ap.parse_args(argv)
    if args.fast:
        args.seeds, args.jobs_at_once, args.overrides = 3, "2", [*FAST, *args.overrides]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kdrun-bench-packed-"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KDRUN_SWEEP_NAME")}
    env.update(KDRUN_CACHE_DIR=str(work / "cache"), KDRUN_OUTPUT_DIR=str(work / "outputs"), HF_HUB_OFFLINE="1",
               WANDB_MODE="offline")
    base = [f"experiment={args.experiment}", *args.overrides, "logger=none"]
    seeds = ",".join(str(s) for s in range(1, args.seeds + 1))

    print(f"[bench] warm-up run (fills the teacher cache) in {work}", flush=True)
    kdrun([*base, "seed=0", f"hydra.run.dir={work / 'warmup'}"], env, args.fast)
    secs, packed_jobs = {}, "?"
    for tag, at_once in (("one_at_a_time", "1"), ("packed", args.jobs_at_once)):
        secs[tag], stdout = kdrun(["-m", *base, f"seed={seeds}", "launcher=packed",
                                   f"hydra.launcher.jobs_at_once={at_once}", f"hydra.sweep.dir={work / tag}"], env,
                                  args.fast)
        found = re.search(r"\[kdrun\] (\d+) of \d+ jobs at once", stdout)
        packed_jobs = found.group(1) if found else packed_jobs
    one, packed = sweep_metrics(work / "one_at_a_time"), sweep_metrics(work / "packed")
    if sorted(one) != sorted(packed) or len(one) != args.seeds:
        raise SystemExit(f"the sweeps did not finish every job: {sorted(one)} and {sorted(packed)}")
    worst = max(abs(one[s] - packed[s]) for s in one)

    print(f"\n{args.seeds} jobs of `kdrun -m {' '.join(base)} seed={seeds}`; {device_line()}")
    print(f"one at a time:          {secs['one_at_a_time']:7.1f} s")
    print(f"packed ({packed_jobs} at once):     {secs['packed']:7.1f} s  (jobs_at_once={args.jobs_at_once})")
    print(f"ratio one-at-a-time / packed: {secs['one_at_a_time'] / secs['packed']:.2f}x")
    print(f"largest difference of a job's main dev metric between the sweeps: {worst:.4g}")


if __name__ == "__main__":
    main()
