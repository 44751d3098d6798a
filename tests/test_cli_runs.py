"""The kdrun command as a user runs it: multirun with a shared teacher, the real-model quickstart,
and the real GLUE files when ../shared is present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import GLUE, REPO, TINY, TOY


def kdrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "kdrun", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def results(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("results.json"))]


def test_multirun_trains_the_teacher_once(tmp_path: Path) -> None:
    kdrun("-m", *TINY, *TOY, "objective=finetune,logit", "student=truncated", f"cache_dir={tmp_path}/cache",
          f"hydra.sweep.dir={tmp_path}/sweep")
    res = results(tmp_path / "sweep")
    assert [r["objective"] for r in res] == ["finetune", "logit"]
    assert [r["teacher"]["cached"] for r in res] == [False, True]
    assert len(list((tmp_path / "cache" / "teachers").glob("*/model"))) == 1


def test_quickstart_with_the_real_pretrained_teacher(tmp_path: Path) -> None:
    """The quickstart preset: all-MiniLM-L6-v2 learns the toy task; the 2-layer student is well above chance."""
    r = kdrun("experiment=quickstart", "logger=none", "task.toy.num_validation=200",
              f"cache_dir={tmp_path}/cache",
              f"hydra.run.dir={tmp_path}/run")
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["teacher"]["metrics"]["validation"]["accuracy"] > 0.8
    assert res["student"]["metrics"]["validation"]["accuracy"] > 0.7
    assert res["student"]["info"]["layers"] == 2 and res["teacher"]["info"]["hidden"] == 384
    assert "teacher  validation  accuracy" in r.stdout


@pytest.mark.skipif(not GLUE.exists(), reason="../shared/data/glue is absent")
@pytest.mark.parametrize("task,metric", [("cola", "matthews_correlation"), ("mrpc", "f1"), ("stsb", "pearson"),
                                         ("sst2", "accuracy")])
def test_real_glue_files(tmp_path: Path, task: str, metric: str) -> None:
    folder = {"cola": "CoLA", "mrpc": "MRPC", "stsb": "STS-B", "sst2": "SST-2"}[task]
    kdrun(*TINY, f"task={task}", f"task.data_dir={GLUE / folder}", "task.max_train_samples=64",
          "task.max_eval_samples=64", "objective=logit", "train.epochs=1", f"cache_dir={tmp_path}/cache",
          f"hydra.run.dir={tmp_path}/run")
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert metric in res["student"]["metrics"]["validation"]
    assert res["config"]["task"]["data_dir"] == str(GLUE / folder)
