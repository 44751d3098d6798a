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
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from kdrun.engine.checkpoints import (
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
from kdrun.engine.grad_shares import grad_share_logs
from kdrun.engine.objective import Objective, StagePlan
from kdrun.engine.optim import build_optimizer, build_scheduler, stage_optim
from kdrun.engine.parts import RunParts
from kdrun.engine.strategies import strategy_of
from kdrun.errors import UserError
from kdrun.models.features import Features, extract_features, model_inputs, output_logits
from kdrun.runtime.preemption import Interrupted
from kdrun.runtime.syncs import host_section
from kdrun.tasks.data.pipeline import make_loader, resolve_num_workers


class TrainingDiverged(UserError, RuntimeError):
    """A loss became NaN or infinite; the last good checkpoint is kept."""


class SimulatedInterrupt(Interrupted):
    """Raised by ``train.stop_after_steps`` to imitate a killed job (testing aid)."""


# ----------------------------------------------------------------------------------------- helpers

def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


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
        batch = to_device(batch, accelerator.device)
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


def _is_log_step(stage_step: int, every: int, total_steps: int) -> bool:
    return stage_step % every == 0 or stage_step == total_steps


def _stop_requested(parts: RunParts, at_log_step: bool) -> bool:
    """Whether a termination signal arrived. One process reads its own flag every step; several
    agree at logging steps only (an all-reduce and a host read), so all of them stop at the same step."""
    if parts.guard is None:
        return False
    flag = parts.guard.pending
    if parts.world_size > 1:
        if not at_log_step:
            return False
        import torch.distributed as dist

        with host_section():
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
class LogitTable:
    """Teacher logits for every training row, looked up by the rows' ``idx`` on the device (a row's
    ``idx`` need not be its position: a corpus subsample keeps the original ones)."""

    def __init__(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        self.sorted_ids, order = torch.sort(ids.to(logits.device))
        self.logits = logits[order]

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits[torch.searchsorted(self.sorted_ids, idx.to(self.sorted_ids.device))]


def _teacher_logit_table(parts: RunParts, plan: StagePlan) -> LogitTable:
    """Teacher logits for every training row (the data are fixed across epochs)."""
    parts.teacher.eval()
    logits, _ = predict(parts.teacher, parts.train_data, parts.collator, parts.train_cfg.eval_batch_size,
                        parts.accelerator, desc="teacher logits", world_size=parts.world_size)
    ids = torch.as_tensor(np.asarray(parts.train_data["idx"]), dtype=torch.long)
    return LogitTable(torch.from_numpy(logits).to(parts.accelerator.device), ids)


# ------------------------------------------------------------------------------------ stage setup

@dataclass
class _Meter:
    """Loss values (device tensors: no host read per step), throughput and gradient shares since
    the last log line."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    batches: int = 0
    examples: int = 0
    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)
    shares: dict[str, float] = field(default_factory=dict)

    def add(self, values: dict[str, torch.Tensor], loss: torch.Tensor, examples: int, tokens: int) -> None:
        for k, v in {**values, "loss": loss}.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.batches += 1
        self.examples += examples
        self.tokens += tokens


@dataclass
class FiniteWatch:
    """Whether a loss or term became NaN/inf, kept on the device and read at logging, evaluation and
    checkpoint steps (:meth:`check`), so the training step never waits for the host. A checkpoint
    is never written after a non-finite step: the last one kept is the last good one."""

    keys: list[str] = field(default_factory=list)
    # The processes training this model together (1: alone, also a teacher fine-tuned by one rank of
    # a data-parallel run while the others wait: no collective then).
    world_size: int = 1
    bad: torch.Tensor | None = None  # (1 + terms,) bool: ever non-finite since the stage began
    first_step: torch.Tensor | None = None  # step of the first non-finite loss (-1: none)
    first_values: torch.Tensor | None = None  # the loss and terms at that step

    def add(self, loss: torch.Tensor, values: dict[str, torch.Tensor], step: int) -> None:
        vec = torch.stack([loss.detach().float(), *(v.detach().float().reshape(()) for v in values.values())])
        now = ~torch.isfinite(vec)
        if self.bad is None or len(self.keys) != vec.numel():
            self.keys = ["total (weighted sum)", *values]
            self.bad, self.first_values = now, vec
            self.first_step = torch.full((), -1, dtype=torch.long, device=vec.device)
        new = now.any() & (self.first_step < 0)
        self.first_step = torch.where(new, torch.tensor(step), self.first_step)
        self.first_values = torch.where(new, vec, self.first_values)
        self.bad = self.bad | now

    def check(self, plan: StagePlan, run_dir: Path) -> None:
        """Raise :class:`TrainingDiverged` naming the stage, step and terms (a host read). With several
        processes every rank raises at the same check when any rank saw a non-finite value (the check
        steps are the same on every rank), so none is left waiting in the next all-reduce."""
        with host_section():
            elsewhere = self._agree()
            if elsewhere is not None:
                step, rank = elsewhere
                raise TrainingDiverged(
                    f"stage '{plan.name}': the loss became non-finite at step {step} on process {rank} (its log "
                    f"names the terms); every process stops. The last good checkpoint is kept in "
                    f"{checkpoint_dir(run_dir)}; lower the lr or the term's weight, or check the inputs.")
            if self.bad is None or not bool(self.bad.any()):
                return
            bad = self.bad.tolist()
            terms = [k for k, b in zip(self.keys[1:], bad[1:]) if b] or [self.keys[0]]
            shown = {k: float(v) for k, v in zip(self.keys, self.first_values.tolist())}
            step = int(self.first_step)
        raise TrainingDiverged(
            f"stage '{plan.name}': loss term(s) {', '.join(terms)} became non-finite at step {step} "
            f"(values: {shown}). The last good checkpoint is kept in {checkpoint_dir(run_dir)}; lower the "
            "lr or the term's weight, or check the inputs.")


    def _agree(self) -> tuple[int, int] | None:
        """Several processes: (first step, lowest rank) of a non-finite value seen on another rank while
        this one saw none; None when this rank saw one itself, when none did, or with one process."""
        import torch.distributed as dist

        if self.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        device = self.bad.device if self.bad is not None else (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu"))
        mine = self.bad is not None and bool(self.bad.any())
        none = -float(2**62)
        vec = torch.tensor([-float(self.first_step) if mine else none, -float(dist.get_rank()) if mine else none],
                           dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)  # max of -x: the first step and the lowest rank
        if mine or vec[0].item() == none:
            return None
        return int(-vec[0].item()), int(-vec[1].item())


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


def setup_stage(parts: RunParts, plan: StagePlan, state: TrainState, resume_from: Path | None) -> StageLoop:
    """The stage's loader, optimizer and schedule, restored from ``resume_from`` when resuming."""
    acc, cfg, tcfg = parts.accelerator, plan.cfg, parts.train_cfg
    train_data = parts.augmented_data if cfg["data"] == "augmented" else parts.train_data
    if train_data is None:
        raise RuntimeError(f"stage '{plan.name}' trains on augmented data but none was built")
    from kdrun.engine.teacher_store import StoreCollator, open_stage_store

    strategy = strategy_of(plan.cfg)  # the stage's strategy, or None for plain steps
    step = strategy.start(parts, plan, state) if strategy is not None else None
    store = open_stage_store(parts, plan, train_data, strategy, state)
    loader, sampler = make_loader(
        train_data, cfg["batch_size"], StoreCollator(parts.collator, store) if store else parts.collator,
        seed=tcfg.seed + 1000 * plan.index, train=True,
        group_by_length=tcfg.group_by_length, num_workers=resolve_num_workers(tcfg.num_workers, acc.device.type),
        pin_memory=acc.device.type == "cuda", rank=parts.rank, world_size=parts.world_size,
    )
    probe = wrap_for_stage(parts, plan, strategy)
    batches_per_epoch = len(sampler.batches())
    steps_per_epoch = max(1, batches_per_epoch // tcfg.gradient_accumulation_steps)
    total_steps = max(1, math.ceil(cfg["epochs"] * steps_per_epoch))
    optimizer = make_optimizer(parts, plan)  # the stage's own; the run's one scaler unscales it
    if parts.objective.balancer is not None:  # GradNorm measures the terms' gradients on the last layer
        from kdrun.models.loading import encoder_layers

        last = encoder_layers(acc.unwrap_model(parts.student))[-1]
        parts.objective.balance_params = [p for p in last.parameters() if p.requires_grad]
        # under fp16 its per-term gradients are measured scaled, like the training backward
        parts.objective.balancer.grad_scale = lambda: acc.precision.scale_tensor(acc.device)
    scheduler = make_scheduler(plan, tcfg, optimizer, total_steps)
    meter = _Meter()
    if resume_from is not None:
        saved = load_optim_rng(resume_from, optimizer, scheduler, rank=parts.rank, precision=acc.precision)
        if saved is not None:  # the log interval the checkpoint cut: its losses so far
            meter.sums = {k: v.to(acc.device) for k, v in saved["sums"].items()}
            meter.batches = int(saved["batches"])
    table = None
    if (store is None and plan.uses_teacher and plan.teacher_logits_only and tcfg.cache_teacher_logits
            and cfg["data"] == "original" and not (strategy is not None and strategy.teacher_live)):
        table = _teacher_logit_table(parts, plan)
    measure = getattr(parts.tracker, "grad_shares", False)
    pbar = tqdm(total=total_steps, initial=state.stage_step, desc=f"stage {plan.index}:{plan.name}",
                disable=not acc.is_main_process, dynamic_ncols=True, mininterval=2.0)
    return StageLoop(plan, loader, sampler, optimizer, scheduler, batches_per_epoch, total_steps,
                     num_epochs=math.ceil(total_steps / steps_per_epoch), pbar=pbar, log_every=max(1, parts.log_every),
                     teacher_table=table, store=store, strategy=step or PlainStep(), meter=meter,
                     share_params=[p for p in parts.student.parameters() if p.requires_grad] if measure else None,
                     probe_unused=probe, watch=FiniteWatch(world_size=parts.world_size))


def leaves_parameters_unused(plan: StagePlan, strategy: Any = None) -> bool:
    """Whether the stage's loss can leave some of the student's parameters without a gradient (DDP
    must then search for them): unless some term reads the task head's logits (the whole network up
    to the head is then in the graph), or when the stage's strategy says so (``strategy``: the
    stage's strategy or None)."""
    varies = strategy is not None and strategy.leaves_parameters_unused
    return varies or not any(t.spec.reads_logits for t in plan.terms) or not plan.terms


def ddp_settings(plan: StagePlan, strategy: Any, train_cfg: Any) -> tuple[bool, bool]:
    """(``find_unused_parameters``, ``probe``) of the stage's DDP wrapper.

    ``find_unused_parameters=True`` makes DDP search the autograd graph for parameters without a
    gradient at every step and read the used-parameter map back to the host (a sync on CUDA). A
    stage whose loss leaves the same parameters unused at every step (an intermediate-layer stage:
    the task head is computed but never in the loss) has a static graph: its unused parameters are
    found once, on the stage's first batch (``probe``, :func:`ignore_unused_parameters`), DDP is
    told to ignore them and runs without the search. DDP's own ``static_graph`` cannot be used
    there: it counts every parameter that feeds any output of the forward (the head's logits) as
    used. A strategy whose steps run several different forward passes (sub-networks) keeps the
    per-step search. ``train.find_unused_parameters`` forces the search on or off (no probe)."""
    forced = getattr(train_cfg, "find_unused_parameters", None)
    if forced is not None:
        return bool(forced), False
    if not leaves_parameters_unused(plan, strategy):
        return False, False
    return True, not (strategy is not None and strategy.leaves_parameters_unused)


def _ddp_ignored(wrapper: Any) -> set[str]:
    return set(getattr(wrapper, "parameters_to_ignore", None) or ())


def _ddp_wrap(parts: RunParts, find_unused: bool, ignore: list[str]) -> None:
    """(Re)wrap the student in DDP unless the current wrapper has these settings; ``ignore``: names of
    parameters DDP leaves alone (they get no gradient in this stage)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(parts.student, DDP) and parts.student.find_unused_parameters == find_unused \
            and _ddp_ignored(parts.student) == set(ignore):
        return
    module = parts.accelerator.unwrap_model(parts.student)
    if isinstance(parts.student, DDP):  # the previous stage's wrapper stops reducing gradients
        parts.student.reducer._remove_autograd_hooks()
    module._ddp_params_and_buffers_to_ignore = list(ignore)  # what DDP reads (a later stage: none)
    for name, p in module.named_parameters():
        p._ddp_ignored = name in ignore
    cuda = parts.accelerator.device.type == "cuda"
    parts.student = DDP(module, device_ids=[parts.accelerator.local_process_index] if cuda else None,
                        find_unused_parameters=find_unused, broadcast_buffers=False)


def wrap_for_stage(parts: RunParts, plan: StagePlan, strategy: Any = None) -> bool:
    """With several processes, (re)wrap the student in DDP with the stage's :func:`ddp_settings`
    (a new wrapper only when they change). True when the stage's first batch should find the
    unused parameters (:func:`ignore_unused_parameters`)."""
    if parts.world_size <= 1:
        return False
    find_unused, probe = ddp_settings(plan, strategy, parts.train_cfg)
    _ddp_wrap(parts, find_unused, [])
    return probe


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


# ------------------------------------------------------------------------------------------ the step
#
# One engine for every objective, device and precision. A step is: the stage's strategy runs one
# or more forward passes (PlainStep: the student once; a stage strategy's loop: e.g. every
# sub-network) and gives each pass's loss to ``backward``; at an accumulation boundary
# ``optimizer_step`` averages the objective's gradients across processes, unscales once, clips and
# steps. Models run under autocast; the objective runs outside it, so every term computes in fp32.
# Nothing in a step reads a device value on the host: meters and the non-finite check stay on the
# device and are read at logging, evaluation and checkpoint steps (kdrun.runtime.syncs.host_section).

def teacher_features(parts: RunParts, loop: StageLoop, batch: dict[str, Any]) -> Features | None:
    """The frozen teacher's features for ``batch`` (from the stage's logit table when cached);
    under ``no_grad`` (not inference mode), so they join the student's graph without copies."""
    if not loop.plan.uses_teacher:
        return None
    if loop.store is not None:
        return loop.store.features(batch, loop.plan.teacher_needs)
    if loop.teacher_table is not None:
        logits = loop.teacher_table[batch["idx"]]
        if logits.dim() == 3:  # QA: the table is as wide as the widest window, the batch as its own
            logits = logits[:, : batch["attention_mask"].shape[1]]
        return Features(logits=logits, attention_mask=batch["attention_mask"])
    with torch.no_grad(), parts.accelerator.autocast():
        return extract_features(parts.teacher, batch, loop.plan.teacher_needs)


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
        """Yield (loss, values) of each forward pass; the engine runs ``backward`` on each loss."""
        acc = parts.accelerator
        logged = acc.sync_gradients and _is_log_step(state.stage_step + 1, loop.log_every, loop.total_steps)
        weighted = {} if loop.share_params and logged else None
        with acc.autocast():
            s_feats = extract_features(parts.student, batch, loop.plan.student_needs)
        t_feats = teacher_features(parts, loop, batch)
        loss, values = objective_loss(parts, loop, batch, state, s_feats, t_feats, weighted=weighted)
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


# ------------------------------------------------------------------------------------- bookkeeping

def _global_counts(parts: RunParts, examples: int, tokens: int) -> tuple[int, int]:
    """Examples and tokens since the last log line summed over the processes (one all-reduce at a
    logging step, which every process reaches at the same step): the logged throughput is the run's,
    not rank 0's share of it."""
    if parts.world_size <= 1:
        return examples, tokens
    import torch.distributed as dist

    counts = torch.tensor([float(examples), float(tokens)], dtype=torch.float64, device=parts.accelerator.device)
    dist.all_reduce(counts)
    total = counts.tolist()
    return int(total[0]), int(total[1])


def _log(parts: RunParts, loop: StageLoop, state: TrainState) -> None:
    """Log the mean losses, lr, throughput and gradient shares since the last log line; start over.
    The one place the step's device-side meters are read."""
    m = loop.meter
    dt = max(time.perf_counter() - m.since, 1e-9)
    logs = {f"train/{k}": float(v) / m.batches for k, v in m.sums.items()}
    examples, tokens = _global_counts(parts, m.examples, m.tokens)
    logs.update({"train/lr": loop.scheduler.get_last_lr()[0], "train/examples_per_s": examples / dt,
                 "train/tokens_per_s": tokens / dt, "stage": loop.plan.name,
                 "epoch": state.epoch + state.batch_in_epoch / loop.batches_per_epoch})
    if parts.accelerator.precision.scaler is not None:
        logs["train/loss_scale"] = parts.accelerator.precision.loss_scale()
    logs.update({f"objective/{k}": v for k, v in parts.objective.log_values(loop.plan.index).items()})
    logs.update(m.shares)
    parts.tracker.log(logs, step=state.global_step)
    loop.pbar.set_postfix(loss=f"{logs['train/loss']:.4f}")
    loop.meter = _Meter()


def evaluate_stage(parts: RunParts, plan: StagePlan, state: TrainState, tag: str) -> None:
    """Evaluate the student on dev, record and log it, and keep it when it is the best so far (and
    strictly better than ``parts.selection_threshold`` when set)."""
    from kdrun.tasks.kinds import metric_sign

    results = evaluate(parts, parts.student, plan.index)
    score = main_score(parts, results)
    floor = parts.selection_threshold
    eligible = floor is None or score > metric_sign(parts.main_metric) * float(floor)
    state.evals.append({"stage": plan.name, "step": state.global_step, "stage_step": state.stage_step, "at": tag,
                        "metrics": results})
    flat = {f"eval/{split}/{k}": v for split, m in results.items() for k, v in m.items()}
    parts.tracker.log({"stage": plan.name, **flat}, step=state.global_step)
    if plan.cfg.get("select_best", True) and eligible and (state.best_metric is None or state.best_stage != plan.index
                                                           or score > state.best_metric):
        state.best_metric, state.best_stage, state.best_step = score, plan.index, state.global_step
        save_best(parts, state)
    parts.student.train()


def after_step(parts: RunParts, loop: StageLoop, state: TrainState) -> bool:
    """Log, evaluate, checkpoint or stop after an optimizer step; True when the stage is done. Only
    steps that log, evaluate or checkpoint read device values (the non-finite watch first)."""
    tcfg, eval_every, ckpt_every = parts.train_cfg, loop.plan.cfg.get("eval_every_steps"), \
        parts.train_cfg.checkpoint_every_steps
    within = state.stage_step < loop.total_steps
    log = _is_log_step(state.stage_step, loop.log_every, loop.total_steps)
    do_eval = bool(eval_every) and state.stage_step % eval_every == 0 and within
    ckpt = bool(ckpt_every) and state.global_step % ckpt_every == 0 and within
    if log or do_eval or ckpt:
        with host_section():
            loop.watch.check(loop.plan, parts.run_dir)
            if log:
                _log(parts, loop, state)
            if do_eval:
                evaluate_stage(parts, loop.plan, state, "steps")
            if ckpt:
                save_checkpoint(parts, state, loop.optimizer, loop.scheduler, parts.accelerator.precision, loop.meter)
    if _stop_requested(parts, at_log_step=log):
        with host_section():
            loop.watch.check(loop.plan, parts.run_dir)
            save_checkpoint(parts, state, loop.optimizer, loop.scheduler, parts.accelerator.precision, loop.meter)
        loop.pbar.close()
        parts.guard.stop()
    if tcfg.stop_after_steps is not None and state.global_step >= tcfg.stop_after_steps:
        loop.pbar.close()
        raise SimulatedInterrupt(f"stopped after {state.global_step} steps (train.stop_after_steps); "
                                 "rerun the same command to resume")
    return not within


def finish_stage(parts: RunParts, loop: StageLoop, state: TrainState) -> None:
    """Evaluate at the stage's end (unless just done), record its result and checkpoint it as finished."""
    plan = loop.plan
    with host_section():
        loop.watch.check(plan, parts.run_dir)
        if (not state.evals or state.evals[-1]["stage_step"] != state.stage_step
                or state.evals[-1]["stage"] != plan.name):
            evaluate_stage(parts, plan, state, "stage_end")
        last = state.evals[-1]
        state.stage_results.append({"stage": plan.name, "steps": state.stage_step, "metrics": last["metrics"],
                                    "best_metric": state.best_metric if state.best_stage == plan.index else None})
        # The next stage starts fresh; the checkpoint below marks this one as finished.
        state.stage += 1
        state.epoch = state.batch_in_epoch = state.stage_step = 0
        save_checkpoint(parts, state, None, None, parts.accelerator.precision)


def _host_batches(loader):
    """The loader's batches, each with its (examples, tokens) counted on the host before the batch
    moves to the device (fetching and collating a batch is host work by design)."""
    with host_section():
        batches = iter(loader)
    while True:
        with host_section():
            batch = next(batches, None)
            if batch is None:
                return
            counts = (int(batch["input_ids"].shape[0]), int(batch["attention_mask"].sum()))
        yield batch, counts


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
        for batch, (examples, tokens) in _host_batches(loop.loader):
            batch = to_device(batch, acc.device)
            loss, values = train_step(parts, loop, batch, state)
            state.batch_in_epoch += 1
            loop.meter.add(values, loss, examples, tokens)
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
            with host_section():
                loop.watch.check(plan, parts.run_dir)
                evaluate_stage(parts, plan, state, "epoch")
    loop.pbar.close()
    finish_stage(parts, loop, state)


__all__ = [
    "RunParts", "TrainState", "TrainingDiverged", "SimulatedInterrupt", "Interrupted", "run_stage", "evaluate",
    "seed_everything", "load_checkpoint_state", "checkpoint_dir", "restore_models", "finalize_best",
    "predict", "grad_share_logs", "make_optimizer", "make_scheduler", "setup_stage", "train_step", "after_step",
]
