"""Length-grouped batching, dynamic padding and the cache primitives."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kdrun.runtime.cache import content_hash, get_or_build, staging_dir, write_json_atomic
from kdrun.tasks.data.batches import Collator, LengthGroupedBatchSampler
from tests.conftest import load_script


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


# ------------------------------------------------------------------ vectorised collation, loaders

# The references: row by row, as kdrun collated before (the collation benchmark's naive side).
_BENCH = load_script("bench/collate")
naive_collate, naive_corpus_collate = _BENCH.naive_collate, _BENCH.naive_corpus_collate


def assert_same_batch(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def ragged_rows(n: int, seed: int, *, lo: int = 0, hi: int = 40, pair: bool = True, regression: bool = False,
                qa: bool = False, spans: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        m = rng.randint(lo, hi)
        row = {"input_ids": [rng.randrange(5, 30000) for _ in range(m)],
               # a mask that is not all ones and token types that change mid-row: nothing is assumed
               "attention_mask": [int(rng.random() < 0.9) for _ in range(m)]}
        if pair:
            row["token_type_ids"] = [int(j >= m // 2) for j in range(m)]
        row["labels"] = [rng.randrange(m + 1), rng.randrange(m + 1)] if qa else \
            (rng.uniform(0, 5) if regression else rng.randrange(3))
        row["idx"] = rng.randrange(10**6)
        if spans:
            starts = sorted(rng.sample(range(max(m, 1)), min(m, rng.randint(0, 6))))
            row["spans"] = [[a, a + rng.randint(1, 4)] for a in starts]
        rows.append(row)
    return rows


@pytest.mark.parametrize("pad_to", [None, 48])
@pytest.mark.parametrize("kind", ["classification", "single", "regression", "qa", "spans"])
def test_vectorised_collator_is_bit_identical_to_row_by_row(kind: str, pad_to: int | None) -> None:
    regression = kind == "regression"
    for seed in range(12):
        rows = ragged_rows(random.Random(seed).randint(1, 33), seed, pair=kind != "single", regression=regression,
                           qa=kind == "qa", spans=kind == "spans")
        if seed == 0:
            rows[0] = {**rows[0], **{k: [] for k in ("input_ids", "attention_mask", "token_type_ids", "spans")
                                     if k in rows[0]}}  # an empty row
        col = Collator(pad_token_id=7, regression=regression, pad_to=pad_to)
        assert_same_batch(col(rows), naive_collate(rows, 7, regression, pad_to))
    if kind == "spans":  # no row has a span
        none = [{**r, "spans": []} for r in ragged_rows(5, 99, spans=True)]
        out = Collator(0, False)(none)
        assert out["spans"].shape == (5, 0, 2)
        assert_same_batch(out, naive_collate(none, 0, False))


def test_vectorised_collator_accepts_tensor_rows_and_rejects_overlong_rows() -> None:
    rows = ragged_rows(6, 3, lo=1, hi=20)
    as_tensors = [{**r, "input_ids": torch.tensor(r["input_ids"], dtype=torch.int32),
                   "attention_mask": np.array(r["attention_mask"], dtype=np.int8)} for r in rows]
    assert_same_batch(Collator(0, False)(as_tensors), naive_collate(rows, 0, False))
    with pytest.raises(ValueError, match="more than the batch width"):
        Collator(0, False, pad_to=3)(rows)


@pytest.mark.parametrize("pad_to", [None, 64])
@pytest.mark.parametrize("masking", [True, False])
def test_vectorised_corpus_collator_keeps_its_seeded_masks(masking: bool, pad_to: int | None) -> None:
    from kdrun.strategies.general.data import CorpusCollator

    mask_id = 3 if masking else None
    col = CorpusCollator(pad_token_id=0, mask_token_id=mask_id, vocab_size=50, probability=0.15, seed=11, pad_to=pad_to)
    for seed in range(10):
        # lengths 0..2 have no inner token to mask; the rest are BERT-like segments
        rows = [{"input_ids": [1, *r["input_ids"], 2][: len(r["input_ids"]) + 2 - (j % 3 == 0) * 2], "idx": r["idx"]}
                for j, r in enumerate(ragged_rows(random.Random(seed).randint(1, 33), seed, lo=0, hi=50))]
        assert_same_batch(col(rows), naive_corpus_collate(rows, 0, mask_id, 50, 0.15, 11, pad_to))
    # mask_segment (public) still gives a segment's mask as before
    seq = torch.arange(10, 40)
    chosen, new = CorpusCollator(0, 3, 50, 0.15, seed=11).mask_segment(len(seq), 5, seq)
    ref = naive_corpus_collate([{"input_ids": seq.tolist(), "idx": 5}], 0, 3, 50, 0.15, 11)
    assert torch.equal(chosen, ref["mlm_positions"]) and torch.equal(new, ref["input_ids"][0, chosen])


def tiny_dataset(n: int = 90, seed: int = 0):
    import datasets

    rows = ragged_rows(n, seed, lo=2, hi=30, spans=True)
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    cols["idx"] = list(range(n))  # the loader's rows are the dataset's rows
    cols["length"] = [len(r["input_ids"]) for r in rows]
    return datasets.Dataset.from_dict(cols), rows


def test_make_loader_collates_as_row_by_row_and_passes_pin_memory() -> None:
    from kdrun.tasks.data.batches import make_loader

    ds, rows = tiny_dataset()
    loader, sampler = make_loader(ds, 8, Collator(0, False), seed=1, train=True)
    assert loader.num_workers == 0 and not loader.pin_memory
    sampler.set_epoch(0)
    batches = sampler.batches()
    got = list(loader)
    assert len(got) == len(batches)
    for b, idx in zip(got, batches):
        assert_same_batch(b, naive_collate([{**rows[i], "idx": i} for i in idx], 0, False))
    pinned, _ = make_loader(ds, 8, Collator(0, False), seed=1, train=True, pin_memory=True)
    assert pinned.pin_memory


def epoch_idx(loader) -> list[list[int]]:
    return [b["idx"].tolist() for b in loader]


def test_persistent_workers_keep_exact_resume() -> None:
    """With worker processes (persistent across epochs) every epoch, a resumed one included, yields
    exactly the sampler's batches after set_epoch(epoch, start_batch), as loading in-process does."""
    from kdrun.tasks.data.batches import make_loader

    ds, _ = tiny_dataset(120)
    plain, s0 = make_loader(ds, 8, Collator(0, False), seed=5, train=True, num_workers=0)
    loader, sampler = make_loader(ds, 8, Collator(0, False), seed=5, train=True, num_workers=2)
    assert loader.num_workers == 2 and loader.persistent_workers
    # a resumed run: its first epoch starts at batch 4 of epoch 1
    sampler.set_epoch(1, start_batch=4)
    s0.set_epoch(1)
    assert epoch_idx(loader) == s0.batches()[4:]
    # an epoch abandoned with batches prefetched (a stage ends mid-epoch), then the next one from batch 3
    sampler.set_epoch(2)
    it = iter(loader)
    first = [next(it)["idx"].tolist() for _ in range(2)]
    assert first == sampler.batches()[:2]
    sampler.set_epoch(3, start_batch=3)
    s0.set_epoch(3, start_batch=3)
    got = list(loader)
    want = list(plain)
    assert [b["idx"].tolist() for b in got] == sampler.batches()[3:]
    for a, b in zip(got, want):
        assert_same_batch(a, b)
    sampler.set_epoch(4)
    assert epoch_idx(loader) == sampler.batches()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_resolve_num_workers(monkeypatch) -> None:
    from kdrun.errors import ConfigError
    from kdrun.tasks.data import batches as pipeline

    monkeypatch.setattr(pipeline, "_available_cpus", lambda: 16)
    assert pipeline.resolve_num_workers("auto", "cpu") == 0
    assert pipeline.resolve_num_workers("auto", "cuda") == 4
    assert pipeline.resolve_num_workers("auto", torch.device("cuda", 0)) == 4
    assert pipeline.resolve_num_workers("auto", torch.device("cpu")) == 0
    monkeypatch.setattr(pipeline, "_available_cpus", lambda: 5)
    assert pipeline.resolve_num_workers("auto", "cuda") == 2
    monkeypatch.setattr(pipeline, "_available_cpus", lambda: 1)
    assert pipeline.resolve_num_workers("auto", "cuda") == 0
    assert pipeline.resolve_num_workers(0, "cuda") == 0 and pipeline.resolve_num_workers(3, "cpu") == 3
    for bad in (-1, "two", "4", "Auto", 1.5, True, None):
        with pytest.raises(ConfigError, match=r"train\.num_workers"):
            pipeline.resolve_num_workers(bad, "cpu")
    ds, _ = tiny_dataset(10)
    with pytest.raises(ConfigError, match=r"train\.num_workers=-2"):
        pipeline.make_loader(ds, 4, Collator(0, False), seed=0, train=True, num_workers=-2)
    # auto through make_loader: as for CUDA when the batches are pinned, else as for the CPU
    monkeypatch.setattr(pipeline, "_available_cpus", lambda: 8)
    assert pipeline.make_loader(ds, 4, Collator(0, False), seed=0, train=True, num_workers="auto")[0].num_workers == 0
    assert pipeline.make_loader(ds, 4, Collator(0, False), seed=0, train=True, num_workers="auto",
                                pin_memory=True)[0].num_workers == 4


def test_num_workers_config_key() -> None:
    from tests.conftest import compose

    assert compose([]).train.num_workers == "auto"
    assert compose(["train.num_workers=3"]).train.num_workers == 3


def test_bench_collate_script_runs_fast() -> None:
    import re

    from kdrun.runtime import forkrun

    repo = Path(__file__).resolve().parents[1]
    r = forkrun.run(["--fast"], None, repo, 300, script="scripts/bench/collate.py")  # forked: python SCRIPT ARGS
    assert r.returncode == 0, r.stderr
    m = re.search(r"^ratio (\d+\.\d+)x", r.stdout, re.M)
    assert m and float(m.group(1)) > 0, r.stdout
