"""Evaluation of a general student: the distillation loss on the corpus's held-out segments."""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def heldout_losses(parts: Any, model: Any, stage: int | None = None) -> dict[str, dict[str, float]]:
    """{split: {"distill_loss": weighted total, <term>: unweighted value}}, each the mean over the
    split's segments of the objective's loss for stage ``stage`` (default: the last stage), with the
    same masks as in training and, as in training, the objective computed in fp32 outside autocast
    (the kept model is selected on it). Lower is better; the trainer negates ``distill_loss`` to select."""
    from kdrun.engine.trainer import to_device
    from kdrun.models.features import extract_features
    from kdrun.tasks.data.batches import make_loader

    acc = parts.accelerator
    objective = parts.objective
    plan = objective.plans[len(objective.plans) - 1 if stage is None else stage]
    model = acc.unwrap_model(model)
    model.eval()
    out = {}
    for split, data in parts.eval_data.items():
        loader, _ = make_loader(data, parts.train_cfg.eval_batch_size, parts.collator, seed=0, train=False,
                                rank=parts.rank, world_size=parts.world_size)
        sums = torch.zeros(len(plan.terms) + 2, dtype=torch.float64)  # terms..., total, segments
        for batch in loader:
            batch = to_device(batch, acc.device)
            with acc.autocast():  # the models in the training precision, the objective in fp32 outside
                s = extract_features(model, batch, plan.student_needs)  # autocast: as in training
                t = extract_features(parts.teacher, batch, plan.teacher_needs) if plan.uses_teacher else None
            with torch.autocast(device_type=acc.device.type, enabled=False):
                loss, values = objective(plan.index, s, t, batch)
            n = float(batch["input_ids"].shape[0])
            sums += torch.tensor([*(float(values[term.key]) * n for term in plan.terms), float(loss) * n, n],
                                 dtype=torch.float64)
        if parts.world_size > 1:
            import torch.distributed as dist

            sums = sums.to(acc.device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        n = max(float(sums[-1]), 1.0)
        out[split] = {"distill_loss": float(sums[-2]) / n,
                      **{term.key: float(sums[i]) / n for i, term in enumerate(plan.terms)}}
    return out
