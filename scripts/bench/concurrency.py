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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kdrun.runtime import harness

# --fast: tiny random teacher and student (all-MiniLM-L6-v2's tokenizer, no download) on a few toy
# sentences, one epoch each: the whole comparison in seconds, for checking the script, not for figures.
FAST = ["teacher=tiny_random", "student=tiny_random", "teacher.finetune.epochs=1", "train.epochs=1",
        "task.toy.num_train=64", "task.toy.num_validation=32"]


def kdrun_cmd(args: list[str], out: Path, tag: str) -> list[str]:
    return [sys.executable, "-m", "kdrun", *args, "logger=none", f"hydra.run.dir={out / tag}", "resume=false"]


def timed(cmds: list[list[str]], env: dict[str, str]) -> float:
    """Wall time from starting all ``cmds`` together until the last one ends."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a run failed ({p.returncode}):\n{err[-2000:]}")
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
    timed([kdrun_cmd(base, work, "warmup")], env)
    alone = timed([kdrun_cmd(base, work, "alone")], env)
    naive = timed([kdrun_cmd([*base, f"train.num_threads={cores}"], work, f"naive{i}") for i in (1, 2)], env)
    fixed = timed([kdrun_cmd(base, work, f"default{i}") for i in (1, 2)], env)
    print(f"\n{cores} cores; `kdrun {' '.join(base)}`")
    print(f"one run alone:                              {alone:7.1f} s")
    print(f"two at once, each with all {cores} threads (naive):  {naive:7.1f} s  ({naive / alone:.2f}x one run)")
    print(f"two at once, kdrun's default threads:        {fixed:7.1f} s  ({fixed / alone:.2f}x one run)")
    print(f"ratio naive / default: {naive / fixed:.2f}x")


if __name__ == "__main__":
    main()
