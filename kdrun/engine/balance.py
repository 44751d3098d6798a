"""Automatic loss balancing (``objective.balance``): weights for a stage's terms set during training.

A stage's loss is Σ_i S_i with S_i = weight_i · L_i (the YAML weights). ``fixed`` keeps that sum (the
default, bit for bit). The other methods multiply each summand by a factor learned as training goes:

- ``uncertainty`` (Kendall, Gal & Cipolla, 2018): learned log-variances s_i,
  loss = Σ_i exp(-s_i) S_i + s_i. A term whose (weighted) loss is large gets its factor exp(-s_i)
  lowered until exp(-s_i) S_i ≈ 1 (the optimum of each summand is s_i = log S_i).
- ``gradnorm`` (Chen, Badrinarayanan, Lee & Rabinovich, 2018): factors w_i (summing to the number of
  terms) chosen so that each term's gradient norm on the shared parameters, G_i = w_i ‖∇_W S_i‖,
  approaches mean(G) · r_i^α, where r_i is the term's relative inverse training rate
  (S_i(t)/S_i(0) over its mean across terms). The model is trained on Σ_i w_i S_i with w fixed; the
  factors get their gradient only from Σ_i |G_i − target_i| (targets held constant), and are
  renormalised before each forward. W is the student's last encoder layer
  (``Objective.balance_params``, set by the trainer); without it (evaluation) the current factors
  are used as they are. Under fp16 each ‖∇_W S_i‖ is taken of S_i times the run's loss scale and
  divided by it (``Balancer.grad_scale``, set by the trainer), as the training backward is: unscaled,
  the per-token gradients of a small summand (~1e-10) flush to zero in fp16 activations and the
  balance would silently stop moving.

The factors are parameters of the objective (optimised with the stage's objective lr, checkpointed),
and are logged as ``objective/balance/<term>``. Nothing reads a device value on the host.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

BALANCE_METHODS = ("fixed", "gradnorm", "uncertainty")


class Balancer(nn.Module):
    """Learned factors for the terms of each stage (a stage with fewer than two terms is left alone)."""

    def __init__(self, method: str, stage_terms: dict[int, list[str]], alpha: float = 1.5):
        super().__init__()
        if method not in BALANCE_METHODS[1:]:
            raise ValueError(f"objective.balance={method!r} is not one of {', '.join(BALANCE_METHODS)}")
        self.method, self.alpha = method, float(alpha)
        self.keys = {s: list(k) for s, k in stage_terms.items() if len(k) > 1}
        start = 0.0 if method == "uncertainty" else 1.0  # log-variance 0 / factor 1: the YAML weights
        self.factors = nn.ParameterDict({f"stage{s}": nn.Parameter(torch.full((len(k),), start))
                                         for s, k in self.keys.items()})
        for s, k in self.keys.items():  # GradNorm's S_i(0), NaN until the stage's first step
            self.register_buffer(f"initial{s}", torch.full((len(k),), float("nan")))
        # The run's fp16 loss scale as a device tensor (None: no scaling); read when GradNorm measures
        # gradients (kdrun.runtime.precision.Precision.scale_tensor, set by the trainer).
        self.grad_scale: Callable[[], torch.Tensor | None] | None = None

    def balances(self, stage: int) -> bool:
        return stage in self.keys

    def weights(self, stage: int) -> torch.Tensor:
        """The factors multiplying the stage's summands."""
        f = self.factors[f"stage{stage}"]
        return torch.exp(-f) if self.method == "uncertainty" else f

    def log_values(self, stage: int) -> dict[str, torch.Tensor]:
        if not self.balances(stage):
            return {}
        w = self.weights(stage).detach()
        return {f"balance/{k}": w[i] for i, k in enumerate(self.keys[stage])}

    def combine(self, stage: int, summands: list[torch.Tensor], shared: list[torch.Tensor] | None) -> torch.Tensor:
        """The balanced total of the stage's summands (fp32 scalars attached to the graph)."""
        s = torch.stack(summands)
        if self.method == "uncertainty":
            f = self.factors[f"stage{stage}"]
            return (torch.exp(-f) * s + f).sum()
        return self._gradnorm(stage, s, summands, shared)

    def _gradnorm(self, stage: int, s: torch.Tensor, summands: list[torch.Tensor],
                  shared: list[torch.Tensor] | None) -> torch.Tensor:
        w = self.factors[f"stage{stage}"]
        with torch.no_grad():  # renormalise: Σ w = number of terms, each kept positive
            w.clamp_(min=1e-3).mul_(len(w) / w.sum())
        total = (w.detach() * s).sum()
        if shared is None or not torch.is_grad_enabled():
            return total
        # ‖∇_W S_i‖, constants; a non-finite norm (an fp16 overflow) counts as 0 for this step
        scale = self.grad_scale() if self.grad_scale is not None else None
        norms = torch.nan_to_num(torch.stack([_grad_norm(x, shared, scale) for x in summands]), nan=0.0, posinf=0.0)
        initial = getattr(self, f"initial{stage}")
        initial.copy_(torch.where(torch.isnan(initial), s.detach(), initial))
        # a loss rounded to just below 0 (a KL of identical distributions) must not make r_i^α NaN
        ratio = s.detach().clamp_min(0) / initial.clamp_min(1e-12)
        rate = ratio / ratio.mean().clamp_min(1e-12)
        g = w * norms
        target = torch.nan_to_num(g.mean() * rate.pow(self.alpha), nan=0.0, posinf=0.0).detach()
        grad_loss = (g - target).abs().sum()
        return total + (grad_loss - grad_loss.detach())  # the value is the loss; w also gets grad_loss's gradient


def _grad_norm(value: torch.Tensor, params: list[torch.Tensor], scale: torch.Tensor | None = None) -> torch.Tensor:
    """‖d value / d params‖ (fp32 scalar). ``scale`` (the fp16 loss scale, a device tensor): the
    gradient is taken of ``value * scale`` and its norm divided by ``scale``, so that gradients
    flowing through fp16 activations do not underflow; no host read."""
    if not value.requires_grad:
        return value.new_zeros(())
    grads = torch.autograd.grad(value * scale if scale is not None else value, params, retain_graph=True,
                                allow_unused=True)
    sq = [g.float().pow(2).sum() for g in grads if g is not None]
    if not sq:
        return value.new_zeros(())
    norm = torch.stack(sq).sum().sqrt()
    return norm / scale.float() if scale is not None else norm
