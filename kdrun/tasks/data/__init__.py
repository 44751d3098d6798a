"""Task data: GLUE TSV / csv / json / hub loaders and the synthetic toy task."""

from kdrun.tasks.data.sources import DataError, check_task_data, expected_tsv_paths, load_task_data, read_glue_tsv
from kdrun.tasks.data.toy import make_toy_splits, toy_label

__all__ = [
    "DataError",
    "check_task_data",
    "expected_tsv_paths",
    "load_task_data",
    "make_toy_splits",
    "read_glue_tsv",
    "toy_label",
]
