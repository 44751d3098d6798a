"""Multi-granularity structural KD (MGSKD; Liu, Tao, Feng & Zhao 2022, ACL).

Three registered terms, one per granularity, so each is weighted (λ_token, λ_span, λ_sample),
switched off and logged on its own (``train/mgskd_token`` …); each term also logs its
pair and angle parts (``train/mgskd_token/pair`` …)::

    L_stage1 = λ_token mgskd_token + λ_span mgskd_span + λ_sample mgskd_sample
    mgskd_token  = Σ_{layer pairs below M}   MSE(P_s, P_t)   + Huber(T_s, T_t)    (tokens)
    mgskd_span   = Σ_{layer pairs below M}   MSE(P̂_s, P̂_t)   + Huber(T̂_s, T̂_t)    (spans)
    mgskd_sample = Σ_{layer pairs from M up} Huber(T̃_s, T̃_t)  [+ MSE(P̃_s, P̃_t)]  (samples)

Representations (per layer; hidden state 0 = embeddings): tokens are the real tokens; a span is
the mean of its tokens (``Features.spans``: (B, S, 2) ``[start, end)``, -1 padding; an example with
fewer than ``min_spans`` spans leaves the span loss, not the batch); a sample is the mean of its
real tokens. The layer pairs are the mapping group's (``uniform``: TinyBERT's/CKD's); the student
index of a pair decides its granularity: below the boundary M token + span, from M up sample
(``hierarchical=false``: every granularity on every pair).

Relations:

- pair-wise interactions over ``heads`` (m) relation heads: each d-vector is split into m
  sub-vectors of d/m, ``P^h_ij = <r_i^h, r_j^h> / sqrt(d/m)``; MSE over all valid (h, i, j),
  the diagonal included (a vector's interaction with itself is its scaled squared norm),
  computed from each head's small Gram matrix of both sides' sub-vectors side by side (never the
  (B, m, n, n) tensors);
- triplet angles, one head (the whole vector), ``cos ∠ r_a r_v r_b`` at vertex v, from the Gram
  matrix of the centred points (:mod:`kdrun.losses.relations`' identities, never (n, n, d)
  difference tensors). Tokens and spans use the two-step salient selection, made on the teacher
  and reused for the student: ``A^h = softmax_j(P^h_t)`` over valid j; vertices = top-k1 by
  ``s_j = Σ_h Σ_i A^h_ij`` (valid i); for each vertex v its top-k2 neighbours by ``Σ_h A^h_vj``
  (j ≠ v). Angles between every ordered pair (a, b) of a vertex's neighbours (a = b included: cos 1
  on both sides, error 0 — the convention of :mod:`kdrun.losses.relations`); Huber (smooth L1,
  ``huber_beta``) averaged over valid triples (:class:`kdrun.losses.angle_kernel.SalientAngleLoss`, its
  gradient computed in the forward pass). Samples: all triples of the batch (k1 = k2 = batch
  size, as in the paper) in each of the m heads;
- relation heads need the width divisible by m. A student whose width is not (TinyBERT's 312 with
  m = 64) is projected to the teacher's width by a learned linear map (``project=auto``; ``always``
  projects any student, ``never`` makes such a student an error). One projection per term, shared
  by its layers; the trainer optimises it with the student.

Everything is computed in fp32 with autocast off; the teacher side without gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kdrun.losses.angle_kernel import SalientAngleLoss
from kdrun.losses.prediction import Temperature, logit_kd, regression_mse
from kdrun.losses.registry import LossContext, ParamError, Params, param, positive, positive_int, register_loss
from kdrun.losses.relations import _tiny, _tol, all_triples_sum, full_precision, gram, relation_dtype, valid_points
from kdrun.models.features import Features, no_autocast

PROJECT = ("auto", "always", "never")
_NEG = -1e9  # masked logit (exp underflows to exactly 0, stays finite)


# --------------------------------------------------------------------------------------- relations

def split_heads(x: torch.Tensor, m: int) -> torch.Tensor:
    """(..., n, d) -> (..., m, n, d/m): the m relation-head sub-vectors of each point."""
    *lead, n, d = x.shape
    if d % m:
        raise ValueError(f"width {d} is not divisible by {m} relation heads")
    return x.reshape(*lead, n, m, d // m).movedim(-2, -3)


def pair_interactions(x: torch.Tensor, m: int) -> torch.Tensor:
    """(B, n, d) -> (B, m, n, n) scaled dot products ``<r_i^h, r_j^h> / sqrt(d/m)``."""
    h = split_heads(x, m).contiguous()  # one copy for both operands
    return (h @ h.transpose(-1, -2)) / math.sqrt(x.shape[-1] // m)


def pair_mse(xs: torch.Tensor, xt: torch.Tensor, mask: torch.Tensor, m: int) -> torch.Tensor:
    """MSE between the m-head interactions of xs (B, n, ds) and xt (B, n, dt) over entries whose two
    points are valid (mask (B, n)). Stacked layers xs (L, B, n, ds), xt (L, B, n, dt) sharing the
    mask: the sum of the L layers' MSEs.

    Per head, with X zeroed at invalid points, a = ds/m, b = dt/m:
    ``||X_s X_s^T/√a - X_t X_t^T/√b||² = ||X_s^T X_s||²/a - 2 ||X_s^T X_t||²/√(ab) + ||X_t^T X_t||²/b``
    ``= Σ_ij u_i u_j K_ij²``, ``K = Y^T Y`` with ``Y = [X_s | X_t]``, ``u = (a^-1/2 …, -b^-1/2 …)``: one
    (a+b)² product per head, O(n (a+b)²), in fp64 (the blocks' cancellation stays far below the loss),
    without the (B, m, n, n) matrices. With fewer points than a + b (one or a few relation heads,
    short rows) the n x n interactions, O(n² (a+b)), cost less and are formed instead
    (``scripts/bench/mgskd_pair.py`` times both).
    """
    y = torch.cat([xs, xt.to(xs.dtype)], -1).masked_fill(~mask[..., None], 0.0)
    return _pair_mse(y, xs.shape[-1], mask, m)


def _pair_mse(y: torch.Tensor, ds: int, mask: torch.Tensor, m: int, w: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pair_mse` of both sides' points side by side, ``y`` (..., B, n, ds + dt), padding zeroed."""
    n = mask.sum(-1, dtype=torch.float64)
    direct = pair_direct_form(y.shape[-2], y.shape[-1], m)
    per_layer = _pair_sq_direct(y, ds, m) if direct else _pair_sq_kernel(y, ds, m, w)
    return (per_layer / (n @ n).clamp_min(1)).sum().to(y.dtype)


def pair_direct_form(n: int, width: int, m: int) -> bool:
    """Whether the pair MSE of n points of both sides' summed width forms the n x n interactions:
    with fewer points than a head's two widths a + b they cost less than the (a+b)² kernel."""
    return n < width // m


def _pair_sq_kernel(y: torch.Tensor, ds: int, m: int, w: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_pair_mse`'s squared errors / m per layer by the (a+b)² kernel, O(n (a+b)²) per head."""
    a, b = ds // m, (y.shape[-1] - ds) // m
    y = torch.cat([split_heads(y[..., :ds], m), split_heads(y[..., ds:], m)], -1).double()  # (..., B, m, n, a+b)
    k2 = (y.transpose(-1, -2) @ y).square().sum((-4, -3))  # (..., a + b, a + b), summed over examples, heads
    if w is None or w.shape[0] != (a + b) ** 2:
        w = pair_weights(a * m, b * m, m).to(y.device)
    return (k2.flatten(-2) @ w.to(torch.float64)).clamp_min(0.0)


def _pair_sq_direct(y: torch.Tensor, ds: int, m: int) -> torch.Tensor:
    """:func:`_pair_mse`'s squared errors / m per layer formed as the (..., B, m, n, n) interactions,
    O(n² (a+b)) per head: the cheaper form when n < a + b (few relation heads, short rows). No
    cancellation here, so fp32 (fp64 where y is fp64); padding rows of y are zero and add nothing."""
    y = y.to(torch.promote_types(y.dtype, torch.float32))
    diff = pair_interactions(y[..., :ds], m) - pair_interactions(y[..., ds:], m)
    return diff.square().sum((-4, -3, -2, -1), dtype=torch.float64) / m


def pair_weights(ds: int, dt: int, m: int) -> torch.Tensor:
    """:func:`pair_mse`'s fp64 weights ``u_i u_j`` for widths ds, dt (1/m of the mean folded in), on the CPU;
    a term's module holds them on its device (no copy per step)."""
    a, b = ds // m, dt // m
    u = [(a * m) ** -0.5] * a + [-((b * m) ** -0.5)] * b
    return torch.tensor([ui * uj for ui in u for uj in u], dtype=torch.float64)


def salient_selection(pt: torch.Tensor, mask: torch.Tensor, k1: int, k2: int, pad: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-step selection on the teacher's interactions ``pt`` (..., B, m, n, n), mask (B, n);
    leading dims (stacked layers) share the mask.

    Returns vertices (..., B, K1) token indices, neighbours (..., B, K1, K2) token indices and their
    validity (..., B, K1, K2) bool (False where an example has fewer valid points than k1 / k2 + 1),
    with K1 = min(k1, n), K2 = min(k2, n - 1); ``pad``: ``~mask`` when the caller has it.
    """
    n, pad = pt.shape[-1], ~mask if pad is None else pad
    a = torch.softmax(pt.masked_fill(pad[:, None, None, :], _NEG), dim=-1)
    heads_sum = a.sum(-3)  # (..., B, n, n): attention query i pays to j, summed over heads
    heads_sum.mul_(mask[:, :, None])  # queries that are padding give nothing
    glob = heads_sum.sum(-2).masked_fill(pad, -math.inf)  # (..., B, n): attention received
    K1, K2 = min(k1, n), max(min(k2, n - 1), 0)
    vscore, vert = glob.topk(K1, dim=-1)
    local = heads_sum.gather(-2, vert[..., None].expand(*vert.shape, n))  # attention the vertex pays
    local = local.scatter(-1, vert[..., None], -math.inf).masked_fill(pad[:, None, :], -math.inf)
    nscore, nb = local.topk(K2, dim=-1)
    valid = (nscore + vscore[..., None]) > -math.inf  # scores are finite or -inf
    return vert, nb, valid


def structure_losses(xs: torch.Tensor, xt: torch.Tensor, mask: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair MSE, angle Huber) between student points xs (B, n, ds) and teacher points xt (B, n, dt)
    (keywords: :func:`_structure`'s). Relations are within each example; ``mask`` (B, n) marks the valid
    points. Stacked layers xs (L, B, n, ds), xt (L, B, n, dt) sharing the mask: the sums over the L layers.
    """
    return _structure(torch.cat([xs, xt.to(xs.dtype)], -1), xs.shape[-1], mask, **kw)


def _structure(y: torch.Tensor, ds: int, mask: torch.Tensor, *, heads: int, pair: bool, angle: bool, k1: int,
               k2: int, huber_beta: float, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`structure_losses` of both sides' points side by side, ``y`` (..., B, n, ds + dt): the
    masking and centring run once for both."""
    zero = y.sum() * 0.0 if not (pair and angle) else None  # keeps the graph when a part is off or empty
    lp = la = zero
    pad = ~mask
    y = y.masked_fill(pad[..., None], 0.0)
    if pair:
        lp = _pair_mse(y, ds, mask, heads, weights)
    if angle and y.shape[-2] >= 2:
        la = _salient_angles(y, ds, mask, pad, heads, k1, k2, huber_beta)
    elif angle:
        la = y.sum() * 0.0
    return lp, la


def _salient_angles(y: torch.Tensor, ds: int, mask: torch.Tensor, pad: torch.Tensor, heads: int, k1: int, k2: int,
                    beta: float) -> torch.Tensor:
    """Angle Huber of the salient triples (selected on the teacher) of ``y`` (padding zeroed)."""
    layers = math.prod(y.shape[:-3])
    with torch.no_grad():
        vert, nb, valid = salient_selection(pair_interactions(y[..., ds:], heads), mask, k1, k2, pad)
    yc = y - y.sum(-2, keepdim=True) / valid_points(mask)  # padding is never read: no triple holds it
    gs = gram(yc[..., :ds])
    with torch.no_grad():
        gt = gram(yc[..., ds:])
    idx = torch.cat([vert[..., None], nb], -1).flatten(0, -3)
    dt = y.dtype
    return SalientAngleLoss.apply(gs.flatten(0, -3), gt.flatten(0, -3), idx, valid.flatten(0, -3), float(beta),
                                  layers, _tol(dt), _tiny(dt), torch.is_grad_enabled() and gs.requires_grad)


def span_points(h: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Mean of each span's token vectors: h (..., B, n, d), spans (B, S, 2) [start, end) -> (..., B, S, d)."""
    return span_weights(spans, h.shape[-2], h.dtype) @ h


def span_weights(spans: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, n): row s averages the tokens of span s (``w @ h`` are the span means)."""
    ar = torch.arange(n, device=spans.device)
    start, end = spans[..., :1], spans[..., 1:]
    w = ((ar >= start) & (ar < end)).to(dtype)
    return w / w.sum(-1, keepdim=True).clamp_min(1)


def span_mask(spans: torch.Tensor, min_spans: int) -> torch.Tensor:
    """(B, S) validity: a real span of an example that has at least ``min_spans`` of them."""
    real = (spans[..., 0] >= 0) & (spans[..., 1] > spans[..., 0])
    return real & (real.sum(-1, keepdim=True) >= min_spans)


def sample_points(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over real tokens: (..., B, n, d) -> (..., B, d)."""
    m = mask.to(h.dtype)[..., None]
    return (h * m).sum(-2) / m.sum(-2).clamp_min(1)


def _sample_angles(v: torch.Tensor, ds: int, heads: int, beta: float) -> torch.Tensor:
    """Angle Huber among all triples of the batch's samples, in each of the m heads: ``v`` (L, B, ds + dt)
    both sides' samples side by side (every sample valid: no masking; the batch centred once)."""
    L, n, _ = v.shape
    vc = v - v.sum(-2, keepdim=True) / n
    gs = gram(split_heads(vc[..., :ds], heads).reshape(L * heads, n, -1))  # (L m, B, B)
    with torch.no_grad():
        gt = gram(split_heads(vc[..., ds:], heads).reshape(L * heads, n, -1))
    return all_triples_sum(gs, gt, "huber", beta) / max(heads * n * (n - 1) ** 2, 1)  # the layers' means, summed


# ------------------------------------------------------------------------------------------ module

class MGSKDModule(nn.Module):
    """A term's learned projection of the student to the teacher's width (when needed) and the
    weights of its pair MSE. (Its parts go to ``ctx.parts``: the trainer logs them as ``train/<term>/<part>``.)"""

    def __init__(self, student_width: int, teacher_width: int, project: bool, heads: int = 0):
        super().__init__()
        self.proj = nn.Linear(student_width, teacher_width) if project else None
        width = teacher_width if project else student_width
        if heads and not (width % heads or teacher_width % heads):  # pair_mse's weights, not in the state
            self.register_buffer("pair_weights", pair_weights(width, teacher_width, heads), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d_s) -> (..., d_t) in ``h``'s precision (fp32 / fp64), autocast off."""
        if self.proj is None:
            return h
        with no_autocast(h.device):
            return F.linear(h, self.proj.weight.to(h.dtype), self.proj.bias.to(h.dtype))


@dataclass(frozen=True)
class StructureParams(Params):
    """Shared by the three levels: m relation heads, the boundary layer M between the token/span and
    sample levels (``hierarchical``), the projection policy, the Huber β and the relation types."""

    objective = "mgskd"
    level = ""  # token | span | sample

    heads: int = param(64, check=positive_int)
    boundary: int = 2
    hierarchical: bool = True
    project: str = param("auto", choices=PROJECT)
    huber_beta: float = param(1.0, check=positive)
    pair: bool = True
    angle: bool = True

    def validate(self) -> None:
        if not (self.pair or self.angle):
            raise ParamError(f"both relation types of mgskd_{self.level} are off; set its weight to 0 instead "
                             f"(objective.params.{self.level}=false)")


@dataclass(frozen=True)
class TokenParams(StructureParams):
    level = "token"
    k1: int = param(20, check=positive_int)
    k2: int = param(20, check=positive_int)


@dataclass(frozen=True)
class SpanParams(TokenParams):
    level = "span"
    min_spans: int = param(3, check=positive_int)


@dataclass(frozen=True)
class SampleParams(StructureParams):
    level = "sample"
    pair: bool = False


def _needs_projection(student_info, teacher_info, heads: int, project: str) -> bool:
    if project == "always":
        return True
    return project == "auto" and student_info["hidden"] % heads != 0


def _factory(student_info, teacher_info, layer_pairs, p: StructureParams) -> nn.Module:
    return MGSKDModule(student_info["hidden"], teacher_info["hidden"],
                       _needs_projection(student_info, teacher_info, p.heads, p.project), p.heads)


# ------------------------------------------------------------------------------------------ checks

def _layers(layer_pairs, boundary: int, hierarchical: bool, top: bool) -> list[tuple[int, int]]:
    if not hierarchical:
        return list(layer_pairs)
    return [p for p in layer_pairs if (p[0] >= boundary) == top]


def _check(student_info, teacher_info, layer_pairs, p: StructureParams) -> None:
    src, heads, term = "objective.params", p.heads, f"mgskd_{p.level}"
    if teacher_info["hidden"] % heads:
        divisors = [m for m in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96) if teacher_info["hidden"] % m == 0]
        raise ValueError(f"the teacher's width {teacher_info['hidden']} is not divisible by heads={heads}; "
                         f"set {src}.heads to a divisor of it (e.g. {divisors[-3:]})")
    width = teacher_info["hidden"] if _needs_projection(student_info, teacher_info, heads, p.project) \
        else student_info["hidden"]
    if width % heads:
        raise ValueError(f"the student's width {student_info['hidden']} is not divisible by heads={heads} and "
                         f"project=never; set {src}.project=auto (a learned projection to the teacher's width) "
                         "or choose heads dividing both widths")
    if not _layers(layer_pairs, p.boundary, p.hierarchical, p.level == "sample"):
        where = "from" if p.level == "sample" else "below"
        raise ValueError(
            f"no student layer {where} the boundary M={p.boundary} among the layer pairs {layer_pairs}, so {term} "
            f"has nothing to distil; change {src}.boundary, or switch the term off ({src}.{p.level}=false)")


# ------------------------------------------------------------------------------------------- terms

def _hidden(s: Features, t: Features, term: str):
    hs, ht = s.require("hidden_states"), t.require("hidden_states")
    if hs[0].shape[:2] != ht[0].shape[:2]:
        raise RuntimeError(f"{term}: student and teacher token sequences differ ({tuple(hs[0].shape[:2])} vs "
                           f"{tuple(ht[0].shape[:2])}); both models must share the tokenizer")
    return hs, ht, s.attention_mask.bool()


def _stacked(hs, ht, pairs, dt: torch.dtype, module) -> tuple[torch.Tensor, torch.Tensor]:
    """The paired layers stacked: student (L, B, n, d) through the term's projection, teacher (L, B, n, dt)."""
    xs = torch.stack([hs[si].to(dt) for si, _ in pairs])
    with torch.no_grad():
        xt = torch.stack([ht[ti].to(dt) for _, ti in pairs])
    return (module(xs) if module is not None else xs), xt


def _within_examples(hs, ht, pairs, module, points, mask, parts: dict, **kw) -> torch.Tensor:
    """Token / span level: Σ over ``pairs`` of the pair + angle losses among ``points(h)`` (B, n', d).

    ``parts`` receives the pair and angle sums (for the module's log).
    """
    dt = relation_dtype(hs[0])
    if pairs:
        xs, xt = _stacked(hs, ht, pairs, dt, module)
        lp, la = _structure(points(torch.cat([xs, xt], -1)), xs.shape[-1], mask,  # both sides at once
                            weights=getattr(module, "pair_weights", None), **kw)
    else:
        lp = la = hs[0].to(dt).sum() * 0.0  # (no layer pair: 0, still on the graph)
    parts.update({k: v for k, v in (("pair", lp), ("angle", la)) if kw[k]})
    return lp + la


def _structure_kw(p: TokenParams) -> dict:
    return {"heads": p.heads, "pair": p.pair, "angle": p.angle, "k1": p.k1, "k2": p.k2, "huber_beta": p.huber_beta}


@register_loss("mgskd_token", params=TokenParams, needs={"hidden_states"}, module=_factory, check=_check)
def mgskd_token(s: Features, t: Features, batch, ctx: LossContext, p: TokenParams) -> torch.Tensor:
    """MGSKD token level: Σ over layer pairs below M of MSE(pair interactions) + Huber(salient angles)."""
    hs, ht, mask = _hidden(s, t, "mgskd_token")
    parts: dict[str, torch.Tensor] = {}
    with full_precision(hs[0].device):
        total = _within_examples(hs, ht, _layers(ctx.layer_pairs, p.boundary, p.hierarchical, top=False),
                                 ctx.module, lambda x: x, mask, parts, **_structure_kw(p))
    ctx.parts.update(parts)
    return total


@register_loss("mgskd_span", params=SpanParams, needs={"hidden_states", "spans"}, teacher_needs={"hidden_states"},
               module=_factory, check=_check)
def mgskd_span(s: Features, t: Features, batch, ctx: LossContext, p: SpanParams) -> torch.Tensor:
    """MGSKD span level: as the token level among span means; examples with < min_spans spans left out."""
    hs, ht, _ = _hidden(s, t, "mgskd_span")
    spans = s.require("spans").to(hs[0].device)
    smask = span_mask(spans, p.min_spans)
    parts: dict[str, torch.Tensor] = {}
    with full_precision(hs[0].device):
        w = span_weights(spans, hs[0].shape[-2], relation_dtype(hs[0]))  # shared by both sides
        total = _within_examples(hs, ht, _layers(ctx.layer_pairs, p.boundary, p.hierarchical, top=False),
                                 ctx.module, lambda x: w @ x, smask, parts, **_structure_kw(p))
    ctx.parts.update(parts, examples=smask.any(-1).float().sum())
    return total


@register_loss("mgskd_sample", params=SampleParams, needs={"hidden_states"}, module=_factory, check=_check)
def mgskd_sample(s: Features, t: Features, batch, ctx: LossContext, p: SampleParams) -> torch.Tensor:
    """MGSKD sample level: Σ over layer pairs from M up of Huber(angles among the batch's mean-pooled
    samples, all triples, in each of the m heads) [+ MSE(their pair interactions)]."""
    hs, ht, mask = _hidden(s, t, "mgskd_sample")
    module = ctx.module
    dt = relation_dtype(hs[0])
    pairs = _layers(ctx.layer_pairs, p.boundary, p.hierarchical, top=True)
    parts: dict[str, torch.Tensor] = {}
    with full_precision(hs[0].device):
        if pairs:  # every pair at once: the paired layers stacked, (L, B, d) samples of both sides side by side
            xs, xt = _stacked(hs, ht, pairs, dt, module)
            ds, v = xs.shape[-1], sample_points(torch.cat([xs, xt], -1), mask)
            if p.angle:  # (L, m, B, d/m): one point set per layer and head
                parts["angle"] = _sample_angles(v, ds, p.heads, p.huber_beta)
            if p.pair:  # one point set per layer: every sample valid
                ones = v.new_ones((1, v.shape[-2]), dtype=torch.bool)
                parts["pair"] = _pair_mse(v[:, None], ds, ones, p.heads, getattr(module, "pair_weights", None))
        else:  # no layer pair: 0, still on the graph
            parts = dict.fromkeys([k for k in ("pair", "angle") if getattr(p, k)], hs[0].to(dt).sum() * 0.0)
        ctx.parts.update(parts)
        lp, la = parts.get("pair"), parts.get("angle")
        return la if lp is None else lp if la is None else lp + la


# ---------------------------------------------------------------------------------------- stage 2

REGRESSION = ("finetune", "kd")


def _regression(value: str) -> str | None:
    if value in REGRESSION:
        return None
    return ("must be finetune (MSE to the gold score, the paper's STS-B setting) or kd (MSE to the teacher's "
            "output)")


@dataclass(frozen=True)
class PredictionParams(Temperature):
    objective = "mgskd"
    regression: str = param("finetune", check=_regression)


@register_loss("mgskd_prediction", params=PredictionParams, uses_labels=True)
def mgskd_prediction(s: Features, t: Features, batch, ctx: LossContext, p: PredictionParams) -> torch.Tensor:
    """MGSKD stage 2: T²·KL(p_t‖p_s) at temperature T; regression tasks (STS-B): MSE to the gold score
    (``regression=finetune``, the paper fine-tunes STS-B instead of distilling predictions) or to the
    teacher's output (``kd``)."""
    if ctx.regression and p.regression == "finetune":
        return regression_mse(s.logits, batch["labels"])
    return logit_kd(s, t, batch, ctx, p)  # p is a Temperature (a new one per call breaks a compiled graph)
