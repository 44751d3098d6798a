"""Model families: where each encoder keeps its layers, attention projections and sizes.

Loss terms see only a features record (kdrun/models/features.py); building one, truncating a model and
describing it needs to know the family's module layout. One :class:`Adaptor` per
``config.model_type`` says so: BERT, RoBERTa, DistilBERT, ELECTRA and DeBERTa-v2.

Every family gives logits, hidden states (L+1 of (B, n, d), index 0 the embedding output that
enters layer 1), attention probabilities (eager attention), Q/K/V projections and pre-softmax
attention scores. What "pre-softmax scores" are:

- BERT, RoBERTa, DistilBERT, ELECTRA: Q K^T / sqrt(d_head) (scaled dot product; Vaswani et al., 2017).
- DeBERTa-v2: disentangled attention (He et al., 2021) adds content-to-position and
  position-to-content terms and scales everything by 1 / sqrt(d_head * (1 + #relative terms)). The
  scores are the whole logit the softmax sees: Q K^T times that scale plus the relative-position
  terms, captured from the layer's own computation, so they reproduce its attention probabilities.
  They are not a plain query-key product, so score-matching terms (TinyBERT's attention loss,
  MiniLM's attention KL) compare a DeBERTa student's full logits with the teacher's.

Other families load and train with logit-only objectives; terms that read layers, Q/K/V or
scores refuse them by name (:func:`check_features`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

# Needs that read the encoder's layers (served only for families with an adaptor).
LAYER_NEEDS = frozenset({"hidden_states", "attentions", "qkv", "attention_scores"})


@dataclass(frozen=True)
class Adaptor:
    """Layer access of one model family (``config.model_type``)."""

    family: str
    config_class: str  # transformers config class for random models
    layers_path: tuple[str, ...]  # attributes from the base model to the layer ModuleList
    layers_field: str  # config fields: layer count, width, heads (native names)
    hidden_field: str
    heads_field: str
    projections: tuple[str, str, str]  # Q, K, V linear layers inside the self-attention module
    heads_attr: str  # head count attribute of the self-attention module
    token_types: bool = True  # takes token_type_ids (when its type vocabulary has ≥ 2 entries)
    sdpa: bool = True  # has an SDPA attention implementation
    dropout_fields: tuple[str, ...] = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    random_fields: Callable[[Any, int], dict[str, Any]] = field(default=lambda cfg, pad: {})
    scores: str = "Q K^T / sqrt(d_head)"

    def base(self, model: nn.Module) -> nn.Module:
        """The encoder inside a model with a head, or the model itself when it is the bare encoder."""
        return getattr(model, model.base_model_prefix, model)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The encoder's transformer layers, in order."""
        owner = self.base(model)
        for name in self.layers_path:
            owner = getattr(owner, name)
        return owner

    def set_layers(self, model: nn.Module, layers: list[nn.Module]) -> None:
        """Replace the layer list (truncation) and keep the config's layer count in step."""
        owner = self.base(model)
        for name in self.layers_path[:-1]:
            owner = getattr(owner, name)
        setattr(owner, self.layers_path[-1], nn.ModuleList(layers))
        setattr(model.config, self.layers_field, len(layers))
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: len(layers)]

    def attention(self, layer: nn.Module) -> nn.Module | None:
        """The self-attention module of ``layer``: the one holding the Q/K/V projections."""
        return next((m for m in layer.modules()
                     if all(isinstance(getattr(m, n, None), nn.Linear) for n in self.projections)), None)

    def scaling(self, attn: nn.Module) -> float:
        """Factor of Q K^T in the pre-softmax scores."""
        return float(attn.scaling)

    def score_bias(self, attn: nn.Module, store: list[Any], i: int):
        """Capture what the layer adds to the scaled Q K^T (None: nothing); returns a handle or None."""
        return None

    def sizes(self, config: Any) -> dict[str, int]:
        return {"layers": int(getattr(config, self.layers_field)), "hidden": int(getattr(config, self.hidden_field)),
                "heads": int(getattr(config, self.heads_field))}

    def uses_token_types(self, config: Any) -> bool:
        return self.token_types and int(getattr(config, "type_vocab_size", 0) or 0) >= 2


class _AttributePatch:
    """Shadows a module's method with a wrapper on the instance until :meth:`remove`."""

    def __init__(self, module: nn.Module, name: str, wrapper: Callable[..., Any]):
        self.module, self.name = module, name
        object.__setattr__(module, name, wrapper)

    def remove(self) -> None:
        self.module.__dict__.pop(self.name, None)


@dataclass(frozen=True)
class DebertaV2Adaptor(Adaptor):
    """Disentangled attention: the relative-position terms are captured where the layer computes them."""

    def scaling(self, attn: nn.Module) -> float:
        factor = 1 + sum(t in attn.pos_att_type for t in ("c2p", "p2c"))
        return 1.0 / math.sqrt(attn.attention_head_size * factor)

    def score_bias(self, attn: nn.Module, store: list[Any], i: int):
        if not attn.relative_attention:
            return None
        compute = attn.disentangled_attention_bias  # already divided by the same scale as Q K^T

        def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = compute(*args, **kwargs)
            store[i] = out
            return out

        return _AttributePatch(attn, "disentangled_attention_bias", wrapper)


def _bert_like(cfg: Any, pad: int) -> dict[str, Any]:
    p = 0.1 if cfg.dropout is None else cfg.dropout
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": 512, "pad_token_id": pad, "hidden_dropout_prob": p,
            "attention_probs_dropout_prob": p}


def _roberta(cfg: Any, pad: int) -> dict[str, Any]:
    # Position ids start after the padding index (padding_idx + 1 + i), so 512 tokens need 513 + pad
    # positions; one token type, as in RoBERTa (Liu et al., 2019): segment ids are not passed.
    return _bert_like(cfg, pad) | {"max_position_embeddings": 512 + pad + 1, "type_vocab_size": 1}


def _electra(cfg: Any, pad: int) -> dict[str, Any]:
    return _bert_like(cfg, pad) | {"embedding_size": cfg.hidden_size}


def _distilbert(cfg: Any, pad: int) -> dict[str, Any]:
    p = 0.1 if cfg.dropout is None else cfg.dropout
    return {"dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
            "hidden_dim": cfg.intermediate_size, "max_position_embeddings": 512, "pad_token_id": pad,
            "dropout": p, "attention_dropout": p, "seq_classif_dropout": p}


def _deberta_v2(cfg: Any, pad: int) -> dict[str, Any]:
    # DeBERTa-v3's layout (He et al., 2023): relative attention with both disentangled terms,
    # bucketed relative positions, no absolute position input, no token types.
    return _bert_like(cfg, pad) | {"relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                                   "position_biased_input": False, "position_buckets": 256,
                                   "max_relative_positions": -1, "norm_rel_ebd": "layer_norm",
                                   "share_att_key": True, "type_vocab_size": 0}


_BERT_SIZES = {"layers_field": "num_hidden_layers", "hidden_field": "hidden_size",
               "heads_field": "num_attention_heads"}
_BERT_ATTN = {"projections": ("query", "key", "value"), "heads_attr": "num_attention_heads"}

ADAPTORS: dict[str, Adaptor] = {a.family: a for a in (
    Adaptor("bert", "BertConfig", ("encoder", "layer"), **_BERT_SIZES, **_BERT_ATTN, random_fields=_bert_like),
    Adaptor("roberta", "RobertaConfig", ("encoder", "layer"), **_BERT_SIZES, **_BERT_ATTN, random_fields=_roberta),
    Adaptor("electra", "ElectraConfig", ("encoder", "layer"), **_BERT_SIZES, **_BERT_ATTN, random_fields=_electra),
    Adaptor("distilbert", "DistilBertConfig", ("transformer", "layer"), "n_layers", "dim", "n_heads",
            ("q_lin", "k_lin", "v_lin"), "n_heads", token_types=False,
            dropout_fields=("dropout", "attention_dropout"), random_fields=_distilbert),
    DebertaV2Adaptor("deberta-v2", "DebertaV2Config", ("encoder", "layer"), **_BERT_SIZES,
                     projections=("query_proj", "key_proj", "value_proj"), heads_attr="num_attention_heads",
                     sdpa=False, random_fields=_deberta_v2,
                     scores="Q K^T / sqrt(3 d_head) + c2p + p2c (the full disentangled logits)"),
)}


def family_of(model_or_config: Any) -> str:
    model = getattr(model_or_config, "module", model_or_config)  # DistributedDataParallel
    config = getattr(model, "config", model)
    return str(getattr(config, "model_type", type(model).__name__))


def get_adaptor(model_or_config: Any, *, needed_for: str | None = None) -> Adaptor:
    """The adaptor of a model or config; unknown families fail naming what needed them."""
    family = family_of(model_or_config)
    if family in ADAPTORS:
        return ADAPTORS[family]
    what = f"{needed_for} needs layer access, which kdrun has" if needed_for else "kdrun has layer access"
    raise ValueError(f"model family '{family}': {what} for {', '.join(ADAPTORS)} only; "
                     "choose a model of one of those families or an objective that reads logits only")


def find_adaptor(model_or_config: Any) -> Adaptor | None:
    return ADAPTORS.get(family_of(model_or_config))


def check_family(family: str, role: str) -> None:
    """A ``random`` model's ``family`` key must name a registered family."""
    if family not in ADAPTORS:
        raise ValueError(f"{role}.family='{family}' is not one of {', '.join(ADAPTORS)}")


def check_features(plans: list[Any], student: nn.Module, teacher: nn.Module | None) -> None:
    """Fail before training when a loss term needs layer features a model's family cannot give."""
    for role, model in (("student", student), ("teacher", teacher)):
        if model is None or find_adaptor(model) is not None:
            continue
        for term in (t for plan in plans for t in plan.terms):
            needs = (term.spec.needs if role == "student" else term.spec.teacher_needs) & LAYER_NEEDS
            if needs:
                get_adaptor(model, needed_for=f"loss '{term.spec.name}' ({role} {', '.join(sorted(needs))})")


def random_config(cfg: Any, vocab_size: int, num_labels: int, pad_token_id: int = 0):
    """A transformers config of family ``cfg.family`` with the sizes of a ``random`` model config."""
    import transformers

    family = getattr(cfg, "family", None) or "bert"
    check_family(family, "model")
    adaptor = ADAPTORS[family]
    config_cls = getattr(transformers, adaptor.config_class)
    return config_cls(vocab_size=vocab_size, num_labels=num_labels, **adaptor.random_fields(cfg, pad_token_id))
