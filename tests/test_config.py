"""Every config group option composes; the schema rejects bad keys and types, naming them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kdrun.losses import LOSSES, get_loss
from tests.conftest import REPO, TINY, TOY, compose

CONF = REPO / "conf"
GROUPS = ["task", "teacher", "student", "objective", "mapping", "augmentation", "logger", "sweep",
          "experiment", "launcher"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group: str, option: str) -> None:
    cfg = compose([f"{group}={option}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group in ("task", "teacher", "student", "objective"):
        assert getattr(cfg, group).name == option


def test_all_groups_have_options() -> None:
    for g in GROUPS:
        assert options(g), f"conf/{g} is empty"


@pytest.mark.parametrize(
    "override,key",
    [
        ("task.nosuch=1", "nosuch"),
        ("train.seed=abc", "train.seed"),
        ("objective.stages.0.lr=fast", "objective.stages[0].lr"),
        ("task.num_labels=two", "task.num_labels"),
    ],
)
def test_schema_rejects_bad_values(override: str, key: str) -> None:
    with pytest.raises(Exception) as e:
        cfg = compose([override])
        OmegaConf.to_container(cfg, resolve=True)
    assert key.split(".")[-1].split("[")[0] in str(e.value)


def test_unknown_key_in_yaml_is_named(tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "typo.yaml").write_text("name: typo\nmax_seq_lenght: 64\n")
    with pytest.raises(Exception) as e:
        compose([f"hydra.searchpath=[file://{tmp_path}]", "task=typo"])
    assert "max_seq_lenght" in str(e.value)


def test_logit_weights_follow_alpha() -> None:
    cfg = compose(["objective=logit", "objective.alpha=0.7", "objective.temperature=3"])
    losses = OmegaConf.to_container(cfg.objective.stages[0].losses, resolve=True)
    assert losses[0]["name"] == "ce" and losses[0]["weight"] == pytest.approx(0.3)
    assert losses[1]["weight"] == pytest.approx(0.7)
    assert losses[1]["params"]["temperature"] == 3


def test_mnli_evaluates_both_dev_sets() -> None:
    cfg = compose(["task=mnli"])
    assert list(cfg.task.eval_splits) == ["validation_matched", "validation_mismatched"]


def _kdrun(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdrun", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_help_lists_groups() -> None:
    out = _kdrun("--help").stdout
    for g in GROUPS:
        assert f"{g}:" in out
    assert "cola, mnli, mrpc, qnli, qqp, rte, squad, sst2, stsb, text_corpus, toy, wikipedia, wnli" in out


def test_unknown_task_lists_choices() -> None:
    t = time.perf_counter()
    r = _kdrun("task=nosuch")
    assert r.returncode != 0
    assert time.perf_counter() - t < 30
    assert r.stderr.startswith("kdrun: error: task=nosuch: no such option of task") and "kdrun --help" in r.stderr


def test_missing_data_dir_names_paths(tmp_path: Path) -> None:
    r = _kdrun("task=sst2", f"task.data_dir={tmp_path}/nonexistent", f"cache_dir={tmp_path}/c",
               f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 2, r.stderr
    assert f"{tmp_path}/nonexistent/train.tsv" in r.stderr and "dev.tsv" in r.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_hub_only_model_offline_fails_fast(tmp_path: Path) -> None:
    t = time.perf_counter()
    r = _kdrun("teacher=bert_base", "logger=none", f"cache_dir={tmp_path}/c", f"hydra.run.dir={tmp_path}/run")
    elapsed = time.perf_counter() - t
    assert r.returncode == 2, r.stderr
    assert "bert-base-uncased" in r.stderr and "teacher=minilm_l6" in r.stderr
    assert elapsed < 30  # process start-up included; the hub is never contacted


# Runs kdrun with data_fingerprint (called once the data are loaded) replaced by a bug.
_BROKEN_RUN = """
import sys
import kdrun.tasks.data.common

def data_fingerprint(dsd):
    raise {exc}("an internal bug")

kdrun.tasks.data.common.data_fingerprint = data_fingerprint
from kdrun.cli import main

sys.argv = ["kdrun", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("exc", ["ZeroDivisionError", "ValueError"])
def test_internal_error_keeps_its_traceback(tmp_path: Path, exc: str) -> None:
    # A ValueError from kdrun's own code is a bug too: only kdrun.errors.UserError is a user's mistake.
    r = subprocess.run([sys.executable, "-c", _BROKEN_RUN.format(exc=exc), *TINY, *TOY, f"cache_dir={tmp_path}/c",
                        f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1, r.stderr
    assert "Traceback (most recent call last)" in r.stderr and f"{exc}: an internal bug" in r.stderr
    assert "in data_fingerprint" in r.stderr and "kdrun: error:" not in r.stderr


def test_config_error_is_one_line(tmp_path: Path) -> None:
    r = _kdrun(*TINY, *TOY, "objective.stages.0.losses.0.name=nosuch", f"cache_dir={tmp_path}/c",
               f"hydra.run.dir={tmp_path}/run", timeout=120)
    assert r.returncode == 2, r.stderr
    get_loss("ce")  # imports the built-in terms into LOSSES
    (line,) = r.stderr.strip().splitlines()
    head = "kdrun: error: objective.stages[0].losses[0]: unknown loss term 'nosuch'. Valid loss terms: "
    assert line.startswith(head)
    listed = line[len(head):].split(", ")
    # the built-in terms, sorted (other tests may have registered test-only terms in this process)
    assert listed == sorted(listed) and {"ce", "logit_kd", "ckd_wr_pair", "tinybert_attention"} <= set(listed)
    from kdrun.losses.registry import TERM_GROUPS

    assert set(listed) <= set(LOSSES) | {f"{g} (group)" for g in TERM_GROUPS} and "ckd_relations (group)" in listed
