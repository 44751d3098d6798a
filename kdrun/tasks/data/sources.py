"""Load a task's splits into a :class:`datasets.DatasetDict` with canonical columns.

Every split has ``text_a`` (str), ``text_b`` (str, pair tasks only), ``label`` (int64 class id, or
float32 for regression) and ``idx`` (int64 row position within the split after subsampling).

Sources, tried in this order (see :class:`kdrun.config.TaskConfig`):

1. ``task.toy`` -> the synthetic task of :mod:`kdrun.tasks.data.toy`;
2. ``task.data_files`` -> csv / tsv / json / jsonl files read with :func:`datasets.load_dataset`;
3. ``task.data_dir`` -> the classic GLUE TSV layout, parsed here (quoting off);
4. the hub (``task.hub_dataset`` / ``task.hub_config``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from kdrun.config import task_config
from kdrun.tasks.data.hub import check_hub, load_hub
from kdrun.tasks.data.toy import make_toy_splits

__all__ = [
    "DataError",
    "check_task_data",
    "expected_tsv_paths",
    "load_task_data",
    "read_glue_tsv",
]

from kdrun.tasks.data.common import (  # noqa: F401  (DataError is part of this module's interface)
    _GLUE_HINT,
    DataError,
    _features,
    _is_pair,
    _is_regression,
    _LabelParser,
    task_splits,
)
from kdrun.tasks.data.tsv import _check_tsv_files, expected_tsv_paths, read_glue_tsv

# --------------------------------------------------------------------------------------------
# data_files (csv / tsv / json)


def _data_file_paths(task: Any) -> dict[str, Path]:
    files = dict(task.data_files or {})
    missing = [s for s in task_splits(task) if s not in files]
    if missing:
        raise DataError(
            f"task '{task.name}': task.data_files has no file for split(s) {missing}; it maps "
            f"{ {k: str(v) for k, v in files.items()} }. Give every split, e.g. task.data_files='{{train: a.csv, "
            f"{missing[0]}: b.csv}}'"
        )
    return {s: Path(os.path.expanduser(str(files[s]))) for s in task_splits(task)}


def _check_data_files(task: Any) -> dict[str, Path]:
    paths = _data_file_paths(task)
    if any(not p.is_file() for p in paths.values()):
        listing = "\n".join(
            f"  {split}: {p}{'' if p.is_file() else '  (missing)'}" for split, p in paths.items()
        )
        raise DataError(
            f"task '{task.name}': data files not found. Expected files:\n{listing}\n"
            "Check task.data_files (paths are relative to the working directory)."
        )
    for split, p in paths.items():
        if _file_format(p) is None:
            raise DataError(
                f"{p}: unsupported data file type for split '{split}'; use .csv, .tsv, .json or .jsonl."
            )
    return paths


def _file_format(path: Path) -> tuple[str, dict[str, Any]] | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    ext = suffixes[-1] if suffixes else ""
    if ext == ".csv":
        return "csv", {"keep_default_na": False}
    if ext == ".tsv":
        return "csv", {"sep": "\t", "quoting": 3, "keep_default_na": False}
    if ext in (".json", ".jsonl"):
        return "json", {}
    return None


def _source_columns(ds: datasets.Dataset, task: Any, where: str) -> tuple[list[str], str]:
    """The task's text and label column names, checked to exist in ``ds``."""
    text_cols = [str(c) for c in task.text_columns]
    label_col = str(task.label_column)
    expected = text_cols + [label_col]
    absent = [c for c in expected if c not in ds.column_names]
    if absent:
        raise DataError(
            f"{where}: missing column(s) {absent}; expected columns {expected} (task.text_columns and "
            f"task.label_column), found {ds.column_names}."
        )
    return text_cols, label_col


def _read_data_file(path: Path, split: str, task: Any) -> dict[str, list[Any]]:
    fmt = _file_format(path)
    assert fmt is not None
    builder, kwargs = fmt
    try:
        ds = datasets.load_dataset(builder, data_files={split: str(path)}, split=split, **kwargs)
    except Exception as e:
        raise DataError(f"{path}: could not be read as {builder} ({type(e).__name__}: {e}).") from e
    text_cols, label_col = _source_columns(ds, task, f"{path}")
    canon = ["text_a", "text_b"][: len(text_cols)]
    parse_label = _LabelParser(task)
    out: dict[str, list[Any]] = {c: [] for c in canon}
    out["label"] = []
    for c_src, c_dst in zip(text_cols, canon):
        values = ds[c_src]
        for row, v in enumerate(values, start=1):
            if v is None or not str(v).strip():
                raise DataError(
                    f"{path}: row {row}: empty text in column {c_src!r}. Fix or remove this row."
                )
        out[c_dst] = [str(v) for v in values]
    for row, v in enumerate(ds[label_col], start=1):
        value, err = parse_label(v)
        if err is not None:
            raise DataError(f"{path}: row {row}: {err}. Fix this row or the task's label settings.")
        out["label"].append(value)
    return out


# --------------------------------------------------------------------------------------------
# Hub


def _hub_split(ds: datasets.Dataset, split: str, task: Any) -> dict[str, list[Any]]:
    text_cols, label_col = _source_columns(ds, task, f"task '{task.name}': hub split '{split}'")
    parse_label = _LabelParser(task)
    out: dict[str, list[Any]] = {}
    for c_src, c_dst in zip(text_cols, ["text_a", "text_b"]):
        out[c_dst] = ["" if v is None else str(v) for v in ds[c_src]]
    labels = []
    for row, v in enumerate(ds[label_col], start=1):
        value, err = parse_label(v)
        if err is not None:
            raise DataError(f"task '{task.name}': hub split '{split}', row {row}: {err}.")
        labels.append(value)
    out["label"] = labels
    return out


# --------------------------------------------------------------------------------------------
# Assembly


def _subsample(cols: dict[str, list[Any]], limit: int | None, seed: int, what: str) -> dict[str, list[Any]]:
    """Keep the first ``limit`` rows of a seeded shuffle (unchanged if the split is not larger)."""
    if limit is None:
        return cols
    limit = int(limit)
    if limit < 1:
        raise DataError(f"task.{what} must be a positive integer or null, got {limit}")
    n = len(cols["label"])
    if limit >= n:
        return cols
    order = np.random.default_rng(seed).permutation(n)[:limit].tolist()
    return {k: [v[i] for i in order] for k, v in cols.items()}


def _to_dataset(cols: dict[str, list[Any]], pair: bool, regression: bool) -> datasets.Dataset:
    data: dict[str, list[Any]] = {"text_a": cols["text_a"]}
    if pair:
        data["text_b"] = cols["text_b"]
    data["label"] = cols["label"]
    data["idx"] = list(range(len(cols["label"])))
    return datasets.Dataset.from_dict(data, features=_features(pair, regression))


def check_task_data(task: Any) -> None:
    """Cheap pre-flight check (no parsing): the configured files exist, else :class:`DataError`.

    For the hub, only reachability is probed (a few seconds at most) so an offline machine fails
    at once instead of after minutes of retries; a dataset in the local cache is still used when
    HF_DATASETS_OFFLINE=1 is set.
    """
    task = task_config(task)
    if task.toy is not None:
        return
    if dict(task.data_files or {}):
        _check_data_files(task)
        return
    if task.data_dir:
        _check_tsv_files(task)
        return
    check_hub(task)


def load_task_data(task: Any, seed: int | None = None) -> datasets.DatasetDict:
    """Load the train and eval splits of ``task`` with canonical columns (see module docstring).

    ``max_train_samples`` / ``max_eval_samples`` subsets are drawn with ``task.sample_seed`` (not the
    run's seed), so runs over several seeds see the same examples; ``seed`` overrides it.
    """
    task = task_config(task)
    if seed is None:
        seed = int(task.sample_seed)
    splits = task_splits(task)
    train_split = splits[0]
    pair = _is_pair(task)
    regression = _is_regression(task)

    raw: dict[str, dict[str, list[Any]]] = {}
    toy = task.toy
    if toy is not None:
        if pair or regression or int(task.num_labels) != 2:
            raise DataError(
                f"task '{task.name}': the toy generator makes single-sentence binary tasks; set "
                "task.text_columns to one column and task.num_labels=2, or remove task.toy."
            )
        raw = make_toy_splits(toy, train_split=train_split, eval_splits=splits[1:])
    elif dict(task.data_files or {}):
        for split, path in _check_data_files(task).items():
            raw[split] = _read_data_file(path, split, task)
    elif task.data_dir:
        for split, path in _check_tsv_files(task).items():
            raw[split] = read_glue_tsv(path, task)
    else:
        for split, ds in load_hub(task).items():
            raw[split] = _hub_split(ds, split, task)

    out = datasets.DatasetDict()
    for split in splits:
        cols = raw[split]
        if split == train_split:
            cols = _subsample(cols, task.max_train_samples, seed, "max_train_samples")
        else:
            cols = _subsample(cols, task.max_eval_samples, seed, "max_eval_samples")
        out[split] = _to_dataset(cols, pair, regression)
    return out
