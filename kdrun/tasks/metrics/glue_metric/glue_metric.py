"""GLUE-style metrics as a self-contained, offline ``evaluate`` module.

Load it with ``evaluate.load`` on this directory (or on this file); no network access is needed::

    import evaluate

    clf = evaluate.load("path/to/kdrun/tasks/metrics/glue_metric")  # config "classification" (default)
    clf.compute(predictions=[0, 1, 1], references=[0, 1, 0], metrics=["accuracy", "f1"])

    reg = evaluate.load("path/to/kdrun/tasks/metrics/glue_metric", config_name="regression")
    reg.compute(predictions=[0.1, 2.5, 4.0], references=[0.0, 3.0, 4.5], metrics=["pearson", "spearmanr"])

Configurations (they fix the input ``features``):

* ``"classification"`` (also the default, ``config_name=None`` / ``"default"``): ``predictions`` and
  ``references`` are int64 class ids. Metrics: ``accuracy``, ``f1`` (binary, positive class 1),
  ``matthews_correlation``.
* ``"regression"``: ``predictions`` and ``references`` are float32 scores. Metrics: ``pearson``,
  ``spearmanr``.

``metrics`` is a keyword argument of ``compute``: a list of metric names (or one name). When it is
omitted, classification computes ``accuracy`` and regression computes ``pearson`` and ``spearmanr``.
Asking for a metric of the other configuration, or an unknown one, raises ``ValueError``.
Every result is a plain Python ``float``. Pearson/Spearman of a constant input are undefined and are
returned as ``nan`` (scipy's warning about it is silenced).
"""

from __future__ import annotations

import warnings

import datasets
import evaluate
import numpy as np
from scipy import stats
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

CLASSIFICATION_METRICS = ("accuracy", "f1", "matthews_correlation")
REGRESSION_METRICS = ("pearson", "spearmanr")
VALID_METRICS = CLASSIFICATION_METRICS + REGRESSION_METRICS

_CLASSIFICATION_CONFIGS = ("classification", "default")
_REGRESSION_CONFIGS = ("regression",)

_DESCRIPTION = """\
Metrics used by the GLUE benchmark (accuracy, binary F1, Matthews correlation, Pearson and Spearman
correlation), computed with scikit-learn and scipy. Offline, self-contained module of kdrun.
"""

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: class ids (int, config "classification") or scores (float, config "regression").
    references: gold class ids or gold scores, same length and kind as `predictions`.
    metrics: list of metric names (or a single name) among
        "accuracy", "f1", "matthews_correlation" (classification) and "pearson", "spearmanr" (regression).
        Defaults to ["accuracy"] (classification) or ["pearson", "spearmanr"] (regression).
Returns:
    dict mapping each requested metric name to a Python float.
Examples:
    >>> import evaluate
    >>> m = evaluate.load("kdrun/tasks/metrics/glue_metric")  # doctest: +SKIP
    >>> m.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0], metrics=["accuracy", "f1"])  # doctest: +SKIP
    {'accuracy': 0.75, 'f1': 0.6666666666666666}
"""


def _pearson(predictions: np.ndarray, references: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConstantInputWarning / degenerate inputs -> nan
        return float(stats.pearsonr(predictions, references)[0])


def _spearman(predictions: np.ndarray, references: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(stats.spearmanr(predictions, references)[0])


def _f1_binary(predictions: np.ndarray, references: np.ndarray) -> float:
    labels = set(np.unique(predictions).tolist()) | set(np.unique(references).tolist())
    if not labels <= {0, 1}:
        raise ValueError(
            f"'f1' is binary F1 (positive class 1) and needs class ids in {{0, 1}}; got {sorted(labels)}"
        )
    return float(f1_score(references, predictions, average="binary", pos_label=1, zero_division=0.0))


_FUNCTIONS = {
    "accuracy": lambda p, r: float(accuracy_score(r, p)),
    "f1": _f1_binary,
    "matthews_correlation": lambda p, r: float(matthews_corrcoef(r, p)),
    "pearson": _pearson,
    "spearmanr": _spearman,
}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class GlueMetric(evaluate.Metric):
    """Accuracy / binary F1 / MCC (config "classification") and Pearson / Spearman (config "regression")."""

    def _is_regression(self) -> bool:
        if self.config_name in _REGRESSION_CONFIGS:
            return True
        if self.config_name in _CLASSIFICATION_CONFIGS:
            return False
        raise KeyError(
            f"Unknown config_name {self.config_name!r}: use one of "
            f"{list(_CLASSIFICATION_CONFIGS + _REGRESSION_CONFIGS)}"
        )

    def _info(self) -> evaluate.MetricInfo:
        dtype = "float32" if self._is_regression() else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}
            ),
            format="numpy",
        )

    def _compute(self, predictions, references, metrics=None):
        regression = self._is_regression()
        allowed = REGRESSION_METRICS if regression else CLASSIFICATION_METRICS
        if metrics is None:
            metrics = list(REGRESSION_METRICS) if regression else ["accuracy"]
        elif isinstance(metrics, str):
            metrics = [metrics]
        for name in metrics:
            if name not in VALID_METRICS:
                raise ValueError(f"Unknown metric {name!r}; valid metrics are {list(VALID_METRICS)}")
            if name not in allowed:
                raise ValueError(
                    f"Metric {name!r} is not available with config {self.config_name!r}; "
                    f"it accepts {list(allowed)}"
                )
        dtype = np.float64 if regression else np.int64
        predictions = np.asarray(predictions, dtype=dtype).reshape(-1)
        references = np.asarray(references, dtype=dtype).reshape(-1)
        if predictions.shape != references.shape:
            raise ValueError(f"{predictions.size} predictions but {references.size} references")
        if predictions.size == 0:
            raise ValueError("Cannot compute metrics on zero examples")
        return {name: _FUNCTIONS[name](predictions, references) for name in metrics}
