"""The fuzz scripts in their fast modes: a few signals at random moments, every run compared with
the uninterrupted one after one restart that resumed from the checkpoint on disk, also with one
of two DDP processes killed; damaged cache entries, checkpoints (last, best) and a killed teacher
build's directory (README "Reliability in figures" states the full counts)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.conftest import load_script


@pytest.mark.parametrize("sig,runs", [("KILL", 2), ("TERM", 1)])
def test_fuzz_kill_fast(tmp_path: Path, sig: str, runs: int) -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz_kill").main(["--fast", "--runs", str(runs), "--signal", sig, "--seed", "1",
                                            "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["passed"] == res["counted"] == runs and not res["failures"], buf.getvalue()
    assert f"{runs}/{runs} passed" in buf.getvalue()


def test_fuzz_kill_ddp_rank_fast(tmp_path: Path) -> None:
    """Two processes under torchrun; SIGKILL to rank 1 alone; one restart ends identically."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz_kill").main(["--fast", "--ddp", "--runs", "1", "--seed", "4", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["passed"] == res["counted"] == 1 and res["ddp"], buf.getvalue()


def test_fuzz_kill_judges_the_restart() -> None:
    """A run passes only when its one restart resumed from the checkpoint on disk (or later)."""
    fk = load_script("fuzz_kill")
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


def test_fuzz_kill_reads_a_checkpoint_left_by_a_cut_swap(tmp_path: Path) -> None:
    fk = load_script("fuzz_kill")
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

    fk = load_script("fuzz_kill")
    a = {"weights": {"w": torch.zeros(2)}, "metrics": {"student": 0.5}, "log": [{"train/loss": 1.0}]}
    assert fk.same(a, a) == []
    b = {**a, "weights": {"w": torch.tensor([0.0, 1e-7])}}
    assert fk.same(a, b) == ["student weights"]
    assert fk.same(a, {**a, "log": [{"train/loss": 1.0000001}]}) == ["metrics.jsonl"]


def test_fuzz_damage_fast(tmp_path: Path) -> None:
    """A few damaged files per scenario, each rerun: nothing is used silently."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz_damage").main(["--fast", "--per-scenario", "2", "--seed", "3", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_damage.json").read_text())
    assert rc == 0, buf.getvalue()
    assert {t["scenario"] for t in res["trials"]} == {"task", "partial", "augment", "spans", "corpus"}
    assert res["counts"].get("silently used", 0) == 0 and "0 silently used" in buf.getvalue()
    assert sum(res["counts"].get(k, 0) for k in ("rebuilt", "refused")) >= 9


def test_fuzz_damage_damages_and_classifies(tmp_path: Path) -> None:
    fd = load_script("fuzz_damage")
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


def test_fuzz_faults_fast(tmp_path: Path) -> None:
    """A NaN at a random step, three racing builders, a full run directory and a full cache (tmpfs,
    where the tests may mount one)."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz_faults").main(["--fast", "--seed", "2", "--out", str(tmp_path)])
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
