"""Data parallelism per stage: the student's DDP wrapper and its settings (whether the stage's loss
leaves parameters unused), and the objective's own gradients averaged across processes."""

from __future__ import annotations

from typing import Any

import torch

from kdrun.engine.objective import Objective, StagePlan
from kdrun.engine.run_parts import RunParts


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
