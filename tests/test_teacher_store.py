"""The teacher-output store: a frozen teacher's outputs computed once per (teacher, data, features),
read back exactly, shared by the runs of a sweep, rebuilt when damaged, and giving the student a
live teacher gives (fp32 store)."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kdrun.app.run import run
from tests.conftest import TINY, TOY, compose

# tinybert's stages read hidden states, attention scores (from Q and K) and logits
TINYBERT = ["objective=tinybert", "objective.params.intermediate_epochs=1", "objective.params.prediction_epochs=1"]


def quiet_run(cfg, run_dir: Path) -> str:
    """The run's printed output, its store lines' continuations (kdrun.engine.teacher_store.wrapped)
    joined back, so a phrase reads the same whatever the paths' lengths."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        run(cfg, run_dir)
    return re.sub(r"\n\[kdrun\]   ", " ", buf.getvalue())


def student(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "student" / "model.safetensors"))


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "teacher_outputs").glob("*") if p.is_dir() and not p.name.startswith("."))


def test_store_run_gives_the_live_teachers_student(run_cfg, cache_dir: Path, tmp_path: Path) -> None:
    live = quiet_run(run_cfg(*TINYBERT, "teacher.store=off", "teacher.store_dtype=fp32"), tmp_path / "live")
    assert "teacher store" not in live
    out = quiet_run(run_cfg(*TINYBERT, "teacher.store=on", "teacher.store_dtype=fp32"), tmp_path / "stored")
    assert out.count("teacher store: building") == 2 and "the teacher does not run" in out
    a, b = student(tmp_path / "live"), student(tmp_path / "stored")
    # equal up to the last bits a batch's padding width changes in the teacher's kernels
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    moved = load_file(str(next((cache_dir / "teachers").glob("*/model/model.safetensors"))))
    assert max(float((a[k] - moved[k]).abs().max()) for k in a if k in moved and moved[k].shape == a[k].shape) > 1e-3


def test_stored_features_equal_the_live_teachers(run_cfg, cache_dir: Path, tmp_path: Path) -> None:
    """Naive twin: the teacher run live on a padded batch, against the store gathered for that batch."""
    from kdrun.engine.teacher_store import StoreCollator, StoreReader
    from kdrun.models.features import extract_features
    from kdrun.models.loading import load_classifier
    from kdrun.tasks.data.batches import make_loader

    quiet_run(run_cfg(*TINYBERT, "teacher.store=on", "teacher.store_dtype=fp32"), tmp_path / "r")
    entry = next(e for e in entries(cache_dir) if "qkv" in StoreReader(e).meta["kinds"])
    reader = StoreReader(entry)
    assert {"hidden_states", "qkv"} <= set(reader.meta["kinds"]) and reader.meta["dtype"] == "float32"
    teacher_dir = str(next((cache_dir / "teachers").glob("*/model")))
    teacher = load_classifier(teacher_dir, 2).eval()
    from kdrun.models.loading import load_tokenizer
    from kdrun.tasks.data.batches import Collator, tokenize_splits
    from kdrun.tasks.data.sources import load_task_data

    cfg = run_cfg(*TINYBERT)
    tok = load_tokenizer(teacher_dir)
    train = tokenize_splits(load_task_data(cfg.task), tok, cfg.task.max_seq_length)["train"]
    collator = StoreCollator(Collator(tok.pad_token_id, False), reader)
    loader, sampler = make_loader(train, 16, collator, seed=3, train=True)
    sampler.set_epoch(0)
    batch = next(iter(loader))
    with torch.no_grad():
        live = extract_features(teacher, batch, frozenset({"hidden_states", "qkv"}))
    stored = reader.features(batch, frozenset({"hidden_states", "attention_scores"}))
    mask = batch["attention_mask"].bool()
    for h_live, h_store in zip(live.hidden_states, stored.hidden_states, strict=True):
        assert torch.allclose(h_live[mask], h_store[mask], atol=1e-5)
        assert torch.all(h_store[~mask] == 0)  # unpadded storage: nothing past a row's length
    for layer in (1, teacher.config.num_hidden_layers):
        q = live.qkv().projection("q", layer)
        assert torch.allclose(q[mask], stored.qkv().projection("q", layer)[mask], atol=1e-5)
        s_live, s_store = live.attention_scores(layer), stored.attention_scores(layer)
        keys = mask[:, None, None, :] & mask[:, None, :, None]
        assert torch.allclose(s_live[keys.expand_as(s_live)], s_store[keys.expand_as(s_store)], atol=1e-4)


def test_sweep_builds_once_and_a_damaged_entry_is_rebuilt(run_cfg, cache_dir: Path, tmp_path: Path) -> None:
    logs = [quiet_run(run_cfg("objective=logit", f"seed={s}", "teacher.store=on"), tmp_path / f"s{s}")
            for s in (1, 2, 3)]
    assert "teacher store: building logits" in logs[0]
    assert all("building" not in x and "from the cache" in x for x in logs[1:])
    (entry,) = entries(cache_dir)
    assert StoreReader_meta(entry)["dtype"] == "float16"
    (entry / "logits.npy").write_bytes((entry / "logits.npy").read_bytes()[:-3])  # truncated
    out = quiet_run(run_cfg("objective=logit", "seed=4", "teacher.store=on"), tmp_path / "s4")
    assert "is damaged" in out and "teacher store: building logits" in out
    assert len(entries(cache_dir)) == 1 and (cache_dir / "teacher_outputs" / ".damaged").is_dir()


def StoreReader_meta(entry: Path) -> dict:
    from kdrun.engine.teacher_store import StoreReader

    return StoreReader(entry).meta


def test_size_cap_and_off_run_the_teacher_live(run_cfg, cache_dir: Path, tmp_path: Path) -> None:
    out = quiet_run(run_cfg("objective=logit", "teacher.store=on", "teacher.store_max_gb=1e-9"), tmp_path / "cap")
    assert "more than teacher.store_max_gb=1e-09; running the teacher live" in out
    assert not entries(cache_dir)


def test_what_cannot_be_stored_says_why() -> None:
    from transformers import BertConfig, BertModel

    from kdrun.engine.teacher_store import why_not_storable
    from kdrun.strategies.dynabert.strategy import STRATEGY as DYNABERT

    bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16))
    assert why_not_storable(frozenset({"logits", "hidden_states", "qkv"}), bert, None) is None
    assert "attentions" in why_not_storable(frozenset({"logits", "attentions"}), bert, None)
    assert "mlm_logits" in why_not_storable(frozenset({"mlm_logits"}), bert, None)
    assert "DynaBERT" in why_not_storable(frozenset({"logits"}), bert, DYNABERT)


def test_gather_pads_rows_like_a_naive_loop(tmp_path: Path) -> None:
    """The vectorised gather against slicing each row out of the flat arrays by hand."""
    from kdrun.engine.teacher_store import StoreReader

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=12)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    hidden = rng.standard_normal((offsets[-1], 3)).astype(np.float16)
    logits = rng.standard_normal((12, 2)).astype(np.float16)
    np.save(tmp_path / "offsets.npy", offsets)
    np.save(tmp_path / "hidden.0.npy", hidden)
    np.save(tmp_path / "logits.npy", logits)
    import json

    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "float16", "arrays": {
        "hidden.0": {"per_token": True, "width": 3}, "logits": {"per_token": False, "width": 2}}}))
    idx = np.array([7, 2, 11, 0])
    got = StoreReader(tmp_path).gather(idx, 10)
    for r, i in enumerate(idx):
        n = lengths[i]
        want = np.zeros((10, 3), np.float16)
        want[:n] = hidden[offsets[i]: offsets[i] + n]
        assert np.array_equal(got["teacher/hidden.0"][r].numpy(), want)
        assert np.array_equal(got["teacher/logits"][r].numpy(), logits[i])


def test_store_settings_are_checked_at_compose_time() -> None:
    from kdrun.app.preflight import _check_store
    from kdrun.errors import ConfigError

    for override, reason in (("teacher.store=sometimes", "'sometimes', expected one of [auto, on, off]"),
                             ("teacher.store_dtype=int8", "'int8', expected one of [fp16, bf16, fp32]")):
        with pytest.raises(Exception) as e:
            compose([*TINY, *TOY, override])
        assert reason in str(e.value.__cause__) and override.split("=")[0] in str(e.value.__cause__)
    with pytest.raises(ConfigError, match="teacher.store_max_gb=0"):
        _check_store(compose([*TINY, *TOY, "teacher.store_max_gb=0"]).teacher)


def test_two_processes_store_run_gives_the_live_teachers_student(tmp_path: Path) -> None:
    """DDP (2 gloo processes): rank 0 builds the entry, both ranks read it; the student equals the
    live teacher's two-process student (fp32 store)."""
    from tests.test_ddp import torchrun
    from tests.test_sweeps import weights

    args = [*TINY, *TOY, *TINYBERT, f"cache_dir={tmp_path}/cache"]
    live = torchrun(tmp_path, *args, "teacher.store=off", "teacher.store_dtype=fp32", f"output_dir={tmp_path}/live")
    assert live.returncode == 0, live.stdout[-2000:] + live.stderr[-3000:]
    stored = torchrun(tmp_path, *args, "teacher.store=on", "teacher.store_dtype=fp32", f"output_dir={tmp_path}/stored")
    assert stored.returncode == 0, stored.stdout[-2000:] + stored.stderr[-3000:]
    assert stored.stdout.count("teacher store: building") == 2  # rank 0 only, once per stage
    assert stored.stdout.count("the teacher does not run") == 2
    a, b = weights(tmp_path / "live"), weights(tmp_path / "stored")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_results_count_the_teachers_forwards(run_cfg, tmp_path: Path) -> None:
    """Live: every training batch runs the teacher; stored: one pass over the training rows builds
    the entry, and a second run runs it not at all."""
    import json

    def forwards(name: str, *extra: str) -> dict:
        quiet_run(run_cfg("objective=minilm", "train.epochs=2", *extra), tmp_path / name)
        return json.loads((tmp_path / name / "results.json").read_text())["teacher_forward"]

    # minilm: a relations stage (live: every batch of both epochs of the 160 toy rows) and a
    # prediction stage (live: its in-run logit table, one pass); stored: one pass per stage's entry
    assert forwards("live", "teacher.store=off")["rows"] == 2 * 160 + 160
    assert forwards("build", "teacher.store=on")["rows"] == 160 + 160
    assert forwards("read", "teacher.store=on") == {"batches": 0, "rows": 0}


def test_bench_store_fast_mode(tmp_path: Path) -> None:
    """scripts/bench/store.py in its fast mode: the stored sweep runs the teacher once per stage's
    entry instead of for every run, and trains the same students."""
    import json

    from tests.conftest import load_script

    buf = io.StringIO()
    with redirect_stdout(buf):
        load_script("bench/store").main(["--fast", "--out", str(tmp_path / "b"), "--cache", str(tmp_path / "c")])
    res = json.loads((tmp_path / "b" / "bench_store.json").read_text())
    # two entries for 2 runs: logits (logit's stage and minilm's prediction stage share it) and
    # minilm's Q/K/V; each built by one pass over the 160 toy rows
    assert res["off"]["entries"] == 0 and res["on"]["entries"] == 2
    assert res["on"]["teacher_rows"] == 2 * 160 < res["off"]["teacher_rows"]
    assert res["on"]["score"] == pytest.approx(res["off"]["score"], abs=0.05)
    assert res["off"]["entry_bytes"] == 0 < res["on"]["entry_bytes"] and res["on"]["read_s_per_batch"] > 0
    assert 0 < res["read_share"] == pytest.approx(res["on"]["read_s_per_batch"] / res["on"]["step_s"])
    assert "speed-up of the sweep with the store" in buf.getvalue() and "of a stored run's step" in buf.getvalue()


def test_bench_peers_fast_mode(tmp_path: Path) -> None:
    """scripts/bench/peers.py in its fast mode (kdrun with and without the store on toy sentences):
    the table is printed and both runs trained the same student from the same start."""
    import json

    from tests.conftest import load_script

    buf = io.StringIO()
    with redirect_stdout(buf):
        load_script("bench/peers").main(["--fast", "--out", str(tmp_path / "p")])
    rows = {r["tool"]: r for r in json.loads((tmp_path / "p" / "bench_peers.json").read_text())}
    assert set(rows) == {"kdrun", "kdrun-nostore"}
    assert rows["kdrun"]["tokens_per_s"] > 0 and rows["kdrun"]["peak_rss_mb"] > 100
    assert rows["kdrun"]["dev_accuracy"] == pytest.approx(rows["kdrun-nostore"]["dev_accuracy"], abs=0.05)
    assert "tokens/s" in buf.getvalue()


def test_logit_table_looks_rows_up_by_idx_not_position() -> None:
    """The live teacher's logit table of a logits-only stage: a subsample keeps its rows' original
    ``idx`` (not positions); each batch row gets its own row's logits (a dictionary as the naive twin)."""
    import torch

    from kdrun.engine.trainer import LogitTable

    ids = torch.tensor([238, 5, 17, 900, 42])
    logits = torch.randn(5, 3)
    table = LogitTable(logits, ids)
    naive = {int(i): logits[k] for k, i in enumerate(ids)}
    batch_idx = torch.tensor([900, 5, 238, 42])
    got = table[batch_idx]
    assert torch.equal(got, torch.stack([naive[int(i)] for i in batch_idx]))


def test_auto_is_decided_once_per_entry_so_reruns_agree(run_cfg, tmp_path: Path, capsys) -> None:
    """``teacher.store=auto`` measures when an entry is first used and keeps the verdict beside it:
    a second run of the same stage takes the same decision (not a new, noisy timing), and a verdict
    written there is what it follows."""
    import json

    from kdrun.app.run import run

    cfg = ["objective=logit", "teacher.store=auto", "train.epochs=1"]
    run(run_cfg(*cfg), tmp_path / "a")
    (verdict,) = list((Path(run_cfg().cache_dir) / "teacher_outputs").glob("*/auto_decision.json"))
    first = json.loads(verdict.read_text())
    capsys.readouterr()
    run(run_cfg(*cfg, "seed=5"), tmp_path / "b")
    assert "measured when the entry was first used" in capsys.readouterr().out
    flipped = {**first, "use": not first["use"], "why": "teacher.store=auto: a recorded verdict"}
    verdict.write_text(json.dumps(flipped))
    out = run(run_cfg(*cfg, "seed=6"), tmp_path / "c")
    text = capsys.readouterr().out
    assert "a recorded verdict" in text
    assert (out["teacher_forward"]["rows"] == 0) == flipped["use"]  # live teacher rows only when not stored
