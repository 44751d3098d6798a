"""train.compile over whole runs, and CUDA-graph replay semantics on the CPU.

Each objective family runs as a user runs it (``kdrun.app.run.run``, results.json read back): both
stages, >= 20 steps each over several batch widths, its balancer where it has one. Under
``train.compile=true`` every stage records at most one compilation per width and no graph break
(dynamo's own counters: the ``eager`` backend traces exactly as inductor does, without building
kernels). Under the test-only ``replayed`` step mode (kdrun.engine.compiled.StepForward) the region's
inputs are copied into static buffers and its outputs written into the same static tensors at every
call, as CUDA-graph replay does: a tensor kept from an earlier step changes under whoever kept it.
A whole run in that mode -- logged losses, the non-finite watch, MGSKD's logged parts, the student's
weights -- must equal the eager run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.test_spans import write_corpus

# The toy task's rows are 5-48 tokens; padded to multiples of 16 they fall into widths 16, 32, 48.
WIDTHS = 3
BASE = ["student.dropout=0.0", "train.num_threads=1", "train.pad_to_multiple_of=16", "task.toy.num_train=160",
        "train.epochs=1"]
FAMILIES = {
    "logit": [],
    "ckd": [],
    "ckd_gradnorm": [],  # GradNorm: its stage runs eagerly (torch.autograd.grad per term), said so
    "mgskd": ["objective.params.heads=4", "objective.params.batch_size=8"],
    "tinybert": [],
    "tinybert_official": [],
    "minilm": [],
}


def _stage_batches(name: str) -> list[str]:
    """Batches of 8 in every stage of the objective: 20 steps per stage on 160 rows."""
    if name == "mgskd":
        return []
    from tests.conftest import compose

    stages = compose([f"objective={name}"]).objective.stages
    return [f"objective.stages.{i}.batch_size=8" for i in range(len(stages))]


def _args(name: str, tmp_path: Path) -> list[str]:
    extra = [f"spans.corpus_dir={write_corpus(tmp_path / 'conll')}"] if name == "mgskd" else []
    return [f"objective={name}", *BASE, *FAMILIES[name], *_stage_batches(name), *extra]


def _run(run_cfg, tmp_path: Path, name: str, sub: str, *extra: str) -> dict:
    from kdrun.app.run import run

    run(run_cfg(*_args(name, tmp_path), *extra), tmp_path / sub)
    return json.loads((tmp_path / sub / "results.json").read_text())


def _logged(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_compiled_run_compiles_once_per_width_without_graph_breaks(name: str, run_cfg, tmp_path: Path) -> None:
    res = _run(run_cfg, tmp_path, name, "c", "train.compile=true", "train.compile_backend=eager")
    for stage in res["stages"]:
        assert stage["steps"] >= 20, stage
        assert stage["graph_breaks"] == 0, (name, stage)
        # MGSKD's span stage: one graph per (width, span-count bucket of 16)
        assert stage["compilations"] <= WIDTHS * (2 if stage["stage"] == "structural" else 1), (name, stage)
        if name == "ckd_gradnorm" and stage["stage"] != "prediction":
            assert stage["step_mode"] == "eager" and stage["compilations"] == 0
        else:
            assert stage["step_mode"] == "compiled" and stage["compilations"] >= 2, (name, stage)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", ["ckd", "mgskd", "tinybert_official", "minilm"])
def test_a_run_under_graph_replay_semantics_equals_the_eager_run(name: str, accumulate: int, run_cfg,
                                                                  tmp_path: Path, monkeypatch) -> None:
    """Both stages, several log intervals, three widths: logged losses (and MGSKD's parts), evaluations
    and the student's weights as the eager run's. Fails where anything outside the region keeps a
    region output across steps (a meter summing by reference, a term module's running sums)."""
    import kdrun.engine.compiled as compiled

    args = (f"train.gradient_accumulation_steps={accumulate}", "logger.log_every_steps=4")
    eager = _run(run_cfg, tmp_path, name, "eager", *args)
    monkeypatch.setattr(compiled, "step_mode", lambda *a, **k: "replayed")
    replayed = _run(run_cfg, tmp_path, name, "replayed", *args)
    assert [s["step_mode"] for s in replayed["stages"]] == ["replayed"] * len(replayed["stages"])
    logs = [_logged(tmp_path / d) for d in ("eager", "replayed")]
    train = [[{k: v for k, v in line.items() if k.startswith("train/") and "per_s" not in k} for line in run]
             for run in logs]
    assert len(train[0]) == len(train[1]) and sum(1 for x in train[0] if "train/loss" in x) >= 2
    for a, b in zip(*train):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7) for k in a), (a, b)
    got, want = replayed["student"]["metrics"]["validation"], eager["student"]["metrics"]["validation"]
    assert got == pytest.approx(want)
    wa, wb = (load_file(str(tmp_path / d / "student" / "model.safetensors")) for d in ("eager", "replayed"))
    diff = {k: float((wa[k] - wb[k]).abs().max()) for k in wa}
    assert max(diff.values()) < 1e-6, sorted(diff.items(), key=lambda kv: -kv[1])[:3]


def test_compile_notice_says_when_a_stage_compiles_and_each_graph_done(run_cfg, tmp_path: Path, capsys) -> None:
    res = _run(run_cfg, tmp_path, "logit", "c", "train.compile=true", "train.compile_backend=eager")
    out = capsys.readouterr().out
    assert out.count("[kdrun] train.compile: stage 'logit_kd' is compiling its step (compiled; once per batch "
                     "width) ...") == 1, out[-3000:]
    done = [line for line in out.splitlines() if "compiled its step for 8x" in line]
    assert len(done) == res["stages"][0]["compilations"] >= 2 and done[-1].endswith(
        f"({res['stages'][0]['compilations']} graph(s) so far)")
