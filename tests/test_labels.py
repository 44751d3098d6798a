"""A saved student says what it predicts: id2label/label2id from task.label_names or the GLUE
task's class names, read back by transformers' pipeline() and kept by the ONNX export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import GLUE, compose

from kdrun.tasks.classification import class_names, labelled_model_config


@pytest.mark.parametrize("task,names", [
    ("sst2", ["negative", "positive"]), ("cola", ["unacceptable", "acceptable"]),
    ("mrpc", ["not_equivalent", "equivalent"]), ("mnli", ["entailment", "neutral", "contradiction"]),
    ("rte", ["entailment", "not_entailment"]), ("toy", None), ("stsb", None)])
def test_label_names_of_each_task(task: str, names) -> None:
    assert class_names(compose([f"task={task}"]).task) == names


def test_label_config_for_classes_regression_and_a_mismatch() -> None:
    sst2 = labelled_model_config(compose(["task=sst2"]).task)
    assert sst2["id2label"] == {0: "negative", 1: "positive"} and sst2["label2id"] == {"negative": 0, "positive": 1}
    assert labelled_model_config(compose(["task=stsb"]).task) == {"problem_type": "regression"}
    renamed = compose(["task=sst2", "task.label_names=[bad,good]"]).task
    assert labelled_model_config(renamed)["id2label"] == {0: "bad", 1: "good"}
    wrong_count = compose(["task=sst2", "task.num_labels=3"]).task  # names that do not fit are not guessed
    assert "id2label" not in labelled_model_config(wrong_count)


def test_label_names_reach_pipeline_and_the_onnx_export(run_cfg, tmp_path: Path) -> None:
    from transformers import pipeline

    from kdrun.app.run import run

    rd = tmp_path / "r"
    run(run_cfg("objective=finetune", "task.label_names=[no,yes]", "report.cost=false"), rd)
    saved = json.loads((rd / "student" / "config.json").read_text())
    assert saved["id2label"] == {"0": "no", "1": "yes"} and saved["label2id"] == {"no": 0, "yes": 1}
    answers = pipeline("text-classification", model=str(rd / "student"), device="cpu")(["a b c", "d e"])
    assert {a["label"] for a in answers} <= {"no", "yes"} and len(answers) == 2
    pytest.importorskip("onnxruntime")
    from kdrun.app import export as E

    assert E.main([str(rd), "--format", "onnx", "--out", str(tmp_path / "x"), "--threads", "1"]) == 0
    exported = json.loads((tmp_path / "x" / "config.json").read_text())
    assert exported["id2label"] == {"0": "no", "1": "yes"}


@pytest.mark.skipif(not (GLUE / "SST-2").is_dir(), reason="GLUE SST-2 is not available")
def test_label_names_of_a_real_sst2_student(run_cfg, tmp_path: Path) -> None:
    from transformers import pipeline

    from kdrun.app.run import run

    rd = tmp_path / "r"
    run(run_cfg("task=sst2", f"task.data_dir={GLUE / 'SST-2'}", "task.max_train_samples=32",
                "task.max_eval_samples=16", "objective=finetune", "report.cost=false", toy=False), rd)
    answer = pipeline("text-classification", model=str(rd / "student"), device="cpu")("a fine film")[0]
    assert answer["label"] in ("negative", "positive")
