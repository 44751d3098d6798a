"""Choices made for speed never change a number: the teacher-output store (``teacher.store`` auto, on
or off) trains the same student bit for bit, and the padding multiple does not split the store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_teacher_store import entries, quiet_run, student

# 96 rows, one epoch, one compute thread (the thread count changes summation order; by default it
# follows the kdrun runs alive on the host)
SMALL = ["student=truncated", "task.toy.num_train=96", "task.toy.num_validation=16", "train.epochs=1",
         "train.num_threads=1"]
OBJECTIVES = {
    "logit": ["objective=logit"],  # the logits-only stage: the live side is the in-run logit table
    "tinybert": ["objective=tinybert", "objective.params.intermediate_epochs=1",
                 "objective.params.prediction_epochs=1"],  # hidden states, attention scores, logits
}


def assert_same_student(a: Path, b: Path) -> None:
    wa, wb = student(a), student(b)
    assert wa.keys() == wb.keys()
    differ = {k: float((wa[k] - wb[k]).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    assert not differ, f"{len(differ)} of {len(wa)} tensors differ: {differ}"


# The live side rounds once kdrun.engine.compiled.live_teacher returns live_as_stored(parts, plan, features)
# and kdrun.engine.evaluation._teacher_logit_table keeps logits_as_stored(parts, plan, logits).


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_store_on_and_off_train_the_same_student(objective: str, run_cfg, cache_dir: Path, tmp_path: Path) -> None:
    """The default student (``truncated``) and store dtype (fp16): read from the store or run live,
    the teacher's outputs are the same numbers, so is every weight of the student."""
    args = [*SMALL, *OBJECTIVES[objective]]
    live = quiet_run(run_cfg(*args, "teacher.store=off"), tmp_path / "off")
    assert "teacher store" not in live
    stored = quiet_run(run_cfg(*args, "teacher.store=on"), tmp_path / "on")
    assert "the teacher does not run" in stored and all(
        "float16" in (e / "meta.json").read_text() for e in entries(cache_dir))
    assert_same_student(tmp_path / "off", tmp_path / "on")


def _tiny_teacher_and_rows():
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    teacher = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)).eval()
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 13, size=10)
    rows = {"input_ids": [rng.integers(1, 100, n).tolist() for n in lengths],
            "attention_mask": [[1] * n for n in lengths], "length": lengths.tolist(), "labels": [0] * 10,
            "idx": rng.permutation(np.arange(100, 110)).tolist()}  # ids that are no positions
    return teacher, Dataset.from_dict(rows), lengths


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_live_features_are_the_stored_ones(dtype: str, tmp_path: Path) -> None:
    """The live teacher's features, served as the store serves them, equal what the store wrote and
    reads for the same batch bit for bit: logits, hidden states, Q/K/V and attention scores, zero
    past each row's length."""
    from types import SimpleNamespace

    from kdrun.engine.teacher_store import STORE_DTYPES, StoreReader, as_stored, build_store
    from kdrun.models.features import extract_features
    from kdrun.tasks.data.batches import Collator, make_loader

    teacher, ds, lengths = _tiny_teacher_and_rows()
    needs = frozenset({"logits", "hidden_states", "qkv"})
    acc = SimpleNamespace(device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", enabled=False))
    build_store(tmp_path, teacher, ds, lengths, Collator(0, False), needs, len(ds), acc, STORE_DTYPES[dtype])
    reader = StoreReader(tmp_path)
    (batch,) = make_loader(ds, len(ds), Collator(0, False), seed=0, train=False)[0]  # the build's batch
    with torch.no_grad():
        raw = extract_features(teacher, batch, needs)
    live = as_stored(raw, STORE_DTYPES[dtype])
    stored = reader.features({**batch, **reader.gather(batch["idx"].numpy(), int(lengths.max()))}, needs)
    assert torch.equal(live.logits, stored.logits)
    for h_live, h_stored in zip(live.hidden_states, stored.hidden_states, strict=True):
        assert torch.equal(h_live, h_stored)
    for layer in (1, 2):
        for w in "qkv":
            assert torch.equal(live.qkv().projection(w, layer), stored.qkv().projection(w, layer))
        assert torch.equal(live.attention_scores(layer), stored.attention_scores(layer))
    pad = ~batch["attention_mask"].bool()
    assert pad.any() and bool((live.hidden_states[-1][pad] == 0).all())
    rounded = not torch.equal(raw.hidden_states[-1][~pad], live.hidden_states[-1][~pad])
    assert rounded == (dtype != "fp32")  # fp16/bf16 changed the fp32 values; fp32 kept them


def test_served_rounds_as_the_store_writes() -> None:
    """fp16 and bf16 round to nearest as the build's cast does; fp16 keeps what lies beyond its range
    (the store refuses it and the stage runs live: the same numbers either way)."""
    from kdrun.engine.teacher_store import served

    x = torch.tensor([[[1.0 + 2**-12, 3.0, 7e4]], [[-1e-8, 2.5, -1e5]]])
    valid = torch.tensor([[True], [False]])
    half = served(x, torch.float16, valid)
    assert half.dtype == torch.float32
    assert half[0, 0].tolist() == [1.0, 3.0, 7e4] and half[1, 0].tolist() == [0.0, 0.0, 0.0]
    assert served(torch.tensor([1.0 + 2**-8 + 2**-10]), torch.bfloat16).item() == 1.0 + 2**-7
    assert served(torch.tensor([-1e5]), torch.bfloat16).item() == -99840.0


def test_padding_multiple_shares_one_entry(run_cfg, cache_dir: Path, tmp_path: Path) -> None:
    """Runs that differ only in ``train.pad_to_multiple_of`` (an eager run and a compiled one's
    widths) read one entry: it is built at the rows' own widths and keeps them unpadded. With
    widths that the multiple leaves as they are (a multiple of 1), the students are equal too."""
    args = [*SMALL, *OBJECTIVES["tinybert"], "teacher.store=on"]
    first = quiet_run(run_cfg(*args, "train.pad_to_multiple_of=0"), tmp_path / "p0")
    assert first.count("teacher store: building") == 2
    built = entries(cache_dir)
    for multiple in (32, 1):
        out = quiet_run(run_cfg(*args, f"train.pad_to_multiple_of={multiple}"), tmp_path / f"p{multiple}")
        assert "building" not in out and out.count("from the cache") == 2
    assert entries(cache_dir) == built
    assert_same_student(tmp_path / "p0", tmp_path / "p1")


def test_the_key_leaves_the_padding_multiple_out() -> None:
    """The build's collator never rounds widths up, so the key's collator settings are the same for
    every multiple; every other setting of the collator stays in the key."""
    from kdrun.engine.teacher_store import build_collator, collator_settings
    from kdrun.tasks.data.batches import Collator

    plain, bucketed = Collator(0, False), Collator(0, False, multiple=32, limit=128)
    assert collator_settings(build_collator(bucketed)) == collator_settings(plain)
    assert bucketed.multiple == 32  # the run's own collator is left as it is
    rows = [{"input_ids": [1] * n, "attention_mask": [1] * n, "labels": 0, "idx": i} for i, n in enumerate((3, 5))]
    assert build_collator(bucketed)(rows)["input_ids"].shape == (2, 5)
    assert collator_settings(build_collator(Collator(1, False))) != collator_settings(plain)  # pad id
    assert np.array_equal(bucketed(rows)["input_ids"].shape, (2, 32))
