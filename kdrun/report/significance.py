"""Paired significance of a table cell against the same student's finetune cell, over seeds: an exact
two-sided sign-flip permutation test (Fisher 1935; Pitman 1937) and a paired t-test (Student 1908);
the minimal detectable effect of such a design (paired t-test power, and simulated for the rule that
needs both tests); equivalence by two one-sided t-tests (Schuirmann 1987); and Benjamini–Hochberg
(1995) q-values over many comparisons."""

from __future__ import annotations

import functools
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from kdrun.report.results import Cell

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
    """One line per comparison: Δ, both tests' p and the Benjamini–Hochberg q of its t-test over the
    report's comparisons (the false discovery rate over the whole table)."""
    lines, qs = [], comparison_qvalues(comparisons)
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
                         f"{min_sign_flip_p(c.n):.3g}); paired t-test p = {_fmt_p(c.p_ttest)}"
                         + (f", q (BH over {len(qs)}) = {_fmt_p(qs[row, task])}" if (row, task) in qs else ""))
    return lines


# ----------------------------------------------------------------------- minimal detectable effect

POWER = 0.8


def min_detectable_effect(n: int, sd: float, alpha: float = 0.05, power: float = POWER) -> float | None:
    """The smallest true mean difference a two-sided paired t-test over ``n`` pairs detects with
    probability ``power`` at level ``alpha``: (t_{1-α/2,n-1} + t_{power,n-1}) · sd / √n, with ``sd``
    the standard deviation of the paired differences. None with fewer than 2 pairs, or without scipy."""
    if n < 2:
        return None
    try:
        from scipy import stats
    except ImportError:
        return None

    return float((stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n))


SEEDS_MOST = 1000  # seeds_needed looks no further


def seeds_needed(effect: float, sd: float, alpha: float = 0.05, power: float = POWER,
                 most: int = SEEDS_MOST) -> int | None:
    """The fewest pairs with which a paired t-test detects a true difference ``effect`` with
    probability ``power`` when the differences spread by ``sd``: the smallest n whose
    min_detectable_effect is at most ``|effect|``. A lower bound for the rule needing the sign-flip
    test too (simulated: its MDE is 1.27 times the t-test's with 6 pairs, 1.05 with 8, 1.02 with
    10). None above ``most``, with no spread, or without scipy."""
    if not sd or sd <= 0 or not effect:
        return None

    def short(n: int) -> bool:
        return (min_detectable_effect(n, sd, alpha, power) or math.inf) > abs(effect)

    lo, hi = 2, most
    if short(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if short(mid) else (lo, mid)
    return lo


def min_seeds_for_sign_flip(alpha: float) -> int:
    """The fewest pairs with which the exact sign-flip test can give p < ``alpha`` (2/2^n < alpha)."""
    n = 1
    while min_sign_flip_p(n) >= alpha:
        n += 1
    return n


@dataclass
class Spread:
    """A task's measured spread: the sd the MDE uses, the typical n, and where the sd comes from."""

    sd: float
    n: int
    source: str


def _count(items: list, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _pooled(groups: list[list[float]]) -> float:
    dof = sum(len(g) - 1 for g in groups)
    return math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in groups) / dof)


def task_spread(comparisons: dict[tuple, dict[str, Comparison]], cells: dict[tuple, dict[str, Cell]],
                task: str) -> Spread | None:
    """The sd of paired differences from finetune pooled over the task's comparisons (n: their median
    number of pairs); without paired differences √2 × the pooled sd of the scores (the difference of
    two independent runs; n: the cells' median number of seeds); None without two seeds anywhere."""
    diffs = [c.diffs for cs in comparisons.values() for t, c in cs.items() if t == task and c.n >= 2]
    if diffs:
        return Spread(_pooled(diffs), statistics.median_low(len(d) for d in diffs),
                      f"sd of paired differences with {BASELINE_OBJECTIVE}, pooled over {_count(diffs, 'comparison')}")
    scores = [c.values for cs in cells.values() for t, c in cs.items() if t == task and len(c.values) >= 2]
    if not scores:
        return None
    return Spread(math.sqrt(2) * _pooled(scores), statistics.median_low(len(v) for v in scores),
                  f"√2 × sd of the scores, pooled over {_count(scores, 'cell')}; no paired differences")


def mde_lines(comparisons: dict[tuple, dict[str, Comparison]], cells: dict[tuple, dict[str, Cell]],
              tasks: list[str], scale: float, alpha: float) -> list[str]:
    """Per task: the minimal detectable effect and whether the sign-flip test can reach ``alpha``."""
    lines = []
    for task in tasks:
        spread = task_spread(comparisons, cells, task)
        if spread is None:
            lines.append(f"- {task}: no spread measured (fewer than 2 seeds per cell)")
            continue
        floor = min_sign_flip_p(spread.n)
        mde = min_detectable_effect(spread.n, spread.sd, alpha)
        mde_text = "— (needs scipy)" if mde is None else f"{mde * scale:.2f}"
        if spread.sd == 0:  # every seed scored the same: no noise to detect an effect against
            mde_text = "undefined (no spread: every seed scored the same)"
        lines.append(f"- {task}: MDE = {mde_text} with n = {spread.n} seeds ({spread.source}: "
                     f"{spread.sd * scale:.2f}); smallest sign-flip p = 2/2^{spread.n} = {floor:.3g}"
                     + (f" ≥ {alpha:g}: the sign-flip test cannot reach {alpha:g} with fewer than "
                        f"{min_seeds_for_sign_flip(alpha)} seeds" if floor >= alpha else ""))
    return lines


def cell_mde(comparison: Comparison | None, alpha: float) -> float | None:
    """The MDE of one comparison from its own paired differences (None with fewer than 2)."""
    if comparison is None or comparison.n < 2:
        return None
    return min_detectable_effect(comparison.n, statistics.stdev(comparison.diffs), alpha)


# ------------------------------------------------------- the rule a verdict applies: both tests

JOINT_DRAWS = 100_000
JOINT_SEED = 0


def _t_two_sided_p(d):
    """Per row of ``d`` (draws × n): the two-sided one-sample t-test p-value of mean 0."""
    from scipy import stats

    n = d.shape[1]
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return 2 * stats.t.sf(abs(t), n - 1)


def _sign_flip_rows_p(d):
    """Per row of ``d`` (draws × n): the exact two-sided sign-flip p (as ``sign_flip_p``)."""
    import numpy as np

    n = d.shape[1]
    flips = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    observed = np.abs(d.sum(axis=1))[:, None]
    tol = 1e-9 * np.abs(d).max(axis=1)[:, None] * n
    return np.count_nonzero(np.abs(d @ flips.T) >= observed - tol, axis=1) / 2**n


def joint_power(effect: float, z, alpha: float = 0.05) -> float:
    """The share of draws ``z`` (standard normal, draws × n) shifted by ``effect`` (in sd units) in
    which both tests reach ``alpha`` with a positive mean: the rule behind "reproduced"."""
    d = z + effect
    hits = (_t_two_sided_p(d) < alpha) & (_sign_flip_rows_p(d) < alpha) & (d.mean(axis=1) > 0)
    return float(hits.mean())


@functools.cache
def joint_mde_unit(n: int, alpha: float = 0.05, power: float = POWER, draws: int = JOINT_DRAWS,
                   seed: int = JOINT_SEED) -> float:
    """``joint_mde`` for sd = 1 (the MDE scales with sd). The same normal draws serve every effect
    tried, so the simulated power only grows with the effect and bisection finds where it reaches
    ``power``; infinite where the sign-flip test cannot reach ``alpha`` with n pairs."""
    import numpy as np

    if min_sign_flip_p(n) >= alpha:
        return math.inf
    z = np.random.default_rng(seed).standard_normal((draws, n))
    lo, hi = 0.0, 1.0
    while joint_power(hi, z, alpha) < power:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if joint_power(mid, z, alpha) < power else (lo, mid)
    return hi


def joint_mde(n: int, sd: float, alpha: float = 0.05, power: float = POWER, draws: int = JOINT_DRAWS,
              seed: int = JOINT_SEED) -> float | None:
    """The smallest true mean difference that the exact sign-flip test and the paired t-test both
    detect at level ``alpha``, in its direction, with probability ``power``: simulated with ``draws``
    normal paired differences of standard deviation ``sd`` (seed ``seed``), bisected on the effect.
    None with fewer than 2 pairs or more than EXACT_MAX_PAIRS (the sign-flip test is enumerated)."""
    if n < 2 or n > EXACT_MAX_PAIRS:
        return None
    return joint_mde_unit(n, alpha, power, draws, seed) * sd


def tost_p(diffs: list[float], margin: float) -> float | None:
    """Two one-sided paired t-tests (Schuirmann 1987) of "the mean difference lies within ±margin":
    the larger of the p-values of H0: mean ≤ −margin and H0: mean ≥ +margin; equivalence is shown at
    level α when it is below α. None with fewer than 2 differences or no spread."""
    from scipy import stats

    n = len(diffs)
    if n < 2 or statistics.stdev(diffs) == 0:
        return None
    se = statistics.stdev(diffs) / math.sqrt(n)
    mean = statistics.fmean(diffs)
    p_lower = stats.t.sf((mean + margin) / se, n - 1)  # against mean ≤ −margin
    p_upper = stats.t.cdf((mean - margin) / se, n - 1)  # against mean ≥ +margin
    return float(max(p_lower, p_upper))


def above_p(values: list[float], bound: float) -> float | None:
    """One-sided one-sample t-test p of "the mean exceeds ``bound``" (H0: mean ≤ bound); None with
    fewer than 2 values; 0 or 1 when the values have no spread (all above the bound, or not)."""
    from scipy import stats

    n = len(values)
    if n < 2:
        return None
    if statistics.stdev(values) == 0:
        return 0.0 if values[0] > bound else 1.0
    t = (statistics.fmean(values) - bound) / (statistics.stdev(values) / math.sqrt(n))
    return float(stats.t.sf(t, n - 1))


def bh_qvalues(pvalues: list[float]) -> list[float]:
    """Benjamini–Hochberg (1995) q-values, in the order given: q_(i) = min over j ≥ i of
    m · p_(j) / j (p sorted ascending), at most 1. A hypothesis survives FDR q* when its q < q*."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    q = [0.0] * m
    running = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, m * pvalues[i] / rank)
        q[i] = running
    return q


def comparison_qvalues(comparisons: dict[tuple, dict[str, Comparison]]) -> dict[tuple[tuple, str], float]:
    """{(row, task): BH q-value} over every comparison with a t-test p-value (kdrun-report's cells
    against finetune), for a report that controls the false discovery rate over its whole table."""
    keys = [(row, task) for row in sorted(comparisons) for task, c in sorted(comparisons[row].items())
            if c.p_ttest is not None]
    return dict(zip(keys, bh_qvalues([comparisons[r][t].p_ttest for r, t in keys])))
