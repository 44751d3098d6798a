"""Prediction-layer losses: CE, Hinton et al. 2015's KD, TinyBERT's soft cross-entropy.

Classification records hold (B, C) logits. Question answering records (task.kind=qa) hold (B, n, 2)
start / end logits over a window's n tokens with (B, 2) gold [start, end] labels: every term then
reads 2B distributions over the positions (a batch mean is the mean of the start and the end
term), padding positions at probability 0 (:func:`prediction_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kdrun.losses.registry import LossContext, NoParams, Params, param, positive, register_loss
from kdrun.models.features import Features, fp32

# Logit given to padding positions of QA windows: exp underflows to exactly 0 (as for -inf) while
# differences stay finite, so KL and soft CE need no special cases.
MASKED_LOGIT = -1e9


def prediction_rows(f: Features) -> torch.Tensor:
    """(B, C) class logits as they are; QA's (B, n, 2) start / end logits as (2B, n) rows over the
    positions (start and end of example 0, then of example 1, ...), padding at MASKED_LOGIT."""
    z = fp32(f.logits)
    if z.dim() == 2:
        return z
    z = z.masked_fill(~f.attention_mask.bool()[..., None], MASKED_LOGIT)
    return z.transpose(1, 2).reshape(-1, z.shape[1])


def regression_mse(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE of (B, 1) outputs to (B,) or (B, 1) targets (gold scores or the teacher's outputs), in fp32."""
    z = fp32(z).reshape(-1)
    return F.mse_loss(z, target.reshape(-1).to(z.dtype))


@dataclass(frozen=True)
class Temperature(Params):
    temperature: float = param(1.0, check=positive)


@register_loss("ce", uses_teacher=False, uses_labels=True)
def cross_entropy(s: Features, t: Features | None, batch, ctx: LossContext, p: NoParams) -> torch.Tensor:
    """Cross-entropy with the gold labels (MSE to the gold score for regression; QA: the mean of the
    start and end position CE)."""
    labels = batch["labels"]
    if ctx.regression:
        return regression_mse(s.logits, labels)
    return F.cross_entropy(prediction_rows(s), labels.long().reshape(-1))


@register_loss("logit_kd", params=Temperature)
def logit_kd(s: Features, t: Features, batch, ctx: LossContext, p: Temperature) -> torch.Tensor:
    """Hinton KD: T^2 * KL(softmax(z_t/T) || softmax(z_s/T)), batch mean; MSE of outputs for regression."""
    if ctx.regression:
        return regression_mse(s.logits, t.logits)
    zs, zt = prediction_rows(s), prediction_rows(t)
    log_ps = F.log_softmax(zs / p.temperature, dim=-1)
    log_pt = F.log_softmax(zt / p.temperature, dim=-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
    return kl * p.temperature**2


@register_loss("soft_ce", params=Temperature)
def soft_cross_entropy(s: Features, t: Features, batch, ctx: LossContext, p: Temperature) -> torch.Tensor:
    """Soft cross-entropy mean_b(-sum_c p_t log p_s) at temperature T, no T^2 (TinyBERT stage 2)."""
    if ctx.regression:
        return regression_mse(s.logits, t.logits)
    zs, zt = prediction_rows(s), prediction_rows(t)
    pt = F.softmax(zt / p.temperature, dim=-1)
    return -(pt * F.log_softmax(zs / p.temperature, dim=-1)).sum(-1).mean()
