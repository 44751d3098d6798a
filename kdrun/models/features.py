"""The features record that teacher and student both produce, and that loss terms consume.

Loss terms never look inside a model: they see only a :class:`Features` record. What a record
holds is decided by the union of the loss terms' declared needs, so hidden states, attentions and
Q/K/V projections are computed (or kept) only when some term asks for them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

# Names a loss term may list in ``needs``:
#   logits, hidden_states, attentions (post-softmax, eager attention only), spans,
#   qkv (per-layer query/key/value projections), attention_scores (pre-softmax scores, from Q and K),
#   mlm_logits (the masked-LM head's logits at the batch's masked positions; corpus tasks).
KNOWN_NEEDS = frozenset({"logits", "hidden_states", "attentions", "spans", "qkv", "attention_scores", "mlm_logits"})
MLM_NEED = "mlm_logits"  # only a corpus task masks tokens, so only there can a term read them
# Needs served by forward hooks on the attention projections (any attention implementation, SDPA too).
PROJECTION_NEEDS = frozenset({"qkv", "attention_scores"})
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least single precision (losses are computed in fp32 under bf16/fp16 autocast;
    float64 inputs, as in the tests, stay float64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def no_autocast(device: torch.device) -> torch.autocast:
    """Context with autocast off on ``device``'s type: matmuls inside keep their inputs' (fp32)
    precision even when a caller runs under bf16/fp16 autocast."""
    return torch.autocast(device_type=device.type, enabled=False)


class AttentionInputs:
    """Q, K, V projections of every transformer layer, captured by forward hooks.

    Layers are numbered 1..L like hidden states (layer l's attention reads hidden state l-1).
    Tensors captured under ``torch.inference_mode`` (the teacher) are cloned when first read, so
    they can take part in the student's autograd graph; pre-softmax scores are computed, in fp32,
    only for the layers a loss term reads.
    """

    def __init__(self, q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor], heads: int,
                 scaling: float, bias: list[torch.Tensor | None] | None = None):
        # bias: per layer, what the family adds to the scaled Q K^T before the softmax (DeBERTa-v2's
        # relative-position terms, (B*h, n, n)), None where nothing is added.
        self._raw = {"q": q, "k": k, "v": v}
        self._bias = bias or [None] * len(q)
        self.heads = heads
        self.scaling = scaling
        self.num_layers = len(q)
        self._cache: dict[tuple[str, int], torch.Tensor] = {}

    def _layer(self, layer: int) -> int:
        if not 1 <= layer <= self.num_layers:
            raise IndexError(f"attention layer {layer} requested; the model has layers 1..{self.num_layers}")
        return layer - 1

    def projection(self, which: str, layer: int) -> torch.Tensor | None:
        """(B, n, d) output of layer ``layer``'s ``which`` ∈ {q, k, v} projection (all heads), or its
        score ``bias`` ((B*h, n, n) or None)."""
        key = (which, layer)
        if key not in self._cache:
            x = (self._bias if which == "bias" else self._raw[which])[self._layer(layer)]
            if x is None:
                return None
            # an inference-mode tensor (a teacher run under inference_mode) is copied to join autograd;
            # a compiled step runs its teacher under no_grad, and is_inference() cannot be traced
            self._cache[key] = x.clone() if not torch.compiler.is_compiling() and x.is_inference() else x
        return self._cache[key]

    def heads_of(self, which: str, layer: int, heads: int | None = None) -> torch.Tensor:
        """(B, h, n, d/h): the projection split into ``heads`` heads (default: the model's)."""
        x = self.projection(which, layer)
        h = heads or self.heads
        b, n, d = x.shape
        return x.view(b, n, h, d // h).transpose(1, 2)

    def scores(self, layer: int) -> torch.Tensor:
        """(B, h, n, n) pre-softmax attention scores of ``layer`` (fp32, also under autocast; no mask):
        Q K^T / sqrt(d_head), plus the family's additive terms where it has them (kdrun/models/adaptors.py)."""
        key = ("scores", layer)
        if key not in self._cache:
            q = fp32(self.heads_of("q", layer))
            k = fp32(self.heads_of("k", layer))
            with no_autocast(q.device):
                scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
            bias = self.projection("bias", layer)
            if bias is not None:
                scores = scores + fp32(bias).view_as(scores)
            self._cache[key] = scores
        return self._cache[key]


@dataclass
class Features:
    """What one forward pass exposes.

    logits: (B, C) class logits, or (B, 1) regression outputs, or (B, n, 2) start / end logits (QA);
        None for a bare encoder (general distillation).
    hidden_states: tuple of L+1 tensors (B, n, d); index 0 is the embedding output.
    attentions: tuple of L tensors (B, h, n, n) of attention probabilities (eager attention only).
    attention_mask: (B, n), 1 for real tokens.
    spans: per-example span index tensors when the data provides them.
    mlm_logits: (M, V) masked-LM logits at ``batch["mlm_positions"]`` (flat indices into (B, n)).
    extra: features later objectives add; ``extra["attention_inputs"]`` (an :class:`AttentionInputs`)
        when a term needs ``qkv`` or ``attention_scores`` — read it with :meth:`attention_scores`
        and :meth:`qkv`.
    """

    logits: torch.Tensor | None
    attention_mask: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    spans: Any = None
    mlm_logits: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def require(self, name: str) -> Any:
        value = getattr(self, name, None) if name != "extra" else self.extra
        if value is None:
            raise RuntimeError(
                f"features record has no '{name}': the loss term that reads it must declare "
                f"needs={{'{name}'}} in its @register_loss decorator"
            )
        return value

    def _attention_inputs(self, need: str) -> AttentionInputs:
        rec = self.extra.get("attention_inputs")
        if rec is None:
            raise RuntimeError(
                f"features record has no Q/K/V projections: the loss term that reads them must declare "
                f"needs={{'{need}'}} in its @register_loss decorator")
        return rec

    def attention_scores(self, layer: int) -> torch.Tensor:
        """(B, h, n, n) pre-softmax scores of transformer layer ``layer`` (1..L), fp32, unmasked."""
        return self._attention_inputs("attention_scores").scores(layer)

    def qkv(self) -> AttentionInputs:
        """Per-layer Q, K, V projections (see :class:`AttentionInputs`)."""
        return self._attention_inputs("qkv")


def output_logits(out: Any) -> torch.Tensor | None:
    """A model output's logits: (B, C) of a classifier; (B, n, 2) start / end logits of a
    question-answering head (task.kind=qa); None for a bare encoder."""
    if getattr(out, "logits", None) is None and getattr(out, "start_logits", None) is not None:
        return torch.stack((out.start_logits, out.end_logits), dim=-1)
    return getattr(out, "logits", None)


# The first module of each family's masked-LM head (applied to the last hidden states).
MLM_HEADS = {"bert": ("cls",), "roberta": ("lm_head",), "electra": ("generator_predictions",),
             "distilbert": ("vocab_transform",), "deberta-v2": ("lm_predictions", "cls")}


def mlm_head(model: nn.Module) -> nn.Module:
    """The module where ``model``'s masked-LM head starts; ValueError when it has none."""
    from kdrun.models.adaptors import family_of

    model = getattr(model, "module", model)
    for name in MLM_HEADS.get(family_of(model), ()):
        if isinstance(getattr(model, name, None), nn.Module):
            return getattr(model, name)
    raise ValueError(f"{type(model).__name__} has no masked-LM head kdrun can read (heads of the families "
                     f"{', '.join(MLM_HEADS)} are known); the mlm_kd term needs a masked-LM model")


def model_inputs(batch: Mapping[str, torch.Tensor], model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The batch's model inputs; token_type_ids only for models that use them (not DistilBERT, nor
    RoBERTa or DeBERTa-v3 with a single token type: segment ids of 1 would index past their table)."""
    from kdrun.models.adaptors import find_adaptor

    keys = MODEL_INPUTS
    if model is not None:
        config = getattr(model, "module", model).config
        adaptor = find_adaptor(config)
        if adaptor is not None and not adaptor.uses_token_types(config):
            keys = tuple(k for k in keys if k != "token_type_ids")
    return {k: batch[k] for k in keys if k in batch}


FORWARD_COUNTS = "kdrun_forward_counts"  # the attribute holding a model's counted forward passes


def count_forwards(model: nn.Module, counts: dict[str, int]) -> None:
    """Count ``model``'s forward passes and rows into ``counts`` ({"batches", "rows"}). A pass traced
    into a compiled step is not counted by the hook (a Python counter read while tracing becomes a
    guard: the step would recompile at every call); the step counts it (:func:`count_forward`)."""
    def hook(_module, args, kwargs):
        if torch.compiler.is_compiling():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        count_forward(_module, int(ids.shape[0]) if ids is not None else 0)

    target = unwrapped(model)
    setattr(target, FORWARD_COUNTS, counts)
    target.register_forward_pre_hook(hook, with_kwargs=True)


def count_forward(model: nn.Module | None, rows: int) -> None:
    """One forward pass of ``rows`` rows, where :func:`count_forwards` counts ``model``'s passes."""
    counts = getattr(unwrapped(model), FORWARD_COUNTS, None) if model is not None else None
    if counts is not None:
        counts["batches"] += 1
        counts["rows"] += rows


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP (``module``) or torch.compile (``_orig_mod``) wrapper."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


class _Capture:
    """Forward hooks on a model's attention projections and masked-LM head, registered once and left
    in place (a compiled model keeps the same hooks from step to step); they act only while a
    feature extraction that needs them runs."""

    def __init__(self, model: nn.Module):
        from kdrun.models.adaptors import get_adaptor
        from kdrun.models.loading import attention_projections

        modules = attention_projections(model)
        adaptor = get_adaptor(unwrapped(model))
        self.store: dict[str, list[Any]] = {w: [None] * len(modules) for w in ("q", "k", "v", "bias")}
        self.active = False
        self.positions: torch.Tensor | None = None  # masked-LM rows to keep (mlm_logits), or None
        for i, attn in enumerate(modules):
            for which, name in zip(("q", "k", "v"), adaptor.projections):
                getattr(attn, name).register_forward_hook(self._keeper(which, i))
            adaptor.score_bias(attn, self.store["bias"], i)  # stays patched: only records the bias
        first = modules[0]
        self.meta = (int(getattr(first, adaptor.heads_attr)), adaptor.scaling(first))
        self.mlm_hooked = False

    def _keeper(self, which: str, i: int):
        def hook(_m, _inp, out):
            if self.active and self.store[which][i] is None:  # DeBERTa-v2 reuses Q and K on positions
                self.store[which][i] = out
        return hook

    def hook_mlm(self, model: nn.Module) -> None:
        """Make the masked-LM head see only the rows at ``self.positions`` (flat indices into (B, n)),
        so the vocabulary logits are computed for the masked tokens alone."""
        if self.mlm_hooked:
            return

        def gather(_module, args):
            if self.positions is None:
                return None
            h = args[0]
            return (h.reshape(-1, h.shape[-1]).index_select(0, self.positions), *args[1:])

        mlm_head(model).register_forward_pre_hook(gather)
        self.mlm_hooked = True

    def __deepcopy__(self, memo: dict) -> None:
        """A copied model gets no capture (its copied hooks still write to this one); capture_of
        gives it its own."""
        return None

    def take(self) -> dict[str, list[Any]]:
        """What the last forward recorded; the store is emptied for the next one."""
        out = {w: list(v) for w, v in self.store.items()}
        for v in self.store.values():
            v[:] = [None] * len(v)
        return out


CAPTURE_ATTR = "_kdrun_capture"


def capture_of(model: nn.Module) -> _Capture:
    """The model's capture, kept as an attribute of the model itself: a compiled step reads it
    through the model (a process-wide table of models would put every model ever hooked into the
    step's guards)."""
    base = unwrapped(model)
    cap = base.__dict__.get(CAPTURE_ATTR)
    if cap is None:
        cap = _Capture(base)
        setattr(base, CAPTURE_ATTR, cap)
    return cap


@contextmanager
def _capturing(model: nn.Module, projections: bool, positions: torch.Tensor | None):
    """Activate the model's persistent hooks for one forward pass; yields the capture (or None)."""
    if not projections and positions is None:
        yield None
        return
    cap = capture_of(model)
    if positions is not None:
        cap.hook_mlm(unwrapped(model))
    cap.active, cap.positions = projections, positions
    try:
        yield cap
    finally:
        cap.active, cap.positions = False, None


def extract_features(model: nn.Module, batch: Mapping[str, Any], needs: frozenset[str]) -> Features:
    """Run ``model`` on ``batch`` and collect the features in ``needs``."""
    capture = bool(needs & PROJECTION_NEEDS)
    mlm = "mlm_logits" in needs
    with _capturing(model, capture, batch["mlm_positions"] if mlm else None) as cap:
        out = model(
            **model_inputs(batch, model),
            output_hidden_states="hidden_states" in needs,
            output_attentions="attentions" in needs,
            return_dict=True,
        )
        store = cap.take() if cap is not None else None
    attentions = tuple(out.attentions) if "attentions" in needs else None
    if attentions is not None and len(attentions) == 0:
        raise RuntimeError("model returned no attentions: it must run with attn_implementation='eager'")
    extra: dict[str, Any] = {}
    if capture:
        extra["attention_inputs"] = AttentionInputs(store["q"], store["k"], store["v"], *cap.meta, bias=store["bias"])
    logits = output_logits(out)
    return Features(
        logits=None if mlm else logits,
        mlm_logits=logits if mlm else None,
        attention_mask=batch["attention_mask"],
        hidden_states=tuple(out.hidden_states) if "hidden_states" in needs else None,
        attentions=attentions,
        spans=batch.get("spans") if "spans" in needs else None,
        extra=extra,
    )
