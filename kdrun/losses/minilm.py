"""MiniLM and MiniLMv2 losses (Wang et al. 2020; Wang et al. 2021).

Both compare one student layer with one teacher layer — by default the last of each (MiniLM's
choice; MiniLMv2 suggests an upper-middle teacher layer for large teachers: ``teacher_layer``).
Every relation is a per-head distribution over keys, compared with KL(teacher || student), averaged
over heads and real query tokens; padded keys take no probability.

- ``minilm_attention``: the attention distributions softmax(Q K^T / sqrt(d_k)) per attention head.
- ``minilm_value``: value relations softmax(V V^T / sqrt(d_k)) per attention head.
  Both compare head by head, so student and teacher need the same number of attention heads.
- ``minilmv2_qq``, ``minilmv2_kk``, ``minilmv2_vv``: the Q-Q, K-K and V-V self-relations
  softmax(X X^T / sqrt(d_r)) where X (all heads concatenated, width d) is split into
  ``relation_heads`` heads of width d_r = d / relation_heads — a number independent of the attention
  heads, so only the widths must be divisible by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdrun.losses.layerwise import relation_kl
from kdrun.losses.registry import LossContext, Params, param, positive_int, register_loss
from kdrun.models.features import Features, fp32, no_autocast

RELATIONS = {"query": "q", "key": "k", "value": "v"}


@dataclass(frozen=True)
class LayerParams(Params):
    """The layers compared (1..L; null: the last, as MiniLM)."""

    objective = "minilm"
    student_layer: int | None = param(None, check=positive_int)
    teacher_layer: int | None = param(None, check=positive_int)


@dataclass(frozen=True)
class V2Params(LayerParams):
    objective = "minilmv2"
    relation_heads: int = param(12, check=positive_int)


def _layers(s: Features, t: Features, p: LayerParams) -> tuple[int, int]:
    return (p.student_layer or s.qkv().num_layers, p.teacher_layer or t.qkv().num_layers)


def _check_layers(student_info, teacher_info, p: LayerParams) -> None:
    for who, info, layer in (("student", student_info, p.student_layer), ("teacher", teacher_info, p.teacher_layer)):
        if layer is not None and layer > info["layers"]:
            raise ValueError(
                f"params.{who}_layer={layer!r} but the {who} has {info['layers']} layers; choose "
                f"1..{info['layers']} or null (its last layer) (objective.params.{who}_layer)")


def _check_v1(term: str):
    def check(student_info, teacher_info, pairs, p: LayerParams) -> None:
        _check_layers(student_info, teacher_info, p)
        if student_info["heads"] != teacher_info["heads"]:
            raise ValueError(
                f"{term} (MiniLM v1) compares relations head by head, but the student has "
                f"{student_info['heads']} attention heads and the teacher {teacher_info['heads']}; use a student "
                "with the teacher's head count, or objective=minilmv2, whose relation heads do not depend on "
                "the attention heads")

    return check


def self_relation(x: torch.Tensor) -> torch.Tensor:
    """(B, h, n, d) -> (B, h, n, n) scaled dot products x x^T / sqrt(d), fp32 (also under autocast)."""
    x = fp32(x)
    with no_autocast(x.device):
        return torch.matmul(x, x.transpose(-1, -2)) / x.shape[-1] ** 0.5


@register_loss("minilm_attention", params=LayerParams, needs={"attention_scores"}, map_kinds=(),
               check=_check_v1("minilm_attention"))
def minilm_attention(s: Features, t: Features, batch, ctx: LossContext, p: LayerParams) -> torch.Tensor:
    """MiniLM: KL between the (last) layers' attention distributions, per head."""
    ls, lt = _layers(s, t, p)
    return relation_kl(s.attention_scores(ls), t.attention_scores(lt), s.attention_mask)


@register_loss("minilm_value", params=LayerParams, needs={"qkv"}, map_kinds=(), check=_check_v1("minilm_value"))
def minilm_value(s: Features, t: Features, batch, ctx: LossContext, p: LayerParams) -> torch.Tensor:
    """MiniLM: KL between value relations softmax(V V^T / sqrt(d_k)), per attention head."""
    ls, lt = _layers(s, t, p)
    return relation_kl(self_relation(s.qkv().heads_of("v", ls)), self_relation(t.qkv().heads_of("v", lt)),
                       s.attention_mask)


def _check_v2(student_info, teacher_info, pairs, p: V2Params) -> None:
    _check_layers(student_info, teacher_info, p)
    relation_heads = p.relation_heads
    bad = [f"{who} {info['hidden']}" for who, info in (("student", student_info), ("teacher", teacher_info))
           if info["hidden"] % relation_heads]
    if bad:
        raise ValueError(
            f"MiniLMv2 splits Q/K/V into relation_heads={relation_heads} heads, which must divide both "
            f"widths (not {', '.join(bad)}); set objective.params.relation_heads to a common divisor of "
            f"{student_info['hidden']} and {teacher_info['hidden']}")


def minilmv2_relation(s: Features, t: Features, relation: str, p: V2Params) -> torch.Tensor:
    """MiniLMv2: KL between Q-Q, K-K or V-V self-relations over ``relation_heads`` relation heads."""
    ls, lt = _layers(s, t, p)
    which = RELATIONS[relation]
    return relation_kl(self_relation(s.qkv().heads_of(which, ls, p.relation_heads)),
                       self_relation(t.qkv().heads_of(which, lt, p.relation_heads)), s.attention_mask)


@register_loss("minilmv2_qq", params=V2Params, needs={"qkv"}, map_kinds=(), check=_check_v2)
def minilmv2_qq(s: Features, t: Features, batch, ctx: LossContext, p: V2Params) -> torch.Tensor:
    """MiniLMv2 query-query relation KL over relation heads."""
    return minilmv2_relation(s, t, "query", p)


@register_loss("minilmv2_kk", params=V2Params, needs={"qkv"}, map_kinds=(), check=_check_v2)
def minilmv2_kk(s: Features, t: Features, batch, ctx: LossContext, p: V2Params) -> torch.Tensor:
    """MiniLMv2 key-key relation KL over relation heads."""
    return minilmv2_relation(s, t, "key", p)


@register_loss("minilmv2_vv", params=V2Params, needs={"qkv"}, map_kinds=(), check=_check_v2)
def minilmv2_vv(s: Features, t: Features, batch, ctx: LossContext, p: V2Params) -> torch.Tensor:
    """MiniLMv2 value-value relation KL over relation heads."""
    return minilmv2_relation(s, t, "value", p)
