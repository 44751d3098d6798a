"""Task data from the Hugging Face hub: reachability checked in seconds, datasets loaded with a
message that says what to use instead."""

from __future__ import annotations

import os
from typing import Any

import datasets

from kdrun.config import task_config
from kdrun.models.loading import hub_offline, hub_reachable
from kdrun.tasks.data.common import DataError, task_splits


def check_hub(task: Any) -> None:
    """Only reachability is probed (a few seconds at most), so a machine without the hub fails at
    once instead of after minutes of retries; a dataset in the local cache is still used when
    HF_DATASETS_OFFLINE=1 is set."""
    task = task_config(task)
    if not hub_offline() and os.environ.get("HF_DATASETS_OFFLINE") != "1" and not hub_reachable():
        raise DataError(
            f"task '{task.name}': its data comes from the hub ({task.hub_dataset}), which is "
            "unreachable. Use local files instead: task.data_dir=<GLUE TSV dir> (classic "
            "GLUE layout), task.data_files={train: ..., validation: ...} (csv/json), or task=toy."
        )


# Hub datasets that moved into an organisation's namespace: the old id is still accepted.
LEGACY_HUB_IDS = {"squad": "rajpurkar/squad"}


def load_hub(task: Any) -> dict[str, datasets.Dataset]:
    task = task_config(task)
    name = task.hub_dataset
    config = task.hub_config
    hint = (
        "Use local files instead: task.data_dir=<GLUE TSV dir> (classic GLUE layout), "
        "task.data_files={train: ..., validation: ...} (csv/json), or task=toy (synthetic, no download)."
    )
    if not name:
        raise DataError(f"task '{task.name}': no data source configured (no toy, data_files, "
                        f"data_dir or hub_dataset). {hint}")
    # A legacy id is read under its current id, then as given (a local cache made under the old id).
    hub_ids = [LEGACY_HUB_IDS[str(name)], str(name)] if str(name) in LEGACY_HUB_IDS else [str(name)]
    failure = None
    for hub_id in hub_ids:
        try:
            loaded = datasets.load_dataset(hub_id, None if config is None else str(config))
            break
        except Exception as e:
            failure = e if failure is None else failure  # report the first id's error
    else:
        offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v) == "1"]
        note = f" ({', '.join(offline)}=1 is set)" if offline else ""
        tried = " or ".join(repr(h) for h in hub_ids)
        raise DataError(
            f"task '{task.name}': dataset {tried} (config {config!r}) could not be loaded from the "
            f"hub{note}: {type(failure).__name__}: {failure}\n{hint}"
        ) from failure
    missing = [s for s in task_splits(task) if s not in loaded]
    if missing:
        raise DataError(
            f"task '{task.name}': hub dataset {name!r} ({config!r}) has no split(s) {missing}; "
            f"available: {list(loaded)}. Fix task.train_split / task.eval_splits."
        )
    return {s: loaded[s] for s in task_splits(task)}


