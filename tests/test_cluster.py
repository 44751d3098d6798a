"""Cluster-grade runs: a signal during teacher fine-tuning resumes it exactly (locally and under a
real SLURM), and, on a real one-node SLURM started by scripts/slurm_localhost.sh, job arrays,
preemption with requeue and two-task data-parallel jobs (tests marked ``slurm``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY, TOY
from tests.test_sweeps import assert_same_weights, env_for, kdrun, weights

# A teacher fine-tuning long enough (800 tiny steps) to be interrupted in the middle.
SLOW_TEACHER = [*TINY, *TOY, "task.toy.num_train=320", "teacher.finetune.epochs=10", "teacher.finetune.batch_size=4",
                "objective=logit", "student.dropout=0.0", "train.checkpoint_every_steps=1000000"]


def teacher_entries(cache: Path) -> tuple[list[Path], list[Path]]:
    """(complete teacher entries, resumable staging directories) in a cache."""
    root = cache / "teachers"
    if not root.is_dir():
        return [], []
    return ([p for p in root.iterdir() if (p / ".complete").exists()], list(root.glob(".*.partial")))


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 300) -> list[str]:
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    pytest.fail(f"never printed {text!r}:\n" + "".join(lines[-30:]))


def test_signal_during_teacher_fine_tuning_resumes_it_exactly(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    kdrun(ref, *SLOW_TEACHER, "hydra.run.dir=run")
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kdrun", *SLOW_TEACHER, "hydra.run.dir=run"], cwd=work,
                            env=env_for(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_line(proc, "fine-tuning the teacher")
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "stopped by SIGTERM after writing a checkpoint" in out
    complete, partial = teacher_entries(work / "cache")
    assert complete == [] and len(partial) == 1  # a half-trained teacher is never published
    step = json.loads((partial[0] / "checkpoints" / "last" / "state.json").read_text())["global_step"]
    assert 0 < step < 800

    again = kdrun(work, *SLOW_TEACHER, "hydra.run.dir=run")
    assert f"resuming the teacher's fine-tuning at step {step}" in again.stdout
    complete, partial = teacher_entries(work / "cache")
    assert len(complete) == 1 and partial == []
    mine = json.loads((work / "run" / "results.json").read_text())
    theirs = json.loads((ref / "run" / "results.json").read_text())
    assert mine["teacher"]["metrics"] == theirs["teacher"]["metrics"]
    assert mine["student"]["metrics"] == theirs["student"]["metrics"]
    assert_same_weights(weights(work / "run"), weights(ref / "run"), atol=1e-6)
    from safetensors.torch import load_file

    ref_teacher = teacher_entries(ref / "cache")[0][0] / "model" / "model.safetensors"
    assert_same_weights(load_file(str(complete[0] / "model" / "model.safetensors")), load_file(str(ref_teacher)),
                        atol=1e-6)


# --------------------------------------------------------------------------- compute threads

_REGISTERED = """
import sys, time
from kdrun.threads import register_run
register_run()
print("registered", flush=True)
time.sleep(60)
"""


def test_live_runs_are_counted_and_threads_chosen(tmp_path: Path, monkeypatch) -> None:
    from kdrun import threads as TH

    monkeypatch.setattr(TH.tempfile, "gettempdir", lambda: str(tmp_path))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    TH._REGISTRATION.clear()
    TH.register_run()
    assert TH.live_runs() == 1
    others = [subprocess.Popen([sys.executable, "-c", _REGISTERED], stdout=subprocess.PIPE, text=True, env=env)
              for _ in range(2)]
    try:
        for p in others:
            assert p.stdout.readline().strip() == "registered"
        assert TH.live_runs() == 3
        cores = TH.usable_cores()
        assert TH.choose_threads(None, {}) == (max(1, cores // 3), f"{cores} cores / 3 kdrun runs on this machine")
    finally:
        for p in others:
            p.kill()
            p.wait()
    assert TH.live_runs() == 1 and len(list(TH.registry_dir().glob("*.lock"))) == 1  # the dead ones' files go
    assert TH.choose_threads(3, {"OMP_NUM_THREADS": "2"}) == (3, "train.num_threads")
    assert TH.choose_threads(None, {"OMP_NUM_THREADS": "2", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "4"}) == \
        (2, "OMP_NUM_THREADS")
    assert TH.choose_threads(None, {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "4"}) == (4, "SLURM cpus_per_task")
    TH._REGISTRATION.clear()


def test_num_threads_is_no_part_of_a_runs_identity(run_cfg, tmp_path: Path) -> None:
    """A requeued job on a node with other cores resumes its checkpoints and lands in the same directory."""
    from omegaconf import OmegaConf

    from kdrun.config import sweep_name
    from kdrun.run import run_config_hash

    a = OmegaConf.to_container(run_cfg(), resolve=True)
    b = OmegaConf.to_container(run_cfg("train.num_threads=1"), resolve=True)
    assert run_config_hash(a) == run_config_hash(b)
    assert sweep_name(["task=toy", "seed=1,2"]) == sweep_name(["task=toy", "seed=1,2", "train.num_threads=1"])
