"""The stage loop: batches → features → weighted loss terms → optimizer step; evaluation, checkpoints.

Kept short on purpose. Accelerate gives device placement, mixed precision and gradient
accumulation; everything objective-specific lives in the loss terms.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from kdrun.checkpoints import (
    TrainState,
    checkpoint_dir,
    finalize_best,
    load_checkpoint_state,
    load_optim_rng,
    restore_models,
    save_best,
    save_checkpoint,
    seed_everything,
)
from kdrun.data.pipeline import make_loader
from kdrun.errors import UserError
from kdrun.features import Features, extract_features, model_inputs, output_logits
from kdrun.grad_shares import grad_share_logs
from kdrun.objective import Objective, StagePlan
from kdrun.optim import build_optimizer, build_scheduler, stage_optim
from kdrun.preemption import Interrupted, PreemptionGuard


class TrainingDiverged(UserError, RuntimeError):
    """A loss became NaN or infinite; the last good checkpoint is kept."""


class SimulatedInterrupt(Interrupted):
    """Raised by ``train.stop_after_steps`` to imitate a killed job (testing aid)."""


@dataclass
class RunParts:
    accelerator: Any
    student: nn.Module
    teacher: nn.Module | None
    objective: Objective
    train_data: Any
    eval_data: dict[str, Any]
    collator: Any
    # (logits, labels) -> metrics, or a dict of them per eval split (QA: each split's windows)
    metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]] | dict[str, Callable]
    main_metric: str
    train_cfg: Any
    tracker: Any
    run_dir: Path
    config_hash: str
    log_every: int = 10
    # Data parallelism: this process's rank and the number of processes (1 = not distributed).
    # Every process sees its slice of each global batch; evaluation is gathered on all of them.
    rank: int = 0
    world_size: int = 1
    guard: PreemptionGuard | None = None
    # The tokenised augmented training set, for stages with ``data: augmented``.
    augmented_data: Any = None
    # Replaces prediction + metric_fn: (parts, model, stage index or None) -> {split: metrics}
    # (corpus tasks: the held-out distillation loss, kdrun/general/evaluate.py).
    evaluator: Callable[..., dict[str, dict[str, float]]] | None = None


# ----------------------------------------------------------------------------------------- helpers

def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _clone_features(f: Features) -> Features:
    """Turn inference-mode tensors into ordinary ones so they can take part in autograd graphs."""
    return Features(
        logits=f.logits.clone() if f.logits is not None else None,
        mlm_logits=f.mlm_logits.clone() if f.mlm_logits is not None else None,
        attention_mask=f.attention_mask,
        hidden_states=tuple(h.clone() for h in f.hidden_states) if f.hidden_states is not None else None,
        attentions=tuple(a.clone() for a in f.attentions) if f.attentions is not None else None,
        spans=f.spans,
        extra={k: v.clone() if torch.is_tensor(v) else v for k, v in f.extra.items()},
    )


# -------------------------------------------------------------------------------------- evaluation

@torch.inference_mode()
def predict(model: nn.Module, data, collator, batch_size: int, accelerator,
            desc: str = "predict", world_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Logits (N, C) and labels (N,) for a tokenised split, in the split's row order.

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
        batch = _to_device(batch, accelerator.device)
        with accelerator.autocast():
            out = model(**model_inputs(batch, model))
        logits.append(output_logits(out).float().cpu())
        labels.append(batch["labels"].cpu())
        order.append(batch["idx"].cpu())
    if world_size > 1:
        from accelerate.utils import gather_object

        mine = [(torch.cat(order), _cat_logits(logits), torch.cat(labels))] if order else []
        parts = gather_object(mine)
        order, logits, labels = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    idx = torch.cat(order)
    perm = torch.argsort(idx)
    return _cat_logits(logits)[perm].numpy(), torch.cat(labels)[perm].numpy()


def _cat_logits(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate batches of logits; per-token (B, n, 2) QA logits of batches padded to different
    widths are padded with -inf to the widest."""
    if parts and parts[0].dim() == 3:
        width = max(p.shape[1] for p in parts)
        parts = [torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1]), value=float("-inf")) for p in parts]
    return torch.cat(parts)


def evaluate(parts: RunParts, model: nn.Module, stage: int | None = None) -> dict[str, dict[str, float]]:
    """Metrics per eval split (``stage``: the stage being trained, for evaluators that depend on it)."""
    if parts.evaluator is not None:
        return parts.evaluator(parts, model, stage)
    results = {}
    for split, data in parts.eval_data.items():
        logits, labels = predict(model, data, parts.collator, parts.train_cfg.eval_batch_size, parts.accelerator,
                                 desc=f"eval {split}", world_size=parts.world_size)
        metric_fn = parts.metric_fn[split] if isinstance(parts.metric_fn, dict) else parts.metric_fn  # QA: per split
        results[split] = metric_fn(logits, labels)
    return results


def main_score(parts: RunParts, results: dict[str, dict[str, float]]) -> float:
    """The first split's main metric, negated for losses (higher is always better here)."""
    from kdrun.general import metric_sign

    first = next(iter(results.values()))
    return metric_sign(parts.main_metric) * float(first[parts.main_metric])


# --------------------------------------------------------------------------------------- the stage

def _average_objective_grads(objective: Objective, world_size: int) -> None:
    """The objective's own parameters (projections, layer maps) are not inside the student's DDP
    wrapper, so their gradients are averaged across processes here, in one all-reduce."""
    grads = [p.grad for p in objective.parameters() if p.grad is not None]
    if not grads:
        return
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _loss_scale(acc) -> float:
    scaler = getattr(acc, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None else 1.0


def _is_log_step(stage_step: int, every: int, total_steps: int) -> bool:
    return stage_step % every == 0 or stage_step == total_steps


def _stop_requested(parts: RunParts) -> bool:
    """Whether a termination signal arrived (on any process: all of them stop at the same step)."""
    if parts.guard is None:
        return False
    flag = parts.guard.pending
    if parts.world_size > 1:
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=parts.accelerator.device)
        dist.all_reduce(t)
        anywhere = t.item() > 0
        if anywhere and not flag:  # another process was signalled: stop here too, as for SIGTERM
            parts.guard.received = int(signal.SIGTERM)
        flag = anywhere
    return flag


def make_optimizer(parts: RunParts, plan: StagePlan) -> torch.optim.Optimizer:
    """The stage's optimizer (train.optimizer or its own) over the student's trainable parameters,
    biases and normalisation weights without weight decay, and the objective's own parameters."""
    cfg = plan.cfg
    decay, no_decay = [], []
    for name, p in parts.student.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in name or "norm" in name.lower() else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg["weight_decay"], "lr": cfg["lr"]},
        {"params": no_decay, "weight_decay": 0.0, "lr": cfg["lr"]},
    ]
    obj_params = parts.objective.stage_parameters(plan.index)
    if obj_params:
        groups.append({"params": obj_params, "weight_decay": 0.0, "lr": cfg["objective_lr"] or cfg["lr"]})
    return build_optimizer(groups, stage_optim(cfg, parts.train_cfg)[0], cfg["lr"])


def make_scheduler(plan: StagePlan, train_cfg: Any, optimizer: torch.optim.Optimizer, total_steps: int):
    """The stage's schedule (train.scheduler or its own) after warmup_ratio of the stage's steps."""
    return build_scheduler(stage_optim(plan.cfg, train_cfg)[1], optimizer, int(plan.cfg["warmup_ratio"] * total_steps),
                           total_steps)


@torch.inference_mode()
def _teacher_logit_table(parts: RunParts, plan: StagePlan) -> torch.Tensor:
    """Teacher logits for every training row, indexed by ``idx`` (the data are fixed across epochs)."""
    parts.teacher.eval()
    logits, _ = predict(parts.teacher, parts.train_data, parts.collator, parts.train_cfg.eval_batch_size,
                        parts.accelerator, desc="teacher logits", world_size=parts.world_size)
    return torch.from_numpy(logits).to(parts.accelerator.device)


# ------------------------------------------------------------------------------------ stage setup

@dataclass
class _Meter:
    """Loss values, throughput and gradient shares since the last log line."""

    sums: dict[str, float] = field(default_factory=dict)
    batches: int = 0
    examples: int = 0
    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)
    shares: dict[str, float] = field(default_factory=dict)

    def add(self, values: dict[str, torch.Tensor], loss: torch.Tensor, batch: dict[str, Any]) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.sums["loss"] = self.sums.get("loss", 0.0) + float(loss.detach())
        self.batches += 1
        self.examples += int(batch["input_ids"].shape[0])
        self.tokens += int(batch["attention_mask"].sum())


@dataclass
class StageLoop:
    """One stage's training setup (``setup_stage``) and its log totals."""

    plan: StagePlan
    loader: Any
    sampler: Any
    optimizer: Any
    scheduler: Any
    batches_per_epoch: int
    total_steps: int
    num_epochs: int
    pbar: Any
    log_every: int = 10
    # The teacher's logits for every training row (teacher_logits_only stages, when cached).
    teacher_table: torch.Tensor | None = None
    # logger.grad_shares: the parameters per-term gradients are measured on (last micro-batch of a logged step).
    share_params: list[torch.Tensor] | None = None
    meter: _Meter = field(default_factory=_Meter)
    # DynaBERT's width / depth phases (kdrun/dynabert/train.py): the stage's sub-networks and teacher.
    adaptive: Any = None


def setup_stage(parts: RunParts, plan: StagePlan, state: TrainState, resume_from: Path | None) -> StageLoop:
    """The stage's loader, optimizer and schedule, restored from ``resume_from`` when resuming."""
    acc, cfg, tcfg = parts.accelerator, plan.cfg, parts.train_cfg
    train_data = parts.augmented_data if cfg["data"] == "augmented" else parts.train_data
    if train_data is None:
        raise RuntimeError(f"stage '{plan.name}' trains on augmented data but none was built")
    loader, sampler = make_loader(
        train_data, cfg["batch_size"], parts.collator, seed=tcfg.seed + 1000 * plan.index, train=True,
        group_by_length=tcfg.group_by_length, num_workers=tcfg.num_workers, rank=parts.rank,
        world_size=parts.world_size,
    )
    from kdrun.dynabert.train import start_adaptive

    adaptive = start_adaptive(parts, plan, state)  # None unless the stage sets adaptive.phase
    batches_per_epoch = len(sampler.batches())
    steps_per_epoch = max(1, batches_per_epoch // tcfg.gradient_accumulation_steps)
    total_steps = max(1, math.ceil(cfg["epochs"] * steps_per_epoch))
    optimizer = acc.prepare_optimizer(make_optimizer(parts, plan), device_placement=False)
    scheduler = make_scheduler(plan, tcfg, optimizer, total_steps)
    if resume_from is not None:
        load_optim_rng(resume_from, optimizer, scheduler)
    table = None
    if (plan.uses_teacher and plan.teacher_logits_only and tcfg.cache_teacher_logits and cfg["data"] == "original"
            and adaptive is None):
        table = _teacher_logit_table(parts, plan)
    measure = getattr(parts.tracker, "grad_shares", False)
    pbar = tqdm(total=total_steps, initial=state.stage_step, desc=f"stage {plan.index}:{plan.name}",
                disable=not acc.is_main_process, dynamic_ncols=True, mininterval=2.0)
    return StageLoop(plan, loader, sampler, optimizer, scheduler, batches_per_epoch, total_steps,
                     num_epochs=math.ceil(total_steps / steps_per_epoch), pbar=pbar, log_every=max(1, parts.log_every),
                     teacher_table=table, adaptive=adaptive,
                     share_params=[p for p in parts.student.parameters() if p.requires_grad] if measure else None)


# ------------------------------------------------------------------------------------------ the step

def _teacher_features(parts: RunParts, loop: StageLoop, batch: dict[str, Any]) -> Features | None:
    if not loop.plan.uses_teacher:
        return None
    if loop.teacher_table is not None:
        logits = loop.teacher_table[batch["idx"]]
        if logits.dim() == 3:  # QA: the table is as wide as the widest window, the batch as its own
            logits = logits[:, : batch["attention_mask"].shape[1]]
        return Features(logits=logits, attention_mask=batch["attention_mask"])
    with torch.inference_mode():
        feats = extract_features(parts.teacher, batch, loop.plan.teacher_needs)
    return _clone_features(feats)


def _check_finite(parts: RunParts, plan: StagePlan, state: TrainState, loss: torch.Tensor,
                  values: dict[str, torch.Tensor]) -> None:
    if torch.isfinite(loss):
        return
    bad = [k for k, v in values.items() if not torch.isfinite(v)] or ["total (weighted sum)"]
    raise TrainingDiverged(
        f"stage '{plan.name}': loss term(s) {', '.join(bad)} became non-finite at step "
        f"{state.global_step + 1} (values: { {k: float(v) for k, v in values.items()} }). "
        f"The last good checkpoint is kept in {checkpoint_dir(parts.run_dir)}; lower the lr "
        "or the term's weight, or check the inputs."
    )


def train_step(parts: RunParts, loop: StageLoop, batch: dict[str, Any],
               state: TrainState) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch: forward, weighted loss, backward; at an accumulation boundary also clipping
    and the optimizer step. Returns the loss and the terms' values."""
    if loop.adaptive is not None:  # every sub-network's loss, one update (DynaBERT)
        return loop.adaptive.step(parts, loop, batch, state)
    acc, plan, student = parts.accelerator, loop.plan, parts.student
    with acc.accumulate(student):
        with acc.autocast():
            s_feats = extract_features(student, batch, plan.student_needs)
            t_feats = _teacher_features(parts, loop, batch)
            logged_step = acc.sync_gradients and _is_log_step(state.stage_step + 1, loop.log_every, loop.total_steps)
            weighted = {} if loop.share_params and logged_step else None
            loss, values = parts.objective(plan.index, s_feats, t_feats, batch, step=state.global_step,
                                           weighted=weighted)
        _check_finite(parts, plan, state, loss, values)
        if weighted:
            loop.meter.shares = grad_share_logs(weighted, loop.share_params, _loss_scale(acc))
        acc.backward(loss)
        if acc.sync_gradients and parts.world_size > 1:
            _average_objective_grads(parts.objective, parts.world_size)
        if acc.sync_gradients and parts.train_cfg.max_grad_norm:
            acc.clip_grad_norm_(list(student.parameters()) + list(parts.objective.parameters()),
                                parts.train_cfg.max_grad_norm)
        loop.optimizer.step()  # a no-op between accumulation boundaries (Accelerate's optimizer)
        loop.optimizer.zero_grad(set_to_none=True)
    return loss, values


# ------------------------------------------------------------------------------------- bookkeeping

def _log(parts: RunParts, loop: StageLoop, state: TrainState) -> None:
    """Log the mean losses, lr, throughput and gradient shares since the last log line; start over."""
    m = loop.meter
    dt = max(time.perf_counter() - m.since, 1e-9)
    logs = {f"train/{k}": v / m.batches for k, v in m.sums.items()}
    logs.update({"train/lr": loop.scheduler.get_last_lr()[0], "train/examples_per_s": m.examples / dt,
                 "train/tokens_per_s": m.tokens / dt, "stage": loop.plan.name,
                 "epoch": state.epoch + state.batch_in_epoch / loop.batches_per_epoch})
    logs.update({f"objective/{k}": v for k, v in parts.objective.log_values(loop.plan.index).items()})
    logs.update(m.shares)
    parts.tracker.log(logs, step=state.global_step)
    loop.pbar.set_postfix(loss=f"{logs['train/loss']:.4f}")
    loop.meter = _Meter()


def evaluate_stage(parts: RunParts, plan: StagePlan, state: TrainState, tag: str) -> None:
    """Evaluate the student on dev, record and log it, and keep it when it is the best so far."""
    results = evaluate(parts, parts.student, plan.index)
    score = main_score(parts, results)
    state.evals.append({"stage": plan.name, "step": state.global_step, "stage_step": state.stage_step, "at": tag,
                        "metrics": results})
    flat = {f"eval/{split}/{k}": v for split, m in results.items() for k, v in m.items()}
    parts.tracker.log({"stage": plan.name, **flat}, step=state.global_step)
    if plan.cfg.get("select_best", True) and (state.best_metric is None or state.best_stage != plan.index
                                               or score > state.best_metric):
        state.best_metric, state.best_stage, state.best_step = score, plan.index, state.global_step
        save_best(parts, state)
    parts.student.train()


def after_step(parts: RunParts, loop: StageLoop, state: TrainState) -> bool:
    """Log, evaluate, checkpoint or stop after an optimizer step; True when the stage is done."""
    tcfg, eval_every, ckpt_every = parts.train_cfg, loop.plan.cfg.get("eval_every_steps"), \
        parts.train_cfg.checkpoint_every_steps
    within = state.stage_step < loop.total_steps
    if _is_log_step(state.stage_step, loop.log_every, loop.total_steps):
        _log(parts, loop, state)
    if eval_every and state.stage_step % eval_every == 0 and within:
        evaluate_stage(parts, loop.plan, state, "steps")
    if ckpt_every and state.global_step % ckpt_every == 0 and within:
        save_checkpoint(parts, state, loop.optimizer, loop.scheduler)
    if _stop_requested(parts):
        save_checkpoint(parts, state, loop.optimizer, loop.scheduler)
        loop.pbar.close()
        parts.guard.stop()
    if tcfg.stop_after_steps is not None and state.global_step >= tcfg.stop_after_steps:
        loop.pbar.close()
        raise SimulatedInterrupt(f"stopped after {state.global_step} steps (train.stop_after_steps); "
                                 "rerun the same command to resume")
    return not within


def finish_stage(parts: RunParts, plan: StagePlan, state: TrainState) -> None:
    """Evaluate at the stage's end (unless just done), record its result and checkpoint it as finished."""
    if not state.evals or state.evals[-1]["stage_step"] != state.stage_step or state.evals[-1]["stage"] != plan.name:
        evaluate_stage(parts, plan, state, "stage_end")
    last = state.evals[-1]
    state.stage_results.append({"stage": plan.name, "steps": state.stage_step, "metrics": last["metrics"],
                                "best_metric": state.best_metric if state.best_stage == plan.index else None})
    # The next stage starts fresh; the checkpoint below marks this one as finished.
    state.stage += 1
    state.epoch = state.batch_in_epoch = state.stage_step = 0
    save_checkpoint(parts, state, None, None)


# --------------------------------------------------------------------------------------- the stage

def run_stage(parts: RunParts, plan: StagePlan, state: TrainState, resume_from: Path | None) -> None:
    """Train one stage from ``state`` (fresh or resumed) to its end, evaluating and checkpointing."""
    loop = setup_stage(parts, plan, state, resume_from)
    acc = parts.accelerator
    parts.student.train()
    if parts.teacher is not None:
        parts.teacher.eval()
    while state.epoch < loop.num_epochs and state.stage_step < loop.total_steps:
        loop.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        for batch in loop.loader:
            batch = _to_device(batch, acc.device)
            loss, values = train_step(parts, loop, batch, state)
            state.batch_in_epoch += 1
            loop.meter.add(values, loss, batch)
            if not acc.sync_gradients:
                continue
            loop.scheduler.step()
            state.stage_step += 1
            state.global_step += 1
            loop.pbar.update(1)
            if after_step(parts, loop, state):
                break
        if state.stage_step >= loop.total_steps:
            break
        state.epoch += 1
        state.batch_in_epoch = 0
        if not plan.cfg.get("eval_every_steps"):
            evaluate_stage(parts, plan, state, "epoch")
    loop.pbar.close()
    finish_stage(parts, plan, state)


__all__ = [
    "RunParts", "TrainState", "TrainingDiverged", "SimulatedInterrupt", "Interrupted", "run_stage", "evaluate",
    "seed_everything", "load_checkpoint_state", "checkpoint_dir", "restore_models", "finalize_best",
    "predict", "grad_share_logs", "make_optimizer", "make_scheduler", "setup_stage", "train_step", "after_step",
]
