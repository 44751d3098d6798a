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
``tinybert`` reproduces the official code: entries of padded keys are zeroed in both maps, and so
is any score <= -100 (the official code zeroes scores <= -100, which its additive -10000 mask
leaves at padded keys, each map on its own), padded query rows are kept, and the mean runs over all
B·h·n·n entries.

Both official reductions depend on how far a batch is padded. kdrun takes n as the batch's longest
row (:func:`padded_mean`: positions past it, which a compiled step's width buckets add, are left
out), so a run's numbers do not depend on ``train.pad_to_multiple_of`` or on ``train.compile``. The
official code pads every batch to ``max_seq_length``; kdrun pads each batch to its longest row
(docs/objectives.md lists this among the remaining differences).

Reduction (``reduction`` of ``tinybert_embedding`` and ``tinybert_hidden``): ``tokens`` (default)
averages the squared errors over the real tokens' entries; ``all`` reproduces the official code's
``MSELoss()``: the mean over all B·n·d entries, padded positions included (n as above).

``tinybert_soft_ce``: the official code's prediction loss, ``mean(-p_t log p_s)`` over the batch
*and* the classes (``soft_ce`` sums over the classes: C times larger); MSE of outputs for
regression, as ``soft_ce``.

Objective (conf/objective/tinybert.yaml): stage 1 = embedding + 2a·hidden + 2(1−a)·attention
(a = 0.5: TinyBERT's equal weights); stage 2 = ``soft_ce`` at T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kdrun.losses.hidden import masked_mean
from kdrun.losses.layerwise import (
    LAYER_MAP_KINDS,
    ONE_TO_ONE,
    PROJECTIONS,
    WEIGHTED,
    ProjectionParams,
    attention_kl,
    check_projection,
    layer_map_of,
    mapped,
    masked_average,
    masked_log_softmax,
    projection_check,
    projection_module,
)
from kdrun.losses.prediction import prediction_rows, regression_mse
from kdrun.losses.registry import LossContext, Params, param, positive, register_loss
from kdrun.models.features import Features, fp32

ATTENTION_LOSSES = ("mse", "kl")
PADDING = ("exclude", "tinybert")
REDUCTIONS = ("tokens", "all")
# The official code's attention scores carry an additive -10000 mask; it zeroes every entry <= -100.
OFFICIAL_SCORE_FLOOR = -100.0


@dataclass(frozen=True)
class TinyProjection(ProjectionParams):
    """TinyBERT's projection defaults to one shared W (its official code)."""

    objective = "tinybert"
    projection: str = param("shared", choices=PROJECTIONS)
    reduction: str = param("tokens", choices=REDUCTIONS)


def _share_projection(p: TinyProjection) -> str:
    # Both terms build the same module for every student hidden state (embeddings included); the
    # objective keeps one per stage, as the official single W.
    return f"tinybert_projection_{p.projection}"


_projection = projection_module(embeddings=True)


def _check_embedding(student_info, teacher_info, pairs, p: TinyProjection) -> None:
    check_projection("tinybert_embedding", p.projection, student_info, teacher_info)


@register_loss("tinybert_embedding", params=TinyProjection, needs={"hidden_states"}, map_kinds=(),
               check=_check_embedding, module=_projection, share=_share_projection,
               reads_padding=lambda p: p.reduction == "all")
def tinybert_embedding(s: Features, t: Features, batch, ctx: LossContext, p: TinyProjection) -> torch.Tensor:
    """TinyBERT embedding loss: MSE(E_s W, E_t) over real tokens."""
    es = fp32(s.require("hidden_states")[0])
    if ctx.module is not None:
        es = fp32(ctx.module(es, 0))
    return _mse(es, fp32(t.require("hidden_states")[0]), s.attention_mask, p.reduction)


def _mse(xs: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """Squared error of (B, n, d) states: mean over real tokens (``tokens``) or all B·n·d entries (``all``),
    n the batch's longest row (:func:`padded_mean`)."""
    if reduction == "all":
        return padded_mean((xs - target) ** 2, mask, dims=(-2,))
    return masked_mean((xs - target) ** 2, mask)


def padded_mean(x: torch.Tensor, mask: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Mean of ``x`` over every entry, padded positions included, but along ``dims`` (token axes) only
    up to the batch's longest row: the mean of the batch padded to its longest row, whatever wider
    padding a compiled step's buckets add (the positions past it are left out, so the loss does not
    depend on ``train.pad_to_multiple_of``). ``mask``: (B, n) attention mask, right-padded."""
    keep = mask.bool().any(0).to(x.dtype)  # (n,): up to the longest row
    others = float(x.numel())  # the entries along the other axes
    for d in dims:
        shape = [1] * x.dim()
        shape[d] = -1
        x = x * keep.view(shape)
        others /= x.shape[d]
    return x.sum() / (keep.sum() ** len(dims) * others)


@register_loss("tinybert_hidden", params=TinyProjection, needs={"hidden_states"}, map_kinds=LAYER_MAP_KINDS,
               check=projection_check("tinybert_hidden"), module=_projection, share=_share_projection,
               reads_padding=lambda p: p.reduction == "all")
def tinybert_hidden(s: Features, t: Features, batch, ctx: LossContext, p: TinyProjection) -> torch.Tensor:
    """TinyBERT hidden loss: Σ_j MSE(H_s^j W, mapped teacher hidden states) over real tokens."""
    total = s.attention_mask.new_zeros((), dtype=torch.float32)
    for _, xs, tgt in mapped(s, t, ctx, lambda h: h, ctx.module, embeddings=False):
        total = total + _mse(xs, tgt, s.attention_mask, p.reduction)
    return total


@dataclass(frozen=True)
class AttentionParams(Params):
    objective = "tinybert"
    loss: str = param("mse", choices=ATTENTION_LOSSES, key="attention_loss")
    padding: str = param("exclude", choices=PADDING, key="attention_padding")


def _check_attention(student_info, teacher_info, pairs, p: AttentionParams) -> None:
    if student_info["heads"] != teacher_info["heads"]:
        raise ValueError(
            f"tinybert_attention compares attention maps head by head, but the student has "
            f"{student_info['heads']} heads and the teacher {teacher_info['heads']}; use a student with the "
            "teacher's head count or switch the attention loss off (objective.params.a=1)")


def attention_mse(ss: torch.Tensor, st: torch.Tensor, mask: torch.Tensor, padding: str) -> torch.Tensor:
    """MSE between (B, h, n, n) pre-softmax scores; see the module docstring for ``padding``."""
    m = mask.bool()
    ss, st = fp32(ss), fp32(st)  # squares of fp32 differences, whatever the scores' dtype
    if padding == "tinybert":
        pad_key = ~m[:, None, None, :]
        ss = ss.masked_fill(pad_key | (ss <= OFFICIAL_SCORE_FLOOR), 0.0)
        st = st.masked_fill(pad_key | (st <= OFFICIAL_SCORE_FLOOR), 0.0)
        return padded_mean((ss - st) ** 2, m, dims=(-2, -1))
    valid = (m[:, None, :, None] & m[:, None, None, :]).expand_as(ss)
    return masked_average((ss - st) ** 2, valid)


@register_loss("tinybert_attention", params=AttentionParams, needs={"attention_scores"},
               map_kinds={ONE_TO_ONE, WEIGHTED}, check=_check_attention,
               reads_padding=lambda p: p.padding == "tinybert")  # padded query rows count
def tinybert_attention(s: Features, t: Features, batch, ctx: LossContext, p: AttentionParams) -> torch.Tensor:
    """TinyBERT attention loss per head: MSE of pre-softmax scores, or KL of distributions (Jassani et al.)."""
    lmap = layer_map_of(ctx)
    if lmap.kind == "pairs":  # one teacher layer per row: every row in one stacked call
        return _stacked_attention(s, t, lmap.pairs_at(ctx.step), p)
    weights = lmap.row_weights(ctx.step)
    mask = s.attention_mask
    total = s.attention_mask.new_zeros((), dtype=torch.float32)
    for i, row in enumerate(lmap.rows):
        if row.student == 0:
            continue
        scores_s = s.attention_scores(row.student)
        if p.loss == "mse":
            target = lmap.target(i, t.attention_scores, step=ctx.step, weights=weights)
            total = total + attention_mse(scores_s, target, mask, p.padding)
        else:
            target = lmap.target(i, lambda layer: masked_log_softmax(t.attention_scores(layer), mask).exp(),
                                 step=ctx.step, weights=weights)  # a mixture of distributions
            total = total + attention_kl(masked_log_softmax(scores_s, mask), target, mask)
    return total


def _stacked_attention(s: Features, t: Features, pairs: list[tuple[int, int]], p: AttentionParams) -> torch.Tensor:
    """The attention loss summed over one-to-one ``pairs``, their scores stacked (L, B, h, n, n): the
    per-layer means share one count, so their sum is L times the stacked mean."""
    pairs = [(si, ti) for si, ti in pairs if si != 0]
    if not pairs:
        return s.attention_mask.new_zeros((), dtype=torch.float32)
    mask = s.attention_mask
    ss = torch.stack([fp32(s.attention_scores(si)) for si, _ in pairs])
    st = torch.stack([fp32(t.attention_scores(ti)) for _, ti in pairs])
    if p.loss == "mse":
        return attention_mse(ss, st, mask, p.padding) * len(pairs)
    return attention_kl(masked_log_softmax(ss, mask), masked_log_softmax(st, mask).exp(), mask) * len(pairs)


@dataclass(frozen=True)
class SoftCeParams(Params):
    temperature: float = param(1.0, check=positive)
    # On a regression task (STS-B): the MSE to the teacher's outputs or to the gold scores.
    regression_target: str = param("teacher", choices=("teacher", "gold"))


@register_loss("tinybert_soft_ce", params=SoftCeParams,
               uses_labels=lambda p, regression: regression and p.regression_target == "gold")
def tinybert_soft_ce(s: Features, t: Features, batch, ctx: LossContext, p: SoftCeParams) -> torch.Tensor:
    """TinyBERT's official prediction loss: mean over rows *and* classes of -softmax(z_t/T) log softmax(z_s/T)
    (``soft_ce`` / C); for regression the MSE of the (B, 1) outputs to the teacher's outputs, or to the
    gold scores (``regression_target: gold``)."""
    if ctx.regression:
        return regression_mse(s.logits, batch["labels"] if p.regression_target == "gold" else t.logits)
    zs, zt = prediction_rows(s), prediction_rows(t)
    pt = F.softmax(zt / p.temperature, dim=-1)
    return -(pt * F.log_softmax(zs / p.temperature, dim=-1)).mean()
