"""The constant predictor beside every score: what a model that ignores its input gets on each dev split.

Classification: the majority class of the training split (ties: the smallest class id);
regression: the training split's mean. Each dev split's baseline is the task's own metric
function run on that constant prediction, so every metric gets one. A constant has no
correlation with anything: Pearson and Spearman are undefined and reported as 0.0 (``note``).

``se`` is the noise scale of each metric on a dev set of that size, for a predictor with no
skill: accuracy sqrt(p(1-p)/n) with p the baseline accuracy (binomial); F1 the same (an
approximation); MCC 1/sqrt(n) (n·MCC² is χ²₁ under independence); Pearson and Spearman
1/sqrt(n-1) (a correlation under no association). A score less than ``NOISE_SE`` of these
above the baseline is within noise of it.

results.json: ``"baseline": {"kind", "label", "n": {split: n}, "se": {split: {metric: se}},
split: {metric: value}}`` (with ``undefined`` and ``note`` when a metric is undefined); ``None``
for corpus tasks (a loss has no constant predictor); ``{"kind": None, "reason"}`` where no
baseline is defined (question answering).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter, defaultdict
from typing import Any, NamedTuple

import numpy as np

MAJORITY, MEAN = "majority class", "training mean"
NOISE_SE = 2.0  # a score within this many SE of the baseline is within noise of it
RESERVED = ("kind", "label", "n", "se", "undefined", "note", "reason")
QA_REASON = ("question answering: an answer is a span of each question's own context, so no constant "
             "prediction is defined")


def _se(metric: str, p: float, n: int) -> float | None:
    """The dev-set noise scale of ``metric`` for a no-skill predictor (module docstring)."""
    if metric in ("accuracy", "f1"):
        return math.sqrt(p * (1.0 - p) / n)
    if metric == "matthews_correlation":
        return 1.0 / math.sqrt(n)
    if metric in ("pearson", "spearmanr"):
        return 1.0 / math.sqrt(n - 1) if n > 1 else None
    return None


def _constant(train_labels: np.ndarray, regression: bool) -> float | int:
    if regression:
        return float(np.mean(train_labels))
    return int(np.argmax(np.bincount(train_labels.astype(np.int64))))


def _scores(metrics: list[str], label: float | int, refs: np.ndarray, regression: bool) -> dict[str, float]:
    from kdrun.tasks.metrics import compute_task_metrics

    with warnings.catch_warnings():  # sklearn and scipy warn about constant predictions
        warnings.simplefilter("ignore")
        return compute_task_metrics(metrics, np.full(len(refs), label), refs, regression)


def constant_baseline(metrics: list[str], regression: bool, train_labels: Any,
                      eval_labels: dict[str, Any]) -> dict[str, Any]:
    """The baseline entry of results.json for a labelled task (module docstring)."""
    train = np.asarray(train_labels)
    label = _constant(train, regression)
    out: dict[str, Any] = {"kind": MEAN if regression else MAJORITY, "label": label, "n": {}, "se": {}}
    undefined: set[str] = set()
    for split, labels in eval_labels.items():
        refs = np.asarray(labels)
        values = _scores(list(metrics), label, refs, regression)
        undefined |= {k for k, v in values.items() if not math.isfinite(v)}
        out[split] = {k: v if math.isfinite(v) else 0.0 for k, v in values.items()}
        p = float(np.mean(refs == label)) if not regression else 0.0
        out["n"][split] = len(refs)
        out["se"][split] = {k: _se(k, p, len(refs)) for k in values}
    if undefined:
        out["undefined"] = sorted(undefined)
        out["note"] = f"{', '.join(out['undefined'])} of a constant prediction: undefined, reported as 0.0"
    return out


def run_baseline(task_cfg: Any, train: Any, evals: dict[str, Any]) -> dict[str, Any] | None:
    """The baseline of a run from its tokenised splits, as the task's kind defines it (None: the kind
    has none, e.g. a corpus)."""
    from kdrun.tasks.kinds import kind_of

    return kind_of(task_cfg).baseline(task_cfg, train, evals)


def labelled_baseline(task_cfg: Any, train: Any, evals: dict[str, Any]) -> dict[str, Any]:
    """A constant prediction's scores from the ``labels`` columns; never raises, since it is computed
    after training: a failure is recorded as the reason."""
    try:
        return constant_baseline(list(task_cfg.metrics), task_cfg.num_labels == 1, list(train["labels"]),
                                 {s: list(d["labels"]) for s, d in evals.items()})
    except Exception as e:  # noqa: BLE001 — the trained student must still be written
        return {"kind": None, "reason": f"not computed ({type(e).__name__}: {e})"}


# ----------------------------------------------------------------------------------- reading it

def split_values(baseline: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """{split: {metric: value}} of a results.json baseline (empty when there is none)."""
    return {k: v for k, v in (baseline or {}).items() if k not in RESERVED}


class Baseline(NamedTuple):
    """One metric's baseline on one dev split."""

    value: float
    se: float | None
    kind: str
    undefined: bool = False  # 0.0 standing for a metric a constant prediction does not define


def lookup(baseline: dict[str, Any] | None, split: str, metric: str) -> Baseline | None:
    """``metric``'s baseline on ``split`` from a results.json baseline, or None."""
    values = split_values(baseline).get(split) or {}
    if metric not in values:
        return None
    se = ((baseline.get("se") or {}).get(split) or {}).get(metric)
    return Baseline(float(values[metric]), se, baseline["kind"], undefined(baseline, metric))


def undefined(baseline: dict[str, Any] | None, metric: str) -> bool:
    """Whether the baseline reports ``metric`` as 0.0 because it is undefined for a constant."""
    return metric in ((baseline or {}).get("undefined") or [])


def within_noise(value: float, base: float, se: float | None) -> str | None:
    """"below" or "within noise of" when ``value`` is not clearly above the baseline, else None."""
    if se is None:
        return None
    if value < base - NOISE_SE * se:
        return "below"
    return "within noise of" if value <= base + NOISE_SE * se else None


def kind_text(kind: str | None) -> str:
    return {MAJORITY: "majority-class", MEAN: "training-mean"}.get(kind, "constant")


def noise_warnings(summary: dict[str, Any]) -> list[str]:
    """One line per teacher or student main metric that is not clearly above the baseline."""
    baseline = summary.get("baseline")
    main = (summary.get("student") or {}).get("selected", {}).get("metric")
    lines = []
    for who in ("teacher", "student"):
        for split, metrics in ((summary.get(who) or {}).get("metrics") or {}).items():
            hit = lookup(baseline, split, main) if main in metrics else None
            where = within_noise(metrics[main], hit.value, hit.se) if hit else None
            if where:
                lines.append(f"warning: the {who}'s {main} on {split} ({metrics[main]:.4f}) is {where} the "
                             f"{kind_text(hit.kind)} baseline ({hit.value:.4f}; {NOISE_SE:g} SE = "
                             f"{NOISE_SE * hit.se:.4f})")
    return lines


def table_cells(baseline: dict[str, Any] | None, split: str, metric: str) -> tuple[str, str]:
    """The printed table's baseline and SE columns for one metric."""
    hit = lookup(baseline, split, metric)
    if hit is None:
        return "—", "—"
    return f"{hit.value:.4f}" + (" (constant)" if hit.undefined else ""), "—" if hit.se is None else f"{hit.se:.4f}"


def describe(baseline: dict[str, Any] | None) -> str | None:
    """The line under the printed table that says what the baseline is (None without one)."""
    if baseline is None:
        return None
    if baseline.get("kind") is None:
        return f"baseline: none ({baseline.get('reason')})"
    what = (f"the majority class of the training split ({baseline['label']})" if baseline["kind"] == MAJORITY
            else f"the training mean ({baseline['label']:.4f})")
    return (f"baseline: a constant prediction of {what}; SE: dev-set noise of a no-skill predictor"
            + (f"; {baseline['note']}" if baseline.get("note") else ""))


# ------------------------------------------------------------------------------ kdrun-report

NEAR_MARK = "≈"  # a cell's mean is within noise of (or below) the constant predictor's score


def cell_baseline(runs: list[Any]) -> Baseline | None:
    """The baseline of a table cell: the mean over its runs' recorded baselines (one dev set: all equal)."""
    hits = [r.baseline for r in runs if r.baseline is not None]
    if not hits:
        return None
    ses = [h.se for h in hits if h.se is not None]
    return hits[0]._replace(value=statistics.fmean(h.value for h in hits),
                            se=statistics.fmean(ses) if ses else None)


def task_baselines(runs: list[Any]) -> tuple[dict[str, Baseline], list[str]]:
    """Each task's most common baseline among its runs, and the tasks whose runs disagree
    (different training or dev data under one task name)."""
    by_task: dict[str, Counter] = defaultdict(Counter)
    for r in runs:
        if r.baseline is not None:
            by_task[r.task][r.baseline] += 1
    return ({t: c.most_common(1)[0][0] for t, c in by_task.items()},
            sorted(t for t, c in by_task.items() if len({b.value for b in c}) > 1))


def near_cells(cells: dict[tuple, dict[str, Any]]) -> dict[tuple, dict[str, str]]:
    """near[row][task] = "within noise of" | "below" for cells not clearly above their baseline."""
    out: dict[tuple, dict[str, str]] = defaultdict(dict)
    for row, by_task in cells.items():
        for task, cell in by_task.items():
            b = cell_baseline(cell.runs)
            where = within_noise(cell.mean, b.value, b.se) if b else None
            if where:
                out[row][task] = where
    return dict(out)


def _value_text(b: Baseline | None, scale: float) -> str:
    return "—" if b is None else f"{b.value * scale:.2f}" + (" (constant)" if b.undefined else "")


def constant_row(bases: dict[str, Baseline], tasks: list[str], n_label_cols: int, scale: float) -> list[str] | None:
    """The table's baseline row (None when no run recorded a baseline)."""
    if not bases:
        return None
    means = [bases[t].value * scale for t in tasks if t in bases]
    avg = f"{statistics.fmean(means):.2f}" + ("" if len(means) == len(tasks) else "*")
    kinds = " / ".join(sorted({b.kind for b in bases.values()}))
    return ["baseline", kinds, *[""] * (n_label_cols - 2), *[_value_text(bases.get(t), scale) for t in tasks], avg]


def constant_note(bases: dict[str, Baseline], tasks: list[str], scale: float) -> str:
    """The line under the table that says what the baseline row and the mark mean."""
    ses = ", ".join(f"{t} {bases[t].se * scale:.2f}" for t in tasks if t in bases and bases[t].se is not None)
    return (f"Row `baseline`: a constant prediction (the training split's majority class; the training mean "
            f"for regression, whose correlations are undefined and shown as 0) scored on each dev set. "
            f"{NEAR_MARK} the mean is within {NOISE_SE:g} SE of that baseline or below it; SE is the dev-set "
            f"noise of a no-skill predictor (×{scale:g}: {ses or 'not recorded'}).")


def near_lines(near: dict[tuple, dict[str, str]], cells: dict[tuple, dict[str, Any]], tasks: list[str],
               scale: float) -> list[str]:
    lines = []
    for row in sorted(near):
        for task in (t for t in tasks if t in near[row]):
            cell, b = cells[row][task], cell_baseline(cells[row][task].runs)
            lines.append(f"- {' / '.join(row)} · {task}: mean {cell.mean * scale:.2f} is {near[row][task]} the "
                         f"{kind_text(b.kind)} baseline {b.value * scale:.2f} ({NOISE_SE:g} SE = "
                         f"{NOISE_SE * b.se * scale:.2f})")
    return lines
