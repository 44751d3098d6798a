"""Prediction-layer losses: CE, Hinton et al. 2015's KD, TinyBERT's soft cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdrun.features import Features
from kdrun.losses.registry import LossContext, register_loss


@register_loss("ce", uses_teacher=False, uses_labels=True)
def cross_entropy(s: Features, t: Features | None, batch, ctx: LossContext) -> torch.Tensor:
    """Cross-entropy with the gold labels (MSE to the gold score for regression)."""
    logits = s.logits.float()
    labels = batch["labels"]
    if ctx.regression:
        return F.mse_loss(logits.view(-1), labels.float().view(-1))
    return F.cross_entropy(logits, labels.long())


@register_loss("logit_kd")
def logit_kd(s: Features, t: Features, batch, ctx: LossContext, temperature: float = 1.0) -> torch.Tensor:
    """Hinton KD: T^2 * KL(softmax(z_t/T) || softmax(z_s/T)), batch mean; MSE of outputs for regression."""
    zs, zt = s.logits.float(), t.logits.float()
    if ctx.regression:
        return F.mse_loss(zs.view(-1), zt.view(-1))
    log_ps = F.log_softmax(zs / temperature, dim=-1)
    log_pt = F.log_softmax(zt / temperature, dim=-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
    return kl * temperature**2


@register_loss("soft_ce")
def soft_cross_entropy(
    s: Features, t: Features, batch, ctx: LossContext, temperature: float = 1.0
) -> torch.Tensor:
    """Soft cross-entropy mean_b(-sum_c p_t log p_s) at temperature T, no T^2 (TinyBERT stage 2)."""
    zs, zt = s.logits.float(), t.logits.float()
    if ctx.regression:
        return F.mse_loss(zs.view(-1), zt.view(-1))
    pt = F.softmax(zt / temperature, dim=-1)
    return -(pt * F.log_softmax(zs / temperature, dim=-1)).sum(-1).mean()
