"""Prediction-layer losses: CE, Hinton et al. 2015's KD, TinyBERT's soft cross-entropy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kdrun.features import Features
from kdrun.losses.registry import LossContext, NoParams, Params, param, positive, register_loss


@dataclass(frozen=True)
class Temperature(Params):
    temperature: float = param(1.0, check=positive)


@register_loss("ce", uses_teacher=False, uses_labels=True)
def cross_entropy(s: Features, t: Features | None, batch, ctx: LossContext, p: NoParams) -> torch.Tensor:
    """Cross-entropy with the gold labels (MSE to the gold score for regression)."""
    logits = s.logits.float()
    labels = batch["labels"]
    if ctx.regression:
        return F.mse_loss(logits.view(-1), labels.float().view(-1))
    return F.cross_entropy(logits, labels.long())


@register_loss("logit_kd", params=Temperature)
def logit_kd(s: Features, t: Features, batch, ctx: LossContext, p: Temperature) -> torch.Tensor:
    """Hinton KD: T^2 * KL(softmax(z_t/T) || softmax(z_s/T)), batch mean; MSE of outputs for regression."""
    zs, zt = s.logits.float(), t.logits.float()
    if ctx.regression:
        return F.mse_loss(zs.view(-1), zt.view(-1))
    log_ps = F.log_softmax(zs / p.temperature, dim=-1)
    log_pt = F.log_softmax(zt / p.temperature, dim=-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
    return kl * p.temperature**2


@register_loss("soft_ce", params=Temperature)
def soft_cross_entropy(s: Features, t: Features, batch, ctx: LossContext, p: Temperature) -> torch.Tensor:
    """Soft cross-entropy mean_b(-sum_c p_t log p_s) at temperature T, no T^2 (TinyBERT stage 2)."""
    zs, zt = s.logits.float(), t.logits.float()
    if ctx.regression:
        return F.mse_loss(zs.view(-1), zt.view(-1))
    pt = F.softmax(zt / p.temperature, dim=-1)
    return -(pt * F.log_softmax(zs / p.temperature, dim=-1)).sum(-1).mean()
