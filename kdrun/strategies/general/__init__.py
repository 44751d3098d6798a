"""General (task-agnostic) distillation on raw text as a kind of task: ``task.kind=general``.

A corpus task (``task=wikipedia`` / ``task=text_corpus``) has no labels: the teacher is used as it
is (no fine-tuning), the student learns only from the teacher's representations (label-free loss
terms: CKD's relations, TinyBERT's layers, MiniLM's relations, DistilBERT's cosine, and the teacher's
masked-LM distribution, ``mlm_kd``), evaluation is the distillation loss on a held-out slice of the
corpus, and the student is saved as a plain Hugging Face encoder (+ its MLM head when trained) that
task runs take with ``student=pretrained student.name_or_path=<run>/student``.

Pieces: kdrun/strategies/general/kind.py (the ``corpus`` task kind), kdrun/tasks/data/corpus.py
(reading and segmenting), kdrun/strategies/general/data.py (the cached shards and the masking
collator), kdrun/strategies/general/evaluate.py (held-out loss),
kdrun/strategies/general/cli.py (downstream probe), kdrun/losses/mlm.py (the masked-LM
distribution term).
"""

from __future__ import annotations

from typing import Any

from kdrun.errors import ConfigError
from kdrun.models.features import MLM_NEED

CORPUS_METRICS = ("distill_loss",)


def head_for(plans: list[Any], role: str) -> str:
    """The model head a corpus run loads for ``role``: ``mlm`` when a term reads its masked-LM
    distribution, else the bare encoder."""
    needs = frozenset().union(*(getattr(p, f"{role}_needs") for p in plans)) if plans else frozenset()
    return "mlm" if MLM_NEED in needs else "encoder"


def uses_mlm(plans: list[Any]) -> bool:
    return head_for(plans, "student") == "mlm" or head_for(plans, "teacher") == "mlm"


def check_corpus_config(cfg: Any, plans: list[Any]) -> None:
    """Preflight of a corpus run: label-free terms only, a corpus given, sane corpus keys."""
    task = cfg.task
    for plan in plans:
        bad = [t.key for t in plan.terms if t.spec.reads_task_outputs]
        if bad or not plan.terms:
            what = f"terms {bad} need" if bad else "no loss terms: it trains on"
            raise ConfigError(
                f"objective '{cfg.objective.name}', stage '{plan.name}': {what} gold labels or task logits, which "
                f"task '{task.name}' (task.kind=general, raw text) does not have. Use a label-free objective: "
                "objective=ckd_general, mlm_ckd, tinybert_general, minilm_general, minilmv2_general or "
                "distilbert_general")
    if not task.data_files:
        raise ConfigError(f"task '{task.name}' needs its text: task.data_files=<file, directory or glob of plain-text "
                          "or WikiExtractor files> (e.g. task.data_files=/path/to/wikipedia)")
    if not 0 < task.validation_percent < 100:
        raise ConfigError(f"task.validation_percent={task.validation_percent} must be in (0, 100): the share of "
                          "documents held out for evaluation")
    if not 0 < task.mlm_probability < 1:
        raise ConfigError(f"task.mlm_probability={task.mlm_probability} must be in (0, 1) (BERT: 0.15)")
    if task.min_segment_tokens < 1:
        raise ConfigError(f"task.min_segment_tokens={task.min_segment_tokens} must be a positive number of tokens")
    if cfg.augmentation.name != "none":
        raise ConfigError(f"augmentation={cfg.augmentation.name} rewrites task sentences; a corpus task "
                          "distils on its own text (augmentation=none)")
