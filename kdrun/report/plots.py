"""The report's figures (matplotlib, files only), each saved atomically."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from kdrun.report.results import Cell, RunRecord, group_by_setting, swept_keys
from kdrun.report.significance import BASELINE_OBJECTIVE, SIGN_FLIP_MARK, TTEST_MARK, Comparison, _per_seed
from kdrun.tasks.kinds import metric_sign

# ------------------------------------------------------------------------------------------ plots

FIGURE_FORMATS = {"png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Save through a temporary sibling file and a rename, so a figure is never half-written; the
    format comes from the file's suffix (PNG without one)."""
    from kdrun.runtime.cache import atomic_file

    path = Path(path)
    try:
        fig.tight_layout()
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format=path.suffix.lstrip(".").lower() or "png", dpi=110)
    finally:
        _pyplot().close(fig)
    return path


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def value_order(v: Any) -> tuple:
    """Sort key of a swept key's values when some runs have it unset (null) or of another type:
    numbers by value, then other values by their text, then null."""
    if _is_number(v):
        return (0, float(v), "")
    return (2, 0.0, "") if v is None else (1, 0.0, json.dumps(v, default=str))


def value_label(v: Any) -> str:
    """A swept value as an axis label: ``null`` for a key unset in that run (e.g. all rows kept)."""
    return "null" if v is None else str(v)


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
            xs = sorted(best, key=value_order)
            numeric = all(_is_number(v) for v in xs)
            pos = xs if numeric else list(range(len(xs)))
            ax.errorbar(pos, [means[best[v]] for v in xs], yerr=[stds[best[v]] for v in xs], marker="o", capsize=3)
            if numeric and len(xs) > 2 and min(xs) > 0 and max(xs) / min(xs) >= 100:
                ax.set_xscale("log")
            if not numeric:
                ax.set_xticks(pos, [value_label(v) for v in xs], rotation=30)
            ax.set_xlabel(k)
            ax.set_ylabel(f"dev {metric} (best over other keys)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task} · {' · '.join(row)}")
        written.append(_save(fig, out / f"sweep_{label}.png"))
        if len(keys) == 2:
            k1, k2 = keys
            v1 = sorted({json.loads(s)[k1] for s in settings}, key=value_order)
            v2 = sorted({json.loads(s)[k2] for s in settings}, key=value_order)
            grid = [[math.nan] * len(v2) for _ in v1]
            for s, m in means.items():
                d = json.loads(s)
                grid[v1.index(d[k1])][v2.index(d[k2])] = m
            fig, ax = plt.subplots(figsize=(1.2 * len(v2) + 2.5, 0.8 * len(v1) + 2))
            im = ax.imshow(grid, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(v2)), [value_label(v) for v in v2])
            ax.set_yticks(range(len(v1)), [value_label(v) for v in v1])
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


def _seedwise_average(cells_of_row: dict[str, Cell], tasks: list[str]) -> list[float]:
    """Per seed, the average over the row's tasks (only seeds that every task of the row has)."""
    per_task = [_per_seed(cells_of_row[t]) for t in tasks if t in cells_of_row]
    if not per_task:
        return []
    seeds = sorted(set.intersection(*(set(p) for p in per_task)))
    return [statistics.fmean(p[s] for p in per_task) for s in seeds]


def plot_objectives(cells: dict[tuple, dict[str, Cell]], tasks: list[str], path: Path, scale: float,
                    comparisons: dict[tuple, dict[str, Comparison]] | None = None, alpha: float = 0.05,
                    metric_of: dict[str, str] | None = None) -> Path | None:
    """Grouped bars: one group per task plus the average, one bar per row (objective) with the mean
    over seeds and an error bar of the std over seeds; significance marks above the bars. The
    average bar is the table's average of the task means, its error bar the std over seeds of the
    per-seed average (seeds that every task has); hatched when the row lacks some tasks."""
    plt = _pyplot()

    rows = sorted(cells)
    if not rows or not tasks:
        return None
    groups = [*tasks, "avg"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, len(groups) * (0.35 * len(rows) + 0.6) + 2), 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tops: list[float] = []
    lows: list[float] = []
    for i, row in enumerate(rows):
        cs = cells[row]
        cmp = (comparisons or {}).get(row, {})
        xs, ys, errs, marks = [], [], [], []
        for g, task in enumerate(tasks):
            if task in cs:
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(cs[task].mean * scale)
                errs.append(cs[task].std * scale)
                marks.append(cmp[task].marks(alpha) if task in cmp else "")
        color = colors[i % len(colors)]
        ax.bar(xs, ys, width * 0.92, yerr=errs, capsize=2, color=color, label=" / ".join(row))
        means = [cs[t].mean * scale for t in tasks if t in cs]
        if means:
            per_seed = _seedwise_average(cs, tasks)
            avg_err = statistics.stdev(per_seed) * scale if len(per_seed) > 1 else 0.0
            partial = len(means) < len(tasks)
            ax.bar([len(tasks) - 0.4 + width * (i + 0.5)], [statistics.fmean(means)], width * 0.92, yerr=[avg_err],
                   capsize=2, color=color, hatch="//" if partial else None, edgecolor="white" if partial else None)
            ys, errs = [*ys, statistics.fmean(means)], [*errs, avg_err]
        for x, y, e, m in zip(xs, ys, errs, marks):
            if m:
                ax.text(x, y + e, m, ha="center", va="bottom", fontsize=9)
        tops += [y + e for y, e in zip(ys, errs)]
        lows += [y - e for y, e in zip(ys, errs)]
    metric_of = metric_of or {}
    ax.set_xticks(range(len(groups)), [f"{t}\n({metric_of[t]})" if t in metric_of else t for t in groups], fontsize=8)
    lo, hi = min(lows, default=0.0), max(tops, default=1.0)
    pad = 0.08 * (hi - lo if hi > lo else abs(hi) or 1.0)
    ax.set_ylim(min(0.0, lo - pad), hi + 2 * pad)
    ax.axvline(len(tasks) - 0.5, color="0.6", lw=0.8, ls=":")
    ax.set_ylabel(f"dev score ×{scale:g} (mean ± std over seeds)")
    title = "objectives × tasks (avg: hatched = over the tasks present)"
    if any(c.marks(alpha) for cs in (comparisons or {}).values() for c in cs.values()):
        title += f"; {SIGN_FLIP_MARK} sign-flip, {TTEST_MARK} t-test p < {alpha:g} vs {BASELINE_OBJECTIVE}"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (latency, score) points no other point beats on both (at most as slow and at least as good,
    better on one), sorted by latency: the best score reachable at each latency."""
    front: list[tuple[float, float]] = []
    for lat, score in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or score > front[-1][1]:
            front.append((lat, score))
    return front


def plot_pareto(points: list[dict[str, Any]], path: Path, scale: float) -> Path:
    """Dev score against the student's batch-1 latency, one panel per task: each run a point coloured
    by its row, the teachers as stars, the Pareto front of the students as a step line."""
    plt = _pyplot()

    tasks = sorted({p["task"] for p in points})
    rows = sorted({p["row"] for p in points})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks) + 1.5, 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [p for p in points if p["task"] == task]
        for i, row in enumerate(rows):
            pts = [p for p in mine if p["row"] == row]
            if pts:
                ax.scatter([p["latency_ms"] for p in pts], [p["value"] * scale for p in pts], s=22,
                           color=colors[i % len(colors)], label=row, zorder=3)
        teachers = {(p["teacher_latency_ms"], p["teacher_value"]) for p in mine
                    if p["teacher_latency_ms"] is not None and p["teacher_value"] is not None}
        if teachers:
            ax.scatter([t[0] for t in teachers], [t[1] * scale for t in teachers], marker="*", s=120, color="0.3",
                       label="teacher", zorder=3)
        sign = metric_sign(mine[0]["metric"])  # losses: lower is better
        front = pareto_front([(p["latency_ms"], sign * p["value"]) for p in mine])
        ax.step([f[0] for f in front], [sign * f[1] * scale for f in front], where="post", color="0.5", lw=1, zorder=2)
        ax.set_xscale("log")
        ax.set_xlabel("latency at batch 1 (ms, log scale)")
        ax.set_ylabel(f"dev {mine[0]['metric']} ×{scale:g}")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("score vs latency (each run; line: Pareto front of the students)", fontsize=9)
    return _save(fig, path)


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
