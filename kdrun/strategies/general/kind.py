"""The ``general`` task kind: raw text for general (task-agnostic) distillation (``task=wikipedia``,
``task=text_corpus``). No labels: the pre-trained teacher is used as it is, the student learns from
its representations only and is scored by the distillation loss on held-out documents."""

from __future__ import annotations

from typing import Any

from kdrun.strategies.general import CORPUS_METRICS, check_corpus_config, head_for, uses_mlm
from kdrun.tasks.kinds import KindData, TaskKind, register_task_kind


class GeneralKind(TaskKind):
    name = "general"
    fine_tunes_teacher = False
    lower_is_better = frozenset(CORPUS_METRICS)

    def check_config(self, cfg: Any, plans: list[Any]) -> None:
        super().check_config(cfg, plans)
        check_corpus_config(cfg, plans)

    def check_metrics(self, names: list[str], task: Any) -> list[str]:
        names = [names] if isinstance(names, str) else list(names)
        if not names or any(name not in CORPUS_METRICS for name in names):
            raise ValueError(f"Metric(s) {names} do not apply to a corpus task; use {list(CORPUS_METRICS)} "
                             "(the held-out distillation loss)")
        return list(dict.fromkeys(names))

    def check_data(self, task: Any) -> None:
        from kdrun.tasks.data.corpus import corpus_files

        corpus_files(task.data_files)

    def load_data(self, cfg: Any, tokenizer: Any, tok_hash: str, plans: list[Any], spans: Any = None) -> KindData:
        from kdrun.strategies.general.data import CorpusCollator, load_corpus

        train, validation, data_hash, _ = load_corpus(cfg.task, tokenizer, tok_hash, cfg.cache_dir)
        mlm = uses_mlm(plans)
        collator = CorpusCollator(tokenizer.pad_token_id, tokenizer.mask_token_id if mlm else None, len(tokenizer),
                                  cfg.task.mlm_probability, seed=cfg.train.seed,
                                  pad_to=cfg.task.max_seq_length if cfg.train.pad_to_max_length else None)
        return KindData(data_hash, None, train, {"validation": validation}, collator)

    def head(self, plans: list[Any], role: str) -> str:
        """The bare encoder, or with its masked-LM head when a term reads its distribution."""
        return head_for(plans, role)

    def pretrained_teacher(self, cfg: Any, ref: str | None, plans: list[Any], tokenizer: Any, need_attn: bool) -> Any:
        from kdrun.strategies.general.models import general_teacher

        return general_teacher(cfg, ref, head_for(plans, "teacher"), len(tokenizer), tokenizer.pad_token_id,
                               need_attn)

    def metric_fn(self, task: Any, eval_data: dict[str, Any]) -> Any:
        return None

    def evaluator(self) -> Any:
        from kdrun.strategies.general.evaluate import heldout_losses

        return heldout_losses


register_task_kind(GeneralKind())
