"""DynaBERT (kdrun/strategies/dynabert): depth rule, rewiring, sub-networks vs exported models, one adaptive
step's gradients vs a naive sum over separately built sub-models, parameter and FLOPs counts,
config errors, and one tiny run through the CLI with the export round trip."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from kdrun.errors import ConfigError
from kdrun.runtime import forkrun
from kdrun.strategies.dynabert.export import export_subnetwork, standard_heads
from kdrun.strategies.dynabert.export import main as export_main
from kdrun.strategies.dynabert.rewire import importance, rewire
from kdrun.strategies.dynabert.subnet import (
    Shape,
    count_flops,
    count_params,
    depth_step,
    kept_count,
    kept_layers,
    shape_of,
    subnet_pairs,
    subnetwork,
)
from tests.conftest import REPO, TINY, compose, load_script

VOCAB = 60


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one thread avoids thread start-up and spinning on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_bert(layers: int = 4, heads: int = 4, hidden: int = 32, ffn: int = 48, impl: str = "eager",
              seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    c = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=ffn, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                   max_position_embeddings=64)
    c._attn_implementation = impl
    model = BertForSequenceClassification(c).eval()
    with torch.no_grad():  # larger random weights than BERT's init, so that every unit matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def batch(n: int = 3, length: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1, length - 3:] = 0
    return {"input_ids": torch.randint(1, VOCAB, (n, length), generator=g), "attention_mask": mask,
            "token_type_ids": torch.zeros(n, length, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,), generator=g)}


def logits(model: nn.Module, b: dict[str, torch.Tensor], **kw) -> torch.Tensor:
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"],
                 **kw).logits


# ------------------------------------------------------------------------------------------ rules

def test_depth_rule_drops_every_kth_layer() -> None:
    assert kept_layers(12, 0.75) == [0, 1, 2, 4, 5, 6, 8, 9, 10]  # drops 1-based layers 4, 8, 12
    assert kept_layers(12, 0.5) == [0, 2, 4, 6, 8, 10]
    assert kept_layers(6, 0.75) == [0, 1, 2, 4, 5]
    assert kept_layers(6, 0.5) == [0, 2, 4]
    assert kept_layers(4, 2 / 3) == [0, 1, 3]
    assert kept_layers(4, 1.0) == [0, 1, 2, 3]
    assert kept_layers(1, 0.5) == [0]
    assert depth_step(0.8) == 5
    assert subnet_pairs([(0, 0), (1, 2), (2, 4), (3, 6)], [0, 2]) == [(0, 0), (1, 2), (2, 6)]
    assert subnet_pairs([(1, 1), (2, 2), (3, 3)], [0, 1]) == [(1, 1), (2, 2)]
    for bad in (0.6, 0.25, 0.0, 1.5):
        with pytest.raises(ValueError):
            depth_step(bad)
    assert [kept_count(12, w) for w in (1.0, 0.75, 0.5, 0.25)] == [12, 9, 6, 3]
    assert [kept_count(1536, w) for w in (0.75, 0.25)] == [1152, 384]
    assert kept_count(2, 0.25) == 1


# -------------------------------------------------------------------------------------- rewiring

def test_rewiring_preserves_outputs_and_sorts_importance() -> None:
    model = tiny_bert()
    batches = [batch(seed=s) for s in range(3)]
    before = [logits(model, b, output_hidden_states=True) for b in batches]
    hidden_before = model(**{k: v for k, v in batches[0].items() if k != "labels"}, output_hidden_states=True)
    head_imp, ffn_imp = importance(model, batches)
    assert head_imp.shape == (4, 4) and ffn_imp.shape == (4, 48) and (head_imp > 0).all()
    orders = rewire(model, head_imp, ffn_imp)
    assert any(o != sorted(o) for o in orders["heads"]) and any(o != sorted(o) for o in orders["ffn"])
    for b, ref in zip(batches, before):
        torch.testing.assert_close(logits(model, b), ref, atol=1e-5, rtol=0)
    hidden_after = model(**{k: v for k, v in batches[0].items() if k != "labels"}, output_hidden_states=True)
    for x, y in zip(hidden_after.hidden_states, hidden_before.hidden_states):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    # measured again, the importances now come in decreasing order within each layer
    head2, ffn2 = importance(model, batches)
    torch.testing.assert_close(head2, head_imp.gather(1, torch.tensor(orders["heads"])), rtol=1e-4, atol=1e-6)
    assert (head2[:, :-1] >= head2[:, 1:] - 1e-6).all() and (ffn2[:, :-1] >= ffn2[:, 1:] - 1e-6).all()


# ---------------------------------------------------------------------------- sub-network vs export

@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("width,depth", [(1.0, 1.0), (0.75, 0.75), (0.5, 0.5), (0.25, 1.0)])
def test_subnetwork_equals_exported_smaller_model(tmp_path: Path, impl: str, width: float, depth: float) -> None:
    model = tiny_bert(impl=impl)
    b = batch()
    with subnetwork(model, width, depth) as sub:
        expected = logits(model, b)
    small, info = export_subnetwork(model, width, depth)
    small.save_pretrained(tmp_path)
    loaded = BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation=impl).eval()
    torch.testing.assert_close(logits(loaded, b), expected, atol=1e-5, rtol=0)
    c = loaded.config
    heads = kept_count(4, width)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (32, kept_count(48, width),
                                                                           len(kept_layers(4, depth)))
    assert c.num_attention_heads == standard_heads(32, heads) == info["standard_heads"]
    assert info["kept_heads"] == heads and sub["layers"] == info["kept_layers"]
    assert info["params_subnetwork"] == count_params(shape_of(model), width, depth)
    assert info["params_exported"] == sum(p.numel() for p in loaded.parameters())
    if (width, depth) != (1.0, 1.0):
        assert info["params_exported"] < sum(p.numel() for p in model.parameters())
    assert logits(model, b).shape == expected.shape  # the model is whole again after the block
    assert len(model.bert.encoder.layer) == 4
    assert "forward" not in model.bert.encoder.layer[0].intermediate.dense.__dict__


def test_standard_heads() -> None:
    assert [standard_heads(384, k) for k in (12, 9, 6, 3)] == [12, 12, 6, 3]
    assert standard_heads(32, 3) == 4


# ------------------------------------------------------------------------- one adaptive step, naively

class _Recorder:
    """Stands in for the optimizer: keeps the gradients of the one step instead of applying them."""

    def __init__(self, model: nn.Module):
        self.model, self.grads, self.steps = model, None, 0

    def step(self) -> None:
        self.steps += 1
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=True)


def _masked_forward(model: nn.Module, b: dict, width: float, hidden: bool = True):
    """The width sub-network the naive way: the whole model with dropped heads' context vectors and
    dropped FFN neurons' activations multiplied by zero (forward pre-hooks)."""
    shape = shape_of(model)
    k, f = kept_count(shape.heads, width), kept_count(shape.ffn, width)
    head_mask = (torch.arange(shape.heads) < k).float().repeat_interleave(shape.head_dim)
    ffn_mask = (torch.arange(shape.ffn) < f).float()
    handles = []
    for layer in model.bert.encoder.layer:
        handles.append(layer.attention.output.dense.register_forward_pre_hook(lambda m, a: (a[0] * head_mask,)))
        handles.append(layer.output.dense.register_forward_pre_hook(lambda m, a: (a[0] * ffn_mask,)))
    try:
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                     token_type_ids=b["token_type_ids"], output_hidden_states=hidden)
    finally:
        for h in handles:
            h.remove()


def _naive_loss(plan, s_out, t_out, keep: list[int], b: dict) -> torch.Tensor:
    """The stage's weighted terms on the sub-network's hidden states against the teacher's at the kept
    layers' own positions (embeddings with embeddings)."""
    from kdrun.losses import LossContext
    from kdrun.models.features import Features

    th = (t_out.hidden_states[0],) + tuple(t_out.hidden_states[d + 1] for d in keep)
    s = Features(logits=s_out.logits, attention_mask=b["attention_mask"], hidden_states=tuple(s_out.hidden_states))
    t = Features(logits=t_out.logits, attention_mask=b["attention_mask"], hidden_states=th)
    ctx = LossContext(num_labels=2, layer_pairs=[(i, i) for i in range(len(keep) + 1)])
    return sum(term.weight * term.spec.impl(s, t, b, ctx, term.params) for term in plan.terms)


@pytest.mark.parametrize("objective,phase", [("dynabert_ckd", 0), ("dynabert", 1)])
def test_adaptive_step_equals_sum_of_separate_subnetworks(objective: str, phase: int) -> None:
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.engine.trainer import FiniteWatch, train_step
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec
    from kdrun.runtime.precision import make_kd_accelerator
    from kdrun.strategies.dynabert.train import AdaptiveStage

    cfg = compose([f"objective={objective}", "objective.params.widths=[1.0,0.75,0.5,0.25]",
                   "objective.params.depths=[1.0,0.75,0.5]", "objective.params.window_pair=3",
                   "objective.params.window_angle=3"] if objective == "dynabert_ckd" else [f"objective={objective}"])
    plans = plan_stages(cfg.objective)
    plan = plans[phase]
    teacher = tiny_bert(seed=0)
    student = copy.deepcopy(teacher).train()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    objective_m = Objective(plans, MappingSpec.from_config(cfg.mapping), 2, describe(student), describe(teacher))
    b = batch(n=4, length=11)
    widths, depths = [1.0, 0.75, 0.5, 0.25], ([1.0] if phase == 0 else [1.0, 0.75, 0.5])
    stage = AdaptiveStage("width" if phase == 0 else "depth", widths, depths)
    if phase == 1:  # phase 3's teacher: a frozen copy of the (phase-2) student; each layer with itself
        stage.teacher = copy.deepcopy(student).eval().requires_grad_(False)
        stage.pairs = [(i, i) for i in range(5)]
    rec = _Recorder(student)
    parts = SimpleNamespace(accelerator=make_kd_accelerator(True, "no"), student=student,
                            teacher=teacher.requires_grad_(False), objective=objective_m, world_size=1,
                            train_cfg=SimpleNamespace(max_grad_norm=0.0))
    loop = SimpleNamespace(plan=plan, optimizer=rec, strategy=stage, watch=FiniteWatch(), teacher_table=None,
                           store=None)
    total, values = train_step(parts, loop, b, SimpleNamespace(global_step=0, stage_step=0))  # the engine's step
    assert rec.steps == 1 and len([k for k in values if k.startswith("subnet/")]) == len(widths) * len(depths)

    # naive: every sub-network built on its own (masks for width, a separate copy holding only the
    # kept layers for depth), its loss's gradients mapped back to the full model's names and summed
    naive: dict[str, torch.Tensor] = {}
    naive_total = 0.0
    for w in widths:
        with torch.no_grad():  # phase 2: the full teacher; phase 3: the phase-2 model at width w
            t_out = _masked_forward(stage.teacher, b, w) if phase == 1 else _masked_forward(teacher, b, 1.0)
        for d in depths:
            keep = kept_layers(4, d)
            sub = copy.deepcopy(student)
            sub.bert.encoder.layer = nn.ModuleList([sub.bert.encoder.layer[i] for i in keep])
            sub.zero_grad(set_to_none=True)
            loss = _naive_loss(plan, _masked_forward(sub, b, w), t_out, keep, b)
            loss.backward()
            naive_total += float(loss.detach())
            for name, p in sub.named_parameters():
                if p.grad is None:
                    continue
                parts_ = name.split(".")
                if parts_[:3] == ["bert", "encoder", "layer"]:
                    parts_[3] = str(keep[int(parts_[3])])
                full = ".".join(parts_)
                naive[full] = naive.get(full, 0) + p.grad
    assert float(total) == pytest.approx(naive_total, rel=1e-5)
    assert set(rec.grads) == set(naive)
    for name, g in naive.items():
        torch.testing.assert_close(rec.grads[name], g, atol=2e-6, rtol=1e-4, msg=name)


def _engine_step_grads(student: nn.Module, wrap=None) -> tuple[dict[str, torch.Tensor], int]:
    """One engine step of phase 3 (4 widths x 3 depths) on ``student`` (``wrap``: a DDP wrapper
    factory); the gradients the optimizer gets and how many times DDP all-reduced them (comm-hook
    calls for the first bucket: one per synchronised backward)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.engine.trainer import FiniteWatch, train_step
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec
    from kdrun.runtime.precision import make_kd_accelerator
    from kdrun.strategies.dynabert.train import AdaptiveStage

    cfg = compose(["objective=dynabert"])
    plans = plan_stages(cfg.objective)
    objective_m = Objective(plans, MappingSpec.from_config(cfg.mapping), 2, describe(student), describe(student))
    stage = AdaptiveStage("depth", [1.0, 0.75, 0.5, 0.25], [1.0, 0.75, 0.5])
    stage.teacher = copy.deepcopy(student).eval().requires_grad_(False)
    stage.pairs = [(i, i) for i in range(5)]
    rounds = []
    model = student
    if wrap is not None:
        model = wrap(student)

        def counting(state, bucket):
            rounds.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(None, counting)
    rec = _Recorder(student)
    parts = SimpleNamespace(accelerator=make_kd_accelerator(True, "no"), student=model, teacher=None,
                            objective=objective_m, world_size=1, train_cfg=SimpleNamespace(max_grad_norm=0.0))
    loop = SimpleNamespace(plan=plans[1], optimizer=rec, strategy=stage, watch=FiniteWatch(), teacher_table=None,
                           store=None)
    train_step(parts, loop, batch(n=4, length=11), SimpleNamespace(global_step=0, stage_step=0))
    assert rec.steps == 1
    return rec.grads, rounds.count(0)


def test_ddp_dynabert_all_reduces_once_per_step_not_once_per_subnetwork() -> None:
    """A process group of one over gloo: the 12 sub-network passes of a phase-3 step accumulate their
    gradients locally (``no_sync``) and the last pass's backward all-reduces them once; the gradients
    are those of the same step without DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = tiny_bert(seed=0).train()
    plain, _ = _engine_step_grads(copy.deepcopy(base))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29900 + os.getpid() % 90))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        grads, rounds = _engine_step_grads(copy.deepcopy(base),
                                           lambda m: DDP(m, find_unused_parameters=True, broadcast_buffers=False))
    finally:
        dist.destroy_process_group()
    assert rounds == 1, f"{rounds} all-reduces in one step of 12 sub-network passes"
    assert set(grads) == set(plain)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------- counts

def test_param_and_flop_counts_by_hand() -> None:
    s = Shape(layers=4, hidden=32, heads=4, head_dim=8, ffn=48, labels=2, vocab=100, positions=64, token_types=2)
    # embeddings (100 + 64 + 2) * 32 + LayerNorm 64; one full layer: Q, K, V 3 * (32*32 + 32), O 32*32 + 32,
    # 2 LayerNorms 128, FFN 32*48 + 48 + 48*32 + 32; pooler 32*32 + 32; classifier 32*2 + 2
    emb = 166 * 32 + 64
    layer = 3 * 1056 + 1056 + 128 + 1584 + 1568
    head = 1056 + 66
    assert count_params(s) == emb + 4 * layer + head == 5376 + 4 * 7504 + 1122
    # width 0.5: 2 heads (16 dims), 24 neurons; depth 0.75 keeps 3 layers
    layer_half = 3 * (32 * 16 + 16) + (16 * 32 + 32) + 128 + (32 * 24 + 24) + (24 * 32 + 32)
    assert count_params(s, 0.5, 0.75) == emb + 3 * layer_half + head
    assert count_params(s, 0.5, 0.75, embeddings=False) == 3 * layer_half + head
    # FLOPs at n = 128: per layer 8 n d a + 4 n^2 a + 4 n d f, plus 2 d^2 + 2 d C
    assert count_flops(s) == 4 * (8 * 128 * 32 * 32 + 4 * 128 * 128 * 32 + 4 * 128 * 32 * 48) + 2 * 1024 + 128
    assert count_flops(s, 0.5, 0.75) == 3 * (524288 + 1048576 + 393216) + 2176
    assert count_flops(s, 0.5, 0.75, seq_len=10) == 3 * (8 * 10 * 32 * 16 + 4 * 100 * 16 + 4 * 10 * 32 * 24) + 2176


@pytest.mark.parametrize("width,depth", [(1.0, 1.0), (0.5, 0.75), (0.25, 0.5)])
def test_counts_match_the_model(width: float, depth: float) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_bert(ffn=48)
    shape = shape_of(model)
    # parameters: a real BERT has exactly the counted parameters at full size
    assert count_params(shape) == sum(p.numel() for p in model.parameters())
    # FLOPs: torch's counter over the sub-network's matrix products on one 16-token example
    b = {k: v[:1] for k, v in batch(n=2, length=16).items()}
    with torch.no_grad(), subnetwork(model, width, depth), FlopCounterMode(display=False) as counter:
        logits(model, b)
    assert counter.get_total_flops() == count_flops(shape, width, depth, seq_len=16)


# ------------------------------------------------------------------------------------ config errors

@pytest.mark.parametrize("override,key", [
    ("objective.params.depths=[1.0,0.6]", "objective.stages[1].adaptive.depths[1]"),
    ("objective.params.widths=[1.0,1.5]", "objective.stages[0].adaptive.widths[1]"),
    ("objective.params.widths=[]", "objective.stages[0].adaptive.widths"),
    ("objective.stages.0.adaptive.phase=both", "objective.stages[0].adaptive.phase"),
    ("objective.params.importance_samples=0", "objective.stages[0].adaptive.importance_samples"),
])
def test_config_errors_name_the_key(override: str, key: str) -> None:
    from kdrun.app.preflight import preflight

    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        preflight(compose([*TINY, "objective=dynabert_ckd", override]))


def test_misspelt_adaptive_key_fails_at_composition() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="widht"):
        compose(["objective=dynabert", "objective.stages.0.adaptive.widht=[0.5]"])


# ---------------------------------------------------------------------------------- the whole run

# A whole DynaBERT run in seconds: tiny models, two widths and two depths (tests/test_scripts_fast.py too).
TINY_DYNABERT_RUN = [
    *TINY, "task=toy", "task.toy.num_train=48", "task.toy.num_validation=24", "objective=dynabert_ckd",
    "student=truncated", "student.num_layers=4", "objective.params.widths=[1.0,0.5]",
    "objective.params.depths=[1.0,0.5]", "objective.params.width_epochs=1", "objective.params.depth_epochs=1",
    "objective.params.batch_size=16"]

def test_cli_run_prints_the_table_and_exports(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = forkrun.run([*TINY_DYNABERT_RUN, f"cache_dir={tmp_path}/cache", f"hydra.run.dir={run_dir}"],
                    {**os.environ, "OMP_NUM_THREADS": "1"}, REPO, 300)  # forked: kdrun.runtime.forkrun
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DynaBERT sub-networks" in r.stdout and "m_w" in r.stdout
    res = json.loads((run_dir / "results.json").read_text())
    rows = res["subnetworks"]["rows"]
    assert [(x["width"], x["depth"]) for x in rows] == [(1.0, 1.0), (1.0, 0.5), (0.5, 1.0), (0.5, 0.5)]
    assert all(set(x["metrics"]["validation"]) == {"accuracy", "f1"} for x in rows)
    assert rows[0]["metrics"] == res["student"]["metrics"]  # the full network is the student
    assert rows[0]["params"] > rows[1]["params"] > rows[3]["params"] and rows[2]["flops"] < rows[0]["flops"]
    assert res["subnetworks"]["rewiring"]["importance_data"] == "validation"
    assert [s["stage"] for s in res["stages"]] == ["width", "depth"] and (run_dir / "subnetworks.png").exists()

    out = tmp_path / "export"
    assert export_main([str(run_dir), "width=0.5", "depth=0.5", str(out)]) == 0
    from transformers import AutoModelForSequenceClassification

    small = AutoModelForSequenceClassification.from_pretrained(out).eval()
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "student").eval()
    b = batch()
    b["input_ids"] = b["input_ids"] + 1000  # ids of the shared tokenizer's vocabulary
    with torch.no_grad(), subnetwork(model, 0.5, 0.5):
        expected = logits(model, b)
    with torch.no_grad():
        torch.testing.assert_close(logits(small, b), expected, atol=1e-5, rtol=0)
    assert small.config.num_hidden_layers == 2 and (out / "tokenizer.json").exists()
    assert json.loads((out / "dynabert.json").read_text())["max_abs_logit_diff_random_inputs"] < 1e-5
    assert export_main([str(run_dir), "width=0.5", "depth=0.6", str(out)]) == 2  # not DynaBERT's rule

    # the comparison script: one table with a column per run, one plot
    script = load_script("plots/dynabert")
    runs = script.load([f"a={run_dir}", f"b={run_dir}"])
    md = script.table(runs, markdown=True).splitlines()
    assert len(md) == 2 + len(rows) and "a accuracy" in md[0] and "b f1" in md[0]
    from kdrun.strategies.dynabert.results import plot_subnetworks

    assert plot_subnetworks({k: v["subnetworks"] for k, v in runs.items()}, tmp_path / "p.png",
                            metrics=["accuracy", "f1"]).exists()


def test_interrupted_run_resumes_with_the_same_phase3_teacher(run_cfg, tmp_path: Path) -> None:
    """Killed inside phase 3 and rerun, the run ends with the same student and table as an uninterrupted
    one: the resumed stage distils from the saved phase-2 model, not from the restored student."""
    from safetensors.torch import load_file

    from kdrun.app.run import run
    from kdrun.engine.trainer import SimulatedInterrupt

    args = ["task.toy.num_train=48", "task.toy.num_validation=24", "objective=dynabert", "student=truncated",
            "student.num_layers=4", "objective.params.widths=[1.0,0.5]", "objective.params.depths=[1.0,0.5]",
            "objective.params.batch_size=16", "objective.params.lr=1e-3", "objective.params.width_epochs=1",
            "objective.params.depth_epochs=1", "train.checkpoint_every_steps=1"]
    ref = run(run_cfg(*args), tmp_path / "ref")
    rd = tmp_path / "resumed"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg(*args, "train.stop_after_steps=5"), rd)  # 3 steps per phase: 2 steps into phase 3
    assert (rd / "checkpoints" / "adaptive_teacher_stage1.safetensors").exists()
    out = run(run_cfg(*args), rd)
    assert out["subnetworks"]["rows"] == ref["subnetworks"]["rows"]
    wa = load_file(str(tmp_path / "ref" / "student" / "model.safetensors"))
    wb = load_file(str(rd / "student" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
