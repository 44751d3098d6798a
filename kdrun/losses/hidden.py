"""Hidden-state matching over the mapping's layer pairs."""

from __future__ import annotations

import torch

from kdrun.losses.registry import LossContext, NoParams, register_loss
from kdrun.models.features import Features, fp32


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` (B, n, ...) over the real tokens of ``mask`` (B, n) and all trailing dims."""
    m = mask.to(x.dtype).view(*mask.shape, *([1] * (x.dim() - mask.dim())))
    denom = m.sum() * x[0, 0].numel()
    return (x * m).sum() / denom.clamp_min(1.0)


def _same_width(student_info, teacher_info, layer_pairs, p: NoParams) -> None:
    if student_info["hidden"] != teacher_info["hidden"]:
        raise ValueError(
            f"hidden_mse compares hidden states directly, but the student's width is "
            f"{student_info['hidden']} and the teacher's {teacher_info['hidden']}; use a student of the "
            "teacher's width (student=truncated) or an objective with projections"
        )


@register_loss("hidden_mse", needs={"hidden_states"}, check=_same_width)
def hidden_mse(s: Features, t: Features, batch, ctx: LossContext, p: NoParams) -> torch.Tensor:
    """Sum over mapped layer pairs of the MSE between hidden states, averaged over real tokens.

    Needs equal widths (a truncated student of its teacher); projections come with TinyBERT.
    """
    hs, ht = s.require("hidden_states"), t.require("hidden_states")
    total = hs[0].new_zeros((), dtype=torch.float32)
    for si, ti in ctx.layer_pairs:
        a, b = fp32(hs[si]), fp32(ht[ti])
        total = total + masked_mean((a - b) ** 2, s.attention_mask)
    return total
