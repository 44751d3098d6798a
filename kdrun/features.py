"""The features record that teacher and student both produce, and that loss terms consume.

Loss terms never look inside a model: they see only a :class:`Features` record. What a record
holds is decided by the union of the loss terms' declared needs, so hidden states and attentions
are computed only when some term asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

# Names a loss term may list in ``needs``.
KNOWN_NEEDS = frozenset({"logits", "hidden_states", "attentions", "spans"})
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class Features:
    """What one forward pass exposes.

    logits: (B, C) class logits, or (B, 1) regression outputs.
    hidden_states: tuple of L+1 tensors (B, n, d); index 0 is the embedding output.
    attentions: tuple of L tensors (B, h, n, n) of attention probabilities (eager attention only).
    attention_mask: (B, n), 1 for real tokens.
    spans: per-example span index tensors when the data provides them.
    extra: room for features later objectives add (e.g. pre-softmax scores from hooks).
    """

    logits: torch.Tensor
    attention_mask: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    spans: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def require(self, name: str) -> Any:
        value = getattr(self, name, None) if name != "extra" else self.extra
        if value is None:
            raise RuntimeError(
                f"features record has no '{name}': the loss term that reads it must declare "
                f"needs={{'{name}'}} in its @register_loss decorator"
            )
        return value


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def extract_features(model: nn.Module, batch: Mapping[str, Any], needs: frozenset[str]) -> Features:
    """Run ``model`` on ``batch`` and collect the features in ``needs``."""
    out = model(
        **model_inputs(batch),
        output_hidden_states="hidden_states" in needs,
        output_attentions="attentions" in needs,
        return_dict=True,
    )
    attentions = tuple(out.attentions) if "attentions" in needs else None
    if attentions is not None and len(attentions) == 0:
        raise RuntimeError("model returned no attentions: it must run with attn_implementation='eager'")
    return Features(
        logits=out.logits,
        attention_mask=batch["attention_mask"],
        hidden_states=tuple(out.hidden_states) if "hidden_states" in needs else None,
        attentions=attentions,
        spans=batch.get("spans") if "spans" in needs else None,
    )
