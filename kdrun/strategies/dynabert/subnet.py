"""Sub-networks of one BERT at a width and a depth multiplier, without copying weights.

Width m_w keeps the first ``ceil(m_w * heads)`` attention heads and the first ``ceil(m_w * ffn)``
FFN neurons of every layer (after rewiring these are the most important ones). Depth m_d keeps the
layers of DynaBERT's rule (Hou et al., 2020): with L layers numbered d = 0..L-1, drop every layer
with ``(d + 1) mod (1 / (1 - m_d)) == 0``, i.e. every (1/(1-m_d))-th layer counted from the bottom
(m_d = 0.5 drops layers 2, 4, 6, ...; m_d = 0.75 drops layers 4, 8, 12, ... in 1-based numbering).
So ``1 / (1 - m_d)`` must be an integer >= 2, or m_d = 1.0 (all layers).

:func:`subnetwork` runs the model as that sub-network: inside the ``with`` block every Q/K/V
projection computes ``F.linear(x, W[:k*dh], b[:k*dh])``, the attention output projection reads only
the kept heads' columns ``W[:, :k*dh]``, the FFN's two linear layers are cut the same way, and the
encoder's layer list holds only the kept layers (the same module objects). Slices are views, so
gradients flow into the full shared weights. Hugging Face's BERT attention splits its projections
with ``view(..., -1, head_dim)``, so fewer heads need no other change, under SDPA and eager alike.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch.nn.functional as F
from torch import nn

from kdrun.errors import ConfigError
from kdrun.models.adaptors import find_adaptor

# Families whose layers have BERT's layout: attention.self.{query,key,value}, attention.output.dense,
# intermediate.dense, output.dense.
FAMILIES = ("bert", "roberta", "electra")
# FLOPs are counted per example at this sequence length (DynaBERT and CKD report FLOPs at 128).
FLOPS_SEQ_LEN = 128


# --------------------------------------------------------------------------------------- the rules

def depth_step(m_d: float) -> int | None:
    """k = 1 / (1 - m_d) of DynaBERT's depth rule (None for m_d = 1: nothing is dropped).

    Raises ValueError unless k is an integer >= 2 (within 1e-6)."""
    if not 0.0 < m_d <= 1.0:
        raise ValueError(f"{m_d} must be in (0, 1]")
    if abs(m_d - 1.0) < 1e-9:
        return None
    k = 1.0 / (1.0 - m_d)
    if abs(k - round(k)) > 1e-6 or round(k) < 2:
        raise ValueError(
            f"{m_d}: DynaBERT's rule drops every (1/(1-m_d))-th layer, so 1/(1-m_d) must be an integer >= 2 "
            "(m_d = 0.5, 0.6667, 0.75, 0.8, ...) or m_d = 1.0")
    return int(round(k))


def kept_layers(num_layers: int, m_d: float) -> list[int]:
    """0-based indices of the layers depth multiplier ``m_d`` keeps (DynaBERT's rule, module doc)."""
    k = depth_step(m_d)
    return [d for d in range(num_layers) if k is None or (d + 1) % k != 0]


def kept_count(total: int, m_w: float) -> int:
    """ceil(m_w * total), at least 1 (heads or FFN neurons kept by width multiplier ``m_w``)."""
    if not 0.0 < m_w <= 1.0:
        raise ValueError(f"width multiplier {m_w} must be in (0, 1]")
    return max(1, math.ceil(m_w * total - 1e-9))


# ---------------------------------------------------------------------------------------- structure

@dataclass(frozen=True)
class Shape:
    """Sizes of a BERT-layout model: layers L, hidden d, heads H, head dim dh, FFN neurons f, labels C."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    labels: int
    vocab: int
    positions: int
    token_types: int


def _base(model: nn.Module) -> nn.Module:
    model = getattr(model, "module", model)  # DistributedDataParallel
    return getattr(model, model.base_model_prefix)


def check_model(model: nn.Module, what: str = "adaptive training") -> None:
    """Raise ConfigError unless ``model`` has BERT's layer layout (the families in FAMILIES)."""
    adaptor = find_adaptor(getattr(model, "module", model))
    if adaptor is None or adaptor.family not in FAMILIES:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"{what} slices BERT-layout layers ({', '.join(FAMILIES)}); the student is '{family}'. "
                          "Use a student of one of those families (e.g. student=truncated of a BERT teacher)")


def layer_list(model: nn.Module) -> nn.ModuleList:
    return _base(model).encoder.layer


def shape_of(model: nn.Module) -> Shape:
    c = getattr(model, "module", model).config
    attn = layer_list(model)[0].attention.self
    emb = _base(model).embeddings
    tt = getattr(emb, "token_type_embeddings", None)
    return Shape(layers=len(layer_list(model)), hidden=int(c.hidden_size), heads=int(attn.query.out_features
                 // attn.attention_head_size), head_dim=int(attn.attention_head_size),
                 ffn=int(layer_list(model)[0].intermediate.dense.out_features), labels=int(c.num_labels),
                 vocab=int(emb.word_embeddings.num_embeddings), positions=int(emb.position_embeddings.num_embeddings),
                 token_types=int(tt.num_embeddings) if tt is not None else 0)


# -------------------------------------------------------------------------------------- sub-network

def _install_output_hooks(model: nn.Module) -> None:
    """Transformers 5 records hidden states with hooks installed on the modules present at the first
    forward; install them now, while every layer is in the tree, or layers dropped in a first
    sub-network call would never report their outputs."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # older transformers collect hidden states in the encoder's loop
        return
    maybe_install_capturing_hooks(getattr(model, "module", model))


def _slice_linear(lin: nn.Linear, rows: int | None = None, cols: int | None = None) -> None:
    """Shadow ``lin.forward`` with one that uses the first ``rows`` output rows / ``cols`` input columns."""
    def forward(x):
        w, b = lin.weight, lin.bias
        if rows is not None:
            w = w[:rows]
            b = b[:rows] if b is not None else None
        if cols is not None:
            w = w[:, :cols]
        return F.linear(x, w, b)

    object.__setattr__(lin, "forward", forward)


@contextmanager
def subnetwork(model: nn.Module, width: float = 1.0, depth: float = 1.0) -> Iterator[dict]:
    """Run ``model`` as its (width, depth) sub-network inside the block (module doc); yields its sizes
    ``{"heads", "ffn", "layers"}`` (``layers``: the kept 0-based layer indices)."""
    check_model(model)
    shape = shape_of(model)
    heads, ffn = kept_count(shape.heads, width), kept_count(shape.ffn, width)
    keep = kept_layers(shape.layers, depth)
    base = _base(model)
    full = base.encoder.layer
    _install_output_hooks(model)
    patched: list[nn.Linear] = []
    try:
        if width < 1.0:
            q = heads * shape.head_dim
            for layer in full:
                a = layer.attention
                for lin, rows, cols in ((a.self.query, q, None), (a.self.key, q, None), (a.self.value, q, None),
                                        (a.output.dense, None, q), (layer.intermediate.dense, ffn, None),
                                        (layer.output.dense, None, ffn)):
                    _slice_linear(lin, rows, cols)
                    patched.append(lin)
        if len(keep) < len(full):
            # nn.Module.__setattr__ registers the sub-list; the original list object is put back below
            base.encoder.layer = nn.ModuleList([full[i] for i in keep])
        yield {"heads": heads, "ffn": ffn, "layers": keep}
    finally:
        base.encoder.layer = full
        for lin in patched:
            lin.__dict__.pop("forward", None)


def subnet_pairs(pairs: list[tuple[int, int]], kept: list[int]) -> list[tuple[int, int]]:
    """(student, teacher) hidden-state pairs for a depth sub-network keeping 0-based layers ``kept``:
    each kept layer keeps its teacher, renumbered to the sub-network's hidden states (embeddings stay
    0); pairs of dropped layers are left out."""
    pos = {0: 0, **{d + 1: j + 1 for j, d in enumerate(kept)}}
    return [(pos[s], t) for s, t in pairs if s in pos]


# ------------------------------------------------------------------------------------ counts

def count_params(shape: Shape, width: float = 1.0, depth: float = 1.0, embeddings: bool = True) -> int:
    """Parameters of the (width, depth) sub-network: embeddings (word, position, token type, LayerNorm),
    per kept layer Q/K/V/O with biases on the kept heads, two LayerNorms, the FFN's kept neurons, and the
    pooler and classifier."""
    d, dh, c = shape.hidden, shape.head_dim, shape.labels
    a = kept_count(shape.heads, width) * dh
    f = kept_count(shape.ffn, width)
    per_layer = 3 * (d * a + a) + (a * d + d) + 2 * d + (d * f + f) + (f * d + d) + 2 * d
    n = len(kept_layers(shape.layers, depth)) * per_layer + (d * d + d) + (d * c + c)
    if embeddings:
        n += (shape.vocab + shape.positions + shape.token_types) * d + 2 * d
    return n


def count_flops(shape: Shape, width: float = 1.0, depth: float = 1.0, seq_len: int = FLOPS_SEQ_LEN) -> int:
    """FLOPs of one example of ``seq_len`` tokens, 2 per multiply-add of the matrix products: per kept
    layer Q/K/V and output projections ``4 * 2 n d a`` (a = kept heads * head dim), attention scores and
    the weighted sum of values ``2 * 2 n^2 a``, the FFN ``2 * 2 n d f``; plus pooler ``2 d^2`` and
    classifier ``2 d C``. Embedding lookups, biases, softmax, GELU and LayerNorm are left out."""
    n, d, c = seq_len, shape.hidden, shape.labels
    a = kept_count(shape.heads, width) * shape.head_dim
    f = kept_count(shape.ffn, width)
    per_layer = 8 * n * d * a + 4 * n * n * a + 4 * n * d * f
    return len(kept_layers(shape.layers, depth)) * per_layer + 2 * d * d + 2 * d * c
