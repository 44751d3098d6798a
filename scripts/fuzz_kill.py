"""Kill a run at random moments while it works and count the runs that still end exactly like an
uninterrupted one, each after exactly one restart that resumed where the killed run had got to.

    python scripts/fuzz_kill.py --runs 20                    # SIGKILL at 20 random moments
    python scripts/fuzz_kill.py --runs 20 --signal TERM      # graceful stop (also USR2: SLURM's warning)
    python scripts/fuzz_kill.py --runs 5 --ddp               # two processes (torchrun); one rank is killed
    python scripts/fuzz_kill.py --runs 2 --fast              # the tests

The run: tiny models on the toy task, two stages (objective=tinybert: an intermediate-layer stage,
then a prediction stage), a checkpoint every 3 steps, evaluation every 4, and a cache with no
teacher yet, so the teacher's fine-tuning, both stages, evaluations, checkpoint writes, the
teacher-output store and the teacher's cache entry being published, and the final outputs are all
moments a signal can land in. First the run goes uninterrupted twice: the reference, and a second
run that must end identically and is timed from its log (t0 when it printed its first phase, T
when it printed its outputs). Each of N runs, in its own cache and run directory, gets the signal
at a moment drawn uniformly from [t0, T) (seeded: ``--seed``); with ``--ddp`` SIGKILL goes to one
worker process (rank 1) alone, and torchrun stops the other. A signal that lands after the run
printed its outputs (or after it exited) tests nothing: it is reported apart and drawn again
(at most N extra draws), and T becomes that moment (the machine may be less busy than it was
for the timed run). After the signal (and ``--repeat`` more signalled restarts), the script
reads the checkpoint the run left on disk (``checkpoints/last``, or ``last.old`` from a swap cut
between its renames; the teacher's in its cache entry's ``.partial`` directory) and restarts the
run once. A run passes when:

* that one restart exits 0 (a second restart is not tried: it would hide a broken resume);
* the restart resumed from the step on disk or later (it printed ``resuming at ... step G`` with
  G at or after it; the same for the teacher's fine-tuning): a silent start-over fails;
* its student weights are bit for bit the reference's, its results.json metrics (teacher, student,
  every evaluation) are equal, and its metrics.jsonl has the same records (throughput and timing
  fields, which measure the machine, left out).

Prints where each signal landed (the last phase the run had printed) and the count, e.g.
``20/20 passed``; exits 1 unless every counted run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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
    p.add_argument("--ddp", action="store_true", help="two processes under torchrun; the signal kills rank 1 alone")
    p.add_argument("--out", default="outputs/fuzz_kill")
    p.add_argument("--fast", action="store_true", help="a shorter run (one stage epoch each), for the tests")
    return p.parse_args(argv)


def override_value(value: object) -> str:
    """``value`` as a Hydra override value: quoted when Hydra's grammar would not take it bare (a
    path with non-ASCII letters, commas, quotes or brackets)."""
    text = str(value)
    if text.isascii() and not any(c in text for c in ",'\"[]{}()=\\:"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def kdrun_command(overrides: list[str], cache: Path, run_dir: Path, ddp: bool = False,
                  port: int = 29500) -> list[str]:
    """``python -m kdrun`` with ``overrides`` in its own cache and run directory (the fuzz scripts' runs);
    ``ddp``: two processes under torchrun."""
    launch = [sys.executable, "-m", "kdrun"] if not ddp else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        "-m", "kdrun"]
    return [*launch, *overrides, f"cache_dir={override_value(cache)}", f"output_dir={override_value(run_dir)}"]


_PORTS = iter(range(29500 + os.getpid() % 97 * 5, 65000))  # a fresh port for each launch: no wait for a freed one


def command(args: argparse.Namespace, work: Path) -> list[str]:
    extra = ["objective.params.prediction_epochs=1"] if args.fast else []
    return kdrun_command([*RUN, *extra], work / "cache", work / "run", ddp=args.ddp, port=next(_PORTS))


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return e


def start(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), start_new_session=True)


def rank_process(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker ``rank`` (a descendant of ``launcher`` whose environment says
    RANK=<rank>), or None."""
    todo, seen = [launcher], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if pid != launcher and f"RANK={rank}".encode() in environ:
                return pid
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # gone meanwhile
            continue
    return None


def signalled_run(cmd: list[str], delay: float, sig: signal.Signals, log, ddp: bool = False) -> bool:
    """Start the run and send ``sig`` after ``delay`` seconds (SIGKILL to its whole process group;
    with ``ddp``, to rank 1's process alone); False when it finished before the signal."""
    proc = start(cmd, log)
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        target = rank_process(proc.pid, 1) if ddp else None
        if ddp and target is None:  # no worker yet (start-up): the launcher stands in
            target = proc.pid
        if ddp:
            os.kill(target, sig)
        else:
            os.killpg(proc.pid, sig) if sig == signal.SIGKILL else os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:  # a DDP peer left waiting: end the whole group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return True


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


def _state_step(ckpt: Path) -> int | None:
    for d in (ckpt, ckpt.with_name(ckpt.name + ".old")):  # .old: a swap cut between its renames
        try:
            return int(json.loads((d / "state.json").read_text())["global_step"])
        except (OSError, ValueError, KeyError):
            continue
    return None


def on_disk(work: Path) -> dict[str, int | None]:
    """The steps of the checkpoints a stopped run left: the student's and the teacher's (in the
    teacher entry's ``.partial`` directory, while it was being fine-tuned)."""
    partial = sorted((work / "cache" / "teachers").glob(".*.partial"))
    return {"student": _state_step(work / "run" / "checkpoints" / "last"),
            "teacher": _state_step(partial[0] / "checkpoints" / "last") if partial else None}


RESUMED = {"student": re.compile(r"resuming at stage \d+ step (\d+) from"),
           "teacher": re.compile(r"resuming the teacher's fine-tuning at step (\d+) from")}


def resumed_at(restart_log: str) -> dict[str, int | None]:
    """The step the restart resumed the student and the teacher from (None: it did not resume)."""
    found = {who: [int(m) for m in pattern.findall(restart_log)] for who, pattern in RESUMED.items()}
    return {who: min(steps) if steps else None for who, steps in found.items()}


def resume_problems(saved: dict[str, int | None], restart_log: str) -> list[str]:
    """What is wrong with how the restart resumed from the checkpoints ``saved`` on disk: each must
    be resumed from (at its step or a later one), never trained again from the start."""
    problems = []
    if "this run is complete" in restart_log:
        return problems
    for who, step in saved.items():
        found = [int(m) for m in RESUMED[who].findall(restart_log)]
        if step is not None and not found:
            problems.append(f"the {who} started over (a checkpoint at step {step} was on disk)")
        elif step is not None and min(found) < step:
            problems.append(f"the {who} resumed at step {min(found)}, before the checkpoint at step {step}")
    return problems


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


def judge(reference: dict, work: Path, restart_rc: int, saved: dict, restart_log: str) -> list[str]:
    """Why a signalled run fails (empty: it passed): its one restart failed, resumed wrongly, or
    ended differently from the reference."""
    if restart_rc != 0:
        return [f"the restart exited {restart_rc}"]
    problems = resume_problems(saved, restart_log)
    try:
        return problems + [f"differs in {d}" for d in same(reference, outcome(work / "run"))]
    except (OSError, KeyError, ValueError) as e:
        return problems + [f"its outputs are unreadable ({e})"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    sig = getattr(signal, f"SIG{args.signal}")
    if args.ddp and sig != signal.SIGKILL:
        raise SystemExit("--ddp kills one rank: use it with --signal KILL")
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
    total = marks.get("outputs written", total)  # after the outputs only the exit is left: nothing to test
    print(f"[fuzz_kill] reference {total:.1f}s; phases began at " +
          ", ".join(f"{k} {v:.1f}s" for k, v in sorted(marks.items(), key=lambda kv: kv[1])), flush=True)
    rng = random.Random(args.seed)
    passed, counted, late, landed, failures, trials = 0, 0, 0, {}, [], []
    for i in range(2 * args.runs):
        if counted == args.runs:
            break
        work = out / f"run{i:03d}"
        delay = rng.uniform(t_first, total)
        with open(out / f"run{i:03d}.signalled.log", "w") as log:
            hit = signalled_run(command(args, work), delay, sig, log, args.ddp)
        where = phase((out / f"run{i:03d}.signalled.log").read_text(errors="replace")) if hit else "finished first"
        if where in ("outputs written", "finished first"):
            late += 1
            # this run was faster than the timed one (a machine shared with other work): later
            # draws stay below the moment it had already written its outputs by
            total = max(t_first + 0.5, delay)
            print(f"[fuzz_kill] draw {i}: SIG{args.signal} at {delay:.1f}s landed after the outputs ({where}): "
                  f"not counted, drawn again (now before {total:.1f}s)", flush=True)
            continue
        restart_log = out / f"run{i:03d}.restarts.log"
        with open(restart_log, "w") as log:
            for _ in range(args.repeat):
                signalled_run(command(args, work), rng.uniform(t_first, total), sig, log, args.ddp)
            saved = on_disk(work)
            log.write(f"[fuzz_kill] on disk before the restart: {json.dumps(saved)}\n")
            log.flush()
            rc = start(command(args, work), log).wait()
        counted += 1
        landed[where] = landed.get(where, 0) + 1
        text = restart_log.read_text(errors="replace")
        problems = judge(reference, work, rc, saved, text)
        trials.append({"run": i, "signal_s": round(delay, 2), "phase": where, "on_disk": saved,
                       "resumed_at": resumed_at(text), "passed": not problems})
        passed += not problems
        if problems:
            failures.append({"run": i, "phase": where, "problems": problems})
        resumed = ", ".join(f"{k} from step {v}" for k, v in saved.items() if v is not None) or "nothing on disk"
        print(f"[fuzz_kill] run {i}: SIG{args.signal} at {delay:.1f}s ({where}; {resumed}), one restart: "
              f"{'passed' if not problems else 'FAILED: ' + '; '.join(problems)}", flush=True)
    print(f"[fuzz_kill] signals landed in: {', '.join(f'{k} {v}' for k, v in sorted(landed.items()))}"
          f"; {late} landed after the outputs (not counted)")
    print(f"[fuzz_kill] {passed}/{args.runs} passed: one restart each, resumed at or after the checkpoint on "
          f"disk, identical to the uninterrupted run (SIG{args.signal}{', one DDP rank' if args.ddp else ''}, "
          f"reference {total:.1f}s)")
    (out / "fuzz_kill.json").write_text(json.dumps({
        "runs": args.runs, "counted": counted, "passed": passed, "identical": passed, "after_outputs": late,
        "signal": args.signal, "ddp": args.ddp, "landed": landed, "failures": failures, "trials": trials,
        "reference_s": total}, indent=1))
    return 0 if passed == counted == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
