"""Hydra's composition errors reach the user as one line with the closest valid choices (each case
in a fresh ``kdrun`` process, its whole output asserted short)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from test_sweeps import env_for

from kdrun.app import composition_errors as ce
from tests.conftest import TINY, TOY

CASES = [
    (["objective=logits"], "objective=logits: no such option of objective; did you mean objective=logit? "
                           "(kdrun --help lists the groups and their options)"),
    (["task=sst3"], "task=sst3: no such option of task; did you mean task=sst2?"),
    (["task.max_train_sample=64"], "task.max_train_sample: no such key in task; did you mean "
                                   "task.max_train_samples or "),
    (["objectiv=logit"], "objectiv: no such key in the config; did you mean objective=logit?"),
    (["teacher.finetun.epochs=1"], "teacher.finetun.epochs: no such key in teacher; did you mean "
                                   "teacher.finetune.epochs? (kdrun --cfg job shows every key)"),
    (["objective=ckd", "objective.params.windw_pair=3"], "objective.params.windw_pair: no such key in "
                                                         "objective.params; did you mean objective.params.window_pair"),
    (["model=bert_base"], "model= is not chosen on its own: its options are chosen through teacher= and student="),
    (["train.lr=abc"], "train.lr='abc': expected float"),
    (["train.precision=bf17"], "train.precision='bf17': not one of auto, no, fp32, bf16, fp16; did you mean "
                               "train.precision=bf16"),
    (["train.optimizer.kwargs.betas=[0.9,0.99]"], "train.optimizer.kwargs.betas: not set in train.optimizer.kwargs; "
                                                  "add it with +train.optimizer.kwargs.betas=<value>"),
    (["task=nosuch"], "task=nosuch: no such option of task; its options are cola, mnli, mrpc, qnli, qqp, rte, squad, "
                      "sst2, stsb, text_corpus, toy, wikipedia, wnli (kdrun --help lists"),
    (["train.compile=maybe"], "train.compile='maybe': expected a boolean: true or false\n"),
    (["optimizer=adam"], "optimizer: no such key in the config; did you mean train.optimizer.name=adam or "
                         "teacher.finetune.optimizer.name=adam?"),
    (["logger=wandb_offline"], "logger=wandb_offline: no such option of logger; did you mean logger=wandb "
                               "logger.mode=offline?"),
]
FREE_FORM = "+ adds keys only under free-form dictionaries such as train.optimizer.kwargs"
PLUS_CASES = [
    (["+train.epoch=5", "experiment=quickstart"], f"+train.epoch=5: no such key in train, and {FREE_FORM}; did you "
                                                  "mean train.epochs=5? (kdrun --cfg job shows every key)\n"),
    (["+train.epochs=5"], "+train.epochs=5: train.epochs is a key of the config already; set it without the +: "
                          "train.epochs=5\n"),
    (["+task.max_train_sample=32"], f"+task.max_train_sample=32: no such key in task, and {FREE_FORM}; did you "
                                    "mean task.max_train_samples=32 or "),
    (["+foo=1"], f"+foo=1: no such key in the config, and {FREE_FORM} (kdrun --cfg job shows every key)\n"),
    (["-m", "+train.epoch=1,2", "seed=1,2"], "+train.epoch=1,2: no such key in train, and + adds keys only under"),
    (["+task.toy.num_trai=5", "task=sst2"], "+task.toy.num_trai=5: no such key in task.toy, and + adds keys only "),
]
FREE_FORM_PLUS = ["+train.optimizer.kwargs.betas=[0.9,0.99]", "+launcher.x=1", "+objective.params.foo=1",
                  "+hydra.job.env_set.A=1", "++train.epochs=5"]


@pytest.mark.parametrize("args,expected", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_cli_errors_one_line_with_a_suggestion(tmp_path, args: list[str], expected: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", *args], cwd=tmp_path, env=env_for(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"kdrun: error: {expected}"), r.stderr
    assert "+" not in r.stderr or "kwargs" in expected  # '+key' only where the schema takes a new key
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("args,expected", PLUS_CASES, ids=[" ".join(a) for a, _ in PLUS_CASES])
def test_cli_errors_plus_on_a_schema_key_is_refused(tmp_path, args: list[str], expected: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", *args], cwd=tmp_path, env=env_for(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr.count("\n")) == (2, "", 1), r.stderr
    assert r.stderr.startswith(f"kdrun: error: {expected}"), r.stderr
    assert not list(tmp_path.iterdir())


def test_cli_errors_plus_under_free_form_dictionaries_adds_the_key(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", *FREE_FORM_PLUS, "--cfg", "job"], cwd=tmp_path,
                       env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["train"]["optimizer"]["kwargs"]["betas"] == [0.9, 0.99] and cfg["train"]["epochs"] == 5
    assert cfg["launcher"]["x"] == 1 and cfg["objective"]["params"]["foo"] == 1


PREFLIGHT_CASES = [
    (["train.pad_to_multiple_of=1000", "task.max_seq_length=48"],
     "train.pad_to_multiple_of=1000 is above task.max_seq_length=48, the widest a batch can be; choose a multiple "
     "of at most 48, or 0 (each batch padded to its longest row)"),
    (["objective=mgskd", "objective.params.span=false", "objective.params.heads=7"],  # the tiny teacher: 32 wide
     "objective.stages[0].losses[0] (mgskd_token): the teacher's width 32 is not divisible by heads=7; set "
     "objective.params.heads to a divisor of it (e.g. [8, 16, 32])"),
]


@pytest.mark.parametrize("args,expected", PREFLIGHT_CASES, ids=[" ".join(a) for a, _ in PREFLIGHT_CASES])
def test_cli_errors_preflight_one_line_before_any_model_loads(tmp_path, args: list[str], expected: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", *TINY, *TOY, *args, "hydra.run.dir=D"], cwd=tmp_path,
                       env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, f"kdrun: error: {expected}\n")
    assert not (tmp_path / "cache").exists()  # no teacher fine-tuned


def test_cli_errors_closest_choices_are_by_the_leaf_name() -> None:
    keys = {"teacher": ["name", "kind", "finetune", "store"], "": ["task", "teacher", "objective"]}
    message = ("Could not override 'teacher.finetun.epochs'.\nTo append to your config use "
               "+teacher.finetun.epochs=1\nKey 'finetun' not in 'TeacherConfig'\n    full_key: teacher.finetun\n")
    line = ce.unknown_key(message, keys.get)
    assert line == ("teacher.finetun.epochs: no such key in teacher; did you mean teacher.finetune.epochs? "
                    "(kdrun --cfg job shows every key)")
    nothing_close = message.replace("finetun", "zzzzzz")
    assert ce.unknown_key(nothing_close, keys.get).startswith("teacher.zzzzzz.epochs: no such key in teacher (")


def test_cli_errors_an_unrecognised_error_is_left_to_hydra() -> None:
    assert ce.one_line(RuntimeError("something else entirely")) is None


def test_cli_errors_groups_listed_by_help_are_known() -> None:
    groups = ce.config_groups()
    assert {"objective", "task", "teacher", "student", "model", "experiment/base"} <= set(groups)
