"""Optimizers and learning-rate schedules from config.

Any ``torch.optim`` optimizer by class name with its keyword arguments, and a ``linear``,
``cosine`` or ``constant`` schedule after a linear warmup. The defaults are AdamW and linear.

Adam and AdamW run torch's fused kernel (``fused=True``) unless the kwargs choose an implementation
(``fused``, ``foreach``, ``differentiable``): one pass over all parameters instead of a loop over
tensors, about 10x faster steps on a CPU for a MiniLM-sized student (its 30522 x 384 word embeddings
dominate). It computes the same update; results differ from the per-tensor loop in the last bit of
float32 (``train.optimizer.kwargs={fused: false}`` gives the loop back, bit for bit).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from omegaconf import OmegaConf

SCHEDULES = ("linear", "cosine", "constant")
DEFAULT_OPTIMIZER = {"name": "AdamW", "kwargs": None}  # OptimizerConfig's defaults
DEFAULT_SCHEDULER = "linear"
# torch.optim optimizers kdrun's training step cannot drive, and why.
UNSUPPORTED = {
    "LBFGS": "needs a closure that re-evaluates the loss",
    "SparseAdam": "takes sparse gradients only",
    "Muon": "takes 2-D parameters only (biases and LayerNorm weights are 1-D)",
}
# Set per parameter group from the stage (lr, weight_decay) or by the trainer (params).
FROM_STAGE = ("params", "lr", "weight_decay")
# Optimizers that get torch's fused kernel unless the kwargs choose an implementation.
FUSED_BY_DEFAULT = ("Adam", "AdamW")
IMPLEMENTATION_KWARGS = ("fused", "foreach", "differentiable")


def optimizer_choices() -> list[str]:
    """The ``torch.optim`` optimizer classes kdrun can train with."""
    import torch

    return sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type)
                  and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer and n not in UNSUPPORTED)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def stage_optim(stage_cfg: Mapping[str, Any], train_cfg: Any) -> tuple[dict[str, Any], str]:
    """A stage's optimizer config and schedule: its own when set, else the ``train`` ones."""
    opt = dict(stage_cfg.get("optimizer") or _plain(train_cfg.optimizer))
    return {**opt, "kwargs": dict(opt.get("kwargs") or {})}, stage_cfg.get("scheduler") or train_cfg.scheduler


def check_scheduler(name: str, where: str) -> None:
    """Raise ValueError naming ``where`` (the key, e.g. ``train.scheduler``) for an unknown schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"{where}='{name}' is not a schedule; choose one of {list(SCHEDULES)}")


def check_optimizer(opt: Mapping[str, Any], where: str, weight_decay: float = 0.0) -> None:
    """Raise ValueError naming the key when ``opt`` cannot train: an unknown name, an unknown or
    invalid keyword argument, or weight decay for an optimizer that has none. ``where`` is the
    optimizer's key (``train.optimizer``, ``objective.stages[1].optimizer``, ...)."""
    import torch

    unknown = sorted(set(opt) - {"name", "kwargs"})
    if unknown or "name" not in opt:
        raise ValueError(f"{where}: takes name and kwargs (e.g. {{name: SGD, kwargs: {{momentum: 0.9}}}}), "
                         f"got {sorted(opt)}")
    name, kwargs = opt["name"], dict(opt.get("kwargs") or {})
    choices = optimizer_choices()
    if name not in choices:
        why = f" ({UNSUPPORTED[name]})" if name in UNSUPPORTED else ""
        raise ValueError(f"{where}.name='{name}' is not a torch.optim optimizer kdrun can use{why}; "
                         f"choose one of {choices}")
    cls = getattr(torch.optim, name)
    accepted = [p for p in inspect.signature(cls).parameters if p not in FROM_STAGE]
    for key in kwargs:
        if key in FROM_STAGE:
            raise ValueError(f"{where}.kwargs.{key}: set by the stage (its lr / weight_decay), not here")
        if key not in accepted:
            raise ValueError(f"{where}.kwargs.{key}: {name} takes no such argument; it takes {accepted}")
        if key in IMPLEMENTATION_KWARGS and not isinstance(kwargs[key], bool) and kwargs[key] is not None:
            raise ValueError(f"{where}.kwargs.{key}={kwargs[key]!r} must be true or false (torch would take any "
                             "non-empty value as true)")
    if weight_decay and "weight_decay" not in inspect.signature(cls).parameters:
        raise ValueError(f"{where}.name={name} has no weight decay but the stage asks for "
                         f"weight_decay={weight_decay}; set the stage's weight_decay to 0")
    try:  # the values (betas out of range, a string for a float, ...) on a throwaway parameter
        cls([torch.zeros(1, requires_grad=True)], lr=1e-3, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.kwargs={kwargs}: {name} refuses them ({e})") from None


def build_optimizer(groups: list[dict[str, Any]], opt: Mapping[str, Any], lr: float):
    """``torch.optim.<name>(groups, lr=lr, **kwargs)``; a group's ``weight_decay`` is dropped for an
    optimizer without weight decay (check_optimizer has made sure it is 0 there)."""
    import torch

    cls = getattr(torch.optim, opt["name"])
    if "weight_decay" not in inspect.signature(cls).parameters:
        groups = [{k: v for k, v in g.items() if k != "weight_decay"} for g in groups]
    kwargs = dict(opt.get("kwargs") or {})
    if opt["name"] in FUSED_BY_DEFAULT and not set(IMPLEMENTATION_KWARGS) & set(kwargs):
        kwargs["fused"] = True
    return cls(groups, lr=lr, **kwargs)


def build_scheduler(name: str, optimizer, warmup_steps: int, total_steps: int):
    """The ``transformers`` schedule ``name`` (SCHEDULES) after ``warmup_steps`` of linear warmup."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    if name == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    if name == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    if name == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup_steps)
    raise ValueError(f"unknown schedule '{name}'; choose one of {list(SCHEDULES)}")


def without_default_optim(section: Mapping[str, Any]) -> dict[str, Any]:
    """``section`` (a resolved stage, ``train`` or ``finetune`` dict) without optimizer and
    scheduler entries that are unset or the defaults, for hashes computed before these keys
    existed (teacher cache keys, checkpoint identities), which keep matching for default runs."""
    drop = {"optimizer": (None, DEFAULT_OPTIMIZER), "scheduler": (None, DEFAULT_SCHEDULER)}
    return {k: v for k, v in section.items() if k not in drop or v not in drop[k]}
