"""TinyBERT's intermediate-layer losses, with the variants of Jassani, Dankar & Kumar.

- ``tinybert_embedding``: MSE(E_s W, E_t) over real tokens (W: the projection, see below).
- ``tinybert_hidden``: Σ over mapped transformer layers of MSE(H_s^j W, target_j) over real tokens;
  target_j from the mapping (Jassani et al.'s uniform/random/mean/learnable maps, or any other kind).
- ``tinybert_attention``: Σ over mapped layers of the per-head attention loss:
  ``loss=mse`` on pre-softmax scores (TinyBERT) or ``loss=kl``: KL(softmax(A_t) || softmax(A_s)) per
  head, mean over heads and real query tokens (Jassani et al.). Combining maps (mean, learnable) combine
  the teacher's scores (mse) or its attention distributions (kl).

Projection (``projection``): ``shared`` — one W for the embeddings and every layer, as TinyBERT's
official code; ``per_layer`` — one per student layer; ``none`` — equal widths only. The embedding
and hidden terms of one stage share the same projection module. W starts as the identity when the
widths are equal.

Padding (``padding`` of ``tinybert_attention`` with ``loss=mse``): ``exclude`` (default) averages over
the (real query, real key) entries only, so results do not depend on how much a batch is padded;
``tinybert`` reproduces the official code: entries of padded keys are zeroed in both maps (the
official code zeroes scores <= -100 left by its additive -10000 mask), padded query rows are
kept, and the mean runs over all B·h·n·n entries.

Objective (conf/objective/tinybert.yaml): stage 1 = embedding + 2a·hidden + 2(1−a)·attention
(a = 0.5: TinyBERT's equal weights); stage 2 = ``soft_ce`` at T.
"""

from __future__ import annotations

import torch

from kdrun.features import Features, fp32
from kdrun.losses.hidden import masked_mean
from kdrun.losses.layerwise import (
    ONE_TO_ONE,
    PER_SAMPLE,
    WEIGHTED,
    attention_kl,
    check_projection,
    layer_map_of,
    mapped,
    masked_log_softmax,
    projection_check,
    projection_factory,
    reads_layer_map,
)
from kdrun.losses.registry import LossContext, register_loss

ATTENTION_LOSSES = ("mse", "kl")
PADDING = ("exclude", "tinybert")
SHARE_KEY = "tinybert_projection"


# Both terms build the same module for every student hidden state (embeddings included); the
# objective keeps one per stage (share_key), as the official single W.
_projection_module = projection_factory(embeddings=True, default="shared", share_key=SHARE_KEY)


def _check_embedding(student_info, teacher_info, pairs, projection="shared") -> None:
    check_projection("tinybert_embedding", projection, student_info, teacher_info)


@reads_layer_map()
@register_loss("tinybert_embedding", needs={"hidden_states"}, check=_check_embedding,
               module_factory=_projection_module)
def tinybert_embedding(s: Features, t: Features, batch, ctx: LossContext, projection: str = "shared") -> torch.Tensor:
    """TinyBERT embedding loss: MSE(E_s W, E_t) over real tokens."""
    es = fp32(s.require("hidden_states")[0])
    if ctx.module is not None:
        es = fp32(ctx.module(es, 0))
    return masked_mean((es - fp32(t.require("hidden_states")[0])) ** 2, s.attention_mask)


_check_hidden = projection_check("tinybert_hidden", default="shared")


@reads_layer_map(ONE_TO_ONE, WEIGHTED, PER_SAMPLE)
@register_loss("tinybert_hidden", needs={"hidden_states"}, check=_check_hidden, module_factory=_projection_module)
def tinybert_hidden(s: Features, t: Features, batch, ctx: LossContext, projection: str = "shared") -> torch.Tensor:
    """TinyBERT hidden loss: Σ_j MSE(H_s^j W, mapped teacher hidden states) over real tokens."""
    total = s.logits.new_zeros((), dtype=torch.float32)
    for _, xs, tgt in mapped(s, t, ctx, lambda h: h, ctx.module, embeddings=False):
        total = total + masked_mean((xs - tgt) ** 2, s.attention_mask)
    return total


def _check_attention(student_info, teacher_info, pairs, loss="mse", padding="exclude") -> None:
    if loss not in ATTENTION_LOSSES:
        raise ValueError(f"params.loss='{loss}' must be one of {', '.join(ATTENTION_LOSSES)} "
                         "(objective=tinybert: objective.params.attention_loss)")
    if padding not in PADDING:
        raise ValueError(f"params.padding='{padding}' must be one of {', '.join(PADDING)} "
                         "(objective=tinybert: objective.params.attention_padding)")
    if student_info["heads"] != teacher_info["heads"]:
        raise ValueError(
            f"tinybert_attention compares attention maps head by head, but the student has "
            f"{student_info['heads']} heads and the teacher {teacher_info['heads']}; use a student with the "
            "teacher's head count or switch the attention loss off (objective.params.a=1)")


def attention_mse(ss: torch.Tensor, st: torch.Tensor, mask: torch.Tensor, padding: str) -> torch.Tensor:
    """MSE between (B, h, n, n) pre-softmax scores; see the module docstring for ``padding``."""
    m = mask.bool()
    if padding == "tinybert":
        key = m[:, None, None, :]
        return ((ss.masked_fill(~key, 0.0) - st.masked_fill(~key, 0.0)) ** 2).mean()
    valid = (m[:, None, :, None] & m[:, None, None, :]).expand_as(ss)
    return ((ss - st) ** 2)[valid].mean()


@reads_layer_map(ONE_TO_ONE, WEIGHTED)
@register_loss("tinybert_attention", needs={"attention_scores"}, check=_check_attention)
def tinybert_attention(s: Features, t: Features, batch, ctx: LossContext, loss: str = "mse",
                       padding: str = "exclude") -> torch.Tensor:
    """TinyBERT attention loss per head: MSE of pre-softmax scores, or KL of distributions (Jassani et al.)."""
    lmap = layer_map_of(ctx)
    weights = lmap.row_weights(ctx.step)
    mask = s.attention_mask
    total = s.logits.new_zeros((), dtype=torch.float32)
    for i, row in enumerate(lmap.rows):
        if row.student == 0:
            continue
        scores_s = s.attention_scores(row.student)
        if loss == "mse":
            target = lmap.target(i, t.attention_scores, step=ctx.step, weights=weights)
            total = total + attention_mse(scores_s, target, mask, padding)
        else:
            target = lmap.target(i, lambda layer: masked_log_softmax(t.attention_scores(layer), mask).exp(),
                                 step=ctx.step, weights=weights)  # a mixture of distributions
            total = total + attention_kl(masked_log_softmax(scores_s, mask), target, mask)
    return total
