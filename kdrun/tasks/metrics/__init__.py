"""GLUE metrics for kdrun, computed by the project's own offline ``evaluate`` module.

The module lives in ``kdrun/tasks/metrics/glue_metric/glue_metric.py`` (shipped as package data) and is a
regular ``evaluate.Metric``, so it can also be loaded directly::

    evaluate.load(str(Path(kdrun.tasks.metrics.__file__).parent / "glue_metric"), config_name="regression")

Its two configurations fix the input features: ``"classification"`` (int64 class ids; the default)
and ``"regression"`` (float32 scores). ``evaluate`` is imported lazily (it pulls in transformers and
takes seconds), so importing this package for ``VALID_METRICS`` or ``labelled_metric_names`` is cheap.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import evaluate

__all__ = [
    "CLASSIFICATION_METRICS",
    "GLUE_METRIC_PATH",
    "REGRESSION_METRICS",
    "VALID_METRICS",
    "labelled_metric_names",
    "compute_task_metrics",
    "load_glue_metric",
]

# Keep in sync with glue_metric/glue_metric.py (the evaluate module cannot import kdrun).
CLASSIFICATION_METRICS = ("accuracy", "f1", "matthews_correlation")
REGRESSION_METRICS = ("pearson", "spearmanr")
VALID_METRICS = CLASSIFICATION_METRICS + REGRESSION_METRICS

GLUE_METRIC_PATH = Path(__file__).resolve().parent / "glue_metric"

_CACHE: dict[bool, evaluate.EvaluationModule] = {}
_LOCK = threading.Lock()


def load_glue_metric(regression: bool) -> evaluate.EvaluationModule:
    """The local GLUE metric module, config ``"regression"`` or ``"classification"``.

    Loaded once per config and process (later calls return the cached instance); offline: ``evaluate``
    loads a local script without any network access. Predictions are kept in memory, not in
    ``~/.cache/huggingface/evaluate`` arrow files.
    """
    key = bool(regression)
    with _LOCK:
        module = _CACHE.get(key)
        if module is None:
            config_name = "regression" if key else "classification"
            try:
                import evaluate

                module = evaluate.load(str(GLUE_METRIC_PATH), config_name=config_name, keep_in_memory=True)
            except OSError as error:
                # evaluate.load copies the script into HF_MODULES_CACHE (~/.cache/huggingface/modules);
                # on a read-only home, fall back to importing it in place. Same class, same results.
                warnings.warn(
                    f"evaluate.load({str(GLUE_METRIC_PATH)!r}) failed ({error}); "
                    "importing the metric script directly",
                    RuntimeWarning,
                    stacklevel=2,
                )
                module = _instantiate_directly(config_name)
            _CACHE[key] = module
    return module


def _instantiate_directly(config_name: str) -> evaluate.EvaluationModule:
    import evaluate

    script = GLUE_METRIC_PATH / "glue_metric.py"
    name = "kdrun_glue_metric_script"
    py_module = sys.modules.get(name)
    if py_module is None:
        spec = importlib.util.spec_from_file_location(name, script)
        py_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(py_module)
        sys.modules[name] = py_module
    classes = [
        obj
        for obj in vars(py_module).values()
        if isinstance(obj, type) and issubclass(obj, evaluate.Metric) and obj.__module__ == name
    ]
    if len(classes) != 1:
        raise ImportError(f"expected exactly one evaluate.Metric subclass in {script}, found {len(classes)}")
    return classes[0](config_name=config_name, keep_in_memory=True)


def _to_numpy(values: Any, what: str) -> np.ndarray:
    """numpy array from a numpy array, torch tensor (any device / dtype, incl. bf16) or sequence."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch.Tensor, without importing torch
        values = values.detach().cpu()
        if values.is_floating_point():
            values = values.float()
        values = values.numpy()
    array = np.asarray(values)
    if array.dtype == object:
        raise ValueError(f"{what} must be numeric, got an object array")
    return array


def _class_ids(array: np.ndarray, what: str) -> np.ndarray:
    if array.dtype.kind == "b":
        return array.astype(np.int64)
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
            raise ValueError(f"{what} must be integer class ids for classification, got non-integer floats")
    elif array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be numeric class ids, got dtype {array.dtype}")
    return array.astype(np.int64)


def _prepare_predictions(predictions: Any, regression: bool) -> np.ndarray:
    array = _to_numpy(predictions, "predictions")
    if regression:
        if array.ndim == 2 and array.shape[1] == 1:
            array = array[:, 0]
        if array.ndim != 1:
            raise ValueError(f"regression predictions must have shape (N,) or (N, 1), got {array.shape}")
        return array.astype(np.float64)
    if array.ndim == 2:
        if array.shape[1] < 2:
            raise ValueError(
                f"classification logits must have shape (N, num_labels>=2), got {array.shape}; "
                "(N, 1) outputs are regression scores (use regression=True)"
            )
        return array.argmax(axis=-1).astype(np.int64)
    if array.ndim != 1:
        raise ValueError(
            f"classification predictions must be logits (N, C) or class ids (N,), got {array.shape}"
        )
    return _class_ids(array, "predictions")


def _prepare_references(references: Any, regression: bool) -> np.ndarray:
    array = _to_numpy(references, "references")
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise ValueError(f"references must have shape (N,) or (N, 1), got {array.shape}")
    return array.astype(np.float64) if regression else _class_ids(array, "references")


def labelled_metric_names(metric_names: Sequence[str], regression: bool) -> list[str]:
    """The requested names without duplicates; ValueError naming the valid ones for a classification
    (or, ``regression``, a regression) task. Other task kinds check their own (TaskKind.check_metrics)."""
    if isinstance(metric_names, str):
        metric_names = [metric_names]
    names = list(metric_names)
    if not names:
        raise ValueError(f"No metric requested; valid metrics are {list(VALID_METRICS)}")
    unknown = [name for name in names if name not in VALID_METRICS]
    if unknown:
        raise ValueError(f"Unknown metric(s) {unknown}; valid metrics are {list(VALID_METRICS)}")
    allowed = REGRESSION_METRICS if regression else CLASSIFICATION_METRICS
    wrong = [name for name in names if name not in allowed]
    if wrong:
        kind = "regression" if regression else "classification"
        raise ValueError(f"Metric(s) {wrong} do not apply to a {kind} task; use {list(allowed)}")
    return list(dict.fromkeys(names))  # drop duplicates, keep order


def compute_task_metrics(
    metric_names: Sequence[str], predictions: Any, references: Any, regression: bool
) -> dict[str, float]:
    """Compute ``metric_names`` for a task from model outputs.

    Classification: ``predictions`` are logits ``(N, C)`` (argmax over the last dim) or class ids
    ``(N,)``; references are class ids. Regression: predictions ``(N,)`` or ``(N, 1)`` scores.
    Accepts numpy arrays, torch tensors (any device/dtype) or sequences. Returns ``{name: float}``
    in the requested order; raises ``ValueError`` for unknown names, names of the other task kind,
    shape problems, length mismatches or empty inputs.
    """
    names = labelled_metric_names(metric_names, regression)
    preds = _prepare_predictions(predictions, regression)
    refs = _prepare_references(references, regression)
    if preds.shape[0] != refs.shape[0]:
        raise ValueError(f"{preds.shape[0]} predictions but {refs.shape[0]} references")
    if preds.shape[0] == 0:
        raise ValueError("Cannot compute metrics on zero examples")
    if regression:
        preds, refs = preds.astype(np.float32), refs.astype(np.float32)
    result = load_glue_metric(regression).compute(predictions=preds, references=refs, metrics=names)
    return {name: float(result[name]) for name in names}
