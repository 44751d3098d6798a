"""The teacher-output store for every task kind: labelled, extractive QA, a corpus subsample (its
rows keep their corpus idx, which are no positions) and the token-classification plug-in kind. Each
trains the same student with the store (fp32) as with the live teacher."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kdrun.app.run import run
from tests.conftest import TINY, TOY, compose

TOKEN_STAGES = ("[{name: tags, epochs: 1, lr: 5e-3, batch_size: 16, losses: [{name: token_ce, weight: 0.5}, "
                "{name: token_kd, weight: 0.5}]}]")


def _squad(tmp_path: Path) -> list[str]:
    from tests.test_qa import make_squad

    path = tmp_path / "squad.json"
    path.write_text(json.dumps(make_squad()))
    return ["task=squad", "task.max_seq_length=48", "task.doc_stride=16", f"task.data_files={path}",
            "task.split_by_article=3", "objective=logit"]


def _corpus(tmp_path: Path) -> list[str]:
    from tests.test_general import corpus_args, write_corpus

    return corpus_args(write_corpus(tmp_path / "corpus.txt"), "ckd_general", "task.max_train_samples=40")


KINDS = {
    "labelled": lambda tmp: [*TOY, "objective=ckd", "task.max_train_samples=100"],
    "qa": _squad,
    "corpus": _corpus,
    "tokens": lambda tmp: [*TOY, "task.kind=tokens", "task.imports=[tests.token_kind]",
                           "task.metrics=[token_accuracy]", "task.main_metric=token_accuracy",
                           "task.max_seq_length=32", "objective=finetune", "objective.imports=[tests.token_kind]",
                           f"objective.stages={TOKEN_STAGES}"],
}


def _run(tmp_path: Path, name: str, args: list[str]) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        run(compose([*TINY, "train.epochs=1", f"cache_dir={tmp_path / 'cache'}", *args]), tmp_path / name)
    return buf.getvalue()


@pytest.mark.parametrize("kind", list(KINDS))
def test_store_gives_the_live_teachers_student_for_every_kind(kind: str, tmp_path: Path) -> None:
    from kdrun.engine.teacher_store import StoreReader

    args = KINDS[kind](tmp_path)
    live = _run(tmp_path, "live", [*args, "teacher.store=off", "teacher.store_dtype=fp32"])
    assert "teacher does not run" not in live
    stored = _run(tmp_path, "stored", [*args, "teacher.store=on", "teacher.store_dtype=fp32"])
    assert "the teacher does not run" in stored, stored[-2000:]
    (entry,) = [p for p in (tmp_path / "cache" / "teacher_outputs").iterdir() if not p.name.startswith(".")
                and p.is_dir()]
    ids = np.load(entry / "ids.npy")
    if kind == "corpus":  # a subsample of the corpus: its rows keep their corpus idx
        assert len(ids) == 40 and not np.array_equal(ids, np.arange(40)) and ids.max() >= 40
    a = load_file(str(tmp_path / "live" / "student" / "model.safetensors"))
    b = load_file(str(tmp_path / "stored" / "student" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    # and the store's rows are the teacher's: a row gathered by its idx has its own length
    reader = StoreReader(entry)
    lengths = np.diff(reader.arrays["offsets"])
    some = ids[::7]
    got = reader.gather(some, int(lengths.max()))
    name = next(iter(reader.meta["arrays"]))
    if reader.meta["arrays"][name]["per_token"]:
        nonzero = (got[f"teacher/{name}"].abs().sum(-1) != 0).sum(1).numpy()
        assert np.array_equal(nonzero, lengths[::7])


def test_a_row_id_outside_the_entry_is_refused() -> None:
    from kdrun.engine.teacher_store import RowMap
    from kdrun.errors import UserError

    ids = np.array([238, 5, 17, 900])
    rows = RowMap(ids)
    assert rows.positions(np.array([900, 238, 17])).tolist() == [3, 0, 2]
    with pytest.raises(KeyError, match="row idx 6 is not in"):
        rows.positions(np.array([5, 6]))
    assert RowMap(np.arange(4)).identity
    with pytest.raises(UserError, match="idx column repeats 5"):
        RowMap(np.array([5, 1, 5]))


def test_left_padded_batches_are_refused(tmp_path: Path) -> None:
    from kdrun.engine.teacher_store import RowMap, _Writer

    offsets = np.array([0, 2, 5])
    w = _Writer(tmp_path, offsets, RowMap(np.arange(2)), torch.float32)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 padded on the left
    with pytest.raises(RuntimeError, match="right-padded"):
        w.add(np.array([0, 1]), mask, {"hidden.0": torch.zeros(2, 3, 4)})
