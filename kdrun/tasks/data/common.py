"""What every data source shares: the error type, task-config accessors, label parsing."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import datasets
import numpy as np

from kdrun.errors import UserError

_GLUE_HINT = (
    "Point task.data_dir at a directory in the classic GLUE download layout (e.g. glue_data/MRPC "
    "holding train.tsv and dev.tsv), or adjust task.tsv.files"
)


class DataError(UserError, ValueError):
    """A task's data could not be found or parsed; the message says where and what to do."""


# --------------------------------------------------------------------------------------------
# Task config (typed: kdrun.config.TaskConfig)


def list_of(inner: Any) -> Any:
    """A list column of ``inner``: ``datasets.List`` (datasets 4 and later), ``datasets.Sequence``
    before it."""
    return (getattr(datasets, "List", None) or datasets.Sequence)(inner)


def task_splits(task: Any) -> list[str]:
    """The train split followed by the eval splits, without duplicates."""
    out = [str(task.train_split)]
    for s in task.eval_splits:
        if str(s) not in out:
            out.append(str(s))
    return out


def _is_pair(task: Any) -> bool:
    return len(list(task.text_columns)) == 2


def _is_regression(task: Any) -> bool:
    return int(task.num_labels) == 1


def _features(pair: bool, regression: bool) -> datasets.Features:
    cols: dict[str, Any] = {"text_a": datasets.Value("string")}
    if pair:
        cols["text_b"] = datasets.Value("string")
    cols["label"] = datasets.Value("float32" if regression else "int64")
    cols["idx"] = datasets.Value("int64")
    return datasets.Features(cols)


# --------------------------------------------------------------------------------------------
# Labels


class _LabelParser:
    """Turns a raw label value into a class id or a float score, or says why it can't."""

    def __init__(self, task: Any) -> None:
        self.num_labels = int(task.num_labels)
        self.names = [str(n) for n in task.label_names]
        self.regression = self.num_labels == 1
        if self.names:
            self.lookup = {n: i for i, n in enumerate(self.names)}
        else:
            self.lookup = {str(i): i for i in range(self.num_labels)}

    def describe(self) -> str:
        if self.regression:
            return "a number (regression task, num_labels=1)"
        if self.names:
            return f"one of {self.names} (task.label_names)"
        return f"an integer class id in 0..{self.num_labels - 1} (task.num_labels={self.num_labels})"

    def __call__(self, raw: Any) -> tuple[Any, str | None]:
        """Return ``(value, None)`` or ``(None, reason)``."""
        if raw is None:
            return None, f"missing label; expected {self.describe()}"
        if self.regression:
            try:
                value = float(str(raw).strip()) if isinstance(raw, str) else float(raw)
            except (TypeError, ValueError):
                return None, f"cannot parse label {raw!r} as a float score"
            if not math.isfinite(value):
                return None, f"label {raw!r} is not a finite number"
            return value, None
        if isinstance(raw, bool):
            raw = int(raw)
        if isinstance(raw, str):
            key = raw.strip()
            hit = self.lookup.get(key)
            if hit is not None:
                return hit, None
            if self.names:
                return None, f"unknown label {raw!r}; valid label names are {self.names} (task.label_names)"
            try:
                raw = int(key)
            except ValueError:
                return None, f"label {raw!r} is not {self.describe()}"
        if isinstance(raw, float):
            if not raw.is_integer():
                return None, f"label {raw!r} is not {self.describe()}"
            raw = int(raw)
        if isinstance(raw, (int, np.integer)):
            value = int(raw)
            if self.names and 0 <= value < len(self.names):
                return value, None
            if 0 <= value < self.num_labels:
                return value, None
            return None, f"label {value} is out of range; expected {self.describe()}"
        return None, f"label {raw!r} is not {self.describe()}"


def data_fingerprint(dsd) -> str:
    """Content hash of all splits (texts and labels)."""
    h = hashlib.sha256()
    for split in sorted(dsd):
        ds = dsd[split]
        h.update(f"[{split}:{len(ds)}]".encode())
        for col in ("text_a", "text_b", "label", "question", "context", "answers"):  # (the last three: QA)
            if col in ds.column_names:
                h.update(json.dumps(list(ds[col])).encode())
    return h.hexdigest()[:16]
