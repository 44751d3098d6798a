"""GLUE studies, one command each: grid on dev, then seeds, then the table.

    python scripts/study/reproduce_glue.py --glue <GLUE dir> --recipe glue_cpu   # the study in which students learn
    python scripts/study/reproduce_glue.py --glue <GLUE dir>                     # the miniature study (mini_glue)

``--recipe glue_cpu`` (``experiment=glue_cpu``) is the CPU-scale study: CoLA, SST-2,
MRPC and STS-B, teachers on the whole training split (SST-2's capped at 16,000 rows), 3-layer
students for 3 epochs per stage on 2,000 rows at 128 tokens, every objective of the papers on
SST-2 and STS-B (finetune, logit, pkd, tinybert, minilm, ckd, mgskd, alp and ckd_gradnorm) and the
two baselines, finetune and logit, on MRPC and CoLA (``RECIPES`` below; ``--tasks`` /
``--objectives`` choose others); after the report it prints the finetune criterion, teacher against
student per task (``criterion_lines``), and every objective against logit KD paired by seed
(``versus_logit_lines``; the report pairs with finetune), into ``OUT/report`` too.
``--measure-lengths`` prints the share of rows that each candidate max length would cut, per task
and split, with the teacher's tokenizer.

``--recipe claims``: the papers' claims as arms on ``experiment=glue_cpu``, claim by claim, each at
the setting the GLUE study chose on dev (a grid where it chose none), then the seeds; the table goes
to docs/claims.md (kdrun/report/claims_plan.py, kdrun/report/claims.py).

``--recipe mini_glue`` (the default) is the miniature study of docs/reports.md (32 steps per stage):
every GLUE task kdrun knows and objective on ``experiment=mini_glue``. The recipes run one protocol:

1. grid: each objective at every learning rate of ``--grid-lr`` (and, for ckd and ckd_gradnorm, every
   ``objective.params.lambda_ckd`` of ``--ckd-lambda``) with ``--grid-seed``, one ``kdrun -m``
   multirun per task and objective (``OUT/grid/<task>/<objective>``);
2. the setting with the best dev score per (task, objective) is chosen (``OUT/chosen.json``), as
   the papers choose hyperparameters on dev;
3. seeds: each objective at its chosen setting with ``--seeds`` (six by default, other than the
   grid's; the exact sign-flip test cannot go below p = 2/2^n, 0.031 with 6 seeds, so 6 is the
   fewest with which it can mark a difference at p < 0.05; ``OUT/seeds/<task>/<objective>``);
4. ``kdrun-report OUT/seeds``: mean ± std per task and the average, per objective, marks where an
   objective differs from finetune (paired over seeds), CSV with p-values, and the objective x task
   figure (``OUT/report``).

Every step is a kdrun multirun, so rerunning the command skips finished jobs and resumes
interrupted ones. ``--max-train-samples`` / ``--epochs`` scale the students' part of the study;
``--teacher-full`` (default) fine-tunes each task's teacher on its whole training split, as the
papers do (``--no-teacher-full``: on the students' subsample; ``--teacher-max-train-samples N``:
on N rows of the same shuffle); ``--dry-run`` prints the commands; ``--jobs N`` runs N (task,
objective) pipelines at once (on a GPU; each task's teacher is still fine-tuned once), and the
report's ``runs.csv`` lists every finished run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

from kdrun.report.cli import collect
from kdrun.runtime import harness
from kdrun.runtime.cache import write_json_atomic, write_text_atomic
from kdrun.runtime.packing import usable_cores

# kdrun's GLUE tasks (conf/task/<name>.yaml) and their directories in the classic GLUE TSV layout
GLUE_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "rte": "RTE", "qnli": "QNLI",
             "mnli": "MNLI", "qqp": "QQP", "wnli": "WNLI"}
OBJECTIVES = ["finetune", "logit", "pkd", "tinybert", "minilm", "ckd", "mgskd", "alp"]
# objectives whose grid includes objective.params.lambda_ckd
CKD_GRID = ("ckd", "ckd_gradnorm")


class Recipe(NamedTuple):
    """A study's defaults; every one can be overridden on the command line."""

    experiment: str
    tasks: tuple[str, ...]
    objectives: dict[str, tuple[str, ...]]  # per task; "*" for any other task
    grid_lr: str
    ckd_lambda: str
    out: str
    teacher_rows: dict[str, int] = {}  # per-task cap on the teacher's rows (read only)


ALL_OBJECTIVES = (*OBJECTIVES, "ckd_gradnorm")
RECIPES = {
    "mini_glue": Recipe("mini_glue", tuple(GLUE_DIRS), {"*": tuple(OBJECTIVES)}, "2e-4,5e-4", "0.01,0.1,1,10",
                        "outputs/mini_glue"),
    # Every objective on SST-2 and STS-B (a classification and a regression task, 13 and 28 tokens a
    # row on average), the two baselines on MRPC (53 tokens a row: four times SST-2's cost per step)
    # and CoLA, sized for about five hours of an idle 2-core CPU (docs/results.md).
    "glue_cpu": Recipe("glue_cpu", ("cola", "sst2", "mrpc", "stsb"),
                       {"sst2": ALL_OBJECTIVES, "stsb": ALL_OBJECTIVES, "*": ("finetune", "logit")},
                       "1e-4,3e-4", "0.01,0.1", "outputs/glue_cpu", teacher_rows={"sst2": 16000}),
    # The claims study on the glue_cpu scale (arms and order: kdrun/report/claims_plan.py).
    "claims": Recipe("glue_cpu", ("cola", "sst2", "stsb"), {"*": ()}, "1e-4,3e-4", "0.01,0.1", "outputs/claims",
                     teacher_rows={"sst2": 16000}),
}
REPO = harness.REPO
GLUE_CPU_RUNS = REPO / "docs" / "data" / "glue_cpu_runs.csv"
CLAIMS_RUNS = REPO / "docs" / "data" / "claims_runs.csv"  # every run of the claims recipe so far
# The finetune criterion of the glue_cpu study: (kind, value) per task, on the task's main metric.
CRITERIA = {"sst2": ("of_teacher", 0.90), "mrpc": ("of_teacher", 0.90), "stsb": ("at_least", 0.70),
            "cola": ("above_zero", None)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--glue", required=True, help="GLUE root with the tasks' directories (CoLA/, SST-2/, MRPC/, "
                   "STS-B/, RTE/, QNLI/, MNLI/, QQP/, WNLI/)")
    p.add_argument("--conll", default=None, help="CoNLL-2000 directory for mgskd's chunker (default: beside --glue)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="mini_glue",
                   help="glue_cpu: the study in which students learn; claims: the papers' claims on its scale; "
                        "mini_glue: the miniature study")
    p.add_argument("--out", default=None, help="output directory (default: outputs/<recipe>)")
    p.add_argument("--tasks", default=None, help=f"comma-separated, of {','.join(GLUE_DIRS)} (default: the recipe's)")
    p.add_argument("--objectives", default=None, help="comma-separated, for every task (default: the recipe's)")
    p.add_argument("--grid-lr", default=None, help="learning rates tried on dev (default: the recipe's)")
    p.add_argument("--ckd-lambda", default=None,
                   help="objective.params.lambda_ckd values tried for ckd and ckd_gradnorm (default: the recipe's)")
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
    p.add_argument("--jobs", type=int, default=1,
                   help="(task, objective) pipelines run at once (default 1; on a GPU several share the card: "
                        "each task's first objective runs alone first, so its teacher is fine-tuned once); "
                        "--recipe claims: each arm's seeds N at a time (launcher=packed, cores/N threads each)")
    p.add_argument("--claims", default=None,
                   help="--recipe claims: only the claims whose names start with these (comma-separated, any "
                        "case, e.g. 'CKD,ALP'; names in docs/claims.md)")
    p.add_argument("--ignore-recorded", action="store_true",
                   help="--recipe claims: rerun arms whose seeds docs/data/claims_runs.csv records, and build the "
                        "table from this run's directories alone")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--measure-lengths", action="store_true",
                   help="print the share of rows each max length would cut (per task and split) and exit")
    args = p.parse_args(argv)
    recipe = RECIPES[args.recipe]
    args.out = args.out or recipe.out
    args.tasks = args.tasks or ",".join(recipe.tasks)
    args.grid_lr = args.grid_lr or recipe.grid_lr
    args.ckd_lambda = recipe.ckd_lambda if args.ckd_lambda is None else args.ckd_lambda
    if args.claims and args.recipe != "claims":
        p.error("--claims: only with --recipe claims")
    if args.claims:
        from kdrun.report.claims_plan import names

        if not any(n.lower().startswith(x.strip().lower()) for n in names() for x in args.claims.split(",")):
            p.error(f"--claims {args.claims!r} names no claim or probe the recipe runs; its claims and probes: "
                    f"{'; '.join(names())}")
    unknown = [t for t in args.tasks.split(",") if t not in GLUE_DIRS]
    if unknown:
        p.error(f"--tasks: unknown {', '.join(unknown)}; kdrun's GLUE tasks are {', '.join(GLUE_DIRS)}")
    return args


def objectives_for(args: argparse.Namespace, task: str) -> list[str]:
    """The objectives run on ``task``: --objectives, else the recipe's for the task."""
    if args.objectives:
        return args.objectives.split(",")
    plan = RECIPES[args.recipe].objectives
    return list(plan.get(task, plan["*"]))


def teacher_rows(args: argparse.Namespace, task: str | None = None) -> str:
    """The value of task.teacher_max_train_samples the options (and the recipe, per task) ask for."""
    if args.teacher_max_train_samples:
        return str(args.teacher_max_train_samples)
    if not args.teacher_full:
        return "same"
    cap = RECIPES[args.recipe].teacher_rows.get(task) if task else None
    return str(cap) if cap else "all"


def common_overrides(args: argparse.Namespace, task: str) -> list[str]:
    conll = args.conll or str(Path(args.glue).parent / "conll2000")
    out = [f"experiment={RECIPES[args.recipe].experiment}", f"task={task}",
           f"task.data_dir={Path(args.glue) / GLUE_DIRS[task]}", f"spans.corpus_dir={conll}",
           f"task.teacher_max_train_samples={teacher_rows(args, task)}"]
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
    if objective in CKD_GRID and args.ckd_lambda:
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


def run_objective(args: argparse.Namespace, task: str, objective: str, out: Path,
                  after_grid: Callable[[], object] | None = None) -> dict[str, object] | None:
    common = [*common_overrides(args, task), f"objective={objective}"]
    points = grid(args, objective)
    kdrun_multirun([*common, *(f"{k}={v}" for k, v in points.items()), f"seed={args.grid_seed}"],
                   out / "grid" / task / objective, args.dry_run)
    if after_grid is not None:
        after_grid()
    chosen = None if args.dry_run else choose(out / "grid" / task / objective, list(points))
    setting = chosen["setting"] if chosen else {k: v.split(",")[0] for k, v in points.items()}
    if not args.dry_run:
        retire_other_settings(out / "seeds" / task / objective, setting, out / "stale" / task / objective)
    kdrun_multirun([*common, *(f"{k}={v}" for k, v in setting.items()), f"seed={args.seeds}"],
                   out / "seeds" / task / objective, args.dry_run)
    return chosen


def run_task(args: argparse.Namespace, task: str, out: Path) -> dict[str, object]:
    return {obj: run_objective(args, task, obj, out) for obj in objectives_for(args, task)}


def run_all(args: argparse.Namespace, out: Path) -> dict[str, dict[str, object]]:
    """Every task's pipelines: one after another, or ``--jobs`` at once. With several jobs, each
    task's first objective starts first (its first run fine-tunes and caches the task's teacher);
    the task's other objectives wait until that objective's grid has finished, so no two runs
    fine-tune the same teacher, and the longest pipelines (the larger grids) start first."""
    tasks = args.tasks.split(",")
    if args.jobs <= 1 or args.dry_run:
        return {task: run_task(args, task, out) for task in tasks}
    import threading
    from concurrent.futures import ThreadPoolExecutor

    plan = {task: objectives_for(args, task) for task in tasks}
    ready = {task: threading.Event() for task in tasks}
    rest = sorted(((t, o) for t, objs in plan.items() for o in objs[1:]), key=lambda p: -len(grid(args, p[1])))

    def first(task: str) -> dict[str, object] | None:
        try:
            return run_objective(args, task, plan[task][0], out, after_grid=ready[task].set)
        finally:
            ready[task].set()

    def later(task: str, objective: str) -> dict[str, object] | None:
        ready[task].wait()
        return run_objective(args, task, objective, out)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # FIFO: every first is taken before a later
        futures = {(t, plan[t][0]): pool.submit(first, t) for t in tasks}
        futures.update({pair: pool.submit(later, *pair) for pair in rest})
        return {task: {o: futures[(task, o)].result() for o in plan[task]} for task in tasks}


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
        {"recipe": args.recipe, "tasks": args.tasks,
         "objectives": args.objectives or {t: ",".join(objectives_for(args, t)) for t in args.tasks.split(",")},
         "grid_lr": args.grid_lr, "ckd_lambda": args.ckd_lambda, "grid_seed": args.grid_seed, "seeds": args.seeds,
         "teacher_max_train_samples": {t: teacher_rows(args, t) for t in args.tasks.split(",")},
         "wall_seconds_until_report": round(seconds, 1)})
    return {"chosen": old["chosen"], "invocations": old["invocations"]}


# ------------------------------------------------------------------------------ the finetune criterion

def _main_value(metrics: dict, metric: str) -> float | None:
    """``metric`` from {split: {metric: value}} (the first split) or from a flat {metric: value}."""
    if metric in metrics:
        return float(metrics[metric])
    for values in metrics.values():
        if isinstance(values, dict) and metric in values:
            return float(values[metric])
    return None


def criterion_rows(seeds_dir: Path) -> list[dict]:
    """Per task of the glue_cpu criterion with finetune runs under ``seeds_dir``: the teacher's and the
    finetune students' dev scores (main metric), the threshold, and whether the mean reaches it."""
    runs, _ = collect([seeds_dir])
    rows = []
    for task, (kind, value) in CRITERIA.items():
        mine = [r for r in runs if r.task == task and r.objective == "finetune"]
        if not mine:
            continue
        values = [r.value for r in mine]
        teachers = {v for r in mine
                    if (v := _main_value((json.loads((r.path / "results.json").read_text()).get("teacher") or {})
                                         .get("metrics") or {}, r.metric)) is not None}
        teacher = statistics.fmean(teachers) if teachers else None
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        if kind == "of_teacher":
            threshold = None if teacher is None else value * teacher
            rule = f">= {value:.0%} of the teacher"
        elif kind == "at_least":
            threshold, rule = value, f">= {value * 100:.0f}"
        else:  # clearly above 0: the mean's two standard errors above it
            threshold, rule = 2 * std / math.sqrt(len(values)), "> 0 by 2 standard errors"
        base = mine[0].baseline
        rows.append({"task": task, "metric": mine[0].metric, "teacher": teacher, "mean": mean, "std": std,
                     "n": len(values), "rule": rule, "threshold": threshold,
                     "met": None if threshold is None else mean >= threshold if kind != "above_zero" else
                     mean > threshold, "baseline": None if base is None or base.undefined else base.value})
    return rows


def criterion_lines(seeds_dir: Path) -> list[str]:
    """The criterion as printed: teacher against the finetune student per task, met or by how much missed."""
    def pct(x: float | None) -> str:
        return "?" if x is None else f"{x * 100:.2f}"

    lines = ["finetune criterion (dev, main metric x100): task | teacher | finetune student mean ± std (n) | "
             "rule | threshold | result"]
    for r in criterion_rows(seeds_dir):
        if r["met"] is None:
            result = "unknown (no teacher score recorded)"
        elif r["met"]:
            result = "met"
        else:
            result = f"missed by {(r['threshold'] - r['mean']) * 100:.2f}"
        if r["baseline"] is not None and r["threshold"] is not None and r["threshold"] <= r["baseline"]:
            result += f" (the constant predictor's {pct(r['baseline'])} meets this threshold too)"
        lines.append(f"  {r['task']} {r['metric']} | {pct(r['teacher'])} | {pct(r['mean'])} ± {pct(r['std'])} "
                     f"({r['n']}) | {r['rule']} | {pct(r['threshold'])} | {result}")
    return lines


# ------------------------------------------------------------------------ against logit KD

def versus_logit_lines(seeds_dir: Path) -> list[str]:
    """Each objective against ``logit`` per task, paired by seed (kdrun-report pairs with finetune):
    the mean difference (x100) and the exact sign-flip and paired t-test p-values."""
    from kdrun.report.significance import paired_t_p, sign_flip_p

    runs, _ = collect([seeds_dir])
    by: dict[tuple[str, str], dict[int, float]] = {}
    for r in runs:
        by.setdefault((r.task, r.objective), {})[r.seed] = r.value
    lines = ["against logit (paired by seed; dev, main metric x100): task objective | n | mean difference | "
             "p sign-flip | p t-test"]
    for (task, objective), mine in sorted(by.items()):
        base = by.get((task, "logit"))
        if objective == "logit" or not base:
            continue
        seeds = sorted(set(mine) & set(base))
        if not seeds:
            continue
        a, b = [mine[s] for s in seeds], [base[s] for s in seeds]
        diffs = [x - y for x, y in zip(a, b)]
        p_flip, _ = sign_flip_p(diffs)
        p_t = paired_t_p(a, b)
        lines.append(f"  {task} {objective} | {len(seeds)} | {statistics.fmean(diffs) * 100:+.2f} | "
                     f"{p_flip:.3g} | {'—' if p_t is None else f'{p_t:.3g}'}")
    return lines


# ----------------------------------------------------------------------------------- lengths

def runs_csv(out: Path) -> str:
    """One row per finished run of the study (grid and seeds): its setting, dev score, teacher's
    score, device, precision and seconds, so every number of the report can be checked."""
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["phase", "task", "objective", "seed", "lr", "lambda_ckd", "metric", "dev", "teacher_dev",
                "device", "precision", "run_seconds"])
    for phase in ("grid", "seeds"):
        runs, _ = collect([out / phase]) if (out / phase).exists() else ([], [])
        for r in sorted(runs, key=lambda r: (r.task, r.objective, r.seed, str(r.flat.get("train.lr")))):
            res = json.loads((r.path / "results.json").read_text())
            teacher = _main_value((res.get("teacher") or {}).get("metrics") or {}, r.metric)
            w.writerow([phase, r.task, r.objective, r.seed, r.flat.get("train.lr"),
                        r.flat.get("objective.params.lambda_ckd", ""), r.metric, f"{100 * r.value:.2f}",
                        "" if teacher is None else f"{100 * teacher:.2f}", res.get("device"), res.get("precision"),
                        round((res.get("timings") or {}).get("total_s", 0.0), 1)])
    return buf.getvalue()


def length_lines(args: argparse.Namespace, lengths: tuple[int, ...] = (64, 128, 256)) -> list[str]:
    """The share of rows longer than each max length, per task and split, with the teacher's tokenizer
    (the glue_cpu recipe's: all-MiniLM-L6-v2's uncased WordPiece)."""
    from kdrun.app.preflight import preflight
    from kdrun.config import compose
    from kdrun.models.loading import load_tokenizer
    from kdrun.tasks.data.sources import load_task_data

    lines = [f"task split rows: share of rows cut at max length {', '.join(map(str, lengths))} (longest row)"]
    for task in args.tasks.split(","):
        data_dir = Path(args.glue) / GLUE_DIRS[task]
        if not data_dir.exists():
            lines.append(f"{task}: {data_dir} absent, skipped")
            continue
        cfg = compose([f"experiment={RECIPES[args.recipe].experiment}", f"task={task}", f"task.data_dir={data_dir}",
                       "task.max_train_samples=null"])
        refs = preflight(cfg).refs
        tok = load_tokenizer(next(refs[k] for k in ("teacher", "teacher_tokenizer", "student_tokenizer") if k in refs))
        for split, ds in load_task_data(cfg.task).items():
            a = list(ds["text_a"])
            b = list(ds["text_b"]) if "text_b" in ds.column_names and ds[0]["text_b"] is not None else None
            n_tok = [len(x) for x in (tok(a, b) if b else tok(a))["input_ids"]]
            shares = ", ".join(f"{sum(n > m for n in n_tok) / len(n_tok):.2%}" for m in lengths)
            lines.append(f"{task} {split} {len(n_tok)}: {shares} ({max(n_tok)})")
    return lines


# ------------------------------------------------------------------------------------ the claims study

def claim_setting(args: argparse.Namespace, task: str, objective: str, out: Path, known: dict) -> dict:
    """The arm's setting: the GLUE study's choice for (task, objective), else this recipe's grid on dev."""
    if (task, objective) in known:
        return known[(task, objective)]
    points = grid(args, objective)
    kdrun_multirun([*common_overrides(args, task), f"objective={objective}",
                    *(f"{k}={v}" for k, v in points.items()), *packed_overrides(args.jobs), f"seed={args.grid_seed}"],
                   out / "grid" / task / objective, args.dry_run)
    chosen = None if args.dry_run else choose(out / "grid" / task / objective, list(points))
    known[(task, objective)] = chosen["setting"] if chosen else {k: v.split(",")[0] for k, v in points.items()}
    return known[(task, objective)]


# A finished seed run keeps its results and student, not its resume state (about 130 MB a run on the
# glue_cpu scale: the 518 runs' checkpoints would take some 70 GB).
KEEP_NO_CHECKPOINTS = "train.keep_checkpoints=false"


def packed_overrides(jobs: int, cores: int | None = None) -> list[str]:
    """With ``--jobs N`` (N > 1) each multirun's seeds run N at a time (``launcher=packed``), each with
    the cores / N threads: fixed, so a run's result never depends on what ran beside it."""
    if jobs <= 1:
        return []
    threads = max(1, (cores or usable_cores()) // jobs)
    return ["launcher=packed", f"hydra.launcher.jobs_at_once={jobs}", f"train.num_threads={threads}"]


def warm_teacher(args: argparse.Namespace, task: str, out: Path) -> None:
    """Before ``--jobs N`` runs a task's arms N at a time: one small run with every core, which
    fine-tunes and caches the task's teacher (otherwise the first packed job would, on its share of
    the cores, while the others wait for it)."""
    cmd = ["kdrun", *common_overrides(args, task), "objective=logit", "task.max_train_samples=64",
           "train.epochs=1", f"hydra.run.dir={out / 'teachers' / task}"]
    print("$ " + " ".join(cmd), flush=True)
    if not args.dry_run and subprocess.call(cmd) != 0:
        print(f"[reproduce_glue] the teacher run for {task} failed; the arms will fine-tune it", flush=True)


def recorded_seeds(path: Path) -> dict[tuple[str, str], set[int]]:
    """{(task, arm): seeds} of the runs the claims CSV records (made before, maybe on another machine)."""
    from kdrun.report.claims import recorded_runs

    return {key: set(by_seed) for key, by_seed in recorded_runs(path).items()}


def log_wall_time(out: Path, started: float, args: argparse.Namespace) -> None:
    """This invocation's wall time so far in OUT/wall_time.json (one entry per invocation, rewritten
    after every step, so an interrupted invocation still counts up to its last finished step)."""
    path = out / "wall_time.json"
    entries = json.loads(path.read_text()) if path.exists() else []
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
             "seconds": round(time.time() - started, 1), "tasks": args.tasks, "jobs": args.jobs}
    entries = [e for e in entries if e.get("started") != entry["started"]] + [entry]
    write_json_atomic(path, entries)


def run_claims(args: argparse.Namespace, out: Path) -> int:
    """Every arm of every claim (kdrun/report/claims_plan.py), one kdrun multirun over the seeds each,
    claim by claim; then the claims table (kdrun/report/claims.py)."""
    from kdrun.report import claims, claims_plan

    started = time.time()
    known = claims_plan.chosen_settings(GLUE_CPU_RUNS)
    reused = set(known)
    current = None
    warmed: set[str] = set()
    only = args.claims.split(",") if args.claims else None
    recorded = {} if args.ignore_recorded else recorded_seeds(CLAIMS_RUNS)
    for claim, task, name in claims_plan.steps(args.tasks.split(","), only):
        wanted = set(claims_plan.seeds_of(name, sorted(int(x) for x in args.seeds.split(","))))
        if wanted <= recorded.get((task, name), set()) and not (out / "seeds" / task / name).exists():
            print(f"# {task} {name}: seeds {args.seeds} recorded in docs/data/claims_runs.csv; a run skips "
                  "them (--ignore-recorded reruns them)", flush=True)
            if not args.dry_run:
                continue
        if args.jobs > 1 and task not in warmed:
            warm_teacher(args, task, out)
            warmed.add(task)
        if claim != current:
            print(f"# claim: {claim}", flush=True)
            current = claim
        arm = claims_plan.ARMS[name]
        setting = claim_setting(args, task, arm.base, out, known)
        if (task, arm.base) in reused:
            print(f"# {task} {name}: the setting the glue_cpu study chose for {arm.base} "
                  f"(docs/data/glue_cpu_runs.csv)", flush=True)
        overrides = claims_plan.merge_overrides(common_overrides(args, task), [f"objective={arm.objective}"],
                                                [f"{k}={v}" for k, v in setting.items()], arm.overrides)
        seeds = ",".join(map(str, claims_plan.seeds_of(name, [int(x) for x in args.seeds.split(",")])))
        kdrun_multirun([*overrides, *packed_overrides(args.jobs), KEEP_NO_CHECKPOINTS, f"seed={seeds}"],
                       out / "seeds" / task / name, args.dry_run)
        if not args.dry_run:
            log_wall_time(out, started, args)
    grids = {k: len(args.grid_lr.split(",")) for k in set(known) - reused}
    print(claims_plan.cost_line(args.tasks.split(","), len(args.seeds.split(",")), grids, only), flush=True)
    if not args.dry_run:
        docs = REPO / "docs" / "claims.md"
        print(claims.write_report(out, GLUE_CPU_RUNS, docs, None if args.ignore_recorded else CLAIMS_RUNS))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure_lengths:
        print("\n".join(length_lines(args)), flush=True)
        return 0
    out = Path(args.out)
    if args.recipe == "claims":
        return run_claims(args, out)
    t0 = time.time()
    chosen = run_all(args, out)
    report = ["kdrun-report", str(out / "seeds"), "--out", str(out / "report"),
              "--figure", str(out / "report" / "objectives.png")]
    print("$ " + " ".join(report), flush=True)
    if args.dry_run:
        return 0
    write_json_atomic(out / "chosen.json", merged_choices(out / "chosen.json", chosen, args, time.time() - t0))
    rc = subprocess.call(report)
    if args.recipe == "glue_cpu":
        for name, lines in (("criterion.txt", criterion_lines(out / "seeds")),
                            ("versus_logit.txt", versus_logit_lines(out / "seeds"))):
            print("\n".join(lines), flush=True)
            write_text_atomic(out / "report" / name, "\n".join(lines) + "\n")
        write_text_atomic(out / "report" / "runs.csv", runs_csv(out))
    print(f"[reproduce_glue] wall time {time.time() - t0:.0f}s; chosen settings in {out / 'chosen.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
