"""kdrun-doctor on a CPU-only machine (one --quick run shared by the tests below), its exit status
and JSON writing, and scripts/bench/engine.py --fast."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from kdrun.app import doctor, doctor_steps
from kdrun.runtime import forkrun
from tests.conftest import REPO

PRECISIONS = ("fp32", "bf16", "fp16")
STEP_LINE = re.compile(r"^\[(pass|fail)\] step (\w+) (fp32|bf16|fp16): .*rel diff ([0-9.e+-]+) ")


def labelled_objectives() -> list[str]:
    """conf/objective/ without the corpus-only (general distillation, masked-LM) objectives."""
    names = sorted(p.stem for p in (REPO / "conf" / "objective").glob("*.yaml"))
    return [n for n in names if not n.endswith("_general") and n != "mlm_ckd"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("doctor") / "d.json"
    # forked from a process that imported kdrun's libraries (kdrun.runtime.forkrun)
    proc = forkrun.run(["--quick", "--out", str(out)], None, REPO, 600, module="kdrun.app.doctor")
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("[")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_quick_run_on_cpu_passes_skips_nccl_and_checks_gloo(quick_run) -> None:
    proc, report = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _lines(proc)
    assert "[info] cuda: CUDA available: no" in lines
    assert "[skip] NCCL all-reduce: skipped, CUDA is absent" in lines
    assert any(line.startswith("[pass] gloo all-reduce: 2 processes, every rank got the sum 3") for line in lines)
    assert "[info] train.precision=auto: resolves to fp32 on cpu" in lines
    assert report["ok"] is True and report["device"] == "cpu" and report["quick"] is True


def test_every_objective_and_precision_has_a_row_with_a_relative_difference(quick_run) -> None:
    proc, report = quick_run
    rows = {(c["data"]["objective"], c["data"]["precision"]): c for c in report["checks"]
            if c["name"].startswith("step ")}
    precisions = PRECISIONS if not torch.cuda.is_available() else {c["data"]["precision"] for c in rows.values()}
    want = {(o, p) for o in labelled_objectives() for p in precisions}
    assert set(rows) == want
    for (_, prec), c in rows.items():
        rel = c["data"]["rel_diff"]
        assert isinstance(rel, float) and math.isfinite(rel), c
        assert c["status"] == "pass" and c["data"]["grads_finite"], c
        if prec == "fp32":
            assert rel == 0.0  # the reference itself
        assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in c["data"]["stages"])


def test_json_matches_the_printed_report(quick_run) -> None:
    proc, report = quick_run
    assert _lines(proc) == [c["line"] for c in report["checks"]]
    printed = {(m[2], m[3]): float(m[4]) for m in map(STEP_LINE.match, _lines(proc)) if m}
    assert len(printed) == len(labelled_objectives()) * len(PRECISIONS)
    for c in report["checks"]:
        if c["name"].startswith("step "):
            key = (c["data"]["objective"], c["data"]["precision"])
            assert printed[key] == pytest.approx(c["data"]["rel_diff"], rel=1e-2, abs=1e-12)
    counts = report["counts"]
    summary = f"({counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped)"
    assert summary in proc.stdout.splitlines()[-1]
    bench = [c for c in report["checks"] if c["name"].startswith("throughput ")]
    assert [c["data"]["objective"] for c in bench] == ["logit", "ckd"]
    for c in bench:
        assert c["data"]["tokens_per_s"] > 0 and c["data"]["peak_bytes"] > 0
        assert f"{c['data']['tokens_per_s']:.0f} tokens/s" in c["line"]
        assert c["data"]["ops_per_step"] > 100 and f", {c['data']['ops_per_step']} ATen ops, " in c["line"]


def test_exit_status_is_one_when_a_check_fails(tmp_path: Path, monkeypatch) -> None:
    def failing(report, *args):
        report.add("gloo all-reduce", "fail", "simulated")

    monkeypatch.setattr(doctor, "check_collectives", failing)
    monkeypatch.setattr(doctor, "check_precision_steps", lambda report, device: None)
    monkeypatch.setattr(doctor, "check_throughput", lambda report, quick, device: None)
    out = tmp_path / "sub" / "d.json"
    assert doctor.main(["--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["counts"]["fail"] == 1
    assert [p.name for p in out.parent.iterdir()] == ["d.json"]  # no temporary file left


def test_judge_applies_the_tolerance_and_finiteness() -> None:
    ref = [doctor_steps.StepResult(1.0, True, True, 1.0, 0)]
    assert doctor_steps.judge("bf16", [doctor_steps.StepResult(1.04, True, True, 1.0, 0)], ref)[0]
    assert doctor_steps.judge("bf16", [doctor_steps.StepResult(1.2, True, True, 1.0, 0)], ref)[:1] == (False,)
    step = doctor_steps.StepResult
    assert doctor_steps.judge("fp16", [step(1.0, True, False, math.inf, 8)], ref)[2] == "non-finite gradients"
    assert doctor_steps.judge("no", [step(math.nan, False, True, 1.0, 0)], ref)[2] == "non-finite loss"


def test_fixed_batch_spans_stay_inside_each_row() -> None:
    b = doctor_steps.fixed_batch(4, 16, 100)
    lengths = b["attention_mask"].sum(1)
    real = b["spans"][..., 0] >= 0
    assert (real.sum(1) >= 3).all()  # MGSKD's span level needs 3 spans per example
    assert (b["spans"][..., 1][real] <= lengths[:, None].expand_as(real)[real]).all()


def test_bench_engine_fast_prints_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = forkrun.run(["--fast", "--json", str(out)], None, REPO, 300, script="scripts/bench/engine.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for prec in ("fp32", "bf16"):
        assert re.search(rf"\(a\) objective=ckd, {prec}: .*\n(.*\n){{3}}throughput ratio kdrun / naive: \d+\.\d\dx",
                         proc.stdout), prec
        assert re.search(rf"\(b\) {prec}, syncs per step: kdrun \d+(\.\d+)?, naive \d+", proc.stdout), prec
    for name in ("ckd", "ckd_official", "mgskd", "minilm", "tinybert"):
        assert re.search(rf"^{name}\s+\d+\.\d ms  ratio \d+\.\d{{3}}x", proc.stdout, re.M), name
    res = json.loads(out.read_text())
    # the naive step reads the loss, every term and the token count on the host; kdrun's step none of them
    for r in res["engine_vs_naive"].values():
        assert r["naive"]["syncs_per_step"] >= r["kdrun"]["syncs_per_step"] + 4


def test_precision_student_kinds_each_step_with_fp32_master_weights(quick_run) -> None:
    """A row per student kind (truncated first) and mixed precision, built as a run builds it."""
    proc, report = quick_run
    rows = [c for c in report["checks"] if c["name"].startswith("student ") and "precision" in c["data"]]
    kinds = list(dict.fromkeys(c["data"]["student_kind"] for c in rows))
    assert kinds == ["truncated", "pretrained (bf16 checkpoint)", "random", "corpus"]
    assert {c["data"]["precision"] for c in rows} == ({"bf16", "fp16"} if not torch.cuda.is_available()
                                                       else {c["data"]["precision"] for c in rows})
    assert all(c["status"] == "pass" and "fp32 master weights" in c["detail"] for c in rows), rows


def test_precision_student_check_fails_on_bf16_master_weights() -> None:
    """The judge fails a step made on bf16 parameters (the updates round away) and names why."""
    from kdrun.app.doctor_students import judge_step

    torch.manual_seed(0)
    w = torch.randn(2048) * 0.05
    update = torch.full_like(w, 5e-5) * torch.sign(torch.randn(2048))
    ref = {"delta": (w + update) - w, "dtypes": {"torch.float32"}}
    w16 = w.to(torch.bfloat16)
    lost = {"delta": ((w16 + update.to(torch.bfloat16)).float() - w16.float()), "dtypes": {"torch.float32"}}
    ok, detail = judge_step(lost, ref)
    assert not ok and "lost to rounding" in detail
    assert not judge_step({**ref, "dtypes": {"torch.bfloat16"}}, ref)[0]
    assert judge_step(ref, ref)[0]


def test_device_rows_on_a_gpu_do_not_collide_with_the_check_name(monkeypatch) -> None:
    """On a machine with GPUs the environment check adds one row per device; its data once had a
    ``name`` key, which collided with Report.add's own argument (a TypeError on every GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    report = doctor.Report()
    try:
        doctor.check_environment(report)
    except Exception as e:  # noqa: BLE001 - later CUDA calls fail on a CPU machine; the rows before them count
        assert "name" not in str(e), e
    row = next(c for c in report.checks if c.name == "device 0")
    assert row.data == {"device_name": "Test GPU", "capability": [9, 0]}


def test_student_kind_steps_move_each_batch_to_the_runs_device(monkeypatch, tmp_path: Path) -> None:
    """The student-kind check feeds the engine's step batches on the run's device, as the trainer
    does (on a GPU the batches once stayed on the CPU: index_select across devices)."""
    from kdrun.app import doctor_students
    from kdrun.engine import trainer

    moved, seen = [], []

    def fake_to_device(batch, device):
        moved.append(str(device))
        return {**batch, "placed": True}

    session, parts = doctor_students.build_run(doctor_students.kind_overrides("random", tmp_path, None, None)
                                               + [f"cache_dir={tmp_path}/cache"], tmp_path / "run")
    monkeypatch.setattr(trainer, "to_device", fake_to_device)
    monkeypatch.setattr(trainer, "train_step", lambda parts, loop, batch, state: seen.append(batch))
    doctor_students.first_steps(parts, session.pre.plans[0], max_steps=2)
    assert seen and all(b.get("placed") for b in seen)
    assert moved == [str(parts.accelerator.device)] * len(seen)


def _no_checks(monkeypatch) -> None:
    from kdrun.app import doctor_students

    monkeypatch.setattr(doctor, "check_collectives", lambda report, device: None)
    monkeypatch.setattr(doctor_students, "check_student_kinds", lambda report, device, precisions: None)
    monkeypatch.setattr(doctor, "check_precision_steps", lambda report, device: None)
    monkeypatch.setattr(doctor, "check_throughput", lambda report, quick, device: None)


def test_doctor_writes_its_report_in_the_cache_dir_as_the_docs_say(tmp_path: Path, monkeypatch, capsys) -> None:
    _no_checks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KDRUN_CACHE_DIR", str(tmp_path / "cache"))
    assert doctor.main([]) == 0
    out = tmp_path / "cache" / "kdrun-doctor.json"
    assert json.loads(out.read_text())["ok"] is True
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"report: {out}")
    assert not (tmp_path / "kdrun-doctor.json").exists()  # nothing in the working directory
    assert doctor.main(["--out", "here.json"]) == 0 and (tmp_path / "here.json").is_file()


def test_doctor_without_a_writable_cache_dir_uses_a_temporary_directory_as_the_docs_say(tmp_path: Path, monkeypatch,
                                                                         capsys) -> None:
    _no_checks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KDRUN_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: cannot exist
    monkeypatch.setattr(doctor.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert doctor.main([]) == 0
    written = list((tmp_path / "tmp").glob("kdrun-doctor-*/kdrun-doctor.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["ok"] is True
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"report: {written[0]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "tmp"]


def test_doctor_help_speaks_of_checks_as_the_docs_do(capsys) -> None:
    with pytest.raises(SystemExit):
        doctor.parse_args(["--help"])
    text = capsys.readouterr().out
    for check in ("environment", "all-reduce", "student kinds", "objectives", "throughput"):
        assert re.search(rf"^  {check} ", text, re.M), check
    assert not re.findall(r"kdrun\.\w+|doctor_\w+", text)  # no module names
    assert "kdrun-doctor.json in the cache directory" in " ".join(text.split())
