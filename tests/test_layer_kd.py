"""Layer-matching objectives: the features record's Q/K/V and scores, every loss term against a naive
loop written here, zero loss for identical models, constraints, learnable maps in the objective, and
every objective end to end with tiny models (plus the map pictures)."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kdrun.engine.objective import Objective, plan_stages
from kdrun.losses import LossContext, get_loss
from kdrun.models.features import AttentionInputs, Features, extract_features
from kdrun.models.mapping import LayerMap, MappedPairs, Row, pairs_map
from tests.conftest import TINY, assert_kept_best, compose, load_script, task_objectives

# Every objective for labelled tasks but mgskd (it needs a chunker: tests/test_mgskd.py).
OBJECTIVES = [o for o in task_objectives() if o != "mgskd"]


# ------------------------------------------------------------------------------------ helpers

def tiny_bert(layers=4, hidden=16, heads=2, attn="eager", seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=60, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, max_position_embeddings=32, num_labels=2)
    cfg._attn_implementation = attn
    return BertForSequenceClassification(cfg).eval()


def batch(B=3, n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    ids = torch.randint(5, 60, (B, n), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def rand_features(B=3, n=6, d=8, heads=2, layers=3, seed=0, grad=False) -> Features:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    hidden = tuple(torch.randn(B, n, d, generator=g, dtype=torch.float64).requires_grad_(grad)
                   for _ in range(layers + 1))
    qkv = [[torch.randn(B, n, d, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(layers)]
           for _ in range(3)]
    rec = AttentionInputs(*qkv, heads=heads, scaling=(d // heads) ** -0.5)
    return Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=hidden,
                    extra={"attention_inputs": rec})


def info(f: Features) -> dict:
    rec = f.extra["attention_inputs"]
    return {"layers": rec.num_layers, "hidden": f.hidden_states[0].shape[-1], "heads": rec.heads}


def term(name, s, t, lmap=None, **params):
    spec = get_loss(name)
    lmap = lmap or pairs_map([])
    pairs = MappedPairs(lmap.pairs, lmap)
    spec.check(info(s), info(t), pairs, **params)
    module = spec.build_module(info(s), info(t), pairs, **params)
    if module is not None:
        module = module.double()
    ctx = LossContext(num_labels=2, layer_pairs=lmap.pairs, module=module, layer_map=lmap)
    return spec.fn(s, t, None, ctx, **params), module


def real(mask, b, i):
    return bool(mask[b, i])


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def heads_of(x, h):  # (B, n, d) -> (B, h, n, d/h)
    B, n, d = x.shape
    return x.reshape(B, n, h, d // h).permute(0, 2, 1, 3)


# ------------------------------------------------------------------------ features: Q/K/V, scores

def test_scores_from_hooks_match_eager_attentions_and_sdpa() -> None:
    model, b = tiny_bert(), batch()
    f = extract_features(model, b, frozenset({"logits", "attentions", "attention_scores", "qkv"}))
    key_pad = ~b["attention_mask"].bool()[:, None, None, :]
    for layer in range(1, 5):
        probs = f.attention_scores(layer).masked_fill(key_pad, float("-inf")).softmax(-1)
        real_q = b["attention_mask"].bool()
        assert torch.allclose(probs.permute(0, 2, 1, 3)[real_q], f.attentions[layer - 1].permute(0, 2, 1, 3)[real_q],
                              atol=1e-5)
    # under SDPA (no attention probabilities) the hooks give the same scores and the same logits
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    g = extract_features(sdpa, b, frozenset({"logits", "attention_scores"}))
    assert torch.allclose(g.logits, f.logits, atol=1e-5)
    assert all(torch.allclose(g.attention_scores(layer), f.attention_scores(layer), atol=1e-5) for layer in (1, 4))
    assert f.qkv().heads_of("v", 2).shape == (3, 2, 7, 8)
    with pytest.raises(IndexError, match="layers 1..4"):
        f.attention_scores(5)
    with pytest.raises(RuntimeError, match="needs=\\{'attention_scores'\\}"):
        Features(logits=f.logits, attention_mask=f.attention_mask).attention_scores(1)


def test_hooks_registered_once_and_teacher_tensors_join_autograd() -> None:
    teacher, student, b = tiny_bert(seed=3), tiny_bert(layers=2, seed=4), batch()
    with torch.inference_mode():
        t = extract_features(teacher, b, frozenset({"logits", "qkv", "attention_scores", "hidden_states"}))
    projections = [p for layer in teacher.bert.encoder.layer for p in
                   (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value)]
    assert all(len(p._forward_hooks) == 1 for p in projections)  # kdrun's capture hooks stay, once
    with torch.inference_mode():
        extract_features(teacher, b, frozenset({"logits", "qkv"}))
    assert all(len(p._forward_hooks) == 1 for p in projections)
    s = extract_features(student, b, frozenset({"logits", "qkv", "attention_scores", "hidden_states"}))
    ctx = LossContext(2, layer_pairs=[(1, 2), (2, 4)], layer_map=pairs_map([(1, 2), (2, 4)]))
    loss = (get_loss("tinybert_attention").fn(s, t, None, ctx) + get_loss("minilm_value").fn(s, t, None, ctx)
            + get_loss("minilmv2_qq").fn(s, t, None, ctx, relation_heads=4))
    loss.backward()
    assert student.bert.encoder.layer[1].attention.self.value.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- naive references

def naive_pkd(s, t, rows):
    per_row = []
    for si, ti in rows:
        per_ex = []
        for b in range(s.hidden_states[0].shape[0]):
            a, c = s.hidden_states[si][b, 0], t.hidden_states[ti][b, 0]
            a, c = a / math.sqrt(float(a @ a)), c / math.sqrt(float(c @ c))
            per_ex.append(sum(float(x - y) ** 2 for x, y in zip(a, c)) / len(a))
        per_row.append(sum(per_ex) / len(per_ex))
    return sum(per_row) / len(per_row)


def test_pkd_hand_computed() -> None:
    # one example, one layer: [CLS] (3, 4) vs (4, 3) -> unit (0.6, 0.8) vs (0.8, 0.6); MSE = 0.04
    hs = (torch.zeros(1, 2, 2), torch.tensor([[[3.0, 4.0], [9.0, 9.0]]]))
    ht = (torch.zeros(1, 2, 2), torch.tensor([[[4.0, 3.0], [1.0, 1.0]]]))
    s = Features(logits=torch.zeros(1, 2), attention_mask=torch.ones(1, 2), hidden_states=hs)
    t = Features(logits=torch.zeros(1, 2), attention_mask=torch.ones(1, 2), hidden_states=ht)
    ctx = LossContext(2, layer_pairs=[(1, 1)])
    assert get_loss("pkd_patience").fn(s, t, None, ctx).item() == pytest.approx(0.04, rel=1e-6)


def test_pkd_and_cosine_match_naive() -> None:
    s, t = rand_features(grad=True), rand_features(layers=6, seed=1)
    rows = [(1, 2), (2, 4), (3, 6)]
    got, _ = term("pkd_patience", s, t, pairs_map(rows))
    assert got.item() == pytest.approx(naive_pkd(s, t, rows), rel=1e-9)
    # cosine over real tokens, summed over pairs (embeddings included)
    rows = [(0, 0), (1, 3), (3, 6)]
    got, _ = term("hidden_cosine", s, t, pairs_map(rows))
    want = 0.0
    mask = s.attention_mask
    for si, ti in rows:
        vals = []
        for b, i in itertools.product(range(3), range(6)):
            if real(mask, b, i):
                a, c = s.hidden_states[si][b, i], t.hidden_states[ti][b, i]
                vals.append(1 - float(a @ c) / math.sqrt(float(a @ a) * float(c @ c)))
        want += sum(vals) / len(vals)
    assert got.item() == pytest.approx(want, rel=1e-9)
    got.backward()
    assert s.hidden_states[1].grad is not None


def test_pkd_with_mean_map_and_projection() -> None:
    s, t = rand_features(d=4, grad=True), rand_features(d=8, layers=6, seed=1)
    lmap = LayerMap("mean", [Row(1, (1, 2)), Row(2, (3, 4)), Row(3, (5, 6))])
    got, module = term("pkd_patience", s, t, lmap, projection="per_layer", match_last=True)
    want = 0.0
    for si, (t1, t2) in zip((1, 2, 3), ((1, 2), (3, 4), (5, 6))):
        lin = module.per_layer[str(si)]
        for b in range(3):
            a = lin(s.hidden_states[si][b, 0])
            c = (t.hidden_states[t1][b, 0] + t.hidden_states[t2][b, 0]) / 2
            a, c = a / a.norm(), c / c.norm()
            want += float(((a - c) ** 2).mean()) / 3
    assert got.item() == pytest.approx(want / 3, rel=1e-9)
    with pytest.raises(ValueError, match="width is 4 and the teacher's 8.*projection"):
        term("pkd_patience", s, t, lmap)


def test_alp_matches_naive_per_example_attention() -> None:
    s, t = rand_features(grad=True), rand_features(layers=6, seed=1)
    rows = [Row(1, (1, 2, 3, 4, 5, 6)), Row(2, (4, 5, 6))]
    got, _ = term("alp", s, t, LayerMap("attention", rows))
    want = 0.0
    for row in rows:
        per_ex = []
        for b in range(3):
            h = s.hidden_states[row.student][b, 0]
            ks = [t.hidden_states[k][b, 0] for k in row.teachers]
            alpha = softmax([float(h @ k) for k in ks])
            c = sum(a * k for a, k in zip(alpha, ks))
            per_ex.append(float(((h - c) ** 2).mean()))
        want += sum(per_ex) / 3
    assert got.item() == pytest.approx(want, rel=1e-9)
    got.backward()  # the gradient also flows through α
    assert s.hidden_states[2].grad.abs().sum() > 0


@pytest.mark.parametrize("strategy", ["concat", "mean"])
def test_comb_matches_naive(strategy) -> None:
    s, t = rand_features(d=4, grad=True), rand_features(d=6, layers=6, seed=1)
    rows = [Row(1, (1, 2, 3)), Row(2, (4, 5, 6))]
    got, module = term("comb", s, t, LayerMap(strategy, rows), match_last=True)
    want = 0.0
    for row in rows:
        lin = module.per_layer[str(row.student)]
        assert lin.in_features == (18 if strategy == "concat" else 6)
        for b in range(3):
            parts = [t.hidden_states[k][b, 0] for k in row.teachers]
            c = torch.cat(parts) if strategy == "concat" else sum(parts) / 3
            want += float(((s.hidden_states[row.student][b, 0] - lin(c)) ** 2).mean()) / 3
    assert got.item() == pytest.approx(want, rel=1e-9)


def test_tinybert_embedding_and_hidden_match_naive() -> None:
    s, t = rand_features(d=4, grad=True), rand_features(d=8, layers=6, seed=1)
    mask = s.attention_mask
    emb, module = term("tinybert_embedding", s, t, projection="shared")
    lmap = LayerMap("learnable", [Row(0, (0,)), Row(1, (1, 2)), Row(2, (3, 4)), Row(3, (5, 6))], init="last")
    spec = get_loss("tinybert_hidden")
    ctx = LossContext(2, module=module, layer_map=lmap)
    hid = spec.fn(s, t, None, ctx, projection="shared")
    w = softmax([-1.0, 1.0])
    lin = module.proj

    def token_mse(a_layer, target_fn):
        vals = [float(((lin(s.hidden_states[a_layer][b, i]) - target_fn(b, i)) ** 2).mean())
                for b, i in itertools.product(range(3), range(6)) if real(mask, b, i)]
        return sum(vals) / len(vals)

    assert emb.item() == pytest.approx(token_mse(0, lambda b, i: t.hidden_states[0][b, i]), rel=1e-9)
    want = sum(token_mse(si, lambda b, i, k=k: w[0] * t.hidden_states[k][b, i] + w[1] * t.hidden_states[k + 1][b, i])
               for si, k in ((1, 1), (2, 3), (3, 5)))  # the embedding row is the embedding term's
    assert hid.item() == pytest.approx(want, rel=1e-6)
    hid.backward()
    assert lmap.phi.grad is not None and lmap.phi.grad[1:].abs().sum() > 0


def naive_attention_mse(ss, st, mask, padding):
    B, h, n, _ = ss.shape
    total, count = 0.0, 0
    for b, hh, i, j in itertools.product(range(B), range(h), range(n), range(n)):
        if padding == "exclude":
            if real(mask, b, i) and real(mask, b, j):
                total += float(ss[b, hh, i, j] - st[b, hh, i, j]) ** 2
                count += 1
        else:  # official: padded keys zeroed in both, everything else (padded query rows too) counts
            d = 0.0 if not real(mask, b, j) else float(ss[b, hh, i, j] - st[b, hh, i, j])
            total += d * d
            count += 1
    return total / count


def naive_kl(rs, rt, mask):
    """Mean over (b, head, real query) of KL(softmax(rt) || softmax(rs)) over real keys."""
    B, h, n, _ = rs.shape
    vals = []
    for b, hh, i in itertools.product(range(B), range(h), range(n)):
        if not real(mask, b, i):
            continue
        keys = [j for j in range(n) if real(mask, b, j)]
        p = softmax([float(rt[b, hh, i, j]) for j in keys])
        q = softmax([float(rs[b, hh, i, j]) for j in keys])
        vals.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
    return sum(vals) / len(vals)


def naive_scores(f, layer, heads):
    rec = f.extra["attention_inputs"]
    q, k = heads_of(rec._raw["q"][layer - 1], heads), heads_of(rec._raw["k"][layer - 1], heads)
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize("loss,padding", [("mse", "exclude"), ("mse", "tinybert"), ("kl", "exclude")])
def test_tinybert_attention_matches_naive(loss, padding) -> None:
    s, t = rand_features(grad=True), rand_features(layers=6, seed=1)
    rows = [(1, 2), (2, 4), (3, 6)]
    got, _ = term("tinybert_attention", s, t, pairs_map(rows), loss=loss, padding=padding)
    mask = s.attention_mask
    want = 0.0
    for si, ti in rows:
        ss, st = naive_scores(s, si, 2), naive_scores(t, ti, 2)
        want += naive_attention_mse(ss, st, mask, padding) if loss == "mse" else naive_kl(ss, st, mask)
    assert got.item() == pytest.approx(want, rel=1e-9)


def test_tinybert_attention_with_mean_map_combines_scores_or_distributions() -> None:
    s, t = rand_features(grad=True), rand_features(layers=6, seed=1)
    lmap = LayerMap("mean", [Row(1, (1, 2)), Row(2, (3, 4)), Row(3, (5, 6))])
    mask = s.attention_mask
    mse, _ = term("tinybert_attention", s, t, lmap, loss="mse")
    want = sum(naive_attention_mse(naive_scores(s, si, 2), (naive_scores(t, k, 2) + naive_scores(t, k + 1, 2)) / 2,
                                   mask, "exclude") for si, k in ((1, 1), (2, 3), (3, 5)))
    assert mse.item() == pytest.approx(want, rel=1e-9)
    kl, _ = term("tinybert_attention", s, t, lmap, loss="kl")
    key_pad = ~mask.bool()[:, None, None, :]
    want = 0.0
    for si, k in ((1, 1), (2, 3), (3, 5)):  # teacher distribution = mean of the two layers' distributions
        p = sum(naive_scores(t, x, 2).masked_fill(key_pad, -1e30).softmax(-1) for x in (k, k + 1)) / 2
        want += naive_kl(naive_scores(s, si, 2), p.clamp_min(1e-300).log(), mask)
    assert kl.item() == pytest.approx(want, rel=1e-9)


def test_minilm_terms_match_naive() -> None:
    s, t = rand_features(d=8, heads=2, grad=True), rand_features(d=12, heads=2, layers=5, seed=1)
    mask = s.attention_mask
    att, _ = term("minilm_attention", s, t)
    assert att.item() == pytest.approx(naive_kl(naive_scores(s, 3, 2), naive_scores(t, 5, 2), mask), rel=1e-9)
    val, _ = term("minilm_value", s, t, student_layer=2, teacher_layer=4)

    def vrel(f, layer, h):
        v = heads_of(f.extra["attention_inputs"]._raw["v"][layer - 1], h)
        return v @ v.transpose(-1, -2) / math.sqrt(v.shape[-1])

    assert val.item() == pytest.approx(naive_kl(vrel(s, 2, 2), vrel(t, 4, 2), mask), rel=1e-9)
    for name, which in (("minilmv2_qq", "q"), ("minilmv2_kk", "k"), ("minilmv2_vv", "v")):
        got, _ = term(name, s, t, relation_heads=4)

        def rel(f, layer, which=which):
            x = heads_of(f.extra["attention_inputs"]._raw[which][layer - 1], 4)  # 4 relation heads
            return x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])

        assert got.item() == pytest.approx(naive_kl(rel(s, 3), rel(t, 5), mask), rel=1e-9)


# ------------------------------------------------------------------------ zero for equal models

ZERO_CASES = [
    ("pkd_patience", {"match_last": True}),
    ("hidden_cosine", {}),
    ("alp", {"match_last": True}),
    ("comb", {"match_last": True}),
    ("tinybert_embedding", {"projection": "shared"}),
    ("tinybert_hidden", {"projection": "shared"}),
    ("tinybert_hidden", {"projection": "per_layer"}),
    ("tinybert_attention", {"loss": "mse", "padding": "exclude"}),
    ("tinybert_attention", {"loss": "mse", "padding": "tinybert"}),
    ("tinybert_attention", {"loss": "kl"}),
    ("minilm_attention", {}),
    ("minilm_value", {}),
    ("minilmv2_qq", {"relation_heads": 4}),
    ("minilmv2_kk", {"relation_heads": 4}),
    ("minilmv2_vv", {"relation_heads": 4}),
]


@pytest.mark.parametrize("name,params", ZERO_CASES)
def test_zero_loss_when_student_is_a_copy_of_the_teacher(name, params) -> None:
    teacher = tiny_bert()
    student = copy.deepcopy(teacher)
    b = batch()
    needs = frozenset({"logits", "hidden_states", "qkv", "attention_scores"})
    with torch.no_grad():  # as the trainer runs the teacher
        t = extract_features(teacher, b, needs)
    s = extract_features(student, b, needs)
    spec = get_loss(name)
    lmap = pairs_map([(i, i) for i in range(5)])
    s_info = {"layers": 4, "hidden": 16, "heads": 2}
    pairs = MappedPairs(lmap.pairs, lmap)
    module = spec.build_module(s_info, s_info, pairs, **params)
    value = spec.fn(s, t, b, LossContext(2, layer_pairs=lmap.pairs, module=module, layer_map=lmap), **params)
    assert abs(value.item()) < 1e-6, value.item()
    # ALP's attention over one-layer buckets is the identity map too
    if name == "alp":
        one = LayerMap("attention", [Row(i, (i,)) for i in range(1, 5)])
        assert spec.fn(s, t, b, LossContext(2, layer_map=one), **params).item() < 1e-6


# ---------------------------------------------------------------------------------- objective

def objective_for(*overrides, s=None, t=None):
    from kdrun.models.mapping import MappingSpec

    cfg = compose(list(overrides))
    s = s or {"layers": 2, "hidden": 32, "heads": 2}
    t = t or {"layers": 6, "hidden": 32, "heads": 2}
    return Objective(plan_stages(cfg.objective), MappingSpec.from_config(cfg.mapping, seed=1), 2, s, t)


@pytest.mark.parametrize(
    "overrides,s,t,match",
    [
        (["objective=tinybert"], None, {"layers": 6, "hidden": 32, "heads": 4},
         "tinybert_attention.*student has 2 heads and the teacher 4.*objective.params.a=1"),
        (["objective=minilm"], None, {"layers": 6, "hidden": 32, "heads": 4}, "objective=minilmv2"),
        (["objective=distilbert"], {"layers": 2, "hidden": 16, "heads": 2}, None,
         "hidden_cosine.*width is 16 and the teacher's 32.*objective.params.projection"),
        (["objective=pkd"], {"layers": 2, "hidden": 16, "heads": 2}, None, "pkd_patience.*width is 16"),
        (["objective=alp"], {"layers": 2, "hidden": 16, "heads": 2}, None, "alp.*width is 16"),
        (["objective=minilmv2", "objective.params.relation_heads=5"], None, None,
         "relation_heads=5.*divisor of 32 and 32"),
        (["objective=minilm", "objective.params.teacher_layer=7"], None, None, "teacher_layer=7 but the teacher has 6"),
        (["objective=tinybert", "mapping=skip"], {"layers": 8, "hidden": 32, "heads": 2}, None,
         "the student has 8, the teacher 6"),
        (["objective=tinybert", "mapping=mean"], {"layers": 8, "hidden": 32, "heads": 2}, None,
         "8 matched student layers .* teacher has only 6"),
        (["objective=two_stage_logit", "mapping=mean"], None, None,
         "hidden_mse.*mapping=mean combines teacher layers.*uniform, skip, last, first, random"),
        (["objective=tinybert", "mapping=attention"], None, None, "tinybert_attention.*mapping=attention"),
        (["objective=comb", "mapping=concat", "objective.params.match_last=true"], {"layers": 1, "hidden": 32,
                                                                                   "heads": 2}, None, None),
    ],
)
def test_constraints_fail_before_training(overrides, s, t, match) -> None:
    if match is None:  # a working control case
        objective_for(*overrides, s=s, t=t)
        return
    with pytest.raises(ValueError, match=match):
        objective_for(*overrides, s=s, t=t)


def test_projection_lifts_the_width_constraint() -> None:
    small = {"layers": 2, "hidden": 16, "heads": 2}
    for o in ("distilbert", "pkd"):
        obj = objective_for(f"objective={o}", "objective.params.projection=shared", s=small)
        assert obj.stage_parameters(0)  # the projection is trained


def test_objectives_choose_their_maps_unless_the_group_is_chosen() -> None:
    assert objective_for("objective=alp").layer_pairs == [[0, [0]], [1, [1, 2, 3, 4, 5, 6]]]
    assert objective_for("objective=alp", "objective.params.buckets=po", s={"layers": 4, "hidden": 32, "heads": 2},
                         t={"layers": 12, "hidden": 32, "heads": 2}).layer_pairs == \
        [[0, [0]], [1, [1, 2, 3, 4, 5]], [2, [5, 6, 7, 8, 9]], [3, [9, 10, 11, 12]]]
    assert objective_for("objective=alp", "+mapping.params.temperature=sqrt_d").maps[
        "map_attention_nolast"].temperature == "sqrt_d"
    assert objective_for("objective=alp", "mapping=mean").maps["map_nolast"].strategy == "mean"
    assert objective_for("objective=alp", "objective.params.mapping=null").maps["map_nolast"].strategy == "uniform"
    assert objective_for("objective=pkd").layer_pairs == [[0, 0], [1, 3]]  # PKD-skip, last layer unmatched
    assert objective_for("objective=comb").maps["map_concat_nolast"].rows[-1] == Row(1, (1, 2, 3, 4, 5, 6))
    assert objective_for("objective=tinybert").layer_pairs == [[0, 0], [1, 3], [2, 6]]


def test_learnable_map_in_the_objective_is_trained_logged_and_shared() -> None:
    obj = objective_for("objective=tinybert", "mapping=learnable", "mapping.init=last", "mapping.lr=1e-3")
    lmap = obj.maps["map"]
    assert lmap.lr_scale == pytest.approx(1e-3 / 5e-5)
    params = obj.stage_parameters(0)
    assert any(p is lmap.phi for p in params)
    assert not any(p is lmap.phi for p in obj.stage_parameters(1))  # the prediction stage does not train θ
    # embedding and hidden terms share one projection (TinyBERT's single W)
    assert len(obj.term_modules) == 1 and len([p for p in params if p.dim() == 2 and p is not lmap.phi]) == 1
    logged = obj.log_values(0)
    assert logged["map/s1/t3"] == pytest.approx(math.exp(1) ** 2 / (2 + math.exp(1) ** 2), rel=1e-5)
    assert set(logged) == {f"map/s{s}/t{t}" for s, b in ((1, (1, 2, 3)), (2, (4, 5, 6))) for t in b}
    # gradients from the hidden and attention losses reach θ through the objective
    s, t = rand_features(d=32, heads=2, layers=2, grad=True), rand_features(d=32, heads=2, layers=6, seed=1)
    s = Features(logits=s.logits.float(), attention_mask=s.attention_mask,
                 hidden_states=tuple(h.float() for h in s.hidden_states), extra=s.extra)
    t = Features(logits=t.logits.float(), attention_mask=t.attention_mask,
                 hidden_states=tuple(h.float() for h in t.hidden_states), extra=t.extra)
    for rec in (s.extra["attention_inputs"], t.extra["attention_inputs"]):
        rec._raw = {k: [x.float() for x in v] for k, v in rec._raw.items()}
    total, values = obj(0, s, t, {}, step=0)
    total.backward()
    assert lmap.phi.grad is not None and lmap.phi.grad.abs().sum() > 0
    assert set(values) == {"tinybert_embedding", "tinybert_hidden", "tinybert_attention"}


# ---------------------------------------------------------------------------------- end to end

SMALL = ["task=toy", "task.toy.num_train=64", "task.toy.num_validation=32", "train.epochs=1",
         "train.checkpoint_every_steps=null", "logger.log_every_steps=1"]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layer_kd_cache")


def _run(run_dir: Path, cache: Path, *overrides: str):
    from kdrun.app.run import run

    out = run(compose([*TINY, *SMALL, f"cache_dir={cache}", *overrides]), run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, lines


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_end_to_end(objective, tmp_path: Path, shared_cache: Path) -> None:
    extra = ["objective.params.relation_heads=4"] if objective == "minilmv2" else []
    out, lines = _run(tmp_path, shared_cache, f"objective={objective}", *extra)
    plans = plan_stages(compose([f"objective={objective}", *extra]).objective)
    logged = set().union(*lines)
    for plan in plans:
        assert {f"train/{t.key}" for t in plan.terms} <= logged
    train = [v for line in lines for k, v in line.items() if k.startswith("train/")]
    assert train and all(math.isfinite(v) for v in train)
    assert [s["stage"] for s in out["stages"]] == [p.name for p in plans]
    assert_kept_best(out, n=32)


def test_learnable_map_run_logs_theta_checkpoints_it_and_plots(tmp_path: Path, shared_cache: Path) -> None:
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    _, lines = _run(run_dir, shared_cache, "objective=tinybert", "mapping=learnable", "mapping.lr=1e-2",
                    "train.checkpoint_every_steps=2")
    theta = [line for line in lines if "objective/map/s1/t1" in line]
    assert len(theta) >= 2
    first, last = theta[0], theta[-1]
    assert first["objective/map/s1/t1"] + first["objective/map/s1/t2"] == pytest.approx(1.0, abs=1e-6)
    assert last["objective/map/s1/t1"] != pytest.approx(0.5, abs=1e-4)  # θ moved from its uniform start
    saved = load_file(str(run_dir / "checkpoints" / "last" / "objective.safetensors"))
    assert saved["maps.map.phi"].shape == (3, 2)  # rows: embeddings (one choice), (1, 2), (3, 4)
    written = load_script("plots/maps").main([str(run_dir), "--out", str(tmp_path / "pics")])
    assert [p.name for p in written] == ["map_weights.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_alp_run_plots_attention_per_example(tmp_path: Path, shared_cache: Path) -> None:
    run_dir = tmp_path / "alp"
    out, lines = _run(run_dir, shared_cache, "objective=alp")
    assert any("objective/map_attention_nolast/s1/t4" in line for line in lines)
    learnt = out["stages"][0]["map"]  # the final α and its entropy, in results.json
    layers = sorted(k for k in learnt if k.startswith("map_attention_nolast/s1/t"))
    assert len(layers) >= 2 and sum(learnt[k] for k in layers) == pytest.approx(1.0, abs=1e-4)
    assert 0.0 <= learnt["map_attention_nolast/s1/entropy"] <= math.log(len(layers)) + 1e-6
    written = load_script("plots/maps").main([str(run_dir), "--examples", "5"])
    assert sorted(p.name for p in written) == ["alp_attention.png", "map_attention_nolast_weights.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    assert OmegaConf.create(out["config"]).mapping.name == "uniform"  # the objective chose attention itself
