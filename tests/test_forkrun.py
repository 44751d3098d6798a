"""kdrun.runtime.forkrun: a run forked from a server that imported kdrun's libraries is the run a fresh
``python -m kdrun`` process makes (results, weights, exit statuses, atexit handlers), and a run whose
environment the libraries would read differently at import gets a fresh process."""

from __future__ import annotations

import json
import os
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


PROBE = """
import atexit, os, signal, sys, time
from pathlib import Path


def main(argv):
    what, out = argv[0], Path(argv[1])
    atexit.register(lambda: (out / "own_atexit").write_text(str(os.getpid())))
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    (out / "seen").write_text(f"{os.environ.get('PROBE_SETTING')} {os.getpgid(0) == os.getpid()} {sys.argv}")
    if what == "exit":
        sys.exit(3)
    if what == "raise":
        raise ValueError("probe failed")
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "sleep":
        time.sleep(60)
    return 0
"""
DRIVER = """
import atexit, json, os, subprocess, sys
from pathlib import Path
from kdrun.runtime.forkrun import fork_module

tmp = Path(sys.argv[1])
def parent_atexit():
    with open(tmp / "parent_atexit", "a") as f:
        f.write(f"{os.getpid()}\\n")


atexit.register(parent_atexit)  # the parent's, not the children's
rows = {"driver": os.getpid()}
for what in ("return", "exit", "raise", "kill", "sleep"):
    out = tmp / what
    out.mkdir()
    with open(out / "stdout", "w") as o, open(out / "stderr", "w") as e:
        child = fork_module("kdrun_fork_probe", [what, str(out)], {**os.environ, "PROBE_SETTING": what},
                            o.fileno(), e.fileno(), new_session=(what == "return"))
        try:
            rows[what] = child.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.kill(child.pid, 9)
            rows[what] = ["timeout", child.wait()]
(tmp / "rows.json").write_text(json.dumps(rows))
"""


def test_fork_module_runs_a_modules_main_as_python_m_does(tmp_path: Path) -> None:
    """forkrun.fork_module (the CPU device check's children): the exit status as an interpreter's (main's
    return, sys.exit, an exception, a signal), the output to the given files, the given environment, a
    session of its own where asked, the child's own atexit handlers and not the parent's."""
    (tmp_path / "kdrun_fork_probe.py").write_text(PROBE)
    (tmp_path / "driver.py").write_text(DRIVER)
    p = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert (tmp_path / "parent_atexit").read_text() == f"{rows.pop('driver')}\n"  # once, in the parent
    assert rows == {"return": 0, "exit": 3, "raise": 1, "kill": -signal.SIGKILL, "sleep": ["timeout", -signal.SIGKILL]}
    for what in rows:
        assert (tmp_path / what / "stdout").read_text() == "to stdout\n"
        assert (tmp_path / what / "stderr").read_text().startswith("to stderr\n")
        setting, own_group, argv = (tmp_path / what / "seen").read_text().split(" ", 2)
        assert setting == what and own_group == str(what == "return") and argv == str(["kdrun_fork_probe", what,
                                                                                       str(tmp_path / what)])
        assert (tmp_path / what / "own_atexit").exists() == (what in ("return", "exit", "raise")), what
    assert "ValueError: probe failed" in (tmp_path / "raise" / "stderr").read_text()


SIBLING_SCRIPT = """
import os, sys
from kdrun_sibling_probe import WHERE  # next to the script: sys.path[0] is its folder, as for python SCRIPT

print(sys.argv, WHERE == os.path.dirname(os.path.abspath(sys.argv[0])))
print("err", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_run_of_a_script_and_of_a_module_reads_as_the_fresh_processes(tmp_path: Path) -> None:
    """forkrun.run(script=...) is ``python SCRIPT ARGS`` (sys.argv, sys.path[0] the script's folder, exit
    status, stdout and stderr apart) and forkrun.run(module=...) is ``python -m MODULE ARGS``: the same as
    the fresh processes."""
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / "probe.py").write_text(SIBLING_SCRIPT)
    (folder / "kdrun_sibling_probe.py").write_text("import os\nWHERE = os.path.dirname(os.path.abspath(__file__))\n")
    (tmp_path / "kdrun_module_probe.py").write_text(
        SIBLING_SCRIPT.replace("from kdrun_sibling_probe import WHERE", "WHERE = os.getcwd()"))
    environ = {**env(), "PYTHONPATH": str(tmp_path)}
    script = str(folder / "probe.py")  # absolute: the fork's sys.argv[0] is the script's absolute path
    for how, argv0 in (({"script": script}, script),
                       ({"module": "kdrun_module_probe"}, str(tmp_path / "kdrun_module_probe.py"))):
        got = forkrun.run(["3", "x"], environ, tmp_path, 120, **how)
        fresh = subprocess.run([sys.executable, *([script] if "script" in how else ["-m", how["module"]]),
                                "3", "x"], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)
        assert (got.returncode, got.stdout, got.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr) == (
            3, f"{[argv0, '3', 'x']} True\n", "err\n"), how
