"""kdrun-cache: list, verify (and --fix), gc of set-aside entries and abandoned builds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from filelock import FileLock

from kdrun.runtime.cache import COMPLETE_MARKER, write_manifest
from kdrun.runtime.cache_cli import main, parse_age

DAY = 86400


def make_entry(path: Path, content: bytes = b"x" * 100, manifest: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(content)
    if manifest:
        write_manifest(path)
    return path


def age_tree(path: Path, days: float) -> None:
    t = time.time() - days * DAY
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    make_entry(root / "teachers" / "good")
    bad = make_entry(root / "teachers" / "bad")
    (bad / "data.bin").write_bytes(b"y" * 100)  # same size, other bytes: only the checksum tells
    age_tree(make_entry(root / "teachers" / ".damaged" / "old-20260101", b"z" * 5000, manifest=False), 30)
    age_tree(make_entry(root / "tokenized" / ".k1.partial", b"p" * 300, manifest=False), 10)  # abandoned
    make_entry(root / "tokenized" / ".k2.partial", manifest=False)  # fresh: a build may be at work
    age_tree(make_entry(root / "tokenized" / ".k3.tmp-abc", manifest=False), 10)  # old, but its writer holds the lock
    return root


def test_list_shows_every_item_and_its_state(cache: Path, capsys) -> None:
    assert main(["--cache-dir", str(cache), "list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith(("teachers", "tokenized"))}
    assert set(lines) == {"good", "bad", "old-20260101", "k1", "k2", "k3"}
    assert "set aside" in lines["old-20260101"] and "4.9 KiB" in lines["old-20260101"]
    assert "unfinished" in lines["k1"] and "(not checked)" in lines["bad"]
    assert "6 item(s)" in out
    head = out.splitlines()[0]
    assert head.split() == ["kind", "key", "size", "last", "use", "made", "by", "run", "state"]
    # the columns line up under the header; these entries, made by hand, record no run (—)
    assert lines["old-20260101"][head.index("made by run"):].startswith("—  ")
    assert lines["old-20260101"][head.index("last use"):].startswith("30.0d ago")
    assert lines["k1"][head.index("state"):] == "unfinished"


def test_cache_cli_takes_cache_dir_after_the_command_and_ls_is_list(cache: Path, tmp_path: Path, capsys) -> None:
    assert main(["--cache-dir", str(cache), "list"]) == 0
    before = capsys.readouterr().out
    assert main(["list", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out == before
    assert main(["ls", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out == before
    # after the command wins over before it; given only before, it stays
    assert main(["--cache-dir", str(tmp_path / "nope"), "ls", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out == before
    assert main(["verify", "--cache-dir", str(cache)]) == 1 and "1/2 entries verify" in capsys.readouterr().out
    assert main(["gc", "--cache-dir", str(cache), "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and (cache / "tokenized" / ".k1.partial").exists()
    assert main(["--cache-dir", str(tmp_path / "nope"), "ls"]) == 2


def test_verify_finds_the_changed_byte_and_fix_moves_it_aside(cache: Path, capsys) -> None:
    assert main(["--cache-dir", str(cache), "verify"]) == 1
    out = capsys.readouterr().out
    assert "damaged: " in out and "bad: data.bin does not match its checksum" in out and "1/2 entries verify" in out
    assert main(["--cache-dir", str(cache), "verify", "--fix"]) == 0
    assert not (cache / "teachers" / "bad").exists()
    assert any(p.name.startswith("bad-") for p in (cache / "teachers" / ".damaged").iterdir())
    assert main(["--cache-dir", str(cache), "verify"]) == 0 and "1/1 entries verify" in capsys.readouterr().out
    (cache / "teachers" / "good" / COMPLETE_MARKER).unlink()
    assert main(["--cache-dir", str(cache), "verify"]) == 1  # a published entry without its manifest


def test_gc_removes_only_old_set_aside_and_abandoned_builds(cache: Path, capsys) -> None:
    with FileLock(str(cache / "tokenized" / "k3.lock")):
        assert main(["--cache-dir", str(cache), "gc", "--older-than", "7d", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert out.count("would remove") == 2 and "old-20260101" in out and ".k1.partial" in out
        assert (cache / "tokenized" / ".k1.partial").exists()  # a dry run removes nothing
        assert main(["--cache-dir", str(cache), "gc", "--older-than", "7d"]) == 0
    assert not (cache / "tokenized" / ".k1.partial").exists()
    assert not (cache / "teachers" / ".damaged" / "old-20260101").exists()
    kept = [cache / "teachers" / "good", cache / "teachers" / "bad", cache / "tokenized" / ".k2.partial",
            cache / "tokenized" / ".k3.tmp-abc"]
    assert all(p.exists() for p in kept)
    assert "freed 5.2 KiB in 2 item(s)" in capsys.readouterr().out
    assert main(["--cache-dir", str(cache), "gc", "--older-than", "0s"]) == 0  # lock free now: k2, k3 go too
    assert not (cache / "tokenized" / ".k3.tmp-abc").exists() and (cache / "teachers" / "good").exists()


def test_ages_and_a_missing_cache_are_clear(tmp_path: Path, capsys) -> None:
    assert parse_age("7d") == 7 * DAY and parse_age("12h") == 12 * 3600 and parse_age("2") == 2 * DAY
    with pytest.raises(Exception, match="give a number and a unit"):
        parse_age("a week")
    assert main(["--cache-dir", str(tmp_path / "nope"), "list"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_gc_max_size_evicts_least_recently_used_entries_not_in_use(tmp_path: Path, capsys) -> None:
    import fcntl

    from kdrun.runtime.cache import get_or_build
    from kdrun.runtime.cache_cli import evict_to_size, parse_size

    root = tmp_path / "cache"
    kib = 1024
    for name, days in (("old", 30), ("held", 20), ("mid", 10), ("new", 1)):
        age_tree(make_entry(root / "teacher_outputs" / name, b"x" * (100 * kib)), days)
    (root / "teacher_outputs" / "gone.lock").touch()  # a lock file nobody holds, left by an old build
    age_tree(root / "teacher_outputs" / "gone.lock", 30)
    # a run that reads "held" holds a shared lock on its manifest; "mid" was just used (its time renewed)
    fd = os.open(root / "teacher_outputs" / "held" / COMPLETE_MARKER, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    assert get_or_build(root, "teacher_outputs", "mid", lambda tmp: None, checksums=False)[1]
    try:
        assert main(["--cache-dir", str(root), "gc", "--max-size", "250K", "--dry-run"]) == 0
        assert all((root / "teacher_outputs" / n).exists() for n in ("old", "held", "mid", "new"))
        assert main(["--cache-dir", str(root), "gc", "--max-size", "250K"]) == 0
        out = capsys.readouterr().out
        # least recently used first: old goes, held is in use, then new (mid was used after it)
        assert "in use by a running process" in out
        left = sorted(p.name for p in (root / "teacher_outputs").iterdir())
        assert left == ["held", "mid"], left
    finally:
        os.close(fd)
    assert evict_to_size(root, 150 * kib / 2**30) and sorted(p.name for p in (root / "teacher_outputs").iterdir()) \
        == ["mid"]
    assert parse_size("50G") == 50 * 2**30 and parse_size("1.5m") == int(1.5 * 2**20) and parse_size("3") == 3 * 2**30
    with pytest.raises(Exception, match="give a number and a unit"):
        parse_size("lots")


def test_cache_max_gb_bounds_the_cache_after_a_run(tmp_path: Path) -> None:
    import io
    from contextlib import redirect_stdout

    from kdrun.app.run import run
    from tests.conftest import TINY, TOY, compose

    root = tmp_path / "cache"
    age_tree(make_entry(root / "tokenized" / "stale", b"x" * 2**20), 30)  # 1 MiB, not used for a month
    with redirect_stdout(io.StringIO()):
        run(compose([*TINY, *TOY, "objective=logit", f"cache_dir={root}", "cache_max_gb=0.0005"]), tmp_path / "r")
    assert not (root / "tokenized" / "stale").exists()
    assert any((root / "teachers").iterdir())  # this run's teacher (recently used, small) stays


def test_cache_cli_list_names_the_run_that_built_an_entry(run_cfg, cache_dir: Path, tmp_path: Path, capsys) -> None:
    from kdrun.app.run import run

    rd = tmp_path / "r"
    run(run_cfg("objective=logit", "report.cost=false"), rd)  # the teacher and its outputs: entries of this run
    capsys.readouterr()
    assert main(["list", "--cache-dir", str(cache_dir)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert rows and all(str(rd.resolve()) in row for row in rows), rows
