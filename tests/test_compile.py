"""train.compile: each training step's forward region -- the student's forward, the live teacher's and
the objective's loss (kdrun.engine.compiled.forward_loss) -- runs as one torch.compile graph: no graph
break for any objective family, one compilation per batch width (train.pad_to_multiple_of), and the
same numbers as eager. kdrun's feature hooks (Q/K/V capture) are registered once, before tracing.
The ``eager`` / ``aot_eager`` backends keep the arithmetic; inductor needs a C++ compiler and is the
default for users (its figures: scripts/bench/compile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdrun.app.doctor_steps import (
    TINY_STUDENT,
    TINY_TEACHER,
    EngineStep,
    compose_objectives,
    fixed_batch,
    objective_models,
)
from kdrun.engine.compiled import StepForward, step_mode
from kdrun.errors import ConfigError
from kdrun.tasks.data.batches import bucket_width, resolve_pad_multiple

# every family of loss terms: logits, hidden states (pkd, alp, distilbert), attention (minilm,
# tinybert), Q/K/V relations (minilmv2), CKD's and MGSKD's relations, GradNorm's balancing
FAMILIES = ["finetune", "logit", "pkd", "alp", "distilbert", "minilm", "minilmv2", "tinybert",
            "tinybert_official", "ckd", "ckd_official", "ckd_gradnorm", "mgskd", "comb"]


@pytest.fixture(scope="module")
def objectives():
    return compose_objectives(FAMILIES)


def engine_step(cfg, mode: str, backend: str = "eager", stage: int = 0) -> EngineStep:
    plans, models = objective_models(cfg, TINY_TEACHER, TINY_STUDENT)
    step = EngineStep(models, plans[stage], "no", "cpu", cfg.train, Path("."), record_grads=False)
    step.loop.forward = StepForward(step.parts, plans[stage], mode, backend)
    return step


@pytest.mark.parametrize("name", FAMILIES)
def test_the_step_region_compiles_without_a_graph_break(objectives, name: str) -> None:
    torch._dynamo.reset()
    step = engine_step(objectives[name], "compiled")
    forward = step.loop.forward
    explained = torch._dynamo.explain(forward._region)(fixed_batch(4, 16, 100), None)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


def test_one_compilation_per_width_and_the_same_losses_as_eager(objectives) -> None:
    """Ragged batches over three widths (and an epoch's short last batch, run eagerly): three graphs,
    reused when a width comes back; losses and updated weights equal to the eager step's."""
    torch._dynamo.reset()
    shapes = [(8, 16), (8, 32), (8, 16), (8, 48), (8, 32), (3, 32), (8, 48)]
    runs = {}
    for mode in ("eager", "compiled"):
        step = engine_step(objectives["ckd"], mode, backend="aot_eager")
        torch.manual_seed(0)
        losses = [float(step(fixed_batch(b, n, 100, seed=i))) for i, (b, n) in enumerate(shapes)]
        runs[mode] = (losses, step.parts.student.state_dict(), step.loop.forward.compilations)
    (eager, w_eager, none), (compiled, w_compiled, graphs) = runs["eager"], runs["compiled"]
    assert none == 0 and graphs == 3
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-7)
    assert all(torch.allclose(w_eager[k], w_compiled[k], atol=1e-6) for k in w_eager)


def test_objectives_compiled_one_after_another_keep_their_own_hooks(objectives) -> None:
    """A relation objective's compiled step, then TinyBERT's (Q/K scores from hooks) and MiniLM's in
    the same process: each region traces its own models' hooks and equals its eager step."""
    torch._dynamo.reset()
    for name in ("ckd", "tinybert", "minilm", "mgskd"):
        losses = []
        for mode in ("eager", "compiled"):
            step = engine_step(objectives[name], mode)
            torch.manual_seed(0)
            losses.append([float(step(fixed_batch(4, 16, 100, seed=s))) for s in range(2)])
        assert losses[1] == pytest.approx(losses[0], rel=1e-6), name


def test_compiled_run_equals_uncompiled(run_cfg, tmp_path: Path) -> None:
    from kdrun.app.run import run

    args = ("objective=minilmv2", "objective.params.relation_heads=4", "student.dropout=0.0", "train.epochs=1",
            "train.pad_to_multiple_of=16")
    plain = run(run_cfg(*args), tmp_path / "plain")
    compiled = run(run_cfg(*args, "train.compile=true", "train.compile_backend=eager"), tmp_path / "compiled")
    assert compiled["student"]["metrics"] == plain["student"]["metrics"]
    a = load_file(str(tmp_path / "plain" / "student" / "model.safetensors"))
    b = load_file(str(tmp_path / "compiled" / "student" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    logs = [json.loads(x) for x in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/minilmv2_qq" in x for x in logs)  # the hooked Q/K/V reached the loss
    stage = compiled["stages"][0]
    # the toy task's rows are at most 48 tokens: widths 16, 32 and 48, one graph each at most
    assert stage["step_mode"] == "compiled" and 1 <= stage["compilations"] <= 3
    assert plain["stages"][0]["step_mode"] == "eager" and plain["stages"][0]["compilations"] == 0


def test_a_random_layer_map_runs_eagerly_under_compile(run_cfg, tmp_path: Path, caplog) -> None:
    from kdrun.app.run import run

    res = run(run_cfg("objective=pkd", "mapping=random", "train.epochs=1", "train.compile=true",
                      "train.compile_backend=eager", "task.toy.num_train=64"), tmp_path / "r")
    assert res["stages"][0]["step_mode"] == "eager" and res["stages"][0]["compilations"] == 0
    assert "runs eagerly: its layer map redraws its pairs every step" in caplog.text


def test_compiled_model_keeps_one_set_of_hooks() -> None:
    from kdrun.models.features import extract_features
    from tests.test_layer_kd import batch, tiny_bert

    model = tiny_bert()
    compiled = torch.compile(model, backend="eager")
    needs = frozenset({"logits", "qkv"})
    first = extract_features(compiled, batch(), needs)
    second = extract_features(compiled, batch(), needs)
    q = model.bert.encoder.layer[0].attention.self.query
    assert len(q._forward_hooks) == 1
    torch.testing.assert_close(first.qkv().projection("q", 1), second.qkv().projection("q", 1))
    torch.testing.assert_close(first.logits, model(**batch()).logits)


# ------------------------------------------------------------------------- widths and settings

def test_bucket_widths() -> None:
    assert [bucket_width(n, 32) for n in (1, 31, 32, 33, 64, 65)] == [32, 32, 32, 64, 64, 96]
    assert [bucket_width(n, 32, limit=100) for n in (90, 97, 100)] == [96, 100, 100]
    assert bucket_width(120, 32, limit=100) == 120  # a longer row than the limit keeps its length
    assert bucket_width(37, 0) == 37
    assert resolve_pad_multiple("auto", True) == 32 and resolve_pad_multiple("auto", False) == 0
    with pytest.raises(ConfigError, match="train.pad_to_multiple_of=-8"):
        resolve_pad_multiple(-8, True)


def test_the_collator_pads_to_the_bucket() -> None:
    from kdrun.tasks.data.batches import Collator

    rows = [{"input_ids": [5] * n, "attention_mask": [1] * n, "labels": 0, "idx": i} for i, n in enumerate((3, 17))]
    batch = Collator(0, False, multiple=16, limit=48)(rows)
    assert batch["input_ids"].shape == (2, 32) and int(batch["attention_mask"].sum()) == 20
    assert Collator(0, False)(rows)["input_ids"].shape == (2, 17)


def test_cuda_graphs_are_refused_off_cuda_under_fp16_with_accumulation_and_ddp(run_cfg) -> None:
    from types import SimpleNamespace

    from kdrun.app.preflight import preflight

    with pytest.raises(ConfigError, match=r"train.cuda_graphs=true needs a CUDA device \(this run's is cpu\)"):
        preflight(run_cfg("train.cuda_graphs=true", "train.device=cpu"))
    with pytest.raises(ConfigError, match="does not run under fp16"):
        step_mode(SimpleNamespace(cuda_graphs=True, compile=False), "cuda", "fp16")
    assert step_mode(SimpleNamespace(cuda_graphs=True, compile=False), "cuda", "bf16") == "graphed"
    with pytest.raises(ConfigError, match=r"does not run with train.gradient_accumulation_steps=2"):
        step_mode(SimpleNamespace(cuda_graphs=True, gradient_accumulation_steps=2), "cuda", "bf16")
    with pytest.raises(ConfigError, match=r"does not run with 2 processes \(DDP\)"):
        step_mode(SimpleNamespace(cuda_graphs=True), "cuda", "bf16", world_size=2)
    assert step_mode(SimpleNamespace(cuda_graphs=False, compile=True), "cpu", "no") == "compiled"


def test_bench_compile_fast_compares_both_sides(tmp_path: Path) -> None:
    from tests.test_scripts_fast import run_script

    out = run_script("bench/compile", "--fast", "--json", str(tmp_path / "b.json"), tmp_path=tmp_path, timeout=400)
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert set(rows) == {"logit", "ckd"} and "ratio" in out
    for row in rows.values():  # the same batches, the same arithmetic (aot_eager): equal losses
        assert row["max_loss_diff"] < 1e-5 and row["compiled"]["compilations"] == 1
        assert row["eager"]["compilations"] == 0 and row["ratio"] > 0


@pytest.mark.parametrize("kind", ["labelled", "qa", "corpus", "tokens"])
def test_every_task_kind_compiles_with_the_store_on(kind: str, tmp_path: Path) -> None:
    """Each task kind (labelled, extractive QA, a raw-text corpus, the token plug-in) trains the same
    student compiled as eager, its teacher's outputs read from the store (a region input)."""
    from tests.test_store_kinds import KINDS, _run

    args = [*KINDS[kind](tmp_path), "teacher.store=on", "train.pad_to_multiple_of=16", "student.dropout=0.0"]
    _run(tmp_path, "eager", args)
    _run(tmp_path, "compiled", [*args, "train.compile=true", "train.compile_backend=eager"])
    eager, compiled = (json.loads((tmp_path / n / "results.json").read_text()) for n in ("eager", "compiled"))
    assert [s["step_mode"] for s in compiled["stages"]] == ["compiled"] * len(compiled["stages"])
    assert all(s["compilations"] >= 1 for s in compiled["stages"])
    a = load_file(str(tmp_path / "eager" / "student" / "model.safetensors"))
    b = load_file(str(tmp_path / "compiled" / "student" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_a_compiled_region_on_cuda_keeps_tf32_off_in_every_precision(precision: str) -> None:
    """The fp32 islands' own TF32 switch is not traced, so the compiled call runs with TF32 off in every
    precision (under fp32 too: the relation Gram matrices stay exact), and the user's setting is
    restored after it. Set and read through kdrun's helpers (torch's new fp32_precision API where
    present), never by patching torch's attribute."""
    from types import SimpleNamespace

    from kdrun.runtime.precision import set_tf32_matmul, tf32_matmul

    before = tf32_matmul()
    set_tf32_matmul(True)
    try:
        acc = SimpleNamespace(precision=SimpleNamespace(name=precision), device=torch.device("cuda"))
        forward = StepForward.__new__(StepForward)
        forward.parts = SimpleNamespace(accelerator=acc)
        with forward._exact_fp32():
            inside = tf32_matmul()
        assert inside is False and tf32_matmul() is True
    finally:
        set_tf32_matmul(before)


def test_more_widths_than_dynamos_default_limit_each_get_a_graph(objectives) -> None:
    """12 widths (dynamo keeps 8 graphs per function by default): each compiled, none run eagerly."""
    torch._dynamo.reset()
    step = engine_step(objectives["logit"], "compiled")
    for i, width in enumerate(range(4, 52, 4)):
        step(fixed_batch(4, width, 100, seed=i))
    assert step.loop.forward.compilations == 12


@pytest.mark.parametrize("window", [None, 3])
def test_the_angle_kernel_compiles_with_its_gradients(window) -> None:
    """The angle kernel (kdrun::angle_sum) is one operator to torch.compile: the compiled loss and its
    gradient equal eager's. (Traced as an autograd.Function, torch 2.11 lost its gradient: zero under
    compile; scripts/checks/stack.sh runs this on that stack.)"""
    from kdrun.losses.relations import angle_loss

    torch.manual_seed(0)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 10:] = mask[2, 5:] = 0
    xt, x0 = torch.randn(4, 16, 8), torch.randn(4, 16, 8)
    out = []
    for fn in (angle_loss, torch.compile(angle_loss, backend="aot_eager", fullgraph=True)):
        xs = x0.clone().requires_grad_(True)
        value = fn(xs, xt, mask, loss="huber", window=window)
        value.backward()
        out.append((float(value), xs.grad))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6) and float(out[0][1].norm()) > 0
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-8)


def test_the_recompile_limit_is_raised_under_its_old_name_too(monkeypatch) -> None:
    """Before torch 2.7 dynamo's limit is ``cache_size_limit``: raised there when ``recompile_limit``
    is absent (else every width past the 8th would run eagerly)."""
    import sys
    from types import SimpleNamespace

    from kdrun.engine.compiled import _allow_recompiles

    old = SimpleNamespace(cache_size_limit=8, accumulated_cache_size_limit=64)
    monkeypatch.setattr(torch._dynamo, "config", old)
    monkeypatch.setitem(sys.modules, "torch._dynamo.config", old)
    _allow_recompiles(16)
    assert old.cache_size_limit == 18 and old.accumulated_cache_size_limit == 64
    assert not hasattr(old, "recompile_limit")
