"""Benchmark: batch collation, vectorised (kdrun's collators) against padding row by row.

Realistic rows (random lengths, sentence pairs with token types, labels; corpus segments with
BERT's masking) are grouped into length-sorted batches as in training, and every batch is collated
by both paths: the old row-by-row padding written out below and kdrun's collators (one tensor per
key). The script checks that the two give identical batches, then prints the time of each and their
ratio (best of ``--repeats`` passes over all batches).

    python scripts/bench/collate.py                 # 4000 rows, lengths 5-128, batches of 32
    python scripts/bench/collate.py --fast          # a tiny run (tests)
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import numpy as np
import torch

from kdrun.runtime import harness
from kdrun.strategies.general.data import CorpusCollator
from kdrun.tasks.data.batches import Collator, LengthGroupedBatchSampler

TOKEN_COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


# ---------------------------------------------------------------------- the old, row-by-row collation

def naive_collate(rows: list[dict[str, Any]], pad_token_id: int, regression: bool,
                  pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """The reference: padding row by row, as kdrun collated before it built one tensor per key."""
    width = pad_to or max(len(r["input_ids"]) for r in rows)
    batch = {}
    for key in TOKEN_COLUMNS:
        if key not in rows[0]:
            continue
        t = torch.full((len(rows), width), pad_token_id if key == "input_ids" else 0, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r[key])] = torch.as_tensor(r[key], dtype=torch.long)
        batch[key] = t
    batch["labels"] = torch.tensor([r["labels"] for r in rows], dtype=torch.float32 if regression else torch.long)
    batch["idx"] = torch.tensor([r["idx"] for r in rows], dtype=torch.long)
    if "spans" in rows[0]:
        most = max(len(r["spans"]) for r in rows)
        sp = torch.full((len(rows), most, 2), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            if r["spans"]:
                sp[i, : len(r["spans"])] = torch.as_tensor(r["spans"], dtype=torch.long).view(-1, 2)
        batch["spans"] = sp
    return batch


def naive_corpus_collate(rows: list[dict], pad_token_id: int, mask_token_id: int | None, vocab_size: int,
                         probability: float, seed: int, pad_to: int | None = None) -> dict:
    """The reference corpus collator: row by row, each segment masked from its own (seed, idx) generator."""
    width = pad_to or max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions, targets = [], []
    for i, r in enumerate(rows):
        seq = torch.as_tensor(r["input_ids"], dtype=torch.long)
        if mask_token_id is not None:
            rng = np.random.default_rng([seed, int(r["idx"])])
            inner = np.arange(1, len(seq) - 1)
            k = max(1, int(round(probability * len(inner))))
            chosen = np.sort(rng.choice(inner, size=min(k, len(inner)), replace=False))
            roll = rng.random(len(chosen))
            new = seq[torch.as_tensor(chosen)].numpy().copy()
            new[roll < 0.8] = mask_token_id
            rand = (roll >= 0.8) & (roll < 0.9)
            new[rand] = rng.integers(0, vocab_size, size=int(rand.sum()))
            chosen_t = torch.as_tensor(chosen, dtype=torch.long)
            positions.append(i * width + chosen_t)
            targets.append(seq[chosen_t].clone())
            seq = seq.clone()
            seq[chosen_t] = torch.as_tensor(new, dtype=torch.long)
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    batch = {"input_ids": ids, "attention_mask": mask,
             "idx": torch.tensor([int(r["idx"]) for r in rows], dtype=torch.long)}
    if mask_token_id is not None:
        batch["mlm_positions"], batch["mlm_targets"] = torch.cat(positions), torch.cat(targets)
    return batch


# ------------------------------------------------------------------------------------------ the data

def pair_rows(n: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    """Tokenised sentence pairs as the loader hands them over (Python lists): [CLS] a [SEP] b [SEP]."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(lo, hi)
        first = rng.randint(1, length - 1) if length > 2 else 1
        ids = [101, *(rng.randrange(1000, 30522) for _ in range(length - 2)), 102][:length]
        rows.append({"input_ids": ids, "attention_mask": [1] * length,
                     "token_type_ids": [0] * first + [1] * (length - first), "labels": rng.randrange(3), "idx": i})
    return rows


def batches_of(rows: list[dict[str, Any]], batch_size: int, seed: int) -> list[list[dict[str, Any]]]:
    sampler = LengthGroupedBatchSampler([len(r["input_ids"]) for r in rows], batch_size, seed)
    sampler.set_epoch(0)
    return [[rows[i] for i in b] for b in sampler]


def best_time(fn: Callable[[list[dict[str, Any]]], Any], batches: list, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        best = min(best, time.perf_counter() - t0)
    return best


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def compare(name: str, batches: list, naive: Callable, fast: Callable, repeats: int) -> float:
    for b in batches:
        if not same(naive(b), fast(b)):
            raise SystemExit(f"{name}: the vectorised collation differs from the row-by-row one")
    slow_s, fast_s = best_time(naive, batches, repeats), best_time(fast, batches, repeats)
    rows = sum(len(b) for b in batches)
    print(f"{name}: {len(batches)} batches, {rows} rows: row by row {slow_s * 1e3:.1f} ms "
          f"({slow_s / len(batches) * 1e6:.0f} us/batch), vectorised {fast_s * 1e3:.1f} ms "
          f"({fast_s / len(batches) * 1e6:.0f} us/batch), ratio {slow_s / fast_s:.2f}x", flush=True)
    return slow_s / fast_s


def main(argv: list[str] | None = None) -> float:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--min-length", type=int, default=5)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="passes over all batches; the best one counts")
    ap.add_argument("--fast", action="store_true", help="a tiny run (256 rows, 1 pass) for tests")
    args = ap.parse_args(argv)
    if args.fast:
        args.rows, args.repeats = 256, 1
    torch.set_num_threads(1)  # collation runs in one loader process (or worker)
    rows = pair_rows(args.rows, args.min_length, args.max_length, seed=0)
    batches = batches_of(rows, args.batch_size, seed=0)
    print(f"{args.rows} rows of {args.min_length}-{args.max_length} tokens, batches of {args.batch_size} "
          f"grouped by length, best of {args.repeats} pass(es)")
    col = Collator(pad_token_id=0, regression=False)
    ratio = compare("classification collator", batches, lambda b: naive_collate(b, 0, False), col, args.repeats)
    segments = [{"input_ids": r["input_ids"], "idx": r["idx"]} for r in rows]
    corpus = CorpusCollator(pad_token_id=0, mask_token_id=103, vocab_size=30522, probability=0.15, seed=1)
    compare("corpus collator (masking)", batches_of(segments, args.batch_size, seed=0),
            lambda b: naive_corpus_collate(b, 0, 103, 30522, 0.15, 1), corpus, args.repeats)
    print(f"ratio {ratio:.2f}x (classification collator: row by row / vectorised)")
    return ratio


if __name__ == "__main__":
    main()
