"""The teacher store with several processes (2 gloo CPU processes): rank 0 decides once per stage
and the other rank follows (the same decision on both, kept in the checkpoint for a resume); a rank
waiting for rank 0 that died in the middle of the build exits with one line instead of hanging."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kdrun.runtime import forkrun
from tests.conftest import REPO, TINY, TOY
from tests.test_ddp import ARGS, torchrun
from tests.test_sweeps import env_for


def decisions(out: str) -> tuple[dict[str, str], dict[str, str]]:
    """Per stage: rank 0's decision (the key read, or 'live') and rank 1's."""
    r0, r1 = {}, {}
    for m in re.finditer(r"teacher store: stage '(\w+)' reads the teacher's \S+ \((\w+)\)", out):
        r0[m.group(1)] = m.group(2)
    for m in re.finditer(r"teacher store not used for stage '(\w+)': teacher.store=auto", out):
        r0[m.group(1)] = "live"
    for m in re.finditer(r"rank 1: teacher store for stage '(\w+)': (store (\w+)|live) \(rank 0's decision\)", out):
        r1[m.group(1)] = m.group(3) or "live"
    return r0, r1


def test_store_ddp_decision_same_on_both_ranks_and_after_resume(tmp_path: Path) -> None:
    args = [*ARGS, f"cache_dir={tmp_path}/cache", f"output_dir={tmp_path}/cut", "teacher.store=auto"]
    r = torchrun(tmp_path, *args, "train.stop_after_steps=7")  # killed 2 steps into the second stage
    out = r.stdout + r.stderr
    assert "stopped after 7 steps" in out, out[-3000:]
    r0, r1 = decisions(out)
    assert set(r0) == {"intermediate", "prediction"} and r0 == r1, (r0, r1)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "last" / "state.json").read_text())
    kept = state["store_decisions"]
    assert [k.split(":")[1] for k in kept] == ["intermediate", "prediction"]
    assert all(("live" if not d["use"] else d["key"]) == r0[k.split(":")[1]] for k, d in kept.items())
    assert all("ms/row" in d["why"] for d in kept.values())  # auto states both figures

    r = torchrun(tmp_path, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "resuming at stage 1" in r.stdout, out[-3000:]
    want = r0["prediction"] if r0["prediction"] == "live" else f"store {r0['prediction']}"
    assert f"teacher store for stage 'prediction': the checkpoint's decision ({want}:" in out
    assert f"rank 1: teacher store for stage 'prediction': the checkpoint's decision ({want}:" in out
    assert "reads the teacher's" not in out and "measured now" not in out  # nothing decided or measured again


def test_store_ddp_rank0_dies_while_building(tmp_path: Path) -> None:
    """Rank 0 is killed in the middle of the store's build (no torchrun agent to stop rank 1): rank 1
    exits within its poll interval with the line naming cache_dir."""
    common = [*TINY, *TOY, "objective=logit", f"cache_dir={tmp_path}/cache", "task.imports=[tests.slow_store_build]"]
    env = {**env_for(tmp_path), "PYTHONPATH": str(REPO)}
    warm = forkrun.run([*common, "teacher.store=off", f"output_dir={tmp_path}/warm"], env, tmp_path, 600)  # forked
    assert warm.returncode == 0, warm.stderr[-3000:]  # the teacher, cached
    port = str(29700 + os.getpid() % 1000)
    procs = []
    for rank in (0, 1):
        env = {**env_for(tmp_path), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kdrun", *common, "teacher.store=on", f"output_dir={tmp_path}/run"], cwd=tmp_path,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 300
        for line in procs[0].stdout:
            if "rank 0 is building" in line or time.monotonic() > deadline:
                break
        assert "rank 0 is building" in line
        procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[1].communicate(timeout=60)
        assert time.monotonic() - t0 < 30
        assert procs[1].returncode == 2, err[-3000:]
        assert "rank 0 stopped before publishing rank 0's teacher-store decision for stage 'logit_kd'" in err
        assert f"cache_dir={tmp_path}/cache" in err and "every node of a multi-node run must share cache_dir" in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
