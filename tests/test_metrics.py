"""Tests for kdrun.tasks.metrics and its offline evaluate module, against values computed by hand."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import kdrun.tasks.metrics as km
from kdrun.tasks.metrics import (
    VALID_METRICS,
    compute_task_metrics,
    load_glue_metric,
)

METRIC_DIR = Path(km.__file__).resolve().parent / "glue_metric"

# Binary case used throughout: TP=3, FN=2, FP=1, TN=4.
REFS = [1, 1, 1, 1, 0, 0, 0, 0, 1, 0]
PREDS = [1, 1, 1, 0, 0, 0, 1, 0, 0, 0]


# ----------------------------------------------------------------------------------------------
# Naive reference implementations (deliberately not using sklearn / scipy)
# ----------------------------------------------------------------------------------------------


def confusion(preds, refs):
    tp = sum(1 for p, r in zip(preds, refs) if p == 1 and r == 1)
    tn = sum(1 for p, r in zip(preds, refs) if p == 0 and r == 0)
    fp = sum(1 for p, r in zip(preds, refs) if p == 1 and r == 0)
    fn = sum(1 for p, r in zip(preds, refs) if p == 0 and r == 1)
    return tp, tn, fp, fn


def naive_mcc(preds, refs):
    tp, tn, fp, fn = confusion(preds, refs)
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else (tp * tn - fp * fn) / denom


def naive_f1(preds, refs):
    tp, _, fp, fn = confusion(preds, refs)
    precision = tp / (tp + fp)
    recall = tp / (tp + fn)
    return 2 * precision * recall / (precision + recall)


def naive_pearson(x, y):
    x = [float(v) for v in x]
    y = [float(v) for v in y]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    vx = sum((a - mx) ** 2 for a in x)
    vy = sum((b - my) ** 2 for b in y)
    return cov / math.sqrt(vx * vy)


def average_ranks(values):
    """1-based ranks; tied values get the mean of the positions they occupy."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        mean_rank = (i + 1 + j + 1) / 2
        for k in range(i, j + 1):
            ranks[order[k]] = mean_rank
        i = j + 1
    return ranks


def naive_spearman(x, y):
    return naive_pearson(average_ranks(list(x)), average_ranks(list(y)))


# Regression data with ties in both vectors; values exactly representable in float32.
REG_PREDS = [0.5, 2.25, 2.25, 4.0, 1.0, 3.5, 0.5, 5.0]
REG_REFS = [0.0, 2.0, 3.0, 4.5, 1.0, 3.0, 1.0, 4.75]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")


# ----------------------------------------------------------------------------------------------
# Sanity of the hand computations themselves
# ----------------------------------------------------------------------------------------------


def test_naive_helpers_match_hand_arithmetic():
    assert confusion(PREDS, REFS) == (3, 4, 1, 2)
    # MCC = (3*4 - 1*2) / sqrt(4 * 5 * 5 * 6) = 10 / sqrt(600)
    assert naive_mcc(PREDS, REFS) == pytest.approx(10 / math.sqrt(600))
    # P = 3/4, R = 3/5 -> F1 = 2 * 0.45 / 1.35 = 2/3
    assert naive_f1(PREDS, REFS) == pytest.approx(2 / 3)
    assert average_ranks([10, 20, 20, 5, 20]) == [2.0, 4.0, 4.0, 1.0, 4.0]


# ----------------------------------------------------------------------------------------------
# compute_task_metrics: classification
# ----------------------------------------------------------------------------------------------


def test_classification_metrics_by_hand():
    result = compute_task_metrics(
        ["matthews_correlation", "accuracy", "f1"], np.array(PREDS), np.array(REFS), regression=False
    )
    assert list(result) == ["matthews_correlation", "accuracy", "f1"]
    assert all(type(v) is float for v in result.values())
    assert result["accuracy"] == pytest.approx(7 / 10)
    assert result["f1"] == pytest.approx(naive_f1(PREDS, REFS))
    assert result["f1"] == pytest.approx(2 / 3)
    assert result["matthews_correlation"] == pytest.approx(naive_mcc(PREDS, REFS))
    assert result["matthews_correlation"] == pytest.approx(0.4082482904638631)


def test_argmax_over_2d_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(PREDS), 2)).astype(np.float32)
    # Force the argmax to be PREDS.
    logits[np.arange(len(PREDS)), np.array(PREDS)] += 10.0
    result = compute_task_metrics(["accuracy", "f1"], logits, REFS, regression=False)
    assert result == pytest.approx({"accuracy": 0.7, "f1": 2 / 3})


def test_argmax_multiclass_accuracy_and_mcc():
    refs = [0, 1, 2, 2, 1, 0, 2, 1, 0]
    preds = [0, 2, 2, 2, 1, 1, 0, 1, 0]
    logits = np.full((len(preds), 3), -1.0)
    logits[np.arange(len(preds)), preds] = 3.0
    result = compute_task_metrics(["accuracy", "matthews_correlation"], logits, refs, regression=False)
    assert result["accuracy"] == pytest.approx(6 / 9)
    # Multiclass MCC (Gorodkin): (c*s - sum_k p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)).
    s, c = len(refs), sum(p == r for p, r in zip(preds, refs))
    p_k = [preds.count(k) for k in range(3)]
    t_k = [refs.count(k) for k in range(3)]
    expected = (c * s - sum(a * b for a, b in zip(p_k, t_k))) / math.sqrt(
        (s * s - sum(a * a for a in p_k)) * (s * s - sum(b * b for b in t_k))
    )
    assert result["matthews_correlation"] == pytest.approx(expected)


def test_f1_rejects_multiclass_labels():
    with pytest.raises(ValueError, match="binary"):
        compute_task_metrics(["f1"], [0, 1, 2], [0, 1, 2], regression=False)


def test_degenerate_classification():
    # Constant predictions: MCC is 0 by convention, F1 is 0 (no true positive), no warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = compute_task_metrics(
            ["matthews_correlation", "f1", "accuracy"], [0, 0, 0, 0], [0, 1, 0, 1], regression=False
        )
    assert result == {"matthews_correlation": 0.0, "f1": 0.0, "accuracy": 0.5}


def test_classification_accepts_integral_floats_and_column_references():
    refs = np.array(REFS, dtype=np.float32).reshape(-1, 1)
    result = compute_task_metrics(["accuracy"], np.array(PREDS, dtype=np.float64), refs, regression=False)
    assert result == {"accuracy": pytest.approx(0.7)}
    with pytest.raises(ValueError, match="integer class ids"):
        compute_task_metrics(["accuracy"], [0.5, 1.0], [0, 1], regression=False)


def test_classification_rejects_single_logit_column():
    with pytest.raises(ValueError, match="regression"):
        compute_task_metrics(["accuracy"], np.zeros((4, 1)), [0, 1, 0, 1], regression=False)


# ----------------------------------------------------------------------------------------------
# compute_task_metrics: regression
# ----------------------------------------------------------------------------------------------


def test_regression_metrics_by_hand():
    result = compute_task_metrics(
        ["pearson", "spearmanr"], np.array(REG_PREDS), np.array(REG_REFS), regression=True
    )
    assert all(type(v) is float for v in result.values())
    assert result["pearson"] == pytest.approx(naive_pearson(REG_PREDS, REG_REFS), abs=1e-6)
    assert result["spearmanr"] == pytest.approx(naive_spearman(REG_PREDS, REG_REFS), abs=1e-6)
    # Ties must actually matter here: ordinal ranking would give a different answer.
    ordinal = naive_pearson(np.argsort(np.argsort(REG_PREDS)), np.argsort(np.argsort(REG_REFS)))
    assert abs(ordinal - result["spearmanr"]) > 1e-3


def test_regression_squeezes_n_by_1():
    preds = np.array(REG_PREDS, dtype=np.float32).reshape(-1, 1)
    result = compute_task_metrics(["pearson"], preds, REG_REFS, regression=True)
    assert result["pearson"] == pytest.approx(naive_pearson(REG_PREDS, REG_REFS), abs=1e-6)
    with pytest.raises(ValueError, match=r"\(N,\) or \(N, 1\)"):
        compute_task_metrics(["pearson"], np.zeros((8, 2)), REG_REFS, regression=True)


def test_regression_constant_prediction_is_nan():
    result = compute_task_metrics(["pearson", "spearmanr"], [1.0, 1.0, 1.0], [0.0, 2.0, 5.0], True)
    assert math.isnan(result["pearson"]) and math.isnan(result["spearmanr"])


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    logits = torch.zeros(len(PREDS), 2, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        logits[torch.arange(len(PREDS)), torch.tensor(PREDS)] = 1.0
    result = compute_task_metrics(["accuracy"], logits, torch.tensor(REFS), regression=False)
    assert result["accuracy"] == pytest.approx(0.7)
    scores = torch.tensor(REG_PREDS, requires_grad=True).unsqueeze(-1)
    result = compute_task_metrics(["spearmanr"], scores, torch.tensor(REG_REFS), regression=True)
    assert result["spearmanr"] == pytest.approx(naive_spearman(REG_PREDS, REG_REFS), abs=1e-6)


# ----------------------------------------------------------------------------------------------
# Errors and helpers
# ----------------------------------------------------------------------------------------------


def test_invalid_metric_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        compute_task_metrics(["accuracy", "bleu"], PREDS, REFS, regression=False)
    message = str(info.value)
    assert "bleu" in message
    for name in VALID_METRICS:
        assert name in message


def test_metric_of_wrong_kind_is_rejected():
    with pytest.raises(ValueError, match="regression"):
        compute_task_metrics(["accuracy"], REG_PREDS, REG_REFS, regression=True)
    with pytest.raises(ValueError, match="classification"):
        compute_task_metrics(["pearson"], PREDS, REFS, regression=False)


def test_length_mismatch_and_empty():
    with pytest.raises(ValueError, match="predictions but"):
        compute_task_metrics(["accuracy"], [0, 1, 1], [0, 1], regression=False)
    with pytest.raises(ValueError, match="zero examples"):
        compute_task_metrics(["accuracy"], np.zeros((0, 2)), [], regression=False)


def test_valid_metrics():
    assert set(VALID_METRICS) == {"matthews_correlation", "accuracy", "f1", "pearson", "spearmanr"}


def test_load_glue_metric_is_cached():
    clf = load_glue_metric(regression=False)
    reg = load_glue_metric(regression=True)
    assert load_glue_metric(False) is clf and load_glue_metric(True) is reg
    assert clf is not reg
    assert clf.config_name == "classification" and reg.config_name == "regression"


def test_fallback_when_evaluate_load_cannot_write(monkeypatch):
    import evaluate

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(evaluate, "load", read_only)
    monkeypatch.setattr(km, "_CACHE", {})
    with pytest.warns(RuntimeWarning, match="directly"):
        module = load_glue_metric(regression=False)
    assert isinstance(module, evaluate.EvaluationModule)
    result = module.compute(predictions=PREDS, references=REFS, metrics=["f1"])
    assert result["f1"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------------------
# The evaluate module itself
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [METRIC_DIR, METRIC_DIR / "glue_metric.py"])
def test_evaluate_load_local_module_offline(path, tmp_path):
    import evaluate

    # Default storage (arrow cache files, here under tmp_path) and default config = classification.
    clf = evaluate.load(str(path), cache_dir=str(tmp_path))
    assert isinstance(clf, evaluate.EvaluationModule)
    out = clf.compute(predictions=PREDS, references=REFS, metrics=["accuracy", "f1", "matthews_correlation"])
    assert out == pytest.approx({"accuracy": 0.7, "f1": 2 / 3, "matthews_correlation": 10 / math.sqrt(600)})
    assert clf.compute(predictions=PREDS, references=REFS) == pytest.approx({"accuracy": 0.7})

    reg = evaluate.load(str(path), config_name="regression", cache_dir=str(tmp_path))
    # add_batch + compute(metrics=...) path, as used in distributed / streaming evaluation.
    reg.add_batch(predictions=REG_PREDS[:4], references=REG_REFS[:4])
    reg.add_batch(predictions=REG_PREDS[4:], references=REG_REFS[4:])
    out = reg.compute(metrics=["pearson", "spearmanr"])
    assert out["pearson"] == pytest.approx(naive_pearson(REG_PREDS, REG_REFS), abs=1e-6)
    assert out["spearmanr"] == pytest.approx(naive_spearman(REG_PREDS, REG_REFS), abs=1e-6)

    # (In-memory instances for the failing calls: an exception in _compute leaves evaluate's cache-file
    # lock held, and a later instance with the same cache file would wait for it.)
    clf = evaluate.load(str(path), keep_in_memory=True)
    reg = evaluate.load(str(path), config_name="regression", keep_in_memory=True)
    with pytest.raises(ValueError, match="valid metrics"):
        clf.compute(predictions=PREDS, references=REFS, metrics=["bleu"])
    with pytest.raises(ValueError, match="not available"):
        reg.compute(predictions=REG_PREDS, references=REG_REFS, metrics=["accuracy"])
    with pytest.raises(KeyError, match="config_name"):
        evaluate.load(str(path), config_name="mrpc")


def test_evaluate_load_fresh_process_offline(tmp_path):
    """A new interpreter with an empty HF cache and no network loads the module quickly."""
    script = textwrap.dedent(
        f"""
        import json, socket, time

        def refuse(*args, **kwargs):
            raise RuntimeError("network access attempted")

        socket.socket.connect = refuse
        socket.create_connection = refuse
        import evaluate

        start = time.perf_counter()
        metric = evaluate.load({str(METRIC_DIR)!r}, config_name="regression")
        seconds = time.perf_counter() - start
        out = metric.compute(predictions=[1.0, 2.0, 3.5], references=[1.0, 2.5, 3.0], metrics=["spearmanr"])
        print(json.dumps({{"seconds": seconds, "out": out}}))
        """
    )
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_MODULES_CACHE=str(tmp_path / "modules"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["out"] == {"spearmanr": pytest.approx(1.0)}
    assert report["seconds"] < 10, report
    assert (tmp_path / "modules").exists()
