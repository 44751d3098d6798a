"""kdrun.runtime.forkrun: a run forked from a server that imported kdrun's libraries is the run a fresh
``python -m kdrun`` process makes (results, weights, exit statuses, atexit handlers), and a run whose
environment the libraries would read differently at import gets a fresh process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kdrun.runtime import forkrun
from tests.conftest import REPO, load_script

RUN = ["teacher=tiny_random", "student=tiny_random", "logger=none", "train.num_threads=1", "task=toy",
       "task.toy.num_train=64", "task.toy.num_validation=32", "teacher.finetune.epochs=1", "objective=logit",
       "train.epochs=1"]
ATEXIT = """
import atexit
import os
from pathlib import Path

atexit.register(lambda: Path(os.environ["KDRUN_ATEXIT_FILE"]).write_text(str(os.getpid())))
"""


def env() -> dict[str, str]:
    """The environment the server imported under, where an earlier test of this process started it (the
    process's own may have changed since: a run in it sets HYDRA_FULL_ERROR, ...); else the fuzz scripts'."""
    return dict(forkrun._SERVER.get("env") or load_script("fuzz/kill").env())


def test_a_forked_run_is_the_run_of_a_fresh_process(tmp_path: Path) -> None:
    (tmp_path / "kdrun_atexit_probe.py").write_text(ATEXIT)
    forked_env = {**env(), "PYTHONPATH": str(tmp_path), "KDRUN_ATEXIT_FILE": str(tmp_path / "atexit.txt")}
    args = [*RUN, f"cache_dir={tmp_path / 'cache'}", "objective.imports=[kdrun_atexit_probe]"]
    run = forkrun.start([*args, f"output_dir={tmp_path / 'forked'}"], forked_env, tmp_path / "forked.log")
    assert isinstance(run, forkrun.Run) and run.wait(timeout=300) == 0, (tmp_path / "forked.log").read_text()
    assert (tmp_path / "atexit.txt").read_text() == str(run.pid)  # its atexit handlers ran, in its own process
    fresh = subprocess.run([sys.executable, "-m", "kdrun", *args, f"output_dir={tmp_path / 'fresh'}"], cwd=REPO,
                           env={**forked_env, "KDRUN_ATEXIT_FILE": str(tmp_path / "fresh_atexit.txt")},
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    res = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("forked", "fresh")]
    assert res[0]["student"]["metrics"] == res[1]["student"]["metrics"] and res[1]["teacher"]["cached"]
    weights = [load_file(str(tmp_path / d / "student" / "model.safetensors")) for d in ("forked", "fresh")]
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[1]) and weights[0].keys() == weights[1].keys()
    assert "teacher: fine-tuned and cached" in (tmp_path / "forked.log").read_text()


def test_exit_statuses_read_as_a_processes(tmp_path: Path) -> None:
    bad = forkrun.start([*RUN, "train.epoch=1", f"output_dir={tmp_path / 'bad'}"], env(), tmp_path / "bad.log")
    assert isinstance(bad, forkrun.Run) and bad.wait(timeout=120) == 2
    assert (tmp_path / "bad.log").read_text() == ("kdrun: error: train.epoch: no such key in train; did you mean "
                                                  "train.epochs? (kdrun --cfg job shows every key)\n")
    run = forkrun.start([*RUN, f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'killed'}"], env(),
                        tmp_path / "killed.log", new_session=True)
    time.sleep(0.5)
    assert run.poll() is None
    run.send_signal(signal.SIGKILL)
    assert run.wait(timeout=60) == -signal.SIGKILL == run.returncode


def test_a_run_whose_libraries_would_import_differently_gets_a_fresh_process(tmp_path: Path, monkeypatch) -> None:
    forkrun.start([*RUN, "train.epoch=1"], env(), tmp_path / "a.log").wait(timeout=120)  # the server runs
    other = forkrun.start([*RUN, "train.epoch=1"], {**env(), "HF_DATASETS_CACHE": str(tmp_path / "hf")},
                          tmp_path / "b.log")
    assert isinstance(other, subprocess.Popen) and other.wait(timeout=120) == 2
    monkeypatch.setenv("KDRUN_FORKRUN", "0")
    plain = forkrun.start([*RUN, "train.epoch=1"], env(), tmp_path / "c.log")
    assert isinstance(plain, subprocess.Popen) and plain.wait(timeout=120) == 2
    logs = [(tmp_path / f"{x}.log").read_text() for x in "abc"]
    assert logs[0] == logs[1] == logs[2] and logs[0].startswith("kdrun: error: train.epoch:")  # forked or not
    assert forkrun._at_import({**env(), "PYTHONPATH": "x", "KDRUN_CACHE_DIR": "y"}) == forkrun._at_import(env())


def test_run_captures_stdout_and_stderr_apart_and_run_time_settings_keep_the_fork(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """forkrun.run reads as subprocess.run(capture_output=True, text=True): the error line on stderr alone;
    settings read only while a run runs (RUN_TIME) keep it forked; the timeout kills the run."""
    forkrun.start([*RUN, "train.epoch=1"], env(), tmp_path / "a.log").wait(timeout=120)  # the server runs
    run_time = {**env(), "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "true",
                "KDRUN_CACHE_DIR": str(tmp_path / "c"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    assert isinstance(forkrun.start([*RUN, "train.epoch=1"], run_time, tmp_path / "b.log"), forkrun.Run)
    sklearn_set = {k: v for k, v in env().items() if k not in forkrun.SET_BY_IMPORT}  # without, then with them
    for kmp in (sklearn_set, {**sklearn_set, "KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}):
        assert isinstance(forkrun.start([*RUN, "train.epoch=1"], kmp, tmp_path / "k.log"), forkrun.Run)
    bad = forkrun.run([*RUN, "train.epoch=1"], run_time, tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr == (tmp_path / "a.log").read_text()
    assert bad.args[:3] == [sys.executable, "-m", "kdrun"] and bad.stderr.startswith("kdrun: error: train.epoch:")
    monkeypatch.setattr(forkrun, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError(k)))
    with pytest.raises(AssertionError, match="'err': PosixPath"):  # stderr goes to a file of its own
        forkrun.run(RUN, run_time)
    monkeypatch.undo()
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forkrun.run([*RUN, f"cache_dir={tmp_path / 'slow'}", f"output_dir={tmp_path / 'slow_run'}"], run_time,
                    timeout=1)
    assert time.monotonic() - t0 < 30


def test_the_server_is_no_runs_process(tmp_path: Path) -> None:
    """The fuzz scripts wait for every process carrying a run's tag (KDRUN_FUZZ_RUN): the server must not
    carry the tag of the run that started it, or the first run's wait never ends."""
    from multiprocessing import forkserver

    fk = load_script("fuzz/kill")
    with fk.fresh_log(tmp_path / "run.log") as log:  # the first run of a process starts the server
        proc = fk.start(fk.kdrun_command([*RUN, "train.epoch=1"], tmp_path / "cache", tmp_path / "run"), log)
        assert proc.wait(timeout=120) == 2
    assert fk.tagged(proc.tag) == []
    server = Path(f"/proc/{forkserver._forkserver._forkserver_pid}/environ").read_bytes().split(b"\0")
    assert not [e for e in server if e.startswith(b"KDRUN_")], server
