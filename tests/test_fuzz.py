"""The fuzz scripts in their fast modes: a few signals at random moments, every run compared with
the uninterrupted one after one restart that resumed from the checkpoint on disk, also with one
of two DDP processes killed; damaged cache entries, checkpoints (last, best) and a killed teacher
build's directory (README "Reliability in figures" states the full counts)."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests import procs
from tests.conftest import load_script


@pytest.fixture(scope="module")
def kill_references(tmp_path_factory) -> Path:
    """Where the kill tests' uninterrupted runs go: the tests of one run (logger) share them
    (``fuzz/kill.py --references``), each test's signalled runs and restarts are its own."""
    return tmp_path_factory.mktemp("kill-references")


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("sig,runs", [("KILL", 2), ("TERM", 1)])
def test_fuzz_kill_fast(tmp_path: Path, sig: str, runs: int, kill_references: Path) -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz/kill").main(["--fast", "--runs", str(runs), "--signal", sig, "--seed", "1",
                                            "--out", str(tmp_path), "--references", str(kill_references / "none")])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["passed"] == res["counted"] == runs and not res["failures"], buf.getvalue()
    assert f"{runs}/{runs} passed" in buf.getvalue()


@pytest.mark.usefixtures("no_leftover_processes")
def test_fuzz_kill_ddp_rank_fast(tmp_path: Path) -> None:
    """Two processes under torchrun; SIGKILL to rank 1 alone; one restart ends identically."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz/kill").main(["--fast", "--ddp", "--runs", "1", "--seed", "4", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["passed"] == res["counted"] == 1 and res["ddp"], buf.getvalue()


@pytest.mark.usefixtures("no_leftover_processes")
def test_fuzz_kill_wandb_fast(tmp_path: Path, kill_references: Path) -> None:
    """SIGTERM in the student stage under logger=wandb (offline): the stopped run's wandb offline run
    and its restart's are one wandb run (the id in wandb_id.txt) holding every step once."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz/kill").main(["--fast", "--logger", "wandb", "--signal", "TERM", "--runs", "1",
                                            "--events", "student step 3,student step 6", "--seed", "1",
                                            "--out", str(tmp_path), "--references", str(kill_references / "wandb")])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["passed"] == res["counted"] == 1 and res["logger"] == "wandb", buf.getvalue()
    (trial,) = res["trials"]
    assert len(trial["wandb_logs"]) == 2 and trial["resumed_at"]["student"] >= 3  # stopped, then restarted
    assert "one wandb run" in buf.getvalue()


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("signal,event", [("KILL", "student step 6"), ("TERM", "teacher checkpoint")])
def test_fuzz_kill_wandb_after_a_checkpoint_or_in_the_teacher_fast(tmp_path: Path, signal: str, event: str,
                                                                   kill_references: Path) -> None:
    """A SIGKILL after the student's checkpoint (the killed run's wandb service writes nothing: the
    restart logs the rows up to its checkpoint again) and a SIGTERM while the teacher fine-tunes (the
    restart keeps the wandb run id though no student checkpoint exists): one wandb run, every step once."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz/kill").main(["--fast", "--logger", "wandb", "--signal", signal, "--runs", "1",
                                            "--at", "event", "--events", event, "--out", str(tmp_path),
                                            "--references", str(kill_references / "wandb")])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["passed"] == res["counted"] == 1, buf.getvalue()


def test_fuzz_kill_judges_the_restart() -> None:
    """A run passes only when its one restart resumed from the checkpoint on disk (or later)."""
    fk = load_script("fuzz/kill")
    saved = {"student": 6, "teacher": None}
    ok = "[kdrun] resuming at stage 1 step 6 from /r/checkpoints/last\n"
    assert fk.resume_problems(saved, ok) == []
    assert fk.resume_problems(saved, "stage 0:intermediate ...\n") == [
        "the student started over (a checkpoint at step 6 was on disk)"]
    assert fk.resume_problems(saved, "[kdrun] resuming at stage 0 step 3 from /r\n") == [
        "the student resumed at step 3, before the checkpoint at step 6"]
    assert fk.resume_problems({"student": None, "teacher": 3}, "fine-tuning the teacher\n") == [
        "the teacher started over (a checkpoint at step 3 was on disk)"]
    assert fk.resume_problems({"student": None, "teacher": 3},
                              "[kdrun] resuming the teacher's fine-tuning at step 3 from /c\n") == []
    assert fk.judge({}, Path("/nonexistent"), 1, saved, ok) == ["the restart exited 1"]
    assert fk.resumed_at(ok) == {"student": 6, "teacher": None}


def test_fuzz_kill_makes_its_uninterrupted_runs_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--references: invocations of the same run (signal, events, seed aside) make the two uninterrupted
    runs once and reuse them; another run (here without --fast) makes its own there, in place of them."""
    fk = load_script("fuzz/kill")
    made: list[str] = []

    def timed(cmd: list[str], log: Path) -> tuple[float, dict]:
        made.append(log.name)
        return 9.0, {"stage 0": 2.0, "outputs written": 8.0}

    monkeypatch.setattr(fk, "timed_reference", timed)
    monkeypatch.setattr(fk, "outcome", lambda run: {"run": str(run)})
    monkeypatch.setattr(fk, "same", lambda a, b: [])
    refs = tmp_path / "refs"
    for sig in ("KILL", "TERM"):
        got = fk.references(fk.parse_args(["--fast", "--signal", sig, "--references", str(refs)]), tmp_path / sig)
        assert got == ({"run": str(refs / "reference" / "run")}, None, 2.0, 8.0, {"stage 0": 2.0,
                                                                                "outputs written": 8.0})
    assert made == ["reference.log", "timing.log"]
    fk.references(fk.parse_args(["--references", str(refs)]), tmp_path / "full")
    assert made == ["reference.log", "timing.log"] * 2
    key = json.loads((refs / "references.json").read_text())["key"]
    assert "objective.params.prediction_epochs=1" not in key["overrides"] and key["ddp"] is False
    with pytest.raises(SystemExit) as not_a_dir:
        fk.parse_args(["--references", str(refs / "references.json")])
    assert not_a_dir.value.code == 2


def test_fuzz_kill_reads_a_checkpoint_left_by_a_cut_swap(tmp_path: Path) -> None:
    fk = load_script("fuzz/kill")
    (tmp_path / "run" / "checkpoints" / "last.old").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.old" / "state.json").write_text('{"global_step": 9}')
    partial = tmp_path / "cache" / "teachers" / ".k.partial" / "checkpoints" / "last"
    partial.mkdir(parents=True)
    (partial / "state.json").write_text('{"global_step": 3}')
    assert fk.on_disk(tmp_path) == {"student": 9, "teacher": 3}
    assert fk.override_value(tmp_path / "a b") == str(tmp_path / "a b")
    assert fk.override_value("/x/ré ü") == "'/x/ré ü'" and fk.override_value("/x/it's") == "'/x/it\\'s'"


def test_fuzz_kill_comparison_sees_a_difference(tmp_path: Path) -> None:
    """The comparison the count rests on: a changed weight or metric is reported, timings are not."""
    import torch

    fk = load_script("fuzz/kill")
    a = {"weights": {"w": torch.zeros(2)}, "metrics": {"student": 0.5}, "log": [{"train/loss": 1.0}]}
    assert fk.same(a, a) == []
    b = {**a, "weights": {"w": torch.tensor([0.0, 1e-7])}}
    assert fk.same(a, b) == ["student weights"]
    assert fk.same(a, {**a, "log": [{"train/loss": 1.0000001}]}) == ["metrics.jsonl"]


@pytest.mark.usefixtures("no_leftover_processes")
def test_fuzz_damage_fast(tmp_path: Path) -> None:
    """A few damaged files per scenario, each rerun: nothing is used silently; kdrun never reads the
    files of a stopped run's wandb offline directory."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz/damage").main(["--fast", "--per-scenario", "2", "--seed", "3", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_damage.json").read_text())
    assert rc == 0, buf.getvalue()
    assert {t["scenario"] for t in res["trials"]} == {"task", "partial", "augment", "spans", "corpus", "wandb"}
    assert res["counts"].get("silently used", 0) == 0 and "0 silently used" in buf.getvalue()
    assert sum(res["counts"].get(k, 0) for k in ("rebuilt", "refused")) >= 9
    assert {t["outcome"] for t in res["trials"] if t["scenario"] == "wandb"} == {"not read"}


def test_fuzz_damage_damages_and_classifies(tmp_path: Path) -> None:
    fd = load_script("fuzz/damage")
    f = tmp_path / "f.bin"
    f.write_bytes(bytes(range(10)))
    assert fd.damage(f, "flip") and f.read_bytes() == bytes([0, 1, 2, 3, 4, 5 ^ 0xFF, 6, 7, 8, 9])
    assert fd.damage(f, "truncate") and f.stat().st_size == 5
    assert fd.damage(f, "delete") and not f.exists()
    (tmp_path / "empty").write_bytes(b"")
    assert not fd.damage(tmp_path / "empty", "flip")
    said = "[kdrun] cache entry /c/teachers/k is damaged (x is missing); moved to /c/teachers/.damaged/k"
    names = ("/c/teachers/k/x", "/c/teachers/k")
    assert fd.classify(0, "training...\n", True, names) == "silently used"
    assert fd.classify(0, said, True, names) == "rebuilt"
    assert fd.classify(0, said, False, names) == "wrong"
    assert fd.classify(0, "training...\n", True, names, unread=True) == "not read"  # wandb's, and nothing read it
    assert fd.classify(0, "training...\n", False, names, unread=True) == "silently used"
    g = tmp_path / "g.bin"
    g.write_bytes(b"abc")
    fd.mark_unread(g)
    assert not fd.was_read(g) and g.read_bytes() == b"abc" and fd.was_read(g) == fd.atime_works(tmp_path)
    g.unlink()
    assert not fd.was_read(g)  # deleted and not recreated
    other = "[kdrun] cache entry /c/teachers/j is damaged (y is missing); moved to /c/teachers/.damaged/j"
    assert fd.classify(0, other, True, names) == "silently used"  # a message about another entry
    best = ("/r/checkpoints/best/student.safetensors", "/r/checkpoints/best")
    assert fd.classify(2, "kdrun: error: /r/checkpoints/best is damaged (x); rerun with resume=false", False,
                       best) == "refused"
    assert fd.classify(1, "kdrun: error: /r/checkpoints/best is damaged", False, best) == "unclear failure"
    assert fd.classify(1, "Traceback ... KeyError: 'w'", False, best) == "unclear failure"
    last = ("/r/checkpoints/last/state.json", "/r/checkpoints/last")
    crash = "Traceback (most recent call last):\n  File x, line 3\nKeyError: 'stage'"
    assert fd.classify(1, crash, False, last) == "unclear failure"  # 'last' in a traceback names nothing
    assert fd.classify(2, "kdrun: error: task.data_files: not found", False, last) == "unclear failure"
    assert fd.entry_of(Path("/w/cache/teachers/k/model/a.bin")) == Path("/w/cache/teachers/k")
    assert fd.entry_of(Path("/w/run/checkpoints/best/s.bin")) == Path("/w/run/checkpoints/best")
    assert fd.entry_of(Path("/w/c é/teachers/.k.partial/checkpoints/last/s.bin")) == \
        Path("/w/c é/teachers/.k.partial/checkpoints/last")


def test_a_manifest_with_a_damaged_byte_is_reported_not_raised(tmp_path: Path) -> None:
    from kdrun.runtime.cache import COMPLETE_MARKER, entry_problem, write_manifest

    (tmp_path / "a.txt").write_text("hello")
    write_manifest(tmp_path)
    assert entry_problem(tmp_path) is None
    marker = tmp_path / COMPLETE_MARKER
    raw = bytearray(marker.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    marker.write_bytes(bytes(raw))
    assert entry_problem(tmp_path).startswith("manifest unreadable")


@pytest.mark.usefixtures("no_leftover_processes")
def test_fuzz_faults_fast(tmp_path: Path) -> None:
    """A NaN at a random step, three racing builders, a full run directory and a full cache (tmpfs,
    where the tests may mount one)."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz/faults").main(["--fast", "--seed", "2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_faults.json").read_text())
    assert rc == 0, buf.getvalue()
    assert res["nan"] == {"handled": 1, "runs": 1} and res["race"] == {"handled": 1, "runs": 1}
    assert res["disk"]["handled"] == res["disk"]["runs"]  # 0/0 where no tmpfs can be mounted


def test_disk_full_errors_name_the_place(tmp_path: Path) -> None:
    import errno

    from kdrun.runtime.logs import disk_full

    places = {"output_dir": tmp_path / "run", "cache_dir": tmp_path / "cache"}
    err = disk_full(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "x.pt")), places)
    assert err is not None and str(err).startswith(f"no space left on the device holding {tmp_path / 'run' / 'x.pt'}")
    wrapped = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                           "message: \"No space left on device\" })")
    assert "then rerun" in str(disk_full(wrapped, places))
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("writing failed") from inner
    except RuntimeError as outer:
        assert disk_full(outer, places) is not None  # found down the exception's chain
    assert disk_full(ValueError("bad value"), places) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied"), places) is None


# ------------------------------------------------------------------------- wandb's offline runs

def wandb_log(path: Path, run_id: str | None, rows: list[tuple[int, dict]], pad: int = 0) -> Path:
    """A wandb transaction log as wandb writes it: ``:W&B``, version, then each record in LevelDB-log
    chunks (CRC-32 of type and data, length, type) that never cross a 32 KiB block; ``pad`` bytes of
    filler per history value make records span blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = [pb.Record(run=pb.RunRecord(run_id=run_id))] if run_id else []
    for step, values in rows:
        rec = pb.Record()
        rec.history.step.num = step
        for k, v in {**values, "_filler": json.dumps("x" * pad)}.items():
            rec.history.item.add(key=k, value_json=v)
        records.append(rec)
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for data in (r.SerializeToString() for r in records):
        first = True
        while True:
            room = 32768 - len(out) % 32768
            if room < 7:
                out += bytes(room)
                continue
            part, data = data[:room - 7], data[room - 7:]
            kind = (1 if not data else 2) if first else (4 if not data else 3)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + part), len(part), kind) + part
            first = False
            if not data:
                break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))
    return path


def test_fuzz_wandb_log_reader_reads_across_blocks_and_sees_damage(tmp_path: Path) -> None:
    fk = load_script("fuzz/kill")
    rows = [(s, {"train/loss": json.dumps(s / 7), "train/examples_per_s": "9"}) for s in range(1, 60)]
    log = wandb_log(tmp_path / "run-a.wandb", "a", rows, pad=2000)  # about 120 KiB: 4 blocks
    assert log.stat().st_size > 3 * 32768
    h = fk.wandb_history(log)
    assert h["id"] == "a" and h["problem"] is None
    assert h["rows"] == [(s, {"train/loss": json.dumps(s / 7)}) for s in range(1, 60)]  # timings left out
    raw = bytearray(log.read_bytes())
    raw[50000] ^= 0xFF
    log.write_bytes(bytes(raw))
    h = fk.wandb_history(log)
    assert h["problem"].startswith("a damaged or cut record") and 0 < len(h["rows"]) < 59
    assert [s for s, _ in h["rows"]] == list(range(1, len(h["rows"]) + 1))  # the rows before the damage
    log.write_bytes(bytes(raw[:-10]))
    assert fk.wandb_history(log)["problem"] is not None


def test_fuzz_wandb_check_sees_a_gap_a_repeat_a_second_run_and_other_values(tmp_path: Path) -> None:
    fk = load_script("fuzz/kill")
    a, b, c = ({"train/loss": v} for v in ("0.5", "0.25", "0.125"))
    ref = [(5, a), (10, b), (15, c)]
    run = tmp_path / "run"
    (run / "wandb_id.txt").parent.mkdir(parents=True)
    (run / "wandb_id.txt").write_text("r1\n")

    def problems(*logs: tuple[str | None, list]) -> list[str]:
        paths = [wandb_log(run / "wandb" / f"offline-run-{i}" / "run.wandb", rid, rows)
                 for i, (rid, rows) in enumerate(logs)]
        return fk.wandb_problems(ref, run, paths)

    # the killed run logged 5 and 10; the restart, resumed from a checkpoint at 5, logs 10 again (dropped)
    assert problems(("r1", [(5, a), (10, b)]), ("r1", [(10, b), (15, c)])) == []
    assert problems((None, []), ("r1", [(5, a), (10, b), (15, c)])) == []  # a SIGKILL left a log of no run
    assert problems((None, []), ("r1", [(10, b), (15, c)])) == ["wandb: steps [10, 15], the uninterrupted run's "
                                                                "[5, 10, 15]"]
    assert problems(("r1", [(5, a)]), ("r2", [(10, b), (15, c)]))[0].startswith("wandb: run ids ['r1', 'r2']")
    assert problems(("r1", [(5, a), (5, a), (10, b), (15, c)]))[0].startswith("wandb: an offline run logs a step twice")
    assert problems(("r1", [(5, a), (10, c), (15, c)])) == ["wandb: values differ at steps [10]"]


def test_fuzz_kill_events_are_what_the_run_wrote(tmp_path: Path) -> None:
    """--at event signals on what is on disk or in the log, never on a clock."""
    fk = load_script("fuzz/kill")
    assert not any(fk.reached(e, tmp_path, "") for e in fk.EVENTS)
    assert fk.reached("stage 0", tmp_path, "[kdrun] stage 0:intermediate ...")
    ckpt = tmp_path / "cache" / "teachers" / ".k.partial" / "checkpoints" / "last"
    ckpt.mkdir(parents=True)
    assert not fk.reached("teacher checkpoint", tmp_path, "")
    (ckpt / ".complete").write_text("{}")
    assert fk.reached("teacher checkpoint", tmp_path, "") and not fk.reached("teacher published", tmp_path, "")
    last = tmp_path / "run" / "checkpoints" / "last"
    last.mkdir(parents=True)
    (last / "state.json").write_text('{"global_step": 3}')
    assert fk.reached("student step 3", tmp_path, "") and not fk.reached("student step 6", tmp_path, "")
    assert fk.parse_args(["--fast"]).at == "event" and fk.parse_args([]).at == "time"


def test_fuzz_leftover_check_finds_a_process_in_a_group_of_its_own(tmp_path: Path) -> None:
    """The check the fuzz, DDP and SLURM tests end with: a grandchild whose parent has exited and
    that left the test's process group (setsid) is still found by the tag it inherited, and only it."""
    spawn = ("import subprocess; print(subprocess.Popen(['sleep', '60'], start_new_session=True, "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    env = {**os.environ, procs.TAG: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", spawn], env=env, capture_output=True, text=True, check=True)
    untagged = subprocess.Popen(["sleep", "60"])
    try:
        orphan = int(out.stdout)
        assert procs.processes_of(tmp_path) == {orphan: "sleep 60"}
        assert procs.processes_of(tmp_path / "other") == {}
    finally:
        procs.kill_all([orphan, untagged.pid])
        untagged.wait()
    assert procs.wait_gone(lambda: procs.processes_of(tmp_path), timeout=10) == {}
