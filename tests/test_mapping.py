"""The mapping group: tables for 12→4, 12→6, 6→2 and 12→8 of every strategy (typed out by hand from
the papers' rules, not recomputed), random draws, learnable θ, combination targets, errors."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kdrun.models.mapping import LayerMap, MappingSpec, Row, build_rows, make_buckets
from tests.conftest import compose

DEPTHS = [(12, 4), (12, 6), (6, 2), (12, 8)]  # (teacher, student)

# Buckets over transformer layers, one per student layer (NO: floor(j*Lt/m) boundaries; PO: each
# bucket also takes the next bucket's first layer).
NO = {
    (12, 4): [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)],
    (12, 6): [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)],
    (6, 2): [(1, 2, 3), (4, 5, 6)],
    (12, 8): [(1,), (2, 3), (4,), (5, 6), (7,), (8, 9), (10,), (11, 12)],
}
PO = {
    (12, 4): [(1, 2, 3, 4), (4, 5, 6, 7), (7, 8, 9, 10), (10, 11, 12)],
    (12, 6): [(1, 2, 3), (3, 4, 5), (5, 6, 7), (7, 8, 9), (9, 10, 11), (11, 12)],
    (6, 2): [(1, 2, 3, 4), (4, 5, 6)],
    (12, 8): [(1, 2), (2, 3, 4), (4, 5), (5, 6, 7), (7, 8), (8, 9, 10), (10, 11), (11, 12)],
}
UNIFORM = {  # CKD's gcd rule worked out by hand, embeddings included
    (12, 4): [(0, 0), (1, 3), (2, 6), (3, 9), (4, 12)],
    (12, 6): [(0, 0), (1, 2), (2, 4), (3, 6), (4, 8), (5, 10), (6, 12)],
    (6, 2): [(0, 0), (1, 3), (2, 6)],
    (12, 8): [(0, 0), (2, 3), (4, 6), (6, 9), (8, 12)],
}
SKIP = {  # teacher layer floor(j * Lt / Ls)
    (12, 4): [3, 6, 9, 12],
    (12, 6): [2, 4, 6, 8, 10, 12],
    (6, 2): [3, 6],
    (12, 8): [1, 3, 4, 6, 7, 9, 10, 12],
}
FIRST_NO = {(12, 4): [1, 4, 7, 10], (12, 6): [1, 3, 5, 7, 9, 11], (6, 2): [1, 4], (12, 8): [1, 2, 4, 5, 7, 8, 10, 11]}
LAST_NO = {(12, 4): [3, 6, 9, 12], (12, 6): [2, 4, 6, 8, 10, 12], (6, 2): [3, 6], (12, 8): [1, 3, 4, 6, 7, 9, 10, 12]}
LAST_PO = {(12, 4): [4, 7, 10, 12], (12, 6): [3, 5, 7, 9, 11, 12], (6, 2): [4, 6], (12, 8): [2, 4, 5, 7, 8, 10, 11, 12]}


def table(strategy, lt, ls, **kw):
    return [(r.student, r.teachers) for r in build_rows(strategy, ls, lt, **kw)]


@pytest.mark.parametrize("lt,ls", DEPTHS)
def test_one_to_one_tables(lt, ls) -> None:
    assert [(s, t[0]) for s, t in table("uniform", lt, ls)] == UNIFORM[(lt, ls)]
    assert [(s, t[0]) for s, t in table("uniform", lt, ls, include_embeddings=False)] == UNIFORM[(lt, ls)][1:]
    embed = [(0, (0,))]
    assert table("skip", lt, ls) == embed + [(j + 1, (t,)) for j, t in enumerate(SKIP[(lt, ls)])]
    assert table("first", lt, ls, buckets="no") == embed + [(j + 1, (t,)) for j, t in enumerate(FIRST_NO[(lt, ls)])]
    assert table("last", lt, ls, buckets="no") == embed + [(j + 1, (t,)) for j, t in enumerate(LAST_NO[(lt, ls)])]
    assert table("last", lt, ls, buckets="po", include_embeddings=False) == \
        [(j + 1, (t,)) for j, t in enumerate(LAST_PO[(lt, ls)])]
    # buckets=all: every student layer sees every teacher layer, so first/last are 1 and Lt
    assert {t for _, t in table("first", lt, ls, buckets="all", include_embeddings=False)} == {(1,)}
    assert {t for _, t in table("last", lt, ls, buckets="all", include_embeddings=False)} == {(lt,)}


@pytest.mark.parametrize("lt,ls", DEPTHS)
@pytest.mark.parametrize("strategy", ["random", "mean", "learnable", "attention", "concat"])
def test_bucket_tables(strategy, lt, ls) -> None:
    for kind, want in (("no", NO[(lt, ls)]), ("po", PO[(lt, ls)]), ("all", [tuple(range(1, lt + 1))] * ls)):
        assert table(strategy, lt, ls, buckets=kind, include_embeddings=False) == \
            [(j + 1, b) for j, b in enumerate(want)]
    assert table(strategy, lt, ls, buckets="no")[0] == (0, (0,))  # embeddings: a row of their own


def test_last_student_layer_unmatched_follows_the_papers() -> None:
    # Passban et al. 2021, 12 → 4 with the last student layer unmatched: 3 buckets of 4 (NO), 1-5 / 5-9 / 9-12 (PO),
    # PKD's first-of-bucket 1, 5, 9; PKD-skip keeps k = Lt / Ls = 3
    kw = dict(include_embeddings=False, exclude_last=True)
    assert table("mean", 12, 4, buckets="no", **kw) == [(1, (1, 2, 3, 4)), (2, (5, 6, 7, 8)), (3, (9, 10, 11, 12))]
    assert table("attention", 12, 4, buckets="po", **kw) == [(1, (1, 2, 3, 4, 5)), (2, (5, 6, 7, 8, 9)),
                                                              (3, (9, 10, 11, 12))]
    assert table("first", 12, 4, buckets="no", **kw) == [(1, (1,)), (2, (5,)), (3, (9,))]
    assert table("skip", 12, 4, **kw) == [(1, (3,)), (2, (6,)), (3, (9,))]
    assert table("skip", 12, 6, **kw) == [(j, (2 * j,)) for j in range(1, 6)]  # PKD-skip 2, 4, 6, 8, 10
    assert table("attention", 12, 2, buckets="all", **kw) == [(1, tuple(range(1, 13)))]  # ALP with 2 layers
    assert table("uniform", 12, 4, exclude_last=True) == [(0, (0,)), (1, (3,)), (2, (6,)), (3, (9,))]


# -------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize(
    "strategy,kw,match",
    [
        ("skip", {}, "student has 6, the teacher 4"),
        ("mean", {"buckets": "no"}, "6 matched student layers .* teacher has only 4"),
        ("concat", {"buckets": "po"}, "6 matched student layers .* teacher has only 4"),
        ("mean", {"buckets": "some"}, "mapping.buckets='some' must be one of all, no, po"),
        ("nosuch", {}, "Valid mappings: uniform, skip, last, first, random, mean, learnable, attention, concat"),
    ],
)
def test_mapping_errors_name_the_numbers(strategy, kw, match) -> None:
    with pytest.raises((ValueError, KeyError), match=match):
        build_rows(strategy, 6, 4, **kw)


def test_more_buckets_than_layers_allowed_with_all() -> None:
    assert len(build_rows("mean", 6, 4, buckets="all", include_embeddings=False)) == 6
    assert make_buckets(4, 4, "no") == [(1,), (2,), (3,), (4,)]


def test_spec_checks_keys() -> None:
    with pytest.raises(ValueError, match="mapping.init='first' must be one of uniform, last"):
        MappingSpec(name="learnable", init="first").check()
    with pytest.raises(ValueError, match="mapping.params: mapping 'mean' has no parameter"):
        MappingSpec(name="mean", params={"temperature": 2.0}).check()
    with pytest.raises(ValueError, match="mapping.lr"):
        MappingSpec(name="learnable", lr=-1.0).check()
    with pytest.raises(ValueError, match="nothing is left to match"):
        build_rows("skip", 1, 4, exclude_last=True)


def test_every_mapping_option_composes_to_its_spec() -> None:
    for name in ("uniform", "skip", "first", "last", "random", "mean", "learnable", "attention", "concat"):
        cfg = compose([f"mapping={name}"])
        spec = MappingSpec.from_config(cfg.mapping)
        assert spec.name == name
    assert MappingSpec.from_config(compose(["mapping=mean"]).mapping).buckets == "no"
    assert MappingSpec.from_config(compose(["mapping=mean", "mapping.buckets=po"]).mapping).buckets == "po"


# ------------------------------------------------------------------------------ random draws

def test_random_map_distribution_and_determinism() -> None:
    rows = build_rows("random", 2, 6, buckets="no", include_embeddings=True)
    lmap = LayerMap("random", rows, seed=7)
    n = 6000
    counts = Counter(tuple(lmap.pairs_at(step)) for step in range(n))
    per_layer = {1: Counter(), 2: Counter()}
    for draw, c in counts.items():
        assert draw[0] == (0, 0)  # the embedding row has one choice
        for s, t in draw[1:]:
            per_layer[s][t] += c
    assert set(per_layer[1]) == {1, 2, 3} and set(per_layer[2]) == {4, 5, 6}
    for s in (1, 2):
        for t, c in per_layer[s].items():  # each ≈ 1/3; 5 standard deviations of a binomial
            assert abs(c / n - 1 / 3) < 5 * math.sqrt(1 / 3 * 2 / 3 / n), (s, t, c)
    # independent rows: all 9 combinations appear
    assert len(counts) == 9
    # a step's draw is the same whenever it is asked for (every term, after a resume), and seeded
    assert lmap.pairs_at(123) == LayerMap("random", rows, seed=7).pairs_at(123)
    assert [lmap.pairs_at(s) for s in range(50)] != [LayerMap("random", rows, seed=8).pairs_at(s) for s in range(50)]
    w = lmap.row_weights(5)
    chosen = dict(lmap.pairs_at(5))
    for r, weights in zip(rows, w):
        assert weights.tolist() == [1.0 if t == chosen[r.student] else 0.0 for t in r.teachers]


# ------------------------------------------------------------------------------ learnable θ

def test_learnable_init_and_gradients_reach_theta() -> None:
    rows = build_rows("learnable", 2, 6, buckets="no", include_embeddings=False)
    uni = LayerMap("learnable", rows, init="uniform")
    assert torch.allclose(torch.stack(uni.row_weights()), torch.full((2, 3), 1 / 3))
    last = LayerMap("learnable", rows, init="last")
    e = math.exp(1)
    want = [1 / (2 + e * e), 1 / (2 + e * e), e * e / (2 + e * e)]  # softmax(-1, -1, 1) ≈ (0.11, 0.11, 0.78)
    for w in last.row_weights():
        assert w.tolist() == pytest.approx(want, rel=1e-6)
    assert want[2] == pytest.approx(0.787, abs=1e-3)
    # target = Σ_k softmax(θ)_k h_k; the gradient reaches θ
    g = torch.Generator().manual_seed(0)
    reps = {t: torch.randn(3, 5, generator=g) for t in range(1, 7)}
    tgt = last.target(1, lambda t: reps[t])
    assert torch.allclose(tgt, sum(w * reps[t] for w, t in zip(want, (4, 5, 6))), atol=1e-6)
    (tgt ** 2).sum().backward()
    assert last.phi.grad is not None and last.phi.grad[1].abs().sum() > 0 and last.phi.grad[0].abs().sum() == 0
    logged = last.log_values()
    assert logged["s2/t6"] == pytest.approx(want[2], rel=1e-6) and set(logged) == {
        f"s{s}/t{t}" for s, b in ((1, (1, 2, 3)), (2, (4, 5, 6))) for t in b}


def test_learnable_rows_of_different_sizes_mask_padding() -> None:
    rows = build_rows("learnable", 3, 4, buckets="po", include_embeddings=True)  # (0) (1,2) (2,3) (3,4)
    lmap = LayerMap("learnable", rows, init="last")
    for r, w in zip(rows, lmap.row_weights()):
        assert len(w) == len(r.teachers) and w.sum().item() == pytest.approx(1.0)
    assert lmap.row_weights()[0].tolist() == [1.0]


def test_learnable_theta_moves_at_its_own_lr() -> None:
    """θ = lr_scale * φ with θ's gradient passed to φ: one AdamW step of lr_g on φ moves θ by
    mapping.lr (Adam's first step is lr * sign(grad)), and the gradient clipping sees θ's gradient."""
    rows = build_rows("learnable", 2, 6, buckets="no", include_embeddings=False)
    spec = MappingSpec(name="learnable", buckets="no", include_embeddings=False, lr=1e-2)
    lmap = spec.build(2, 6, stage_lr=1e-4)
    ref = LayerMap("learnable", rows)  # lr_scale 1
    g = torch.Generator().manual_seed(1)
    reps = {t: torch.randn(4, 3, generator=g) for t in range(1, 7)}

    def loss(m):
        return sum((m.target(i, lambda t: reps[t]) * (i + 1.0)).pow(2).sum() for i in range(2))

    loss(lmap).backward()
    loss(ref).backward()
    assert torch.allclose(lmap.phi.grad, ref.phi.grad)  # θ's true gradient
    before = lmap.theta().detach().clone()
    opt = torch.optim.AdamW([lmap.phi], lr=1e-4, weight_decay=0.0)
    opt.step()
    step = (lmap.theta().detach() - before).abs()
    assert torch.allclose(step[lmap.phi.grad != 0], torch.tensor(1e-2), rtol=1e-3)


# --------------------------------------------------------------------------- combinations

def test_mean_attention_and_concat_targets_by_hand() -> None:
    g = torch.Generator().manual_seed(3)
    reps = {t: torch.randn(2, 4, generator=g) for t in range(1, 7)}
    rows = [Row(1, (1, 2, 3)), Row(2, (4, 5, 6))]
    mean = LayerMap("mean", rows)
    assert torch.allclose(mean.target(1, lambda t: reps[t]), (reps[4] + reps[5] + reps[6]) / 3, atol=1e-6)
    cat = LayerMap("concat", rows)
    assert torch.equal(cat.target(0, lambda t: reps[t]), torch.cat([reps[1], reps[2], reps[3]], dim=-1))
    att = LayerMap("attention", rows, temperature=2.0)
    hs = torch.randn(2, 4, generator=g)
    got = att.target(1, lambda t: reps[t], student_rep=hs)
    for b in range(2):  # per example: α_k = exp(h_s·h_k / T) / Σ
        dots = [float(hs[b] @ reps[t][b]) / 2.0 for t in (4, 5, 6)]
        z = sum(math.exp(d) for d in dots)
        want = sum(math.exp(d) / z * reps[t][b] for d, t in zip(dots, (4, 5, 6)))
        assert torch.allclose(got[b], want, atol=1e-5)
    logged = att.log_values()
    assert set(logged) == {"s2/t4", "s2/t5", "s2/t6", "s2/entropy"}
    assert sum(v for k, v in logged.items() if "/t" in k) == pytest.approx(1.0)
    entropies = []  # the mean over examples of −Σ α_k log α_k, by hand
    for b in range(2):
        dots = [float(hs[b] @ reps[t][b]) / 2.0 for t in (4, 5, 6)]
        alpha = [math.exp(d) / sum(math.exp(e) for e in dots) for d in dots]
        entropies.append(-sum(a * math.log(a) for a in alpha))
    assert logged["s2/entropy"] == pytest.approx(sum(entropies) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="needs the student's representation"):
        att.target(0, lambda t: reps[t])
    # sqrt_d: scaled dot products, as attention in a transformer (d = 4 here, so T = 2 as above)
    scaled = LayerMap("attention", rows, temperature="sqrt_d")
    assert torch.allclose(scaled.target(1, lambda t: reps[t], student_rep=hs), got)
    MappingSpec(name="attention", params={"temperature": "sqrt_d"}).check()
    MappingSpec(name="uniform", params={"temperature": 5.0}).check()  # for a term's own attention map
    with pytest.raises(ValueError, match="temperature='hot' must be a number > 0 or sqrt_d"):
        MappingSpec(name="attention", params={"temperature": "hot"}).check()


def test_mapping_typos_fail_before_any_model_loads(run_cfg) -> None:
    from kdrun.app.run import ConfigError, preflight

    # closed sets: the schema refuses them when the config is composed, naming key and choices
    for overrides, reason in (
            (("mapping=mean", "mapping.buckets=nope"), "'nope', expected one of [all, no, po]"),
            (("mapping=learnable", "mapping.init=middle"), "'middle', expected one of [uniform, last]")):
        with pytest.raises(Exception) as e:
            run_cfg(*overrides)
        assert reason in str(e.value.__cause__) and overrides[1].split("=")[0] in str(e.value.__cause__)
    with pytest.raises(ConfigError, match="mapping.lr="):
        preflight(run_cfg("mapping=learnable", "mapping.lr=-1"))
