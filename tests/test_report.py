"""kdrun-report on hand-written results.json files: the numbers in the table are checked against
values computed here, and jobs without results are listed."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest

from kdrun.report.cli import baseline_row, main, min_sign_flip_p, report, sign_flip_p


def write_run(root: Path, name: str, task: str, objective: str, seed: int, value: float, metric: str = "accuracy",
              student: str = "bert_L4_H312", **cfg_extra) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / ".hydra").mkdir()
    config = {"seed": seed, "task": {"name": task, "main_metric": metric}, "objective": {"name": objective},
              "train": {"seed": seed, "lr": cfg_extra.pop("lr", 5e-5)}, "logger": {"group": name}, **cfg_extra}
    evals = [{"stage": "s", "step": s, "metrics": {"validation": {metric: value * s / 10}}} for s in (5, 10)]
    (d / "results.json").write_text(json.dumps({
        "task": task, "objective": objective, "config": config, "evals": evals,
        "student": {"name": student, "metrics": {"validation": {metric: value, "other": 0.0}}}}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "train/loss": 1.0 / s}) for s in (1, 2, 3))
                                     + '\n{"step": 4, "train/lo')  # a line cut by a kill is skipped
    return d


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "multirun" / "sweep-1"
    # ckd on rte: two learning rates x 3 seeds; the better mean (lr 2e-5) must be chosen.
    for i, (lr, seed, v) in enumerate([(5e-5, 1, 0.60), (5e-5, 2, 0.70), (5e-5, 3, 0.65),
                                       (2e-5, 1, 0.66), (2e-5, 2, 0.68), (2e-5, 3, 0.67)]):
        write_run(root, f"rte-ckd-{i}", "rte", "ckd", seed, v, lr=lr)
    # ckd on cola (mcc), one setting, two seeds
    write_run(root, "cola-ckd-a", "cola", "ckd", 1, 0.30, metric="matthews_correlation")
    write_run(root, "cola-ckd-b", "cola", "ckd", 2, 0.34, metric="matthews_correlation")
    # logit on rte only
    write_run(root, "rte-logit", "rte", "logit", 1, 0.62)
    # a failed and an interrupted job
    failed = root / "rte-pkd-x"
    (failed / ".hydra").mkdir(parents=True)
    (failed / "error.json").write_text(json.dumps({"type": "ConfigError", "message": "bad key objective.foo"}))
    cut = root / "rte-alp-y"
    (cut / ".hydra").mkdir(parents=True)
    (cut / "checkpoints" / "last").mkdir(parents=True)
    (cut / "checkpoints" / "last" / "state.json").write_text(json.dumps({"stage": 1, "global_step": 37}))
    return root


def test_table_values_choice_and_problems(sweep: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    rep = report([sweep.parent], out)
    cells = rep["cells"]
    rte = cells[("bert_L4_H312", "ckd")]["rte"]
    assert rte.setting == {"train.lr": 2e-5} and rte.n_settings == 2
    assert rte.mean == pytest.approx(0.67) and rte.std == pytest.approx(statistics.stdev([0.66, 0.68, 0.67]))
    assert [r.seed for r in rte.runs] == [1, 2, 3]
    assert rep["swept"][("bert_L4_H312", "ckd")] == ["train.lr"]
    printed = capsys.readouterr().out
    # columns in GLUE order, ×100, average over the row's tasks (marked when a task is missing)
    assert "| student | objective | cola (matthews_correlation) | rte (accuracy) | avg |" in printed
    assert "| bert_L4_H312 | ckd | 32.00 ± 2.83 | 67.00 ± 1.00 | 49.50 |" in printed
    assert "| bert_L4_H312 | logit | — | 62.00 | 62.00* |" in printed
    assert "train.lr=2e-05 (n=3 seeds [1,2,3], best of 2 settings)" in printed
    assert "[failed]" in printed and "bad key objective.foo" in printed
    assert "[incomplete]" in printed and "checkpoint at stage 1 step 37" in printed

    rows = (out / "table.csv").read_text().splitlines()
    assert len(rows) == 4  # header + ckd/cola + ckd/rte + logit/rte
    ckd_rte = next(r for r in rows if r.startswith("bert_L4_H312,ckd,rte"))
    assert ",0.670000,0.010000,3,1 2 3," in ckd_rte
    tex = (out / "table.tex").read_text()
    assert "67.00 $\\pm$ 1.00" in tex and "matthews\\_correlation" in tex and tex.startswith("\\begin{tabular}")
    names = {p.name for p in out.iterdir()}
    assert {"table.csv", "table.tex", "table.md", "seed_spread.png", "curves_rte.png", "curves_cola.png",
            "objectives.png"} <= names
    assert any(n.startswith("sweep_rte-bert_L4_H312-ckd") for n in names)
    assert not any(n.endswith(".tmp") for n in names)


def test_two_swept_keys_give_a_heatmap_and_rows_split_by_key(tmp_path: Path) -> None:
    root = tmp_path / "m"
    i = 0
    for alpha in (0.5, 0.9):
        for t in (1, 4):
            for mapping in ("uniform", "learnable"):
                write_run(root, f"r{i}", "sst2", "tinybert", 1, 0.8 + alpha / 10 + t / 100,
                          objective_params={"alpha": alpha, "t": t}, mapping={"name": mapping})
                i += 1
    rep = report([root], tmp_path / "out", row_keys=["mapping.name"])
    assert set(rep["cells"]) == {("bert_L4_H312", "tinybert", "mapping.name=uniform"),
                                 ("bert_L4_H312", "tinybert", "mapping.name=learnable")}
    cell = rep["cells"][("bert_L4_H312", "tinybert", "mapping.name=uniform")]["sst2"]
    assert cell.setting == {"objective_params.alpha": 0.9, "objective_params.t": 4}
    assert any(p.name.startswith("heatmap_sst2") for p in rep["files"])


def test_cli_errors_clearly_on_an_empty_path(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "empty")])
    assert e.value.code == 2
    assert "no results.json" in capsys.readouterr().err


# ------------------------------------------------------------------ paired significance vs finetune

def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p of Student's t from its density, integrated here (Simpson's rule), not scipy."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    x, k = abs(t), 20_000
    h = x / k
    f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(k + 1)]
    central = h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))  # P(0 < T < |t|)
    return 1 - 2 * central


def naive_paired_t(a: list[float], b: list[float]) -> float:
    d = [x - y for x, y in zip(a, b)]
    t = statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(len(d)))
    return t_two_sided_p(t, len(d) - 1)


S, L6 = "bert_L4_H312", "bert_L6_H768"
# (student, objective, task) -> {seed: value}
PAIRED = {
    (S, "finetune", "rte"): {1: 0.60, 2: 0.62, 3: 0.64},
    (S, "finetune", "sst2"): {1: 0.80, 2: 0.81, 3: 0.82, 4: 0.83},
    (S, "finetune", "mrpc"): {1: 0.70, 2: 0.71, 3: 0.72, 4: 0.70, 5: 0.71, 6: 0.72},
    (S, "ckd", "rte"): {1: 0.63, 2: 0.66, 3: 0.65},  # differences +3, +4, +1 (×100)
    (S, "ckd", "sst2"): {1: 0.83, 2: 0.82, 3: 0.80, 4: 0.87},  # +3, +1, -2, +4
    (S, "logit", "rte"): {1: 0.61, 2: 0.65, 7: 0.90},  # seed 7 has no finetune run: pairs are seeds 1, 2
    (S, "tinybert", "mrpc"): {1: 0.72, 2: 0.74, 3: 0.73, 4: 0.75, 5: 0.73, 6: 0.76},  # six positive differences
    (L6, "ckd", "rte"): {1: 0.70, 2: 0.72},  # this student has no finetune row
}


@pytest.fixture
def paired(tmp_path: Path) -> Path:
    root = tmp_path / "multirun" / "paired"
    for (student, objective, task), by_seed in PAIRED.items():
        for seed, v in by_seed.items():
            write_run(root, f"{student}-{objective}-{task}-{seed}", task, objective, seed, v, student=student)
    return root


def _vals(student: str, objective: str, task: str, seeds: list[int]) -> list[float]:
    return [PAIRED[(student, objective, task)][s] for s in seeds]


def test_exact_sign_flip_p_values_counted_by_hand() -> None:
    # 3 differences of one sign: of the 2^3 sign assignments only the observed one and its mirror
    # image reach |sum| = 8, so p = 2/8.
    assert sign_flip_p([0.03, 0.04, 0.01]) == (0.25, True)
    # +3 +1 -2 +4 (sum 6): flipping a subset with sum s gives 10 - 2s; |10 - 2s| >= 6 for the subsets
    # summing to 0, 1, 2 (the empty set, {1}, {2}) and their complements: 6 of 16.
    assert sign_flip_p([0.03, 0.01, -0.02, 0.04]) == (0.375, True)
    assert sign_flip_p([0.0, 0.0]) == (1.0, True)
    assert sign_flip_p([0.02, -0.02]) == (1.0, True)  # every assignment is as extreme as |0|
    assert [min_sign_flip_p(n) for n in (1, 2, 3, 5, 6)] == [1.0, 0.5, 0.25, 0.0625, 0.03125]
    # beyond 16 pairs the assignments are sampled; compare with the exact count on 18 pairs
    d = [0.01 * ((-1) ** (i % 3 == 0)) * (1 + i % 4) for i in range(18)]
    exact, is_exact = sign_flip_p(d, exact_max=18)
    sampled, is_exact_mc = sign_flip_p(d)
    assert is_exact and not is_exact_mc and sampled == pytest.approx(exact, abs=0.01)
    assert 1 / 200_001 <= sign_flip_p([0.01] * 20)[0] <= 10 / 200_001  # exact would be 2/2^20


def test_baseline_row_choice() -> None:
    rows = [(S, "finetune", "m=a"), (S, "finetune", "m=b"), (S, "ckd", "m=a"), (S, "ckd", "m=c"), (L6, "ckd", "m=a"),
            ("tiny", "finetune", "m=a"), ("tiny", "ckd", "m=z")]
    assert baseline_row((S, "ckd", "m=a"), rows) == (S, "finetune", "m=a")  # same extra keys
    assert baseline_row((S, "ckd", "m=c"), rows) is None  # two finetune rows, neither matches
    assert baseline_row(("tiny", "ckd", "m=z"), rows) == ("tiny", "finetune", "m=a")  # the only one
    assert baseline_row((L6, "ckd", "m=a"), rows) is None
    assert baseline_row((S, "finetune", "m=a"), rows) is None


def test_significance_marks_csv_and_latex(paired: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    rep = report([paired], out, plots=False)
    cmp = rep["comparisons"]
    assert set(cmp) == {(S, "ckd"), (S, "logit"), (S, "tinybert")}  # not finetune itself, not L6

    ckd_rte = cmp[(S, "ckd")]["rte"]
    assert ckd_rte.seeds == [1, 2, 3] and ckd_rte.p_sign_flip == pytest.approx(0.25) and ckd_rte.exact
    a, b = _vals(S, "ckd", "rte", [1, 2, 3]), _vals(S, "finetune", "rte", [1, 2, 3])
    p_t = naive_paired_t(a, b)
    # with 2 degrees of freedom the t CDF has a closed form: two-sided p = 1 - |t| / sqrt(2 + t^2)
    t = statistics.fmean([0.03, 0.04, 0.01]) / (statistics.stdev([0.03, 0.04, 0.01]) / math.sqrt(3))
    assert p_t == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-6)
    assert ckd_rte.p_ttest == pytest.approx(p_t, abs=1e-6)

    ckd_sst2 = cmp[(S, "ckd")]["sst2"]
    assert ckd_sst2.p_sign_flip == pytest.approx(0.375) and ckd_sst2.n == 4
    assert ckd_sst2.p_ttest == pytest.approx(naive_paired_t(_vals(S, "ckd", "sst2", [1, 2, 3, 4]),
                                                            _vals(S, "finetune", "sst2", [1, 2, 3, 4])), abs=1e-6)
    logit = cmp[(S, "logit")]["rte"]
    assert logit.seeds == [1, 2] and logit.p_sign_flip == pytest.approx(0.5)  # 2 same-sign pairs: 2/4
    # differences +1, +3: t = 2 / (sqrt(2) / sqrt(2)) = 2; one degree of freedom: p = 1 - (2/pi) atan(2)
    assert logit.p_ttest == pytest.approx(1 - 2 / math.pi * math.atan(2.0), abs=1e-6)
    tiny = cmp[(S, "tinybert")]["mrpc"]
    assert tiny.p_sign_flip == pytest.approx(2 / 64)  # six positive differences: 2/2^6 < 0.05
    p_tiny_t = naive_paired_t(_vals(S, "tinybert", "mrpc", list(range(1, 7))),
                              _vals(S, "finetune", "mrpc", list(range(1, 7))))
    assert tiny.p_ttest == pytest.approx(p_tiny_t, abs=1e-6) and p_tiny_t < 0.05

    printed = capsys.readouterr().out
    tb = PAIRED[(S, "tinybert", "mrpc")].values()
    tiny_cell = f"{statistics.fmean(tb) * 100:.2f} ± {statistics.stdev(tb) * 100:.2f}†‡"
    assert "| student | objective | sst2 (accuracy) | mrpc (accuracy) | rte (accuracy) | avg |" in printed
    assert f"| {S} | tinybert | — | {tiny_cell} | — |" in printed
    # p = 0.25, 0.375, 0.5: no mark; the t-test of ckd on rte decides its own mark
    ckd_rte_cell = "64.67 ± 1.53" + ("‡" if p_t < 0.05 else "")
    assert f"| {S} | ckd | 83.00 ± 2.94 | — | {ckd_rte_cell} |" in printed
    assert f"| {S} | logit | — | — | 72.00 ± 15.72 |" in printed  # logit's rte p-values are both > 0.05
    assert f"| {L6} | ckd | — | — | 71.00 ± 1.41 |" in printed  # no finetune row: no mark
    assert f"| {S} | finetune | 81.50 ± 1.29 | 71.00 ± 0.89 | 62.00 ± 2.00 | 71.50 |" in printed
    # the footnote: what the marks mean, the tests, n, and the floor of the sign-flip p
    assert "† p < 0.05 in an exact two-sided paired sign-flip permutation test" in printed
    assert "n = 2, 3, 4, 6 pairs" in printed and "paired t-test" in printed
    assert "n=2: 0.5, n=3: 0.25, n=4: 0.125, n=6: 0.0312" in printed
    assert "with n ≤ 4 pairs † cannot appear" in printed
    assert (f"- {S} / ckd · rte vs {S} / finetune: Δ = +2.67 over n=3 seeds [1,2,3]; sign-flip p = 0.25 "
            "(exact, smallest attainable 0.25)") in printed
    assert f"- {S} / logit · rte vs {S} / finetune: Δ = +2.00 over n=2 seeds [1,2]" in printed

    rows = {(r["student"], r["objective"], r["task"]): r for r in csv.DictReader((out / "table.csv").open())}
    r = rows[(S, "ckd", "rte")]
    assert r["baseline"] == f"{S}/finetune" and r["n_pairs"] == "3"
    assert float(r["p_vs_finetune"]) == pytest.approx(0.25)
    assert float(r["p_ttest_vs_finetune"]) == pytest.approx(p_t, rel=1e-5)
    assert float(r["mean_diff_vs_finetune"]) == pytest.approx(0.08 / 3, abs=1e-6)
    # Benjamini–Hochberg over every t-tested cell, computed naively: min over p_j >= p_i of p_j m / rank_j
    tested = {k: float(v["p_ttest_vs_finetune"]) for k, v in rows.items() if v["p_ttest_vs_finetune"]}
    ranked = sorted(tested.values())
    naive = {k: min(1.0, min(pj * len(ranked) / (j + 1) for j, pj in enumerate(ranked) if pj >= p))
             for k, p in tested.items()}
    assert {k: float(rows[k]["q_bh_vs_finetune"]) for k in tested} == pytest.approx(naive, rel=1e-5)
    assert f"q (BH over {len(tested)}) = " in printed
    assert rows[(S, "logit", "rte")]["n_pairs"] == "2"
    assert float(rows[(S, "tinybert", "mrpc")]["p_vs_finetune"]) == pytest.approx(0.03125)
    for key in [(L6, "ckd", "rte"), (S, "finetune", "rte")]:
        assert [rows[key][c] for c in ("baseline", "n_pairs", "p_vs_finetune", "p_ttest_vs_finetune")] == [""] * 4
    tex = (out / "table.tex").read_text()
    assert "1.47$^{\\dagger\\ddagger}$ &" in tex and "\\multicolumn{6}" in tex and "\\footnotesize" in tex
    md = (out / "table.md").read_text()
    assert tiny_cell in md and "smallest attainable 0.25" in md


def test_a_shared_task_without_shared_seeds_gets_no_mark(tmp_path: Path) -> None:
    root = tmp_path / "m"
    write_run(root, "ft", "rte", "finetune", 1, 0.6)
    write_run(root, "kd", "rte", "ckd", 2, 0.9)
    rep = report([root], tmp_path / "out", plots=False)
    c = rep["comparisons"][(S, "ckd")]["rte"]
    assert c.n == 0 and c.p_sign_flip is None and c.marks(0.05) == ""
    assert rep["footnote"] == ""
    row = next(csv.DictReader((tmp_path / "out" / "table.csv").open()))
    assert row["objective"] == "ckd" and row["n_pairs"] == "0" and row["p_vs_finetune"] == ""


def test_objectives_figure(paired: Path, tmp_path: Path, capsys) -> None:
    fig = tmp_path / "figs" / "objectives.png"
    main([str(paired), "--out", str(tmp_path / "rep"), "--no-plots", "--figure", str(fig)])
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in fig.parent.iterdir()] == ["objectives.png"]  # no temporary file left
    assert not any(p.suffix == ".png" for p in (tmp_path / "rep").iterdir())  # --no-plots: only the figure
    assert str(fig) in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([str(paired), "--figure", str(tmp_path / "objectives.txt")])
    assert e.value.code == 2


# ------------------------------------------------------------------------------------ any mix of runs

def _set_config(run_dir: Path, **sections) -> None:
    """Merge config sections into a written results.json (e.g. a key null in some runs)."""
    res = json.loads((run_dir / "results.json").read_text())
    for name, values in sections.items():
        res["config"].setdefault(name, {}).update(values)
    (run_dir / "results.json").write_text(json.dumps(res))


def test_report_over_null_keys_failed_runs_and_other_objectives(tmp_path: Path, capsys) -> None:
    root = tmp_path / "mixed"
    # task.max_train_samples=null,64 and train.batch_size=16,null: a key null in some runs, two keys swept
    for i, (rows, batch, seed, v) in enumerate([(None, 16, 1, 0.60), (64, 16, 1, 0.55), (None, None, 1, 0.62),
                                                (64, None, 1, 0.50), (None, 16, 2, 0.64), (64, None, 2, 0.52)]):
        d = write_run(root, f"ckd-{i}", "rte", "ckd", seed, v)
        _set_config(d, task={"max_train_samples": rows}, train={"batch_size": batch})
    d = write_run(root, "logit-0", "rte", "logit", 1, 0.58)  # another objective, with keys the others lack
    _set_config(d, objective={"alpha": 0.9, "temperature": 2.0})
    failed = root / "ckd-failed"  # a run started without Hydra's launcher that failed: error.json only
    failed.mkdir()
    (failed / "error.json").write_text(json.dumps({"type": "RuntimeError", "message": "out of memory",
                                                   "phase": "stage"}))
    out = tmp_path / "report"
    main([str(root), "--out", str(out)])
    text = capsys.readouterr().out
    table = (out / "table.md").read_text()
    assert "| bert_L4_H312 | ckd | 62.00 ± 2.83 | 62.00 |" in table  # null rows, batch 16: (0.60 + 0.64) / 2
    assert "| bert_L4_H312 | logit | 58.00 | 58.00 |" in table
    assert "task.max_train_samples=null, train.batch_size=16" in text
    jobs = text.split("Jobs without results:")[1]
    assert "[failed]" in jobs and "ckd-failed: RuntimeError: out of memory" in jobs
    assert {"sweep_rte-bert_L4_H312-ckd.png", "heatmap_rte-bert_L4_H312-ckd.png", "objectives.png",
            "seed_spread.png", "curves_rte.png"} <= {p.name for p in out.iterdir()}
