"""kdrun-doctor --device-check on a CPU: the --fast dress rehearsal through the same code as on a GPU
(one run shared by the tests below, with a test-only check that overruns its limit), the total
budget, and a doctor killed between two checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kdrun.app import device_check
from kdrun.runtime import forkrun
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only rehearsal")


def doctor_args(out: Path, *args: str) -> list[str]:
    """``python -m kdrun.app.doctor`` ARGS of a device check writing to ``out``."""
    return ["--device-check", "--out", str(out), *args]


def doctor_cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "kdrun.app.doctor", *doctor_args(out, *args)]


def read_lines(out: Path) -> list[dict]:
    """Every line of device_check.jsonl, parsed (json.loads fails on a torn line)."""
    text = (out / device_check.JSONL).read_text()
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def dead(pid: int) -> bool:
    """No such process, or a zombie (killed and not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict], Path, float]:
    tmp = tmp_path_factory.mktemp("device-check")
    env = {**os.environ, "KDRUN_DEVICE_CHECK_EXTRA": "sleep", "KDRUN_DEVICE_CHECK_EXTRA_S": "3",
           "KDRUN_DEVICE_CHECK_EXTRA_PIDS": str(tmp / "overrun.pids")}
    t0 = time.perf_counter()
    # the doctor forked from a process that imported kdrun's libraries (kdrun.runtime.forkrun)
    proc = forkrun.run(doctor_args(tmp / "out", "--fast"), env, REPO, 600, module="kdrun.app.doctor")
    return proc, read_lines(tmp / "out"), tmp, time.perf_counter() - t0


def by_name(lines: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in lines}


def test_every_planned_check_has_one_line_in_order_and_a_table_row(rehearsal) -> None:
    proc, lines, _, _ = rehearsal
    want = ["meta", "environment", "overrun", *[s.name for s in device_check.planned(True, None)[1:]]]
    assert [r["name"] for r in lines] == want, proc.stdout[-3000:]
    assert "step tinybert eager" not in want and "doctor" not in want  # left out of --fast
    for r in lines[1:]:
        assert set(r) == {"name", "status", "figures", "seconds"}
        assert f"| {r['name']:<22} | {r['status']:<7} | {r['seconds']:>6.1f} |" in proc.stdout
    assert lines[0]["figures"]["fast"] is True and "--fast" in lines[0]["figures"]["command"]


def test_the_overrun_is_killed_with_its_grandchild_and_the_others_pass(rehearsal) -> None:
    proc, lines, tmp, _ = rehearsal
    rows = by_name(lines)
    over = rows["overrun"]
    assert over["status"] == "timeout" and 3.0 <= over["seconds"] < 10.0, over
    assert "killed with its process group after 3 s" in over["figures"]["reason"]
    pids = [int(p) for p in (tmp / "overrun.pids").read_text().split()]
    assert len(pids) == 2  # the check's process and the sleep it started
    assert all(dead(p) for p in pids), [Path(f"/proc/{p}/stat").read_text() for p in pids if not dead(p)]
    assert proc.returncode == 1  # the timeout counts as a failure
    assert "0 failed, 1 timed out" in proc.stdout.splitlines()[-1]
    others = [r for r in lines[1:] if r["name"] != "overrun"]
    assert {r["status"] for r in others} <= {"pass", "skip"}, [r for r in others if r["status"] not in ("pass", "skip")]


def test_cuda_only_checks_are_recorded_as_skipped(rehearsal) -> None:
    _, lines, _, _ = rehearsal
    skipped = {r["name"] for r in lines if r["status"] == "skip"}
    assert skipped == {"step logit graphed", "step ckd graphed", "run graphed", "syncs", "step mgskd graphed",
                       "fp16 skip"}
    assert all(r["figures"] == {"reason": "needs CUDA"} and r["seconds"] == 0.0 for r in lines
               if r["name"] in skipped)


def test_step_rows_hold_consistent_throughput_and_flops(rehearsal) -> None:
    _, lines, _, _ = rehearsal
    rows = by_name(lines)
    for name in ("step logit eager", "step ckd eager", "step logit compiled", "step ckd compiled", "step mgskd eager"):
        f = rows[name]["figures"]
        assert f["shape"]["batch"] * f["shape"]["tokens"] == 64  # the tiny shape: 4 x 16 tokens
        assert f["tokens_per_s"] == pytest.approx(64 * 1e3 / f["ms_per_step"], rel=1e-9)
        assert f["achieved_tflop_s"] == pytest.approx(f["model_tflop_per_step"] / (f["ms_per_step"] / 1e3), rel=1e-9)
        assert f["peak_fraction"] is None and f["precision"] == "fp32" and f["loss_finite"] is True
    eager, compiled = rows["step ckd eager"]["figures"], rows["step ckd compiled"]["figures"]
    assert eager["model_tflop_per_step"] == compiled["model_tflop_per_step"] > 0
    assert eager["ops_per_step"] > 100 and compiled["ops_per_step"] is None
    assert compiled["compilations"] >= 1 and compiled["backend"] == "aot_eager"


def test_exactness_and_runs(rehearsal) -> None:
    _, lines, _, _ = rehearsal
    rows = by_name(lines)
    for name in ("exact ckd", "exact mgskd"):
        for mode in ("eager", "compiled"):
            row = rows[name]["figures"]["rows"][mode]
            assert row["status"] == "pass" and row["grad_norm_rel_diff"] <= 2e-2 and row["grad_count"] > 1000
    eager, compiled = rows["run eager"]["figures"], rows["run compiled"]["figures"]
    assert [s["steps"] for s in eager["stages"]] == [30] and eager["compilations"] == 0
    assert compiled["compilations"] >= 1 and compiled["graph_breaks"] == 0
    assert "train.compile=true" in compiled["overrides"]
    assert rows["tiny fp16"]["figures"]["precision"] == "fp16"
    assert "model.onnx" in rows["export"]["figures"]["files"]


def test_the_fast_rehearsal_fits_three_minutes(rehearsal) -> None:
    *_, seconds = rehearsal
    assert seconds < 240, seconds  # under 180 s on an idle 2-core CPU; slack for a loaded one


def test_a_check_gets_what_is_left_of_the_budget_and_later_ones_are_skipped(tmp_path: Path) -> None:
    """The test-only check that never ends, under a limit (60 s) above the budget (8 s): killed when the
    budget runs out, whatever the machine's speed; the checks after it are not started."""
    env = {**os.environ, "KDRUN_DEVICE_CHECK_EXTRA": "sleep", "KDRUN_DEVICE_CHECK_EXTRA_S": "60",
           "KDRUN_DEVICE_CHECK_EXTRA_PIDS": str(tmp_path / "overrun.pids")}
    proc = forkrun.run(doctor_args(tmp_path, "--fast", "--budget-s", "8", "--checks", "environment,overrun,exact"),
                       env, REPO, 120, module="kdrun.app.doctor")
    lines = read_lines(tmp_path)
    assert [(r["name"], r["status"]) for r in lines] == [
        ("meta", "pass"), ("environment", "pass"), ("overrun", "timeout"), ("exact ckd", "skip"),
        ("exact mgskd", "skip")], proc.stdout
    over = lines[2]
    assert over["seconds"] < 8.0 and "budget left when it started" in over["figures"]["reason"]
    assert all(r["figures"]["reason"].startswith("not started: ") for r in lines[3:]) and proc.returncode == 1


def test_a_killed_doctor_leaves_valid_lines_and_no_check_running(tmp_path: Path) -> None:
    mark = f"KDRUN_TEST_MARK={tmp_path}".encode()  # inherited by every process the doctor starts
    doc = subprocess.Popen(doctor_cmd(tmp_path, "--fast", "--checks", "environment,run eager"), cwd=REPO,
                           env={**os.environ, "KDRUN_TEST_MARK": str(tmp_path)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    jsonl = tmp_path / device_check.JSONL
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not jsonl.exists() or jsonl.read_text().count("\n") < 2):
        time.sleep(0.1)
    while time.monotonic() < deadline and len(marked(mark)) < 3:
        time.sleep(0.2)  # the next check (run eager) has started its kdrun run
    assert len(marked(mark)) >= 3, "the doctor, its check and the check's kdrun run should be running"
    doc.send_signal(signal.SIGKILL)
    doc.wait()
    assert [r["name"] for r in read_lines(tmp_path)] == ["meta", "environment"]
    time.sleep(1.0)
    assert marked(mark) == []  # the check and its run died with the doctor (PR_SET_PDEATHSIG)


def marked(mark: bytes) -> list[int]:
    """The live processes whose environment holds ``mark``."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and mark in (p / "environ").read_bytes().split(b"\0") and not dead(int(p.name)):
                out.append(int(p.name))
        except OSError:
            continue
    return out


def test_device_check_needs_an_out_folder_and_known_check_names(tmp_path: Path) -> None:
    from kdrun.app import doctor

    with pytest.raises(SystemExit, match="--out DIR is required"):
        doctor.main(["--device-check"])
    with pytest.raises(SystemExit, match="--checks nosuch: no such check; the checks are: environment, "):
        doctor.main(["--device-check", "--out", str(tmp_path), "--checks", "nosuch"])
