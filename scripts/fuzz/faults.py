"""Inject faults into tiny runs and count the runs kdrun brought through them.

    python scripts/fuzz/faults.py --nan 10 --race 3 --disk 4      # the full counts
    python scripts/fuzz/faults.py --fast                          # one of each, for the tests

* ``--nan N``: N runs, each with a test-only loss term (a plug-in loaded through
  ``objective.imports``) that turns the loss NaN at a random step. Counted as handled when the run
  stops with an error naming the stage, the step and the term, its ``checkpoints/last`` is intact
  (its manifest verifies) and from before that step, and the run resumed without the fault ends
  exactly like a run that never had it (student weights, metrics, metrics log).
* ``--race N``: N rounds of three processes started together, in one cache without the teacher they
  all need. Counted when exactly one fine-tuned the teacher (from their logs), the other two reused
  it, and the three students are identical.
* ``--disk N``: N runs whose run directory (even rounds) or cache (odd rounds) lives on a small tmpfs
  that fills up mid-run (its size drawn between 20 % and 80 % of what the finished run holds there). Counted
  when the run stops with one line naming the full path, no cache entry is half-published (every
  entry's manifest verifies), the last checkpoint is intact, and a rerun after the tmpfs is made
  larger finishes exactly like the reference. Needs root (``mount -t tmpfs``); skipped otherwise.

Every run is forked from a process that imported kdrun's libraries once (kdrun.runtime.forkrun;
``KDRUN_FORKRUN=0``: a fresh ``python -m kdrun`` each).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kdrun.runtime import forkrun, harness

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kill as fk  # noqa: E402  (the run helpers and the exact comparison)

TINY = ["teacher=tiny_random", "student=tiny_random", "logger=none", "train.num_threads=1",
        "train.eval_batch_size=64", "task=toy", "task.toy.num_train=128", "task.toy.num_validation=32",
        "teacher.finetune.epochs=1"]
NAN_TERM = '''
import os

from kdrun.losses import register_loss


@register_loss("fuzz_nan", uses_teacher=False)
def fuzz_nan(s, t, batch, ctx, p):
    """0 (on the graph) at every step but KDRUN_FUZZ_NAN_STEP (1-based, as kdrun counts), where it is NaN."""
    zero = s.logits.float().sum() * 0.0
    return zero + float("nan") if str(ctx.step + 1) == os.environ.get("KDRUN_FUZZ_NAN_STEP") else zero
'''
NAN_RUN = ["objective=finetune", "objective.imports=[kdrun_fuzz_nan]", "train.epochs=2",
           "objective.stages.0.batch_size=16",
           "objective.stages.0.losses=[{name: ce, weight: 1.0}, {name: fuzz_nan, weight: 1.0}]",
           "train.checkpoint_every_steps=2", "logger.log_every_steps=1"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--nan", type=int, default=10)
    p.add_argument("--race", type=int, default=3)
    p.add_argument("--disk", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/fuzz_faults")
    p.add_argument("--fast", action="store_true", help="one fault of each kind")
    args = p.parse_args(argv)
    if args.fast:
        args.nan, args.race, args.disk = min(args.nan, 1), min(args.race, 1), min(args.disk, 2)
    return args


def kdrun(overrides: list[str], work: Path, log: Path, extra_env: dict[str, str] | None = None,
          cache: Path | None = None, run_dir: Path | None = None) -> subprocess.Popen | forkrun.Run:
    """Start ``python -m kdrun`` on the tiny toy run, forked (kdrun.runtime.forkrun); its output to ``log``."""
    env = {**fk.env(), "PYTHONPATH": os.pathsep.join([str(work.parent), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    log.unlink(missing_ok=True)  # the run appends to it
    return forkrun.start(fk.kdrun_args([*TINY, *overrides], cache or work / "cache", run_dir or work / "run"), env, log)


def intact(ckpt: Path) -> bool:
    from kdrun.runtime.cache import manifest_problem

    return not ckpt.exists() or manifest_problem(ckpt) is None


def steps_of(run_dir: Path) -> int:
    return sum(s["steps"] for s in json.loads((run_dir / "results.json").read_text())["stages"])


# ------------------------------------------------------------------------------------------ NaN

def nan_trials(args: argparse.Namespace, out: Path, rng: random.Random) -> tuple[int, int]:
    root = out / "nan"
    (root / "kdrun_fuzz_nan.py").parent.mkdir(parents=True, exist_ok=True)
    (root / "kdrun_fuzz_nan.py").write_text(textwrap.dedent(NAN_TERM))
    ref = root / "reference"
    if kdrun(NAN_RUN, ref, root / "reference.log").wait() != 0:
        raise SystemExit(f"the reference run failed: see {root / 'reference.log'}")
    reference, total = fk.outcome(ref / "run"), steps_of(ref / "run")
    ok = 0
    for i in range(args.nan):
        work, step = root / f"run{i:02d}", rng.randint(1, total)
        shutil.rmtree(work, ignore_errors=True)
        rc = kdrun(NAN_RUN, work, root / f"run{i:02d}.log", {"KDRUN_FUZZ_NAN_STEP": str(step)}).wait()
        log = (root / f"run{i:02d}.log").read_text(errors="replace")
        named = f"became non-finite at step {step}" in log and "fuzz_nan" in log and "stage 'finetune'" in log
        ckpt = work / "run" / "checkpoints" / "last"
        before = not ckpt.exists() or json.loads((ckpt / "state.json").read_text())["global_step"] < step
        good_ckpt = intact(ckpt)
        resumed = kdrun(NAN_RUN, work, root / f"run{i:02d}.resumed.log").wait() == 0
        same = resumed and not fk.same(reference, fk.outcome(work / "run"))
        ok += rc != 0 and named and before and good_ckpt and same
        print(f"[fuzz_faults] nan {i}: NaN at step {step}/{total}: exit {rc}, named {named}, checkpoint intact "
              f"{good_ckpt} and earlier {before}, resumed identically {same}", flush=True)
    return ok, args.nan


# ------------------------------------------------------------------------------------- racing builders

def race_trials(args: argparse.Namespace, out: Path) -> tuple[int, int]:
    ok = 0
    for i in range(args.race):
        root = out / "race" / f"round{i}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        runs = ["objective=logit", "train.epochs=1", f"seed={i}", f"teacher.finetune.seed={100 + i}"]
        procs = [kdrun(runs, root, root / f"p{j}.log", cache=root / "cache", run_dir=root / f"run{j}")
                 for j in range(3)]
        rcs = [p.wait() for p in procs]
        logs = [(root / f"p{j}.log").read_text(errors="replace") for j in range(3)]
        trained = sum("fine-tuning the teacher" in log for log in logs)
        reused = sum("teacher from cache" in log for log in logs)
        outs = [fk.outcome(root / f"run{j}") for j in range(3)] if rcs == [0, 0, 0] else []
        same = bool(outs) and not fk.same(outs[0], outs[1]) and not fk.same(outs[0], outs[2])
        ok += trained == 1 and reused == 2 and same
        print(f"[fuzz_faults] race {i}: exits {rcs}, {trained} fine-tuned the teacher, {reused} reused it, "
              f"students identical {same}", flush=True)
    return ok, args.race


# ------------------------------------------------------------------------------------------ full disk

def mounted(path: Path, mb: float) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.call(["mount", "-t", "tmpfs", "-o", f"size={max(int(mb * 1024), 64)}k", "tmpfs", str(path)],
                           stderr=subprocess.DEVNULL) == 0


def du_mb(path: Path) -> float:
    from kdrun.runtime.cache_cli import tree_size

    return tree_size(path) / 2**20


def entries_ok(cache: Path) -> bool:
    """Every published cache entry verifies against its manifest (``kdrun-cache verify``'s check)."""
    from kdrun.runtime.cache_cli import scan

    return cache.exists() and all(it.state != "damaged" for it in scan(cache, check=True))


def disk_trials(args: argparse.Namespace, out: Path, rng: random.Random) -> tuple[int, int]:
    root = out / "disk"
    runs = ["objective=tinybert", "objective.params.intermediate_epochs=1", "objective.params.prediction_epochs=1",
            "train.checkpoint_every_steps=2", "teacher.store=on"]
    ref = root / "reference"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if kdrun(runs, ref, root / "reference.log").wait() != 0:
        raise SystemExit(f"the reference run failed: see {root / 'reference.log'}")
    reference = fk.outcome(ref / "run")
    need = {"run": du_mb(ref / "run"), "cache": du_mb(ref / "cache")}
    ok = tried = 0
    for i in range(args.disk):
        which = "run" if i % 2 == 0 else "cache"
        work, small = root / f"trial{i}", root / f"trial{i}" / which
        if not mounted(small, need[which] * rng.uniform(0.2, 0.8)):
            print("[fuzz_faults] disk: cannot mount a tmpfs (needs root); skipped", flush=True)
            break
        tried += 1
        try:
            ok += disk_trial(runs, work, small, which, reference, i)
        finally:
            subprocess.call(["umount", str(small)])
    return ok, tried


def disk_trial(runs: list[str], work: Path, small: Path, which: str, reference: dict, i: int) -> bool:
    log = work / "full.log"
    rc = kdrun(runs, work, log).wait()
    text = log.read_text(errors="replace")
    named = any("kdrun: error: no space left" in line and str(small) in line for line in text.splitlines())
    clean = entries_ok(work / "cache") and intact(work / "run" / "checkpoints" / "last")
    subprocess.call(["mount", "-o", "remount,size=512m", str(small)])
    rc2 = kdrun(runs, work, work / "rerun.log").wait()
    same = rc2 == 0 and not fk.same(reference, fk.outcome(work / "run"))
    print(f"[fuzz_faults] disk {i}: {which} on a full tmpfs: exit {rc}, one line naming it {named}, nothing "
          f"half-published {clean}, rerun with space identical {same}", flush=True)
    return rc != 0 and named and clean and same


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    figures = {"nan": nan_trials(args, out, rng), "race": race_trials(args, out), "disk": disk_trials(args, out, rng)}
    for name, (good, n) in figures.items():
        print(f"[fuzz_faults] {name}: {good}/{n} handled")
    print(f"[fuzz_faults] {time.perf_counter() - t0:.0f}s in all")
    (out / "fuzz_faults.json").write_text(json.dumps({k: {"handled": g, "runs": n} for k, (g, n) in figures.items()}))
    return 0 if all(g == n for g, n in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
