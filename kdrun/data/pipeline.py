"""Tokenisation, length-grouped batching and dynamic padding.

Batches are padded to their own longest example, not to ``max_seq_length``; examples of similar
length are grouped (shuffled mega-batches sorted by length, batch order shuffled) so padding stays
small while the order is still random. The order depends only on (seed, epoch), which is what
makes an exact resume possible: skip the batches already seen.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

TOKEN_COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


def tokenize_splits(dsd, tokenizer, max_seq_length: int, num_proc: int | None = None):
    """Tokenise every split (no padding) and keep ``input_ids``, masks, ``labels``, ``idx``, ``length``."""
    pair = "text_b" in next(iter(dsd.values())).column_names

    def encode(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
        enc = tokenizer(
            rows["text_a"],
            rows["text_b"] if pair else None,
            truncation=True,
            max_length=max_seq_length,
            padding=False,
        )
        enc["length"] = [len(x) for x in enc["input_ids"]]
        return enc

    out = {}
    for split, ds in dsd.items():
        tok = ds.map(
            encode,
            batched=True,
            batch_size=1000,
            num_proc=num_proc,
            desc=f"tokenize {split}",
            remove_columns=[c for c in ds.column_names if c not in ("label", "idx")],
        )
        tok = tok.rename_column("label", "labels")
        out[split] = tok
    return out


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of indices with similar lengths, in an order fixed by (seed, epoch).

    ``group_by_length=False`` gives plain shuffled batches. ``set_epoch`` must be called before each
    epoch; ``start_batch`` skips the first batches (resume).

    Data-parallel runs (``world_size`` > 1): every process builds the same global batches and keeps
    its contiguous slice of each, so ``batch_size`` is the global batch whatever the number of
    processes, and a resume position counts global batches.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        seed: int,
        group_by_length: bool = True,
        shuffle: bool = True,
        mega_batch_mult: int = 50,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.group_by_length = group_by_length
        self.shuffle = shuffle
        self.mega = mega_batch_mult * batch_size
        self.epoch = 0
        self.start_batch = 0
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def batches(self) -> list[list[int]]:
        """The global batches of the current epoch, in order."""
        out = self._batches()
        if self.world_size > 1 and self.shuffle:  # in training every process needs rows in each step
            out = [b for b in out if len(b) >= self.world_size]
        return out

    def _batches(self) -> list[list[int]]:
        n = len(self.lengths)
        idx = list(range(n))
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        if not self.shuffle:
            if self.group_by_length:  # evaluation: sort by length for minimal padding
                idx.sort(key=lambda i: -self.lengths[i])
            return [idx[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        rng.shuffle(idx)
        if not self.group_by_length:
            return [idx[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        batches: list[list[int]] = []
        for m in range(0, n, self.mega):
            chunk = sorted(idx[m : m + self.mega], key=lambda i: -self.lengths[i])
            batches.extend(chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        rng.shuffle(batches)
        return batches

    def shard(self, batch: list[int]) -> list[int]:
        """This process's contiguous slice of a global batch (sizes differ by at most one)."""
        if self.world_size == 1:
            return batch
        n, w, r = len(batch), self.world_size, self.rank
        return batch[r * n // w : (r + 1) * n // w]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches()[self.start_batch :]:
            mine = self.shard(batch)
            if mine:  # (evaluation: a short last batch may leave a process nothing)
                yield mine

    def __len__(self) -> int:
        return (len(self.lengths) + self.batch_size - 1) // self.batch_size - self.start_batch


class Collator:
    """Pads a list of tokenised rows to the longest (or to ``pad_to``) and stacks tensors."""

    def __init__(self, pad_token_id: int, regression: bool, pad_to: int | None = None):
        self.pad_token_id = pad_token_id
        self.regression = regression
        self.pad_to = pad_to

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = self.pad_to or max(len(r["input_ids"]) for r in rows)
        batch: dict[str, torch.Tensor] = {}
        for key in TOKEN_COLUMNS:
            if key not in rows[0]:
                continue
            fill = self.pad_token_id if key == "input_ids" else 0
            t = torch.full((len(rows), width), fill, dtype=torch.long)
            for i, r in enumerate(rows):
                seq = r[key]
                t[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            batch[key] = t
        batch["labels"] = torch.tensor(
            [r["labels"] for r in rows], dtype=torch.float32 if self.regression else torch.long
        )
        batch["idx"] = torch.tensor([r["idx"] for r in rows], dtype=torch.long)
        return batch


def make_loader(
    ds,
    batch_size: int,
    collator: Collator,
    seed: int,
    train: bool,
    group_by_length: bool = True,
    num_workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[DataLoader, LengthGroupedBatchSampler]:
    sampler = LengthGroupedBatchSampler(
        ds["length"], batch_size, seed, group_by_length=group_by_length, shuffle=train, rank=rank,
        world_size=world_size,
    )
    cols = [c for c in (*TOKEN_COLUMNS, "labels", "idx") if c in ds.column_names]
    # A private generator: creating the loader's iterator must not draw from the global RNG, or
    # dropout masks after a resume would differ from those of an uninterrupted run.
    loader = DataLoader(
        ds.with_format(None, columns=cols), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler
