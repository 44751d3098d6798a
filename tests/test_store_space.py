"""The teacher-output store's space and key: a full disk during the build is one line and publishes
nothing (a small tmpfs), too little free space runs the teacher live, fp16 overflow is refused
naming the output, opens do not read the entry's bytes, and the key follows every setting that
changes the outputs without reading a token."""

from __future__ import annotations

import io
import os
import re
import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

from kdrun.app.run import run
from tests.conftest import TINY, TOY, compose

# tinybert's first stage stores hidden states and Q/K/V: about 1 MiB for the toy rows
TINYBERT = ["objective=tinybert", "objective.params.intermediate_epochs=1", "objective.params.prediction_epochs=1"]


def _run(cfg, run_dir: Path) -> str:
    """The run's printed output, its store lines' continuations (kdrun.engine.teacher_store.wrapped)
    joined back, so a phrase reads the same whatever the paths' lengths."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        run(cfg, run_dir)
    return re.sub(r"\n\[kdrun\]   ", " ", buf.getvalue())


def published(kind_dir: Path) -> list[Path]:
    return [p for p in kind_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if kind_dir.is_dir() else []


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """The cache's teacher_outputs directory on a 256 KiB tmpfs (skips where mounting is not allowed)."""
    where = tmp_path / "cache" / "teacher_outputs"
    where.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_enospc_during_the_build_is_one_line_and_publishes_nothing(small_tmpfs: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    from kdrun.engine import teacher_store
    from kdrun.errors import UserError

    cfg = compose([*TINY, *TOY, *TINYBERT, f"cache_dir={tmp_path / 'cache'}", "teacher.store=on"])
    # the free-space check passes (as when another writer fills the disk during the build) ...
    monkeypatch.setattr(teacher_store, "free_bytes", lambda path: 2**40)
    with pytest.raises(UserError) as err:
        _run(cfg, tmp_path / "run")
    # ... and the build's allocation meets the full disk: one line, nothing published, no staging left
    assert "\n" not in str(err.value) and "no space left" in str(err.value) and "cache_dir=" in str(err.value)
    assert "nothing was published" in str(err.value)
    assert [p.name for p in small_tmpfs.iterdir() if not p.name.endswith(".lock")] == []


def test_too_little_free_space_runs_the_teacher_live(small_tmpfs: Path, tmp_path: Path) -> None:
    cfg = compose([*TINY, *TOY, *TINYBERT, f"cache_dir={tmp_path / 'cache'}", "teacher.store=on"])
    out = _run(cfg, tmp_path / "run")
    assert "free; running the teacher live" in out and (tmp_path / "run" / "student").is_dir()
    # the hidden states and Q/K/V did not fit and were not written; the prediction stage's logits did
    assert [("hidden.0" in (e / "meta.json").read_text()) for e in published(small_tmpfs)] == [False]


def test_files_are_allocated_not_sparse(tmp_path: Path) -> None:
    from kdrun.engine.teacher_store import RowMap, _Writer

    w = _Writer(tmp_path, np.array([0, 3000, 6000]), RowMap(np.arange(2)), torch.float32)
    w._array("hidden.0", True, 256)
    st = (tmp_path / "hidden.0.npy").stat()
    assert st.st_blocks * 512 >= st.st_size  # every block is there (a sparse file has far fewer)


def test_fp16_overflow_runs_the_teacher_live_naming_the_output(tmp_path: Path, monkeypatch) -> None:
    from kdrun.engine import store_build, teacher_store

    real = store_build._outputs

    def loud(feats, kinds):  # a teacher whose layer-2 hidden state exceeds fp16's range
        out = real(feats, kinds)
        if "hidden.2" in out:
            out["hidden.2"] = out["hidden.2"] * 1e6
        return out

    monkeypatch.setattr(store_build, "_outputs", loud)
    cfg = compose([*TINY, *TOY, *TINYBERT, f"cache_dir={tmp_path / 'cache'}", "teacher.store=on"])
    out = _run(cfg, tmp_path / "run")
    assert "the teacher's hidden.2 reaches" in out and "beyond fp16's range" in out
    assert "teacher.store_dtype=bf16 or fp32 stores it" in out
    # the stage without hidden states (prediction: logits) is stored; the overflowing one is not
    entries = published(tmp_path / "cache" / "teacher_outputs")
    assert len(entries) == 1 and "hidden.2" not in (entries[0] / "meta.json").read_text()
    with pytest.raises(teacher_store.StoreOverflow):
        store_build._to_numpy(torch.tensor([70000.0]), torch.float16, "x")
    assert store_build._to_numpy(torch.tensor([65504.0]), torch.float16, "x")[0] == 65504


def test_opening_an_entry_checks_sizes_not_checksums(tmp_path: Path, monkeypatch) -> None:
    from kdrun.runtime import cache

    def build(tmp: Path) -> None:
        (tmp / "a.npy").write_bytes(b"x" * 1000)

    entry, cached = cache.get_or_build(tmp_path, "teacher_outputs", "k", build, checksums=False)
    assert not cached
    monkeypatch.setattr(cache, "file_sha256", lambda p: pytest.fail("an open read the entry's bytes"))
    assert cache.get_or_build(tmp_path, "teacher_outputs", "k", build, checksums=False) == (entry, True)
    (entry / "a.npy").write_bytes(b"x" * 999)  # a truncated file is still found, by its size
    monkeypatch.undo()
    out = io.StringIO()
    with redirect_stdout(out):
        _, cached = cache.get_or_build(tmp_path, "teacher_outputs", "k", build, checksums=False)
    assert not cached and "a.npy has 999 bytes" in out.getvalue()


def test_the_key_follows_config_collator_and_rows_without_reading_tokens() -> None:
    from transformers import BertConfig, BertModel

    from kdrun.engine.teacher_store import StoreSettings, store_key
    from kdrun.strategies.general.data import CorpusCollator

    def bert(**kw):
        torch.manual_seed(0)
        args = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "intermediate_size": 16, **kw}
        return BertModel(BertConfig(**args))

    ids, lengths = np.arange(10), np.full(10, 7)

    def key(teacher=None, collator=None, ids=ids, lengths=lengths, **settings):
        return store_key(StoreSettings(**settings), teacher or bert(), collator or CorpusCollator(0, 4, 50),
                         ids, lengths, ["hidden_states"], "no")

    base = key()
    assert key() == base  # deterministic
    assert key(teacher=bert(num_attention_heads=4)) != base  # same weights' shapes, other heads
    assert key(teacher=bert(layer_norm_eps=1e-5)) != base
    assert key(teacher=bert(hidden_act="relu")) != base
    assert key(collator=CorpusCollator(0, 4, 50, probability=0.2)) != base
    assert key(collator=CorpusCollator(0, 4, 50, seed=1)) != base
    assert key(ids=ids + 100) != base and key(lengths=lengths + 1) != base  # another subsample
    assert key(dtype="bf16") != base
    assert key(key={"data_key": "x"}) != key(key={"data_key": "y"})
    # the augmentation's key only matters to a stage on the augmented data
    assert key(key={"augmentation": "a"}) == key(key={"augmentation": "b"})


def test_the_size_cap_is_checked_before_any_hashing(tmp_path: Path, monkeypatch) -> None:
    from kdrun.engine import teacher_store

    monkeypatch.setattr(teacher_store, "store_key", lambda *a, **k: pytest.fail("hashed before the cap"))
    cfg = compose([*TINY, *TOY, "objective=logit", f"cache_dir={tmp_path / 'cache'}", "teacher.store=on",
                   "teacher.store_max_gb=1e-9"])
    assert "more than teacher.store_max_gb" in _run(cfg, tmp_path / "run")


def test_row_lengths_and_ids_come_from_arrow_with_selections() -> None:
    import datasets

    from kdrun.engine.teacher_store import row_ids, row_lengths

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]], "idx": [5, 9, 2]}).select([2, 0])
    assert row_lengths(ds).tolist() == [2, 3] and row_ids(ds).tolist() == [2, 5]
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"


def test_a_store_file_written_after_publishing_is_found_without_reading_the_others(tmp_path: Path) -> None:
    """Opens check sizes, not checksums; a file whose modification time moved since publishing (a byte
    flipped in place) is checksummed, and the entry is refused naming it."""
    import os

    from kdrun.runtime.cache import entry_problem, write_manifest

    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "a.npy").write_bytes(b"\0" * 64)
    (entry / "b.npy").write_bytes(b"\1" * 64)
    write_manifest(entry)
    assert entry_problem(entry, checksums=False) is None
    st = (entry / "b.npy").stat()
    os.utime(entry / "b.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes: fine
    assert entry_problem(entry, checksums=False) is None
    with open(entry / "a.npy", "r+b") as f:
        f.seek(7)
        f.write(b"\x80")
    os.utime(entry / "a.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    want = "a.npy does not match its checksum (written to after it was published)"
    assert entry_problem(entry, checksums=False) == want
