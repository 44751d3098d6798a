"""launcher=packed (kdrun/runtime/packing.py): at most ``jobs_at_once`` jobs of a sweep run at a time,
each its own process, with the same results as one at a time; ``auto`` from the GPU's free memory,
one-line errors for bad settings, and scripts/bench/packed.py in its fast mode."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

import pytest

from kdrun.runtime import packing
from tests.conftest import TINY, TOY
from tests.test_scripts_fast import run_script
from tests.test_sweeps import kdrun, result_files

# ------------------------------------------------------------------------------- resolving the number


def resolved(jobs_at_once, free: float | None, cores: int = 16, num_jobs: int = 100, memory=6) -> int:
    return packing.resolve(jobs_at_once, memory, num_jobs, free_gb=lambda: free, cores=lambda: cores).jobs


@pytest.mark.parametrize(("free", "cores", "num_jobs", "memory", "expected"), [
    (80.0, 16, 100, 6, 13),    # 80 GiB free / 6 GiB a job, rounded down
    (80.0, 4, 100, 6, 4),      # capped by the CPU cores
    (80.0, 16, 3, 6, 3),       # never more than the jobs to run
    (5.9, 16, 100, 6, 1),      # less than one job's estimate: still one
    (139.0, 16, 100, 2.5, 16),
    (24.0, 16, 100, 2.5, 9),
])
def test_auto_divides_the_free_memory_and_caps_by_cores_and_jobs(free, cores, num_jobs, memory, expected) -> None:
    assert resolved("auto", free, cores, num_jobs, memory) == expected


def test_auto_without_a_gpu_runs_one_at_a_time_and_a_stated_number_is_kept() -> None:
    found = packing.resolve("auto", 6, 10, free_gb=lambda: None, cores=lambda: 16)
    assert found.jobs == 1 and "without a GPU" in found.reason
    assert resolved(3, None) == 3 and resolved("3", 80.0) == 3 and resolved(3, None, num_jobs=2) == 2
    found = packing.resolve(2, 6, 4, free_gb=lambda: pytest.fail("a stated number asks for no memory"))
    assert found == packing.Packing(2, "hydra.launcher.jobs_at_once=2")
    auto = packing.resolve("AUTO", 6, 100, free_gb=lambda: 40.0, cores=lambda: 8)
    assert auto.jobs == 6 and "40.0 GiB free" in auto.reason and "job_memory_gb=6" in auto.reason


@pytest.mark.parametrize(("key", "value"), [
    ("jobs_at_once", 0), ("jobs_at_once", -2), ("jobs_at_once", "two"), ("jobs_at_once", 1.5),
    ("jobs_at_once", True), ("jobs_at_once", None), ("job_memory_gb", 0), ("job_memory_gb", "lots"),
    ("job_memory_gb", "nan"), ("job_memory_gb", "inf"),
])
def test_a_bad_value_is_one_line_naming_the_key(key: str, value) -> None:
    params = {"jobs_at_once": "auto", "job_memory_gb": 6, key: value}
    with pytest.raises(packing.PackingError) as caught:
        packing.check_settings(params)
    message = str(caught.value)
    assert message.startswith(f"hydra.launcher.{key}={value}: must be ") and "\n" not in message


def test_a_key_that_packed_does_not_have_is_refused() -> None:
    with pytest.raises(packing.PackingError, match=r"^hydra.launcher.array_parallelism: not a setting of "
                                                   r"launcher=packed \(its settings: .*jobs_at_once"):
        packing.check_settings({"jobs_at_once": 2, "array_parallelism": 4})
    packing.check_settings({"jobs_at_once": "auto", "job_memory_gb": 1.5, "timeout_min": 5})


def test_free_memory_comes_from_the_first_visible_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi is asked about the first device of CUDA_VISIBLE_DEVICES (MiB -> GiB); an empty
    CUDA_VISIBLE_DEVICES is no GPU, and a failing nvidia-smi counts as none."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\n[ "$KD_FAIL" = 1 ] && exit 9\necho 40960\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert packing.gpu_free_gb() == 40.0
    assert (tmp_path / "args").read_text().split()[-2:] == ["-i", "3"]
    monkeypatch.setenv("KD_FAIL", "1")
    assert packing.gpu_free_gb() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert packing.gpu_free_gb() is None


def test_jobs_see_the_devices_the_command_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert packing.visible_devices_setup() == ["unset CUDA_VISIBLE_DEVICES"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b, 0")
    assert packing.visible_devices_setup() == ["export CUDA_VISIBLE_DEVICES='GPU-1a2b, 0'"]


def test_the_executor_starts_a_job_only_while_fewer_than_its_slots_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's local executor starts every job at once; the packed one waits (polling) until a
    running job has ended. Fake processes that end after a few polls stand in for the jobs."""
    from submitit.local.local import LocalExecutor

    class Proc:
        def __init__(self) -> None:
            self.polls_left = 3

        def poll(self) -> int | None:
            return None if self.polls_left > 0 else 0

    procs: list[Proc] = []
    running_at_start: list[int] = []

    def start(self, command: str):
        running_at_start.append(sum(p.poll() is None for p in procs))
        procs.append(Proc())
        return type("Job", (), {"_process": procs[-1]})()

    def wait(_seconds: float) -> None:
        for p in procs:
            p.polls_left -= 1

    monkeypatch.setattr(LocalExecutor, "_submit_command", start)
    monkeypatch.setattr(packing.time, "sleep", wait)
    executor = packing._packed_executor_class()(folder=tmp_path)
    executor.slots = 2
    for _ in range(5):
        executor._submit_command("job")
    assert running_at_start == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("visible", [None, "0", ""])
def test_a_job_process_sees_the_devices_of_the_command(visible: str | None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A real submitit job: CUDA_VISIBLE_DEVICES in the job is the submitting command's (unset stays
    unset), where submitit_local would set it from gpus_per_node (empty: no GPU)."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    executor = packing._packed_executor_class()(folder=tmp_path / "jobs")
    executor.update_parameters(timeout_min=2, setup=packing.visible_devices_setup())
    job = executor.submit(lambda: os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    assert job.result() == ("<unset>" if visible is None else visible)


# ------------------------------------------------------------------------------------ a packed sweep

STAMP = re.compile(r"submitit INFO \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\) - "
                   r"(Starting with JobEnvironment|Exiting after successful completion)")


def job_intervals(sweep_dir: Path) -> list[tuple[datetime, datetime]]:
    """(start, end) of every job, from the timestamps of submitit's log in the job's process."""
    spans = []
    for log in sorted((sweep_dir / ".submitit").glob("*/*_0_log.out")):
        found = {kind: datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t, kind in STAMP.findall(log.read_text())}
        spans.append((found["Starting with JobEnvironment"], found["Exiting after successful completion"]))
    return spans


def most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def metrics_by_seed(sweep_dir: Path) -> dict[int, dict]:
    found = {}
    for path in result_files(sweep_dir):
        res = json.loads(path.read_text())
        found[res["config"]["seed"]] = res["student"]["metrics"]
    return found


def test_packed_sweep_runs_two_at_once_with_the_results_of_one_at_a_time(tmp_path: Path) -> None:
    """4 tiny jobs with jobs_at_once=2: never more than 2 run at a time, 2 do overlap, and every
    job's dev metrics equal those of the same jobs run in turn by launcher=local. A rerun submits
    nothing."""
    sweep = ["-m", *TINY, *TOY, "seed=1,2,3,4"]
    packed_dir, local_dir = tmp_path / "packed", tmp_path / "local"
    out = kdrun(tmp_path, *sweep, "launcher=packed", "hydra.launcher.jobs_at_once=2", f"hydra.sweep.dir={packed_dir}")
    assert f"[kdrun] 2 of 4 jobs at once (hydra.launcher.jobs_at_once=2); sweep directory {packed_dir}" in out.stdout
    # each job's start, end and result, a summary, as the other launchers report; no empty .submitit/%j
    for i in range(4):
        assert f"[kdrun] job {i} (seed={i + 1}) started" in out.stdout
        assert re.search(rf"^\[kdrun\] job {i} \(seed={i + 1}\) ended after \d+ s: main metric \d\.\d{{4}}$",
                         out.stdout, re.M), out.stdout
    assert re.search(r"^\[kdrun\] launcher=packed: 4 of 4 jobs done, 0 failed, in \d+ s$", out.stdout, re.M)
    assert not (packed_dir / ".submitit" / "%j").exists()
    spans = job_intervals(packed_dir)
    assert len(spans) == 4
    assert most_at_once(spans) == 2, spans
    kdrun(tmp_path, *sweep, "launcher=local", f"hydra.sweep.dir={local_dir}")
    packed_metrics, local_metrics = metrics_by_seed(packed_dir), metrics_by_seed(local_dir)
    assert sorted(packed_metrics) == [1, 2, 3, 4]
    assert packed_metrics == local_metrics
    again = kdrun(tmp_path, *sweep, "launcher=packed", "hydra.launcher.jobs_at_once=2", f"hydra.sweep.dir={packed_dir}")
    assert "4 of 4 jobs already have results (reported, not submitted); submitting 0" in again.stdout
    assert len(list((packed_dir / ".submitit").glob("*/*_0_log.out"))) == 4


def test_a_bad_setting_stops_the_sweep_before_any_job(tmp_path: Path) -> None:
    r = kdrun(tmp_path, "-m", *TINY, *TOY, "seed=1,2", "launcher=packed", "hydra.launcher.jobs_at_once=0",
              f"hydra.sweep.dir={tmp_path / 'sweep'}", check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == "kdrun: error: hydra.launcher.jobs_at_once=0: must be a whole number above 0 or auto"
    assert not list(tmp_path.rglob("*_submitted.pkl"))


# ---------------------------------------------------------------------------------- bench_packed.py

def test_bench_packed_fast(tmp_path: Path) -> None:
    """The fast mode times 3 tiny jobs one at a time and 2 at once, prints both and their ratio,
    and both sweeps finish every job (one at a time in one, two at a time in the other)."""
    work = tmp_path / "work"
    stdout = run_script("bench/packed", "--fast", "--workdir", str(work), tmp_path=tmp_path, timeout=400,
                        SLURM_JOB_ID="")
    one = re.search(r"^one at a time:\s+(\d+\.\d) s$", stdout, re.M)
    packed = re.search(r"^packed \(2 at once\):\s+(\d+\.\d) s  \(jobs_at_once=2\)$", stdout, re.M)
    ratio = re.search(r"^ratio one-at-a-time / packed: (\d+\.\d\d)x$", stdout, re.M)
    assert one and packed and ratio, stdout
    assert float(ratio.group(1)) == pytest.approx(float(one.group(1)) / float(packed.group(1)), rel=0.05)
    assert "3 jobs of `kdrun -m experiment=quickstart" in stdout and "seed=1,2,3`" in stdout
    for tag in ("one_at_a_time", "packed"):
        assert len(list((work / tag).glob("*/results.json"))) == 3
    spans = job_intervals(work / "packed")
    assert most_at_once(spans) == 2 and most_at_once(job_intervals(work / "one_at_a_time")) == 1
