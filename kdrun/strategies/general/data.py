"""A corpus task's data: tokenised segments cached by content hash, and the masking collator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdrun.tasks.data.corpus import corpus_files, corpus_fingerprint, write_corpus_splits

# Bumped when the layout of cached corpus shards changes.
CORPUS_CACHE_VERSION = "1"


def corpus_cache_key(fingerprint: str, tok_hash: str, task: Any) -> dict[str, Any]:
    return {"corpus": fingerprint, "tokenizer": tok_hash, "max_seq_length": int(task.max_seq_length),
            "validation_percent": float(task.validation_percent), "min_tokens": int(task.min_segment_tokens),
            "version": CORPUS_CACHE_VERSION}


def load_corpus(task: Any, tokenizer, tok_hash: str, cache_dir: str) -> tuple[Any, Any, str, dict[str, Any]]:
    """(train, validation, data hash, info): the corpus's segments as memory-mapped Arrow datasets,
    tokenised once per (corpus content, tokenizer, segment settings) and cached under
    ``<cache>/corpus/<key>`` (written atomically, checked against its manifest when loaded)."""
    import datasets
    from tqdm.auto import tqdm

    from kdrun.runtime.cache import content_hash, load_or_build

    files = corpus_files(task.data_files)
    fingerprint = corpus_fingerprint(files)
    key = content_hash(corpus_cache_key(fingerprint, tok_hash, task))
    stats: dict[str, Any] = {}

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        size = sum(f.stat().st_size for f in files)
        with tqdm(desc=f"tokenising {len(files)} corpus file(s), {size / 1e6:.1f} MB", unit="tok", unit_scale=True,
                  mininterval=2.0, dynamic_ncols=True) as bar:
            s = write_corpus_splits(files, tokenizer, tmp, task.max_seq_length, task.validation_percent,
                                    task.min_segment_tokens, progress=bar)
        stats.update(documents=s.documents, tokens=s.tokens, segments=s.segments,
                     tokens_per_s=s.tokens / max(time.perf_counter() - t0, 1e-9))

    def load(entry: Path) -> dict[str, Any]:
        return {s: datasets.Dataset.from_file(str(entry / f"{s}.arrow")) for s in ("train", "validation")}

    splits, entry, cached = load_or_build(cache_dir, "corpus", key, build, load)
    train, validation = _subsample(splits["train"], task.max_train_samples, task.sample_seed), \
        _subsample(splits["validation"], task.max_eval_samples, task.sample_seed)
    info = {"files": len(files), "path": str(entry), "cached": cached, "segments": {"train": len(train),
            "validation": len(validation)}, **stats}
    how = "from cache" if cached else f"built at {stats['tokens_per_s']:,.0f} tokens/s"
    print(f"[kdrun] corpus: {len(train):,} training and {len(validation):,} held-out segments of at most "
          f"{task.max_seq_length} tokens ({how}: {entry})", flush=True)
    return train, validation, fingerprint, info


def _subsample(ds, limit: int | None, seed: int):
    if limit is None or limit >= len(ds):
        return ds
    order = np.random.default_rng(seed).permutation(len(ds))[:limit]
    return ds.select(np.sort(order))  # the segments keep their corpus order and their idx


class CorpusCollator:
    """Pads segments and, for masked-LM terms, masks them as BERT did: ``probability`` of the tokens
    (at least one per segment, never [CLS]/[SEP]/padding) are chosen; 80 % become [MASK], 10 % a random
    token, 10 % stay. A segment's mask depends only on (``seed``, its ``idx``): the same at every
    epoch (static masking, as BERT's pre-computed data), in evaluation, and after a resume.

    Batch keys: ``input_ids``, ``attention_mask``, ``idx`` (the segment's row), and with masking
    ``mlm_positions`` (flat indices into the (B, n) batch of the chosen tokens) and ``mlm_targets``
    (their original ids).
    """

    def __init__(self, pad_token_id: int, mask_token_id: int | None = None, vocab_size: int = 0,
                 probability: float = 0.15, seed: int = 0, pad_to: int | None = None):
        self.pad_token_id, self.mask_token_id, self.vocab_size = pad_token_id, mask_token_id, vocab_size
        self.probability, self.seed, self.pad_to = probability, seed, pad_to

    @property
    def masks(self) -> bool:
        return self.mask_token_id is not None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        # One tensor per key for the whole batch (kdrun.tasks.data.batches.pad_rows); only the masks are
        # drawn row by row, each from its segment's own generator.
        from kdrun.tasks.data.batches import pad_rows

        n = len(rows)
        seqs = [r["input_ids"] for r in rows]
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=n)
        width = self.pad_to or int(lengths.max())
        ids = pad_rows(seqs, width, self.pad_token_id, lengths)
        mask = torch.from_numpy(np.arange(width) < lengths[:, None]).to(torch.long)
        idx = torch.tensor([int(r["idx"]) for r in rows], dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": mask, "idx": idx}
        if self.masks:
            draws = [self._draw(int(m), int(i)) for m, i in zip(lengths, idx.tolist())]
            positions = np.concatenate([i * width + d[0] for i, d in enumerate(draws)])  # flat, row by row
            roll = np.concatenate([d[1] for d in draws])
            flat = ids.view(-1).numpy()  # a view: writing it writes ``ids``
            targets = flat[positions]
            new = targets.copy()
            new[roll < 0.8] = self.mask_token_id
            new[(roll >= 0.8) & (roll < 0.9)] = np.concatenate([d[2] for d in draws])
            flat[positions] = new
            batch["mlm_positions"] = torch.from_numpy(positions)
            batch["mlm_targets"] = torch.from_numpy(targets)
        return batch

    def _draw(self, n: int, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A segment's mask draws: (positions chosen in 1..n-2, their rolls, the random ids of the rolls
        in [0.8, 0.9)), from the generator seeded by (``seed``, ``idx``), in the order BERT's masking draws."""
        rng = np.random.default_rng([self.seed, idx])
        inner = np.arange(1, n - 1)
        k = max(1, int(round(self.probability * len(inner))))
        chosen = np.sort(rng.choice(inner, size=min(k, len(inner)), replace=False)).astype(np.int64, copy=False)
        roll = rng.random(len(chosen))
        rand = (roll >= 0.8) & (roll < 0.9)
        return chosen, roll, rng.integers(0, self.vocab_size, size=int(rand.sum())).astype(np.int64, copy=False)

    def mask_segment(self, n: int, idx: int, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions chosen in 1..n-2, their new ids) for one segment of length ``n``."""
        chosen, roll, random_ids = self._draw(n, idx)
        new = seq[torch.as_tensor(chosen)].numpy().copy()
        new[roll < 0.8] = self.mask_token_id
        new[(roll >= 0.8) & (roll < 0.9)] = random_ids
        return torch.as_tensor(chosen, dtype=torch.long), torch.as_tensor(new, dtype=torch.long)
