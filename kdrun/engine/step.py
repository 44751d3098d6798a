"""The training step: one engine for every objective, device and precision.

A step is: the stage's strategy runs one or more forward passes (PlainStep: the student once; a
stage strategy's loop: e.g. every sub-network) and gives each pass's loss to ``backward``; at an
accumulation boundary ``optimizer_step`` averages the objective's gradients across processes,
unscales once, clips and steps. Models run under autocast; the objective runs outside it, so every
term computes in fp32. Nothing in a step reads a device value on the host: meters and the non-finite
check stay on the device and are read at logging, evaluation and checkpoint steps
(kdrun.runtime.syncs.host_section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kdrun.engine.checkpoints import TrainState
from kdrun.engine.compiled import StepForward, live_teacher
from kdrun.engine.ddp import _average_objective_grads, _ddp_wrap
from kdrun.engine.evaluation import LogitTable
from kdrun.engine.grad_shares import grad_share_logs
from kdrun.engine.meters import FiniteWatch, _Meter
from kdrun.engine.objective import StagePlan
from kdrun.engine.run_parts import RunParts
from kdrun.models.features import Features
from kdrun.runtime.syncs import host_section


def _is_log_step(stage_step: int, every: int, total_steps: int) -> bool:
    return stage_step % every == 0 or stage_step == total_steps


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
    teacher_table: LogitTable | None = None
    # The stage's teacher-output store: batches then carry the teacher's outputs (teacher/*).
    store: Any = None
    # logger.grad_shares: the parameters per-term gradients are measured on (last micro-batch of a logged step).
    share_params: list[torch.Tensor] | None = None
    meter: _Meter = field(default_factory=_Meter)
    watch: FiniteWatch = field(default_factory=FiniteWatch)
    # How a micro-batch becomes forward passes: PlainStep, or the step loop of the stage's strategy
    # (kdrun/engine/strategies.py; e.g. a loop over sub-networks).
    strategy: Any = None
    # Several processes: find the parameters the stage leaves unused on its first batch (ddp_settings).
    probe_unused: bool = False
    # How PlainStep runs the stage's forward region: eager, compiled or graphed (kdrun.engine.compiled).
    forward: Any = None


def stored_teacher(loop: StageLoop, batch: dict[str, Any]) -> Features | None:
    """The teacher's features read for ``batch`` (the stage's teacher-output store or logit table),
    or None when the stage runs the teacher live or uses none."""
    if not loop.plan.uses_teacher:
        return None
    if loop.store is not None:
        return loop.store.features(batch, loop.plan.teacher_needs)
    if loop.teacher_table is not None:
        return Features(logits=loop.teacher_table.for_batch(batch), attention_mask=batch["attention_mask"])
    return None


def teacher_features(parts: RunParts, loop: StageLoop, batch: dict[str, Any]) -> Features | None:
    """The frozen teacher's features for ``batch``: read when stored, else its forward pass."""
    stored = stored_teacher(loop, batch)
    if stored is not None or not loop.plan.uses_teacher:
        return stored
    return live_teacher(parts, loop.plan, batch)


def objective_loss(parts: RunParts, loop: StageLoop, batch: dict[str, Any], state: TrainState,
                   s_feats: Features, t_feats: Features | None, layer_pairs=None,
                   weighted: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The stage's weighted loss (fp32, outside autocast) and its terms' values; recorded by the
    stage's non-finite watch."""
    with torch.autocast(device_type=parts.accelerator.device.type, enabled=False):
        loss, values = parts.objective(loop.plan.index, s_feats, t_feats, batch, step=state.global_step,
                                       weighted=weighted, layer_pairs=layer_pairs)
    loop.watch.add(loss, values, state.global_step + 1)
    return loss, values


class PlainStep:
    """The default strategy: one forward pass of the student per micro-batch."""

    def passes(self, parts: RunParts, loop: StageLoop, batch: dict[str, Any], state: TrainState):
        """Yield (loss, values) of each forward pass; the engine runs ``backward`` on each loss.
        The pass is the stage's region (kdrun.engine.compiled), eager or compiled."""
        acc = parts.accelerator
        logged = acc.sync_gradients and _is_log_step(state.stage_step + 1, loop.log_every, loop.total_steps)
        weighted = {} if loop.share_params and logged else None
        forward = getattr(loop, "forward", None) or StepForward(parts, loop.plan)
        loss, values = forward(batch, stored_teacher(loop, batch), state.global_step, weighted)
        loop.watch.add(loss, values, state.global_step + 1)
        if weighted:  # logger.grad_shares: a logging step, where host reads are allowed
            with host_section():
                loop.meter.shares = grad_share_logs(weighted, loop.share_params, acc.precision.loss_scale())
        yield loss, values

    def combine(self, results: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
        return results[0]


def backward(parts: RunParts, loss: torch.Tensor) -> None:
    """Backward of one pass's loss, scaled for fp16 and divided by the accumulation steps."""
    parts.accelerator.backward(parts.accelerator.precision.scale(loss))


def optimizer_step(parts: RunParts, loop: StageLoop) -> None:
    """At an accumulation boundary: average the objective's gradients across processes, unscale
    once, clip, step (skipped by the fp16 scaler on inf/NaN gradients), zero the gradients."""
    prec = parts.accelerator.precision
    if parts.world_size > 1:
        _average_objective_grads(parts.objective, parts.world_size)
    prec.unscale_(loop.optimizer)
    if parts.train_cfg.max_grad_norm:
        params = [p for p in (*parts.student.parameters(), *parts.objective.parameters()) if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, parts.train_cfg.max_grad_norm)
    prec.step(loop.optimizer)
    loop.optimizer.zero_grad(set_to_none=True)


def train_step(parts: RunParts, loop: StageLoop, batch: dict[str, Any],
               state: TrainState) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch: the strategy's forward passes, each with its backward; at an accumulation
    boundary also the optimizer step. Returns the (detached) loss and the values to log."""
    acc = parts.accelerator
    if getattr(loop, "probe_unused", False):  # first batch of the stage: DDP then ignores what it leaves unused
        loop.probe_unused = False
        ignore_unused_parameters(parts, loop, batch, state)
    with acc.accumulate(parts.student):
        results = []
        for loss, values in loop.strategy.passes(parts, loop, batch, state):
            backward(parts, loss)
            results.append((loss.detach(), values))
        if acc.sync_gradients:
            optimizer_step(parts, loop)
    return loop.strategy.combine(results)


def ignore_unused_parameters(parts: RunParts, loop: StageLoop, batch: dict[str, Any], state: TrainState) -> list[str]:
    """Find the student's parameters the stage's loss does not reach (differentiating the loss of
    ``batch`` once, random state forked so the run's dropout masks are untouched), agree on them
    across processes (unused on every one) and rewrap the student in DDP ignoring them, without the
    per-step search. Returns their names."""
    from kdrun.models.features import extract_features as features_of

    acc, plan = parts.accelerator, loop.plan
    module = acc.unwrap_model(parts.student)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    kept = parts.objective.balance_params
    parts.objective.balance_params = None  # GradNorm must not take this batch as its S_i(0)
    devices = [acc.device] if acc.device.type == "cuda" else []
    try:
        with host_section(), torch.random.fork_rng(devices=devices, device_type=acc.device.type):
            with acc.autocast():
                s_feats = features_of(module, batch, plan.student_needs)
            t_feats = teacher_features(parts, loop, batch)
            with torch.autocast(device_type=acc.device.type, enabled=False):
                loss, _ = parts.objective(plan.index, s_feats, t_feats, batch, step=state.global_step)
            if not loss.requires_grad:  # nothing is trained through the student: keep the search
                return []
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            used = torch.tensor([float(g is not None) for g in grads], device=acc.device)
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(used, op=dist.ReduceOp.MAX)
            unused = [n for (n, _), u in zip(named, used.tolist()) if not u]
    finally:
        parts.objective.balance_params = kept
    _ddp_wrap(parts, False, unused)
    return unused
