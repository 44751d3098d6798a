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
p = 2/2^n (0.25 for 3 seeds), which is why the t-test is shown as well.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import statistics
import sys
import tempfile
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


# ------------------------------------------------------------------------- paired significance

BASELINE_OBJECTIVE = "finetune"
EXACT_MAX_PAIRS = 16  # 2^16 sign assignments enumerated; more pairs are sampled
MONTE_CARLO_DRAWS = 200_000
SIGN_FLIP_MARK, TTEST_MARK = "†", "‡"  # "*" already means "average over the tasks present"


@dataclass
class Comparison:
    """One cell against the same student's finetune cell on the same task, paired over seeds."""

    baseline: tuple[str, ...]
    seeds: list[int]
    diffs: list[float]  # row minus baseline, per paired seed (unscaled)
    p_sign_flip: float | None
    p_ttest: float | None
    exact: bool

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean_diff(self) -> float | None:
        return statistics.fmean(self.diffs) if self.diffs else None

    def marks(self, alpha: float) -> str:
        out = ""
        if self.p_sign_flip is not None and self.p_sign_flip < alpha:
            out += SIGN_FLIP_MARK
        if self.p_ttest is not None and self.p_ttest < alpha:
            out += TTEST_MARK
        return out


def min_sign_flip_p(n: int) -> float:
    """The smallest p an exact two-sided sign-flip test over n pairs can give: the observed signs
    and their mirror image are always among the most extreme of the 2^n assignments."""
    return min(1.0, 2.0 / 2**n) if n > 0 else 1.0


def sign_flip_p(diffs: list[float], exact_max: int = EXACT_MAX_PAIRS, draws: int = MONTE_CARLO_DRAWS,
                seed: int = 0) -> tuple[float, bool]:
    """Two-sided paired permutation test of "the mean difference is 0" (Fisher 1935; Pitman 1937).

    Under the null hypothesis each difference is as likely to have the opposite sign, so the
    statistic |Σ dᵢ| is compared with its value under every one of the 2^n sign assignments
    (exact, up to ``exact_max`` pairs); with more pairs, ``draws`` random assignments are used and
    p = (1 + #{as extreme}) / (1 + draws) (Phipson & Smyth 2010). Returns (p, exact)."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n == 0:
        raise ValueError("no pairs")
    scale = float(np.abs(d).max())
    if scale == 0.0:
        return 1.0, True
    observed = abs(float(d.sum()))
    tol = 1e-9 * scale * n  # sums equal up to float rounding count as ties (as extreme)
    if n <= exact_max:
        bits = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
        sums = (1 - 2 * bits) @ d
        return float(np.count_nonzero(np.abs(sums) >= observed - tol)) / 2**n, True
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, draws, 10_000):
        signs = rng.choice((-1.0, 1.0), size=(min(10_000, draws - start), n))
        hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
    return (1 + hits) / (1 + draws), False


def paired_t_p(a: list[float], b: list[float]) -> float | None:
    """Two-sided paired t-test p-value (Student 1908) through ``scipy.stats.ttest_rel``; None with
    fewer than 2 pairs, when the differences have no spread (t undefined), or without scipy."""
    if len(a) < 2:
        return None
    d = [x - y for x, y in zip(a, b)]
    if statistics.pstdev(d) <= 1e-12 + 1e-9 * max(abs(x) for x in d):
        return None
    try:
        from scipy import stats
    except ImportError:  # scipy is a dependency; a stripped-down install still gets the sign-flip test
        return None
    return float(stats.ttest_rel(a, b).pvalue)


def _per_seed(cell: Cell) -> dict[int, float]:
    """Seed -> value; a seed run more than once in the chosen setting counts as its mean."""
    by_seed: dict[int, list[float]] = defaultdict(list)
    for r in cell.runs:
        by_seed[r.seed].append(r.value)
    return {s: statistics.fmean(v) for s, v in by_seed.items()}


def baseline_row(row: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The finetune row ``row`` is compared with: the one with the same student and the same extra
    row keys, else the student's only finetune row; None for finetune rows themselves, when the
    student has no finetune row, or when it has several and none matches."""
    if row[1] == BASELINE_OBJECTIVE:
        return None
    rows = list(rows)
    same = (row[0], BASELINE_OBJECTIVE, *row[2:])
    if same in rows:
        return same
    candidates = [r for r in rows if r[0] == row[0] and r[1] == BASELINE_OBJECTIVE]
    return candidates[0] if len(candidates) == 1 else None


def compare_with_baseline(cells: dict[tuple, dict[str, Cell]]) -> dict[tuple, dict[str, Comparison]]:
    """comparisons[row][task] for every cell whose row has a finetune baseline with that task."""
    out: dict[tuple, dict[str, Comparison]] = {}
    for row in sorted(cells):
        base = baseline_row(row, cells)
        if base is None:
            continue
        out[row] = {}
        for task, cell in cells[row].items():
            base_cell = cells[base].get(task)
            if base_cell is None:
                continue
            mine, theirs = _per_seed(cell), _per_seed(base_cell)
            seeds = sorted(set(mine) & set(theirs))
            a, b = [mine[s] for s in seeds], [theirs[s] for s in seeds]
            diffs = [x - y for x, y in zip(a, b)]
            p, exact = sign_flip_p(diffs) if diffs else (None, True)
            out[row][task] = Comparison(baseline=base, seeds=seeds, diffs=diffs, p_sign_flip=p,
                                        p_ttest=paired_t_p(a, b), exact=exact)
    return out


def _fmt_p(p: float | None) -> str:
    return "—" if p is None else f"{p:.3g}"


def significance_footnote(comparisons: dict[tuple, dict[str, Comparison]], alpha: float) -> str:
    """The line under the table that says what the marks mean, which tests, and the n behind them."""
    ns = sorted({c.n for cs in comparisons.values() for c in cs.values() if c.n > 0})
    if not ns:
        return ""
    floors = ", ".join(f"n={n}: {min_sign_flip_p(n):.3g}" for n in ns)
    unreachable = [n for n in ns if min_sign_flip_p(n) >= alpha]
    sampled = any(n > EXACT_MAX_PAIRS for n in ns)
    return (f"{SIGN_FLIP_MARK} p < {alpha:g} in an exact two-sided paired sign-flip permutation test "
            f"(Fisher 1935; Pitman 1937) against the same student's {BASELINE_OBJECTIVE} row, pairing runs "
            f"on the same task with the same seed (n = {', '.join(map(str, ns))} pairs; only seeds both rows "
            f"have count{'; more than ' + str(EXACT_MAX_PAIRS) + ' pairs: Monte Carlo' if sampled else ''}). "
            f"{TTEST_MARK} p < {alpha:g} in a paired t-test (Student 1908; scipy.stats.ttest_rel), which assumes "
            f"normally distributed differences. Smallest attainable sign-flip p = 2/2^n ({floors})"
            + (f", so with n ≤ {max(unreachable)} pairs {SIGN_FLIP_MARK} cannot appear." if unreachable else ".")
            + f" No mark: not significant, no {BASELINE_OBJECTIVE} row for the student, or no shared seeds.")


def comparison_lines(comparisons: dict[tuple, dict[str, Comparison]], tasks: list[str], scale: float) -> list[str]:
    lines = []
    for row in sorted(comparisons):
        for task in tasks:
            c = comparisons[row].get(task)
            if c is None:
                continue
            head = f"- {' / '.join(row)} · {task} vs {' / '.join(c.baseline)}: "
            if c.n == 0:
                lines.append(head + "no shared seeds, not tested")
                continue
            kind = "exact" if c.exact else f"Monte Carlo, {MONTE_CARLO_DRAWS} draws"
            lines.append(head + f"Δ = {c.mean_diff * scale:+.2f} over n={c.n} seeds [{','.join(map(str, c.seeds))}]; "
                         f"sign-flip p = {_fmt_p(c.p_sign_flip)} ({kind}, smallest attainable "
                         f"{min_sign_flip_p(c.n):.3g}); paired t-test p = {_fmt_p(c.p_ttest)}")
    return lines


def _fmt(cell: Cell | None, scale: float) -> str:
    if cell is None:
        return "—"
    if len(cell.values) == 1:
        return f"{cell.mean * scale:.2f}"
    return f"{cell.mean * scale:.2f} ± {cell.std * scale:.2f}"


def table_rows(cells: dict[tuple, dict[str, Cell]], tasks: list[str], scale: float,
               comparisons: dict[tuple, dict[str, Comparison]] | None = None, alpha: float = 0.05) -> list[list[str]]:
    rows = []
    for row in sorted(cells):
        cs = cells[row]
        cmp = (comparisons or {}).get(row, {})
        means = [cs[t].mean * scale for t in tasks if t in cs]
        avg = f"{statistics.fmean(means):.2f}" + ("" if len(means) == len(tasks) else "*") if means else "—"
        rows.append([*row, *[_fmt(cs.get(t), scale) + (cmp[t].marks(alpha) if t in cmp else "") for t in tasks],
                     avg])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def latex(header: list[str], rows: list[list[str]], n_label_cols: int, footnote: str = "") -> str:
    def esc(s: str) -> str:
        return (s.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("&", "\\&").replace("%", "\\%")
                .replace("±", "$\\pm$").replace("—", "--").replace("#", "\\#")
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


def _setting_text(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items()) or "(single setting)"


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        fig.tight_layout()
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=path.suffix.lstrip(".").lower() or "png", dpi=110)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as savefig(path) would create it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
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
           plots: bool = True, stream=None, figure: Path | None = None, alpha: float = 0.05) -> dict[str, Any]:
    """Build the table (printed as Markdown), write CSV/LaTeX/PNGs into ``out``; returns a summary.

    ``figure``: where the objectives × tasks bar chart goes (default ``out/objectives.png`` when
    ``plots``; written even without ``plots`` when given). ``alpha``: level of the table's marks."""
    stream = stream or sys.stdout
    runs, problems = collect(paths, row_keys or [])
    if not runs and not problems:
        raise FileNotFoundError(f"no results.json or Hydra job directories under {', '.join(map(str, paths))}")
    cells, swept = build_cells(runs)
    tasks = _task_order({r.task for r in runs})
    label_cols = ["student", "objective", *(row_keys or [])]
    metric_of = {t: next(r.metric for r in runs if r.task == t) for t in tasks}
    header = [*label_cols, *[f"{t} ({metric_of[t]})" for t in tasks], "avg"]
    comparisons = compare_with_baseline(cells)
    rows = table_rows(cells, tasks, scale, comparisons, alpha)
    footnote = significance_footnote(comparisons, alpha)
    sig_lines = comparison_lines(comparisons, tasks, scale)
    out.mkdir(parents=True, exist_ok=True)

    print(f"# kdrun report: {len(runs)} finished runs" + (f", {len(problems)} without results" if problems else ""),
          file=stream)
    print(f"\nDev scores ×{scale:g}, mean ± std over seeds (best setting per task by mean dev score; "
          "* = average over the tasks present).\n", file=stream)
    print(markdown(header, rows), file=stream)
    if footnote:
        print(f"\n{footnote}", file=stream)
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
    if sig_lines:
        print(f"\nPaired comparisons with {BASELINE_OBJECTIVE} (Δ ×{scale:g}, row minus baseline):", file=stream)
        print("\n".join(sig_lines), file=stream)
    if problems:
        print("\nJobs without results:", file=stream)
        for p in problems:
            print(f"- [{p.status}] {p.path}: {p.detail}", file=stream)

    # files, each written whole or not at all
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*label_cols, "task", "metric", "mean", "std", "n_seeds", "seeds", "values", "setting", "n_settings",
                "baseline", "n_pairs", "mean_diff_vs_finetune", "p_vs_finetune", "p_ttest_vs_finetune"])
    for row in sorted(cells):
        for task in tasks:
            c = cells[row].get(task)
            if c is not None:
                base = baseline_row(row, cells)
                cmp = comparisons.get(row, {}).get(task)
                sig = ["/".join(base) if base else "", cmp.n if cmp else (0 if base else ""),
                       "" if cmp is None or cmp.mean_diff is None else f"{cmp.mean_diff:.6f}",
                       "" if cmp is None or cmp.p_sign_flip is None else f"{cmp.p_sign_flip:.6g}",
                       "" if cmp is None or cmp.p_ttest is None else f"{cmp.p_ttest:.6g}"]
                w.writerow([*row, task, metric_of[task], f"{c.mean:.6f}", f"{c.std:.6f}", len(c.values),
                            " ".join(str(r.seed) for r in c.runs), " ".join(f"{v:.6f}" for v in c.values),
                            json.dumps(c.setting, default=str), c.n_settings, *sig])
    csv_path, tex_path, md_path = out / "table.csv", out / "table.tex", out / "table.md"
    write_text_atomic(csv_path, buf.getvalue())
    write_text_atomic(tex_path, latex(header, rows, len(label_cols), footnote))
    problem_lines = [f"- [{p.status}] {p.path}: {p.detail}" for p in problems]
    write_text_atomic(md_path, markdown(header, rows) + (f"\n\n{footnote}" if footnote else "")
                      + "\n\nChosen configurations:\n" + "\n".join(chosen_lines)
                      + (f"\n\nPaired comparisons with {BASELINE_OBJECTIVE} (Δ ×{scale:g}, row minus baseline):\n"
                         + "\n".join(sig_lines) if sig_lines else "")
                      + ("\n\nJobs without results:\n" + "\n".join(problem_lines) if problems else "") + "\n")
    written: list[Path] = []
    written += [csv_path, tex_path, md_path]
    if plots and runs:
        written += plot_sweeps(runs, out)
        spread = plot_seed_spread(cells, tasks, out, scale)
        if spread:
            written.append(spread)
        written += plot_curves(cells, tasks, out)
    if runs and (plots or figure is not None):
        fig_path = plot_objectives(cells, tasks, figure if figure is not None else out / "objectives.png", scale,
                                   comparisons, alpha, metric_of)
        if fig_path:
            written.append(fig_path)
    print("\nwritten: " + ", ".join(str(p) for p in written), file=stream)
    return {"cells": cells, "swept": swept, "problems": problems, "files": written, "runs": runs,
            "header": header, "rows": rows, "comparisons": comparisons, "footnote": footnote}


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
