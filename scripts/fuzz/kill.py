"""Kill a run at random moments while it works and count the runs that still end exactly like an
uninterrupted one, each after exactly one restart that resumed where the killed run had got to.

    python scripts/fuzz/kill.py --runs 20                    # SIGKILL at 20 random moments
    python scripts/fuzz/kill.py --runs 20 --signal TERM      # graceful stop (also USR2: SLURM's warning)
    python scripts/fuzz/kill.py --runs 5 --ddp               # two processes (torchrun); one rank is killed
    python scripts/fuzz/kill.py --runs 10 --logger wandb     # also one offline wandb run, each step once
    python scripts/fuzz/kill.py --runs 10 --at event         # signal at drawn events, not drawn moments
    python scripts/fuzz/kill.py --runs 2 --fast              # the tests (--at event)

The run: tiny models on the toy task, two stages (objective=tinybert: an intermediate-layer stage,
then a prediction stage), a checkpoint every 3 steps, evaluation every 4, the teacher's outputs
read from the teacher-output store (``teacher.store=on``: ``auto`` would choose by how fast the
machine reads and runs the teacher, so a busy machine could change the numbers), and a cache with no
teacher yet, so the teacher's fine-tuning, both stages, evaluations, checkpoint writes, the
teacher-output store and the teacher's cache entry being published, and the final outputs are all
moments a signal can land in. First the run goes uninterrupted twice: the reference, and a second
run that must end identically and is timed from its log (t0 when it printed its first phase, T
when it printed its outputs). Each of N runs, in its own cache and run directory, gets the signal
at a moment drawn uniformly from [t0, T) (seeded: ``--seed``); with ``--ddp`` SIGKILL goes to one
worker process (rank 1) alone, and torchrun stops the other. A signal that lands after the run
printed its outputs (or after it exited) tests nothing: it is reported apart and drawn again
(at most N extra draws), and T becomes that moment (the machine may be less busy than it was
for the timed run). With ``--at event`` (the default with ``--fast``) the signal goes instead when
the run reaches an event drawn from :data:`EVENTS` (a phase printed, a checkpoint written, the
teacher published; ``--events`` narrows the draw), watched every 10 ms: where it lands does not
depend on how busy the machine is. After the signal (and ``--repeat`` more signalled restarts), the script
reads the checkpoint the run left on disk (``checkpoints/last``, or ``last.old`` from a swap cut
between its renames; the teacher's in its cache entry's ``.partial`` directory) and restarts the
run once. A run passes when:

* that one restart exits 0 (a second restart is not tried: it would hide a broken resume);
* the restart resumed from the step on disk or later (it printed ``resuming at ... step G`` with
  G at or after it; the same for the teacher's fine-tuning): a silent start-over fails;
* its student weights are bit for bit the reference's, its results.json metrics (teacher, student,
  every evaluation) are equal, and its metrics.jsonl has the same records (throughput and timing
  fields, which measure the machine, left out);
* with ``--logger wandb`` (offline): the wandb offline runs the stopped run and its restart wrote
  make one wandb run: every one that holds a run has the id in ``wandb_id.txt``, none logs a step
  twice, the restart's transaction log reads to its end (each record's CRC-32 checked), and their
  history as ``wandb sync`` of them in order leaves it (a resumed run's row at or below a step
  already there is dropped) has every step of the uninterrupted run once, with the same values.

Every process of a run (wandb's service, in a process group of its own, too) is waited for before the
next run starts; one still there a minute after its run ended is killed. A one-process run is forked
from a process that imported kdrun's libraries once (kdrun.runtime.forkrun; ``KDRUN_FORKRUN=0``: a
fresh ``python -m kdrun`` each): no moment is drawn before the run's first phase anyway, and a
signal reaches the fork as it would the fresh process. ``--ddp`` runs start torchrun afresh.

Prints where each signal landed (the last phase the run had printed) and the count, e.g.
``20/20 passed``; exits 1 unless every counted run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

from kdrun.runtime import forkrun, harness

RUN = ["teacher=tiny_random", "student=tiny_random", "logger=none", "task=toy", "task.toy.num_train=160",
       "task.toy.num_validation=64", "teacher.finetune.epochs=2", "objective=tinybert",
       "objective.params.intermediate_epochs=1", "objective.params.prediction_epochs=2",
       "train.checkpoint_every_steps=3", "train.eval_batch_size=64", "train.num_threads=1",
       "teacher.store=on"]  # auto decides by timing: the store read or the teacher run live, other numbers
TIMING_KEYS = ("per_s", "_s", "seconds", "time")
PHASES = [("fine-tuning the teacher", "teacher fine-tuning"), ("teacher trained and cached", "teacher published"),
          ("teacher store: building", "store building"), ("stage 0:intermediate", "stage 0"),
          ("stage 1:prediction", "stage 1"),
          ("outputs:", "outputs written")]
EVENTS = ("teacher fine-tuning", "teacher checkpoint", "teacher published", "stage 0", "student step 3",
          "student step 6")  # what --at event waits for before the signal, in the order a run reaches them


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--signal", choices=("KILL", "TERM", "USR2"), default="KILL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=0, help="signal each restart again this many times")
    p.add_argument("--ddp", action="store_true", help="two processes under torchrun; the signal kills rank 1 alone")
    p.add_argument("--logger", choices=("none", "wandb"), default="none",
                   help="wandb: also check the offline wandb run (one run id, every step logged once)")
    p.add_argument("--at", choices=("time", "event"), default=None,
                   help="time: a moment drawn from the timed run; event: when the run reaches a drawn event "
                        "(a phase printed, a checkpoint written), whatever the machine's speed (default with --fast)")
    p.add_argument("--out", default="outputs/fuzz_kill")
    p.add_argument("--fast", action="store_true", help="a shorter run (one stage epoch each), for the tests")
    p.add_argument("--events", default=",".join(EVENTS), help="with --at event: the events to draw from")
    p.add_argument("--references", default=None,
                   help="where the two uninterrupted runs go (default: --out); reused from there when an earlier "
                        "invocation made them for the same run (its references.json), so invocations that differ "
                        "only in signal, events or seed share them")
    args = p.parse_args(argv)
    args.at = args.at or ("event" if args.fast else "time")
    args.events = args.events.split(",")
    if args.references and Path(args.references).exists() and not Path(args.references).is_dir():
        p.error(f"--references {args.references}: not a directory; name a directory (made if absent) where the "
                "uninterrupted runs go")
    if set(args.events) - set(EVENTS):
        p.error(f"--events: {', '.join(sorted(set(args.events) - set(EVENTS)))}: choose from {', '.join(EVENTS)}")
    return args


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
    return [*launch, *kdrun_args(overrides, cache, run_dir)]


def kdrun_args(overrides: list[str], cache: Path, run_dir: Path) -> list[str]:
    """The arguments of ``python -m kdrun`` for ``overrides`` in its own cache and run directory."""
    return [*overrides, f"cache_dir={override_value(cache)}", f"output_dir={override_value(run_dir)}"]


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick): each launch gets its own, so a port still
    held by a killed run, or by another program's torchrun, is never reused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_overrides(args: argparse.Namespace) -> list[str]:
    extra = ["objective.params.prediction_epochs=1"] if args.fast else []
    return [*RUN, *extra, *([f"logger={args.logger}"] if args.logger != "none" else [])]


def command(args: argparse.Namespace, work: Path) -> list[str]:
    return kdrun_command(run_overrides(args), work / "cache", work / "run", ddp=args.ddp,
                         port=free_port() if args.ddp else 29500)


TAG = "KDRUN_FUZZ_RUN"  # every process of a run carries it (wandb's service too, in a process group of its own)


def env(tag: str = "") -> dict[str, str]:
    """The runs' environment: offline, tagged; without the caller's wandb service (``WANDB_SERVICE``,
    which a process that ran wandb sets: a run attached to it would leave its run id in use there
    when killed, and its restart could not open the same run)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "WANDB_SERVICE")
    e = {k: v for k, v in os.environ.items() if k not in drop}
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **({TAG: tag} if tag else {}))
    return e


def start(cmd: list[str], log) -> subprocess.Popen | forkrun.Run:
    """Start a run in a process group of its own (setsid); the processes it starts carry
    ``KDRUN_FUZZ_RUN=<a tag of its own>`` (``proc.tag``). A one-process run (``python -m kdrun``) is
    forked from a process that imported kdrun's libraries once (kdrun.runtime.forkrun), and appends
    its output to the log through a descriptor of its own: ``log`` is opened for appending
    (:func:`fresh_log`)."""
    tag = secrets.token_hex(8)
    if cmd[:3] == [sys.executable, "-m", "kdrun"]:
        proc = forkrun.start(cmd[3:], env(tag), Path(log.name), new_session=True)
    else:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(tag), start_new_session=True)
    proc.tag = tag
    return proc


def fresh_log(path: Path):
    """``path`` emptied and opened for appending (what this process writes and what a run appends interleave)."""
    Path(path).write_bytes(b"")
    return open(path, "a")


def tagged(tag: str) -> list[int]:
    """The live processes whose environment holds ``KDRUN_FUZZ_RUN=<tag>``."""
    want, found = f"{TAG}={tag}".encode(), []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and want in Path(d, "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def finish(proc: subprocess.Popen, timeout: float = 60) -> int:
    """Wait for the run, then for every process it started (wandb's service ends on its own once the
    run is gone, after writing what it holds); what is still there after ``timeout`` is killed."""
    rc = proc.wait()
    deadline = time.time() + timeout
    while (left := tagged(proc.tag)) and time.time() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return rc


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


def reached(event: str, work: Path, log_text: str) -> bool:
    """Whether the run in ``work`` has got to ``event`` (one of :data:`EVENTS`)."""
    teachers = work / "cache" / "teachers"
    if event == "teacher checkpoint":
        return any(teachers.glob(".*.partial/checkpoints/last/.complete"))
    if event == "teacher published":
        return any(teachers.glob("*/.complete"))
    if event.startswith("student step"):
        return (_state_step(work / "run" / "checkpoints" / "last") or 0) >= int(event.split()[-1])
    return {name: marker for marker, name in PHASES}[event] in log_text


def moment_came(proc: subprocess.Popen, when: float | str, work: Path, log) -> bool:
    """Wait until ``when`` (seconds after the start, or an event of :data:`EVENTS`) while the run
    runs; False when it ended first."""
    if not isinstance(when, str):
        try:
            proc.wait(timeout=when)
            return False
        except subprocess.TimeoutExpired:
            return True
    path, offset = Path(log.name), Path(log.name).stat().st_size  # the log may hold earlier restarts
    while proc.poll() is None:
        with open(path, "rb") as f:
            f.seek(offset)
            if reached(when, work, f.read().decode(errors="replace")):
                return True
        time.sleep(0.01)
    return False


def signalled_run(cmd: list[str], when: float | str, sig: signal.Signals, log, ddp: bool = False,
                  work: Path | None = None) -> bool:
    """Start the run and send ``sig`` at ``when`` (see :func:`moment_came`; SIGKILL to its whole
    process group; with ``ddp``, to rank 1's process alone); False when it finished before the signal.
    Returns once every process of the run has ended."""
    proc = start(cmd, log)
    if not moment_came(proc, when, work, log):
        finish(proc)
        return False
    target = rank_process(proc.pid, 1) if ddp else None
    if ddp and target is not None:
        os.kill(target, sig)
    elif sig == signal.SIGKILL or ddp:  # no worker yet (start-up): the whole group, launcher and all
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:  # a DDP peer left waiting: end the whole group
        os.killpg(proc.pid, signal.SIGKILL)
    finish(proc)
    return True


def timed_reference(cmd: list[str], log_path: Path) -> tuple[float, dict[str, float]]:
    """Run the reference to completion as the signalled runs run (output to a file, unbuffered);
    (its wall time, when each phase's marker first appeared in the file, polled every 20 ms)."""
    t0, marks = time.perf_counter(), {}
    with fresh_log(log_path) as log:
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
    finish(proc)
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


WANDB_BLOCK, WANDB_HEADER, CHUNK = 32768, 7, 7  # wandb's transaction log: LevelDB-log blocks after a header


def wandb_records(path: Path) -> tuple[list[bytes], str | None]:
    """The records of a wandb transaction log (``run-<id>.wandb``: ``:W&B`` and a version, then
    LevelDB-log chunks in 32 KiB blocks, each with a CRC-32 of its type byte and data), and why
    reading stopped before the end (None: every byte was read and checked)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        return [], "no wandb header"
    records, pending, pos = [], b"", WANDB_HEADER
    while pos < len(data):
        room = WANDB_BLOCK - pos % WANDB_BLOCK
        crc, size, kind = struct.unpack_from("<IHB", data, pos) if room >= CHUNK and pos + CHUNK <= len(data) \
            else (0, 0, 0)
        if (crc, size, kind) == (0, 0, 0):  # the zero padding at a block's end
            if room < CHUNK or not any(data[pos:pos + room]):
                pos += room
                continue
            return records, f"cut inside a chunk header at byte {pos}"
        body = data[pos + CHUNK:pos + CHUNK + size]
        if len(body) < size or zlib.crc32(bytes([kind]) + body) != crc or kind not in (1, 2, 3, 4):
            return records, f"a damaged or cut record at byte {pos}"
        pos += CHUNK + size
        pending = body if kind in (1, 2) else pending + body  # 1 whole, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            records.append(pending)
    return records, None


def wandb_history(path: Path) -> dict:
    """What a wandb offline run's transaction log holds: its run id, each history row's step and
    values (timing fields and wandb's own ``_`` fields left out), in order, and any read problem."""
    from wandb.proto import wandb_internal_pb2 as pb

    records, problem = wandb_records(path)
    run_id, rows = None, []
    for raw in records:
        rec = pb.Record.FromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = run_id or rec.run.run_id
        elif kind == "history":
            values = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            rows.append((rec.history.step.num, {k: v for k, v in values.items()
                                                if not k.startswith("_") and not any(t in k for t in TIMING_KEYS)}))
    return {"id": run_id, "rows": rows, "problem": problem}


def wandb_logs(run_dir: Path) -> list[Path]:
    """The transaction logs of every wandb offline run in ``run_dir`` (``wandb/offline-run-*``)."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def same(a: dict, b: dict) -> list[str]:
    """What differs between two outcomes (empty: identical)."""
    import torch

    wa, wb = a["weights"], b["weights"]
    diff = [] if wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) else ["student weights"]
    diff += [] if a["metrics"] == b["metrics"] else ["results.json metrics"]
    return diff + ([] if a["log"] == b["log"] else ["metrics.jsonl"])


def synced_rows(histories: list[dict]) -> list[tuple[int, dict]]:
    """The history of one wandb run as ``wandb sync`` of its offline runs, in order, leaves it: a row at
    or below the last step already there is dropped (wandb drops it in a resumed run)."""
    rows: list[tuple[int, dict]] = []
    for h in histories:
        rows += [r for r in h["rows"] if not rows or r[0] > rows[-1][0]]
    return rows


def wandb_problems(reference: list, run_dir: Path, logs: list[Path]) -> list[str]:
    """Why the wandb offline runs of a stopped and restarted run (``logs``, oldest first) are not one
    wandb run equal to the uninterrupted one's: every run id is the one in wandb_id.txt, no offline run
    logs a step twice, the restart's log reads to its end, and the synced history has every step of
    ``reference`` once, with the same values (timing fields left out)."""
    hist = [h for h in map(wandb_history, logs) if h["id"] or h["rows"]]  # a SIGKILL can leave a log of no run
    stored = (run_dir / "wandb_id.txt").read_text().strip() if (run_dir / "wandb_id.txt").is_file() else None
    problems = [] if hist and {h["id"] for h in hist} == {stored} else [
        f"wandb: run ids {sorted(str(h['id']) for h in hist)}, {stored!r} in wandb_id.txt"]
    problems += [f"wandb: the restart's log: {hist[-1]['problem']}"] if hist and hist[-1]["problem"] else []
    for h in hist:
        steps = [s for s, _ in h["rows"]]
        if steps != sorted(set(steps)):
            problems.append(f"wandb: an offline run logs a step twice or out of order ({steps})")
    rows = synced_rows(hist)
    got, want = [s for s, _ in rows], [s for s, _ in reference]
    if got != want:
        problems.append(f"wandb: steps {got}, the uninterrupted run's {want}")
    elif rows != reference:
        problems.append(f"wandb: values differ at steps {[a[0] for a, b in zip(rows, reference) if a != b]}")
    return problems


def judge(reference: dict, work: Path, restart_rc: int, saved: dict, restart_log: str,
          wandb: tuple[list, list[Path]] | None = None) -> list[str]:
    """Why a signalled run fails (empty: it passed): its one restart failed, resumed wrongly, or
    ended differently from the reference (``wandb``: the reference's wandb history and the run's
    offline wandb logs, oldest first, which must make one wandb run like it)."""
    if restart_rc != 0:
        return [f"the restart exited {restart_rc}"]
    problems = resume_problems(saved, restart_log)
    try:
        problems += [f"differs in {d}" for d in same(reference, outcome(work / "run"))]
        return problems + (wandb_problems(wandb[0], work / "run", wandb[1]) if wandb else [])
    except (OSError, KeyError, ValueError) as e:
        return problems + [f"its outputs are unreadable ({e})"]


def references(args: argparse.Namespace, out: Path) -> tuple[dict, list | None, float, float, dict]:
    """Two uninterrupted runs (the second timed: the first pays one-off costs, compiling and the OS's
    file cache, that the signalled runs do not), which must end identically: (the outcome, its wandb
    history or None, the first moment to draw, the last, when each phase began). Made in
    ``--references`` (default ``--out``), or reused from there when its ``references.json`` was
    written for the same run (overrides and ``--ddp``), after both runs had passed that check."""
    where = Path(args.references) if args.references else out
    made, key = where / "references.json", {"overrides": run_overrides(args), "ddp": args.ddp}
    known = json.loads(made.read_text()) if made.exists() else {}
    if known.get("key") != key:
        made.unlink(missing_ok=True)
        known = {"key": key, **made_references(args, where)}
        harness.write_json(made, known)
    else:
        print(f"[fuzz_kill] the uninterrupted runs in {where} reused (made for the same run)", flush=True)
    rows = synced_rows([wandb_history(p) for p in wandb_logs(where / "reference" / "run")])
    return (outcome(where / "reference" / "run"), rows if args.logger == "wandb" else None, known["t_first"],
            known["total"], known["marks"])


def made_references(args: argparse.Namespace, where: Path) -> dict:
    """Run the two uninterrupted runs in ``where`` and check they agree: when to draw (``t_first``,
    ``total``) and when each phase began (``marks``); runs left there for another run are removed."""
    for d in ("reference", "timing"):
        shutil.rmtree(where / d, ignore_errors=True)
    where.mkdir(parents=True, exist_ok=True)
    timed_reference(command(args, where / "reference"), where / "reference.log")
    reference = outcome(where / "reference" / "run")
    total, marks = timed_reference(command(args, where / "timing"), where / "timing.log")
    rows = [synced_rows([wandb_history(p) for p in wandb_logs(where / d / "run")]) for d in ("reference", "timing")]
    if same(reference, outcome(where / "timing" / "run")) or rows[0] != rows[1]:
        raise SystemExit("two uninterrupted runs differ: the comparison cannot count anything (see timing.log)")
    if args.logger == "wandb" and not rows[0]:
        raise SystemExit("the uninterrupted run logged nothing to wandb (see reference.log)")
    t_first = min(marks.values(), default=0.0)  # start-up (imports, config) is not drawn: nothing is written then
    total = marks.get("outputs written", total)  # after the outputs only the exit is left: nothing to test
    return {"t_first": t_first, "total": total, "marks": marks}


def shown(when: float | str) -> str:
    return f"at {when:.1f}s" if isinstance(when, float) else f"at {when!r}"


def restart(args: argparse.Namespace, work: Path, log_path: Path, draw, logs: list[Path]) -> tuple[int, dict]:
    """``--repeat`` more signalled restarts, then the one restart that must finish: (its exit status,
    the checkpoints on disk before it). ``logs`` gains each new wandb offline log, in order."""
    sig = getattr(signal, f"SIG{args.signal}")
    with fresh_log(log_path) as log:
        for _ in range(args.repeat):
            signalled_run(command(args, work), draw(), sig, log, args.ddp, work)
            logs += [p for p in wandb_logs(work / "run") if p not in logs]
        saved = on_disk(work)
        log.write(f"[fuzz_kill] on disk before the restart: {json.dumps(saved)}\n")
        log.flush()
        rc = finish(start(command(args, work), log))
    logs += [p for p in wandb_logs(work / "run") if p not in logs]
    return rc, saved


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    sig = getattr(signal, f"SIG{args.signal}")
    if args.ddp and sig != signal.SIGKILL:
        raise SystemExit("--ddp kills one rank: use it with --signal KILL")
    out.mkdir(parents=True, exist_ok=True)
    reference, ref_wandb, t_first, total, marks = references(args, out)
    print(f"[fuzz_kill] reference {total:.1f}s; phases began at " +
          ", ".join(f"{k} {v:.1f}s" for k, v in sorted(marks.items(), key=lambda kv: kv[1])), flush=True)
    rng = random.Random(args.seed)

    def draw() -> float | str:
        return rng.choice(args.events) if args.at == "event" else rng.uniform(t_first, total)

    passed, counted, late, landed, failures, trials = 0, 0, 0, {}, [], []
    for i in range(2 * args.runs):
        if counted == args.runs:
            break
        work, when = out / f"run{i:03d}", draw()
        with fresh_log(out / f"run{i:03d}.signalled.log") as log:
            hit = signalled_run(command(args, work), when, sig, log, args.ddp, work)
        where = phase((out / f"run{i:03d}.signalled.log").read_text(errors="replace")) if hit else "finished first"
        if where in ("outputs written", "finished first"):
            late += 1
            if not isinstance(when, str):  # this run was faster than the timed one (a machine shared with
                total = max(t_first + 0.5, when)  # other work): later draws stay below where it had got to
            print(f"[fuzz_kill] draw {i}: SIG{args.signal} {shown(when)} landed after the outputs ({where}): "
                  f"not counted, drawn again", flush=True)
            continue
        logs = list(wandb_logs(work / "run"))
        rc, saved = restart(args, work, out / f"run{i:03d}.restarts.log", draw, logs)
        counted += 1
        landed[where] = landed.get(where, 0) + 1
        text = (out / f"run{i:03d}.restarts.log").read_text(errors="replace")
        problems = judge(reference, work, rc, saved, text, (ref_wandb, logs) if ref_wandb is not None else None)
        trials.append({"run": i, "signal_at": when, "phase": where, "on_disk": saved, "resumed_at": resumed_at(text),
                       "wandb_logs": [p.parent.name for p in logs], "passed": not problems})
        passed += not problems
        if problems:
            failures.append({"run": i, "phase": where, "problems": problems})
        resumed = ", ".join(f"{k} from step {v}" for k, v in saved.items() if v is not None) or "nothing on disk"
        print(f"[fuzz_kill] run {i}: SIG{args.signal} {shown(when)} ({where}; {resumed}), one restart: "
              f"{'passed' if not problems else 'FAILED: ' + '; '.join(problems)}", flush=True)
    print(f"[fuzz_kill] signals landed in: {', '.join(f'{k} {v}' for k, v in sorted(landed.items()))}"
          f"; {late} landed after the outputs (not counted)")
    print(f"[fuzz_kill] {passed}/{args.runs} passed: one restart each, resumed at or after the checkpoint on "
          f"disk, identical to the uninterrupted run (SIG{args.signal}{', one DDP rank' if args.ddp else ''}"
          f"{', one wandb run' if ref_wandb is not None else ''}, reference {total:.1f}s)")
    (out / "fuzz_kill.json").write_text(json.dumps({
        "runs": args.runs, "counted": counted, "passed": passed, "identical": passed, "after_outputs": late,
        "signal": args.signal, "ddp": args.ddp, "logger": args.logger, "at": args.at, "landed": landed,
        "failures": failures, "trials": trials, "reference_s": total}, indent=1))
    return 0 if passed == counted == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
