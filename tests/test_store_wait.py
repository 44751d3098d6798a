"""Waiting for rank 0's cache entry or decision: a dead builder (its lock freed, nothing published),
a builder never seen (another node's cache_dir), a timeout and a termination signal each end the
wait with one line or an exit, instead of waiting for ever."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdrun.errors import UserError
from kdrun.runtime.cache import wait_for_entry, wait_for_file

HOLD = "import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(float(sys.argv[2]))"  # noqa: E501


def holder(lock: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_store_wait_ends_when_the_builder_dies(tmp_path: Path) -> None:
    p = holder(tmp_path / "k.lock", 1.5)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"rank 0 stopped before publishing .* in cache_dir=.*every node"):
        wait_for_entry(tmp_path, "", "k", poll_s=0.1, timeout_s=60)
    assert 1.0 < time.monotonic() - t0 < 10
    p.wait()


def test_store_wait_for_a_builder_never_seen_gives_up_after_the_grace(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(UserError, match="every node of a multi-node run must share cache_dir"):
        wait_for_file(tmp_path / "d.json", tmp_path / "d.lock", tmp_path, "a decision", poll_s=0.1, grace_s=0.5)
    assert time.monotonic() - t0 < 5


def test_store_wait_times_out_and_a_signal_exits(tmp_path: Path) -> None:
    p = holder(tmp_path / "d.lock", 30)
    try:
        with pytest.raises(UserError, match=r"waited 1 s for a decision .*cache_wait_timeout_s"):
            wait_for_file(tmp_path / "d.json", tmp_path / "d.lock", tmp_path, "a decision", timeout_s=1, poll_s=0.1)
        with pytest.raises(SystemExit) as e:
            wait_for_file(tmp_path / "d.json", tmp_path / "d.lock", tmp_path, "a decision", poll_s=0.1,
                          stop=lambda: 15)
        assert e.value.code == 143
        (tmp_path / "d.json").write_text("{}")
        assert wait_for_file(tmp_path / "d.json", tmp_path / "d.lock", tmp_path, "a decision") == tmp_path / "d.json"
    finally:
        p.kill()
        p.wait()
