"""What users who share caches, rerun commands and read reports rely on: damaged cache entries are
rebuilt, one process per run directory, every failed run leaves cli.log and error.json, files
follow the umask, duplicate runs count once, and exit statuses say what went wrong."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from kdrun.app.run import run
from kdrun.report.results import collect
from kdrun.runtime import forkrun
from kdrun.runtime.cache import COMPLETE_MARKER, DAMAGED_DIR, get_or_build, load_or_build, write_text_atomic
from kdrun.runtime.locks import RunDirBusy, run_dir_lock
from tests.conftest import REPO, TINY, TOY
from tests.test_sweeps import env_for


def _kdrun(tmp: Path, *args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """``python -m kdrun ARGS`` in ``tmp``: forked (kdrun.runtime.forkrun), or under ``umask`` a new process."""
    if umask is None:
        return forkrun.run(list(args), env_for(tmp), tmp, 300)
    return subprocess.run([sys.executable, "-m", "kdrun", *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp, env=env_for(tmp), preexec_fn=lambda: os.umask(umask))


def _builder(calls: list[int], payload: bytes = b"x" * 1000):
    def build(tmp: Path) -> None:
        calls.append(1)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(payload)
        (tmp / "meta.json").write_text("{}")
    return build


# ------------------------------------------------------------------------------------ cache entries

@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_entry_is_moved_aside_and_rebuilt(tmp_path: Path, damage: str, capsys) -> None:
    calls: list[int] = []
    entry, cached = get_or_build(tmp_path, "teachers", "k1", _builder(calls))
    manifest = json.loads((entry / COMPLETE_MARKER).read_text())["files"]
    assert set(manifest) == {"sub/weights.bin", "meta.json"} and manifest["sub/weights.bin"]["size"] == 1000
    assert get_or_build(tmp_path, "teachers", "k1", _builder(calls)) == (entry, True) and len(calls) == 1
    w = entry / "sub" / "weights.bin"
    if damage == "truncate":
        w.write_bytes(b"x" * 10)
    elif damage == "flip":  # same size, one byte changed: only the checksum sees it
        w.write_bytes(b"x" * 500 + b"y" + b"x" * 499)
    else:
        w.unlink()
    again, cached = get_or_build(tmp_path, "teachers", "k1", _builder(calls))
    assert (again, cached, len(calls)) == (entry, False, 2)
    assert w.read_bytes() == b"x" * 1000
    aside = list((tmp_path / "teachers" / DAMAGED_DIR).iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("k1-")
    msg = capsys.readouterr().out.strip().splitlines()
    assert len(msg) == 1 and f"cache entry {entry} is damaged" in msg[0] and "rebuilding" in msg[0]
    assert {"truncate": "has 10 bytes, the manifest says 1000", "flip": "does not match its checksum",
            "delete": "sub/weights.bin is missing"}[damage] in msg[0]


def test_unreadable_entry_without_manifest_is_rebuilt_once(tmp_path: Path, capsys) -> None:
    """Entries of older versions carry the marker "ok" and no manifest: a loader failure is the
    sign of damage; a freshly built entry that cannot be loaded is a bug and raises."""
    calls: list[int] = []
    entry, _ = get_or_build(tmp_path, "tokenized", "k", _builder(calls))
    (entry / COMPLETE_MARKER).write_text("ok\n")
    (entry / "meta.json").write_text("{not json")

    value, again, cached = load_or_build(tmp_path, "tokenized", "k", _builder(calls),
                                         lambda e: json.loads((e / "meta.json").read_text()))
    assert (value, again, cached, len(calls)) == ({}, entry, False, 2)
    assert "cannot be loaded: JSONDecodeError" in capsys.readouterr().out
    with pytest.raises(ValueError, match="always broken"):
        load_or_build(tmp_path, "tokenized", "k2", _builder(calls), lambda e: (_ for _ in ()).throw(
            ValueError("always broken")))


_HOLD_LOCK = """
import sys, time
from filelock import FileLock
with FileLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_stale_staging_directories_are_removed_live_ones_kept(tmp_path: Path) -> None:
    kind = tmp_path / "teachers"
    kind.mkdir()
    stale_own, stale_other, live = kind / ".k1.tmp-aaa", kind / ".k2.tmp-bbb", kind / ".k3.tmp-ccc"
    for d in (stale_own, stale_other, live):
        (d / "model").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(kind / "k3") + ".lock"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # k3's writer is alive
        get_or_build(tmp_path, "teachers", "k1", _builder([]))
        assert not stale_own.exists() and not stale_other.exists() and live.exists()
    finally:
        holder.kill()
        holder.wait()


def test_files_and_dirs_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        entry, _ = get_or_build(tmp_path, "teachers", "k", _builder([]))
        write_text_atomic(tmp_path / "out" / "results.json", "{}")
    finally:
        os.umask(old)
    for p in [entry, *entry.rglob("*"), tmp_path / "out" / "results.json"]:
        want = 0o775 if p.is_dir() else 0o664
        assert p.stat().st_mode & 0o777 == want, (p, oct(p.stat().st_mode))


def test_damaged_cached_teacher_is_rebuilt_and_the_run_succeeds(run_cfg, tmp_path: Path, capsys) -> None:
    first = run(run_cfg("objective=logit"), tmp_path / "a")
    weights = Path(first["teacher"]["path"]) / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # as a full disk or an interrupted copy of the cache leaves it
        f.truncate(size // 2)
    capsys.readouterr()
    second = run(run_cfg("objective=logit"), tmp_path / "b")
    out = capsys.readouterr().out
    assert "is damaged (model/model.safetensors has" in out and "rebuilding" in out
    assert second["teacher"]["cached"] is False and second["teacher"]["path"] == first["teacher"]["path"]
    assert weights.stat().st_size == size
    assert second["teacher"]["metrics"] == first["teacher"]["metrics"]  # the same teacher, trained again
    assert second["student"]["metrics"] == first["student"]["metrics"]


# ------------------------------------------------------------------------------- one writer per run

def test_second_process_in_a_held_run_directory_fails_naming_the_holder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        r = _kdrun(tmp_path, *TINY, *TOY, f"hydra.run.dir={run_dir}")
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            with run_dir_lock(run_dir):
                pass
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in r.stderr
    assert "resume=wait" in r.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "error.json").exists()


def test_two_concurrent_runs_of_one_directory_exactly_one_trains(tmp_path: Path) -> None:
    args = [*TINY, *TOY, "objective=logit", f"hydra.run.dir={tmp_path}/run", "logger.log_every_steps=1"]
    procs = [forkrun.start(args, env_for(tmp_path), tmp_path / f"out{i}", tmp_path, err=tmp_path / f"err{i}")
             for i in range(2)]  # forked: kdrun.runtime.forkrun
    codes = [p.wait(timeout=300) for p in procs]
    outs = [((tmp_path / f"out{i}").read_text(), (tmp_path / f"err{i}").read_text()) for i in range(2)]
    codes = sorted(codes)
    assert codes == [0, 2], [o[1][-1500:] for o in outs]
    loser = outs[[p.returncode for p in procs].index(2)]
    assert "is in use by pid" in loser[1]
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in x]
    assert steps == sorted(set(steps)) and steps[0] == 1


def test_resume_wait_waits_for_the_holder_then_reports(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY, *TOY, "objective=finetune", f"hydra.run.dir={run_dir}"]
    assert _kdrun(tmp_path, *args).returncode == 0
    with run_dir_lock(run_dir):
        p = subprocess.Popen([sys.executable, "-m", "kdrun", *args, "resume=wait"], cwd=tmp_path, env=env_for(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = p.stdout.readline()
        assert "is in use by pid" in first and "waiting (resume=wait)" in first
        time.sleep(0.5)
        assert p.poll() is None  # still waiting
    out = first + p.communicate(timeout=120)[0]
    assert p.returncode == 0, out[-2000:]
    assert "this run is complete" in out and "student  validation  accuracy" in out  # its table again


# --------------------------------------------------------------------------- the record of a run

def test_failed_run_leaves_cli_log_and_error_json_and_the_report_lists_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").write_text("sentence\tlabel\ngood film\t1\nbad film\n")  # line 3: a column short
    (data / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    run_dir = tmp_path / "run"
    r = _kdrun(tmp_path, *TINY, "task=sst2", f"task.data_dir={data}", f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr[-2000:]
    err = json.loads((run_dir / "error.json").read_text())
    assert err["user_error"] is True and err["phase"] == "data" and "train.tsv" in err["message"]
    assert err["message"] in r.stderr and "Traceback" in err["traceback"]
    log = (run_dir / "cli.log").read_text()
    assert f"kdrun: error: {err['message']}" in log
    runs, problems = collect([run_dir])
    assert runs == [] and [p.status for p in problems] == ["failed"]
    assert err["message"][:80] in problems[0].detail and "reached: phase data" in problems[0].detail


def test_successful_run_log_and_a_rerun_prints_its_table(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY, *TOY, "objective=finetune", f"hydra.run.dir={run_dir}"]
    first = _kdrun(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    log = (run_dir / "cli.log").read_text()
    assert "student  validation  accuracy" in log and "\r" not in log  # progress bars: their last state only
    again = _kdrun(tmp_path, *args)
    assert again.returncode == 0 and "this run is complete" in again.stdout
    table = [x for x in first.stdout.splitlines() if x.startswith(("teacher ", "student "))]
    assert table and all(x in again.stdout for x in table)
    assert (run_dir / "cli.log").read_text().count("=== ") == 2  # one section per invocation


def test_umask_002_run_writes_group_writable_outputs_and_cache(tmp_path: Path) -> None:
    r = _kdrun(tmp_path, *TINY, *TOY, "objective=logit", f"hydra.run.dir={tmp_path}/run", umask=0o002)
    assert r.returncode == 0, r.stderr[-2000:]
    checked = 0
    for root in (tmp_path / "run", tmp_path / "cache"):
        for p in [root, *root.rglob("*")]:
            mode = p.stat().st_mode & 0o777
            assert mode & (0o070 if p.is_dir() else 0o060) == (0o070 if p.is_dir() else 0o060), (p, oct(mode))
            checked += 1
    assert checked > 20 and (tmp_path / "run" / "results.json").exists()


# ----------------------------------------------------------------------------------- exit statuses

def test_exit_statuses(tmp_path: Path) -> None:
    composition = _kdrun(tmp_path, "objective.nosuch=1")
    assert composition.returncode == 2 and "objective.nosuch: no such key in objective" in composition.stderr
    assert "Traceback" not in composition.stderr
    wrong_type = _kdrun(tmp_path, "train.lr=abc")
    assert wrong_type.returncode == 2 and "train.lr='abc': expected float" in wrong_type.stderr
    bad_resume = _kdrun(tmp_path, *TINY, *TOY, "resume=maybe", f"hydra.run.dir={tmp_path}/r")
    assert bad_resume.returncode == 2 and "resume='maybe' must be true, false or wait" in bad_resume.stderr


def test_read_only_run_directory_is_one_clear_line(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    elif subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                        capture_output=True).returncode != 0:
        pytest.skip("running as root without the right to mount a read-only file system")
    try:
        r = _kdrun(tmp_path, *TINY, *TOY, f"hydra.run.dir={ro}/run")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)
        else:
            ro.chmod(0o755)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("kdrun: error: cannot write the run directory: ")
    assert f"{ro}/run" in r.stderr and "Traceback" not in r.stderr


def test_duplicate_same_seed_runs_are_counted_once(tmp_path: Path) -> None:
    from tests.test_report import write_run

    write_run(tmp_path / "a", "r1", "rte", "ckd", 42, 0.60)
    time.sleep(0.02)
    write_run(tmp_path / "b", "r1", "rte", "ckd", 42, 0.64)  # the same command rerun elsewhere
    write_run(tmp_path / "b", "r2", "rte", "ckd", 43, 0.70)
    runs, problems = collect([tmp_path])
    assert sorted((r.seed, r.value) for r in runs) == [(42, 0.64), (43, 0.70)]  # the newer seed-42 run kept
    assert [(p.status, p.path) for p in problems] == [("duplicate", tmp_path / "a" / "r1")]
    assert str(tmp_path / "b" / "r1") in problems[0].detail
    r = subprocess.run([sys.executable, "-m", "kdrun.report.cli", str(tmp_path), "--no-plots", "--out",
                        str(tmp_path / "rep")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "1 duplicates counted once" in r.stdout and "n=2 seeds [42,43]" in r.stdout
    assert "counted once" in r.stderr


def test_cache_lock_files_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        with FileLock(str(tmp_path / "k.lock")):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "k.lock").stat().st_mode & 0o777 == 0o664


@pytest.mark.parametrize("every", [1, 4])
def test_resumed_metrics_log_has_each_step_once(run_cfg, tmp_path: Path, every: int) -> None:
    """Steps logged between the last checkpoint and a kill are trained again after the resume; the
    log is cut back to the checkpoint, so it equals an uninterrupted run's. With a log line every 4
    steps the checkpoint at 15 cuts the interval 13-16: its saved loss sums make step 16's means
    the uninterrupted run's."""
    from kdrun.engine.trainer import SimulatedInterrupt
    from tests.test_e2e import TWO_STAGES

    def records(run_dir: Path) -> list[dict]:
        volatile = ("time", "train/examples_per_s", "train/tokens_per_s")
        return [{k: v for k, v in json.loads(x).items() if k not in volatile}
                for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # one compute thread: under other kdrun runs on the host the reference and the resumed run could
    # otherwise be given different thread counts and differ by rounding
    args = (*TWO_STAGES, f"logger.log_every_steps={every}", "train.num_threads=1")
    run(run_cfg(*args), tmp_path / "ref")
    rd = tmp_path / "killed"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg(*args, "train.stop_after_steps=17"), rd)  # checkpoint at 15; steps 16, 17 logged
    assert max(r["step"] for r in records(rd)) == 17
    run(run_cfg(*args), rd)
    assert records(rd) == records(tmp_path / "ref")
