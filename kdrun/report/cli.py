"""``kdrun-report PATH…``: the papers' tables and plots from run and multirun directories.

Reads only the ``results.json`` each finished run writes (and, for training-loss curves, the
``metrics.jsonl`` beside it when present). Rows are (student, objective) — plus any config keys
given with ``--rows`` — columns are tasks with each task's main dev metric (×100, as in the
papers) and the GLUE average. A cell is mean ± std over seeds; when a row was swept over other
hyperparameters, the configuration with the best mean dev score is chosen per task, as the papers
do, and its hyperparameters are listed. Jobs without results (interrupted, failed) are listed too.

Each cell is also compared with the ``finetune`` row of the same student, paired over seeds (the
seeds both rows ran on that task): an exact two-sided sign-flip permutation test (Fisher 1935;
Pitman 1937) and a paired t-test (Student 1908, through ``scipy.stats.ttest_rel``). Their p-values
go into the CSV and a mark into the tables. With n pairs the sign-flip test cannot go below
p = 2/2^n (0.25 for 3 seeds), which is why the t-test is shown as well; under the table, each
task's minimal detectable effect says how large a difference its seeds can detect.

The ``baseline`` row is the constant predictor's score that the runs recorded (kdrun.tasks.baselines),
and a cell whose mean is within noise of it (or below it) is marked and listed.

When the runs measured their cost (results.json ``cost``, kdrun.report.cost), two columns follow the
average: ``× smaller`` (the teacher's parameters over the student's) and ``× faster`` (the teacher's
batch-1 latency over the student's), each the median over the row's chosen runs; the CSV gives them per
cell with the latencies, and ``pareto.png`` plots every run's dev score against its student's latency.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from kdrun.report.cost import speed_unreliable
from kdrun.report.plots import (
    FIGURE_FORMATS,
    plot_curves,
    plot_objectives,
    plot_pareto,
    plot_seed_spread,
    plot_sweeps,
)
from kdrun.report.results import (  # noqa: F401  (re-exported: kdrun.report.cli is the public entry)
    Cell,
    Problem,
    RunRecord,
    _setting_text,
    _task_order,
    build_cells,
    collect,
    flatten,
)
from kdrun.report.significance import (  # noqa: F401
    BASELINE_OBJECTIVE,
    SIGN_FLIP_MARK,
    TTEST_MARK,
    Comparison,
    baseline_row,
    cell_mde,
    compare_with_baseline,
    comparison_lines,
    comparison_qvalues,
    mde_lines,
    min_detectable_effect,
    min_sign_flip_p,
    sign_flip_p,
    significance_footnote,
)
from kdrun.runtime.cache import write_text_atomic
from kdrun.tasks.baselines import (
    NEAR_MARK,
    Baseline,
    cell_baseline,
    constant_note,
    constant_row,
    near_cells,
    near_lines,
    task_baselines,
)


def _fmt(cell: Cell | None, scale: float) -> str:
    if cell is None:
        return "—"
    if len(cell.values) == 1:
        return f"{cell.mean * scale:.2f}"
    return f"{cell.mean * scale:.2f} ± {cell.std * scale:.2f}"


def table_rows(cells: dict[tuple, dict[str, Cell]], tasks: list[str], scale: float,
               comparisons: dict[tuple, dict[str, Comparison]] | None = None, alpha: float = 0.05,
               near: dict[tuple, dict[str, str]] | None = None) -> list[list[str]]:
    rows = []
    for row in sorted(cells):
        cs = cells[row]
        cmp, close = (comparisons or {}).get(row, {}), (near or {}).get(row, {})
        means = [cs[t].mean * scale for t in tasks if t in cs]
        avg = f"{statistics.fmean(means):.2f}" + ("" if len(means) == len(tasks) else "*") if means else "—"
        rows.append([*row, *[_fmt(cs.get(t), scale) + (cmp[t].marks(alpha) if t in cmp else "")
                             + (NEAR_MARK if t in close else "") for t in tasks], avg])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def latex(header: list[str], rows: list[list[str]], n_label_cols: int, footnote: str = "") -> str:
    def esc(s: str) -> str:
        return (s.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("&", "\\&").replace("%", "\\%")
                .replace("±", "$\\pm$").replace("—", "--").replace("#", "\\#").replace(NEAR_MARK, "$\\approx$")
                .replace(SIGN_FLIP_MARK + TTEST_MARK, "$^{\\dagger\\ddagger}$")
                .replace(SIGN_FLIP_MARK, "$^{\\dagger}$").replace(TTEST_MARK, "$^{\\ddagger}$")
                .replace("≤", "$\\leq$").replace("2^n", "$2^n$").replace(" < ", " $<$ "))

    spec = "l" * n_label_cols + "c" * (len(header) - n_label_cols)
    out = ["\\begin{tabular}{" + spec + "}", "\\toprule", " & ".join(esc(h) for h in header) + " \\\\", "\\midrule"]
    out += [" & ".join(esc(c) for c in r) + " \\\\" for r in rows]
    out += ["\\bottomrule"]
    if footnote:
        out += [f"\\multicolumn{{{len(header)}}}{{p{{0.95\\linewidth}}}}{{\\footnotesize {esc(footnote)}}} \\\\"]
    out += ["\\end{tabular}"]
    return "\n".join(out) + "\n"


def _chosen_lines(cells: dict[tuple, dict[str, Cell]], tasks: list[str]) -> list[str]:
    lines = []
    for row in sorted(cells):
        for task in tasks:
            cell = cells[row].get(task)
            if cell is not None:
                seeds = ",".join(str(r.seed) for r in cell.runs)
                lines.append(f"- {' / '.join(row)} · {task}: {_setting_text(cell.setting)} "
                             f"(n={len(cell.values)} seeds [{seeds}], best of {cell.n_settings} settings)")
    return lines


# ------------------------------------------------------------------------------------------- cost

COST_COLUMNS = ["× smaller", "× faster"]


def run_cost(run: RunRecord) -> dict[str, Any] | None:
    """The run's measured cost (results.json ``cost``), or None when it has none."""
    try:
        cost = json.loads((run.path / "results.json").read_text()).get("cost")
    except (OSError, json.JSONDecodeError):
        return None
    return cost if isinstance(cost, dict) and "student" in cost else None


SPEED_KEYS = ("faster", "throughput")


def _trusted(cost: dict[str, Any] | None, key: str) -> bool:
    """Whether ``cost`` has the ratio ``key`` and, for a speed ratio, was timed on a machine not busy."""
    return bool(cost) and "ratios" in cost and (key not in SPEED_KEYS or not speed_unreliable(cost))


def _median_ratio(runs: list[RunRecord], costs: dict[Path, dict[str, Any] | None], key: str) -> float | None:
    values = [costs[r.path]["ratios"][key] for r in runs if _trusted(costs.get(r.path), key)]
    return statistics.median(values) if values else None


def _ratio_cell(runs: list[RunRecord], costs: dict[Path, dict[str, Any] | None], key: str) -> str:
    """``2.5×`` (the median over the runs), ``unreliable`` when every timing was on a busy machine, else ``—``."""
    v = _median_ratio(runs, costs, key)
    if v is not None:
        return f"{v:.1f}×" if v >= 0.95 else f"{v:.2g}×"
    return "unreliable" if any(costs.get(r.path) and "ratios" in costs[r.path] for r in runs) else "—"


def cost_cells(cells: dict[tuple, dict[str, Cell]], costs: dict[Path, dict[str, Any] | None]) -> dict[tuple, list[str]]:
    """Per row: ``× smaller`` and ``× faster``, medians over the runs of the row's chosen cells whose
    figures are trusted (``unreliable`` when timed only on a busy machine, "—" without)."""
    out = {}
    for row, cs in cells.items():
        runs = [r for c in cs.values() for r in c.runs]
        out[row] = [_ratio_cell(runs, costs, "smaller"), _ratio_cell(runs, costs, "faster")]
    return out


def untrusted_speed_lines(runs: list[RunRecord], costs: dict[Path, dict[str, Any] | None]) -> list[str]:
    """One line per run whose latency and throughput are left out of the table and figures, and why."""
    return [f"- {r.path}: {speed_unreliable(costs[r.path])}" for r in runs
            if costs.get(r.path) and speed_unreliable(costs[r.path])]


def pareto_points(runs: list[RunRecord], costs: dict[Path, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """One point per run with a cost: task, row label, dev score, student latency (ms) and, when
    measured, the teacher's latency and dev score."""
    points = []
    for r in runs:
        c = costs.get(r.path)
        if not c or speed_unreliable(c):  # a latency timed on a busy machine is no point on the front
            continue
        teacher_value = None
        if c.get("teacher"):
            try:
                res = json.loads((r.path / "results.json").read_text())
                teacher_value = next(iter(res["teacher"]["metrics"].values()))[r.metric]
            except (OSError, KeyError, StopIteration, TypeError, json.JSONDecodeError):
                pass
        points.append({"task": r.task, "row": " / ".join(r.row), "value": r.value, "metric": r.metric,
                       "latency_ms": c["student"]["latency_ms"], "teacher_value": teacher_value,
                       "teacher_latency_ms": (c.get("teacher") or {}).get("latency_ms")})
    return points


def _report_text(t: dict[str, Any], problems: list[Problem], scale: float) -> str:
    """The Markdown report: table, significance footnote, chosen settings, comparisons, problems."""
    parts = [markdown(t["header"], t["rows"])]
    parts += [text for text in (t["footnote"], t["constant_note"]) if text]
    if t["mde_lines"]:
        parts.append(f"Minimal detectable effect vs {BASELINE_OBJECTIVE} (×{scale:g}; paired t-test, α = "
                     f"{t['alpha']:g}, power 0.8: (t_(1-α/2,n-1) + t_(0.8,n-1))·sd/√n):\n" + "\n".join(t["mde_lines"]))
    if t["near_lines"]:
        parts.append(f"Warning: within noise of the constant-predictor baseline ({NEAR_MARK}):\n"
                     + "\n".join(t["near_lines"]))
    if t["chosen"]:
        parts.append("Chosen configurations:\n" + "\n".join(t["chosen"]))
    if t["sig_lines"]:
        parts.append(f"Paired comparisons with {BASELINE_OBJECTIVE} (Δ ×{scale:g}, row minus {BASELINE_OBJECTIVE}):\n"
                     + "\n".join(t["sig_lines"]))
    if t["untrusted"]:
        parts.append("Speed left out (latency, throughput, × faster; unreliable):\n" + "\n".join(t["untrusted"]))
    missing = [p for p in problems if p.status != "duplicate"]
    if missing:
        parts.append("Jobs without results:\n" + "\n".join(f"- [{p.status}] {p.path}: {p.detail}" for p in missing))
    dups = [p for p in problems if p.status == "duplicate"]
    if dups:
        parts.append("Duplicate runs (counted once):\n" + "\n".join(f"- {p.path}: {p.detail}" for p in dups))
    return "\n\n".join(parts) + "\n"


def _csv_text(t: dict[str, Any]) -> str:
    cells, tasks, metric_of, comparisons = (t[k] for k in ("cells", "tasks", "metric_of", "comparisons"))
    qs = comparison_qvalues(comparisons)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*t["label_cols"], "task", "metric", "mean", "std", "n_seeds", "seeds", "values", "setting",
                "n_settings", "baseline", "n_pairs", "mean_diff_vs_finetune", "p_vs_finetune", "p_ttest_vs_finetune",
                "q_bh_vs_finetune", "mde_vs_finetune", "constant_baseline", "constant_baseline_se",
                "near_constant_baseline", "x_smaller", "x_faster", "student_latency_ms", "teacher_latency_ms"])
    for row in sorted(cells):
        for task in tasks:
            c = cells[row].get(task)
            if c is None:
                continue
            base = baseline_row(row, cells)
            cmp = comparisons.get(row, {}).get(task)
            sig = ["/".join(base) if base else "", cmp.n if cmp else (0 if base else ""),
                   "" if cmp is None or cmp.mean_diff is None else f"{cmp.mean_diff:.6f}",
                   "" if cmp is None or cmp.p_sign_flip is None else f"{cmp.p_sign_flip:.6g}",
                   "" if cmp is None or cmp.p_ttest is None else f"{cmp.p_ttest:.6g}",
                   _num(qs.get((row, task)))]
            w.writerow([*row, task, metric_of[task], f"{c.mean:.6f}", f"{c.std:.6f}", len(c.values),
                        " ".join(str(r.seed) for r in c.runs), " ".join(f"{v:.6f}" for v in c.values),
                        json.dumps(c.setting, default=str), c.n_settings, *sig, _num(cell_mde(cmp, t["alpha"])),
                        *_constant_cols(cell_baseline(c.runs)), t["near"].get(row, {}).get(task, ""),
                        *_cost_cols(c.runs, t["costs"])])
    return buf.getvalue()


def _cost_cols(runs: list[RunRecord], costs: dict[Path, dict[str, Any] | None]) -> list[str]:
    """A cell's median ratios and latencies over its runs (empty without cost)."""
    measured = [costs[r.path] for r in runs if costs.get(r.path) and not speed_unreliable(costs[r.path])]

    def med(values: list[float]) -> str:
        return _num(statistics.median(values)) if values else ""

    return [_num(_median_ratio(runs, costs, "smaller")), _num(_median_ratio(runs, costs, "faster")),
            med([c["student"]["latency_ms"] for c in measured]),
            med([c["teacher"]["latency_ms"] for c in measured if c.get("teacher")])]


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.6f}"


def _constant_cols(b: Baseline | None) -> list[str]:
    return ["", ""] if b is None else [f"{b.value:.6f}", _num(b.se)]


def _figures(runs: list[RunRecord], t: dict[str, Any], out: Path, scale: float, plots: bool,
             figure: Path | None, alpha: float) -> list[Path]:
    cells, tasks, written = t["cells"], t["tasks"], []
    if plots and runs:
        written += plot_sweeps(runs, out)
        spread = plot_seed_spread(cells, tasks, out, scale)
        written += [spread] if spread else []
        written += plot_curves(cells, tasks, out)
    points = pareto_points(runs, t["costs"]) if plots else []
    if points:
        written.append(plot_pareto(points, out / "pareto.png", scale))
    if runs and (plots or figure is not None):
        fig_path = plot_objectives(cells, tasks, figure if figure is not None else out / "objectives.png", scale,
                                   t["comparisons"], alpha, t["metric_of"])
        written += [fig_path] if fig_path else []
    return written


def build_table(runs: list[RunRecord], row_keys: list[str], scale: float, alpha: float) -> dict[str, Any]:
    """Cells, header, rows, significance and chosen settings of the runs' table."""
    cells, swept = build_cells(runs)
    tasks = _task_order({r.task for r in runs})
    label_cols = ["student", "objective", *row_keys]
    metric_of = {t: next(r.metric for r in runs if r.task == t) for t in tasks}
    comparisons = compare_with_baseline(cells)
    const = _constant_parts(runs, cells, tasks, len(label_cols), scale)
    costs = {r.path: run_cost(r) for r in runs}
    rows = table_rows(cells, tasks, scale, comparisons, alpha, const["near"]) + const.pop("row")
    extra = []
    if any(costs.values()):  # × smaller / × faster beside the average
        extra, ratio = COST_COLUMNS, cost_cells(cells, costs)
        rows = [[*r, *ratio.get(tuple(r[:len(label_cols)]), ["—", "—"])] for r in rows]
    return {"cells": cells, "swept": swept, "tasks": tasks, "label_cols": label_cols, "metric_of": metric_of,
            "header": [*label_cols, *[f"{t} ({metric_of[t]})" for t in tasks], "avg", *extra], "costs": costs,
            "rows": rows, "untrusted": untrusted_speed_lines(runs, costs),
            "comparisons": comparisons, "footnote": significance_footnote(comparisons, alpha), "alpha": alpha,
            "sig_lines": comparison_lines(comparisons, tasks, scale), "chosen": _chosen_lines(cells, tasks),
            "mde_lines": mde_lines(comparisons, cells, tasks, scale, alpha), **const}


def _constant_parts(runs: list[RunRecord], cells: dict[tuple, dict[str, Cell]], tasks: list[str], n_label_cols: int,
                    scale: float) -> dict[str, Any]:
    """The constant-predictor baseline's table row, note, and the cells within noise of it."""
    bases, differing = task_baselines(runs)
    near = near_cells(cells)
    row = constant_row(bases, tasks, n_label_cols, scale)
    return {"bases": bases, "near": near, "row": [row] if row else [],
            "constant_note": constant_note(bases, tasks, scale) if bases else "",
            "near_lines": near_lines(near, cells, tasks, scale)
            + [f"- {t}: its runs record different baselines (different training or dev data?)" for t in differing]}


def report(paths: list[Path], out: Path, row_keys: list[str] | None = None, scale: float = 100.0,
           plots: bool = True, stream=None, figure: Path | None = None, alpha: float = 0.05) -> dict[str, Any]:
    """Build the table (printed as Markdown), write CSV/LaTeX/PNGs into ``out``; returns a summary.

    ``figure``: where the objectives × tasks bar chart goes (default ``out/objectives.png`` when
    ``plots``; written even without ``plots`` when given). ``alpha``: level of the table's marks."""
    stream = stream or sys.stdout
    runs, problems = collect(paths, row_keys or [])
    if not runs and not problems:
        raise FileNotFoundError(f"no results.json or Hydra job directories under {', '.join(map(str, paths))}")
    t = build_table(runs, list(row_keys or []), scale, alpha)
    out.mkdir(parents=True, exist_ok=True)
    text = _report_text(t, problems, scale)
    n_dup = sum(p.status == "duplicate" for p in problems)
    n_missing = len(problems) - n_dup
    print(f"# kdrun report: {len(runs)} finished runs" + (f", {n_missing} without results" if n_missing else "")
          + (f", {n_dup} duplicates counted once" if n_dup else ""), file=stream)
    n_near = sum(len(v) for v in t["near"].values())
    if n_near:
        print(f"kdrun-report: warning: {n_near} cell(s) within noise of the constant-predictor baseline "
              f"(marked {NEAR_MARK}, listed under the table)", file=sys.stderr)
    if t["untrusted"]:
        print(f"kdrun-report: warning: {len(t['untrusted'])} run(s) timed on a busy machine: their speed is left "
              "out (listed under 'Speed left out')", file=sys.stderr)
    if n_dup:
        print(f"kdrun-report: warning: {n_dup} run(s) repeat the setting and seed of another run and are "
              "counted once (listed under 'Duplicate runs')", file=sys.stderr)
    print(f"\nDev scores ×{scale:g}, mean ± std over seeds (best setting per task by mean dev score; "
          "* = average over the tasks present).\n", file=stream)
    print(text, file=stream, end="")
    written = [out / "table.csv", out / "table.tex", out / "table.md"]  # each written whole or not at all
    write_text_atomic(written[0], _csv_text(t))
    write_text_atomic(written[1], latex(t["header"], t["rows"], len(t["label_cols"]), t["footnote"]))
    write_text_atomic(written[2], text)
    written += _figures(runs, t, out, scale, plots, figure, alpha)
    print("\nwritten: " + ", ".join(str(p) for p in written), file=stream)
    return {"problems": problems, "files": written, "runs": runs,
            **{k: t[k] for k in ("cells", "swept", "header", "rows", "comparisons", "footnote")}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kdrun-report",
        description="Tables (Markdown, CSV, LaTeX) and plots from kdrun run or multirun directories.")
    ap.add_argument("paths", nargs="+", type=Path, help="run dirs, multirun dirs, or any parent of them")
    ap.add_argument("--out", type=Path, default=None, help="where files go (default: <first path>/report)")
    ap.add_argument("--rows", nargs="*", default=[], metavar="KEY",
                    help="config keys that split rows further, e.g. mapping.name (default: none)")
    ap.add_argument("--scale", type=float, default=100.0, help="multiply metrics by this (default 100)")
    ap.add_argument("--no-plots", action="store_true", help="only the tables (and --figure when given)")
    ap.add_argument("--figure", type=Path, default=None, metavar="FILE",
                    help="objectives × tasks bar chart (mean ± std over seeds, and the average) to FILE, e.g. "
                         "objectives.png; its suffix picks the format (default: <out>/objectives.png with the plots)")
    ap.add_argument("--alpha", type=float, default=0.05,
                    help=f"level of the table's significance marks vs the {BASELINE_OBJECTIVE} row (default 0.05)")
    args = ap.parse_args(argv)
    if args.figure is not None and args.figure.suffix.lower().lstrip(".") not in FIGURE_FORMATS:
        ap.error(f"--figure {args.figure}: give a file name ending in one of "
                 + ", ".join("." + f for f in sorted(FIGURE_FORMATS)))
    if not 0.0 < args.alpha < 1.0:
        ap.error(f"--alpha {args.alpha}: must be between 0 and 1")
    out = args.out or (args.paths[0] if args.paths[0].is_dir() else args.paths[0].parent) / "report"
    try:
        report(args.paths, out, args.rows, args.scale, plots=not args.no_plots, figure=args.figure, alpha=args.alpha)
    except FileNotFoundError as e:
        print(f"kdrun-report: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
