"""Evaluation of a model on the eval splits: predictions gathered across processes, the task's metrics,
the selection score, and the teacher's logits for every training row."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from kdrun.engine.objective import StagePlan
from kdrun.engine.run_parts import RunParts
from kdrun.models.features import model_inputs, output_logits
from kdrun.tasks.data.batches import make_loader


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


@torch.inference_mode()
def predict(model: nn.Module, data, collator, batch_size: int, accelerator,
            desc: str = "predict", world_size: int = 1, join=torch.cat) -> tuple[np.ndarray, np.ndarray]:
    """Logits (N, C) and labels (N,) for a tokenised split, in the split's row order (``join``: how the
    task kind joins batches of logits, e.g. per-token logits of different widths).

    With ``world_size`` > 1 every process predicts its slice and the slices are gathered, so all
    processes return the whole split.
    """
    model = accelerator.unwrap_model(model)  # no DDP collectives in evaluation
    model.eval()
    rank = accelerator.process_index if world_size > 1 else 0
    loader, _ = make_loader(data, batch_size, collator, seed=0, train=False, rank=rank, world_size=world_size)
    logits, labels, order = [], [], []
    for batch in tqdm(loader, desc=desc, leave=False, disable=not accelerator.is_main_process or len(loader) < 20,
                      mininterval=2.0, dynamic_ncols=True):
        batch = to_device(batch, accelerator.device)
        with accelerator.autocast():
            out = model(**model_inputs(batch, model))
        logits.append(output_logits(out).float().cpu())
        labels.append(batch["labels"].cpu())
        order.append(batch["idx"].cpu())
    if world_size > 1:
        from accelerate.utils import gather_object

        mine = [(torch.cat(order), join(logits), torch.cat(labels))] if order else []
        parts = gather_object(mine)
        order, logits, labels = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    idx = torch.cat(order)
    perm = torch.argsort(idx)
    return join(logits)[perm].numpy(), torch.cat(labels)[perm].numpy()


def logit_kind(parts: RunParts) -> Any:
    """The run's task kind, for the shape of its logits (the base kind's when the parts name none)."""
    from kdrun.tasks.kinds import TaskKind

    return parts.kind if parts.kind is not None else TaskKind()


def evaluate(parts: RunParts, model: nn.Module, stage: int | None = None) -> dict[str, dict[str, float]]:
    """Metrics per eval split (``stage``: the stage being trained, for evaluators that depend on it)."""
    if parts.evaluator is not None:
        return parts.evaluator(parts, model, stage)
    results = {}
    for split, data in parts.eval_data.items():
        logits, labels = predict(model, data, parts.collator, parts.train_cfg.eval_batch_size, parts.accelerator,
                                 desc=f"eval {split}", world_size=parts.world_size,
                                 join=logit_kind(parts).join_logits)
        metric_fn = parts.metric_fn[split] if isinstance(parts.metric_fn, dict) else parts.metric_fn  # QA: per split
        results[split] = metric_fn(logits, labels)
    return results


def main_score(parts: RunParts, results: dict[str, dict[str, float]]) -> float:
    """The selection score, negated for losses (higher is always better here): the main metric of
    the first eval split, or its sum over ``parts.selection_splits`` when set (MNLI: matched +
    mismatched)."""
    from kdrun.errors import ConfigError
    from kdrun.tasks.kinds import metric_sign

    splits = list(parts.selection_splits or [next(iter(results))])
    missing = [s for s in splits if s not in results]
    if missing:
        raise ConfigError(f"task.selection_splits names {missing}, which are not evaluated; the eval splits are "
                          f"{list(results)} (task.eval_splits)")
    return metric_sign(parts.main_metric) * sum(float(results[s][parts.main_metric]) for s in splits)


class LogitTable:
    """Teacher logits for every training row, looked up by the rows' ``idx`` on the device (a row's
    ``idx`` need not be its position: a corpus subsample keeps the original ones). ``fit``: the task
    kind's batch_logits, which gives a batch its rows as the teacher's logits for that batch."""

    @torch.inference_mode()
    def __init__(self, logits: torch.Tensor, ids: torch.Tensor, fit=None) -> None:
        self.sorted_ids, order = torch.sort(ids.to(logits.device))
        self.logits = logits[order]
        self.fit = fit

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits[torch.searchsorted(self.sorted_ids, idx.to(self.sorted_ids.device))]

    def for_batch(self, batch: dict[str, Any]) -> torch.Tensor:
        """The teacher's logits for ``batch`` (its rows, fitted to the batch by the task kind)."""
        rows = self[batch["idx"]]
        return rows if self.fit is None else self.fit(rows, batch)


def _teacher_logit_table(parts: RunParts, plan: StagePlan) -> LogitTable:
    """Teacher logits for every training row (the data are fixed across epochs)."""
    parts.teacher.eval()
    kind = logit_kind(parts)
    logits, _ = predict(parts.teacher, parts.train_data, parts.collator, parts.train_cfg.eval_batch_size,
                        parts.accelerator, desc="teacher logits", world_size=parts.world_size, join=kind.join_logits)
    ids = torch.as_tensor(np.asarray(parts.train_data["idx"]), dtype=torch.long)
    from kdrun.engine.teacher_store import logits_as_stored

    table = logits_as_stored(parts, plan, torch.from_numpy(logits))  # as a store of the stage serves them
    return LogitTable(table.to(parts.accelerator.device), ids, fit=kind.batch_logits)
