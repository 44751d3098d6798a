"""Length-grouped batching, dynamic padding and the cache primitives."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from kdrun.cache import content_hash, get_or_build, staging_dir, write_json_atomic
from kdrun.data.pipeline import Collator, LengthGroupedBatchSampler


def lengths(n: int = 1000, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (n,), generator=g).tolist()


def test_sampler_covers_every_index_once_and_is_deterministic() -> None:
    ls = lengths()
    s = LengthGroupedBatchSampler(ls, 32, seed=7)
    s.set_epoch(0)
    a = list(s)
    flat = [i for b in a for i in b]
    assert sorted(flat) == list(range(len(ls)))
    s2 = LengthGroupedBatchSampler(ls, 32, seed=7)
    s2.set_epoch(0)
    assert list(s2) == a
    s.set_epoch(1)
    assert list(s) != a  # a new order each epoch


def test_sampler_groups_lengths_and_cuts_padding() -> None:
    ls = lengths()
    grouped = LengthGroupedBatchSampler(ls, 32, seed=1)
    plain = LengthGroupedBatchSampler(ls, 32, seed=1, group_by_length=False)

    def padded_tokens(sampler) -> int:
        return sum(max(ls[i] for i in b) * len(b) for b in sampler.batches())

    assert padded_tokens(grouped) < 0.7 * padded_tokens(plain)
    # within a mega-batch the batches are sorted by length: the spread inside a batch is small
    spreads = [max(ls[i] for i in b) - min(ls[i] for i in b) for b in grouped.batches()]
    assert sum(spreads) / len(spreads) < 10


def test_sampler_resume_skips_consumed_batches() -> None:
    s = LengthGroupedBatchSampler(lengths(200), 16, seed=3)
    s.set_epoch(2)
    full = list(s)
    s.set_epoch(2, start_batch=5)
    assert list(s) == full[5:]
    assert len(s) == len(full) - 5


def test_collator_pads_to_longest_or_fixed() -> None:
    rows = [{"input_ids": [101, 5, 102], "attention_mask": [1, 1, 1], "labels": 1, "idx": 0},
            {"input_ids": [101, 102], "attention_mask": [1, 1], "labels": 0, "idx": 1}]
    b = Collator(pad_token_id=0, regression=False)(rows)
    assert b["input_ids"].tolist() == [[101, 5, 102], [101, 102, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["labels"].dtype == torch.long and b["idx"].tolist() == [0, 1]
    fixed = Collator(pad_token_id=0, regression=True, pad_to=6)(rows)
    assert fixed["input_ids"].shape == (2, 6) and fixed["labels"].dtype == torch.float32


def test_content_hash_is_order_independent() -> None:
    assert content_hash({"a": 1, "b": [1, 2]}) == content_hash({"b": [1, 2], "a": 1})
    assert content_hash({"a": 1}) != content_hash({"a": 2})


def test_staging_dir_leaves_nothing_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with staging_dir(final) as tmp:
            (tmp / "half.bin").write_text("x")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    assert (tmp_path / "r.json").read_text().strip().startswith("{")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def _build_slowly(root: str, counter: str) -> str:
    def build(tmp: Path) -> None:
        with open(counter, "a") as f:
            f.write("built\n")
        time.sleep(1.0)
        (tmp / "payload.txt").write_text("done")

    entry, _ = get_or_build(root, "things", "k1", build)
    return (entry / "payload.txt").read_text()


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    counter = tmp_path / "count.txt"
    ctx = mp.get_context("spawn")
    with ctx.Pool(3) as pool:
        out = pool.starmap(_build_slowly, [(str(tmp_path / "c"), str(counter))] * 3)
    assert out == ["done"] * 3
    assert counter.read_text().count("built") == 1
