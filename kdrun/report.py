"""``kdrun-report PATH…``: the papers' tables and plots from run and multirun directories.

Reads only the ``results.json`` each finished run writes (and, for training-loss curves, the
``metrics.jsonl`` beside it when present). Rows are (student, objective) — plus any config keys
given with ``--rows`` — columns are tasks with each task's main dev metric (×100, as in the
papers) and the GLUE average. A cell is mean ± std over seeds; when a row was swept over other
hyperparameters, the configuration with the best mean dev score is chosen per task, as the papers
do, and its hyperparameters are listed. Jobs without results (interrupted, failed) are listed too.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kdrun.cache import write_text_atomic

# Config keys that never distinguish one experimental setting from another.
IGNORED_PREFIXES = (
    "seed", "train.seed", "run_name", "output_dir", "cache_dir", "resume", "logger.", "train.device",
    "train.num_workers", "train.eval_batch_size", "train.stop_after_steps", "train.checkpoint_every_steps",
    "sweep", "launcher", "task.data_dir", "task.data_files", "objective.stages", "hydra",
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

    @property
    def row(self) -> tuple[str, ...]:
        return (self.student, self.objective, *self.row_extra)


@dataclass
class Problem:
    path: Path
    status: str  # "failed" | "incomplete"
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
                     row_extra=tuple(f"{k}={flat.get(k)}" for k in row_keys))


def _problem(job: Path) -> Problem:
    err = job / "error.json"
    if err.exists():
        try:
            info = json.loads(err.read_text())
            return Problem(job, "failed", f"{info.get('type')}: {info.get('message', '')}".strip()[:300])
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
            if r.parent.resolve() in seen or "checkpoints" in r.parts:
                continue
            seen.add(r.parent.resolve())
            try:
                runs.append(load_run(r, row_keys))
            except (KeyError, StopIteration, json.JSONDecodeError, TypeError, ValueError) as e:
                problems.append(Problem(r.parent, "failed", f"unreadable results.json ({type(e).__name__}: {e})"))
        if root.is_dir():  # Hydra job directories (.hydra/) that have no results.json
            for hydra_dir in sorted(root.rglob(".hydra")):
                job = hydra_dir.parent
                if job.resolve() not in seen and not (job / "results.json").exists():
                    seen.add(job.resolve())
                    problems.append(_problem(job))
    return runs, problems


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
            best_key = max(groups, key=lambda g: (statistics.fmean(x.value for x in groups[g]), len(groups[g])))
            chosen = sorted(groups[best_key], key=lambda r: r.seed)
            cells[row][task] = Cell(values=[r.value for r in chosen], setting=json.loads(best_key), runs=chosen,
                                    n_settings=len(groups))
        swept[row] = sorted(row_swept)
    return cells, swept


def _task_order(tasks: Iterable[str]) -> list[str]:
    tasks = set(tasks)
    return [t for t in GLUE_ORDER if t in tasks] + sorted(tasks - set(GLUE_ORDER))


def _fmt(cell: Cell | None, scale: float) -> str:
    if cell is None:
        return "—"
    if len(cell.values) == 1:
        return f"{cell.mean * scale:.2f}"
    return f"{cell.mean * scale:.2f} ± {cell.std * scale:.2f}"


def table_rows(cells: dict[tuple, dict[str, Cell]], tasks: list[str], scale: float) -> list[list[str]]:
    rows = []
    for row in sorted(cells):
        cs = cells[row]
        means = [cs[t].mean * scale for t in tasks if t in cs]
        avg = f"{statistics.fmean(means):.2f}" + ("" if len(means) == len(tasks) else "*") if means else "—"
        rows.append([*row, *[_fmt(cs.get(t), scale) for t in tasks], avg])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def latex(header: list[str], rows: list[list[str]], n_label_cols: int) -> str:
    def esc(s: str) -> str:
        return (s.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("&", "\\&").replace("%", "\\%")
                .replace("±", "$\\pm$").replace("—", "--").replace("#", "\\#"))

    spec = "l" * n_label_cols + "c" * (len(header) - n_label_cols)
    out = ["\\begin{tabular}{" + spec + "}", "\\toprule", " & ".join(esc(h) for h in header) + " \\\\", "\\midrule"]
    out += [" & ".join(esc(c) for c in r) + " \\\\" for r in rows]
    out += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(out) + "\n"


def _setting_text(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items()) or "(single setting)"


# ------------------------------------------------------------------------------------------ plots

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_sweeps(runs: list[RunRecord], out: Path) -> list[Path]:
    """Metric vs each swept hyperparameter per (task, row): a line (best over the other swept keys,
    mean ± std over seeds) per key, and a heatmap when exactly two keys were swept."""
    plt = _pyplot()

    written = []
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    for r in runs:
        groups[(r.task, *r.row)].append(r)
    for (task, *row), rs in sorted(groups.items()):
        keys = swept_keys(rs)
        if not keys:
            continue
        metric = rs[0].metric
        # mean over seeds for each full setting
        settings = group_by_setting(rs, keys)
        means = {s: statistics.fmean(x.value for x in v) for s, v in settings.items()}
        stds = {s: statistics.stdev([x.value for x in v]) if len(v) > 1 else 0.0 for s, v in settings.items()}
        label = "-".join([task, *row]).replace("/", "_").replace("=", "_")
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
        for ax, k in zip(axes[0], keys):
            best: dict[Any, str] = {}
            for s in settings:
                v = json.loads(s)[k]
                if v not in best or means[s] > means[best[v]]:
                    best[v] = s
            xs = sorted(best, key=lambda v: (isinstance(v, str), v if not isinstance(v, str) else 0, str(v)))
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs)
            pos = xs if numeric else list(range(len(xs)))
            ax.errorbar(pos, [means[best[v]] for v in xs], yerr=[stds[best[v]] for v in xs], marker="o", capsize=3)
            if numeric and len(xs) > 2 and min(xs) > 0 and max(xs) / min(xs) >= 100:
                ax.set_xscale("log")
            if not numeric:
                ax.set_xticks(pos, [str(v) for v in xs], rotation=30)
            ax.set_xlabel(k)
            ax.set_ylabel(f"dev {metric} (best over other keys)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task} · {' · '.join(row)}")
        written.append(_save(fig, out / f"sweep_{label}.png"))
        if len(keys) == 2:
            k1, k2 = keys
            v1 = sorted({json.loads(s)[k1] for s in settings}, key=str)
            v2 = sorted({json.loads(s)[k2] for s in settings}, key=str)
            grid = [[math.nan] * len(v2) for _ in v1]
            for s, m in means.items():
                d = json.loads(s)
                grid[v1.index(d[k1])][v2.index(d[k2])] = m
            fig, ax = plt.subplots(figsize=(1.2 * len(v2) + 2.5, 0.8 * len(v1) + 2))
            im = ax.imshow(grid, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(v2)), [str(v) for v in v2])
            ax.set_yticks(range(len(v1)), [str(v) for v in v1])
            ax.set_xlabel(k2)
            ax.set_ylabel(k1)
            for i in range(len(v1)):
                for j in range(len(v2)):
                    if not math.isnan(grid[i][j]):
                        ax.text(j, i, f"{grid[i][j]:.3f}", ha="center", va="center", color="w", fontsize=8)
            fig.colorbar(im, label=f"dev {metric}")
            ax.set_title(f"{task} · {' · '.join(row)}")
            written.append(_save(fig, out / f"heatmap_{label}.png"))
    return written


def plot_seed_spread(cells: dict[tuple, dict[str, Cell]], tasks: list[str], out: Path, scale: float) -> Path | None:
    """Per task, the per-seed dev scores of each row's chosen setting (points, mean as a bar)."""
    plt = _pyplot()

    rows = sorted(cells)
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(4, 1.1 * len(rows) + 2) * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, row in enumerate(rows):
            cell = cells[row].get(task)
            if cell is None:
                continue
            ys = [v * scale for v in cell.values]
            ax.bar(i, statistics.fmean(ys), color="#cfd8e3", width=0.6)
            jitter = [i + (j - (len(ys) - 1) / 2) * 0.08 for j in range(len(ys))]
            ax.scatter(jitter, ys, color="#1f4e79", zorder=3, s=14)
        ax.set_xticks(range(len(rows)), [" / ".join(r) for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(task)
        ax.set_ylabel("dev score ×100 (per seed)")
        lo = min((v * scale for r in rows if task in cells[r] for v in cells[r][task].values), default=0)
        hi = max((v * scale for r in rows if task in cells[r] for v in cells[r][task].values), default=1)
        ax.set_ylim(lo - 0.1 * (hi - lo + 1), hi + 0.1 * (hi - lo + 1))
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, out / "seed_spread.png")


def _train_losses(run_dir: Path) -> tuple[list[int], list[float]]:
    log = run_dir / "metrics.jsonl"
    steps, losses = [], []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if "train/loss" in rec:
                steps.append(int(rec.get("step", rec.get("_step", len(steps)))))
                losses.append(float(rec["train/loss"]))
    return steps, losses


def plot_curves(cells: dict[tuple, dict[str, Cell]], tasks: list[str], out: Path) -> list[Path]:
    """Training curves of the chosen runs: dev metric per evaluation (results.json) and training
    loss (metrics.jsonl when present), one figure per task."""
    plt = _pyplot()

    written = []
    for task in tasks:
        fig, (ax_m, ax_l) = plt.subplots(1, 2, figsize=(10, 3.6))
        any_loss = False
        for row in sorted(cells):
            cell = cells[row].get(task)
            if cell is None:
                continue
            run = cell.runs[0]
            pts = [(e["step"], next(iter(e["metrics"].values()))[run.metric]) for e in run.evals]
            if pts:
                ax_m.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=" / ".join(row))
            steps, losses = _train_losses(run.path)
            if steps:
                any_loss = True
                ax_l.plot(steps, losses, label=" / ".join(row))
        ax_m.set_xlabel("optimizer step")
        ax_m.set_ylabel(f"dev {run.metric if cells else ''}")
        ax_m.set_title(f"{task}: dev metric (chosen runs, first seed)")
        ax_m.grid(alpha=0.3)
        ax_m.legend(fontsize=7)
        ax_l.set_xlabel("optimizer step")
        ax_l.set_ylabel("training loss")
        ax_l.set_title("training loss" if any_loss else "training loss (no metrics.jsonl)")
        ax_l.grid(alpha=0.3)
        if any_loss:
            ax_l.set_yscale("log")
            ax_l.legend(fontsize=7)
        written.append(_save(fig, out / f"curves_{task}.png"))
    return written


# -------------------------------------------------------------------------------------------- main

def report(paths: list[Path], out: Path, row_keys: list[str] | None = None, scale: float = 100.0,
           plots: bool = True, stream=None) -> dict[str, Any]:
    """Build the table (printed as Markdown), write CSV/LaTeX/PNGs into ``out``; returns a summary."""
    stream = stream or sys.stdout
    runs, problems = collect(paths, row_keys or [])
    if not runs and not problems:
        raise FileNotFoundError(f"no results.json or Hydra job directories under {', '.join(map(str, paths))}")
    cells, swept = build_cells(runs)
    tasks = _task_order({r.task for r in runs})
    label_cols = ["student", "objective", *(row_keys or [])]
    metric_of = {t: next(r.metric for r in runs if r.task == t) for t in tasks}
    header = [*label_cols, *[f"{t} ({metric_of[t]})" for t in tasks], "avg"]
    rows = table_rows(cells, tasks, scale)
    out.mkdir(parents=True, exist_ok=True)

    print(f"# kdrun report: {len(runs)} finished runs" + (f", {len(problems)} without results" if problems else ""),
          file=stream)
    print(f"\nDev scores ×{scale:g}, mean ± std over seeds (best setting per task by mean dev score; "
          "* = average over the tasks present).\n", file=stream)
    print(markdown(header, rows), file=stream)
    chosen_lines = []
    for row in sorted(cells):
        for task in tasks:
            cell = cells[row].get(task)
            if cell is None:
                continue
            seeds = ",".join(str(r.seed) for r in cell.runs)
            chosen_lines.append(f"- {' / '.join(row)} · {task}: {_setting_text(cell.setting)} "
                                f"(n={len(cell.values)} seeds [{seeds}], best of {cell.n_settings} settings)")
    if chosen_lines:
        print("\nChosen configurations:", file=stream)
        print("\n".join(chosen_lines), file=stream)
    if problems:
        print("\nJobs without results:", file=stream)
        for p in problems:
            print(f"- [{p.status}] {p.path}: {p.detail}", file=stream)

    # files, each written whole or not at all
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*label_cols, "task", "metric", "mean", "std", "n_seeds", "seeds", "values", "setting", "n_settings"])
    for row in sorted(cells):
        for task in tasks:
            c = cells[row].get(task)
            if c is not None:
                w.writerow([*row, task, metric_of[task], f"{c.mean:.6f}", f"{c.std:.6f}", len(c.values),
                            " ".join(str(r.seed) for r in c.runs), " ".join(f"{v:.6f}" for v in c.values),
                            json.dumps(c.setting, default=str), c.n_settings])
    csv_path, tex_path, md_path = out / "table.csv", out / "table.tex", out / "table.md"
    write_text_atomic(csv_path, buf.getvalue())
    write_text_atomic(tex_path, latex(header, rows, len(label_cols)))
    problem_lines = [f"- [{p.status}] {p.path}: {p.detail}" for p in problems]
    write_text_atomic(md_path, markdown(header, rows) + "\n\nChosen configurations:\n" + "\n".join(chosen_lines)
                      + ("\n\nJobs without results:\n" + "\n".join(problem_lines) if problems else "") + "\n")
    written: list[Path] = []
    written += [csv_path, tex_path, md_path]
    if plots and runs:
        written += plot_sweeps(runs, out)
        spread = plot_seed_spread(cells, tasks, out, scale)
        if spread:
            written.append(spread)
        written += plot_curves(cells, tasks, out)
    print("\nwritten: " + ", ".join(str(p) for p in written), file=stream)
    return {"cells": cells, "swept": swept, "problems": problems, "files": written, "runs": runs,
            "header": header, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kdrun-report",
        description="Tables (Markdown, CSV, LaTeX) and plots from kdrun run or multirun directories.")
    ap.add_argument("paths", nargs="+", type=Path, help="run dirs, multirun dirs, or any parent of them")
    ap.add_argument("--out", type=Path, default=None, help="where files go (default: <first path>/report)")
    ap.add_argument("--rows", nargs="*", default=[], metavar="KEY",
                    help="config keys that split rows further, e.g. mapping.name (default: none)")
    ap.add_argument("--scale", type=float, default=100.0, help="multiply metrics by this (default 100)")
    ap.add_argument("--no-plots", action="store_true", help="only the tables")
    args = ap.parse_args(argv)
    out = args.out or (args.paths[0] if args.paths[0].is_dir() else args.paths[0].parent) / "report"
    try:
        report(args.paths, out, args.rows, args.scale, plots=not args.no_plots)
    except FileNotFoundError as e:
        print(f"kdrun-report: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
