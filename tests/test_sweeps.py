"""Sweeps as a user runs them: submitit jobs, idempotent reruns, a killed job resumed, Optuna
studies that continue, and one run over two data-parallel processes (gloo on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdrun.config import sweep_name
from kdrun.runtime import forkrun
from tests.conftest import TINY, TOY, compose


def env_for(tmp: Path) -> dict[str, str]:
    # WANDB_SERVICE: the test process's own wandb service, which a kdrun process must not attach to
    env = {k: v for k, v in os.environ.items() if k not in ("KDRUN_SWEEP_NAME", "RANK", "WORLD_SIZE", "WANDB_SERVICE")}
    env.update(KDRUN_OUTPUT_DIR=str(tmp / "outputs"), KDRUN_CACHE_DIR=str(tmp / "cache"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def kdrun(tmp: Path, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m kdrun ARGS`` in ``tmp``, forked from a process that imported kdrun's libraries once
    (kdrun.runtime.forkrun; the processes a launcher starts for its jobs are new interpreters)."""
    r = forkrun.run(list(args), env_for(tmp), tmp, timeout)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def result_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("results.json") if "checkpoints" not in p.parts)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "student" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"student weights differ by up to {worst}"


def test_sweep_name_is_the_command_not_its_order_or_bookkeeping() -> None:
    a = sweep_name(["experiment=quickstart", "objective=finetune,logit", "seed=1,2"])
    assert a == sweep_name(["seed=1,2", "objective=finetune,logit", "experiment=quickstart", "logger=none",
                            "launcher=submitit_local", "train.device=cpu", "resume=true"])
    assert a.startswith("quickstart-")
    assert a != sweep_name(["experiment=quickstart", "objective=finetune,logit", "seed=1,2,3"])


def test_submitit_grid_report_rerun_and_shared_teacher(tmp_path: Path) -> None:
    """4 jobs as concurrent submitit subprocesses: one teacher fine-tuned for all, kdrun-report
    builds the table, and rerunning the sweep trains nothing."""
    grid = ["-m", *TINY, *TOY, "objective=finetune,logit", "seed=1,2", "launcher=submitit_local"]
    kdrun(tmp_path, *grid)
    sweeps = list((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 1
    files = result_files(sweeps[0])
    assert len(files) == 4
    res = [json.loads(p.read_text()) for p in files]
    assert sorted((r["objective"], r["config"]["seed"]) for r in res) == [
        ("finetune", 1), ("finetune", 2), ("logit", 1), ("logit", 2)]
    # the jobs ran at the same time and shared the teacher through the locked cache
    assert len(list((tmp_path / "cache" / "teachers").glob("*/model"))) == 1
    logs = "".join(p.read_text() for p in (sweeps[0] / ".submitit").rglob("*_log.out"))
    assert logs.count("fine-tuning the teacher") == 1
    assert logs.count("teacher from cache") == 1  # the logit job that did not build it (finetune needs none)
    assert sum(r["teacher"].get("cached", False) for r in res if r["objective"] == "logit") == 1

    from kdrun.report.cli import main as report_main

    out = tmp_path / "report"
    report_main([str(sweeps[0]), "--out", str(out)])
    table = (out / "table.csv").read_text().splitlines()
    assert table[0].startswith("student,objective,task,metric,mean,std,n_seeds")
    by_obj = {line.split(",")[1]: line.split(",") for line in table[1:]}
    assert set(by_obj) == {"finetune", "logit"} and all(row[6] == "2" for row in by_obj.values())
    for obj, row in by_obj.items():
        vals = [r["student"]["metrics"]["validation"]["accuracy"] for r in res if r["objective"] == obj]
        assert float(row[4]) == pytest.approx(sum(vals) / 2, abs=1e-6)
    assert (out / "table.tex").read_text().count("\\\\") >= 3
    assert (out / "seed_spread.png").stat().st_size > 1000 and (out / "curves_toy.png").exists()

    mtimes = [p.stat().st_mtime_ns for p in files]
    t0 = time.perf_counter()
    jobs_before = sorted((sweeps[0] / ".submitit").iterdir())
    again = kdrun(tmp_path, *grid)
    assert [p.stat().st_mtime_ns for p in result_files(sweeps[0])] == mtimes
    assert len(list((tmp_path / "outputs" / "multirun").iterdir())) == 1
    assert time.perf_counter() - t0 < 120
    # finished jobs are answered from their results.json, not submitted again
    assert "4 of 4 jobs already have results (reported, not submitted); submitting 0" in again.stdout
    assert sorted((sweeps[0] / ".submitit").iterdir()) == jobs_before


LONG = [*TINY, "task=toy", "task.toy.num_train=320", "task.toy.num_validation=64", "objective=logit",
        "train.epochs=6", "objective.stages.0.batch_size=4", "train.checkpoint_every_steps=1000000",
        "student.dropout=0.1"]


def test_killed_sweep_job_resumes_to_the_same_result(tmp_path: Path) -> None:
    """SIGTERM in mid-training: the job writes a checkpoint at the next step and exits; rerunning
    the sweep resumes it and ends with the weights of an uninterrupted run."""
    ref = tmp_path / "ref"
    ref.mkdir()
    kdrun(ref, *LONG, "hydra.run.dir=run")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(tmp_path / "ref" / "cache", work / "cache")  # same teacher; only the student is at stake
    proc = subprocess.Popen([sys.executable, "-m", "kdrun", "-m", *LONG], cwd=work, env=env_for(work),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = work / "outputs"
    deadline = time.time() + 300
    while time.time() < deadline:
        jsonl = list(log.rglob("metrics.jsonl"))
        if jsonl and jsonl[0].read_text().count("train/loss") >= 3:  # a few logged steps into training
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the job never started training")
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    assert "stopped by SIGTERM after writing a checkpoint" in out, out[-2000:]
    job = next(p.parent for p in log.rglob("metrics.jsonl"))
    assert not (job / "results.json").exists()
    state = json.loads((job / "checkpoints" / "last" / "state.json").read_text())
    assert 0 < state["global_step"] < 480

    from kdrun.report.cli import collect

    _, problems = collect([log])
    assert [p.status for p in problems] == ["incomplete"] and "checkpoint at stage 0" in problems[0].detail

    r = kdrun(work, "-m", *LONG)
    assert f"resuming at stage 0 step {state['global_step']}" in r.stdout
    mine = json.loads((job / "results.json").read_text())
    theirs = json.loads((ref / "run" / "results.json").read_text())
    assert mine["student"]["metrics"] == theirs["student"]["metrics"]
    assert_same_weights(weights(job), weights(ref / "run"), atol=1e-6)


def test_two_process_gloo_run_equals_one_process(tmp_path: Path) -> None:
    """torchrun with 2 CPU processes (gloo): the same global batch gives the same student."""
    args = [*TINY, *TOY, "objective=logit", "train.epochs=2", "student.dropout=0.0",
            f"cache_dir={tmp_path}/cache"]
    kdrun(tmp_path, *args, f"output_dir={tmp_path}/single")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(29500 + os.getpid() % 1000), "-m", "kdrun", *args, f"output_dir={tmp_path}/ddp"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env_for(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    single = json.loads((tmp_path / "single" / "results.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert [e["step"] for e in ddp["evals"]] == [e["step"] for e in single["evals"]]
    for a, b in zip(ddp["evals"], single["evals"]):
        assert a["metrics"]["validation"]["accuracy"] == pytest.approx(b["metrics"]["validation"]["accuracy"])
    assert_same_weights(weights(tmp_path / "ddp"), weights(tmp_path / "single"), atol=1e-5)
    moved = max(float((weights(tmp_path / "single")[k] - w).abs().max())
                for k, w in load_file(str(next((tmp_path / "cache").rglob("model.safetensors")))).items()
                if k in weights(tmp_path / "single"))
    assert moved > 1e-3  # training changed the student, so equality above means something
    assert not list((tmp_path / "ddp").glob("*.tmp")) and (tmp_path / "ddp" / "metrics.jsonl").exists()


def test_optuna_study_resumes_in_its_sweep_dir(tmp_path: Path) -> None:
    base = ["-m", "sweep=optuna", *TINY, *TOY, "train.epochs=1"]
    kdrun(tmp_path, *base, "hydra.sweeper.n_trials=3")
    sweeps = list((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 1 and (sweeps[0] / "optuna.db").exists()
    kdrun(tmp_path, *base, "hydra.sweeper.n_trials=2")
    assert len(list((tmp_path / "outputs" / "multirun").iterdir())) == 1
    import optuna

    study = optuna.load_study(study_name="kdrun", storage=f"sqlite:///{sweeps[0] / 'optuna.db'}")
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(trials) == 5
    assert {"objective.alpha", "objective.temperature", "train.lr"} <= set(trials[0].params)
    finished = [json.loads(p.read_text()) for p in result_files(sweeps[0])]
    values = sorted(r["student"]["metrics"]["validation"]["accuracy"] for r in finished)
    assert sorted({t.value for t in trials}) == sorted(set(values))
    # the continued study proposed new points (a fixed sampler seed would repeat its first ones)
    assert len(finished) == 5


@pytest.mark.parametrize("preset", ["seeds", "optuna", "ckd_grid", "ckd_grid_emnlp", "alp_grid", "tinybert_grid"])
def test_every_sweep_preset_sweeps_existing_keys(preset: str) -> None:
    """A typo in a preset's key would silently add a key nobody reads (or fail late, per job)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from kdrun.config import register_configs

    register_configs()
    with initialize_config_module(config_module="kdrun.conf", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=[f"sweep={preset}"], return_hydra_config=True)
        if cfg.sweep.get("objective"):  # an objective's grid: composed with that objective, as its users run it
            cfg = hydra_compose(config_name="config", overrides=[f"sweep={preset}", f"objective={cfg.sweep.objective}"],
                                return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params, f"sweep={preset} sweeps nothing"
    absent = object()
    for key in params:
        assert OmegaConf.select(cfg, key, default=absent) is not absent, f"sweep={preset}: no key {key}"
    if preset == "optuna":
        assert cfg.hydra.sweeper.direction == "maximize" and "optuna.db" in cfg.hydra.sweeper.storage



@pytest.mark.parametrize("preset,objective", [("ckd_grid", "ckd"), ("ckd_grid_emnlp", "ckd"), ("alp_grid", "alp"),
                                              ("tinybert_grid", "tinybert")])
def test_an_objectives_grid_does_not_choose_the_objective(preset: str, objective: str) -> None:
    """sweep=<grid> changes only the keys it sweeps: the composed objective is the command's, and
    a command with another objective stops with one line naming the one the grid is for."""
    from kdrun.cli import sweep_preset_error

    assert compose([f"sweep={preset}"]).objective.name == "logit"  # the default, not switched
    assert sweep_preset_error([f"sweep={preset}", f"objective={objective}", "task=cola", "seed=1,2"]) is None
    error = sweep_preset_error([f"sweep={preset}", "task=cola"])
    assert error == (f"kdrun: error: sweep={preset} is the grid of objective={objective} and does not choose it; "
                     f"this command's objective is logit: add objective={objective}")
    both = sweep_preset_error([f"sweep={preset}", f"objective={objective},logit"])
    assert both.endswith(f"add objective={objective}")
    assert sweep_preset_error(["sweep=seeds", "objective=logit"]) is None
