"""The runs a report reads: finished runs (results.json), jobs without results, and the cells of a
table (one (row, task) setting chosen by its mean dev score, its values over seeds)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from kdrun.runtime.provenance import moved_aside
from kdrun.tasks.baselines import Baseline, lookup
from kdrun.tasks.kinds import kind_of, metric_sign

# Config keys that never distinguish one experimental setting from another.
IGNORED_PREFIXES = (
    "seed", "train.seed", "run_name", "output_dir", "cache_dir", "resume", "logger.", "train.device",
    "train.num_workers", "train.num_threads", "train.eval_batch_size", "train.stop_after_steps",
    "train.checkpoint_every_steps",
    "sweep", "launcher", "report", "task.data_dir", "task.data_files", "objective.stages", "hydra",
)
GLUE_ORDER = ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli", "toy"]


@dataclass
class RunRecord:
    path: Path
    task: str
    objective: str
    student: str
    seed: int
    metric: str
    value: float
    flat: dict[str, Any]
    evals: list[dict[str, Any]] = field(default_factory=list)
    row_extra: tuple[str, ...] = ()
    baseline: Baseline | None = None  # the constant predictor's score (kdrun.tasks.baselines)

    @property
    def row(self) -> tuple[str, ...]:
        return (self.student, self.objective, *self.row_extra)


@dataclass
class Problem:
    path: Path
    status: str  # "failed" | "incomplete" | "duplicate"
    detail: str


@dataclass
class Cell:
    """The chosen setting of one (row, task): its per-seed values and hyperparameters."""

    values: list[float]
    setting: dict[str, Any]
    runs: list[RunRecord]
    n_settings: int

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0


# ------------------------------------------------------------------------------------ collecting

def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and not all(isinstance(x, (str, int, float, bool)) or x is None for x in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tuple(obj) if isinstance(obj, list) else obj
    return out


def _ignored(key: str) -> bool:
    bases = (p.rstrip(".") for p in IGNORED_PREFIXES)
    return any(key == b or key.startswith(b + ".") for b in bases)


def load_run(path: Path, row_keys: Iterable[str] = ()) -> RunRecord:
    """One finished run from its results.json."""
    res = json.loads(path.read_text())
    cfg = res.get("config") or {}
    flat = flatten(cfg)
    main = (cfg.get("task") or {}).get("main_metric", "accuracy")
    metrics = res["student"]["metrics"]
    first_split = next(iter(metrics))
    value = float(metrics[first_split][main])
    seed = cfg.get("seed", (cfg.get("train") or {}).get("seed", 0))
    return RunRecord(path=path.parent, task=res["task"], objective=res["objective"], student=res["student"]["name"],
                     seed=int(seed), metric=main, value=value, flat=flat, evals=res.get("evals") or [],
                     row_extra=tuple(f"{k}={flat.get(k)}" for k in row_keys),
                     baseline=_baseline(res, first_split, main))


def _baseline(res: dict[str, Any], split: str, metric: str) -> Baseline | None:
    """The run's constant-predictor baseline of ``metric`` on ``split`` (kdrun.tasks.baselines), if recorded."""
    try:
        return lookup(res.get("baseline"), split, metric)
    except (AttributeError, KeyError, TypeError, ValueError):  # a malformed entry: the run counts without it
        return None


# Question answering runs (task.kind=qa) get one column per metric, as the papers report SQuAD.
QA_COLUMNS = {"exact_match": "EM", "f1": "F1"}


def load_runs(path: Path, row_keys: Iterable[str] = ()) -> list[RunRecord]:
    """The records of one finished run: its main metric, or for a question answering run one record
    per metric in ``task.metrics`` where the task's kind says so (QA: task ``squad EM``, ``squad F1``)."""
    rec = load_run(path, row_keys)
    res = json.loads(path.read_text())
    task_cfg = (res.get("config") or {}).get("task") or {}
    if not kind_of(task_cfg).report_each_metric:
        return [rec]
    split, metrics = next(iter(res["student"]["metrics"].items()))
    return [replace(rec, task=f"{rec.task} {QA_COLUMNS.get(m, m)}", metric=m, value=float(metrics[m]),
                    baseline=_baseline(res, split, m))
            for m in task_cfg.get("metrics", [rec.metric]) if m in metrics]


def _problem(job: Path) -> Problem:
    err = job / "error.json"
    if err.exists():
        try:
            info = json.loads(err.read_text())
            where = ", ".join(f"{k} {info[k]}" for k in ("phase", "stage", "step") if info.get(k) is not None)
            detail = f"{info.get('type')}: {info.get('message', '')}".strip()[:300]
            reached = f" (reached: {where}; see error.json and cli.log)" if where else ""
            return Problem(job, "failed", detail + reached)
        except (OSError, json.JSONDecodeError):
            return Problem(job, "failed", "error.json unreadable")
    state = job / "checkpoints" / "last" / "state.json"
    if state.exists():
        try:
            st = json.loads(state.read_text())
            return Problem(job, "incomplete", f"checkpoint at stage {st.get('stage')} step {st.get('global_step')}; "
                                              "rerun the sweep to resume it")
        except (OSError, json.JSONDecodeError):
            pass
    return Problem(job, "incomplete", "no results and no checkpoint (never started, or killed early)")


def collect(paths: list[Path], row_keys: Iterable[str] = ()) -> tuple[list[RunRecord], list[Problem]]:
    """All runs under ``paths`` (run dirs, multirun dirs or parents), and jobs without results."""
    runs: list[RunRecord] = []
    problems: list[Problem] = []
    seen: set[Path] = set()
    for root in paths:
        if not root.exists():
            raise FileNotFoundError(f"{root}: no such file or directory")
        results = [root] if root.is_file() else sorted(root.rglob("results.json"))
        for r in results:
            if r.parent.resolve() in seen or "checkpoints" in r.parts or moved_aside(r.parent):
                continue
            seen.add(r.parent.resolve())
            try:
                runs.extend(load_runs(r, row_keys))
            except (KeyError, StopIteration, json.JSONDecodeError, TypeError, ValueError) as e:
                problems.append(Problem(r.parent, "failed", f"unreadable results.json ({type(e).__name__}: {e})"))
        if root.is_dir():
            for job in _jobs_without_results(root, seen):
                seen.add(job.resolve())
                problems.append(_problem(job))
    runs, duplicates = drop_duplicates(runs)
    return runs, problems + duplicates


def _jobs_without_results(root: Path, seen: set[Path]) -> list[Path]:
    """Hydra job directories (``.hydra/``) and run directories with an ``error.json`` (a run started
    without Hydra's launcher that failed) under ``root`` that have no results.json."""
    marked = {m.parent for name in (".hydra", "error.json") for m in root.rglob(name)}
    return [job for job in sorted(marked) if job.resolve() not in seen and "checkpoints" not in job.parts
            and not (job / "results.json").exists() and not moved_aside(job)]


def _identity(r: RunRecord) -> str:
    """A run's setting and seed: what makes two runs the same measurement."""
    setting = {k: v for k, v in r.flat.items() if not _ignored(k)}
    return json.dumps([r.task, r.objective, r.student, r.row_extra, r.seed, setting], sort_keys=True, default=str)


def drop_duplicates(runs: list[RunRecord]) -> tuple[list[RunRecord], list[Problem]]:
    """Count each (setting, seed) once: the most recent run is kept, the others are reported.

    The same command rerun into another directory (or a sweep copied elsewhere) would otherwise
    enter a mean twice, as "n=2 seeds [42, 42]" with a spurious std of 0."""
    by_id: dict[str, list[RunRecord]] = defaultdict(list)
    for r in runs:
        by_id[_identity(r)].append(r)
    kept, dups = [], []
    for group in by_id.values():
        group.sort(key=lambda r: (r.path / "results.json").stat().st_mtime, reverse=True)
        kept.append(group[0])
        dups += [Problem(d.path, "duplicate", f"same setting and seed {d.seed} as {group[0].path}; counted once")
                 for d in group[1:]]
    order = {id(r): i for i, r in enumerate(runs)}
    return sorted(kept, key=lambda r: order[id(r)]), dups


# ------------------------------------------------------------------------------------- the table

def swept_keys(runs: list[RunRecord]) -> list[str]:
    """Config keys whose values differ among ``runs`` (seeds and bookkeeping excluded)."""
    keys = set().union(*(r.flat for r in runs)) if runs else set()
    out = []
    for k in sorted(keys):
        if _ignored(k):
            continue
        if len({json.dumps(r.flat.get(k), default=str) for r in runs}) > 1:
            out.append(k)
    return out


def group_by_setting(runs: list[RunRecord], keys: list[str]) -> dict[str, list[RunRecord]]:
    """Runs keyed by their values of ``keys`` (a JSON object, so it can be read back)."""
    groups: dict[str, list[RunRecord]] = defaultdict(list)
    for r in runs:
        groups[json.dumps({k: r.flat.get(k) for k in keys}, sort_keys=True, default=str)].append(r)
    return groups


def build_cells(runs: list[RunRecord]) -> tuple[dict[tuple, dict[str, Cell]], dict[tuple, list[str]]]:
    """cells[row][task] = the best setting by mean dev score; also the swept keys per row."""
    by_row_task: dict[tuple, dict[str, list[RunRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        by_row_task[r.row][r.task].append(r)
    cells: dict[tuple, dict[str, Cell]] = {}
    swept: dict[tuple, list[str]] = {}
    for row, tasks in by_row_task.items():
        cells[row] = {}
        row_swept: set[str] = set()
        for task, rs in tasks.items():
            keys = swept_keys(rs)
            row_swept.update(keys)
            groups = group_by_setting(rs, keys)
            sign = metric_sign(next(iter(groups.values()))[0].metric)  # losses: the lowest is best
            best_key = max(groups, key=lambda g: (sign * statistics.fmean(x.value for x in groups[g]), len(groups[g])))
            chosen = sorted(groups[best_key], key=lambda r: r.seed)
            cells[row][task] = Cell(values=[r.value for r in chosen], setting=json.loads(best_key), runs=chosen,
                                    n_settings=len(groups))
        swept[row] = sorted(row_swept)
    return cells, swept


def _task_order(tasks: Iterable[str]) -> list[str]:
    tasks = set(tasks)
    return [t for t in GLUE_ORDER if t in tasks] + sorted(tasks - set(GLUE_ORDER))


def _setting_text(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={'null' if v is None else v}" for k, v in setting.items()) or "(single setting)"
