"""Contextual knowledge distillation (CKD; Park, Kim & Yang 2021, EMNLP, and its ICLR-submission version).

Four loss terms, one per switchable piece of the paper's objective, so each is logged on its own
and each can be turned off from the command line (``conf/objective/ckd.yaml``)::

    L = (1 - a) CE + a L_logit + l_CKD (L_WR + L_LTR)
    L_WR  = ckd_wr_pair  + l_WR  * ckd_wr_angle
    L_LTR = ckd_ltr_pair + l_LTR * ckd_ltr_angle

Word relation (WR): relations among the tokens of a sentence, computed per aligned layer pair
``ctx.layer_pairs`` (the mapping group; ``uniform`` = CKD's gcd alignment with embeddings) and
summed over layer pairs (all pairs in one call: the layers are stacked along the batch); each
layer's value is the mean over the batch's valid token pairs / triples (optionally within a locality
window δ).

Reduction (every term's ``reduction`` parameter): ``mean`` as described here; ``official`` is the
scale of the authors' GLUE training code (Park et al., 2021), which its per-task weights were tuned
on: each term is one pooled mean over all aligned layers and the batch, the sum of element-wise
losses divided by the count of mask entries with diagonal / degenerate entries included (pairs:
L sum_b n_b^2; angles: L sum_b n_b^3, windowed L sum_b n_b (2δ+1)^2; LTR: T l^2 and T l^3 for T
real tokens and l aligned layers). kdrun keeps its corrected edges under both (true window
neighbours only, no NaN); see :func:`kdrun.losses.relations.official_count`.

Layer transforming relation (LTR): the same relations among the aligned layers' representations of
one token (an l x l distance matrix and l^3 angles per token, weights all 1); the value is the mean
over all valid tokens of the batch and their layer pairs / triples (the paper's "sum over tokens",
divided by the number of entries so magnitudes do not grow with batch size or length).

The four terms are written as one entry of a stage's losses, the term group ``ckd_relations``
(:class:`RelationsParams`: their settings and defaults in one place; the entry's weight is l_CKD),
which the stage's plan expands into the four terms with their weights.

Relations are compared, never vectors: student and teacher may differ in width and head count.
Kernels, masking and matching-loss conventions: :mod:`kdrun.losses.relations`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdrun.config import multiply
from kdrun.losses.registry import LossContext, Params, param, positive, register_loss, register_term_group
from kdrun.losses.relations import LOSSES, PHIS, REDUCTIONS, angle_loss, pair_loss
from kdrun.models.features import Features, fp32

# ------------------------------------------------------------------------------------- parameters


def _window(value: int | None) -> str | None:
    return None if value is None or value >= 1 else "must be a positive integer (tokens on each side) or null (all)"


@dataclass(frozen=True)
class _Common(Params):
    objective = "ckd"  # messages name objective=ckd's keys (pair_loss, window_pair, ...)

    huber_beta: float = param(1.0, check=positive)
    reduction: str = param("mean", choices=REDUCTIONS)


@dataclass(frozen=True)
class PairParams(_Common):
    """Pair relations: phi (cosine | l2), normalize (l2 distances by their mean), matching loss."""

    phi: str = param("cosine", choices=PHIS, key="pair_phi")
    normalize: bool = param(False, key="pair_normalize")
    loss: str = param("kl", choices=LOSSES, key="pair_loss")

    def validate(self) -> None:
        if self.normalize and self.phi != "l2":
            self.fail("normalize", "divides distances by their mean, so it needs phi=l2, not cosine")


@dataclass(frozen=True)
class WRPairParams(PairParams):
    window: int | None = param(None, check=_window, key="window_pair")


@dataclass(frozen=True)
class AngleParams(_Common):
    loss: str = param("mse", choices=LOSSES, key="angle_loss")


@dataclass(frozen=True)
class WRAngleParams(AngleParams):
    window: int | None = param(None, check=_window, key="window_angle")


def _check_ltr(student_info, teacher_info, layer_pairs, p: Params) -> None:
    if len(layer_pairs) < 2:
        raise ValueError(
            f"LTR relates each token's representations across the aligned layers, but the mapping gives "
            f"{len(layer_pairs)} layer pair(s) {layer_pairs}; include the embeddings "
            "(mapping.include_embeddings=true) or turn LTR off (objective.params.ltr_pair=false "
            "objective.params.ltr_angle=false)"
        )


# ----------------------------------------------------------------------------------------- helpers

def _hidden(s: Features, t: Features, ctx: LossContext, term: str):
    hs, ht = s.require("hidden_states"), t.require("hidden_states")
    if not ctx.layer_pairs:
        raise RuntimeError(f"{term}: the mapping gave no layer pairs")
    if hs[0].shape[:2] != ht[0].shape[:2]:
        raise RuntimeError(
            f"{term}: student and teacher token sequences differ ({tuple(hs[0].shape[:2])} vs "
            f"{tuple(ht[0].shape[:2])}); CKD compares relations between the same tokens, so both models "
            "must share the tokenizer"
        )
    return hs, ht, s.attention_mask.bool()


def _layer_reduce(total: torch.Tensor, n_layers: int, reduction: str) -> torch.Tensor:
    """WR: per-layer means summed (``mean``) or one pooled mean over the layers (``official``).

    Every layer has the same official count (same tokens), so the pooled mean is the layers' mean.
    """
    return total / n_layers if reduction == "official" else total


def _stacked_layers(hs: tuple[torch.Tensor, ...], ht: tuple[torch.Tensor, ...],
                    layer_pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """The aligned layers stacked: student (l, B, n, ds) and teacher (l, B, n, dt), fp32 (fp64 kept).

    The word relation of every layer pair is then one call of the relation kernels, which sum the
    stacked layers' values (every layer shares the batch's mask).
    """
    xs = torch.stack([fp32(hs[si]) for si, _ in layer_pairs])
    with torch.no_grad():
        xt = torch.stack([fp32(ht[ti]) for _, ti in layer_pairs])
    return xs, xt


def _token_layer_points(hidden: tuple[torch.Tensor, ...], layers: list[int],
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's representations at ``layers``: points (B*n, l, d) and their validity (B*n, l).

    Every token of the batch is a point set; a padding token's set has no valid point, so it adds
    no pair, triple or row (nor official count) — the same sums as keeping only the real tokens,
    without a data-dependent shape.
    """
    points = torch.stack([fp32(hidden[i]) for i in layers], dim=2)  # (B, n, l, d)
    valid = mask.reshape(-1, 1).expand(-1, len(layers))
    return points.flatten(0, 1), valid


# ------------------------------------------------------------------------------------------- terms

@register_loss("ckd_wr_pair", params=WRPairParams, needs={"hidden_states"})
def ckd_wr_pair(s: Features, t: Features, batch, ctx: LossContext, p: WRPairParams) -> torch.Tensor:
    """CKD word relation, pair-wise: sum over aligned layers of the mean LD(phi_s(i, j), phi_t(i, j)).

    phi: ``l2`` (distance, Park et al. 2021, ICLR-submission version) or ``cosine`` (Park et al. 2021,
    EMNLP); normalize: divide distances by the sentence's mean valid distance; loss: mse | l1 | huber |
    kl (rows softmaxed over j);
    window δ: only pairs with |i - j| <= δ (null = all). Mean over the batch's valid pairs (i != j,
    no padding) per layer; ``kl``: mean over valid rows.
    """
    hs, ht, mask = _hidden(s, t, ctx, "ckd_wr_pair")
    xs, xt = _stacked_layers(hs, ht, ctx.layer_pairs)
    total = pair_loss(xs, xt, mask, phi=p.phi, normalize=p.normalize, loss=p.loss, window=p.window,
                      huber_beta=p.huber_beta, reduction=p.reduction)
    return _layer_reduce(total, len(ctx.layer_pairs), p.reduction)


@register_loss("ckd_wr_angle", params=WRAngleParams, needs={"hidden_states"})
def ckd_wr_angle(s: Features, t: Features, batch, ctx: LossContext, p: WRAngleParams) -> torch.Tensor:
    """CKD word relation, triple-wise: sum over aligned layers of the mean LD(psi_s(i,j,k), psi_t(i,j,k)).

    psi = cosine of the angle at vertex j; window δ: i and k within δ of the vertex (null = all).
    Mean over the batch's valid triples per layer (``kl``: over (j, i) rows, softmax over k).
    """
    hs, ht, mask = _hidden(s, t, ctx, "ckd_wr_angle")
    xs, xt = _stacked_layers(hs, ht, ctx.layer_pairs)
    total = angle_loss(xs, xt, mask, loss=p.loss, window=p.window, huber_beta=p.huber_beta, reduction=p.reduction)
    return _layer_reduce(total, len(ctx.layer_pairs), p.reduction)


@register_loss("ckd_ltr_pair", params=PairParams, needs={"hidden_states"}, check=_check_ltr)
def ckd_ltr_pair(s: Features, t: Features, batch, ctx: LossContext, p: PairParams) -> torch.Tensor:
    """CKD layer transforming relation, pair-wise: relations among each token's aligned-layer vectors.

    Per real token, the l x l relation matrix of its representations at the aligned layers
    (student layers vs their teacher layers); mean over the batch's tokens and layer pairs (l != m).
    """
    hs, ht, mask = _hidden(s, t, ctx, "ckd_ltr_pair")
    xs, valid = _token_layer_points(hs, [p[0] for p in ctx.layer_pairs], mask)
    xt, _ = _token_layer_points(ht, [p[1] for p in ctx.layer_pairs], mask)
    return pair_loss(xs, xt, valid, phi=p.phi, normalize=p.normalize, loss=p.loss, window=None,
                     huber_beta=p.huber_beta, reduction=p.reduction)


@register_loss("ckd_ltr_angle", params=AngleParams, needs={"hidden_states"}, check=_check_ltr)
def ckd_ltr_angle(s: Features, t: Features, batch, ctx: LossContext, p: AngleParams) -> torch.Tensor:
    """CKD layer transforming relation, triple-wise: angles among each token's aligned-layer vectors.

    Per real token, the l^3 angles (vertex = a layer); mean over the batch's tokens and valid triples.
    """
    hs, ht, mask = _hidden(s, t, ctx, "ckd_ltr_angle")
    xs, valid = _token_layer_points(hs, [p[0] for p in ctx.layer_pairs], mask)
    xt, _ = _token_layer_points(ht, [p[1] for p in ctx.layer_pairs], mask)
    return angle_loss(xs, xt, valid, loss=p.loss, window=None, huber_beta=p.huber_beta, reduction=p.reduction)


# ------------------------------------------------------------------------------------ term group


def _factor(value: bool | float) -> str | None:
    return None if value >= 0 else "must be >= 0 (a factor of the terms' weights; true / false switch them)"


@dataclass(frozen=True)
class RelationsParams(_Common):
    """The settings of CKD's four terms as one entry of a stage's losses (``ckd_relations``), each
    named as the ``objective.params`` key of objective=ckd that sets it. Their defaults are the
    terms' own. The entry's weight w gives the terms' weights (switches count as 1 / 0):

        ckd_wr_pair  w * wr * wr_pair          ckd_wr_angle  w * wr * lambda_wr * wr_angle
        ckd_ltr_pair w * ltr * ltr_pair        ckd_ltr_angle w * ltr * lambda_ltr * ltr_angle
    """

    # WR's and LTR's own factors (DynaBERT-CKD's lambda1 / lambda2), and the angle terms' (lambda_ltr
    # null: lambda_wr's, as the papers tie them).
    wr: float = param(1.0, check=_factor)
    ltr: float = param(1.0, check=_factor)
    lambda_wr: float = param(1.0, check=_factor)
    lambda_ltr: float | None = param(None, check=lambda v: None if v is None else _factor(v))
    # Per-term switches or factors (objective=ckd_official: the authors' per-task weights).
    wr_pair: bool | float = param(True, check=_factor)
    wr_angle: bool | float = param(True, check=_factor)
    ltr_pair: bool | float = param(True, check=_factor)
    ltr_angle: bool | float = param(True, check=_factor)
    pair_phi: str = param("cosine", choices=PHIS)
    pair_normalize: bool = param(False)
    pair_loss: str = param("kl", choices=LOSSES)
    angle_loss: str = param("mse", choices=LOSSES)
    window_pair: int | None = param(None, check=_window)
    window_angle: int | None = param(None, check=_window)


def expand_relations(weight: float, p: RelationsParams) -> list[tuple[str, float, dict]]:
    """The four terms of a ``ckd_relations`` entry: (name, weight, parameters)."""
    common = {"huber_beta": p.huber_beta, "reduction": p.reduction}
    pair = {**common, "phi": p.pair_phi, "normalize": p.pair_normalize, "loss": p.pair_loss}
    angle = {**common, "loss": p.angle_loss}
    lambda_ltr = p.lambda_wr if p.lambda_ltr is None else p.lambda_ltr
    return [("ckd_wr_pair", multiply(weight, p.wr, p.wr_pair), {**pair, "window": p.window_pair}),
            ("ckd_wr_angle", multiply(weight, p.wr, p.lambda_wr, p.wr_angle), {**angle, "window": p.window_angle}),
            ("ckd_ltr_pair", multiply(weight, p.ltr, p.ltr_pair), pair),
            ("ckd_ltr_angle", multiply(weight, p.ltr, lambda_ltr, p.ltr_angle), angle)]


register_term_group("ckd_relations", RelationsParams, expand_relations)
