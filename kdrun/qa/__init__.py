"""Extractive question answering (SQuAD v1.1) as a kind of task: ``task.kind=qa`` (``task=squad``).

What a QA task adds to the classification pipeline, each in its own module:

- :mod:`kdrun.qa.squad`: SQuAD v1.1 JSON (files, a directory, the hub), validated, optionally
  split by article (``task.split_by_article``);
- :mod:`kdrun.qa.windows`: question + context windows (context-only truncation with a document
  stride, offsets kept, answers outside a window labelled at [CLS]), cached by content hash;
- :mod:`kdrun.qa.spans`: MGSKD's word and phrase spans located in the windows;
- :mod:`kdrun.qa.postprocess`: the best answer span of an example over all its windows (n-best
  start / end candidates, maximum answer length; vectorised);
- :mod:`kdrun.qa.metric`: the official v1.1 exact match and F1.

The model is the family's question-answering head (start / end logits over the window's tokens);
the features record carries them as ``logits`` of shape (B, n, 2), which the prediction-layer loss
terms (kdrun/losses/prediction.py) read as 2B distributions over the n positions. The
intermediate-layer terms see hidden states and attention masks as for any other task.
"""

from __future__ import annotations

from typing import Any

from kdrun.errors import ConfigError

KINDS = ("classification", "qa", "corpus")
QA_METRICS = ("exact_match", "f1")


def is_qa(task: Any) -> bool:
    """Whether a task config is extractive question answering (``task.kind=qa``)."""
    kind = task.get("kind", "classification") if isinstance(task, dict) else getattr(task, "kind", "classification")
    return kind == "qa"


def check_qa_config(cfg: Any) -> None:
    """Preflight checks of a run's QA settings (no data or model loaded): ConfigError naming the key."""
    task = cfg.task
    if task.kind not in KINDS:
        raise ConfigError(f"task.kind='{task.kind}' must be one of {', '.join(KINDS)}")
    if not is_qa(task):
        if task.split_by_article is not None:
            raise ConfigError("task.split_by_article is for question answering tasks (task.kind=qa, task=squad)")
        return
    if task.num_labels != 2:
        raise ConfigError(f"task.num_labels={task.num_labels}: a question answering task has 2 outputs per token "
                          "(start and end); leave task.num_labels=2")
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
