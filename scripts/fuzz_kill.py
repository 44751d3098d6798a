"""Kill a run at random moments and count the runs that still end exactly like an uninterrupted one.

    python scripts/fuzz_kill.py --runs 20                    # SIGKILL at 20 random moments
    python scripts/fuzz_kill.py --runs 20 --signal TERM      # graceful stop (also USR2: SLURM's warning)
    python scripts/fuzz_kill.py --runs 2 --fast              # the tests

The run: tiny models on the toy task, two stages (objective=tinybert: an intermediate-layer stage,
then a prediction stage), a checkpoint every 3 steps, evaluation every 4, and a cache with no
teacher yet, so the teacher's fine-tuning, both stages, evaluations, checkpoint writes, the
teacher-output store and the teacher's cache entry being published, and the final outputs are all
moments a signal can land in. First the run goes uninterrupted twice: the reference, and a second
run that must end identically and is timed from its log (t0 when it printed its first phase, T
half a second after it printed its outputs). Then each of N runs, in its own cache and run
directory, gets the signal at a moment drawn uniformly from [t0, T) (seeded: ``--seed``) and is
restarted with the same command until it exits 0 (a restart may be signalled again with
``--repeat``). A run counts as identical when its student
weights are bit for bit the reference's, its results.json metrics (teacher, student, every
evaluation) are equal, and its metrics.jsonl has the same records (throughput and timing fields,
which measure the machine, left out). Prints where each signal landed (the last phase the run had
printed) and the count, e.g. ``20/20 identical``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN = ["teacher=tiny_random", "student=tiny_random", "logger=none", "task=toy", "task.toy.num_train=160",
       "task.toy.num_validation=64", "teacher.finetune.epochs=2", "objective=tinybert",
       "objective.params.intermediate_epochs=1", "objective.params.prediction_epochs=2",
       "train.checkpoint_every_steps=3", "train.eval_batch_size=64", "train.num_threads=1"]
TIMING_KEYS = ("per_s", "_s", "seconds", "time")
PHASES = [("fine-tuning the teacher", "teacher fine-tuning"), ("teacher trained and cached", "teacher published"),
          ("teacher store: building", "store building"), ("stage 0:intermediate", "stage 0"),
          ("stage 1:prediction", "stage 1"),
          ("outputs:", "outputs written")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--signal", choices=("KILL", "TERM", "USR2"), default="KILL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=0, help="signal each restart again this many times")
    p.add_argument("--out", default="outputs/fuzz_kill")
    p.add_argument("--fast", action="store_true", help="a shorter run (one stage epoch each), for the tests")
    return p.parse_args(argv)


def kdrun_command(overrides: list[str], cache: Path, run_dir: Path) -> list[str]:
    """``python -m kdrun`` with ``overrides`` in its own cache and run directory (the fuzz scripts' runs)."""
    return [sys.executable, "-m", "kdrun", *overrides, f"cache_dir={cache}", f"output_dir={run_dir}"]


def command(args: argparse.Namespace, work: Path) -> list[str]:
    extra = ["objective.params.prediction_epochs=1"] if args.fast else []
    return kdrun_command([*RUN, *extra], work / "cache", work / "run")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return e


def start(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), start_new_session=True)


def signalled_run(cmd: list[str], delay: float, sig: signal.Signals, log) -> bool:
    """Start the run and send ``sig`` after ``delay`` seconds (SIGKILL to its whole process group);
    False when it finished before the signal."""
    proc = start(cmd, log)
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, sig) if sig == signal.SIGKILL else os.kill(proc.pid, sig)
        proc.wait()
        return True


def finish(cmd: list[str], log, limit: int = 10) -> int:
    """Restart until the run exits 0; returns the number of starts it took."""
    for n in range(limit):
        if start(cmd, log).wait() == 0:
            return n + 1
    raise SystemExit(f"the run did not finish after {limit} restarts: {' '.join(cmd)}")


def timed_reference(cmd: list[str], log_path: Path) -> tuple[float, dict[str, float]]:
    """Run the reference to completion as the signalled runs run (output to a file, unbuffered);
    (its wall time, when each phase's marker first appeared in the file, polled every 20 ms)."""
    t0, marks = time.perf_counter(), {}
    with open(log_path, "w") as log:
        proc = start(cmd, log)
        while True:
            done = proc.poll() is not None
            text = log_path.read_text(errors="replace")
            for marker, name in PHASES:
                if name not in marks and marker in text:
                    marks[name] = time.perf_counter() - t0
            if done:
                break
            time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed: see {log_path}")
    return time.perf_counter() - t0, marks


def phase(log_text: str) -> str:
    """The last phase the run had printed before the signal."""
    last, where = "start-up", -1
    for marker, name in PHASES:
        i = log_text.rfind(marker)
        if i > where:
            last, where = name, i
    return last


def outcome(run_dir: Path) -> dict:
    """What must equal the reference: weights, every metric, the metrics log without timings."""
    from safetensors.torch import load_file

    res = json.loads((run_dir / "results.json").read_text())
    records = [{k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING_KEYS)}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"weights": load_file(str(run_dir / "student" / "model.safetensors")),
            "metrics": {"teacher": res["teacher"].get("metrics"), "student": res["student"]["metrics"],
                        "evals": [e["metrics"] for e in res["evals"]], "stages": res["stages"]},
            "log": records}


def same(a: dict, b: dict) -> list[str]:
    """What differs between two outcomes (empty: identical)."""
    import torch

    wa, wb = a["weights"], b["weights"]
    diff = [] if wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) else ["student weights"]
    diff += [] if a["metrics"] == b["metrics"] else ["results.json metrics"]
    return diff + ([] if a["log"] == b["log"] else ["metrics.jsonl"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    sig = getattr(signal, f"SIG{args.signal}")
    ref_dir = out / "reference"
    out.mkdir(parents=True, exist_ok=True)
    timed_reference(command(args, ref_dir), out / "reference.log")
    reference = outcome(ref_dir / "run")
    # timed on a second uninterrupted run: the first pays one-off costs (compiling, the OS's file
    # cache) that the signalled runs do not; it must also end exactly like the first
    total, marks = timed_reference(command(args, out / "timing"), out / "timing.log")
    if same(reference, outcome(out / "timing" / "run")):
        raise SystemExit("two uninterrupted runs differ: the comparison cannot count anything (see timing.log)")
    t_first = min(marks.values(), default=0.0)  # start-up (imports, config) is not drawn: nothing is written then
    total = marks.get("outputs written", total) + 0.5  # after the outputs: only the exit is left
    print(f"[fuzz_kill] reference {total:.1f}s; phases began at " +
          ", ".join(f"{k} {v:.1f}s" for k, v in sorted(marks.items(), key=lambda kv: kv[1])), flush=True)
    rng = random.Random(args.seed)
    identical, landed = 0, {}
    for i in range(args.runs):
        work = out / f"run{i:03d}"
        delay = rng.uniform(t_first, total)
        with open(out / f"run{i:03d}.signalled.log", "w") as log:
            hit = signalled_run(command(args, work), delay, sig, log)
        where = phase((out / f"run{i:03d}.signalled.log").read_text(errors="replace")) if hit else "finished first"
        with open(out / f"run{i:03d}.restarts.log", "w") as log:
            for _ in range(args.repeat):
                signalled_run(command(args, work), rng.uniform(t_first, total), sig, log)
            starts = finish(command(args, work), log)
        landed[where] = landed.get(where, 0) + 1
        diff = same(reference, outcome(work / "run"))
        identical += not diff
        print(f"[fuzz_kill] run {i}: SIG{args.signal} at {delay:.1f}s ({where}), {starts} more start(s): "
              f"{'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)}", flush=True)
    print(f"[fuzz_kill] signals landed in: {', '.join(f'{k} {v}' for k, v in sorted(landed.items()))}")
    print(f"[fuzz_kill] {identical}/{args.runs} identical to the uninterrupted run (SIG{args.signal}, reference "
          f"{total:.1f}s)")
    (out / "fuzz_kill.json").write_text(json.dumps({"runs": args.runs, "identical": identical, "signal": args.signal,
                                                    "landed": landed, "reference_s": total}))
    return 0 if identical == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
