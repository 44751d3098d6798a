"""The stage loop: batches → features → weighted loss terms → optimizer step; evaluation, checkpoints.

Kept short on purpose. Accelerate gives device placement, mixed precision and gradient
accumulation; everything objective-specific lives in the loss terms.
"""

from __future__ import annotations

import math
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from kdrun.cache import staging_dir, write_json_atomic
from kdrun.data.pipeline import make_loader
from kdrun.errors import ConfigError, UserError
from kdrun.features import Features, extract_features, model_inputs
from kdrun.objective import Objective, StagePlan
from kdrun.preemption import Interrupted, PreemptionGuard


class TrainingDiverged(UserError, RuntimeError):
    """A loss became NaN or infinite; the last good checkpoint is kept."""


class SimulatedInterrupt(Interrupted):
    """Raised by ``train.stop_after_steps`` to imitate a killed job (testing aid)."""


@dataclass
class TrainState:
    """Where training is; saved in every checkpoint (JSON)."""

    stage: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    stage_step: int = 0  # optimizer steps in the current stage
    global_step: int = 0  # optimizer steps over all stages
    best_metric: float | None = None
    best_stage: int | None = None
    best_step: int | None = None
    stage_results: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunParts:
    accelerator: Any
    student: nn.Module
    teacher: nn.Module | None
    objective: Objective
    train_data: Any
    eval_data: dict[str, Any]
    collator: Any
    metric_fn: Callable[[dict[str, np.ndarray], np.ndarray, np.ndarray], dict[str, float]]
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


# ----------------------------------------------------------------------------------------- helpers

def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _clone_features(f: Features) -> Features:
    """Turn inference-mode tensors into ordinary ones so they can take part in autograd graphs."""
    return Features(
        logits=f.logits.clone(),
        attention_mask=f.attention_mask,
        hidden_states=tuple(h.clone() for h in f.hidden_states) if f.hidden_states is not None else None,
        attentions=tuple(a.clone() for a in f.attentions) if f.attentions is not None else None,
        spans=f.spans,
        extra={k: v.clone() if torch.is_tensor(v) else v for k, v in f.extra.items()},
    )


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _state_dict_cpu(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def save_module(module: nn.Module, path: Path) -> None:
    sd = _state_dict_cpu(module)
    # safetensors refuses tensors that share storage (tied embeddings): store clones.
    save_file({k: v.clone() for k, v in sd.items()}, str(path))


def load_module(module: nn.Module, path: Path) -> None:
    module.load_state_dict(load_file(str(path)), strict=True)


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
        logits.append(out.logits.float().cpu())
        labels.append(batch["labels"].cpu())
        order.append(batch["idx"].cpu())
    if world_size > 1:
        from accelerate.utils import gather_object

        mine = [(torch.cat(order), torch.cat(logits), torch.cat(labels))] if order else []
        parts = gather_object(mine)
        order, logits, labels = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    idx = torch.cat(order)
    perm = torch.argsort(idx)
    return torch.cat(logits)[perm].numpy(), torch.cat(labels)[perm].numpy()


def evaluate(parts: RunParts, model: nn.Module) -> dict[str, dict[str, float]]:
    results = {}
    for split, data in parts.eval_data.items():
        logits, labels = predict(model, data, parts.collator, parts.train_cfg.eval_batch_size, parts.accelerator,
                                 desc=f"eval {split}", world_size=parts.world_size)
        results[split] = parts.metric_fn(logits, labels)
    return results


def main_score(parts: RunParts, results: dict[str, dict[str, float]]) -> float:
    first = next(iter(results.values()))
    return float(first[parts.main_metric])


# ------------------------------------------------------------------------------------- checkpoints

def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last"


def save_checkpoint(parts: RunParts, state: TrainState, optimizer, scheduler) -> None:
    """Atomically replace checkpoints/last with the current training state."""
    if not parts.accelerator.is_main_process:
        return
    final = checkpoint_dir(parts.run_dir)
    with staging_dir(final) as tmp:
        save_module(parts.accelerator.unwrap_model(parts.student), tmp / "student.safetensors")
        save_module(parts.objective, tmp / "objective.safetensors")
        torch.save(
            {"optimizer": optimizer.state_dict() if optimizer else None,
             "scheduler": scheduler.state_dict() if scheduler else None,
             "rng": rng_state()},
            tmp / "optim_rng.pt",
        )
        write_json_atomic(tmp / "state.json", {"config_hash": parts.config_hash, **state.to_dict()})


def load_checkpoint_state(run_dir: Path, config_hash: str) -> TrainState | None:
    import json

    ckpt = checkpoint_dir(run_dir)
    if not (ckpt / "state.json").exists():
        return None
    meta = json.loads((ckpt / "state.json").read_text())
    if meta.pop("config_hash") != config_hash:
        raise ConfigError(
            f"{ckpt} belongs to a run with a different configuration; use a new run directory "
            "(hydra.run.dir=...) or resume=false to start over"
        )
    return TrainState(**meta)


def save_best(parts: RunParts, state: TrainState) -> None:
    if not parts.accelerator.is_main_process:
        return
    final = parts.run_dir / "checkpoints" / "best"
    with staging_dir(final) as tmp:
        save_module(parts.accelerator.unwrap_model(parts.student), tmp / "student.safetensors")
        write_json_atomic(tmp / "best.json", {"metric": state.best_metric, "stage": state.best_stage,
                                              "step": state.best_step})


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


def _flat_grad(value: torch.Tensor, params: list[torch.Tensor], scale: float) -> torch.Tensor:
    """d value / d params as one float32 vector (zeros where value does not depend on a parameter);
    the graph is kept for the training step's backward, and no ``.grad`` is touched."""
    if not value.requires_grad:
        return torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    grads = torch.autograd.grad(value * scale, params, retain_graph=True, allow_unused=True)
    flat = [(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)]
    return torch.cat(flat) / scale


def grad_share_logs(weighted: dict[str, torch.Tensor], params: list[torch.Tensor],
                    scale: float = 1.0) -> dict[str, float]:
    """Loss-balance diagnostics (``logger.grad_shares``) for one batch's weighted terms L_i.

    With g_i = dL_i/dθ over ``params`` (the student's trainable parameters) and g = Σ_i g_i (the
    total loss's gradient, before clipping): ``grad_norm/<i>`` = ‖g_i‖, ``grad_share/<i>`` =
    ‖g_i‖ / Σ_j ‖g_j‖ (sums to 1), ``grad_cos/<i>`` = cos(g_i, g) (negative: the term pulls against
    the total), ``grad_norm/total`` = ‖g‖, ``weighted/<i>`` = L_i. ``scale`` (the fp16 loss scale)
    keeps small gradients from underflowing and is divided out.
    """
    keys = list(weighted)
    flats = [_flat_grad(weighted[k], params, scale) for k in keys]
    gram = torch.stack([torch.stack([a @ b for b in flats]) for a in flats]).double()
    norms = gram.diagonal().clamp_min(0).sqrt()
    total = gram.sum().clamp_min(0).sqrt()
    shares = norms / norms.sum() if norms.sum() > 0 else torch.full_like(norms, float("nan"))
    cos = gram.sum(1) / (norms * total)  # <g_i, g> / (‖g_i‖ ‖g‖); NaN where a norm is 0
    out = {"grad_norm/total": float(total)}
    for i, k in enumerate(keys):
        out.update({f"grad_norm/{k}": float(norms[i]), f"grad_share/{k}": float(shares[i]),
                    f"grad_cos/{k}": float(cos[i]), f"weighted/{k}": float(weighted[k].detach())})
    return out


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


def _optimizer(parts: RunParts, plan: StagePlan) -> torch.optim.Optimizer:
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
    return torch.optim.AdamW(groups, lr=cfg["lr"])


@torch.inference_mode()
def _teacher_logit_table(parts: RunParts, plan: StagePlan) -> torch.Tensor:
    """Teacher logits for every training row, indexed by ``idx`` (the data are fixed across epochs)."""
    parts.teacher.eval()
    logits, _ = predict(parts.teacher, parts.train_data, parts.collator, parts.train_cfg.eval_batch_size,
                        parts.accelerator, desc="teacher logits", world_size=parts.world_size)
    return torch.from_numpy(logits).to(parts.accelerator.device)


def run_stage(parts: RunParts, plan: StagePlan, state: TrainState, resume_from: Path | None) -> None:
    """Train one stage from ``state`` (fresh or resumed) to its end, evaluating and checkpointing."""
    acc, cfg, tcfg = parts.accelerator, plan.cfg, parts.train_cfg
    student, teacher = parts.student, parts.teacher
    train_data = parts.augmented_data if cfg["data"] == "augmented" else parts.train_data
    if train_data is None:
        raise RuntimeError(f"stage '{plan.name}' trains on augmented data but none was built")
    loader, sampler = make_loader(
        train_data, cfg["batch_size"], parts.collator, seed=tcfg.seed + 1000 * plan.index, train=True,
        group_by_length=tcfg.group_by_length, num_workers=tcfg.num_workers, rank=parts.rank,
        world_size=parts.world_size,
    )
    batches_per_epoch = len(sampler.batches())
    accum = tcfg.gradient_accumulation_steps
    steps_per_epoch = max(1, batches_per_epoch // accum)
    total_steps = max(1, math.ceil(cfg["epochs"] * steps_per_epoch))
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    optimizer = acc.prepare_optimizer(_optimizer(parts, plan), device_placement=False)
    from transformers import get_linear_schedule_with_warmup

    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg["warmup_ratio"] * total_steps), total_steps)
    if resume_from is not None:
        blob = torch.load(resume_from / "optim_rng.pt", weights_only=True, map_location="cpu")
        if blob["optimizer"] is not None:  # None: the checkpoint closed the previous stage
            optimizer.load_state_dict(blob["optimizer"])
            scheduler.load_state_dict(blob["scheduler"])
        set_rng_state(blob["rng"])

    needs_s = plan.student_needs
    needs_t = plan.teacher_needs
    table = None
    if plan.uses_teacher and plan.teacher_logits_only and tcfg.cache_teacher_logits and cfg["data"] == "original":
        table = _teacher_logit_table(parts, plan)

    eval_every = cfg.get("eval_every_steps")
    ckpt_every = tcfg.checkpoint_every_steps
    log_every = max(1, parts.log_every)
    running: dict[str, float] = {}
    # logger.grad_shares: per-term gradients on the last micro-batch of each logged step.
    measure = getattr(parts.tracker, "grad_shares", False)
    share_params = [p for p in student.parameters() if p.requires_grad] if measure else None
    shares: dict[str, float] = {}
    n_running, t_log, ex_log, tok_log = 0, time.perf_counter(), 0, 0

    def do_eval(tag: str) -> None:
        results = evaluate(parts, student)
        score = main_score(parts, results)
        record = {"stage": plan.name, "step": state.global_step, "stage_step": state.stage_step, "at": tag,
                  "metrics": results}
        state.evals.append(record)
        flat = {f"eval/{split}/{k}": v for split, m in results.items() for k, v in m.items()}
        parts.tracker.log({"stage": plan.name, **flat}, step=state.global_step)
        if cfg.get("select_best", True) and (state.best_metric is None or state.best_stage != plan.index
                                              or score > state.best_metric):
            state.best_metric, state.best_stage, state.best_step = score, plan.index, state.global_step
            save_best(parts, state)
        student.train()

    pbar = tqdm(total=total_steps, initial=state.stage_step, desc=f"stage {plan.index}:{plan.name}",
                disable=not acc.is_main_process, dynamic_ncols=True, mininterval=2.0)
    student.train()
    if teacher is not None:
        teacher.eval()
    while state.epoch < num_epochs and state.stage_step < total_steps:
        sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        for batch in loader:
            batch = _to_device(batch, acc.device)
            with acc.accumulate(student):
                with acc.autocast():
                    s_feats = extract_features(student, batch, needs_s)
                    t_feats = None
                    if plan.uses_teacher:
                        if table is not None:
                            t_feats = Features(logits=table[batch["idx"]], attention_mask=batch["attention_mask"])
                        else:
                            with torch.inference_mode():
                                t_feats = extract_features(teacher, batch, needs_t)
                            t_feats = _clone_features(t_feats)
                    logged_step = acc.sync_gradients and _is_log_step(state.stage_step + 1, log_every, total_steps)
                    weighted = {} if share_params and logged_step else None
                    loss, values = parts.objective(plan.index, s_feats, t_feats, batch, step=state.global_step,
                                                   weighted=weighted)
                if not torch.isfinite(loss):
                    bad = [k for k, v in values.items() if not torch.isfinite(v)] or ["total (weighted sum)"]
                    raise TrainingDiverged(
                        f"stage '{plan.name}': loss term(s) {', '.join(bad)} became non-finite at step "
                        f"{state.global_step + 1} (values: { {k: float(v) for k, v in values.items()} }). "
                        f"The last good checkpoint is kept in {checkpoint_dir(parts.run_dir)}; lower the lr "
                        "or the term's weight, or check the inputs."
                    )
                if weighted:
                    shares = grad_share_logs(weighted, share_params, _loss_scale(acc))
                acc.backward(loss)
                if acc.sync_gradients and parts.world_size > 1:
                    _average_objective_grads(parts.objective, parts.world_size)
                if acc.sync_gradients and tcfg.max_grad_norm:
                    acc.clip_grad_norm_(list(student.parameters()) + list(parts.objective.parameters()),
                                        tcfg.max_grad_norm)
                optimizer.step()  # a no-op between accumulation boundaries (Accelerate's optimizer)
                optimizer.zero_grad(set_to_none=True)
            state.batch_in_epoch += 1
            for k, v in values.items():
                running[k] = running.get(k, 0.0) + float(v)
            running["loss"] = running.get("loss", 0.0) + float(loss.detach())
            n_running += 1
            ex_log += int(batch["input_ids"].shape[0])
            tok_log += int(batch["attention_mask"].sum())
            if not acc.sync_gradients:
                continue
            scheduler.step()
            state.stage_step += 1
            state.global_step += 1
            pbar.update(1)
            if _is_log_step(state.stage_step, log_every, total_steps):
                dt = max(time.perf_counter() - t_log, 1e-9)
                logs = {f"train/{k}": v / n_running for k, v in running.items()}
                logs.update({"train/lr": scheduler.get_last_lr()[0], "train/examples_per_s": ex_log / dt,
                             "train/tokens_per_s": tok_log / dt, "stage": plan.name,
                             "epoch": state.epoch + state.batch_in_epoch / batches_per_epoch})
                logs.update({f"objective/{k}": v for k, v in parts.objective.log_values(plan.index).items()})
                logs.update(shares)
                shares = {}
                parts.tracker.log(logs, step=state.global_step)
                pbar.set_postfix(loss=f"{logs['train/loss']:.4f}")
                running, n_running, t_log, ex_log, tok_log = {}, 0, time.perf_counter(), 0, 0
            if eval_every and state.stage_step % eval_every == 0 and state.stage_step < total_steps:
                do_eval("steps")
            if ckpt_every and state.global_step % ckpt_every == 0 and state.stage_step < total_steps:
                save_checkpoint(parts, state, optimizer, scheduler)
            if _stop_requested(parts):
                save_checkpoint(parts, state, optimizer, scheduler)
                pbar.close()
                parts.guard.stop()
            if tcfg.stop_after_steps is not None and state.global_step >= tcfg.stop_after_steps:
                pbar.close()
                raise SimulatedInterrupt(f"stopped after {state.global_step} steps (train.stop_after_steps); "
                                         "rerun the same command to resume")
            if state.stage_step >= total_steps:
                break
        if state.stage_step >= total_steps:
            break
        state.epoch += 1
        state.batch_in_epoch = 0
        if not eval_every:
            do_eval("epoch")
    pbar.close()
    if not state.evals or state.evals[-1]["stage_step"] != state.stage_step or state.evals[-1]["stage"] != plan.name:
        do_eval("stage_end")
    last = state.evals[-1]
    state.stage_results.append({"stage": plan.name, "steps": state.stage_step, "metrics": last["metrics"],
                                "best_metric": state.best_metric if state.best_stage == plan.index else None})
    # The next stage starts fresh; the checkpoint below marks this one as finished.
    state.stage += 1
    state.epoch = state.batch_in_epoch = state.stage_step = 0
    save_checkpoint(parts, state, None, None)


def restore_models(parts: RunParts, ckpt: Path) -> None:
    load_module(parts.accelerator.unwrap_model(parts.student), ckpt / "student.safetensors")
    load_module(parts.objective, ckpt / "objective.safetensors")


def finalize_best(parts: RunParts) -> None:
    """Load the kept best student (when selecting) into ``parts.student``."""
    best = parts.run_dir / "checkpoints" / "best" / "student.safetensors"
    if parts.train_cfg.keep_best and best.exists():
        load_module(parts.accelerator.unwrap_model(parts.student), best)


__all__ = [
    "RunParts", "TrainState", "TrainingDiverged", "SimulatedInterrupt", "Interrupted", "run_stage", "evaluate",
    "seed_everything", "load_checkpoint_state", "checkpoint_dir", "restore_models", "finalize_best",
    "predict",
]
