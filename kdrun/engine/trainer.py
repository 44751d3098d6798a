"""The stage loop: batches → features → weighted loss terms → optimizer step; evaluation, checkpoints.

Kept short on purpose. Accelerate gives device placement, mixed precision and gradient
accumulation; everything objective-specific lives in the loss terms.

The step itself is kdrun.engine.step, evaluation kdrun.engine.evaluation, the meters and the
non-finite watch kdrun.engine.meters, the DDP wrapper kdrun.engine.ddp; their public names are
importable from here too.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
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
from kdrun.engine.ddp import ddp_settings, leaves_parameters_unused, wrap_for_stage
from kdrun.engine.evaluation import LogitTable, _teacher_logit_table, evaluate, main_score, predict, to_device
from kdrun.engine.grad_shares import grad_share_logs
from kdrun.engine.meters import FiniteWatch, TrainingDiverged, _Meter
from kdrun.engine.objective import StagePlan
from kdrun.engine.optim import build_optimizer, build_scheduler, stage_optim
from kdrun.engine.run_parts import RunParts
from kdrun.engine.step import (
    PlainStep,
    StageLoop,
    _is_log_step,
    backward,
    ignore_unused_parameters,
    objective_loss,
    optimizer_step,
    teacher_features,
    train_step,
)
from kdrun.engine.strategies import strategy_of
from kdrun.runtime.preemption import Interrupted
from kdrun.runtime.syncs import host_section
from kdrun.tasks.data.batches import make_loader, resolve_num_workers


class SimulatedInterrupt(Interrupted):
    """Raised by ``train.stop_after_steps`` to imitate a killed job (testing aid)."""


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


def setup_stage(parts: RunParts, plan: StagePlan, state: TrainState, resume_from: Path | None) -> StageLoop:
    """The stage's loader, optimizer and schedule, restored from ``resume_from`` when resuming."""
    acc, cfg, tcfg = parts.accelerator, plan.cfg, parts.train_cfg
    train_data = parts.augmented_data if cfg["data"] == "augmented" else parts.train_data
    if train_data is None:
        raise RuntimeError(f"stage '{plan.name}' trains on augmented data but none was built")
    from kdrun.engine.compiled import stage_forward
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
    label = f"stage {plan.index}:{plan.name}" if parts.role == "student" else f"{parts.role}: {plan.name}"
    pbar = tqdm(total=total_steps, initial=state.stage_step, desc=label,
                disable=not acc.is_main_process, dynamic_ncols=True, mininterval=2.0)
    return StageLoop(plan, loader, sampler, optimizer, scheduler, batches_per_epoch, total_steps,
                     num_epochs=math.ceil(total_steps / steps_per_epoch), pbar=pbar, log_every=max(1, parts.log_every),
                     teacher_table=table, store=store, strategy=step or PlainStep(), meter=meter,
                     share_params=[p for p in parts.student.parameters() if p.requires_grad] if measure else None,
                     probe_unused=probe, watch=FiniteWatch(world_size=parts.world_size),
                     forward=stage_forward(parts, plan, strategy))


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
    logs = {f"train/{k}": v for k, v in m.means().items()}
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
        result = {"stage": plan.name, "steps": state.stage_step, "metrics": last["metrics"],
                  "best_metric": state.best_metric if state.best_stage == plan.index else None}
        learnt = parts.objective.log_values(plan.index)
        if learnt:  # a learnable or attention map's final weights (and α's entropy), as logged
            result["map"] = learnt
        forward = getattr(loop, "forward", None)
        if forward is not None:  # how its steps ran; the graphs compiled (this process's part of the stage)
            result.update(step_mode=forward.mode, compilations=forward.compilations, graph_breaks=forward.graph_breaks)
        state.stage_results.append(result)
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


def train_resumably(parts: RunParts, plans: list[StagePlan], directory: Path, identity: str, *,
                    accelerator: Any = None, resume: bool = True,
                    on_resume: Callable[[TrainState, Path], None] | None = None,
                    on_fresh: Callable[[], None] | None = None,
                    progress: dict[str, Any] | None = None) -> TrainState:
    """Every stage of ``plans`` in order under a preemption guard, continuing from the checkpoint in
    ``directory`` (checkpoints/last) when ``resume`` and it belongs to ``identity``; a signal
    checkpoints at the next step and stops. The student's stages and the teacher's fine-tuning both
    train through here. ``on_resume`` / ``on_fresh``: the caller's own start (a message, the metrics
    log, per-process seeds); ``progress["state"]``: how far it got, for error.json."""
    from kdrun.runtime.preemption import PreemptionGuard

    state = load_checkpoint_state(directory, identity, accelerator) if resume else None
    ckpt = checkpoint_dir(directory)
    if state is not None:
        restore_models(parts, ckpt)
        if on_resume is not None:
            on_resume(state, ckpt)
    else:
        state = TrainState()
        if on_fresh is not None:
            on_fresh()
    if progress is not None:
        progress["state"] = state
    resume_from = ckpt if state.global_step > 0 or state.stage > 0 else None
    with PreemptionGuard() as guard:
        parts.guard = guard
        for plan in plans[state.stage:]:
            run_stage(parts, plan, state, resume_from)
            resume_from = None
    parts.guard = None
    return state


__all__ = [
    "RunParts", "TrainState", "TrainingDiverged", "SimulatedInterrupt", "Interrupted", "run_stage", "evaluate",
    "seed_everything", "load_checkpoint_state", "checkpoint_dir", "restore_models", "finalize_best",
    "predict", "grad_share_logs", "make_optimizer", "make_scheduler", "setup_stage", "train_step", "after_step",
    # from the modules the stage loop is built of (kdrun.engine.step, evaluation, meters, ddp)
    "to_device", "main_score", "LogitTable", "FiniteWatch", "PlainStep", "StageLoop", "teacher_features",
    "objective_loss", "backward", "optimizer_step", "ignore_unused_parameters", "leaves_parameters_unused",
    "ddp_settings", "wrap_for_stage", "evaluate_stage", "finish_stage", "train_resumably",
]
