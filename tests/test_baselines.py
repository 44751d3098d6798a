"""The constant predictor's score beside every score (results.json, the printed table, kdrun-report)
and the minimal detectable effect of a paired design, against values computed by hand here."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from kdrun.report.cli import report
from kdrun.report.significance import min_detectable_effect, min_seeds_for_sign_flip, min_sign_flip_p, task_spread
from kdrun.tasks.baselines import (
    MAJORITY,
    MEAN,
    QA_REASON,
    constant_baseline,
    noise_warnings,
    run_baseline,
    within_noise,
)
from tests.test_report import write_run

# ------------------------------------------------------------------------------ the baseline itself


def test_majority_class_scored_by_the_task_metrics() -> None:
    # training split: three 1s, two 0s -> predict 1; dev: five 1s, three 0s
    b = constant_baseline(["accuracy", "f1", "matthews_correlation"], False, [1, 1, 1, 0, 0],
                          {"validation": [1, 0, 0, 1, 1, 1, 0, 1]})
    assert b["kind"] == MAJORITY and b["label"] == 1 and b["n"] == {"validation": 8}
    # TP = 5, FP = 3, FN = 0: F1 = 2·5 / (2·5 + 3) = 10/13; MCC of a constant is 0
    assert b["validation"] == pytest.approx({"accuracy": 5 / 8, "f1": 10 / 13, "matthews_correlation": 0.0})
    se = b["se"]["validation"]
    assert se["accuracy"] == pytest.approx(math.sqrt(5 / 8 * 3 / 8 / 8))
    assert se["f1"] == se["accuracy"] and se["matthews_correlation"] == pytest.approx(1 / math.sqrt(8))
    assert "undefined" not in b
    json.dumps(b)  # goes into results.json as it is


def test_majority_tie_takes_the_smallest_class_and_each_split_its_own_values() -> None:
    b = constant_baseline(["accuracy"], False, [2, 1, 2, 1, 0], {"m": [1, 1, 2], "mm": [0, 0, 0, 0]})
    assert b["label"] == 1
    assert b["m"] == {"accuracy": pytest.approx(2 / 3)} and b["mm"] == {"accuracy": 0.0}
    assert b["se"]["mm"]["accuracy"] == 0.0 and b["n"] == {"m": 3, "mm": 4}


def test_regression_predicts_the_training_mean_and_calls_correlations_undefined() -> None:
    b = constant_baseline(["pearson", "spearmanr"], True, [1.0, 2.0, 3.0, 6.0], {"validation": [0.5, 4.0, 2.5]})
    assert b["kind"] == MEAN and b["label"] == pytest.approx(3.0)
    assert b["validation"] == {"pearson": 0.0, "spearmanr": 0.0}
    assert b["undefined"] == ["pearson", "spearmanr"] and "undefined" in b["note"]
    assert b["se"]["validation"]["pearson"] == pytest.approx(1 / math.sqrt(2))


def test_corpus_has_none_and_question_answering_a_reason() -> None:
    class Task:
        kind = "corpus"

    assert run_baseline(Task(), None, {}) is None
    Task.kind = "qa"
    assert run_baseline(Task(), None, {}) == {"kind": None, "reason": QA_REASON}


def test_within_noise_is_two_standard_errors() -> None:
    assert within_noise(0.62, 0.5, 0.0625) == "within noise of"  # 0.62 < 0.5 + 0.125
    assert within_noise(0.63, 0.5, 0.0625) is None
    assert within_noise(0.37, 0.5, 0.0625) == "below"
    assert within_noise(0.5, 0.5, None) is None
    assert within_noise(1.0, 1.0, 0.0) == "within noise of"  # a dev set of one class: SE 0


# ------------------------------------------------------------------------------ the printed table

def _summary(teacher: float, student: float, baseline: dict | None) -> dict:
    return {"teacher": {"metrics": {"validation": {"accuracy": teacher}}, "path": "t"},
            "student": {"metrics": {"validation": {"accuracy": student}}, "selected": {"metric": "accuracy"}},
            "baseline": baseline, "timings": {"total_s": 1.0, "teacher_s": 0.5, "stages_s": 0.5}}


def test_printed_table_has_the_baseline_and_warns_near_it(capsys) -> None:
    from kdrun.report.summary import print_summary as _print_table

    base = constant_baseline(["accuracy"], False, [0, 0, 1], {"validation": [0] * 32 + [1] * 32})
    summary = _summary(0.9, 0.6, base)
    _print_table(summary)
    out = capsys.readouterr().out
    assert "baseline" in out.splitlines()[1] and "SE" in out.splitlines()[1]
    assert "student  validation  accuracy  0.6000  0.5000    0.0625" in out
    assert noise_warnings(summary) == ["warning: the student's accuracy on validation (0.6000) is within noise "
                                       "of the majority-class baseline (0.5000; 2 SE = 0.1250)"]
    assert noise_warnings(summary)[0] in out and "teacher's" not in out
    _print_table(_summary(0.9, 0.6, None))  # a results.json from before baselines: the old four columns
    assert "baseline" not in capsys.readouterr().out


def test_tiny_run_records_the_majority_class_baseline(run_cfg, tmp_path: Path, capsys) -> None:
    from kdrun.app.run import run
    from kdrun.tasks.data.toy import make_toy_splits, toy_label

    cfg = run_cfg("objective=logit", "task.toy.num_train=161", "task.toy.num_validation=65",
                  "task.metrics=[accuracy,f1,matthews_correlation]")
    splits = make_toy_splits(cfg.task.toy)
    train_ones = sum(toy_label(t) for t in splits["train"]["text_a"])
    dev_ones = sum(toy_label(t) for t in splits["validation"]["text_a"])
    assert (train_ones, dev_ones) == (80, 32)  # 81 of 161 training rows are 0: the majority class is 0

    run(cfg, tmp_path / "r")
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    b = res["baseline"]
    assert b["kind"] == "majority class" and b["label"] == 0 and b["n"] == {"validation": 65}
    assert b["validation"] == pytest.approx({"accuracy": 33 / 65, "f1": 0.0, "matthews_correlation": 0.0})
    assert b["se"]["validation"] == pytest.approx({"accuracy": math.sqrt(33 / 65 * 32 / 65 / 65),
                                                   "f1": math.sqrt(33 / 65 * 32 / 65 / 65),
                                                   "matthews_correlation": 1 / math.sqrt(65)})
    out = capsys.readouterr().out
    acc = res["student"]["metrics"]["validation"]["accuracy"]
    row = next(line.split() for line in out.splitlines() if line.startswith("student") and "accuracy" in line)
    assert row == ["student", "validation", "accuracy", f"{acc:.4f}", f"{33 / 65:.4f}", "0.0620"]
    near = res["student"]["metrics"]["validation"]["accuracy"] < 33 / 65 + 2 * b["se"]["validation"]["accuracy"]
    assert ("the student's accuracy on validation" in out) == near


# ------------------------------------------------------------------------------ kdrun-report

def _with_baseline(d: Path, value: float, se: float, metric: str = "accuracy", kind: str = MAJORITY) -> None:
    res = json.loads((d / "results.json").read_text())
    res["baseline"] = {"kind": kind, "label": 1, "n": {"validation": 100}, "se": {"validation": {metric: se}},
                       "validation": {metric: value}}
    (d / "results.json").write_text(json.dumps(res))


def test_report_shows_the_baseline_row_warnings_and_mde(tmp_path: Path, capsys) -> None:
    root = tmp_path / "m"
    for seed, ft, kd in [(1, 0.70, 0.72), (2, 0.71, 0.75), (3, 0.69, 0.72)]:
        _with_baseline(write_run(root, f"ft{seed}", "rte", "finetune", seed, ft), 0.53, 0.05)
        _with_baseline(write_run(root, f"kd{seed}", "rte", "ckd", seed, kd), 0.53, 0.05)
        _with_baseline(write_run(root, f"cola{seed}", "cola", "ckd", seed, 0.04 + 0.01 * seed,
                                 metric="matthews_correlation"), 0.0, 0.04, "matthews_correlation")
    out = tmp_path / "rep"
    rep = report([root], out, plots=False)
    printed = capsys.readouterr()
    # cola: mean 0.06 < 0 + 2·0.04; rte: 0.70 and 0.73 are above 0.53 + 2·0.05 (‡: the paired t-test)
    assert "| bert_L4_H312 | ckd | 6.00 ± 1.00≈ | 73.00 ± 1.73‡ | 39.50 |" in printed.out
    assert "| bert_L4_H312 | finetune | — | 70.00 ± 1.00 | 70.00* |" in printed.out
    assert "| baseline | majority class | 0.00 | 53.00 | 26.50 |" in printed.out
    assert rep["rows"][-1][0] == "baseline"
    assert ("- bert_L4_H312 / ckd · cola: mean 6.00 is within noise of the majority-class baseline 0.00 "
            "(2 SE = 8.00)") in printed.out
    assert "1 cell(s) within noise of the constant-predictor baseline" in printed.err
    # rte: differences 0.02, 0.04, 0.03 -> sd 0.01, n = 3; df = 2 has t_p = (2p-1)/sqrt(2p(1-p))
    t975, t80 = 0.95 / math.sqrt(2 * 0.975 * 0.025), 0.6 / math.sqrt(2 * 0.8 * 0.2)
    mde = (t975 + t80) * 0.01 / math.sqrt(3)
    assert f"- rte: MDE = {mde * 100:.2f} with n = 3 seeds (sd of paired differences" in printed.out
    assert "2/2^3 = 0.25 ≥ 0.05: the sign-flip test cannot reach 0.05 with fewer than 6 seeds" in printed.out
    # cola has no finetune row: √2 × the sd of the scores (0.01)
    assert f"- cola: MDE = {(t975 + t80) * math.sqrt(2) * 0.01 / math.sqrt(3) * 100:.2f} with n = 3" in printed.out

    rows = list(csv.DictReader((out / "table.csv").open()))
    kd_cola = next(r for r in rows if r["objective"] == "ckd" and r["task"] == "cola")
    assert kd_cola["near_constant_baseline"] == "within noise of" and float(kd_cola["constant_baseline_se"]) == 0.04
    kd_rte = next(r for r in rows if r["objective"] == "ckd" and r["task"] == "rte")
    assert kd_rte["near_constant_baseline"] == "" and float(kd_rte["mde_vs_finetune"]) == pytest.approx(mde, abs=1e-6)
    assert len(rows) == 3  # one row per cell; each carries its task's baseline
    assert {(r["task"], float(r["constant_baseline"])) for r in rows} == {("cola", 0.0), ("rte", 0.53)}
    assert "$\\approx$" in (out / "table.tex").read_text()


# ------------------------------------------------------------------------------ minimal detectable effect

def test_mde_against_t_quantiles() -> None:
    from scipy import stats

    # df = 2: t_p = (2p - 1) / sqrt(2p(1 - p)); t_0.975 = 4.3027, t_0.8 = 1.0607
    assert min_detectable_effect(3, 0.01) == pytest.approx((4.302653 + 1.060660) * 0.01 / math.sqrt(3), rel=1e-6)
    # n = 5 (df = 4): t_0.975 = 2.776445, t_0.8 = 0.940965 (tables)
    assert stats.t.ppf(0.975, 4) == pytest.approx(2.776445, abs=1e-6)
    assert min_detectable_effect(5, 0.02) == pytest.approx((2.776445 + 0.940965) * 0.02 / math.sqrt(5), rel=1e-6)
    assert min_detectable_effect(5, 0.02, alpha=0.1, power=0.9) == pytest.approx(
        (stats.t.ppf(0.95, 4) + stats.t.ppf(0.9, 4)) * 0.02 / math.sqrt(5))
    assert min_detectable_effect(1, 0.02) is None


def test_smallest_sign_flip_p_and_the_seeds_it_needs() -> None:
    assert [min_sign_flip_p(n) for n in (3, 5, 6)] == [0.25, 0.0625, 0.03125]
    assert min_seeds_for_sign_flip(0.05) == 6 and min_seeds_for_sign_flip(0.01) == 8


def test_task_spread_pools_the_paired_differences() -> None:
    from kdrun.report.significance import Comparison

    a = Comparison(("s", "finetune"), [1, 2, 3], [0.01, 0.03, 0.05], None, None, True)  # variance 4e-4, 2 dof
    b = Comparison(("s", "finetune"), [1, 2], [0.0, 0.02], None, None, True)  # variance 2e-4, 1 dof
    spread = task_spread({("s", "ckd"): {"rte": a}, ("s", "pkd"): {"rte": b}}, {}, "rte")
    assert spread.sd == pytest.approx(math.sqrt((2 * 4e-4 + 1 * 2e-4) / 3)) and spread.n == 2
    assert task_spread({}, {}, "rte") is None
