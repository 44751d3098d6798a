"""A new task kind outside kdrun, as a plug-in would add one: token classification (tag each word
of the synthetic toy sentences as a sentiment word or not).

It is everything the kind needs in one module — the kind (data, collation, head, metric), a model
head (transformers' token classifier) and its two loss terms — and is used with
``task.kind=tokens task.imports=[tests.token_kind] objective.imports=[tests.token_kind]``
(tests/test_task_kinds.py runs it end to end). A packaged plug-in would instead declare the module
under the ``kdrun.task_kinds`` and ``kdrun.losses`` entry points.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F

from kdrun.errors import ConfigError
from kdrun.losses.registry import register_loss
from kdrun.models.loading import register_head
from kdrun.runtime.cache import content_hash
from kdrun.tasks.data.toy import NEGATIVE_WORDS, POSITIVE_WORDS, make_toy_splits
from kdrun.tasks.kinds import KindData, TaskKind, register_task_kind

IGNORE = -100  # sub-word continuations, [CLS], [SEP] and padding carry no label
SENTIMENT = frozenset(POSITIVE_WORDS) | frozenset(NEGATIVE_WORDS)
TERMS = ("token_ce", "token_kd")

register_head("token", "AutoModelForTokenClassification")


def word_labels(words: list[str]) -> list[int]:
    return [int(w in SENTIMENT) for w in words]


def encode(texts: list[str], tokenizer: Any, max_len: int) -> dict[str, list[Any]]:
    """Word-piece ids with one label per word on its first piece."""
    words = [t.split() for t in texts]
    enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
    labels = []
    for i, ws in enumerate(words):
        tags, seen, row = word_labels(ws), set(), []
        for w in enc.word_ids(i):
            row.append(IGNORE if w is None or w in seen else tags[w])
            seen.add(w)
        labels.append(row)
    n = len(texts)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels,
            "idx": list(range(n)), "length": [len(x) for x in enc["input_ids"]]}


class PadToMax:
    """Pads every batch to task.max_seq_length, so per-token labels of all batches stack."""

    def __init__(self, pad_id: int, width: int):
        self.pad_id, self.width = pad_id, width

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        def pad(key: str, fill: int) -> torch.Tensor:
            return torch.tensor([list(r[key]) + [fill] * (self.width - len(r[key])) for r in rows])

        return {"input_ids": pad("input_ids", self.pad_id), "attention_mask": pad("attention_mask", 0),
                "labels": pad("labels", IGNORE), "idx": torch.tensor([r["idx"] for r in rows])}


def token_accuracy(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    keep = labels != IGNORE
    return {"token_accuracy": float((logits.argmax(-1)[keep] == labels[keep]).mean())}


class TokenKind(TaskKind):
    name = "tokens"
    teacher_keyed = ("kind",)
    finetune_loss = "token_ce"

    def check_config(self, cfg: Any, plans: list[Any]) -> None:
        other = [t.key for p in plans for t in p.terms if t.spec.name not in TERMS]
        if other:
            raise ConfigError(f"task.kind=tokens trains with {list(TERMS)} only, not {other}")

    def check_metrics(self, names: list[str], task: Any) -> list[str]:
        if list(names) != ["token_accuracy"]:
            raise ValueError(f"Metric(s) {list(names)} do not apply to token classification; use ['token_accuracy']")
        return ["token_accuracy"]

    def load_data(self, cfg: Any, tokenizer: Any, tok_hash: str, plans: list[Any], spans: Any = None) -> KindData:
        task = cfg.task
        raw = make_toy_splits(task.toy, train_split=task.train_split, eval_splits=list(task.eval_splits))
        split = {s: datasets.Dataset.from_dict(encode(raw[s]["text_a"], tokenizer, task.max_seq_length))
                 for s in raw}
        data_hash = content_hash({s: raw[s]["text_a"] for s in raw})
        return KindData(data_hash, None, split[task.train_split], {s: split[s] for s in task.eval_splits},
                        self.collator(tokenizer, task, True))

    def collator(self, tokenizer: Any, task: Any, pad_to_max_length: bool) -> Any:
        return PadToMax(tokenizer.pad_token_id, task.max_seq_length)

    def head(self, plans: list[Any], role: str) -> str:
        return "token"

    def metric_fn(self, task: Any, eval_data: dict[str, Any]) -> Any:
        return token_accuracy


register_task_kind(TokenKind())


@register_loss("token_ce", uses_teacher=False, uses_labels=True)
def token_ce(s, t, batch, ctx, p) -> torch.Tensor:
    """Cross-entropy of every labelled token."""
    return F.cross_entropy(s.logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)


@register_loss("token_kd")
def token_kd(s, t, batch, ctx, p) -> torch.Tensor:
    """KL(teacher || student) of the tag distributions, mean over labelled tokens."""
    keep = batch["labels"].flatten() != IGNORE
    log_ps = F.log_softmax(s.logits.float().flatten(0, 1)[keep], -1)
    log_pt = F.log_softmax(t.logits.float().flatten(0, 1)[keep], -1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
