"""The miniature GLUE reproduction, one command: grid on dev, then seeds, then the table.

    python scripts/reproduce_glue.py --glue <GLUE dir> --out outputs/mini_glue

For every GLUE task kdrun knows (CoLA, SST-2, MRPC, STS-B, RTE, QNLI, MNLI, QQP, WNLI; ``--tasks``
chooses) and objective (finetune, logit, pkd, tinybert, minilm, ckd, mgskd, alp) on
``experiment=mini_glue`` (minilm_l6 teacher fine-tuned once per task on the whole training split
and cached, 3-layer truncated student on the preset's subsample):

1. grid: each objective at every learning rate of ``--grid-lr`` (and, for ckd, every
   ``objective.params.lambda_ckd`` of ``--ckd-lambda``) with ``--grid-seed``, one ``kdrun -m``
   multirun per task and objective (``OUT/grid/<task>/<objective>``);
2. the setting with the best dev score per (task, objective) is chosen (``OUT/chosen.json``), as
   the papers choose hyperparameters on dev;
3. seeds: each objective at its chosen setting with ``--seeds`` (six by default, other than the
   grid's, so the reported scores are not the ones the choice was made on; the exact two-sided
   sign-flip test cannot go below p = 2/2^n, which is 0.0625 with 5 seeds and 0.031 with 6, so 6
   is the fewest with which it can mark a difference at p < 0.05; ``OUT/seeds/<task>/<objective>``);
4. ``kdrun-report OUT/seeds``: mean ± std per task and the average, per objective, marks where an
   objective differs from finetune (paired over seeds), CSV with p-values, and the objective x task
   figure (``OUT/report``).

Every step is a kdrun multirun, so rerunning the command skips finished jobs and resumes
interrupted ones. ``--max-train-samples`` / ``--epochs`` scale the students' part of the study;
``--teacher-full`` (default) fine-tunes each task's teacher on its whole training split, as the
papers do (``--no-teacher-full``: on the students' subsample; ``--teacher-max-train-samples N``:
on N rows of the same shuffle); ``--dry-run`` prints the commands.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from kdrun.report.cli import collect
from kdrun.runtime.cache import write_json_atomic

# kdrun's GLUE tasks (conf/task/<name>.yaml) and their directories in the classic GLUE TSV layout
GLUE_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "rte": "RTE", "qnli": "QNLI",
             "mnli": "MNLI", "qqp": "QQP", "wnli": "WNLI"}
OBJECTIVES = ["finetune", "logit", "pkd", "tinybert", "minilm", "ckd", "mgskd", "alp"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--glue", required=True, help="GLUE root with the tasks' directories (CoLA/, SST-2/, MRPC/, "
                   "STS-B/, RTE/, QNLI/, MNLI/, QQP/, WNLI/)")
    p.add_argument("--conll", default=None, help="CoNLL-2000 directory for mgskd's chunker (default: beside --glue)")
    p.add_argument("--out", default="outputs/mini_glue")
    p.add_argument("--tasks", default=",".join(GLUE_DIRS), help=f"comma-separated, of {','.join(GLUE_DIRS)}")
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--grid-lr", default="2e-4,5e-4", help="learning rates tried on dev")
    p.add_argument("--ckd-lambda", default="0.01,0.1,1,10", help="objective.params.lambda_ckd values tried for ckd")
    p.add_argument("--grid-seed", type=int, default=0)
    p.add_argument("--seeds", default="1,2,3,4,5,6",
                   help="reported seeds (the exact sign-flip test's floor is 2/2^n: at least 6 for p < 0.05)")
    p.add_argument("--max-train-samples", type=int, default=None, help="override the students' subsample")
    p.add_argument("--teacher-full", action=argparse.BooleanOptionalAction, default=True,
                   help="fine-tune each task's teacher on its whole training split (default; --no-teacher-full: "
                        "on the students' subsample)")
    p.add_argument("--teacher-max-train-samples", type=int, default=None,
                   help="fine-tune the teacher on this many training rows instead (overrides --teacher-full)")
    p.add_argument("--epochs", type=float, default=None, help="override the preset's epochs per stage")
    p.add_argument("--extra", action="append", default=[], help="any further kdrun override (repeatable)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks.split(",") if t not in GLUE_DIRS]
    if unknown:
        p.error(f"--tasks: unknown {', '.join(unknown)}; kdrun's GLUE tasks are {', '.join(GLUE_DIRS)}")
    return args


def teacher_rows(args: argparse.Namespace) -> str:
    """The value of task.teacher_max_train_samples the options ask for."""
    if args.teacher_max_train_samples:
        return str(args.teacher_max_train_samples)
    return "all" if args.teacher_full else "same"


def common_overrides(args: argparse.Namespace, task: str) -> list[str]:
    conll = args.conll or str(Path(args.glue).parent / "conll2000")
    out = ["experiment=mini_glue", f"task={task}", f"task.data_dir={Path(args.glue) / GLUE_DIRS[task]}",
           f"spans.corpus_dir={conll}", f"task.teacher_max_train_samples={teacher_rows(args)}"]
    if args.max_train_samples:
        out.append(f"task.max_train_samples={args.max_train_samples}")
    if args.epochs:
        out.append(f"train.epochs={args.epochs}")
    return out + list(args.extra)


def kdrun_multirun(overrides: list[str], sweep_dir: Path, dry_run: bool) -> None:
    cmd = ["kdrun", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    print("$ " + " ".join(cmd), flush=True)
    if dry_run:
        return
    rc = subprocess.call(cmd)
    if rc != 0:  # failed jobs are recorded in their directories; the report lists them
        print(f"[reproduce_glue] kdrun exited with {rc}; continuing (kdrun-report lists failed jobs)", flush=True)


def grid(args: argparse.Namespace, objective: str) -> dict[str, str]:
    """The grid of one objective: {config key: comma-separated values}."""
    out = {"train.lr": args.grid_lr}
    if objective == "ckd" and args.ckd_lambda:
        out["objective.params.lambda_ckd"] = args.ckd_lambda
    return out


def choose(grid_dir: Path, keys: list[str]) -> dict[str, object] | None:
    """The grid point with the best dev score among the finished runs under ``grid_dir``."""
    runs, _ = collect([grid_dir])
    if not runs:
        return None
    best = max(runs, key=lambda r: r.value)
    return {"setting": {k: best.flat.get(k) for k in keys}, "dev": best.value, "metric": best.metric,
            "grid": {",".join(str(r.flat.get(k)) for k in keys): r.value for r in runs}}


def retire_other_settings(seeds_dir: Path, setting: dict[str, object], stale: Path) -> None:
    """Move seed runs of another setting (the choice changed after the grid grew) out of the
    reported directory, so the report never picks among settings on the seeds it reports."""
    import shutil

    runs, _ = collect([seeds_dir]) if seeds_dir.exists() else ([], [])
    for r in runs:
        if not all(_same(r.flat.get(k), v) for k, v in setting.items()):
            stale.mkdir(parents=True, exist_ok=True)
            shutil.move(str(r.path), str(stale / r.path.name))
            print(f"[reproduce_glue] moved {r.path} (not the chosen {setting}) to {stale}", flush=True)


def _same(a: object, b: object) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def run_objective(args: argparse.Namespace, task: str, objective: str, out: Path) -> dict[str, object] | None:
    common = [*common_overrides(args, task), f"objective={objective}"]
    points = grid(args, objective)
    kdrun_multirun([*common, *(f"{k}={v}" for k, v in points.items()), f"seed={args.grid_seed}"],
                   out / "grid" / task / objective, args.dry_run)
    chosen = None if args.dry_run else choose(out / "grid" / task / objective, list(points))
    setting = chosen["setting"] if chosen else {k: v.split(",")[0] for k, v in points.items()}
    if not args.dry_run:
        retire_other_settings(out / "seeds" / task / objective, setting, out / "stale" / task / objective)
    kdrun_multirun([*common, *(f"{k}={v}" for k, v in setting.items()), f"seed={args.seeds}"],
                   out / "seeds" / task / objective, args.dry_run)
    return chosen


def run_task(args: argparse.Namespace, task: str, out: Path) -> dict[str, object]:
    return {obj: run_objective(args, task, obj, out) for obj in args.objectives.split(",")}


def merged_choices(path: Path, chosen: dict, args: argparse.Namespace, seconds: float) -> dict:
    """chosen.json with this invocation's choices added to those of earlier invocations (a rerun for
    a subset of tasks or objectives updates those entries), and each invocation's wall time."""
    import json

    old = json.loads(path.read_text()) if path.exists() else {"chosen": {}, "invocations": []}
    if "invocations" not in old:  # written by an earlier version: one invocation's keys at the top
        old["invocations"] = [{k: v for k, v in old.items() if k != "chosen"}]
    for task, objectives in chosen.items():
        old["chosen"].setdefault(task, {}).update(objectives)
    old.setdefault("invocations", []).append(
        {"tasks": args.tasks, "objectives": args.objectives, "grid_lr": args.grid_lr, "ckd_lambda": args.ckd_lambda,
         "grid_seed": args.grid_seed, "seeds": args.seeds, "teacher_max_train_samples": teacher_rows(args),
         "wall_seconds_until_report": round(seconds, 1)})
    return {"chosen": old["chosen"], "invocations": old["invocations"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    t0 = time.time()
    chosen = {task: run_task(args, task, out) for task in args.tasks.split(",")}
    report = ["kdrun-report", str(out / "seeds"), "--out", str(out / "report"),
              "--figure", str(out / "report" / "objectives.png")]
    print("$ " + " ".join(report), flush=True)
    if args.dry_run:
        return 0
    write_json_atomic(out / "chosen.json", merged_choices(out / "chosen.json", chosen, args, time.time() - t0))
    rc = subprocess.call(report)
    print(f"[reproduce_glue] wall time {time.time() - t0:.0f}s; chosen settings in {out / 'chosen.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
