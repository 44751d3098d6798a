"""End-to-end runs with tiny random models on the toy task (in-process, seconds each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kdrun.app.run import run
from kdrun.engine.trainer import SimulatedInterrupt, TrainingDiverged

TWO_STAGES = [
    "objective=logit",
    "objective.stages=[{name: intermediate, epochs: 1, lr: 1e-3, batch_size: 16, select_best: false, "
    "losses: [{name: hidden_mse, weight: 1.0}]}, {name: prediction, epochs: 2, lr: 1e-3, batch_size: 16, "
    "eval_every_steps: 7, losses: [{name: ce, weight: 0.1}, {name: logit_kd, weight: 0.9, "
    "params: {temperature: 2.0}}]}]",
    "student=truncated",
    "student.num_layers=2",
    "train.checkpoint_every_steps=5",
]


def test_two_stage_run_writes_all_outputs(run_cfg, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    run_dir = tmp_path / "run"
    summary = run(run_cfg(*TWO_STAGES), run_dir)
    res = json.loads((run_dir / "results.json").read_text())
    assert res["task"] == "toy" and [s["stage"] for s in res["stages"]] == ["intermediate", "prediction"]
    assert set(res["teacher"]["metrics"]["validation"]) == {"accuracy", "f1"}
    assert res["teacher"]["cached"] is False
    assert res["layer_pairs"] == [[0, 0], [1, 2], [2, 4]]  # 4-layer teacher, 2-layer student
    assert res["student"]["selected"]["stage"] == 1  # intermediate stage does not select
    assert res["config"]["task"]["name"] == "toy" and "torch" in res["versions"]
    assert summary["student"]["metrics"] == res["student"]["metrics"]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*lines)
    assert {"train/hidden_mse", "train/ce", "train/logit_kd", "train/lr", "train/examples_per_s",
            "eval/validation/accuracy"} <= keys
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "student")
    assert model.config.num_hidden_layers == 2
    # the saved student reproduces the reported dev metric
    from kdrun.app.run import make_accelerator
    from kdrun.engine.trainer import predict
    from kdrun.models.loading import load_tokenizer
    from kdrun.tasks.data.batches import Collator, tokenize_splits
    from kdrun.tasks.data.sources import load_task_data
    from kdrun.tasks.metrics import compute_task_metrics

    cfg = run_cfg(*TWO_STAGES)
    tok = load_tokenizer(str(run_dir / "student"))
    data = tokenize_splits(load_task_data(cfg.task), tok, cfg.task.max_seq_length)["validation"]
    logits, labels = predict(model, data, Collator(tok.pad_token_id, False), 64, make_accelerator(cfg.train))
    acc = compute_task_metrics(["accuracy"], logits, labels, regression=False)["accuracy"]
    assert acc == pytest.approx(res["student"]["metrics"]["validation"]["accuracy"])


def test_teacher_cache_hit_on_second_run(run_cfg, tmp_path: Path) -> None:
    first = run(run_cfg("objective=logit"), tmp_path / "a")
    second = run(run_cfg("objective=finetune", "student=truncated"), tmp_path / "b")
    assert first["teacher"]["cached"] is False and second["teacher"]["cached"] is True
    assert first["teacher"]["path"] == second["teacher"]["path"]
    assert first["teacher"]["metrics"] == second["teacher"]["metrics"]
    # a fine-tuned teacher can be given directly; it is evaluated, not retrained
    given = run(run_cfg("objective=logit", f"teacher.checkpoint={first['teacher']['path']}"), tmp_path / "d")
    assert given["teacher"]["source"] == "teacher.checkpoint"
    assert given["teacher"]["metrics"]["validation"] == pytest.approx(first["teacher"]["metrics"]["validation"])
    # a different teacher setting is a different cache entry
    third = run(run_cfg("objective=logit", "teacher.finetune.lr=5e-4"), tmp_path / "c")
    assert third["teacher"]["cached"] is False and third["teacher"]["path"] != first["teacher"]["path"]


def test_interrupted_run_resumes_to_identical_result(run_cfg, tmp_path: Path) -> None:
    ref = run(run_cfg(*TWO_STAGES), tmp_path / "ref")
    rd = tmp_path / "resumed"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg(*TWO_STAGES, "train.stop_after_steps=17"), rd)
    assert not (rd / "results.json").exists()
    state = json.loads((rd / "checkpoints" / "last" / "state.json").read_text())
    assert state["global_step"] == 15 and state["stage"] == 1  # last periodic checkpoint before the kill
    # the same configuration again (as a requeued job would run it) continues from step 15
    cfg = run_cfg(*TWO_STAGES)
    out = run(cfg, rd)
    assert out["student"]["metrics"] == ref["student"]["metrics"]
    assert [s["metrics"] for s in out["stages"]] == [s["metrics"] for s in ref["stages"]]
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "ref" / "student" / "model.safetensors"))
    wb = load_file(str(rd / "student" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_completed_run_is_not_redone(run_cfg, tmp_path: Path) -> None:
    rd = tmp_path / "r"
    first = run(run_cfg("objective=finetune"), rd)
    mtime = (rd / "results.json").stat().st_mtime
    again = run(run_cfg("objective=finetune"), rd)
    assert again["student"]["metrics"] == first["student"]["metrics"]
    assert (rd / "results.json").stat().st_mtime == mtime
    n_logged = len((rd / "metrics.jsonl").read_text().splitlines())
    redo = run(run_cfg("objective=finetune", "resume=false"), rd)  # redone from scratch, same result
    assert redo["student"]["metrics"] == first["student"]["metrics"]
    assert (next((rd / "previous").iterdir()) / "results.json").exists()  # the old run, moved aside
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == n_logged  # a fresh log, not appended


def test_nan_loss_stops_naming_term_and_keeps_checkpoint(run_cfg, tmp_path: Path) -> None:
    from dataclasses import dataclass

    from kdrun.losses import LOSSES, Params, register_loss

    @dataclass(frozen=True)
    class StepAt(Params):
        step_at: int = 3

    if "test_nan_after" not in LOSSES:
        @register_loss("test_nan_after", params=StepAt, uses_teacher=False)
        def _nan_after(s, t, batch, ctx, p: StepAt):
            v = s.logits.float().pow(2).mean()
            return v * float("nan") if ctx.step >= p.step_at else v

    rd = tmp_path / "nan"
    cfg = run_cfg("objective=finetune", "objective.stages.0.losses=[{name: ce, weight: 1.0}, {name: test_nan_after, "
                  "weight: 1.0, params: {step_at: 4}}]", "train.checkpoint_every_steps=2")
    with pytest.raises(TrainingDiverged, match=r"test_nan_after.*step 5"):
        run(cfg, rd)
    assert not (rd / "results.json").exists()
    assert json.loads((rd / "checkpoints" / "last" / "state.json").read_text())["global_step"] == 4


def test_regression_task_runs(run_cfg, tmp_path: Path) -> None:
    # a toy regression: the toy labels as float scores via data_files
    import csv

    src = tmp_path / "reg"
    src.mkdir()
    for split, n in (("train", 64), ("dev", 32)):
        with open(src / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["sentence1", "sentence2", "label"])
            for i in range(n):
                w.writerow([f"good day number {i}", "a fine day" if i % 2 else "a bad day", float(i % 2) * 5])
    out = run(run_cfg("task=stsb", f"task.data_files={{train: {src}/train.csv, validation: {src}/dev.csv}}",
                      "objective=logit", toy=False), tmp_path / "run")
    assert set(out["student"]["metrics"]["validation"]) == {"pearson", "spearmanr"}
    shutil.rmtree(tmp_path / "run")


def test_wandb_offline_run_is_recorded(run_cfg, tmp_path: Path) -> None:
    rd = tmp_path / "w"
    run(run_cfg("objective=finetune", "logger=wandb", "logger.group=g1"), rd)
    runs = list((rd / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (blob,) = runs[0].glob("run-*.wandb")
    data = blob.read_bytes()  # the offline record holds the config, the group and the logged keys
    for needle in (b"max_seq_length", b"g1", b"train/ce", b"eval/validation/accuracy"):
        assert needle in data
