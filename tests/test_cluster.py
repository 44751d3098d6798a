"""Cluster-grade runs: a signal during teacher fine-tuning resumes it exactly (locally and under a
real SLURM), and, on a real one-node SLURM started by scripts/slurm_localhost.sh, job arrays,
preemption with requeue and two-task data-parallel jobs (tests marked ``slurm``)."""

from __future__ import annotations

import json
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
