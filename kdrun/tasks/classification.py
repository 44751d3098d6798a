"""The ``classification`` task kind: single sentences or sentence pairs labelled with a class, or a
score (regression, ``task.num_labels=1``) — GLUE and anything in its layout.

Rows come from the toy generator, csv/json files, GLUE TSV directories or the hub
(kdrun/tasks/data/sources.py), are tokenised by kdrun/tasks/data/batches.py and scored by the
local GLUE metric module (kdrun/tasks/metrics/).
"""

from __future__ import annotations

import functools
from typing import Any

from kdrun.errors import ConfigError
from kdrun.models.features import MLM_NEED
from kdrun.tasks import baselines
from kdrun.tasks.data import common
from kdrun.tasks.kinds import KindData, TaskKind, register_task_kind
from kdrun.tasks.metrics import compute_task_metrics, labelled_metric_names


def check_labelled_objective(cfg: Any, plans: list[Any]) -> None:
    """A labelled task's objective: a term must train its head, and no term may read masked-LM
    outputs (only a corpus task masks tokens)."""
    name = cfg.objective.name
    twin = name.removesuffix("_general") if name.endswith("_general") else "ckd"
    mlm = [t.key for p in plans for t in p.terms if MLM_NEED in t.spec.needs | t.spec.teacher_needs]
    if mlm:
        raise ConfigError(
            f"objective '{name}': terms {mlm} match the masked-LM distribution on masked tokens, which only a "
            f"corpus task (task.kind=general, e.g. task=wikipedia) provides; task '{cfg.task.name}' (task.kind="
            f"{cfg.task.kind}) masks none. Distil on it with a task objective, e.g. objective={twin}")
    if not any(t.spec.reads_task_outputs for p in plans for t in p.terms):
        raise ConfigError(
            f"objective '{name}' has no term that reads labels or task logits, so the {cfg.task.kind} head of "
            f"task '{cfg.task.name}' would never be trained and its scores would be those of a random head. "
            f"It is a task-agnostic distillation objective for corpus tasks (task=wikipedia / text_corpus); "
            f"on this task use e.g. objective={twin}")


def bucketed(collator: Any, cfg: Any) -> Any:
    """``collator`` padding batch widths to multiples of ``train.pad_to_multiple_of`` (auto: under a
    compiled step), up to task.max_seq_length; a collator without widths to round is returned as is."""
    from kdrun.tasks.data.batches import resolve_pad_multiple

    train = cfg.train
    multiple = resolve_pad_multiple(train.get("pad_to_multiple_of", "auto"),
                                    bool(train.get("compile")) or bool(train.get("cuda_graphs")))
    if multiple and hasattr(collator, "multiple"):
        collator.multiple, collator.limit = multiple, int(cfg.task.max_seq_length)
    return collator


class LabelledKind(TaskKind):
    """What every labelled kind shares: rows loaded, hashed and tokenised once per run (cached with
    MGSKD's spans), a fine-tuned teacher, gold-label checks of the objective."""

    def check_config(self, cfg: Any, plans: list[Any]) -> None:
        super().check_config(cfg, plans)
        check_labelled_objective(cfg, plans)

    def load_data(self, cfg: Any, tokenizer: Any, tok_hash: str, plans: list[Any], spans: Any = None) -> KindData:
        task = cfg.task
        raw = self.load_raw(task)
        data_hash = common.data_fingerprint(raw)
        tokenized = self.tokenize_cached(raw, tokenizer, task, spans, cfg.cache_dir, f"{data_hash}-{tok_hash}")
        return KindData(data_hash, raw, tokenized[task.train_split], {s: tokenized[s] for s in task.eval_splits},
                        bucketed(self.collator(tokenizer, task, cfg.train.pad_to_max_length), cfg))

    def tokenize_cached(self, raw: Any, tokenizer: Any, task: Any, spans: Any, cache_dir: str, key: str) -> Any:
        raise NotImplementedError

    def collator(self, tokenizer: Any, task: Any, pad_to_max_length: bool) -> Any:
        from kdrun.tasks.data.batches import Collator

        return Collator(tokenizer.pad_token_id, task.num_labels == 1,
                        pad_to=task.max_seq_length if pad_to_max_length else None)


# The class names of the GLUE tasks as the hub's nyu-mll/glue dataset gives them (in label-id
# order), for tasks read from TSV files or the hub whose config names none (task.label_names).
GLUE_CLASS_NAMES = {
    "cola": ["unacceptable", "acceptable"],
    "sst2": ["negative", "positive"],
    "mrpc": ["not_equivalent", "equivalent"],
    "qqp": ["not_duplicate", "duplicate"],
    "mnli": ["entailment", "neutral", "contradiction"],
    "qnli": ["entailment", "not_entailment"],
    "rte": ["entailment", "not_entailment"],
    "wnli": ["not_entailment", "entailment"],
}


def class_names(task: Any) -> list[str] | None:
    """The names of the classes, in label-id order: ``task.label_names``, else the GLUE task's own
    (when the task is a GLUE task with its number of classes), else None."""
    if int(task.num_labels) < 2:
        return None
    names = [str(n) for n in task.label_names] or GLUE_CLASS_NAMES.get(str(task.hub_config or task.name))
    return names if names and len(names) == int(task.num_labels) else None


def labelled_model_config(task: Any) -> dict[str, Any]:
    """``id2label``/``label2id`` from the class names (regression: ``problem_type=regression``)."""
    if int(task.num_labels) == 1:
        return {"problem_type": "regression"}
    names = class_names(task)
    if names is None:
        return {"problem_type": "single_label_classification"}
    return {"problem_type": "single_label_classification", "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)}}



class ClassificationKind(LabelledKind):
    name = "classification"

    def check_metrics(self, names: list[str], task: Any) -> list[str]:
        return labelled_metric_names(names, task.num_labels == 1)

    def check_data(self, task: Any) -> None:
        from kdrun.tasks.data.sources import check_task_data

        check_task_data(task)

    def load_raw(self, task: Any, seed: int | None = None) -> Any:
        from kdrun.tasks.data.sources import load_task_data

        return load_task_data(task, seed)

    def tokenize(self, raw: Any, tokenizer: Any, task: Any) -> Any:
        from kdrun.tasks.data.batches import tokenize_splits

        return tokenize_splits(raw, tokenizer, task.max_seq_length)

    def tokenize_cached(self, raw: Any, tokenizer: Any, task: Any, spans: Any, cache_dir: str, key: str) -> Any:
        from kdrun.tasks.data.batches import tokenize_splits

        return tokenize_splits(raw, tokenizer, task.max_seq_length, spans=spans, span_splits=[task.train_split],
                               cache_dir=cache_dir, cache_key=key)

    def metric_fn(self, task: Any, eval_data: dict[str, Any]) -> Any:
        return functools.partial(compute_task_metrics, list(task.metrics), regression=task.num_labels == 1)

    def baseline(self, task: Any, train: Any, evals: dict[str, Any]) -> dict[str, Any] | None:
        return baselines.labelled_baseline(task, train, evals)

    def model_config(self, task: Any) -> dict[str, Any]:
        return labelled_model_config(task)


register_task_kind(ClassificationKind())
