"""Task kinds: what a kind of task (``task.kind``) owns, and the registry that finds them.

A task kind turns a task config into everything a run needs that depends on what the task *is*:
its checks, its data (loaded, tokenised, collated), the model head, its metrics and the function
that computes them, its majority baseline and its part of the teacher-cache key. The runner, the
trainer, preflight and the teacher code only ever ask the kind; none of them names one.

Built in (entry point group ``kdrun.task_kinds``, declared in pyproject.toml):

- ``classification`` — single sentences and pairs, classes or a regression score (GLUE),
  :mod:`kdrun.tasks.classification`;
- ``qa`` — extractive question answering (SQuAD v1.1), :mod:`kdrun.tasks.qa.kind`;
- ``general`` — a corpus of raw text for general (task-agnostic) distillation,
  :mod:`kdrun.strategies.general.kind` (``corpus``: its former name, a deprecated alias).

A new kind is a subclass of :class:`TaskKind` registered with :func:`register_task_kind` in a module
that kdrun imports: one listed under the ``kdrun.task_kinds`` entry points of any installed package,
or one named in ``task.imports``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kdrun.errors import ConfigError
from kdrun.runtime.plugins import import_entry_point_modules, import_listed_modules

ENTRY_POINT_GROUP = "kdrun.task_kinds"
_KINDS: dict[str, TaskKind] = {}
_LOADED = False


@dataclass
class KindData:
    """A task's data as a run uses it: the content hash of the loaded rows, the raw splits (None
    where the kind has none to offer, e.g. augmentation input), the tokenised training split, the
    tokenised evaluation splits and the batch collator."""

    data_hash: str
    raw: Any
    train: Any
    eval: dict[str, Any]
    collator: Any


class TaskKind:
    """One kind of task. Subclasses override what differs; the defaults describe a labelled task
    whose teacher is fine-tuned on it."""

    name: str = ""
    # The teacher is fine-tuned on the task (and cached); False: the pre-trained teacher is used as it is.
    fine_tunes_teacher: bool = True
    # Metrics where lower is better (model selection negates them).
    lower_is_better: frozenset[str] = frozenset()
    # kdrun-report: one row per metric in task.metrics instead of the main metric only.
    report_each_metric: bool = False
    # task.* keys that only this kind reads and that change a fine-tuned teacher (its cache key).
    teacher_keyed: tuple[str, ...] = ()
    # The loss term (a registered name) the teacher is fine-tuned with.
    finetune_loss: str = "ce"

    # ---- preflight (no data or model loaded); every problem is a ConfigError naming the key
    def check_config(self, cfg: Any, plans: list[Any]) -> None:
        """The kind's task keys and whether the objective's terms suit the kind (here: no kind but QA,
        which overrides this, reads task.split_by_article)."""
        if cfg.task.split_by_article is not None:
            raise ConfigError("task.split_by_article is for question answering tasks (task.kind=qa, task=squad)")

    def check_metrics(self, names: list[str], task: Any) -> list[str]:
        """The requested metric names without duplicates; ValueError naming the valid ones."""
        raise NotImplementedError

    def check_data(self, task: Any) -> None:
        """A cheap look at the configured data (files exist, the hub is reachable)."""

    # ---- data
    def load_data(self, cfg: Any, tokenizer: Any, tok_hash: str, plans: list[Any], spans: Any = None) -> KindData:
        """Load and tokenise the task's splits for a run (``spans``: MGSKD's span extractor or None)."""
        raise NotImplementedError

    def load_raw(self, task: Any, seed: int | None = None) -> Any:
        """The task's splits as rows (a datasets.DatasetDict), for the teacher's own training rows."""
        raise ConfigError(f"task.kind={self.name}: its rows cannot be loaded on their own")

    def collator(self, tokenizer: Any, task: Any, pad_to_max_length: bool) -> Any:
        """The batch collator of the kind's tokenised rows (padding to task.max_seq_length when asked)."""
        raise NotImplementedError

    def tokenize(self, raw: Any, tokenizer: Any, task: Any) -> Any:
        """Tokenise ``raw`` (a DatasetDict) without caching (the teacher's own training rows)."""
        raise ConfigError(f"task.kind={self.name}: its rows cannot be tokenised on their own")

    # ---- models
    def head(self, plans: list[Any], role: str) -> str:
        """The model head ``role`` (teacher or student) is loaded with: a key of kdrun.models.loading.HEADS."""
        return "classification"

    def pretrained_teacher(self, cfg: Any, ref: str | None, plans: list[Any], tokenizer: Any, need_attn: bool) -> Any:
        """The teacher as it is (kinds with fine_tunes_teacher = False)."""
        raise NotImplementedError

    # ---- evaluation
    def metric_fn(self, task: Any, eval_data: dict[str, Any]) -> Callable | dict[str, Callable] | None:
        """``(logits, labels) -> metrics`` (or one per eval split); None when ``evaluator`` scores instead."""
        raise NotImplementedError

    def evaluator(self) -> Callable | None:
        """``(parts, model, stage) -> {split: metrics}`` replacing logits + metric_fn, or None."""
        return None

    def baseline(self, task: Any, train: Any, evals: dict[str, Any]) -> dict[str, Any] | None:
        """The score of a constant prediction (kdrun.tasks.baselines), or None where it has no meaning."""
        return None

    def model_config(self, task: Any) -> dict[str, Any]:
        """Attributes of the saved student's ``config.json`` that describe its outputs (e.g. the class
        names, so that ``pipeline()`` answers with them); none by default."""
        return {}

    # ---- the shape of the kind's logits
    def join_logits(self, batches: list[Any]) -> Any:
        """A split's logits from its batches' logits, in order (one row per example)."""
        import torch

        return torch.cat(batches)

    def batch_logits(self, rows: Any, batch: dict[str, Any]) -> Any:
        """A batch's rows of the teacher's logit table (as :meth:`join_logits` made it) as the logits
        the teacher would give that batch."""
        return rows


def register_task_kind(kind: TaskKind) -> TaskKind:
    """Make ``kind`` available as ``task.kind=<kind.name>`` (a later registration of the same name replaces it)."""
    if not kind.name:
        raise ValueError(f"{type(kind).__name__} has no name")
    _KINDS[kind.name] = kind
    return kind


def _load_entry_points() -> None:
    global _LOADED
    if _LOADED:
        return
    import_entry_point_modules(ENTRY_POINT_GROUP, "task kind")
    _LOADED = True


def import_task_modules(modules: Any, where: str = "task.imports") -> None:
    """Import the modules a task config lists (their ``register_task_kind`` calls run)."""
    import_listed_modules(modules, where, ConfigError)


def task_kinds() -> dict[str, TaskKind]:
    """Every registered kind by name."""
    _load_entry_points()
    return dict(_KINDS)


# Former names of kinds, accepted with a warning for one release: old name -> name.
DEPRECATED_KINDS = {"corpus": "general"}


def get_task_kind(name: str) -> TaskKind:
    kinds = task_kinds()
    if name in DEPRECATED_KINDS and name not in kinds:
        from kdrun.runtime.deprecation import deprecated

        deprecated(f"task.kind={name}", f"task.kind={DEPRECATED_KINDS[name]}")
        name = DEPRECATED_KINDS[name]
    if name not in kinds:
        raise ConfigError(f"task.kind='{name}' must be one of {', '.join(sorted(kinds))} (a new kind registers "
                          "itself with kdrun.tasks.kinds.register_task_kind; see the documentation, "
                          "'Extending kdrun')")
    return kinds[name]


def kind_of(task: Any) -> TaskKind:
    """The kind of a task config (typed, a DictConfig or a plain dict from a results.json)."""
    if isinstance(task, dict):
        import_task_modules(task.get("imports"))
        return get_task_kind(task.get("kind") or "classification")
    import_task_modules(getattr(task, "imports", None))
    return get_task_kind(getattr(task, "kind", None) or "classification")


def metric_sign(metric: str) -> float:
    """+1 for a metric where higher is better, -1 for a loss: sign * value is always 'higher is better'
    (model selection in the trainer, the best setting in kdrun-report)."""
    return -1.0 if any(metric in k.lower_is_better for k in task_kinds().values()) else 1.0
