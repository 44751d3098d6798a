"""The ``qa`` task kind: extractive question answering on SQuAD v1.1 (``task=squad``)."""

from __future__ import annotations

from typing import Any

from kdrun.errors import ConfigError
from kdrun.tasks.baselines import QA_REASON
from kdrun.tasks.classification import LabelledKind, check_labelled_objective
from kdrun.tasks.kinds import register_task_kind
from kdrun.tasks.qa import QA_METRICS


class QAKind(LabelledKind):
    name = "qa"
    report_each_metric = True  # kdrun-report: EM and F1 rows
    teacher_keyed = ("kind", "doc_stride", "max_answer_length", "n_best")

    def check_config(self, cfg: Any, plans: list[Any]) -> None:
        task = cfg.task
        if task.num_labels != 2:
            raise ConfigError(f"task.num_labels={task.num_labels}: a question answering task has 2 outputs per "
                              "token (start and end); leave task.num_labels=2")
        if task.split_by_article is not None and task.split_by_article < 1:
            raise ConfigError(f"task.split_by_article={task.split_by_article} must be a positive number of articles")
        if not 0 <= task.doc_stride < task.max_seq_length:
            raise ConfigError(f"task.doc_stride={task.doc_stride} must be >= 0 and below task.max_seq_length="
                              f"{task.max_seq_length} (it is the overlap between windows, e.g. 128 for 384)")
        for key in ("max_answer_length", "n_best"):
            if task[key] < 1:
                raise ConfigError(f"task.{key}={task[key]} must be a positive integer")
        if cfg.augmentation.name != "none":
            raise ConfigError(f"augmentation={cfg.augmentation.name} makes sentence-classification rows; question "
                              "answering tasks train on their own windows only (augmentation=none)")
        check_labelled_objective(cfg, plans)

    def check_metrics(self, names: list[str], task: Any) -> list[str]:
        names = [names] if isinstance(names, str) else list(names)
        wrong = [name for name in names if name not in QA_METRICS]
        if wrong or not names:
            raise ValueError(f"Metric(s) {wrong or names} do not apply to a question answering task; "
                             f"use {list(QA_METRICS)}")
        return list(dict.fromkeys(names))

    def check_data(self, task: Any) -> None:
        from kdrun.tasks.qa.squad import check_qa_data

        check_qa_data(task)

    def load_raw(self, task: Any, seed: int | None = None) -> Any:
        from kdrun.tasks.qa.squad import load_qa_data

        return load_qa_data(task, seed)

    def tokenize(self, raw: Any, tokenizer: Any, task: Any) -> Any:
        from kdrun.tasks.qa.windows import tokenize_qa_splits

        return tokenize_qa_splits(raw, tokenizer, task)

    def tokenize_cached(self, raw: Any, tokenizer: Any, task: Any, spans: Any, cache_dir: str, key: str) -> Any:
        from kdrun.tasks.qa.windows import tokenize_qa_splits

        return tokenize_qa_splits(raw, tokenizer, task, spans=spans, span_splits=[task.train_split],
                                  cache_dir=cache_dir, cache_key=key)

    def head(self, plans: list[Any], role: str) -> str:
        return "qa"

    def metric_fn(self, task: Any, eval_data: dict[str, Any]) -> Any:
        """One function per eval split: the tokenised windows carry the offsets, contexts and gold
        answers it scores against."""
        from kdrun.tasks.qa.metric import qa_metric_fn

        return {split: qa_metric_fn(data, int(task.n_best), int(task.max_answer_length))
                for split, data in (eval_data or {}).items()}

    def baseline(self, task: Any, train: Any, evals: dict[str, Any]) -> dict[str, Any] | None:
        return {"kind": None, "reason": QA_REASON}

    def join_logits(self, batches: list[Any]) -> Any:
        """Per-token (B, n, 2) logits of batches padded to different widths n, padded with -inf to the
        widest (a padded position is never an answer's start or end)."""
        import torch

        width = max((b.shape[1] for b in batches), default=0)
        return torch.cat([torch.nn.functional.pad(b, (0, 0, 0, width - b.shape[1]), value=float("-inf"))
                          for b in batches])

    def batch_logits(self, rows: Any, batch: dict[str, Any]) -> Any:
        """The table is as wide as the widest window, the batch as its own."""
        return rows[:, : batch["attention_mask"].shape[1]]


register_task_kind(QAKind())
