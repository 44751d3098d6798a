"""Tokenisation, length-grouped batching and dynamic padding: from tokenised rows to the batches a stage trains on.

Batches are padded to their own longest example, not to ``max_seq_length``; examples of similar
length are grouped (shuffled mega-batches sorted by length, batch order shuffled) so padding stays
small while the order is still random. The order depends only on (seed, epoch), which is what
makes an exact resume possible: skip the batches already seen.
"""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

TOKEN_COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


def tokenize_splits(
    dsd,
    tokenizer,
    max_seq_length: int,
    num_proc: int | None = None,
    spans: Any = None,
    span_splits: Sequence[str] | None = None,
    cache_dir: str | None = None,
    cache_key: str | None = None,
):
    """Tokenise every split (no padding) and keep ``input_ids``, masks, ``labels``, ``idx``, ``length``.

    ``spans`` (a :class:`kdrun.strategies.phrases.align.SpanExtractor`): the splits in ``span_splits`` (default:
    all) also get a ``spans`` column, each row a list of ``[start, end)`` token index pairs (MGSKD's
    multi-piece words and chunker phrases), computed once with a progress bar. With ``cache_dir``
    and ``cache_key`` (an identity of the raw data and tokenizer, e.g. their content hashes) the
    tokenised splits with their spans are cached there (``tokenized/<hash>``, Arrow files, written
    atomically) and later runs load them instead of chunking again.
    """
    pair = "text_b" in next(iter(dsd.values())).column_names
    span_splits = list(dsd) if span_splits is None else [s for s in span_splits if s in dsd]
    if spans is None or not span_splits:
        return _tokenize(dsd, tokenizer, max_seq_length, num_proc, pair, None, [])
    if cache_dir is None or cache_key is None:
        return _tokenize(dsd, tokenizer, max_seq_length, num_proc, pair, spans, span_splits)

    import datasets

    from kdrun.runtime.cache import content_hash, load_or_build

    key = content_hash({"data": cache_key, "max_seq_length": max_seq_length, "spans": spans.key,
                        "span_splits": sorted(span_splits), "version": SPANS_CACHE_VERSION})

    def build(tmp) -> None:
        out = _tokenize(dsd, tokenizer, max_seq_length, num_proc, pair, spans, span_splits)
        for split, ds in out.items():
            ds.save_to_disk(str(tmp / split))

    out, entry, hit = load_or_build(cache_dir, "tokenized", key, build,
                                    lambda e: {split: datasets.load_from_disk(str(e / split)) for split in dsd})
    for split in span_splits:
        counts = [len(x) for x in out[split]["spans"]]
        few = sum(c < 3 for c in counts)
        print(f"[kdrun] spans of {split}{' (cached)' if hit else ''}: {sum(counts) / max(len(counts), 1):.2f} per "
              f"example, {few} of {len(counts)} examples have fewer than 3 ({entry})", flush=True)
    return out


# Bumped when the layout of cached tokenised splits changes.
SPANS_CACHE_VERSION = "1"


def _in_published_entry(ds) -> bool:
    """Whether ``ds`` was loaded from a kdrun cache entry (an augmented set): ``datasets`` would
    otherwise write its map cache files into the published entry, which no writer may change."""
    from kdrun.runtime.cache import COMPLETE_MARKER

    for f in getattr(ds, "cache_files", None) or []:
        if any((d / COMPLETE_MARKER).exists() for d in list(Path(f["filename"]).parents)[:3]):
            return True
    return False


def _tokenize(dsd, tokenizer, max_seq_length: int, num_proc: int | None, pair: bool, spans: Any,
              span_splits: Sequence[str]):
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

    def add_spans(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # The same encoding as ``encode`` (its sequence ids locate each segment's tokens).
        enc = tokenizer(rows["text_a"], rows["text_b"] if pair else None, truncation=True,
                        max_length=max_seq_length, padding=False)
        found, _ = spans.spans(enc, rows["text_a"], rows["text_b"] if pair else None)
        return {"spans": found}

    text_cols = ("text_a", "text_b")
    out = {}
    for split, ds in dsd.items():
        with_spans = spans is not None and split in span_splits
        keep = ("label", "idx", *text_cols) if with_spans else ("label", "idx")
        tok = ds.map(
            encode,
            batched=True,
            batch_size=1000,
            num_proc=num_proc,
            desc=f"tokenize {split}",
            keep_in_memory=_in_published_entry(ds),
            remove_columns=[c for c in ds.column_names if c not in keep],
        )
        if with_spans:
            import datasets

            from kdrun.runtime.cache import content_hash
            from kdrun.tasks.data.common import list_of

            feats = datasets.Features({**tok.features,
                                       "spans": list_of(list_of(datasets.Value("int32")))})
            tok = tok.map(
                add_spans,
                batched=True,
                batch_size=1000,
                num_proc=num_proc,
                features=feats,
                desc=f"spans {split}",
                # the extractor holds the chunker's weights: name the result instead of hashing them
                new_fingerprint=content_hash([tok._fingerprint, spans.key, max_seq_length]),
            )
            tok = tok.remove_columns([c for c in text_cols if c in tok.column_names])
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


def _int_flat(seqs: Sequence[Any], total: int) -> np.ndarray:
    """The concatenated values of ``seqs`` as one int64 array (``total`` values in all)."""
    first = seqs[0] if len(seqs) else None
    if isinstance(first, (list, tuple)):  # the usual case: rows as Python lists (datasets' format None)
        return np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
    if not total:
        return np.zeros(0, dtype=np.int64)
    # tensors or arrays (a formatted dataset): cast as torch.as_tensor(seq, dtype=torch.long) would
    return np.concatenate([torch.as_tensor(s).to(torch.long).reshape(-1).numpy() for s in seqs])


def pad_rows(seqs: Sequence[Any], width: int, fill: int, lengths: np.ndarray | None = None,
             key: str = "input_ids") -> torch.Tensor:
    """(B, ``width``) long tensor: row i holds ``seqs[i]`` then ``fill``.

    One pre-allocated tensor filled through a boolean mask of the valid positions (row-major, so
    each row's values land in order), instead of a tensor per row: the same values as padding row
    by row, several times faster on batches of Python lists.
    """
    if lengths is None:
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    out = torch.full((len(seqs), width), fill, dtype=torch.long)
    if len(seqs) == 0:
        return out
    longest = int(lengths.max())
    if longest > width:
        raise ValueError(f"a row's {key} has {longest} tokens, more than the batch width {width} (pad_to)")
    valid = np.arange(width) < lengths[:, None]
    out.numpy()[valid] = _int_flat(seqs, int(lengths.sum()))
    return out


def bucket_width(longest: int, multiple: int, limit: int | None = None) -> int:
    """The batch width for a batch whose longest row has ``longest`` tokens: that length rounded up
    to a multiple of ``multiple`` (0: not rounded), at most ``limit`` (but never below ``longest``)."""
    if multiple <= 0:
        return longest
    width = -(-longest // multiple) * multiple
    return max(longest, min(width, limit)) if limit else width


def resolve_pad_multiple(value: Any, compiled: bool) -> int:
    """``train.pad_to_multiple_of`` (auto / an integer >= 0) → the multiple batches are padded to:
    ``auto`` is 32 for a compiled step (a graph per width: at most max_seq_length / 32 of them) and
    0 (each batch padded to its longest row) otherwise."""
    from kdrun.errors import ConfigError

    if isinstance(value, str) and value == "auto":
        return 32 if compiled else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"train.pad_to_multiple_of={value!r} must be auto or an integer >= 0 (batch widths "
                          "rounded up to a multiple of it; 0 pads each batch to its longest row)")
    return int(value)


class Collator:
    """Pads a list of tokenised rows to the longest (or to ``pad_to``) and stacks tensors.

    Rows with a ``spans`` column give ``batch["spans"]``: (B, S, 2) long ``[start, end)`` token
    indices, S the most spans of a row in the batch, missing spans filled with -1.

    Every key is built as one tensor for the whole batch (:func:`pad_rows`), not row by row; the
    values, dtypes and padding are those of padding each row in turn (tests/test_pipeline.py
    compares the two).
    """

    def __init__(self, pad_token_id: int, regression: bool, pad_to: int | None = None, multiple: int = 0,
                 limit: int | None = None):
        self.pad_token_id = pad_token_id
        self.regression = regression
        self.pad_to = pad_to
        # train.pad_to_multiple_of: widths rounded up to a multiple (a few batch shapes for a
        # compiled step), never past ``limit`` (task.max_seq_length) unless a row is longer
        self.multiple, self.limit = multiple, limit

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = len(rows)
        ids = [r["input_ids"] for r in rows]
        id_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        width = self.pad_to or bucket_width(int(id_lengths.max()), self.multiple, self.limit)
        batch: dict[str, torch.Tensor] = {}
        for key in TOKEN_COLUMNS:
            if key not in rows[0]:
                continue
            fill = self.pad_token_id if key == "input_ids" else 0
            seqs = ids if key == "input_ids" else [r[key] for r in rows]
            lengths = id_lengths if key == "input_ids" else np.fromiter(map(len, seqs), dtype=np.int64, count=n)
            batch[key] = pad_rows(seqs, width, fill, lengths, key)
        batch["labels"] = torch.tensor(
            [r["labels"] for r in rows], dtype=torch.float32 if self.regression else torch.long
        )
        batch["idx"] = torch.tensor([r["idx"] for r in rows], dtype=torch.long)
        if "spans" in rows[0]:  # span counts bucketed too when widths are (a compiled step's shapes)
            batch["spans"] = pad_spans([r["spans"] for r in rows], SPAN_MULTIPLE if self.multiple else 0)
        return batch


# Span counts are rounded up to a multiple of this under train.pad_to_multiple_of (a compiled step
# compiles once per (width, span count) shape; the -1 spans are masked out by every span term).
SPAN_MULTIPLE = 16


def pad_spans(spans: Sequence[Any], multiple: int = 0) -> torch.Tensor:
    """(B, S, 2) long: row i's ``[start, end)`` pairs, then -1; S the most pairs of a row (rounded up
    to ``multiple`` when it is > 0)."""
    counts = np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))
    most = bucket_width(int(counts.max()) if len(spans) else 0, multiple)
    out = torch.full((len(spans), most, 2), -1, dtype=torch.long)
    total = int(counts.sum())
    if not total:
        return out
    pairs = [p for p in spans if len(p)]
    if isinstance(pairs[0], (list, tuple)):
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(pairs)), dtype=np.int64)
    else:
        flat = np.concatenate([torch.as_tensor(p).to(torch.long).reshape(-1).numpy() for p in pairs])
    if flat.size != 2 * total:
        raise ValueError(f"spans must be [start, end) pairs: {total} spans hold {flat.size} values")
    out.numpy()[np.arange(most) < counts[:, None]] = flat.reshape(-1, 2)
    return out


def resolve_num_workers(value: Any, device_type: Any) -> int:
    """Data-loading processes for ``train.num_workers`` (an integer >= 0 or ``auto``) on a device.

    ``auto``: none on CPU devices (workers would compete with the compute threads for the cores);
    on CUDA min(4, half of this process's share of the cores), so batches are collated while the GPU
    computes. The share is the cores available to the process divided by the training processes on
    the node (``LOCAL_WORLD_SIZE``, set by torchrun and ``accelerate launch``), which all see the same
    cores: 8 processes on a 16-core node take 1 worker each, not 4. ``device_type``: ``"cuda"``,
    ``"cpu"``, ... or a torch.device. A bad value is a ConfigError naming ``train.num_workers``.
    """
    from kdrun.errors import ConfigError

    kind = getattr(device_type, "type", device_type)
    if isinstance(value, str) and value == "auto":
        return min(4, _available_cpus() // _processes_on_node() // 2) if kind == "cuda" else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"train.num_workers={value!r} must be auto or an integer >= 0 (data-loading "
                          "processes; 0 loads batches in the training process)")
    return int(value)


def _processes_on_node() -> int:
    """Training processes sharing this node's cores (``LOCAL_WORLD_SIZE``; 1 when unset or unreadable)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, int(value)) if value.isdigit() else 1


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (taskset, SLURM, containers)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def make_loader(
    ds,
    batch_size: int,
    collator: Any,
    seed: int,
    train: bool,
    group_by_length: bool = True,
    num_workers: int | str = 0,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
    device_type: str | None = None,
) -> tuple[DataLoader, LengthGroupedBatchSampler]:
    """The loader of ``ds`` and its batch sampler (call ``sampler.set_epoch`` before each epoch).

    ``pin_memory``: page-locked batches, so that ``.to(device, non_blocking=True)`` overlaps the copy
    with compute; pass True when training on CUDA. ``num_workers``: an integer or ``auto``, resolved
    by :func:`resolve_num_workers` for ``device_type`` (default: ``cuda`` when ``pin_memory``, else
    ``cpu``).

    Workers are persistent (started once per loader, not once per epoch). That keeps exact resumes:
    the batch sampler runs in this process, and each ``iter(loader)`` starts a new pass over it after
    the caller's ``set_epoch(epoch, start_batch=...)``, the workers dropping whatever they had
    prefetched of an abandoned pass (tests/test_pipeline.py).
    """
    num_workers = resolve_num_workers(num_workers, device_type or ("cuda" if pin_memory else "cpu"))
    sampler = LengthGroupedBatchSampler(
        ds["length"], batch_size, seed, group_by_length=group_by_length, shuffle=train, rank=rank,
        world_size=world_size,
    )
    cols = [c for c in (*TOKEN_COLUMNS, "labels", "idx", "spans") if c in ds.column_names]
    # A private generator: creating the loader's iterator must not draw from the global RNG, or
    # dropout masks after a resume would differ from those of an uninterrupted run.
    loader = DataLoader(
        ds.with_format(None, columns=cols), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers,
        pin_memory=pin_memory, persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler
