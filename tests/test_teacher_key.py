"""The teacher cache key: every setting that can change the fine-tuned teacher is in it, and every
other setting provably stays out of the teacher's fine-tuning.

kdrun/app/teacher.py classifies every key of ``task``, ``teacher`` and ``train`` (and the rest of the
run's config). The tests here fail when a schema key is missing from that classification, when a
keyed setting does not change the key, when an unkeyed one does, and (tiny real fine-tunes) when
the run's train settings change the teacher's weights.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kdrun import config as C
from kdrun.app import teacher as T
from tests.conftest import TINY, TOY, compose

REF, DATA, TOK, PREC = "random", "d" * 16, "t" * 16, "no"


def fields(schema) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


@functools.cache
def base(*extra: str):
    """The tiny config with ``extra`` overrides (composed once; callers do not modify it)."""
    return compose([*TINY, *TOY, *extra])


def key(cfg, ref: str = REF, data: str = DATA, tok: str = TOK, precision: str = PREC) -> str:
    return T.teacher_cache_key(cfg, ref, data, tok, precision)


# ------------------------------------------------------------------------------ classification


def _check_partition(schema, *tables: dict) -> None:
    names = [set(t) for t in tables]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not a & b, f"{sorted(a & b)} classified twice"
    unclassified = fields(schema) - set().union(*names)
    assert not unclassified, (
        f"{schema.__name__} keys {sorted(unclassified)} are not classified for the teacher cache: add each to "
        "the key or keep it from reaching the teacher's fine-tuning, and list it in kdrun/app/teacher.py")
    assert not set().union(*names) - fields(schema), "kdrun/app/teacher.py classifies keys the schema no longer has"


def test_every_train_key_is_classified() -> None:
    _check_partition(C.TrainConfig, T.TRAIN_KEYED, T.TRAIN_REPLACED, T.TRAIN_NOT_IN_KEY)
    assert set(base().train) == fields(C.TrainConfig)  # conf/config.yaml adds no key of its own


def test_every_task_key_is_classified() -> None:
    _check_partition(C.TaskConfig, T.TASK_KEYED, T.TASK_KEYED_AS_DATA, T.TASK_NOT_IN_KEY)


def test_every_teacher_key_is_classified() -> None:
    _check_partition(C.TeacherConfig, T.TEACHER_KEYED, T.TEACHER_KEYED_AS_RESOLVED, T.TEACHER_NOT_IN_KEY)


def test_every_run_key_is_classified() -> None:
    _check_partition(C.KdrunConfig, T.RUN_NOT_IN_KEY, dict.fromkeys(T.RUN_CLASSIFIED_BY_KEY))


# ------------------------------------------------------------------------ keyed settings change it

# A changed value for every setting in the key (the base: tiny_random teacher on the toy task).
KEYED_CHANGES = {
    "teacher.kind": "pretrained",
    "teacher.hidden_size": 48,
    "teacher.num_hidden_layers": 3,
    "teacher.num_attention_heads": 4,
    "teacher.intermediate_size": 96,
    "teacher.family": "roberta",
    "teacher.dropout": 0.2,
    "teacher.finetune.epochs": 3.0,
    "teacher.finetune.lr": 1e-4,
    "teacher.finetune.batch_size": 8,
    "teacher.finetune.warmup_ratio": 0.0,
    "teacher.finetune.weight_decay": 0.0,
    "teacher.finetune.eval_every_steps": 5,
    "teacher.finetune.seed": 1,
    "teacher.finetune.gradient_accumulation_steps": 2,
    "teacher.finetune.max_grad_norm": 0.5,
    "teacher.finetune.keep_best": False,
    "teacher.finetune.group_by_length": False,
    "teacher.finetune.optimizer": {"name": "SGD", "kwargs": None},
    "teacher.finetune.scheduler": "cosine",
    "task.num_labels": 3,
    "task.max_seq_length": 32,
    "task.train_split": "validation",
    "task.eval_splits": ["train"],
    "task.main_metric": "f1",
    "task.metrics": ["accuracy"],
}


def _override(name: str, value) -> str:
    if isinstance(value, list):
        text = "[" + ",".join(value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {'null' if v is None else v}" for k, v in value.items()) + "}"
    elif isinstance(value, bool):
        text = str(value).lower()
    else:
        text = str(value)
    return f"{name}={text}"


def test_changes_cover_every_keyed_setting() -> None:
    keyed = {f"teacher.{k}" for k in T.TEACHER_KEYED if k != "finetune"}
    keyed |= {f"teacher.finetune.{k}" for k in fields(C.FinetuneConfig)}
    keyed |= {f"task.{k}" for k in T.TASK_KEYED}
    assert keyed == set(KEYED_CHANGES) | set(QA_KEYED_CHANGES)


# Keyed for question answering teachers only (classification keys stay as they were).
QA_KEYED_CHANGES = {"task.kind": "qa", "task.doc_stride": 64, "task.max_answer_length": 12, "task.n_best": 5}


@pytest.mark.parametrize("name,value", list(QA_KEYED_CHANGES.items()))
def test_qa_setting_changes_the_key_of_qa_teachers_only(name: str, value) -> None:
    cfg, changed = base("task.kind=qa"), base("task.kind=qa", _override(name, value))
    if name != "task.kind":
        assert key(changed) != key(cfg)
        assert key(base(_override(name, value))) == key(base())  # a classification teacher does not read it
    else:
        assert key(base(_override(name, value))) != key(base())


@pytest.mark.parametrize("name,value", list(KEYED_CHANGES.items()))
def test_keyed_setting_changes_the_key(name: str, value) -> None:
    cfg = base()
    changed = base(_override(name, value))
    assert OmegaConf.select(changed, name) == value != OmegaConf.select(cfg, name)
    assert key(changed) != key(cfg)


def test_resolved_precision_is_keyed() -> None:
    assert set(T.TRAIN_KEYED) == {"precision"}
    cfg = base()
    assert len({key(cfg, precision=p) for p in ("no", "bf16", "fp16")}) == 3
    # train.precision itself is read only as the accelerator resolves it (auto = fp32 on a CPU)
    assert key(base("train.precision=fp32")) == key(base("train.precision=bf16")) == key(cfg)


def test_model_reference_and_tokenizer_are_keyed(tmp_path: Path) -> None:
    cfg = base("teacher.kind=pretrained")
    assert key(cfg, ref="bert-base-uncased") != key(cfg, ref="prajjwal1/bert-tiny")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    before = key(cfg, ref=str(model))
    (model / "model.safetensors").write_bytes(b"weights")
    assert key(cfg, ref=str(model)) != before  # a directory is keyed by its files too
    assert key(cfg, tok="u" * 16) != key(cfg)  # teacher.tokenizer: its fingerprint
    # a pretrained teacher's sizes are its checkpoint's: the random-model sizes are not read
    assert key(base("teacher.kind=pretrained", "teacher.hidden_size=48", "teacher.num_hidden_layers=3")) == key(cfg)


def _data_hash(cfg) -> str:
    from kdrun.tasks.data.common import data_fingerprint
    from kdrun.tasks.data.sources import load_task_data

    return data_fingerprint(load_task_data(cfg.task))


@pytest.mark.parametrize("overrides,changed", [
    ([], ["task.toy.seed=7"]),
    ([], ["task.toy.num_train=150"]),
    ([], ["task.max_train_samples=100"]),
    ([], ["task.max_eval_samples=50"]),
    (["task.max_train_samples=100"], ["task.sample_seed=1"]),
])
def test_data_selecting_task_keys_change_the_data_hash(overrides: list[str], changed: list[str]) -> None:
    a, b = base(*overrides), base(*overrides, *changed)
    assert key(a) == key(b)  # not read by the key directly ...
    assert _data_hash(a) != _data_hash(b)  # ... but through the content of the rows


def test_data_file_keys_change_the_data_hash(tmp_path: Path) -> None:
    import csv

    for name, flip in (("a.csv", 0), ("b.csv", 1)):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["sentence", "other", "label", "label2"])
            for i in range(12):
                w.writerow([f"row {i} one", f"row {i} two", (i + flip) % 2, (i // 2) % 2])
    files = f"task.data_files={{train: {tmp_path}/a.csv, validation: {tmp_path}/a.csv}}"
    ref = _data_hash(base("task.toy=null", files))
    for changed in (["task.data_files={train: " + f"{tmp_path}/b.csv, validation: {tmp_path}/a.csv" + "}"],
                    ["task.label_column=label2"], ["task.text_columns=[other]"]):
        cfg = base("task.toy=null", files, *changed)
        assert _data_hash(cfg) != ref, changed


# -------------------------------------------------------------------- excluded settings leave it

# A changed value for every setting not in the key (top level: one key of each group).
NOT_IN_KEY_CHANGES = {
    "train.seed": 7,  # via the top-level seed, below
    "train.epochs": 2.0,
    "train.lr": 1e-2,
    "train.device": "cpu",
    "train.precision": "bf16",  # keyed only as the accelerator resolves it (see above)
    "train.gradient_accumulation_steps": 2,
    "train.max_grad_norm": 0.01,
    "train.optimizer": {"name": "SGD", "kwargs": None},
    "train.scheduler": "cosine",
    "train.eval_batch_size": 7,
    "train.checkpoint_every_steps": 1,
    "train.keep_checkpoints": False,
    "train.keep_best": False,
    "train.cache_teacher_logits": False,
    "train.group_by_length": False,
    "train.pad_to_max_length": True,
    "train.num_workers": 1,
    "train.num_threads": 1,
    "train.tf32": False,
    "train.find_unused_parameters": True,
    "train.compile": True,
    "train.compile_backend": "eager",
    "train.cuda_graphs": True,
    "train.pad_to_multiple_of": 16,
    "train.stop_after_steps": 3,
    "task.name": "renamed",
    "task.validation_percent": 5.0,
    "task.min_segment_tokens": 3,
    "task.mlm_probability": 0.2,
    "task.selection_splits": ["validation"],
    "task.selection_threshold": 0.5,
    "task.imports": ["kdrun.tasks.classification"],
    "teacher.name": "renamed",
    "teacher.checkpoint": "/some/teacher",
    "teacher.store": "off",
    "teacher.store_dtype": "fp32",
    "teacher.store_max_gb": 1.0,
    "teacher.dtype": "bf16",
    "seed": 7,
    "student.hidden_size": 48,
    "objective.alpha": 0.3,
    "mapping.name": "last",
    "augmentation.seed": 3,
    "spans.min_word_pieces": 3,
    "logger.log_every_steps": 1,
    "cache_dir": "/elsewhere",
    "resume": False,
    "output_dir": "/out",
    "run_name": "other",
    "report.cost": False,
    "cache_max_gb": 5.0,
    "cache_wait_timeout_s": 60.0,
    "sweep.extra": 1,
    "launcher.extra": 1,
}


def test_not_in_key_changes_cover_every_excluded_setting() -> None:
    excluded = {f"train.{k}" for k in (*T.TRAIN_REPLACED, *T.TRAIN_NOT_IN_KEY)} | {"train.precision"}
    excluded |= {f"task.{k}" for k in T.TASK_NOT_IN_KEY} | {f"teacher.{k}" for k in T.TEACHER_NOT_IN_KEY}
    assert excluded <= set(NOT_IN_KEY_CHANGES)
    assert set(T.RUN_NOT_IN_KEY) <= {n.split(".")[0] for n in NOT_IN_KEY_CHANGES}


@pytest.mark.parametrize("name,value", list(NOT_IN_KEY_CHANGES.items()))
def test_excluded_setting_leaves_the_key(name: str, value) -> None:
    override = _override("seed" if name == "train.seed" else name, value)
    changed = base(("+" if name.endswith(".extra") else "") + override)
    assert OmegaConf.select(changed, name) == value != OmegaConf.select(base(), name)
    assert key(changed) == key(base())


@pytest.mark.parametrize("name", [*(f"task.{k}" for k in sorted(T.TASK_KEYED_AS_DATA)),
                                  *(f"teacher.{k}" for k in sorted(T.TEACHER_KEYED_AS_RESOLVED))])
def test_data_and_reference_keys_reach_the_key_only_as_what_they_resolve_to(name: str) -> None:
    """Keyed through the data hash, the resolved reference or the tokenizer fingerprint: the key
    function does not read them itself (any value; the config is untyped here)."""
    cfg = base()
    untyped = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.update(untyped, name, {"changed": [1, 2]}, merge=False)
    assert key(untyped) == key(cfg)


# ------------------------------------------------------------ what the teacher's fine-tuning sees


@pytest.mark.parametrize("name", sorted(T.TRAIN_REPLACED))
def test_replaced_train_keys_never_reach_the_teacher(name: str) -> None:
    value = NOT_IN_KEY_CHANGES[f"train.{name}"]
    cfg, changed = base(), base(_override("seed" if name == "seed" else f"train.{name}", value))
    assert changed.train[name] != cfg.train[name]
    assert T.teacher_train_cfg(changed.train, changed.teacher.finetune) == \
        T.teacher_train_cfg(cfg.train, cfg.teacher.finetune)


@pytest.mark.parametrize("name", ["seed", "gradient_accumulation_steps", "max_grad_norm", "keep_best",
                                  "group_by_length", "optimizer", "scheduler"])
def test_teacher_uses_its_own_finetune_settings(name: str) -> None:
    cfg = base(_override(f"teacher.finetune.{name}", KEYED_CHANGES[f"teacher.finetune.{name}"]))
    ttcfg = T.teacher_train_cfg(cfg.train, cfg.teacher.finetune)
    assert ttcfg[name] == cfg.teacher.finetune[name] != base().train[name]


def test_unkeyed_train_keys_pass_through() -> None:
    cfg = base("train.eval_batch_size=7", "train.num_workers=1", "train.device=cpu", "train.precision=bf16")
    ttcfg = T.teacher_train_cfg(cfg.train, cfg.teacher.finetune)
    for name in (*T.TRAIN_NOT_IN_KEY, *T.TRAIN_KEYED):
        assert ttcfg[name] == cfg.train[name]


def test_defaults_train_the_teacher_as_before() -> None:
    """The default config's teacher sees the train settings it saw before the teacher had its own
    (cache_teacher_logits aside, which the teacher, having no teacher, never read)."""
    cfg = compose([])
    old = OmegaConf.merge(cfg.train, {"stop_after_steps": None, "seed": cfg.teacher.finetune.seed,
                                      # auto (not compiled) pads each batch to its longest row, as 0 does
                                      "pad_to_multiple_of": 0})
    new = T.teacher_train_cfg(cfg.train, cfg.teacher.finetune)
    assert {k: v for k, v in new.items() if k != "cache_teacher_logits"} == \
        {k: v for k, v in old.items() if k != "cache_teacher_logits"}


def test_teacher_accelerator_isolates_accumulation_and_loss_scale() -> None:
    from kdrun.runtime.precision import Precision

    run_precision = Precision("fp16", "cpu")
    run_precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc = SimpleNamespace(gradient_accumulation_steps=4, step=3, precision=run_precision)
    with T.teacher_accelerator(acc, 2):
        assert acc.gradient_accumulation_steps == 2 and acc.step == 0
        assert acc.precision is not run_precision and acc.precision.name == "fp16"  # a scaler of its own
        acc.precision.scale(torch.ones(()))  # the teacher's fp16 steps move its loss scale
        acc.precision.scaler.update(new_scale=8.0)
        assert acc.precision.loss_scale() == 8.0
        acc.step = 5
    assert acc.gradient_accumulation_steps == 4 and acc.step == 0
    assert acc.precision is run_precision and run_precision.loss_scale() == 1024.0


# ----------------------------------------------------------------------- tiny real fine-tunes

# Every train setting but device and precision (kept on the CPU in fp32 so the comparison is bit
# for bit on any machine) changed at once to values that would change the teacher if they reached
# it, with labels and logging that do not. The student (the teacher's first two layers) stops after
# a step or two.
REAL_BASE = ["objective=finetune", "student=truncated", "student.num_layers=2", "train.device=cpu",
             "teacher.finetune.eval_every_steps=2", "train.stop_after_steps=1"]
REAL_TRAIN_CHANGED = [
    "seed=7", "train.epochs=3", "train.lr=0.01", "train.precision=fp32", "train.gradient_accumulation_steps=2",
    "train.max_grad_norm=0.01", "train.optimizer={name: SGD, kwargs: {momentum: 0.9}}", "train.scheduler=constant",
    "train.eval_batch_size=7", "train.checkpoint_every_steps=1", "train.keep_checkpoints=false",
    "train.keep_best=false",
    "train.cache_teacher_logits=false", "train.group_by_length=false", "train.pad_to_max_length=true",
    "train.num_workers=1", "train.stop_after_steps=2", "teacher.name=renamed", "task.name=renamed",
    "logger.log_every_steps=1",
]
# The teacher's own counterparts: these do change it (the comparison is not blind).
REAL_FINETUNE_CHANGED = ["teacher.finetune.max_grad_norm=0.01", "teacher.finetune.gradient_accumulation_steps=2",
                         "teacher.finetune.group_by_length=false", "teacher.finetune.keep_best=false",
                         "teacher.finetune.scheduler=constant"]


def _fine_tune(cache: Path, run_dir: Path, *overrides: str) -> tuple[str, dict, dict]:
    """Run kdrun until the student's first steps; returns the teacher's (key, weights, teacher.json)."""
    import json

    from safetensors.torch import load_file

    from kdrun.app.run import run
    from kdrun.engine.trainer import SimulatedInterrupt

    with pytest.raises(SimulatedInterrupt):
        run(compose([*TINY, *TOY, f"cache_dir={cache}", *REAL_BASE, *overrides]), run_dir)
    (entry,) = [p for p in (cache / "teachers").iterdir() if p.is_dir()]
    meta = json.loads((entry / "teacher.json").read_text())
    return entry.name, load_file(str(entry / "model" / "model.safetensors")), meta


def test_run_train_settings_leave_the_teachers_weights_unchanged(tmp_path: Path) -> None:
    key_a, wa, meta_a = _fine_tune(tmp_path / "ca", tmp_path / "a")
    key_b, wb, meta_b = _fine_tune(tmp_path / "cb", tmp_path / "b", *REAL_TRAIN_CHANGED)
    assert key_a == key_b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for split, metrics in meta_a["metrics"].items():
        assert meta_b["metrics"][split] == pytest.approx(metrics)

    key_c, wc, _ = _fine_tune(tmp_path / "cc", tmp_path / "c", *REAL_FINETUNE_CHANGED)
    assert key_c != key_a
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_a_cached_teacher_file_says_it_holds_pytorch_weights(tmp_path) -> None:
    """The teacher's model.safetensors carries ``format: pt``, as save_pretrained's does (transformers
    4.x refuses a file without it when it loads the cached teacher), and loads back unchanged."""
    from safetensors import safe_open
    from transformers import BertConfig, BertForSequenceClassification

    from kdrun.app.teacher import save_model_files

    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    save_model_files(model, tmp_path / "model")
    with safe_open(str(tmp_path / "model" / "model.safetensors"), framework="pt") as f:
        assert (f.metadata() or {}).get("format") == "pt"
    again = BertForSequenceClassification.from_pretrained(tmp_path / "model")
    assert again.classifier.weight.equal(model.classifier.weight)
