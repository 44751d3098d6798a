"""Two kdrun runs at once on one machine: every run taking all cores (the naive way) vs kdrun's
default thread choice (cores divided by the live kdrun runs; kdrun/runtime/threads.py).

    python scripts/bench/concurrency.py                       # two `kdrun experiment=quickstart`
    python scripts/bench/concurrency.py --overrides task.toy.num_train=1000
    python scripts/bench/concurrency.py --fast                # tiny random models, 64 toy sentences

A first run fills the teacher cache (not timed). Then, for each way, both runs start together and
the script reports the wall time until both have finished, the ratio naive / default, and one
run alone for reference. Take the figures on an otherwise idle machine.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from kdrun.runtime import forkrun, harness

# --fast: tiny random teacher and student (all-MiniLM-L6-v2's tokenizer, no download) on a few toy
# sentences, one epoch each, the runs forked: the whole comparison in seconds, for checking the script, not
# for figures.
FAST = ["teacher=tiny_random", "student=tiny_random", "teacher.finetune.epochs=1", "train.epochs=1",
        "task.toy.num_train=64", "task.toy.num_validation=32"]


def kdrun_args(args: list[str], out: Path, tag: str) -> list[str]:
    return [*args, "logger=none", f"hydra.run.dir={out / tag}", "resume=false"]


def timed(runs: list[list[str]], env: dict[str, str], fast: bool = False) -> float:
    """Wall time from starting all ``kdrun RUNS[i]`` together until the last one ends. ``fast``: forked
    from a process that imported kdrun's libraries once (kdrun.runtime.forkrun), else new interpreters
    as a user starts them (KDRUN_FORKRUN=0)."""
    env = env if fast else {**env, "KDRUN_FORKRUN": "0"}
    with tempfile.TemporaryDirectory(prefix="kdrun-bench-conc-out-") as tmp:
        t0 = time.perf_counter()
        procs = [forkrun.start(r, env, Path(tmp) / f"{i}.out", err=Path(tmp) / f"{i}.err") for i, r in enumerate(runs)]
        for i, p in enumerate(procs):
            if p.wait() != 0:
                raise SystemExit(f"a run failed ({p.returncode}):\n{(Path(tmp) / f'{i}.err').read_text()[-2000:]}")
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--experiment", default="quickstart")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra key=value overrides for every run")
    ap.add_argument("--workdir", type=Path, default=None, help="outputs and cache (default: a temporary dir)")
    ap.add_argument("--fast", action="store_true", help="tiny random models on 64 toy sentences (seconds)")
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kdrun-bench-conc-"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(KDRUN_CACHE_DIR=str(work / "cache"), HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    base = [f"experiment={args.experiment}", *(FAST if args.fast else []), *args.overrides]
    cores = len(os.sched_getaffinity(0))

    print(f"[bench] warm-up run (fills the teacher cache) in {work}", flush=True)
    timed([kdrun_args(base, work, "warmup")], env, args.fast)
    alone = timed([kdrun_args(base, work, "alone")], env, args.fast)
    naive = timed([kdrun_args([*base, f"train.num_threads={cores}"], work, f"naive{i}") for i in (1, 2)], env,
                  args.fast)
    fixed = timed([kdrun_args(base, work, f"default{i}") for i in (1, 2)], env, args.fast)
    print(f"\n{cores} cores; `kdrun {' '.join(base)}`")
    print(f"one run alone:                              {alone:7.1f} s")
    print(f"two at once, each with all {cores} threads (naive):  {naive:7.1f} s  ({naive / alone:.2f}x one run)")
    print(f"two at once, kdrun's default threads:        {fixed:7.1f} s  ({fixed / alone:.2f}x one run)")
    print(f"ratio naive / default: {naive / fixed:.2f}x")


if __name__ == "__main__":
    main()
