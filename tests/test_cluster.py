"""Cluster-grade runs: a signal during teacher fine-tuning resumes it exactly (locally and under a
real SLURM), and, on a real one-node SLURM started by scripts/setup/slurm_localhost.sh, job arrays,
preemption with requeue and two-task data-parallel jobs (tests marked ``slurm``). Each SLURM test
ends with its jobs cancelled and gone from squeue and none of its processes left (job steps,
batch scripts, srun, tasks); the module ends with the daemons it started stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs
from tests.conftest import REPO, TINY, TOY
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
from kdrun.runtime.threads import register_run
register_run()
print("registered", flush=True)
time.sleep(60)
"""


def test_live_runs_are_counted_and_threads_chosen(tmp_path: Path, monkeypatch) -> None:
    from kdrun.runtime import threads as TH

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
        assert TH.choose_threads(None, {}) == (max(1, cores // 3), f"{cores} cores / 3 kdrun runs on the host")
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


def test_a_run_in_a_longer_process_counts_only_while_it_runs(run_cfg, tmp_path: Path, monkeypatch) -> None:
    """run() called from a notebook or pytest counts as a live run while it runs, not for the rest of the
    process: it used to stay registered, so every later kdrun command on the machine took half the cores."""
    from kdrun.app.run import run
    from kdrun.runtime import threads as TH

    monkeypatch.setattr(TH.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(TH, "_REGISTRATION", {})
    seen = []
    monkeypatch.setattr("kdrun.app.run.preflight", lambda cfg: seen.append(TH.live_runs()) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run(run_cfg(), tmp_path / "r")
    assert seen == [1] and TH.live_runs() == 1 and not list(TH.registry_dir().glob("*.lock"))
    with TH.registered_run():  # the kdrun command: registered for the whole process, before its jobs
        with pytest.raises(ZeroDivisionError):
            run(run_cfg(), tmp_path / "r")
        assert len(list(TH.registry_dir().glob("*.lock"))) == 1  # the inner run leaves the outer's registration
    assert not list(TH.registry_dir().glob("*.lock"))


def test_num_threads_is_no_part_of_a_runs_identity(run_cfg, tmp_path: Path) -> None:
    """A requeued job on a node with other cores resumes its checkpoints and lands in the same directory."""
    from omegaconf import OmegaConf

    from kdrun.app.run import run_config_hash
    from kdrun.config import sweep_name

    a = OmegaConf.to_container(run_cfg(), resolve=True)
    b = OmegaConf.to_container(run_cfg("train.num_threads=1"), resolve=True)
    assert run_config_hash(a) == run_config_hash(b)
    assert sweep_name(["task=toy", "seed=1,2"]) == sweep_name(["task=toy", "seed=1,2", "train.num_threads=1"])


# ------------------------------------------------------------------------- a real one-node SLURM

SLURM_SCRIPT = REPO / "scripts" / "setup" / "slurm_localhost.sh"
SLURM_JOB = ["launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.mem_gb=1",
             "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=20", "hydra.launcher.signal_delay_s=10"]


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """A running one-node SLURM (started here unless one already runs); its environment. When it was
    started here, it is stopped at the end (``slurm_localhost.sh stop``: its jobs cancelled, their
    steps ended, then the daemons), and no daemon or job step of it may be left."""
    if sys.platform != "linux":
        pytest.skip("the local SLURM needs Linux")
    conf_dir = os.environ.get("KDRUN_SLURM_DIR", "/tmp/kdrun-slurm")
    was_running = subprocess.run([str(SLURM_SCRIPT), "status", conf_dir], capture_output=True).returncode == 0
    r = subprocess.run([str(SLURM_SCRIPT), "start", conf_dir], capture_output=True, text=True, timeout=900)
    if r.returncode == 3:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    env = {"SLURM_CONF": f"{conf_dir}/slurm.conf"}
    yield env
    if not was_running:
        subprocess.run([str(SLURM_SCRIPT), "stop", conf_dir], timeout=300)
        conf = env["SLURM_CONF"]
        left = procs.wait_gone(lambda: {**procs.slurm_steps(conf), **procs.slurm_daemons(conf)}, timeout=10)
        procs.kill_all(left)
        assert not left, f"SLURM processes still running after the cluster was stopped: {left}"


def end_slurm_jobs(tmp: Path, env: dict[str, str], timeout: float = 90) -> list[str]:
    """Cancel every job submitted from under ``tmp`` (its working directory), then wait until squeue
    lists none of them and none of their steps nor any other process of the test is left (scancel
    sends SIGTERM, then SIGKILL after the cluster's KillWait of 30 s); what is still there after
    ``timeout`` seconds is killed. Returns what was left, as lines (empty: everything ended)."""
    full = {**os.environ, **env}

    def ours() -> set[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%A %Z"], env=full, capture_output=True, text=True).stdout
        return {j for j, _, d in (line.partition(" ") for line in out.splitlines()) if tmp in Path(d).parents
                or Path(d) == tmp}

    jobs, deadline = ours(), time.monotonic() + timeout
    if jobs:
        subprocess.run(["scancel", *sorted(jobs)], env=full, capture_output=True)
    while (queued := ours()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = procs.wait_gone(lambda: {**procs.processes_of(tmp), **procs.slurm_steps(env["SLURM_CONF"], jobs)},
                           timeout=max(1.0, deadline - time.monotonic()))
    procs.kill_all(left)
    return [f"job {j} still in squeue" for j in sorted(queued)] + [f"{p}: {c}" for p, c in sorted(left.items())]


@pytest.fixture
def slurm(slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The cluster's environment for one test, whose processes carry ``KDRUN_TEST_TMP`` (tests/procs.py);
    after the test its jobs are cancelled and waited for, and nothing of it may be left."""
    monkeypatch.setenv(procs.TAG, str(tmp_path))
    yield slurm_cluster
    left = end_slurm_jobs(tmp_path, slurm_cluster)
    assert not left, "left running after the test:\n" + "\n".join(left)


def slurm_env(tmp: Path, slurm: dict[str, str]) -> dict[str, str]:
    return {**env_for(tmp), **slurm}


def sbatch_jobs(tmp: Path) -> set[str]:
    """SLURM jobs and array tasks (``<job>_<task>``) submitit submitted under ``tmp`` (a folder each)."""
    return {p.name for p in tmp.rglob(".submitit/*") if p.is_dir() and p.name[0].isdigit()}


def job_log(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(tmp.rglob(".submitit/*/*_log.out")))


def start_sweep(tmp: Path, slurm: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kdrun", "-m", *args, *SLURM_JOB], cwd=tmp,
                            env=slurm_env(tmp, slurm), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slurm
def test_slurm_array_completes_reports_and_a_rerun_submits_nothing(tmp_path: Path, slurm) -> None:
    args = [*TINY, *TOY, "objective=finetune,logit"]
    p = start_sweep(tmp_path, slurm, *args)
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    assert "Bypassing sacct error" not in out  # accounting is disabled on this cluster: one line, then squeue
    assert out.count("SLURM accounting (sacct) is disabled") == 1
    results = sorted(p for p in (tmp_path / "outputs").rglob("results.json") if "checkpoints" not in p.parts)
    assert len(results) == 2
    jobs = sbatch_jobs(tmp_path)
    assert len({j for j in jobs if "_" in j}) == 2 and len({j.split("_")[0] for j in jobs}) == 1  # one array
    from kdrun.report.cli import collect

    runs, problems = collect([tmp_path / "outputs" / "multirun"])
    assert sorted(r.objective for r in runs) == ["finetune", "logit"] and problems == []

    again = start_sweep(tmp_path, slurm, *args)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out[-3000:]
    assert "2 of 2 jobs already have results (reported, not submitted); submitting 0" in out
    assert sbatch_jobs(tmp_path) == jobs


def _preempted_sweep_equals_reference(tmp_path: Path, slurm, args: list[str], ready) -> str:
    """Run ``args`` as a one-job SLURM sweep, send USR2 once ``ready(work)`` holds, and check the
    requeued job ends with the metrics and weights of an uninterrupted local run. Returns the job log."""
    ref = tmp_path / "ref"
    ref.mkdir()
    kdrun(ref, *args, "hydra.run.dir=run")
    work = tmp_path / "work"
    work.mkdir()
    p = start_sweep(work, slurm, *args)
    deadline = time.time() + 300
    while not ready(work):
        assert time.time() < deadline and p.poll() is None, "the job never reached the point to signal"
        time.sleep(0.2)
    (job,) = {j.split("_")[0] for j in sbatch_jobs(work)}
    subprocess.run(["scancel", "--signal=USR2", job], check=True, env={**os.environ, **slurm})
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    log = job_log(work)
    assert "stopped by SIGUSR2 after writing a checkpoint" in log, log[-3000:]
    (res,) = [q for q in (work / "outputs").rglob("results.json") if "checkpoints" not in q.parts]
    mine, theirs = json.loads(res.read_text()), json.loads((ref / "run" / "results.json").read_text())
    assert mine["teacher"]["metrics"] == theirs["teacher"]["metrics"]
    assert mine["student"]["metrics"] == theirs["student"]["metrics"]
    assert_same_weights(weights(res.parent), weights(ref / "run"), atol=1e-6)
    return log


@pytest.mark.slurm
def test_slurm_preemption_in_the_student_stage_requeues_and_resumes_exactly(tmp_path: Path, slurm) -> None:
    args = [*TINY, *TOY, "task.toy.num_train=320", "objective=logit", "train.epochs=6",
            "objective.stages.0.batch_size=4", "train.checkpoint_every_steps=1000000", "student.dropout=0.1"]

    def training(work: Path) -> bool:
        logs = list((work / "outputs").rglob("metrics.jsonl"))
        return bool(logs) and logs[0].read_text().count("train/loss") >= 3

    log = _preempted_sweep_equals_reference(tmp_path, slurm, args, training)
    assert "resuming at stage 0 step" in log


@pytest.mark.slurm
def test_slurm_preemption_during_teacher_fine_tuning_requeues_and_resumes_exactly(tmp_path: Path, slurm) -> None:
    def teacher_training(work: Path) -> bool:
        return "fine-tuning the teacher" in job_log(work) and bool(teacher_entries(work / "cache")[1])

    log = _preempted_sweep_equals_reference(tmp_path, slurm, SLOW_TEACHER, teacher_training)
    assert "resuming the teacher's fine-tuning at step" in log


@pytest.mark.slurm
def test_slurm_two_tasks_per_node_is_one_data_parallel_job(tmp_path: Path, slurm) -> None:
    args = [*TINY, *TOY, "objective=logit", "train.epochs=2", "student.dropout=0.0"]
    kdrun(tmp_path, *args, f"output_dir={tmp_path}/single")
    p = start_sweep(tmp_path, slurm, *args, "hydra.launcher.tasks_per_node=2")
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    (res,) = [q for q in (tmp_path / "outputs").rglob("results.json") if "checkpoints" not in q.parts]
    ddp, single = json.loads(res.read_text()), json.loads((tmp_path / "single" / "results.json").read_text())
    assert [e["step"] for e in ddp["evals"]] == [e["step"] for e in single["evals"]]
    assert ddp["processes"] == 2 and single["processes"] == 1
    assert_same_weights(weights(res.parent), weights(tmp_path / "single"), atol=1e-5)


@pytest.mark.slurm
def test_slurm_teardown_ends_a_running_job_its_steps_and_tasks(tmp_path: Path, slurm_cluster) -> None:
    """What each SLURM test's teardown does, on a two-task job still running (a batch script, srun,
    two tasks): afterwards squeue lists no job of the test and no process of it is left."""
    conf, env = slurm_cluster["SLURM_CONF"], {**os.environ, **slurm_cluster, procs.TAG: str(tmp_path)}
    r = subprocess.run(["sbatch", "--ntasks=2", "--mem=100M", "--wrap", "srun sleep 600"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, check=True)
    job = r.stdout.split()[-1]
    deadline = time.time() + 120
    while sum("sleep 600" in c for c in procs.processes_of(tmp_path).values()) < 3:  # srun's and both tasks'
        assert time.time() < deadline, f"job {job} never started its tasks: {procs.processes_of(tmp_path)}"
        time.sleep(0.2)
    steps = procs.slurm_steps(conf, {job})
    assert any(f"[{job}.batch]" in c for c in steps.values()) and any(f"[{job}.0]" in c for c in steps.values())
    assert any(c.startswith("srun") for c in steps.values()), steps
    assert end_slurm_jobs(tmp_path, slurm_cluster) == []
    assert procs.processes_of(tmp_path) == {} and procs.slurm_steps(conf, {job}) == {}
    queue = subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True).stdout.split()
    assert job not in queue
