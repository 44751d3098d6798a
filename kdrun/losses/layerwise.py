"""Layer-matching loss terms over the mapping group, and the pieces TinyBERT and MiniLM share.

Terms (as described by Passban et al. 2021 and Jassani, Dankar & Kumar):

- ``pkd_patience`` (PKD): MSE between L2-normalised [CLS] vectors of student layer j and its mapped
  teacher representation; mean over examples, dimensions and layers, as PKD's official code.
- ``hidden_cosine`` (DistilBERT): 1 − cos between student and mapped teacher hidden states, mean over
  real tokens, summed over mapped layers (embeddings included when the mapping includes them).
- ``alp`` (ALP-KD): MSE between student [CLS] vectors and the mapped teacher combination
  (``mapping=attention``: C_j = Σ_k α_jk h_t^k, α = softmax_k(h_s^j · h_t^k) per example);
  mean over examples and dimensions, summed over layers.
- ``comb`` (combinatorial KD): MSE between student [CLS] vectors and a learned linear projection (to
  the student's width) of the mapped teacher representation (``mapping=concat``: the concatenation of
  the bucket's layers).

Which teacher layers each student layer learns from is the mapping's business
(:mod:`kdrun.models.mapping`); the terms ask ``ctx.layer_map`` for each row's target. ``pkd_patience``,
``alp`` and ``comb`` match transformer layers only and, by default, leave the student's last layer
unmatched (``match_last: false``, as PKD and ALP-KD: the logits already cover it). They also name
the map their paper uses (``mapping`` / ``buckets``: skip; attention over all layers; concat over
NO buckets), which applies while the ``mapping`` group is at its default (uniform); a mapping
chosen on the command line (``mapping=mean``) replaces it, ``mapping: null`` defers to the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kdrun.losses.hidden import masked_mean
from kdrun.losses.registry import LossContext, Params, param, register_loss
from kdrun.models.features import Features, fp32, no_autocast
from kdrun.models.mapping import BUCKETS, MAPPINGS, LayerMap, MappedPairs, Row, pairs_map

PROJECTIONS = ("none", "shared", "per_layer")
ONE_TO_ONE, WEIGHTED, PER_SAMPLE, CONCAT = "pairs", "weights", "sample", "concat"


LAYER_MAP_KINDS = frozenset({ONE_TO_ONE, WEIGHTED, PER_SAMPLE})  # what the mapped() helper handles


@dataclass(frozen=True)
class ProjectionParams(Params):
    """``projection``: learned linear maps of student vectors to the teacher's width (or none)."""

    projection: str = param("none", choices=PROJECTIONS)


def _map_param(default: str | None) -> object:
    return param(default, choices=(*MAPPINGS, None))


def _buckets_param(default: str | None) -> object:
    return param(default, choices=(*BUCKETS, None))


# ------------------------------------------------------------------------------------ helpers

def layer_map_of(ctx: LossContext) -> LayerMap:
    """The context's map; a fixed map of ``ctx.layer_pairs`` when a caller gave only pairs."""
    return ctx.layer_map if ctx.layer_map is not None else pairs_map(ctx.layer_pairs)


def cls(h: torch.Tensor) -> torch.Tensor:
    """(B, n, d) -> (B, d): the first token's vector ([CLS])."""
    return h[:, 0]


def mapped(s: Features, t: Features, ctx: LossContext, rep: Callable[[torch.Tensor], torch.Tensor],
           project: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
           embeddings: bool = True) -> Iterator[tuple[Row, torch.Tensor, torch.Tensor]]:
    """For each row of the map: (row, student rep (projected), teacher target), in fp32.

    ``rep`` turns a hidden state into the compared representation ([CLS] vector, all tokens);
    ``project(x, student_layer)`` maps student reps to the teacher's width; ``embeddings=False``
    skips the embedding row (student layer 0).
    """
    hs, ht = s.require("hidden_states"), t.require("hidden_states")
    lmap = layer_map_of(ctx)
    weights = lmap.row_weights(ctx.step)
    for i, row in enumerate(lmap.rows):
        if row.student == 0 and not embeddings:
            continue
        xs = fp32(rep(hs[row.student]))
        if project is not None:
            xs = fp32(project(xs, row.student))
        target = lmap.target(i, lambda layer: fp32(rep(ht[layer])), student_rep=xs, step=ctx.step,
                             weights=weights)
        yield row, xs, target


def student_layers(pairs: MappedPairs | list, embeddings: bool = True) -> list[int]:
    rows = pairs.layer_map.rows if isinstance(pairs, MappedPairs) and pairs.layer_map is not None else \
        [Row(s, (t,)) for s, t in pairs]
    return sorted({r.student for r in rows if embeddings or r.student > 0})


def _identity_(lin: nn.Linear) -> None:
    with torch.no_grad():
        lin.weight.copy_(torch.eye(lin.out_features, lin.in_features))
        lin.bias.zero_()


class Projections(nn.Module):
    """Learned linear maps of student vectors to the teacher's width: one shared by every student
    layer (TinyBERT's official code) or one per student layer. When the widths are equal they start
    as the identity, so a truncated student keeps its initial alignment with the teacher."""

    def __init__(self, layers: list[int], d_in: int, d_out: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode == "shared":
            self.proj = nn.Linear(d_in, d_out)
            lins = [self.proj]
        else:
            self.per_layer = nn.ModuleDict({str(layer): nn.Linear(d_in, d_out) for layer in layers})
            lins = list(self.per_layer.values())
        if d_in == d_out:
            for lin in lins:
                _identity_(lin)

    def forward(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """(..., d_in) -> (..., d_out) in the weights' precision (fp32), autocast off."""
        lin = self.proj if self.mode == "shared" else self.per_layer[str(layer)]
        with no_autocast(x.device):
            return lin(x.to(lin.weight.dtype))


def check_projection(term: str, projection: str, student_info: dict, teacher_info: dict) -> None:
    if projection == "none" and student_info["hidden"] != teacher_info["hidden"]:
        raise ValueError(
            f"{term} compares student and teacher vectors directly, but the student's width is "
            f"{student_info['hidden']} and the teacher's {teacher_info['hidden']}; use a student of the "
            "teacher's width (student=truncated) or configure a projection "
            "(objective.params.projection=shared or per_layer: learned linear maps to the teacher's width)")


def check_attention_map_width(term: str, pairs: Any, d_student: int, d_teacher: int) -> None:
    lmap = getattr(pairs, "layer_map", None)
    if lmap is not None and lmap.kind == PER_SAMPLE and d_student != d_teacher:
        raise ValueError(
            f"{term} with mapping=attention weighs teacher layers by dot products with the student's vectors, "
            f"but their widths are {d_student} (student) and {d_teacher} (teacher); use equal widths or "
            "configure a projection (objective.params.projection=shared)")


def make_projections(student_info: dict, teacher_info: dict, pairs: Any, projection: str,
                     embeddings: bool) -> Projections | None:
    if projection == "none":
        return None
    return Projections(student_layers(pairs, embeddings), student_info["hidden"], teacher_info["hidden"], projection)


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last dim (keys) of (B, H, n, n) logits, padded keys (mask (B, n) == 0)
    excluded (their entries are -inf)."""
    key = mask.bool()[:, None, None, :]
    return fp32(logits).masked_fill(~key, float("-inf")).log_softmax(-1)


def attention_kl(log_ps: torch.Tensor, pt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p_t || p_s) over keys, mean over heads and real query tokens of the batch.

    log_ps, pt: (B, H, n, n) student log-probabilities and teacher probabilities (0 at padded keys).
    """
    m = mask.bool()
    key = m[:, None, None, :]
    safe_log_ps = log_ps.masked_fill(~key, 0.0)
    per_query = torch.where(key, torch.xlogy(pt, pt) - pt * safe_log_ps, torch.zeros_like(pt)).sum(-1)
    return masked_average(per_query, m[:, None, :].expand_as(per_query))


def masked_average(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``valid`` (same shape, bool) holds; 0 when none does.

    A masked sum over a count, never ``x[valid]``: boolean indexing has a data-dependent shape, which
    makes the host wait for the device.
    """
    total = torch.where(valid, x, torch.zeros_like(x)).sum()
    return total / valid.sum().clamp_min(1).to(total.dtype)


def projection_check(term: str):
    """``check`` of a term that may project student vectors to the teacher's width (``projection``)."""

    def check(student_info, teacher_info, pairs, p: ProjectionParams) -> None:
        check_projection(term, p.projection, student_info, teacher_info)
        d = teacher_info["hidden"] if p.projection != "none" else student_info["hidden"]
        check_attention_map_width(term, pairs, d, teacher_info["hidden"])

    return check


def projection_module(embeddings: bool):
    """``module`` declaration building the term's :class:`Projections` (none when ``projection=none``)."""

    def build(student_info, teacher_info, pairs, p: ProjectionParams) -> Projections | None:
        return make_projections(student_info, teacher_info, pairs, p.projection, embeddings)

    return build


def relation_kl(rel_s: torch.Tensor, rel_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(softmax(rel_t) || softmax(rel_s)) of (B, H, n, n) relation logits over real keys, mean over
    heads and real queries (MiniLM's attention and value relations, TinyBERT's kl attention loss)."""
    return attention_kl(masked_log_softmax(rel_s, mask), masked_log_softmax(rel_t, mask).exp(), mask)


# --------------------------------------------------------------------------------------- PKD

@dataclass(frozen=True)
class PKDParams(ProjectionParams):
    """``match_last``: also match the student's last layer; ``mapping`` / ``buckets``: the paper's map,
    used while the mapping group is at its default (uniform)."""

    objective = "pkd"
    match_last: bool = False
    mapping: str | None = _map_param("skip")
    buckets: str | None = _buckets_param(None)


@register_loss("pkd_patience", params=PKDParams, needs={"hidden_states"}, map_kinds=LAYER_MAP_KINDS,
               check=projection_check("pkd_patience"), module=projection_module(embeddings=False))
def pkd_patience(s: Features, t: Features, batch, ctx: LossContext, p: PKDParams) -> torch.Tensor:
    """PKD: MSE of L2-normalised [CLS] vectors of mapped layers, mean over examples, dims and layers."""
    vals = [((F.normalize(xs, dim=-1) - F.normalize(tgt, dim=-1)) ** 2).mean()
            for _, xs, tgt in mapped(s, t, ctx, cls, ctx.module, embeddings=False)]
    return torch.stack(vals).mean()


# -------------------------------------------------------------------------------- DistilBERT

@dataclass(frozen=True)
class CosineParams(ProjectionParams):
    objective = "distilbert"


@register_loss("hidden_cosine", params=CosineParams, needs={"hidden_states"}, map_kinds=LAYER_MAP_KINDS,
               check=projection_check("hidden_cosine"), module=projection_module(embeddings=True))
def hidden_cosine(s: Features, t: Features, batch, ctx: LossContext, p: CosineParams) -> torch.Tensor:
    """DistilBERT: 1 − cos(h_s, h_t) over real tokens, summed over mapped layers."""
    total = s.attention_mask.new_zeros((), dtype=torch.float32)
    for _, xs, tgt in mapped(s, t, ctx, lambda h: h, ctx.module, embeddings=True):
        total = total + masked_mean(1.0 - F.cosine_similarity(xs, tgt, dim=-1), s.attention_mask)
    return total


# ------------------------------------------------------------------------------------ ALP-KD

@dataclass(frozen=True)
class ALPParams(PKDParams):
    objective = "alp"
    mapping: str | None = _map_param("attention")
    buckets: str | None = _buckets_param("all")


@register_loss("alp", params=ALPParams, needs={"hidden_states"}, map_kinds=LAYER_MAP_KINDS,
               check=projection_check("alp"), module=projection_module(embeddings=False))
def alp(s: Features, t: Features, batch, ctx: LossContext, p: ALPParams) -> torch.Tensor:
    """ALP-KD: Σ_j MSE(h_s^j, C_j) on [CLS] vectors; C_j from the mapping (attention: per-example α)."""
    vals = [((xs - tgt) ** 2).mean() for _, xs, tgt in mapped(s, t, ctx, cls, ctx.module, embeddings=False)]
    return torch.stack(vals).sum()


# -------------------------------------------------------------------------- combinatorial KD

class RowProjections(nn.Module):
    """One linear map per student layer from its (combined) teacher representation to the student's
    width; input widths differ per row under ``mapping=concat`` (k_j * d_t). A map from one layer of
    the student's width starts as the identity."""

    def __init__(self, in_dims: dict[int, int], d_out: int):
        super().__init__()
        self.per_layer = nn.ModuleDict({str(layer): nn.Linear(d, d_out) for layer, d in in_dims.items()})
        for lin in self.per_layer.values():
            if lin.in_features == d_out:
                _identity_(lin)

    def forward(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """(..., d_in of the row) -> (..., d_student) in the weights' precision (fp32), autocast off."""
        lin = self.per_layer[str(layer)]
        with no_autocast(x.device):
            return lin(x.to(lin.weight.dtype))


@dataclass(frozen=True)
class CombParams(Params):
    objective = "comb"
    match_last: bool = False
    mapping: str | None = _map_param("concat")
    buckets: str | None = _buckets_param("no")


def _check_comb(student_info, teacher_info, pairs, p: CombParams) -> None:
    check_attention_map_width("comb", pairs, student_info["hidden"], teacher_info["hidden"])


def _comb_module(student_info, teacher_info, pairs, p: CombParams) -> RowProjections:
    lmap = getattr(pairs, "layer_map", None) or pairs_map(pairs)
    d_t = teacher_info["hidden"]
    in_dims = {r.student: d_t * (len(r.teachers) if lmap.kind == CONCAT else 1) for r in lmap.rows if r.student > 0}
    return RowProjections(in_dims, student_info["hidden"])


@register_loss("comb", params=CombParams, needs={"hidden_states"}, map_kinds=LAYER_MAP_KINDS | {CONCAT},
               check=_check_comb, module=_comb_module)
def comb(s: Features, t: Features, batch, ctx: LossContext, p: CombParams) -> torch.Tensor:
    """Combinatorial KD: Σ_j MSE(h_s^j, W_j C_j) on [CLS] vectors; C_j = the bucket's concatenation
    under mapping=concat, projected to the student's width by a learned W_j."""
    vals = [((xs - fp32(ctx.module(tgt, row.student))) ** 2).mean()
            for row, xs, tgt in mapped(s, t, ctx, cls, None, embeddings=False)]
    return torch.stack(vals).sum()
