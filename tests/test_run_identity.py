"""A run directory holds one run: another configuration is refused before anything is written, a
finished run stays finished (no error.json, no traceback on a closed pipe), and its provenance is
kept once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY
from test_sweeps import env_for

from kdrun.app.identity import PREVIOUS, PROVENANCE, RunDirTaken, differing_keys, recorded_run
from kdrun.app.run import run
from kdrun.runtime import forkrun

SMALL = [*TINY, "task=toy", "task.toy.num_train=48", "task.toy.num_validation=24", "train.num_threads=1"]


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def kdrun_cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m kdrun`` on the small run with ``args`` in ``tmp`` (forked: kdrun.runtime.forkrun)."""
    flags = [a for a in args if a.startswith("-")]  # Hydra's flags (-m) before the overrides
    return forkrun.run([*flags, *SMALL, *(a for a in args if a not in flags)], env_for(tmp), tmp, 600)


# ------------------------------------------------------------------------------ the identity itself

def test_identity_differing_keys_name_the_choice_not_its_every_key() -> None:
    old = {"objective": {"name": "ckd", "alpha": 0.5, "params": {"wr": 1}}, "train": {"lr": 1e-4, "seed": 1},
           "logger": {"name": "wandb"}}
    new = {"objective": {"name": "logit", "alpha": 0.9}, "train": {"lr": 2e-4, "seed": 1}, "logger": {"name": "none"}}
    diff = differing_keys(old, new)
    # objective's other keys go with its name; logger is no part of a run's identity
    assert [k for k, _, _ in diff] == ["objective.name", "train.lr"]
    assert diff[1][1:] == (1e-4, 2e-4)


def test_identity_recorded_by_results_checkpoint_or_provenance(tmp_path: Path) -> None:
    assert recorded_run(tmp_path / "none") is None
    (tmp_path / "error.json").write_text("{}")  # a config that never passed its checks records no run
    assert recorded_run(tmp_path) is None
    (tmp_path / PROVENANCE).write_text(json.dumps({"config_hash": "p", "config": {"a": 1}}))
    assert (recorded_run(tmp_path).state, recorded_run(tmp_path).config_hash) == ("failed", "p")
    ckpt = tmp_path / "checkpoints" / "last.old"  # a swap cut short counts too
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"config_hash": "c"}))
    assert (recorded_run(tmp_path).state, recorded_run(tmp_path).config_hash) == ("partial", "c")
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": "r", "config": {"a": 2}}))
    rec = recorded_run(tmp_path)
    assert (rec.state, rec.config_hash, rec.config) == ("complete", "r", {"a": 2})


# ----------------------------------------------------------------------- in-process: partial, failed

def test_identity_partial_run_of_another_config_is_refused_untouched(run_cfg, tmp_path: Path) -> None:
    from kdrun.engine.trainer import SimulatedInterrupt

    rd = tmp_path / "r"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg("objective=logit", "train.checkpoint_every_steps=2", "train.stop_after_steps=3"), rd)
    assert recorded_run(rd).state == "partial"
    before = snapshot(rd)
    with pytest.raises(RunDirTaken, match=r"holds a partial run of another configuration \(objective.name: "
                                          r"'logit' -> 'finetune'\); nothing was changed"):
        run(run_cfg("objective=finetune", "train.checkpoint_every_steps=2"), rd)
    assert snapshot(rd) == before


def test_identity_failed_run_of_another_config_is_refused_and_the_same_config_retries(run_cfg, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    import kdrun.app.run as app_run

    def broken(*_a, **_k):
        raise RuntimeError("data source went away")

    rd = tmp_path / "r"
    with monkeypatch.context() as m:
        m.setattr(app_run, "build_parts", broken)
        with pytest.raises(RuntimeError):
            run(run_cfg("objective=finetune"), rd)
    assert recorded_run(rd).state == "failed" and json.loads((rd / "error.json").read_text())["phase"] == "setup"
    before = snapshot(rd)
    with pytest.raises(RunDirTaken, match=r"holds a failed run of another configuration \(train.lr: "):
        run(run_cfg("objective=finetune", "train.lr=3e-4"), rd)
    assert snapshot(rd) == before
    out = run(run_cfg("objective=finetune"), rd)  # the same configuration: retried, error.json removed
    assert out["objective"] == "finetune" and not (rd / "error.json").exists()


def test_identity_resume_false_moves_the_old_run_aside(run_cfg, tmp_path: Path) -> None:
    rd = tmp_path / "r"
    first = run(run_cfg("objective=finetune"), rd)
    before = snapshot(rd)
    second = run(run_cfg("objective=logit", "resume=false"), rd)
    assert second["objective"] == "logit"
    moved = next((rd / PREVIOUS).iterdir())
    kept = snapshot(moved)
    assert {k: v for k, v in before.items() if k != ".kdrun.lock"} == kept  # the whole old run, unchanged
    assert json.loads(kept["results.json"])["student"]["metrics"] == first["student"]["metrics"]
    assert json.loads((rd / PROVENANCE).read_text())["config"]["objective"]["name"] == "logit"


def test_identity_no_error_json_once_the_run_completed(run_cfg, tmp_path: Path, monkeypatch) -> None:
    import kdrun.app.outputs as outputs

    def failing_table(_summary):
        raise RuntimeError("the terminal went away")

    monkeypatch.setattr(outputs, "print_summary", failing_table)
    rd = tmp_path / "r"
    with pytest.raises(RuntimeError, match="terminal"):
        run(run_cfg("objective=finetune"), rd)
    assert (rd / "results.json").exists() and not (rd / "error.json").exists()


def test_keep_checkpoints_false_deletes_them_once_complete_and_the_run_stays_complete(run_cfg,
                                                                                     tmp_path: Path) -> None:
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    a = run(run_cfg("objective=finetune", "train.checkpoint_every_steps=2"), kept)
    b = run(run_cfg("objective=finetune", "train.checkpoint_every_steps=2", "train.keep_checkpoints=false"), dropped)
    assert (kept / "checkpoints" / "last" / "state.json").exists()
    assert not (dropped / "checkpoints").exists() and (dropped / "student" / "config.json").exists()
    assert a["config_hash"] == b["config_hash"]  # where its resume state goes changes nothing computed
    assert a["student"]["metrics"] == b["student"]["metrics"]
    assert recorded_run(dropped).state == "complete"
    before = snapshot(dropped / "student")
    again = run(run_cfg("objective=finetune", "train.checkpoint_every_steps=2", "train.keep_checkpoints=false"),
                dropped)  # rerun: the finished run answers, nothing retrains
    assert again["student"]["metrics"] == b["student"]["metrics"] and snapshot(dropped / "student") == before


# -------------------------------------------------------------------------------- through the CLI

@pytest.fixture(scope="module")
def complete_ckd_run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("ckd")
    r = kdrun_cli(tmp, "objective=ckd", "hydra.run.dir=D")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, tmp / "D"


def test_identity_cli_another_objective_in_a_finished_directory_is_one_line_and_changes_nothing(
        complete_ckd_run) -> None:
    tmp, d = complete_ckd_run
    before = snapshot(d)
    r = kdrun_cli(tmp, "objective=logit", "hydra.run.dir=D")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"kdrun: error: {d} holds a complete run of another configuration "
                               "(objective.name: 'ckd' -> 'logit'")
    assert "resume=false" in r.stderr and "hydra.run.dir=" in r.stderr
    assert snapshot(d) == before  # .hydra/, cli.log, results.json, student/, checkpoints: byte for byte


def test_provenance_kept_once_and_a_report_only_appends_to_cli_log(complete_ckd_run) -> None:
    tmp, d = complete_ckd_run
    prov = json.loads((d / PROVENANCE).read_text())
    assert prov["argv"][1:] == [*SMALL, "objective=ckd", "hydra.run.dir=D"]
    assert prov["config"]["objective"]["name"] == "ckd"
    assert prov["config_hash"] == json.loads((d / "results.json").read_text())["config_hash"]
    import torch

    assert prov["packages"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if head:  # kdrun runs from this checkout (editable install)
        assert prov["git"]["commit"] == head
    assert "- objective=ckd" in (d / ".hydra" / "overrides.yaml").read_text().splitlines()
    assert "name: ckd" in (d / ".hydra" / "config.yaml").read_text()
    before = snapshot(d)
    r = kdrun_cli(tmp, "objective=ckd", "hydra.run.dir=D")
    assert r.returncode == 0 and "this run is complete" in r.stdout
    after = snapshot(d)
    assert {k: v for k, v in after.items() if k != "cli.log"} == {k: v for k, v in before.items() if k != "cli.log"}
    assert after["cli.log"].startswith(before["cli.log"])
    added = after["cli.log"][len(before["cli.log"]):].decode()
    assert added.startswith("=== ") and "this run is complete" in added


def test_pipe_closed_on_a_complete_run_ends_quietly(complete_ckd_run) -> None:
    tmp, d = complete_ckd_run
    before = snapshot(d)
    p = subprocess.Popen([sys.executable, "-m", "kdrun", *SMALL, "objective=ckd", "hydra.run.dir=D"], cwd=tmp,
                         env=env_for(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # as `| head -0` would: every write to stdout fails with EPIPE
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141, err
    assert err == "" and not (d / "error.json").exists()
    after = snapshot(d)
    assert {k: v for k, v in after.items() if k != "cli.log"} == {k: v for k, v in before.items() if k != "cli.log"}
    assert b"this run is complete" in after["cli.log"][len(before["cli.log"]):]  # the log still has it


def test_pipe_through_head_in_a_shell(complete_ckd_run) -> None:
    tmp, d = complete_ckd_run
    cmd = " ".join([sys.executable, "-m", "kdrun", *SMALL, "objective=ckd", "hydra.run.dir=D", "| head -1"])
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], cwd=tmp, env=env_for(tmp), capture_output=True,
                       text=True, timeout=300)
    assert r.stdout.startswith("[kdrun] ") and r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr and r.returncode in (0, 141)
    assert not (d / "error.json").exists()


def test_identity_cli_config_failure_leaves_a_cli_log_with_its_header(tmp_path: Path) -> None:
    r = kdrun_cli(tmp_path, "objective=ckd", "objective.params.window_pair=0", "hydra.run.dir=E")
    assert r.returncode == 2 and "window_pair=0" in r.stderr
    log = (tmp_path / "E" / "cli.log").read_text().splitlines()
    assert log[0].startswith("=== ") and "objective.params.window_pair=0" in log[0]
    assert any("window_pair=0" in line for line in log[1:])
    assert json.loads((tmp_path / "E" / "error.json").read_text())["phase"] == "config"
    assert recorded_run(tmp_path / "E") is None  # a corrected command may use the directory


def test_identity_multirun_job_directory_of_another_config_is_refused(tmp_path: Path) -> None:
    job = ["hydra.sweep.dir=S", "hydra.sweep.subdir=J"]  # both sweeps' jobs land in S/J
    first = kdrun_cli(tmp_path, "-m", "objective=finetune", *job)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(tmp_path / "S" / "J")
    second = kdrun_cli(tmp_path, "-m", "objective=logit", *job)
    assert second.returncode == 2
    assert f"{tmp_path / 'S' / 'J'} holds a complete run of another configuration (objective.name: 'finetune' -> " \
           "'logit')" in second.stderr
    assert snapshot(tmp_path / "S" / "J") == before
