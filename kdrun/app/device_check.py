"""``kdrun-doctor --device-check``: the measurements to take on a new GPU machine, each in its own process.

    kdrun-doctor --device-check --out DIR [--fast] [--budget-s 420] [--tokenizer DIR] [--checks a,b]
    python -m kdrun.app.doctor --device-check --out DIR        (the same, where no console script exists)

Every check runs in a child process of its own process group (setsid) under a hard
timeout, the smaller of its own limit and what is left of the whole budget; at the timeout the whole
group gets SIGKILL, so a CUDA call that never returns and inductor's compile workers end with it.
As soon as a check ends, one JSON line (name, status pass / fail / skip / timeout, figures, seconds)
is appended to ``DIR/device_check.jsonl``, flushed and fsync'd, and a table row is printed: whatever
stops the doctor, the lines written so far stay. A check that cannot start in what is left of the
budget is recorded as skipped. Checks, most valuable first (kdrun.app.device_checks holds their
bodies):

1. tokens/s of kdrun's training step for logit KD and CKD at the papers' shape (a BERT-base-shaped
   teacher, 12 x 768, into a 4 x 312 student; 32 x 128 padded batches; bf16 on CUDA), eager, graphed
   (``train.cuda_graphs``, CUDA only) and compiled (``train.compile``), with the model FLOPs per step
   and the fraction of the device's bf16 dense peak (known devices);
2. CKD's and MGSKD's loss and gradients on the device, eager and compiled, against an fp64 CPU
   reference;
3. a real 30-step ``python -m kdrun`` run per step mode, with its compilations (results.json), graph
   breaks and host syncs, and 20 steps under ``torch.cuda.set_sync_debug_mode`` (CUDA only);
4. MGSKD (eager and graphed), TinyBERT and MiniLM throughput;
5. tiny runs in bf16 and fp16 and with ``teacher.store=on``, kdrun-export of a trained student, the
   fp16 overflow skip (CUDA only) and the whole kdrun-doctor.

On CUDA each check (and each process a check starts) is a new interpreter, so that none inherits
a CUDA state. On a CPU they are forked from the doctor after it imported their libraries once
(:func:`kdrun.runtime.forkrun.fork_module`; ``KDRUN_FORKRUN=0``: new interpreters there too), which
saves some 5 s of imports per process.

``--fast``: tiny shapes on any device (CUDA-only checks recorded as skipped, compiled rows through
the ``aot_eager`` backend; TinyBERT's and MiniLM's steps and the whole doctor left out), about a
minute on a 2-core CPU. The tiny runs need a tokenizer: the
all-MiniLM package's (``kdrun[minilm]``) or a folder saved by ``scripts/setup/device_wheels.sh``
(``--tokenizer DIR`` or ``$KDRUN_TINY_TOKENIZER``). Exit status 0 when no check failed or timed out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JSONL = "device_check.jsonl"
DEFAULT_BUDGET_S = 420.0
FLOOR_S = 10.0  # a check is not started with less than this left of the budget (--fast: FAST_FLOOR_S)
FAST_FLOOR_S = 3.0
TAIL_CHARS = 2500  # of a failed check's output, kept in its line


@dataclass(frozen=True)
class Spec:
    """One check: ``fn`` (a function of kdrun.app.device_checks) called with ``args`` in the child."""

    name: str
    fn: str
    args: tuple = ()
    limit_s: float = 60.0  # on a GPU
    fast_s: float | None = 20.0  # with --fast; None: left out of --fast
    cuda_only: bool = False


def step_specs(objectives: tuple[str, ...], mode: str, limit: float, fast: float | None) -> list[Spec]:
    return [Spec(f"step {o} {mode}", "step_throughput", (o, mode), limit, fast, mode == "graphed")
            for o in objectives]


def checks() -> list[Spec]:
    """Every check, most valuable first."""
    pair = ("logit", "ckd")
    return [
        Spec("environment", "environment", (), 40, 15),
        *step_specs(pair, "eager", 60, 20), *step_specs(pair, "graphed", 150, 60),
        *step_specs(pair, "compiled", 120, 25),
        Spec("exact ckd", "exactness", ("ckd",), 90, 30), Spec("exact mgskd", "exactness", ("mgskd",), 90, 30),
        Spec("run eager", "real_run", ("eager",), 90, 30),
        Spec("run graphed", "real_run", ("graphed",), 150, 60, True),
        Spec("run compiled", "real_run", ("compiled",), 150, 60),
        Spec("syncs", "syncs", (), 60, 30, True),
        *step_specs(("mgskd",), "eager", 60, 20), *step_specs(("tinybert", "minilm"), "eager", 60, None),
        *step_specs(("mgskd",), "graphed", 150, 60),
        Spec("tiny bf16", "tiny_run", ("bf16",), 90, 25), Spec("tiny fp16", "tiny_run", ("fp16",), 90, 25),
        Spec("tiny teacher store", "tiny_run", ("store",), 90, 30), Spec("export", "export", (), 120, 40),
        Spec("fp16 skip", "fp16_skip", (), 40, 20, True), Spec("doctor", "doctor", (), 240, None),
    ]


def test_checks() -> list[Spec]:
    """Checks the tests add ($KDRUN_DEVICE_CHECK_EXTRA=sleep): one that overruns its limit
    ($KDRUN_DEVICE_CHECK_EXTRA_S, default 3 s) after starting a grandchild of its own."""
    if os.environ.get("KDRUN_DEVICE_CHECK_EXTRA") != "sleep":
        return []
    limit = float(os.environ.get("KDRUN_DEVICE_CHECK_EXTRA_S", "3"))
    return [Spec("overrun", "overrun", (), limit, limit)]


def planned(fast: bool, wanted: list[str] | None) -> list[Spec]:
    """The checks of this mode, in order (the test-only one second); ``wanted``: names or name prefixes."""
    specs = [s for s in checks() if not fast or s.fast_s is not None]
    specs[1:1] = test_checks()
    if wanted:
        unknown = [w for w in wanted if not any(s.name.startswith(w) for s in specs)]
        if unknown:
            names = ", ".join(s.name for s in specs)
            raise SystemExit(f"kdrun-doctor: --checks {','.join(unknown)}: no such check; the checks are: {names}")
        specs = [s for s in specs if any(s.name.startswith(w) for w in wanted)]
    return specs


# -------------------------------------------------------------------------------- the JSON lines

def append_line(path: Path, row: dict[str, Any]) -> None:
    """One JSON line appended, flushed and fsync'd: it survives whatever ends the doctor next."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def headline(row: dict[str, Any]) -> str:
    """A table cell: the figures that matter most of a check's line."""
    f = row.get("figures", {})
    if row["status"] in ("skip", "timeout") or f.get("error"):
        return str(f.get("reason") or f.get("error") or "").splitlines()[0][:90] if f else ""
    if "tokens_per_s" in f:
        peak = f"{f['peak_fraction']:.1%} of peak" if f.get("peak_fraction") is not None else "peak unknown"
        return (f"{f['tokens_per_s']:,.0f} tok/s, {f['ms_per_step']:.1f} ms/step, "
                f"{f['achieved_tflop_s']:.3g} TFLOP/s ({peak})")
    if "rows" in f:
        return "; ".join(f"{k}: {v.get('status', '?')}" for k, v in f["rows"].items())[:90]
    keys = ("device", "compilations", "graph_breaks", "syncs_outside_host_sections", "seconds_run", "files")
    return ", ".join(f"{k} {f[k]}" for k in keys if k in f)[:90]


def print_row(row: dict[str, Any]) -> None:
    print(f"| {row['name']:<22} | {row['status']:<7} | {row['seconds']:>6.1f} | {headline(row)} |", flush=True)


# ------------------------------------------------------------------------------- the child process

def kill_group(pgid: int) -> None:
    """SIGKILL to every process of the group (the check's child and whatever it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def child_args(spec: Spec, args: argparse.Namespace, tmp: Path, result: Path) -> list[str]:
    """The arguments of ``python -m kdrun.app.device_checks`` for the check ``spec``."""
    cmd = ["--check", spec.name, "--tmp", str(tmp), "--result", str(result), "--parent", str(os.getpid())]
    if args.fast:
        cmd.append("--fast")
    if args.tokenizer:
        cmd += ["--tokenizer", str(args.tokenizer)]
    return cmd


CHILD_ENV = (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("WANDB_MODE", "offline"),
             ("TOKENIZERS_PARALLELISM", "false"), ("PYTHONUNBUFFERED", "1"))


def child_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in CHILD_ENV:
        env.setdefault(key, value)
    env["KDRUN_CACHE_DIR"] = str(tmp / "cache")
    return env


def forks_checks(cuda: bool) -> bool:
    """Whether the checks are forked from the doctor (after it imported their libraries once) rather than
    started as new interpreters: on a CPU, unless ``KDRUN_FORKRUN=0``. On CUDA every check is a new
    interpreter, so that no check inherits a CUDA state from the process that started it."""
    from kdrun.runtime.forkrun import enabled

    return not cuda and enabled()


def preload() -> None:
    """The checks' libraries imported once in the doctor, under the settings the checks run with (some are
    read at import), before any check is forked from it."""
    import importlib

    from kdrun.runtime.forkrun import PRELOAD

    for key, value in CHILD_ENV:
        os.environ.setdefault(key, value)
    for module in (*PRELOAD, "kdrun.app.device_checks", "kdrun.app.doctor_steps", "torch._dynamo"):
        importlib.import_module(module)


def run_child(args: list[str], env: dict[str, str], timeout: float, fork: bool) -> tuple[int | None, str]:
    """(exit status, or None at the timeout; the output's tail) of ``python -m kdrun.app.device_checks
    ARGS``. The child leads a new process group, which is killed whole at the timeout and after the child
    ends (no worker outlives its check)."""
    from kdrun.runtime.forkrun import start_module

    with tempfile.TemporaryFile() as log:
        proc = start_module("kdrun.app.device_checks", args, fork, env, log.fileno(), log.fileno(), new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:  # Ctrl-C or SIGTERM of the doctor: the check's group goes with it
            kill_group(proc.pid)
            raise
        kill_group(proc.pid)
        proc.wait()
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - TAIL_CHARS))
        return rc, log.read().decode("utf-8", "replace")


def run_one(spec: Spec, args: argparse.Namespace, tmp: Path, timeout: float, fork: bool) -> dict[str, Any]:
    """The check's line: its figures (from the child's result file), status and seconds."""
    result = tmp / f"result-{spec.name.replace(' ', '_')}.json"
    t0 = time.perf_counter()
    rc, tail = run_child(child_args(spec, args, tmp, result), child_env(tmp), timeout, fork)
    seconds = time.perf_counter() - t0
    if rc is None:
        limit = spec.fast_s if args.fast else spec.limit_s
        figures = {"reason": f"killed with its process group after {timeout:.0f} s (the smaller of its limit, "
                             f"{limit:.0f} s{' with --fast' if args.fast else ''}, and the budget left when it "
                             "started)", "output_tail": tail}
        return {"name": spec.name, "status": "timeout", "figures": figures, "seconds": seconds}
    if result.exists():
        figures = json.loads(result.read_text())
        status = figures.pop("status")
    else:
        figures, status = {"error": f"the check's process exited with {rc} and no result"}, "fail"
    if status == "fail" or rc:
        figures["output_tail"] = tail
        status = "fail"
    return {"name": spec.name, "status": status, "figures": figures, "seconds": seconds}


def skip_line(spec: Spec, reason: str) -> dict[str, Any]:
    return {"name": spec.name, "status": "skip", "figures": {"reason": reason}, "seconds": 0.0}


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------ driver

def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every planned check in order under the total budget; each line written as it ends."""
    out = args.out / JSONL
    args.out.mkdir(parents=True, exist_ok=True)
    specs = planned(args.fast, args.checks.split(",") if args.checks else None)
    cuda = device_type() == "cuda"
    rows, fork = [], forks_checks(cuda)
    if fork and any(not s.cuda_only for s in specs):
        preload()  # before the budget starts: on CUDA there is nothing to import here
    deadline, floor = time.monotonic() + args.budget_s, FAST_FLOOR_S if args.fast else FLOOR_S
    print(f"kdrun-doctor --device-check: {len(specs)} checks, budget {args.budget_s:.0f} s, lines in {out}",
          flush=True)
    print("| check                  | status  | secs   | figures |\n|---|---|---:|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="kdrun-device-check-") as tmp_s:
        for spec in specs:
            left = deadline - time.monotonic()
            limit = spec.fast_s if args.fast else spec.limit_s
            if spec.cuda_only and not cuda:
                row = skip_line(spec, "needs CUDA")
            elif left < floor:
                row = skip_line(spec, f"not started: {max(left, 0):.0f} s of the {args.budget_s:.0f} s budget left")
            else:
                row = run_one(spec, args, Path(tmp_s), min(limit, left), fork)
            append_line(out, row)
            print_row(row)
            rows.append(row)
    return rows


def meta_line(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    return {"name": "meta", "status": "pass", "seconds": 0.0, "figures": {
        "command": shlex.join(["kdrun-doctor", *argv]), "fast": args.fast, "budget_s": args.budget_s,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "python": sys.version.split()[0]}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """kdrun-doctor's options of the device check."""
    g = ap.add_argument_group("device check (--device-check)")
    g.add_argument("--device-check", action="store_true",
                   help="the GPU measurements, each check in its own process group under a hard timeout, one "
                        f"JSON line each in DIR/{JSONL} (see docs/speed.md)")
    g.add_argument("--fast", action="store_true",
                   help="tiny shapes on any device (a dress rehearsal, about 1 min on a 2-core CPU)")
    g.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="N",
                   help=f"the whole check's time in seconds (default {DEFAULT_BUDGET_S:.0f}); checks that cannot "
                        "start in what is left are recorded as skipped")
    g.add_argument("--tokenizer", type=Path, default=os.environ.get("KDRUN_TINY_TOKENIZER") or None, metavar="DIR",
                   help="the tiny runs' tokenizer folder (default $KDRUN_TINY_TOKENIZER, else the all-MiniLM "
                        "package's); scripts/setup/device_wheels.sh saves one")
    g.add_argument("--checks", default=None, metavar="A,B", help="only the checks whose names start so")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.out is None:
        raise SystemExit("kdrun-doctor --device-check: --out DIR is required (the folder of device_check.jsonl)")
    args.out.mkdir(parents=True, exist_ok=True)
    append_line(args.out / JSONL, meta_line(args, argv))
    t0 = time.perf_counter()
    rows = run_all(args)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "timeout", "skip")}
    print(f"kdrun-doctor --device-check: {counts['pass']} passed, {counts['fail']} failed, {counts['timeout']} "
          f"timed out, {counts['skip']} skipped in {time.perf_counter() - t0:.0f} s; lines: {args.out / JSONL}",
          flush=True)
    return 0 if counts["fail"] == counts["timeout"] == 0 else 1
