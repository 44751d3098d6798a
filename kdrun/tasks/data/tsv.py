"""The classic GLUE TSV layout (quoting off), read with errors that name file and line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kdrun.config import task_config
from kdrun.tasks.data.common import _GLUE_HINT, DataError, _is_pair, _LabelParser, task_splits


def expected_tsv_paths(task: Any) -> dict[str, Path]:
    """The TSV file each needed split is read from: ``task.data_dir / task.tsv.files[split]``."""
    task = task_config(task)
    data_dir = task.data_dir
    if not data_dir:
        raise DataError(f"task '{task.name}': task.data_dir is not set, so there are no TSV files")
    files = dict(task.tsv.files)
    root = Path(os.path.expanduser(str(data_dir)))
    missing = [s for s in task_splits(task) if s not in files]
    if missing:
        raise DataError(
            f"task '{task.name}': task.tsv.files has no file for split(s) {missing} "
            f"(it maps {files}); add e.g. task.tsv.files.{missing[0]}=dev.tsv"
        )
    return {s: root / str(files[s]) for s in task_splits(task)}


def _check_tsv_files(task: Any) -> dict[str, Path]:
    paths = expected_tsv_paths(task)
    root = Path(os.path.expanduser(str(task.data_dir)))
    missing = [p for p in paths.values() if not p.is_file()]
    if missing:
        listing = "\n".join(
            f"  {split}: {p}{'' if p.is_file() else '  (missing)'}" for split, p in paths.items()
        )
        where = f"directory {root} does not exist" if not root.is_dir() else "some files are missing"
        raise DataError(
            f"task '{task.name}': GLUE TSV data not found ({where}). Expected files:\n{listing}\n"
            f"{_GLUE_HINT}; check task.data_dir={task.data_dir!r}."
        )
    return paths


def _resolve_column(
    spec: str, canon: str, header: list[str] | None, path: Path
) -> int:
    """Column spec (header name or int string, possibly negative) -> index (negative kept if no header)."""
    spec = str(spec).strip()
    if header is not None:
        if spec in header:
            return header.index(spec)
        try:
            index = int(spec)
        except ValueError:
            raise DataError(
                f"{path}:1: column {spec!r} (task.tsv.columns.{canon}) is not in the header; the header "
                f"has {header}. Fix task.tsv.columns.{canon} (a header name or a 0-based index)."
            ) from None
        if not -len(header) <= index < len(header):
            raise DataError(
                f"{path}:1: column index {index} (task.tsv.columns.{canon}) is out of range for a header "
                f"with {len(header)} columns {header}."
            )
        return index % len(header)
    try:
        return int(spec)
    except ValueError:
        raise DataError(
            f"{path}: the file has no header (task.tsv.header=false), so task.tsv.columns.{canon} must be "
            f"a 0-based column index such as \"3\", not {spec!r}."
        ) from None


def _file_lines(path: Path) -> list[str]:
    """The file's lines (UTF-8, BOM and trailing blank lines removed); errors name the line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({e.reason}); re-save the file as UTF-8.") from None
    lines = text.removeprefix("\ufeff").split("\n")
    end = len(lines)
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    return lines[:end]


def _wanted_columns(task: Any, path: Path) -> tuple[dict[str, str], list[str]]:
    columns = dict(task.tsv.columns)
    wanted = ["text_a", "text_b", "label"] if _is_pair(task) else ["text_a", "label"]
    absent = [c for c in wanted if c not in columns]
    if absent:
        raise DataError(
            f"task '{task.name}': task.tsv.columns has no entry for {absent} (needed to read {path}); "
            f"it maps {columns}."
        )
    return columns, wanted


def _row_fields(line: str, where: str, ncols: int | None, need: int, idx: dict[str, int]) -> list[str]:
    fields = line.removesuffix("\r").split("\t")
    n = len(fields)
    if ncols is not None and n != ncols:
        raise DataError(f"{where}: expected {ncols} tab-separated fields (as in the header) but found {n}. "
                        "Fix or remove this line (a stray tab or a line break inside a sentence?).")
    if ncols is None and n < need:
        raise DataError(f"{where}: expected at least {need} tab-separated fields (task.tsv.columns uses column "
                        f"indices {sorted(idx.values())}) but found {n}. Fix or remove this line.")
    return fields


def read_glue_tsv(path: Path | str, task: Any) -> dict[str, list[Any]]:
    """Parse one GLUE TSV file (quoting off) into ``{"text_a", ["text_b"], "label"}`` lists."""
    task = task_config(task)
    path = Path(path)
    columns, wanted = _wanted_columns(task, path)
    lines = _file_lines(path)
    header: list[str] | None = None
    if bool(task.tsv.header):
        if not lines:
            raise DataError(f"{path}:1: the file is empty but a header line was expected (task.tsv.header).")
        header = [h.strip() for h in lines[0].rstrip("\r").split("\t")]
    idx = {c: _resolve_column(columns[c], c, header, path) for c in wanted}
    need = max((i + 1 if i >= 0 else -i) for i in idx.values())
    parse_label = _LabelParser(task)
    out: dict[str, list[Any]] = {c: [] for c in wanted}
    for i in range(1 if header is not None else 0, len(lines)):
        where = f"{path}:{i + 1}"
        fields = _row_fields(lines[i], where, len(header) if header is not None else None, need, idx)
        for col in wanted[:-1]:
            if not fields[idx[col]].strip():
                raise DataError(f"{where}: empty text in column {columns[col]!r} ({col}). Fix or remove this line.")
        value, err = parse_label(fields[idx["label"]])
        if err is not None:
            raise DataError(f"{where}: {err}. Fix this line or the task's label settings.")
        for col in wanted[:-1]:
            out[col].append(fields[idx[col]])
        out["label"].append(value)
    return out
