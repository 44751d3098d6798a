"""MGSKD: each term against a naive implementation written here (loops over heads, examples, rows and
triples; difference vectors for angles), salient selection on a constructed attention pattern,
zero loss for identical models, projection, checks, the prediction stage, configs, and an
end-to-end two-stage run with tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kdrun.engine.objective import plan_stages
from kdrun.losses import get_loss
from kdrun.losses import mgskd as mgskd_module
from kdrun.losses.mgskd import MGSKDModule, pair_mse, salient_selection
from kdrun.losses.registry import LossContext
from kdrun.models.features import Features
from tests.conftest import assert_kept_best, compose
from tests.test_spans import write_corpus

PAIRS = [(0, 0), (1, 2), (2, 4)]  # 2-layer student of a 4-layer teacher, embeddings included


# ------------------------------------------------------------------------------- naive reference

def naive_interactions(x: torch.Tensor, m: int) -> torch.Tensor:
    """x (n, d) -> (m, n, n), one head at a time."""
    dh = x.shape[-1] // m
    return torch.stack([x[:, h * dh:(h + 1) * dh] @ x[:, h * dh:(h + 1) * dh].T / math.sqrt(dh) for h in range(m)])


def naive_pair_mse(xs, xt, valid_rows, m) -> torch.Tensor:
    """xs/xt: lists (per example) of (n, d) points; valid_rows: list of index lists."""
    total, count = 0.0, 0
    for s, t, idx in zip(xs, xt, valid_rows):
        ps, pt = naive_interactions(s[idx], m), naive_interactions(t[idx], m)
        total = total + ((ps - pt) ** 2).sum()
        count += ps.numel()
    return total / max(count, 1)


def naive_select(t: torch.Tensor, idx: list[int], m: int, k1: int, k2: int) -> list[tuple[int, list[int]]]:
    """(vertex, neighbours) in point indices, by the paper's salient scores on teacher points t (n, d)."""
    p = naive_interactions(t, m)
    score = {j: 0.0 for j in idx}
    att = {}
    for h in range(m):
        for i in idx:
            row = torch.softmax(torch.stack([p[h, i, j] for j in idx]), 0)
            for a, j in enumerate(idx):
                att[h, i, j] = float(row[a])
                score[j] += float(row[a])
    verts = sorted(idx, key=lambda j: -score[j])[:k1]
    out = []
    for v in verts:
        local = {j: sum(att[h, v, j] for h in range(m)) for j in idx if j != v}
        out.append((v, sorted(local, key=lambda j: -local[j])[:k2]))
    return out


def naive_cos(x: torch.Tensor, v: int, a: int, b: int) -> torch.Tensor:
    ea, eb = x[a] - x[v], x[b] - x[v]
    if ea.norm() == 0 or eb.norm() == 0:
        return x.new_zeros(())
    return (ea / ea.norm()) @ (eb / eb.norm())


def huber(d: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    return 0.5 * d * d / beta if abs(float(d.detach())) < beta else abs(d) - 0.5 * beta


def naive_salient_angles(xs, xt, valid_rows, m, k1, k2, beta=1.0) -> torch.Tensor:
    total, count = 0.0, 0
    for s, t, idx in zip(xs, xt, valid_rows):
        for v, nbs in naive_select(t, idx, m, k1, k2):
            for a in nbs:
                for b in nbs:
                    total = total + huber(naive_cos(s, v, a, b) - naive_cos(t, v, a, b), beta)
                    count += 1
    return total / max(count, 1)


def naive_sample_angles(vs: torch.Tensor, vt: torch.Tensor, m: int, beta=1.0) -> torch.Tensor:
    """All triples (vertex j, i != j, k != j) among the B samples, in each head."""
    B = vs.shape[0]
    ds, dt = vs.shape[1] // m, vt.shape[1] // m  # head widths of student and teacher
    total, count = 0.0, 0
    for h in range(m):
        s, t = vs[:, h * ds:(h + 1) * ds], vt[:, h * dt:(h + 1) * dt]
        for j in range(B):
            for i in range(B):
                for k in range(B):
                    if i != j and k != j:
                        total = total + huber(naive_cos(s, j, i, k) - naive_cos(t, j, i, k), beta)
                        count += 1
    return total / max(count, 1)


# ---------------------------------------------------------------------------------------- inputs

def make_inputs(seed: int = 0, B: int = 3, n: int = 9, ds: int = 16, dt: int = 24):
    g = torch.Generator().manual_seed(seed)
    hs = tuple(torch.randn(B, n, ds, generator=g, dtype=torch.float64) for _ in range(3))
    ht = tuple(torch.randn(B, n, dt, generator=g, dtype=torch.float64) for _ in range(5))
    lengths = [9, 6, 4][:B]
    mask = torch.zeros(B, n, dtype=torch.long)
    for b, L in enumerate(lengths):
        mask[b, :L] = 1
    # example 0: 4 spans; example 1: 3 spans (one a single token); example 2: 2 spans -> left out
    spans = torch.full((B, 4, 2), -1, dtype=torch.long)
    spans[0] = torch.tensor([[1, 3], [3, 4], [4, 8], [2, 7]])
    spans[1, :3] = torch.tensor([[1, 2], [2, 5], [1, 5]])
    if B > 2:
        spans[2, :2] = torch.tensor([[1, 2], [2, 3]])
    s = Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=hs, spans=spans)
    t = Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=ht)
    return s, t, lengths


def ctx(module=None, pairs=PAIRS) -> LossContext:
    return LossContext(num_labels=2, layer_pairs=pairs, module=module)


def call(name, s, t, module=None, pairs=PAIRS, **params):
    return get_loss(name).fn(s, t, {}, ctx(module, pairs), **params)


# --------------------------------------------------------------------------------- terms vs naive

@pytest.mark.parametrize("pair,angle", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("k1,k2,m", [(20, 20, 4), (3, 2, 4), (3, 2, 8)])  # m 4: the n x n form, 8: the kernel
def test_token_term_matches_naive(pair, angle, k1, k2, m) -> None:
    s, t, lengths = make_inputs()
    got = call("mgskd_token", s, t, heads=m, k1=k1, k2=k2, pair=pair, angle=angle)
    want = 0.0
    for si, ti in PAIRS[:2]:  # boundary 2: student layers 0 and 1
        xs, xt = list(s.hidden_states[si]), list(t.hidden_states[ti])
        rows = [list(range(L)) for L in lengths]
        if pair:
            want = want + naive_pair_mse(xs, xt, rows, m)
        if angle:
            want = want + naive_salient_angles(xs, xt, rows, m, k1, k2)
    assert float(got) == pytest.approx(float(want), rel=1e-9)


@pytest.mark.parametrize("m,n,direct", [(1, 9, True), (4, 9, True), (8, 9, False), (8, 5, False), (2, 30, False)])
def test_pair_mse_both_forms_match_naive(m, n, direct, monkeypatch) -> None:
    """n points against a head's widths a + b (16/m + 24/m): the n x n form below, the (a+b)² kernel
    form at or above; both equal the loops over heads and examples, padded rows included."""
    calls = []
    real = mgskd_module._pair_sq_direct
    monkeypatch.setattr(mgskd_module, "_pair_sq_direct", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(n + m)
    xs, xt = torch.randn(3, n, 16, generator=g, dtype=torch.float64), torch.randn(3, n, 24, generator=g,
                                                                                  dtype=torch.float64)
    lengths = [n, n - 2, 1]
    mask = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    want = naive_pair_mse(list(xs), list(xt), [list(range(L)) for L in lengths], m)
    assert float(pair_mse(xs, xt, mask, m)) == pytest.approx(float(want), rel=1e-10)
    assert bool(calls) == direct
    got32 = pair_mse(xs.float(), xt.float(), mask, m)
    assert got32.dtype == torch.float32 and float(got32) == pytest.approx(float(want), rel=1e-5)


def naive_span_points(h: torch.Tensor, spans: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for b in range(h.shape[0]):
        pts = [h[b, s:e].mean(0) for s, e in spans[b].tolist() if s >= 0]
        out.append(torch.stack(pts) if pts else h.new_zeros(0, h.shape[-1]))
    return out


@pytest.mark.parametrize("pair,angle", [(True, True), (False, True), (True, False)])
def test_span_term_matches_naive(pair, angle) -> None:
    s, t, _ = make_inputs(1)
    m = 4
    got = call("mgskd_span", s, t, heads=m, k1=2, k2=2, pair=pair, angle=angle)
    want = 0.0
    for si, ti in PAIRS[:2]:
        ps, pt = naive_span_points(s.hidden_states[si], s.spans), naive_span_points(t.hidden_states[ti], s.spans)
        keep = [b for b in range(len(ps)) if len(ps[b]) >= 3]  # example 2 has 2 spans: out of the span loss
        assert keep == [0, 1]
        ps, pt = [ps[b] for b in keep], [pt[b] for b in keep]
        rows = [list(range(len(p))) for p in ps]
        if pair:
            want = want + naive_pair_mse(ps, pt, rows, m)
        if angle:
            want = want + naive_salient_angles(ps, pt, rows, m, 2, 2)
    assert float(got) == pytest.approx(float(want), rel=1e-9)


def test_span_term_without_enough_spans_is_zero_with_a_graph() -> None:
    s, t, _ = make_inputs(2)
    s.spans[:, 2:] = -1  # nobody has 3 spans
    hs = tuple(h.clone().requires_grad_(True) for h in s.hidden_states)
    s.hidden_states = hs
    val = call("mgskd_span", s, t, heads=4)
    assert float(val.detach()) == 0.0
    val.backward()  # connected to the graph, so a batch without spans does not break the step
    assert all(h.grad is None or torch.all(h.grad == 0) for h in hs)


@pytest.mark.parametrize("pair", [False, True])
def test_sample_term_matches_naive(pair) -> None:
    s, t, lengths = make_inputs(3, B=3)
    m = 4
    got = call("mgskd_sample", s, t, heads=m, pair=pair)
    want = 0.0
    for si, ti in PAIRS[2:]:  # boundary 2: student layer 2
        vs = torch.stack([s.hidden_states[si][b, :L].mean(0) for b, L in enumerate(lengths)])
        vt = torch.stack([t.hidden_states[ti][b, :L].mean(0) for b, L in enumerate(lengths)])
        want = want + naive_sample_angles(vs, vt, m)
        if pair:
            want = want + naive_pair_mse([vs], [vt], [list(range(3))], m)
    assert float(got) == pytest.approx(float(want), rel=1e-9)


def test_hierarchy_and_boundary() -> None:
    s, t, lengths = make_inputs(4)
    # boundary 1: tokens on student layer 0 only; samples on layers 1 and 2
    tok = call("mgskd_token", s, t, heads=4, boundary=1)
    tok0 = call("mgskd_token", s, t, heads=4, pairs=[(0, 0)])
    assert float(tok) == pytest.approx(float(tok0))
    sam = call("mgskd_sample", s, t, heads=4, boundary=1)
    sam12 = call("mgskd_sample", s, t, heads=4, pairs=PAIRS[1:], boundary=0)
    assert float(sam) == pytest.approx(float(sam12))
    # hierarchical=false: every layer pair
    all_tok = call("mgskd_token", s, t, heads=4, hierarchical=False)
    parts = sum(float(call("mgskd_token", s, t, heads=4, pairs=[p], hierarchical=False)) for p in PAIRS)
    assert float(call("mgskd_token", s, t, heads=4, pairs=[PAIRS[2]])) == 0.0  # no layer below M
    assert float(all_tok) == pytest.approx(parts)


# ---------------------------------------------------------------------------------- selection

def test_salient_selection_on_a_constructed_pattern() -> None:
    # every (valid) query attends column 3 most, then 1, then 0; query 3 attends 4 most of all.
    # Column 5 is padding with a huge logit: it must never be picked.
    B, m, n = 2, 2, 6
    row = torch.tensor([1.0, 3.0, 0.0, 5.0, 0.0, 100.0])
    pt = row.expand(B, m, n, n).clone()
    pt[0, :, 3, 4] = 8.0
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    vert, nb, valid = salient_selection(pt, mask, k1=3, k2=2)
    # received attention (per head): col 3 ≈ 4*0.857 + 0.047, col 4 ≈ 4*0.006 + 0.945, col 1 ≈ 0.47
    assert vert[0].tolist() == [3, 4, 1]
    assert nb[0].tolist() == [[4, 1], [3, 1], [3, 0]]
    assert valid[0].all()
    # example 1 has 2 valid points: vertices 1 then 0 (each attended by both queries), one
    # neighbour each, the third vertex slot and the second neighbour slots are invalid
    assert vert[1, :2].tolist() == [1, 0]
    assert nb[1, 0, 0] == 0 and nb[1, 1, 0] == 1
    assert valid[1].tolist() == [[True, False], [True, False], [False, False]]
    # k larger than the points: clipped
    v2, n2, _ = salient_selection(pt, mask, k1=20, k2=20)
    assert v2.shape == (2, 6) and n2.shape == (2, 6, 5)


def test_selection_is_the_teachers() -> None:
    """Swapping the student's points leaves the chosen triples alone: only the teacher picks them."""
    s, t, _ = make_inputs(5)
    from kdrun.losses.mgskd import pair_interactions

    mask = s.attention_mask.bool()
    a = salient_selection(pair_interactions(t.hidden_states[0], 4), mask, 3, 2)
    got = call("mgskd_token", s, t, heads=4, k1=3, k2=2, pair=False, pairs=[(0, 0)])
    rows = [list(range(int(L))) for L in mask.sum(1)]
    want = naive_salient_angles(list(s.hidden_states[0]), list(t.hidden_states[0]), rows, 4, 3, 2)
    assert float(got) == pytest.approx(float(want), rel=1e-9)
    assert a[0].shape == (3, 3)


# ----------------------------------------------------------------------------- properties, module

@pytest.mark.parametrize("name", ["mgskd_token", "mgskd_span", "mgskd_sample"])
def test_zero_loss_when_student_equals_teacher(name) -> None:
    s, t, _ = make_inputs(6, ds=24, dt=24)
    same = Features(logits=s.logits, attention_mask=s.attention_mask, hidden_states=t.hidden_states[:3],
                    spans=s.spans)
    val = call(name, same, t, heads=4, pairs=[(0, 0), (1, 1), (2, 2)], pair=True)
    assert float(val) == pytest.approx(0.0, abs=1e-12)
    diff = call(name, s, t, heads=4, pairs=[(0, 0), (1, 1), (2, 2)], pair=True)
    assert float(diff) > 1e-3


def test_projection_module_and_gradients() -> None:
    s, t, lengths = make_inputs(7, ds=20, dt=24)  # 20 is not divisible by 8 heads: projected to 24
    spec = get_loss("mgskd_token")
    s_info, t_info = {"hidden": 20, "layers": 2}, {"hidden": 24, "layers": 4}
    module = spec.build_module(s_info, t_info, PAIRS, heads=8).double()
    assert module.proj is not None and module.proj.weight.shape == (24, 20)
    assert spec.build_module({"hidden": 16}, t_info, PAIRS, heads=8).proj is None
    assert spec.build_module({"hidden": 16}, t_info, PAIRS, heads=8, project="always").proj is not None
    hs = tuple(h.clone().requires_grad_(True) for h in s.hidden_states)
    s.hidden_states = hs
    context = ctx(module)
    val = get_loss("mgskd_token").fn(s, t, {}, context, heads=8)
    want = 0.0
    for si, ti in PAIRS[:2]:
        xs = [module.proj(x) for x in s.hidden_states[si]]
        rows = [list(range(L)) for L in lengths]
        want = want + naive_pair_mse(xs, list(t.hidden_states[ti]), rows, 8) + naive_salient_angles(
            xs, list(t.hidden_states[ti]), rows, 8, 20, 20)
    assert float(val.detach()) == pytest.approx(float(want), rel=1e-9)
    val.backward()
    assert torch.isfinite(hs[0].grad).all() and hs[0].grad.abs().sum() > 0
    assert module.proj.weight.grad is not None and module.proj.weight.grad.abs().sum() > 0
    logged = context.parts  # the term's parts, for the step's meters (the module keeps none)
    assert set(logged) == {"pair", "angle"}
    assert float(logged["pair"] + logged["angle"]) == pytest.approx(float(val.detach()))
    assert not hasattr(module, "log_values")


def test_fp32_under_autocast_and_finite_with_duplicates() -> None:
    s, t, _ = make_inputs(8, ds=16, dt=16)
    s.hidden_states = tuple(h.float() for h in s.hidden_states)
    t.hidden_states = tuple(h.float() for h in t.hidden_states)
    s.hidden_states[0][:, 1] = s.hidden_states[0][:, 2]  # duplicated tokens: degenerate angles
    t.hidden_states[0][:, 1] = t.hidden_states[0][:, 2]
    hs = tuple(h.clone().requires_grad_(True) for h in s.hidden_states)
    s.hidden_states = hs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        vals = [call(n, s, t, heads=4) for n in ("mgskd_token", "mgskd_span", "mgskd_sample")]
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in vals)
    sum(vals).backward()
    assert all(torch.isfinite(h.grad).all() for h in hs if h.grad is not None)


@pytest.mark.parametrize("name,params,s_w,t_w,pairs,match", [
    ("mgskd_token", {"heads": 7}, 16, 24, PAIRS, "teacher's width 24 is not divisible by heads=7"),
    ("mgskd_token", {"heads": 8, "project": "never"}, 20, 24, PAIRS, "student's width 20 .* project=never"),
    ("mgskd_token", {"heads": 8, "project": "maybe"}, 16, 24, PAIRS, "project='maybe' must be one of"),
    ("mgskd_token", {"heads": 8, "boundary": 0}, 16, 24, PAIRS, "no student layer below the boundary M=0"),
    ("mgskd_sample", {"heads": 8, "boundary": 3}, 16, 24, PAIRS, "no student layer from the boundary M=3"),
    ("mgskd_span", {"heads": 8, "pair": False, "angle": False}, 16, 24, PAIRS,
     "both relation types of mgskd_span are off"),
    ("mgskd_span", {"heads": 8, "k1": 0}, 16, 24, PAIRS, "k1=0 must be a positive integer"),
    ("mgskd_prediction", {"regression": "gold"}, 16, 24, PAIRS, "regression='gold' must be finetune"),
])
def test_bad_settings_fail_clearly(name, params, s_w, t_w, pairs, match) -> None:
    with pytest.raises(ValueError, match=match):
        get_loss(name).check({"hidden": s_w, "layers": 2}, {"hidden": t_w, "layers": 4}, pairs, **params)


def test_prediction_stage() -> None:
    zs, zt = torch.randn(4, 3), torch.randn(4, 3)
    s, t = Features(logits=zs, attention_mask=torch.ones(4, 2)), Features(logits=zt, attention_mask=torch.ones(4, 2))
    fn = get_loss("mgskd_prediction").fn
    val = fn(s, t, {"labels": torch.tensor([0, 1, 2, 0])}, LossContext(num_labels=3), temperature=2.0)
    pt, log_ps = F.softmax(zt / 2, -1), F.log_softmax(zs / 2, -1)
    assert float(val) == pytest.approx(float(4 * (pt * (pt.log() - log_ps)).sum(-1).mean()), rel=1e-6)
    # regression (STS-B): the gold score by default (the paper fine-tunes), the teacher's output with kd
    rs, rt = Features(logits=zs[:, :1], attention_mask=s.attention_mask), Features(logits=zt[:, :1],
                                                                                     attention_mask=s.attention_mask)
    gold = torch.tensor([0.5, 4.0, 2.0, 1.0])
    reg = LossContext(num_labels=1)
    assert float(fn(rs, rt, {"labels": gold}, reg)) == pytest.approx(float(((zs[:, 0] - gold) ** 2).mean()))
    assert float(fn(rs, rt, {"labels": gold}, reg, regression="kd")) == pytest.approx(
        float(((zs[:, 0] - zt[:, 0]) ** 2).mean()))


def test_module_state_is_only_the_projection() -> None:
    assert list(MGSKDModule(20, 24, True).state_dict()) == ["proj.weight", "proj.bias"]
    assert list(MGSKDModule(16, 24, False).state_dict()) == []


# ------------------------------------------------------------------------------------------ config

def test_objective_config_defaults_and_switches() -> None:
    cfg = compose(["objective=mgskd"])
    plans = plan_stages(cfg.objective)
    assert [p.name for p in plans] == ["structural", "prediction"]
    st = {t.key: t for t in plans[0].terms}
    assert {k: v.weight for k, v in st.items()} == {"mgskd_token": 1.0, "mgskd_span": 1.0, "mgskd_sample": 4.0}
    assert st["mgskd_token"].params.heads == 64 and st["mgskd_token"].params.k1 == 20
    assert st["mgskd_token"].params.k2 == 20 and st["mgskd_token"].params.boundary == 2
    assert st["mgskd_sample"].params.pair is False and st["mgskd_span"].params.min_spans == 3
    assert plans[0].cfg["lr"] == 1e-5 and plans[0].cfg["epochs"] == 20 and not plans[0].cfg["select_best"]
    assert "spans" in plans[0].student_needs and "spans" not in plans[0].teacher_needs
    assert [t.key for t in plans[1].terms] == ["mgskd_prediction"]
    assert plans[1].terms[0].params.as_dict() == {"temperature": 1.0, "regression": "finetune"}
    off = plan_stages(compose(["objective=mgskd", "objective.params.span=false", "objective.params.sample_pair=true",
                               "objective.params.lambda_sample=2"]).objective)
    assert [(t.key, t.weight, t.params.pair) for t in off[0].terms] == [
        ("mgskd_token", 1.0, True), ("mgskd_sample", 2.0, True)]
    assert "spans" not in off[0].student_needs


# ------------------------------------------------------------------------------------- end to end

def test_two_stage_run_logs_each_granularity(run_cfg, tmp_path: Path) -> None:
    from kdrun.app.run import run

    corpus = write_corpus(tmp_path / "conll")
    cfg = run_cfg("objective=mgskd", "objective.params.heads=8", "objective.params.structural_epochs=1",
                  "objective.params.prediction_epochs=1", "objective.params.batch_size=16",
                  "objective.params.structural_lr=1e-3", "objective.params.prediction_lr=1e-3",
                  f"spans.corpus_dir={corpus}")
    out = run(cfg, tmp_path / "run")
    assert [st["stage"] for st in out["stages"]] == ["structural", "prediction"]
    assert [list(p) for p in out["layer_pairs"]] == [[0, 0], [1, 2], [2, 4]]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*lines)
    assert {"train/mgskd_token", "train/mgskd_span", "train/mgskd_sample", "train/mgskd_prediction",
            "train/mgskd_token/pair", "train/mgskd_token/angle", "train/mgskd_span/pair",
            "train/mgskd_span/angle", "train/mgskd_sample/angle"} <= keys
    vals = [v for line in lines for k, v in line.items() if k.startswith(("train/", "objective/"))]
    assert vals and all(math.isfinite(v) for v in vals)
    structural = [x for x in lines if x.get("stage") == "structural" and "train/mgskd_span" in x]
    assert structural and all(x["train/mgskd_span"] > 0 for x in structural)
    assert_kept_best(out, n=64)


@pytest.mark.parametrize("heads", [4, 8])  # both forms of the pair MSE
def test_span_counts_padded_to_a_bucket_leave_the_span_loss_unchanged(heads) -> None:
    """A compiled step pads span counts to a multiple (kdrun.tasks.data.batches.SPAN_MULTIPLE): the
    extra -1 spans are masked out, so the span term is the same to rounding."""
    from kdrun.tasks.data.batches import SPAN_MULTIPLE, pad_spans

    s, t, _ = make_inputs()
    want = call("mgskd_span", s, t, heads=heads)
    rows = [[p for p in row if p[0] >= 0] for row in s.spans.tolist()]
    padded = pad_spans(rows, SPAN_MULTIPLE)
    assert padded.shape[1] == SPAN_MULTIPLE and torch.equal(padded[:, :4], s.spans)
    s.spans = padded
    assert float(call("mgskd_span", s, t, heads=heads)) == pytest.approx(float(want), rel=1e-12)
    assert pad_spans(rows, 0).shape[1] == 4 and pad_spans([[[0, 1]] * 9], 8).shape[1] == 16
