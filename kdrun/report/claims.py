"""The claims study: each testable statement of the CKD, MGSKD, ALP-KD and TinyBERT-study papers as
kdrun arms (an objective and overrides on ``experiment=glue_cpu``), and the analysis that turns
finished runs into the claims table.

A row compares two sides paired by seed: ``a`` against ``b``, where a side is an arm or the
difference of two arms (``x-y``, per seed). ``expect`` is ``>`` (the paper finds a above b), ``=``
(the paper finds no difference) or ``weights`` (a learnable map's final weights agree). Per row:
the mean ± sd of the paired differences (dev score x100), the exact two-sided sign-flip test and the
paired t-test (kdrun.report.significance, as kdrun-report), the Benjamini–Hochberg q-value of the
t-test's p over every measured row, the minimal detectable effect of the rule a verdict applies
(both tests at α = 0.05, power 0.8: ``significance.joint_mde``, simulated), for ``=`` rows two
one-sided t-tests of equivalence within ±EQUIVALENCE_MARGIN, and a verdict.

Runs are read from ``OUT/seeds/<task>/<arm>`` (the recipe's multiruns), and for the seeds missing
there from the CSV the report writes (docs/data/claims_runs.csv), so runs made on another machine
keep their rows; rows whose source is ``glue_cpu`` read the GLUE study's seed runs from
docs/data/glue_cpu_runs.csv instead.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from kdrun.report.claims_plan import (
    ARMS,
    CLAIMS,
    DROPPED,
    HALF,
    NOT_TESTABLE,
    Claim,
    Row,
    glue_cpu_seed_rows,
    run_cpu_seconds,
    steps,
)
from kdrun.report.results import RunRecord, collect
from kdrun.report.significance import (
    SEEDS_MOST,
    above_p,
    bh_qvalues,
    joint_mde,
    paired_t_p,
    seeds_needed,
    sign_flip_p,
    tost_p,
)
from kdrun.runtime.cache import write_text_atomic

MIN_SEEDS = 6
ALPHA = 0.05
EQUIVALENCE_MARGIN = 1.0  # "=" rows: equivalent when the difference lies within ±1 point (x100)
SAME_WEIGHTS = 0.05  # "the same values": final weights of the two initialisations within this, every seed
PRECISION_NAMES = {"no": "fp32"}  # train.precision=no: no mixed precision
# The dev score (x100) of a predictor that ignores its input: MCC and Pearson are 0 (undefined for a
# constant prediction, taken as no correlation); accuracy is the majority class's share (SST-2 dev: 444
# of 872 positive; MRPC dev: 279 of 408).
CONSTANT_SCORE = {"cola": 0.0, "stsb": 0.0, "sst2": 100 * 444 / 872, "mrpc": 100 * 279 / 408}
COLLAPSED_SEE = "see Collapsed arms"
COLLAPSE_MARGIN = 5.0  # points (x100): five times the equivalence margin
COLLAPSE_RULE = ("an arm's mean within noise of a constant predictor, or below the same student fine-tuned on "
                 f"the labels by more than the MDE of that paired comparison and more than {COLLAPSE_MARGIN:g} points")
START, END = "<!-- claims table: start -->", "<!-- claims table: end -->"

__all__ = ["ARMS", "CLAIMS", "Claim", "Row", "Stats", "Measured", "measured_runs", "recorded_runs", "load_arms",
           "glue_cpu_values", "row_stats", "verdict", "verdict_kind", "verdict_summary", "table_rows",
           "markdown_table", "arms_table",
           "not_testable_table", "replace_between_markers", "runs_csv", "final_map_weights", "wall_time",
           "cost_summary", "cost_table", "arm_scores_table"]


# ------------------------------------------------------------------------------------- reading runs

CSV_FIELDS = ("task", "arm", "objective", "overrides", "seed", "lr", "lambda_ckd", "metric", "dev", "device",
              "precision", "threads", "run_seconds", "map_weights", "commit", "teacher", "steps")


@dataclass(frozen=True)
class Measured:
    """One finished seed run of an arm as the table, the cost lines and the CSV use it: read from its
    run directory, or from the CSV that recorded it (docs/data/claims_runs.csv: runs made elsewhere)."""

    task: str
    arm: str
    seed: int
    objective: str
    dev: float  # the main dev metric x100
    metric: str = ""
    lr: str = ""
    lambda_ckd: str = ""
    device: str = ""
    precision: str = ""
    threads: str = ""
    run_seconds: float = 0.0
    weights: tuple[tuple[str, float], ...] = ()  # a learnable map's final weights, sorted by key
    # provenance: kdrun's commit (results.json's git_sha; "recorded:<sha>" for the runs made before it
    # was kept: the commit that first recorded the row), the teacher's cache key (or, for those runs,
    # its settings), and the optimizer steps of each stage ("189/189")
    commit: str = ""
    teacher: str = ""
    steps: str = ""

    def csv_row(self) -> list[str]:
        spec = ARMS.get(self.arm)
        return [self.task, self.arm, self.objective, " ".join(spec.overrides) if spec else "", str(self.seed),
                self.lr, self.lambda_ckd, self.metric, repr(self.dev), self.device, self.precision,
                self.threads, str(round(self.run_seconds, 1)),
                json.dumps(dict(self.weights), sort_keys=True) if self.weights else "",
                self.commit, self.teacher, self.steps]


def from_run(task: str, arm: str, r: RunRecord) -> Measured:
    res = json.loads((r.path / "results.json").read_text())
    lr, lam, threads = (r.flat.get(k) for k in ("train.lr", "objective.params.lambda_ckd", "train.num_threads"))
    return Measured(task, arm, r.seed, r.objective, 100.0 * r.value, r.metric, "" if lr is None else str(lr),
                    "" if lam is None else str(lam), res.get("device", ""), res.get("precision", ""),
                    "auto" if threads is None else str(threads), (res.get("timings") or {}).get("total_s", 0.0),
                    tuple(sorted(final_map_weights(r.path).items())), *provenance(res))


def provenance(res: dict) -> tuple[str, str, str]:
    """(commit, teacher key, steps per stage) of a run from its results.json."""
    commit = (res.get("git_sha") or "") + ("+dirty" if res.get("git_dirty") else "")
    steps = "/".join(str(st.get("steps", "")) for st in res.get("stages", []))
    return commit, (res.get("teacher") or {}).get("key", ""), steps


def from_csv_row(row: dict[str, str]) -> Measured:
    weights = json.loads(row["map_weights"]) if row.get("map_weights") else {}
    return Measured(row["task"], row["arm"], int(row["seed"]), row["objective"], float(row["dev"]), row["metric"],
                    row["lr"], row["lambda_ckd"], row["device"], row["precision"], row.get("threads", ""),
                    float(row["run_seconds"] or 0.0), tuple(sorted(weights.items())), row.get("commit", ""),
                    row.get("teacher", ""), row.get("steps", ""))


def load_arms(out: Path) -> dict[tuple[str, str], dict[int, RunRecord]]:
    """{(task, arm): {seed: run}} from ``out/seeds/<task>/<arm>`` (the latest run of a seed wins)."""
    found: dict[tuple[str, str], dict[int, RunRecord]] = {}
    seeds = out / "seeds"
    if not seeds.exists():
        return found
    for arm_dir in sorted(p for p in seeds.glob("*/*") if p.is_dir()):
        runs, _ = collect([arm_dir])
        if runs:
            found[(arm_dir.parent.name, arm_dir.name)] = {r.seed: r for r in runs}
    return found


Runs = dict[tuple[str, str], dict[int, Measured]]


def recorded_runs(path: Path) -> Runs:
    """{(task, arm): {seed: Measured}} of the runs the CSV at ``path`` records (none if it is absent)."""
    found: Runs = {}
    if path.exists():
        with open(path, newline="") as f:
            for m in map(from_csv_row, csv.DictReader(f)):
                found.setdefault((m.task, m.arm), {})[m.seed] = m
    return found


def measured_runs(out: Path, recorded: Path | None = None) -> Runs:
    """{(task, arm): {seed: Measured}}: the runs under ``out``, and for the seeds they lack, the runs
    the CSV ``recorded`` holds (so a study continued on another machine keeps the rows it had)."""
    found = {k: {s: from_run(*k, r) for s, r in v.items()} for k, v in load_arms(out).items()}
    for key, by_seed in (recorded_runs(recorded) if recorded is not None else {}).items():
        for seed, m in by_seed.items():
            found.setdefault(key, {}).setdefault(seed, m)
    return found


def glue_cpu_values(csv_path: Path) -> dict[tuple[str, str], dict[int, float]]:
    """{(task, objective): {seed: dev x100}} of the GLUE study's seed runs (its runs.csv)."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for r in glue_cpu_seed_rows(csv_path):
        out.setdefault((r["task"], r["objective"]), {})[int(r["seed"])] = float(r["dev"])
    return out


def values_of(runs: Runs) -> dict[tuple[str, str], dict[int, float]]:
    return {k: {s: m.dev for s, m in v.items()} for k, v in runs.items()}


def side(values: dict[tuple[str, str], dict[int, float]], task: str, spec: str) -> dict[int, float]:
    """{seed: value} of an arm, or of ``x-y`` (arm x minus arm y on the seeds both have)."""
    if "-" not in spec:
        return values.get((task, spec), {})
    x, y = (values.get((task, name), {}) for name in spec.split("-"))
    return {s: x[s] - y[s] for s in sorted(set(x) & set(y))}


# ------------------------------------------------------------------------------------ collapsed arms

def control_of(arm: str) -> str:
    """The same student fine-tuned on the same labels: ``finetune_l2`` for an arm of 2-layer students,
    ``finetune_half`` for one trained on half the data (``task.max_train_samples=1000``), else
    ``finetune`` (the objective of the GLUE study's runs, and the recipe's 3-layer control)."""
    overrides = ARMS[arm].overrides if arm in ARMS else ()
    if "student.num_layers=2" in overrides:
        return "finetune_l2"
    return "finetune_half" if HALF in overrides else "finetune"


def collapse_reason(values: dict[tuple[str, str], dict[int, float]], task: str, arm: str) -> str | None:
    """Why ``arm`` did not learn on ``task``, or None: its mean lies within noise of a constant
    predictor (a one-sided t-test does not put it above CONSTANT_SCORE at ALPHA), or below the same
    student fine-tuned on the labels (control_of) by more than the MDE of that paired comparison and
    more than COLLAPSE_MARGIN (a student a little worse than its control has learnt; it is not collapsed)."""
    own = values.get((task, arm), {})
    if len(own) < MIN_SEEDS or arm == control_of(arm):
        return None
    x = list(own.values())
    mean, sd = statistics.fmean(x), statistics.stdev(x)
    floor = CONSTANT_SCORE.get(task)
    if floor is not None:
        p = above_p(x, floor)
        if p is None or p >= ALPHA:
            return (f"{mean:.1f} ± {sd:.1f}, within noise of a constant predictor ({floor:.1f}; one-sided "
                    f"t-test p {_f(p, '.2g')})")
    control = values.get((task, control_of(arm)), {})
    if len(control) >= MIN_SEEDS:
        st = row_stats(own, control)
        if st.mean is not None and st.mde is not None and st.mean < -max(st.mde, COLLAPSE_MARGIN):
            return (f"{mean:.1f} ± {sd:.1f}, below `{control_of(arm)}` ({statistics.fmean(control.values()):.1f}) "
                    f"by {-st.mean:.1f} ± {_f(st.sd, '.1f')}, more than the MDE {st.mde:.2f}")
    return None


def collapsed_arms(values, theirs) -> dict[tuple[str, str, str], str]:
    """{(source, task, arm): reason} for every arm of a row that collapsed (collapse_reason), read
    from the recipe's runs or, for the rows the GLUE study answers, from its runs."""
    out = {}
    for c in CLAIMS:
        vals = theirs if c.source == "glue_cpu" else values
        for task in c.tasks:
            for r in (r for r in c.rows if r.expect != "weights" and (not r.tasks or task in r.tasks)):
                for arm in r.arms():
                    why = collapse_reason(vals, task, arm)
                    if why:
                        out[(c.source, task, arm)] = why
    return out


# ------------------------------------------------------------------------------------- statistics

@dataclass
class Stats:
    n: int
    mean: float | None = None
    sd: float | None = None
    p_flip: float | None = None
    p_t: float | None = None
    mde: float | None = None  # of the rule a verdict applies: both tests, in the paper's direction
    p_tost: float | None = None  # equivalence within ±margin (rows whose paper finds no difference)
    margin: float | None = None
    q: float | None = None  # Benjamini–Hochberg over every measured row's t-test p


def row_stats(a: dict[int, float], b: dict[int, float], margin: float | None = None) -> Stats:
    """The paired differences a - b over the seeds both sides have; with ``margin``, also the TOST
    p-value of equivalence within ±margin."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return Stats(0)
    xa, xb = [a[s] for s in seeds], [b[s] for s in seeds]
    d = [x - y for x, y in zip(xa, xb)]
    sd = statistics.stdev(d) if len(d) > 1 else None
    return Stats(len(d), statistics.fmean(d), sd, sign_flip_p(d)[0], paired_t_p(xa, xb),
                 None if sd is None else joint_mde(len(d), sd),
                 None if margin is None else tost_p(d, margin), margin)


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def verdict(row: Row, st: Stats, task: str = "", why: str = "", collapsed: tuple[str, ...] = ()) -> str:
    """reproduced / not reproduced (and the measured reason) / not run yet, from the row's stats;
    "not informative" when an arm of either side ``collapsed`` (it did not learn: collapse_reason)."""
    if st.n < MIN_SEEDS:
        return "not run yet" if st.n == 0 else f"not run yet ({st.n} of {MIN_SEEDS} seeds)"
    if collapsed:
        return f"not informative: {', '.join(f'`{a}`' for a in collapsed)} collapsed ({COLLAPSED_SEE})"
    sig = sum(p is not None and p < ALPHA for p in (st.p_flip, st.p_t))
    if row.expect == "=":
        return _equivalence_verdict(st, sig)
    if st.mean > 0 and sig == 2:
        return "reproduced"
    if sig == 2:
        return f"not reproduced: reversed ({st.mean:+.2f}, both tests)"
    if sig == 1:
        return f"not reproduced: {'in' if st.mean > 0 else 'reversed in'} one of two tests only"
    return "not reproduced: " + _reason(row.delta_for(task), st, why)


def _equivalence_verdict(st: Stats, sig: int) -> str:
    """A "no difference" row: equivalent (TOST within ±margin), a difference (both tests), or neither."""
    if st.p_tost is not None and st.p_tost < ALPHA:
        return f"reproduced: equivalent within ±{st.margin:.2f} (TOST p {st.p_tost:.3g})"
    if sig == 2:
        return f"not reproduced: they differ by {st.mean:+.2f} (both tests)"
    one = "; a difference in one of two tests only" if sig == 1 else ""
    return (f"inconclusive: neither a difference nor equivalence within ±{st.margin:.2f} "
            f"(TOST p {_f(st.p_tost, '.3g')}){one}")


def _reason(delta: float | None, st: Stats, why: str) -> str:
    """Why a difference was not detected: power (the paper's effect below the MDE) or otherwise."""
    if delta is not None and st.mde is not None and abs(delta) < st.mde:
        need = seeds_needed(delta, st.sd)  # st.sd > 0 here: an MDE of 0 is below no paper effect
        seeds = f"at this sd ≥ {need}" if need else f"more than {SEEDS_MOST}"
        seeds = f"; {seeds} seeds would detect it"
        return f"power (the paper's {delta:+.1f} is below the MDE {st.mde:.2f}{seeds})"
    base = f"no difference above the MDE {_f(st.mde)}"
    if delta is not None:
        base += f", which the paper's {delta:+.1f} exceeds"
    return base + (f"; {why}" if why else "")


# --------------------------------------------------------------------------- learnable map weights

def final_map_weights(run_dir: Path) -> dict[str, float]:
    """The last logged weight of each learnable-map entry (``objective/map*/s<j>/t<k>``) of a run."""
    path = run_dir / "metrics.jsonl"
    last: dict[str, float] = {}
    if not path.exists():
        return last
    for line in path.read_text().splitlines():
        for k, v in json.loads(line).items():
            if k.startswith("objective/map") and "/s" in k and isinstance(v, (int, float)):
                last[k.split("/", 1)[1]] = float(v)
    return last


def weights_row(runs: Runs, task: str, row: Row) -> tuple[str, str]:
    """(measured, verdict) of a ``weights`` row: per seed the largest gap between the two arms' final
    weights; reproduced when every seed's gap is below SAME_WEIGHTS."""
    a, b = runs.get((task, row.a), {}), runs.get((task, row.b), {})
    gaps = []
    for s in sorted(set(a) & set(b)):
        wa, wb = dict(a[s].weights), dict(b[s].weights)
        if wa and set(wa) == set(wb):
            gaps.append(max(abs(wa[k] - wb[k]) for k in wa))
    if len(gaps) < MIN_SEEDS:
        return "—", "not run yet" if not gaps else f"not run yet ({len(gaps)} of {MIN_SEEDS} seeds)"
    mean, sd = statistics.fmean(gaps), statistics.stdev(gaps)
    measured = f"largest gap {mean:.3f} ± {sd:.3f} (n={len(gaps)})"
    if max(gaps) < SAME_WEIGHTS:
        return measured, f"reproduced: every seed's gap below {SAME_WEIGHTS}"
    return measured, (f"not testable at this budget: gap up to {max(gaps):.3f} (start {row.delta_for(task) or 0:.3f}); "
                      "the paper's weights are trained to convergence")


def weights_cell(runs: Runs, task: str, arm: str) -> str:
    """The mean final weights of an arm's runs, for the table ('s1/t1 0.42, ...')."""
    per = [dict(m.weights) for m in runs.get((task, arm), {}).values()]
    per = [w for w in per if w]
    if not per:
        return ""
    keys = sorted(per[0])
    return ", ".join(f"{k.split('/', 1)[-1]} {statistics.fmean(w.get(k, 0.0) for w in per):.2f}" for k in keys)


# ------------------------------------------------------------------------------------------ table

def _label(spec: str) -> str:
    return " − ".join(f"`{x}`" for x in spec.split("-"))


def table_rows(out: Path, glue_cpu_csv: Path, recorded: Path | None = None) -> list[dict[str, str]]:
    """One dict per (claim, task, row): what the paper says, what kdrun measured, and the verdict."""
    return rows_of(measured_runs(out, recorded), glue_cpu_csv)


def rows_of(runs: Runs, glue_cpu_csv: Path) -> list[dict[str, str]]:
    """table_rows from runs already read."""
    mine, theirs = values_of(runs), glue_cpu_values(glue_cpu_csv)
    found = [(c, task, r, _stats(r, task, theirs if c.source == "glue_cpu" else mine))
             for c in CLAIMS for task in c.tasks for r in c.rows if not r.tasks or task in r.tasks]
    tested = [st for *_, st in found if st is not None and st.n >= MIN_SEEDS and st.p_t is not None]
    for st, q in zip(tested, bh_qvalues([st.p_t for st in tested])):
        st.q = q
    down = collapsed_arms(mine, theirs)
    return [_table_row(c, task, r, runs, st, tuple(a for a in dict.fromkeys(r.arms()) if (c.source, task, a) in down))
            for c, task, r, st in found]


def _stats(r: Row, task: str, values) -> Stats | None:
    """The row's paired statistics (None for a ``weights`` row); ``=`` rows with the TOST margin."""
    if r.expect == "weights":
        return None
    margin = EQUIVALENCE_MARGIN if r.expect == "=" else None
    return row_stats(side(values, task, r.a), side(values, task, r.b), margin)


def _table_row(c: Claim, task: str, r: Row, runs: Runs, st: Stats | None,
               collapsed: tuple[str, ...] = ()) -> dict[str, str]:
    base = {"claim": c.key, "paper": c.paper, "task": task, "a": r.a, "b": r.b, "expect": r.expect,
            "paper_numbers": r.paper, "source": c.source}
    if st is None:
        measured, v = weights_row(runs, task, r)
        detail = "; ".join(f"{arm}: {weights_cell(runs, task, arm) or '—'}" for arm in (r.a, r.b))
        return {**base, "n": "", "mean": "", "sd": "", "p_flip": "", "p_t": "", "q": "", "mde": "", "tost": "",
                "measured": f"{measured}; {detail}", "verdict": v}
    measured = "—" if st.n == 0 else f"{st.mean:+.2f} ± {_f(st.sd)} (n={st.n})"
    tost = "" if st.margin is None else f"±{st.margin:.2f}: p {_f(st.p_tost, '.3g')}"
    return {**base, "n": str(st.n), "mean": _f(st.mean), "sd": _f(st.sd), "p_flip": _f(st.p_flip, ".3g"),
            "p_t": _f(st.p_t, ".3g"), "q": _f(st.q, ".3g"), "mde": _f(st.mde), "tost": tost,
            "measured": measured, "verdict": verdict(r, st, task, c.why, collapsed)}


def markdown_table(rows: list[dict[str, str]]) -> str:
    head = ("| claim | task | comparison | paper | kdrun: difference (mean ± sd, n) | p sign-flip | p t-test "
            "| q (BH) | MDE, both tests | equivalence (TOST) | verdict | source |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        cmp = f"{_label(r['a'])} {r['expect'] if r['expect'] != 'weights' else 'same weights as'} {_label(r['b'])}"
        src = "glue_cpu study" if r["source"] == "glue_cpu" else "claims recipe"
        cells = (r["measured"], *(r[k] or "—" for k in ("p_flip", "p_t", "q", "mde", "tost")), r["verdict"], src)
        lines.append(f"| {r['claim']} | {r['task']} | {cmp} | {r['paper_numbers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


KINDS = (("not informative", "not informative"),
         ("reproduced: equivalent", "equivalent"), ("reproduced", "reproduced"), ("inconclusive", "inconclusive"),
         ("not reproduced: reversed (", "reversed (both tests)"),
         ("not reproduced: reversed in one", "one of two tests only"),
         ("not reproduced: in one", "one of two tests only"),
         ("not reproduced: power", "power"), ("not reproduced: no difference", "no difference above the MDE"),
         ("not reproduced: they differ", "a difference where the paper finds none"),
         ("not testable at this budget", "not testable at this budget"), ("not run yet", "not run yet"))


def verdict_kind(v: str) -> str:
    """The summary's category of a verdict: equivalent, reproduced, inconclusive, not run yet, or
    the reason it is not reproduced."""
    return next(label for prefix, label in KINDS if v.startswith(prefix))


def verdict_summary(rows: list[dict[str, str]]) -> str:
    """One paragraph: the rows per verdict and reason, and those whose q-value is below ALPHA."""
    kinds = [verdict_kind(r["verdict"]) for r in rows]
    count = {k: kinds.count(k) for k in dict.fromkeys(label for _, label in KINDS)}
    apart = ("equivalent", "reproduced", "inconclusive", "not informative", "not testable at this budget",
             "not run yet")
    failed = [k for k in count if count[k] and k not in apart]
    tested = [(r, k) for r, k in zip(rows, kinds) if r["q"] not in ("", "—")]
    survive = [k for r, k in tested if float(r["q"]) < ALPHA]
    by = ", ".join(f"{survive.count(k)} {k}" for k in dict.fromkeys(survive))
    return (f"**Verdicts:** {len(rows)} rows; {count['reproduced']} reproduced in the paper's direction, "
            f"{count['equivalent']} equivalent (the paper's \"no difference\", within ±{EQUIVALENCE_MARGIN:.2f}), "
            f"{count['inconclusive']} inconclusive, {count['not informative']} not informative (an arm "
            f"collapsed), {count['not testable at this budget']} not testable at this budget, "
            f"{sum(count[k] for k in failed)} not reproduced"
            + (" (" + "; ".join(f"{k}: {count[k]}" for k in failed) + ")" if failed else "")
            + (f", {count['not run yet']} not run yet" if count["not run yet"] else "")
            + f". Benjamini–Hochberg over the {len(tested)} rows' t-test p-values: {len(survive)} have q < {ALPHA:g}"
            + (f" ({by})." if survive else "."))


def collapsed_table(runs: Runs, glue_cpu_csv: Path) -> str:
    """Every arm of a row that collapsed (collapse_reason), with its measured reason."""
    down = collapsed_arms(values_of(runs), glue_cpu_values(glue_cpu_csv))
    if not down:
        return "No arm of a row collapsed."
    lines = ["| task | arm | runs of | why it is counted as collapsed |", "|---|---|---|---|"]
    lines += [f"| {task} | `{arm}` | {'glue_cpu study' if src == 'glue_cpu' else 'claims recipe'} | {why} |"
              for (src, task, arm), why in sorted(down.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))]
    return "\n".join(lines)


def _layer_entropy(weights: dict[str, float]) -> dict[str, tuple[str, float, float, bool]]:
    """{student layer: (teacher layer with the most weight, its weight, entropy in nats, measured)} of
    one run's attention-map weights (``<map>/s<j>/t<k>``, ``<map>/s<j>/entropy``). Without a recorded
    entropy, that of the mean weights, an upper bound of the mean per-example entropy (measured False)."""
    import math

    by: dict[str, dict[str, float]] = {}
    for k, v in weights.items():
        *_, sj, tk = k.split("/")
        by.setdefault(sj, {})[tk] = v
    out = {}
    for sj, row in sorted(by.items()):
        layers = {t: w for t, w in row.items() if t.startswith("t")}
        top = max(layers, key=layers.get)
        if "entropy" in row:
            out[sj] = (top, layers[top], row["entropy"], True)
        else:
            out[sj] = (top, layers[top], -sum(w * math.log(w) for w in layers.values() if w > 0), False)
    return out


def attention_table(runs: Runs) -> str:
    """ALP's attention over the teacher layers per arm and task: for each student layer the teacher
    layer with the most weight, that weight and the entropy of α (mean over seeds; log k = uniform)."""
    lines = ["| task | arm | student layer | top teacher layer (weight) | entropy of α, nats (uniform: log 6 = 1.79) "
             "| n |", "|---|---|---|---|---|---:|"]
    for (task, arm), by_seed in sorted(runs.items()):
        if ARMS.get(arm) is None or ARMS[arm].objective != "alp":
            continue
        per = [_layer_entropy(dict(m.weights)) for m in by_seed.values() if m.weights]
        for sj in (sorted(per[0]) if per else []):
            tops = sorted({p[sj][0] for p in per if sj in p})
            w = statistics.fmean(p[sj][1] for p in per if sj in p)
            h = statistics.fmean(p[sj][2] for p in per if sj in p)
            bound = "" if all(p[sj][3] for p in per if sj in p) else "≤ "
            lines.append(f"| {task} | `{arm}` | {sj} | {'/'.join(tops)} ({w:.3f}) | {bound}{h:.3f} | {len(per)} |")
    return "\n".join(lines)


def arms_table(tasks: tuple[str, ...] = ("cola", "sst2", "stsb")) -> str:
    """Every arm the recipe runs: its objective, overrides and tasks (``experiment=glue_cpu``)."""
    on: dict[str, list[str]] = {}
    for _, task, arm in steps(list(tasks)):
        on.setdefault(arm, []).append(task)
    lines = ["| arm | objective | overrides | learning rate of | tasks |", "|---|---|---|---|---|"]
    for name, ts in on.items():
        a = ARMS[name]
        lines.append(f"| `{name}` | `{a.objective}` | {' '.join(f'`{o}`' for o in a.overrides) or '—'} | "
                     f"`{a.base}` | {', '.join(ts)} |")
    return "\n".join(lines)


def not_testable_table(entries=NOT_TESTABLE, head: str = "why not testable offline") -> str:
    lines = [f"| paper | claim | {head} |", "|---|---|---|"]
    lines += [f"| {paper} | {claim} | {why} |" for paper, claim, why in entries]
    return "\n".join(lines)


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with what lies between START and END replaced by ``block`` (markers appended if absent)."""
    if START not in text or END not in text:
        return f"{text.rstrip()}\n\n{START}\n{block}\n{END}\n"
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{block}\n{END}{rest.split(END, 1)[1]}"


def runs_csv(runs: Runs) -> str:
    """Every finished run: task, arm, its overrides, seed, setting, dev score, device, precision,
    threads, seconds, and a learnable map's final weights."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for key in sorted(runs):
        for seed in sorted(runs[key]):
            w.writerow(runs[key][seed].csv_row())
    return buf.getvalue()


def arm_scores_table(runs: Runs) -> str:
    """Every arm's dev score per task: mean ± sd over its seeds (x100, the task's main metric)."""
    lines = ["| task | arm | metric | n | dev, mean ± sd |", "|---|---|---|---:|---|"]
    for (task, arm), by_seed in sorted(runs.items()):
        v = [m.dev for m in by_seed.values()]
        sd = f"{statistics.stdev(v):.2f}" if len(v) > 1 else "—"
        metric = next(iter(by_seed.values())).metric
        lines.append(f"| {task} | `{arm}` | {metric} | {len(v)} | {statistics.fmean(v):.2f} ± {sd} |")
    return "\n".join(lines)


def wall_time(out: Path) -> float:
    """The recipe's wall time in seconds: the sum over its invocations (OUT/wall_time.json)."""
    path = out / "wall_time.json"
    return sum(e["seconds"] for e in json.loads(path.read_text())) if path.exists() else 0.0


def cost_summary(runs: Runs, out: Path) -> str:
    """One line: the finished runs, their devices and precisions, the threads they used, their
    summed run time, and the recipe's wall time (every invocation under ``out``)."""
    every = [m for by_seed in runs.values() for m in by_seed.values()]
    if not every:
        return "**Measured:** no run of the recipe has finished yet."
    kinds = sorted({f"{m.device or '?'} {PRECISION_NAMES.get(m.precision, m.precision or '?')}" for m in every})
    threads = sorted({m.threads or "?" for m in every})
    run_s, wall = sum(m.run_seconds for m in every), wall_time(out)
    walls = (f"the wall time of the recipe's invocations on this output folder, teacher fine-tuning included, "
             f"{wall / 3600:.2f} hours (runs that the runs CSV recorded from other folders not included)"
             if wall > 0 else "the recipe's wall time not recorded in this output folder")
    return (f"**Measured:** {len(every)} runs finished ({', '.join(kinds)}; compute threads per run: "
            f"{', '.join(threads)}); their run times sum to {run_s / 3600:.2f} hours; {walls}.")


def cost_table(runs: Runs, tasks: tuple[str, ...] = ("cola", "sst2", "stsb"), seeds: int = MIN_SEEDS) -> str:
    """Per claim: the seed runs planned and finished, the CPU hours estimated for all of them
    (claims_plan.run_cpu_seconds) and the run hours measured for the finished ones, with the
    estimate for those same runs beside it (a run of one compute thread takes about its CPU time)."""
    by_claim: dict[str, list[float]] = {}
    for claim, task, arm in steps(list(tasks)):
        done = runs.get((task, arm), {})
        est = run_cpu_seconds(task, ARMS[arm])
        row = by_claim.setdefault(claim, [0, 0, 0.0, 0.0, 0.0])
        for i, v in enumerate((seeds, len(done), seeds * est, sum(m.run_seconds for m in done.values()),
                               len(done) * est)):
            row[i] += v
    lines = ["| claim | seed runs | finished | estimated CPU hours, all | measured run hours, finished "
             "| estimated, finished |", "|---|---:|---:|---:|---:|---:|"]
    for claim, (planned, done, est, measured, est_done) in by_claim.items():
        tail = f"{measured / 3600:.2f} | {est_done / 3600:.2f}" if done else "— | —"
        lines.append(f"| {claim} | {planned} | {done} | {est / 3600:.2f} | {tail} |")
    return "\n".join(lines)


def write_report(out: Path, glue_cpu_csv: Path, docs: Path | None = None, runs_path: Path | None = None) -> str:
    """The claims table (markdown) into OUT/report, and into ``docs`` between its markers; the CSV of
    every run into OUT/report and ``runs_path``, which also supplies the seeds OUT lacks (runs made
    elsewhere before). Returns the table."""
    runs = measured_runs(out, runs_path)
    rows = rows_of(runs, glue_cpu_csv)
    table = markdown_table(rows)
    block = (f"{cost_summary(runs, out)}\n\n{verdict_summary(rows)}\n\n{table}\n\n"
             f"**Collapsed arms** (the rule: {COLLAPSE_RULE}):\n\n{collapsed_table(runs, glue_cpu_csv)}\n\n"
             f"**ALP's attention over the teacher layers** (final logged α; \"≤\": the entropy of the mean α, "
             f"an upper bound of the mean per-example entropy, for runs that did not record it):\n\n"
             f"{attention_table(runs)}\n\n"
             f"**Every arm's dev score** (main metric x100, mean ± sd over its seeds):\n\n{arm_scores_table(runs)}\n\n"
             f"**The arms** (each on `experiment=glue_cpu`, seeds 1–6, more where a row's n says so):\n\n"
             f"{arms_table()}\n\n"
             f"**Not testable offline:**\n\n{not_testable_table()}\n\n"
             f"**Dropped rows** (not statements of the papers):\n\n{not_testable_table(DROPPED, 'why dropped')}\n\n"
             f"**Cost**, estimated and measured (seed runs; grid runs and teachers not included):\n\n"
             f"{cost_table(runs)}")
    text = runs_csv(runs)
    (out / "report").mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "report" / "claims_table.md", table + "\n")
    write_text_atomic(out / "report" / "claims_runs.csv", text)
    if docs is not None:
        write_text_atomic(docs, replace_between_markers(docs.read_text() if docs.exists() else "", block))
    if runs_path is not None:
        write_text_atomic(runs_path, text)
    return table


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="The claims table from the claims recipe's runs")
    p.add_argument("out", type=Path, help="the recipe's output directory (outputs/claims)")
    p.add_argument("--glue-cpu-csv", type=Path, default=Path("docs/data/glue_cpu_runs.csv"))
    p.add_argument("--docs", type=Path, default=None, help="markdown file whose table to replace (docs/claims.md)")
    p.add_argument("--runs-csv", type=Path, default=None, help="where to write every run (docs/data/claims_runs.csv)")
    a = p.parse_args(argv)
    print(write_report(a.out, a.glue_cpu_csv, a.docs, a.runs_csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
