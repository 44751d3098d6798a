"""Contextual KD: relation kernels against a naive implementation, invariances, degenerate inputs,
the objective's presets, and end-to-end runs with tiny models.

The naive reference below is written the straightforward way on purpose: (n, n, d) difference
tensors, unit vectors, loops over rows, and validity masks built by enumerating indices.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from kdrun.losses import get_loss
from kdrun.losses.registry import LossContext
from kdrun.losses.relations import angle_loss, angle_matrix, pair_loss, pair_relation
from kdrun.models.features import Features
from tests.conftest import REPO, TINY, compose, load_script

LOSSES = ["mse", "l1", "huber", "kl"]
PAIR_OPTIONS = [("l2", False), ("l2", True), ("cosine", False)]
TERMS = ["ckd_wr_pair", "ckd_wr_angle", "ckd_ltr_pair", "ckd_ltr_angle"]


# ------------------------------------------------------------------------------ naive reference

def naive_pair_relation(x: torch.Tensor, phi: str) -> torch.Tensor:
    if phi == "l2":
        return (x[:, :, None, :] - x[:, None, :, :]).norm(dim=-1)
    return F.cosine_similarity(x[:, :, None, :], x[:, None, :, :], dim=-1)


def naive_pair_valid(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    P, n = mask.shape
    v = torch.zeros(P, n, n, dtype=torch.bool)
    for p, i, j in itertools.product(range(P), range(n), range(n)):
        v[p, i, j] = bool(mask[p, i] and mask[p, j]) and i != j and (window is None or abs(i - j) <= window)
    return v


def naive_angles(x: torch.Tensor) -> torch.Tensor:
    """(P, n, d) -> cos[p, j, i, k] of the angle at vertex j between points i and k (0 if degenerate)."""
    diff = x[:, None, :, :] - x[:, :, None, :]  # [p, j, i] = x_i - x_j
    norm = diff.norm(dim=-1, keepdim=True)
    unit = torch.where(norm > 0, diff / norm.clamp_min(1e-300), torch.zeros_like(diff))
    return torch.einsum("pjid,pjkd->pjik", unit, unit)


def naive_triple_valid(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    P, n = mask.shape
    v = torch.zeros(P, n, n, n, dtype=torch.bool)
    for p, j, i, k in itertools.product(range(P), range(n), range(n), range(n)):
        ok = bool(mask[p, i] and mask[p, j] and mask[p, k]) and i != j and k != j
        if window is not None:
            ok = ok and abs(i - j) <= window and abs(k - j) <= window
        v[p, j, i, k] = ok
    return v


def naive_match(rs: torch.Tensor, rt: torch.Tensor, valid: torch.Tensor, loss: str, beta: float) -> torch.Tensor:
    total, count = naive_match_sum(rs, rt, valid, loss, beta)
    return total / count


def naive_match_sum(rs, rt, valid, loss, beta):
    """(summed loss over the valid entries, its mean denominator: entries, or rows for kl)."""
    if loss == "kl":
        m = rs.shape[-1]
        rs, rt, valid = rs.reshape(-1, m), rt.reshape(-1, m), valid.reshape(-1, m)
        total, rows = rs.new_zeros(()), 0
        for r in range(rs.shape[0]):
            v = valid[r]
            if v.any():
                log_ps, log_pt = F.log_softmax(rs[r][v], -1), F.log_softmax(rt[r][v], -1)
                total = total + (log_pt.exp() * (log_pt - log_ps)).sum()
                rows += 1
        return total, rows
    d = (rs - rt)[valid]
    if loss == "mse":
        err = d**2
    elif loss == "l1":
        err = d.abs()
    else:
        err = torch.where(d.abs() < beta, 0.5 * d**2 / beta, d.abs() - 0.5 * beta)
    return err.sum(), valid.sum()


def naive_official_count(mask: torch.Tensor, window: int | None, order: int) -> int:
    """The official code's mask entries, enumerated: each valid point owns its neighbour slots
    (all valid points with no window; positions j-δ..j+δ clamped to the sentence, duplicates and
    the point itself included, with one), and each slot tuple of ``order - 1`` counts once."""
    count = 0
    for p in range(mask.shape[0]):
        real = [j for j in range(mask.shape[1]) if mask[p, j]]
        for j in real:
            slots = real if window is None else [min(max(j + o, 0), len(real) - 1) for o in range(-window, window + 1)]
            count += len(list(itertools.product(slots, repeat=order - 1)))
    return count


def naive_official_pair_sum(xs, xt, mask, phi, loss, window, beta=1.0):
    valid = naive_pair_valid(mask, window)
    return naive_match_sum(naive_pair_relation(xs, phi), naive_pair_relation(xt, phi), valid, loss, beta)[0]


def naive_official_angle_sum(xs, xt, mask, loss, window, beta=1.0):
    valid = naive_triple_valid(mask, window)
    return naive_match_sum(naive_angles(xs), naive_angles(xt), valid, loss, beta)[0]


def naive_pair_loss(xs, xt, mask, phi, normalize, loss, window, beta=1.0):
    valid = naive_pair_valid(mask, window)
    rs, rt = naive_pair_relation(xs, phi), naive_pair_relation(xt, phi)
    if normalize:
        rs = rs / ((rs * valid).sum((1, 2)) / valid.sum((1, 2)))[:, None, None]
        rt = rt / ((rt * valid).sum((1, 2)) / valid.sum((1, 2)))[:, None, None]
    return naive_match(rs, rt, valid, loss, beta)


def naive_angle_loss(xs, xt, mask, loss, window, beta=1.0):
    return naive_match(naive_angles(xs), naive_angles(xt), naive_triple_valid(mask, window), loss, beta)


def naive_token_layers(hidden, layers, mask):
    """(T, l, d) by looping over real tokens."""
    rows = [torch.stack([hidden[layer][b, i] for layer in layers])
            for b in range(mask.shape[0]) for i in range(mask.shape[1]) if mask[b, i]]
    return torch.stack(rows)


# --------------------------------------------------------------------------------------- inputs

def point_sets(P=3, n=9, ds=5, dt=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(P, n, dtype=torch.bool)
    mask[1, 6:] = False  # padding
    mask[2, 3:] = False  # a 3-token sentence: windows reach past its end
    xs = (torch.randn(P, n, ds, generator=g, dtype=dtype) + 2.0).requires_grad_(True)
    xt = torch.randn(P, n, dt, generator=g, dtype=dtype) * 3.0
    return xs, xt, mask


def features(B=3, n=8, ds=6, dt=10, ls=2, lt=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    hs = tuple(torch.randn(B, n, ds, generator=g, dtype=dtype).requires_grad_(True) for _ in range(ls + 1))
    ht = tuple(torch.randn(B, n, dt, generator=g, dtype=dtype) for _ in range(lt + 1))
    s = Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=hs)
    t = Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=ht)
    ctx = LossContext(num_labels=2, layer_pairs=[(0, 0), (1, 2), (2, 4)])
    return s, t, ctx


TERM_PARAMS = {  # every option of every term
    "ckd_wr_pair": [dict(phi=p, normalize=nz, loss=lo, window=w)
                    for (p, nz), lo, w in itertools.product(PAIR_OPTIONS, LOSSES, [None, 2])],
    "ckd_wr_angle": [dict(loss=lo, window=w) for lo, w in itertools.product(LOSSES, [None, 2])],
    "ckd_ltr_pair": [dict(phi=p, normalize=nz, loss=lo) for (p, nz), lo in itertools.product(PAIR_OPTIONS, LOSSES)],
    "ckd_ltr_angle": [dict(loss=lo) for lo in LOSSES],
}
ALL_TERM_CASES = [(name, p) for name, ps in TERM_PARAMS.items() for p in ps]


def call(name, s, t, ctx, **params):
    return get_loss(name).fn(s, t, None, ctx, **params)


def assert_close_with_grad(a, b, x, rtol=1e-5):
    (ga,) = torch.autograd.grad(a, x, retain_graph=True)
    (gb,) = torch.autograd.grad(b, x, retain_graph=True)
    assert torch.isclose(a, b, rtol=rtol, atol=0), (a.item(), b.item())
    assert (ga - gb).abs().max() <= rtol * gb.abs().max(), ((ga - gb).abs().max().item(), gb.abs().max().item())


# ---------------------------------------------------------------------------- kernels vs naive

@pytest.mark.parametrize("phi,normalize", PAIR_OPTIONS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("window", [None, 1, 3])
def test_pair_loss_matches_naive(phi, normalize, loss, window) -> None:
    xs, xt, mask = point_sets()
    ours = pair_loss(xs, xt, mask, phi=phi, normalize=normalize, loss=loss, window=window, huber_beta=0.5)
    ref = naive_pair_loss(xs, xt, mask, phi, normalize, loss, window, 0.5)
    assert_close_with_grad(ours, ref, xs)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("window", [None, 1, 2, 3])
@pytest.mark.parametrize("chunk", [1, 50, 1 << 18])  # one vertex per chunk, a few, everything at once
def test_angle_loss_matches_naive(loss, window, chunk) -> None:
    xs, xt, mask = point_sets()
    ours = angle_loss(xs, xt, mask, loss=loss, window=window, huber_beta=0.3, chunk_elems=chunk)
    ref = naive_angle_loss(xs, xt, mask, loss, window, 0.3)
    assert_close_with_grad(ours, ref, xs)


@pytest.mark.parametrize("name,params", ALL_TERM_CASES)
def test_terms_match_naive(name, params) -> None:
    s, t, ctx = features()
    mask = s.attention_mask.bool()
    hs, ht = s.hidden_states, t.hidden_states
    if name.startswith("ckd_wr"):
        ref = sum(
            naive_pair_loss(hs[a], ht[b], mask, params["phi"], params["normalize"], params["loss"], params["window"])
            if name == "ckd_wr_pair" else naive_angle_loss(hs[a], ht[b], mask, params["loss"], params["window"])
            for a, b in ctx.layer_pairs
        )
    else:
        xs = naive_token_layers(hs, [a for a, _ in ctx.layer_pairs], mask)
        xt = naive_token_layers(ht, [b for _, b in ctx.layer_pairs], mask)
        ones = torch.ones(xs.shape[:2], dtype=torch.bool)
        ref = (naive_pair_loss(xs, xt, ones, params["phi"], params["normalize"], params["loss"], None)
               if name == "ckd_ltr_pair" else naive_angle_loss(xs, xt, ones, params["loss"], None))
    ours = call(name, s, t, ctx, **params)
    for x in hs:
        assert_close_with_grad(ours, ref, x)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("window", [None, 1, 3])
def test_official_reduction_kernels_match_naive(loss, window) -> None:
    xs, xt, mask = point_sets()  # padding, and a 3-token sentence shorter than the windows
    pair = pair_loss(xs, xt, mask, phi="cosine", loss=loss, window=window, huber_beta=0.5, reduction="official")
    ref = naive_official_pair_sum(xs, xt, mask, "cosine", loss, window, 0.5) / naive_official_count(mask, window, 2)
    assert_close_with_grad(pair, ref, xs, rtol=1e-6)
    angle = angle_loss(xs, xt, mask, loss=loss, window=window, huber_beta=0.5, reduction="official")
    ref = naive_official_angle_sum(xs, xt, mask, loss, window, 0.5) / naive_official_count(mask, window, 3)
    assert_close_with_grad(angle, ref, xs, rtol=1e-6)


@pytest.mark.parametrize("window_pair,window_angle", [(None, 2), (None, None), (1, 3)])
def test_official_reduction_terms_match_naive(window_pair, window_angle) -> None:
    """One pooled mean per term over all aligned layers and the batch (the official scale)."""
    s, t, ctx = features()  # 3 aligned layer pairs, padded sentences of 8, 5 and 2 tokens
    mask = s.attention_mask.bool()
    hs, ht = s.hidden_states, t.hidden_states
    L = len(ctx.layer_pairs)
    wr_pair = sum(naive_official_pair_sum(hs[a], ht[b], mask, "cosine", "kl", window_pair)
                  for a, b in ctx.layer_pairs) / (L * naive_official_count(mask, window_pair, 2))
    wr_angle = sum(naive_official_angle_sum(hs[a], ht[b], mask, "mse", window_angle)
                   for a, b in ctx.layer_pairs) / (L * naive_official_count(mask, window_angle, 3))
    xs = naive_token_layers(hs, [a for a, _ in ctx.layer_pairs], mask)
    xt = naive_token_layers(ht, [b for _, b in ctx.layer_pairs], mask)
    ones = torch.ones(xs.shape[:2], dtype=torch.bool)
    tokens = int(mask.sum())
    assert naive_official_count(ones, None, 2) == tokens * L**2 and naive_official_count(ones, None, 3) == tokens * L**3
    ltr_pair = naive_official_pair_sum(xs, xt, ones, "cosine", "kl", None) / (tokens * L**2)
    ltr_angle = naive_official_angle_sum(xs, xt, ones, "mse", None) / (tokens * L**3)
    ours = {
        "ckd_wr_pair": call("ckd_wr_pair", s, t, ctx, loss="kl", window=window_pair, reduction="official"),
        "ckd_wr_angle": call("ckd_wr_angle", s, t, ctx, loss="mse", window=window_angle, reduction="official"),
        "ckd_ltr_pair": call("ckd_ltr_pair", s, t, ctx, loss="kl", reduction="official"),
        "ckd_ltr_angle": call("ckd_ltr_angle", s, t, ctx, loss="mse", reduction="official"),
    }
    refs = {"ckd_wr_pair": wr_pair, "ckd_wr_angle": wr_angle, "ckd_ltr_pair": ltr_pair, "ckd_ltr_angle": ltr_angle}
    for name, value in ours.items():
        for x in hs[1:]:  # the embeddings (layer 0) are aligned too; the upper layers carry gradients
            assert_close_with_grad(value, refs[name], x, rtol=1e-6)


def test_official_scale_relative_to_mean() -> None:
    """Hand-checkable: one unpadded 4-token sentence, one layer, mse on pairs: the official count
    n^2 = 16 includes the 4 diagonal entries that the mean's 12 excludes."""
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(1, 4, 5, generator=g, dtype=torch.float64)
    xt = torch.randn(1, 4, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    mean = pair_loss(xs, xt, mask, phi="l2", loss="mse")
    official = pair_loss(xs, xt, mask, phi="l2", loss="mse", reduction="official")
    assert official.item() == pytest.approx(mean.item() * 12 / 16, rel=1e-12)
    # windowed angles: each of the 4 vertices owns (2*1+1)^2 = 9 slots; the mean counts the true
    # neighbour triples: vertices 0 and 3 have 1 neighbour (1 triple), 1 and 2 have 2 (4 triples)
    mean = angle_loss(xs, xt, mask, loss="mse", window=1)
    official = angle_loss(xs, xt, mask, loss="mse", window=1, reduction="official")
    assert official.item() == pytest.approx(mean.item() * 10 / 36, rel=1e-12)


def test_fp32_kernels_match_fp64_naive_far_from_origin() -> None:
    # Gram identities cancel when vectors are long compared with their spread; centring avoids it.
    xs, xt, mask = point_sets(P=4, n=16, ds=48, dt=64)
    xs32 = (xs.detach() + 30.0).float().requires_grad_(True)
    xt32 = (xt + 30.0).float()
    for loss in LOSSES:
        for window in (None, 3):
            ours = angle_loss(xs32, xt32, mask, loss=loss, window=window)
            ref = naive_angle_loss(xs32.double(), xt32.double(), mask, loss, window)
            assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())
        ours = pair_loss(xs32, xt32, mask, phi="l2", loss=loss)
        ref = naive_pair_loss(xs32.double(), xt32.double(), mask, "l2", False, loss, None)
        assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_angle_gradcheck() -> None:
    # the fused backward of the chunked kernel against finite differences
    xs, xt, mask = point_sets(P=3, n=5, ds=2, dt=3)
    for loss, window in (("huber", None), ("kl", 1)):
        def fn(x, loss=loss, window=window):
            return angle_loss(x, xt, mask, loss=loss, window=window, huber_beta=0.2, chunk_elems=30)

        torch.autograd.gradcheck(fn, (xs,))


def test_window_at_least_n_equals_full() -> None:
    xs, xt, mask = point_sets()
    n = mask.shape[1]
    for loss in LOSSES:
        full = angle_loss(xs, xt, mask, loss=loss, window=None)
        for w in (n - 1, n, 10 * n):
            assert torch.allclose(angle_loss(xs, xt, mask, loss=loss, window=w), full, rtol=1e-12)
        full = pair_loss(xs, xt, mask, loss=loss, window=None)
        for w in (n - 1, n, 10 * n):
            assert torch.allclose(pair_loss(xs, xt, mask, loss=loss, window=w), full, rtol=1e-12)


def test_padding_never_contributes() -> None:
    xs, xt, mask = point_sets()
    xs2, xt2 = xs.detach().clone(), xt.clone()
    xs2[~mask] = 1e6 * torch.randn_like(xs2[~mask])  # garbage in padded positions
    xt2[~mask] = float("nan")
    for loss in LOSSES:
        for window in (None, 2):
            assert torch.allclose(angle_loss(xs2, xt2, mask, loss=loss, window=window),
                                  angle_loss(xs, xt, mask, loss=loss, window=window), rtol=1e-10)
            assert torch.allclose(pair_loss(xs2, xt2, mask, loss=loss, window=window),
                                  pair_loss(xs, xt, mask, loss=loss, window=window), rtol=1e-10)


# ----------------------------------------------------------------------------------- invariances

def _random_orthogonal(d: int, seed: int = 1) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def _transformed(s: Features, fn) -> Features:
    return Features(logits=s.logits, attention_mask=s.attention_mask,
                    hidden_states=tuple(fn(h.detach()) for h in s.hidden_states))


@pytest.mark.parametrize("name,params", ALL_TERM_CASES)
def test_invariances(name, params) -> None:
    s, t, ctx = features()
    d = s.hidden_states[0].shape[-1]
    base = call(name, s, t, ctx, **params)
    q = _random_orthogonal(d)
    shift = 5 * torch.randn(s.attention_mask.shape[0], 1, d, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(2))  # one vector per sentence
    checks = {"rotation": lambda h: h @ q}
    relation_is_cosine = params.get("phi") == "cosine"
    if not relation_is_cosine:  # distances and angles do not see translations; cosines do
        checks["translation"] = lambda h: h + shift
    if "angle" in name or relation_is_cosine or params.get("normalize"):
        checks["scaling"] = lambda h: 3.7 * h
    for what, fn in checks.items():
        moved = call(name, _transformed(s, fn), t, ctx, **params)
        assert torch.isclose(moved, base, rtol=1e-9, atol=1e-12), (what, moved.item(), base.item())


@pytest.mark.parametrize("name,params", ALL_TERM_CASES)
def test_zero_loss_when_student_equals_teacher(name, params) -> None:
    s, t, ctx = features(ds=10, dt=10, ls=4, lt=4, dtype=torch.float32)
    ctx.layer_pairs = [(0, 0), (2, 2), (4, 4)]
    same = Features(logits=t.logits, attention_mask=t.attention_mask,
                    hidden_states=tuple(h.clone().requires_grad_(True) for h in t.hidden_states))
    value = call(name, same, t, ctx, **params)
    assert abs(value.item()) < 1e-6
    value.backward()
    assert all(h.grad is None or h.grad.abs().max() < 1e-4 for h in same.hidden_states)


# --------------------------------------------------------------------------- degenerate inputs

@pytest.mark.parametrize("name,params", ALL_TERM_CASES)
def test_finite_with_duplicated_tokens(name, params) -> None:
    s, t, ctx = features(dtype=torch.float32)
    hs = [h.detach().clone() for h in s.hidden_states]
    for h in hs:
        h[0, 2] = h[0, 1]  # a repeated token
        h[1] = h[1, :1]  # a sentence whose tokens all coincide
        h[2] = 0.0  # all-zero vectors
    hs[2][0, 4] = hs[1][0, 4]  # a token unchanged by a layer (LTR degenerate)
    ht = [h.clone() for h in t.hidden_states]
    ht[2][0, 3] = ht[2][0, 5]
    hs = [h.requires_grad_(True) for h in hs]
    s2 = Features(logits=s.logits, attention_mask=s.attention_mask, hidden_states=tuple(hs))
    t2 = Features(logits=t.logits, attention_mask=t.attention_mask, hidden_states=tuple(ht))
    value = call(name, s2, t2, ctx, **params)
    assert torch.isfinite(value)
    value.backward()
    assert all(torch.isfinite(h.grad).all() for h in hs if h.grad is not None)


def test_degenerate_angles_are_zero() -> None:
    x = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 2.0]]])
    cos = angle_matrix(x, torch.ones(1, 4, dtype=torch.bool), vertex=1)
    assert cos[0, 2].abs().max() == 0 and cos[0, :, 2].abs().max() == 0  # point 2 sits on the vertex
    assert cos[0, 0, 3].item() == pytest.approx(1 / 5**0.5)
    rel, valid = pair_relation(x, torch.ones(1, 4, dtype=torch.bool), "l2")
    assert rel[0, 1, 2] == 0 and rel[0, 0, 1] == pytest.approx(1.0) and not valid[0, 1, 1]


def test_fp32_under_autocast() -> None:
    xs, xt, mask = point_sets(dtype=torch.float32)
    xb, tb = xs.detach().bfloat16().requires_grad_(True), xt.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = angle_loss(xb, tb, mask, loss="kl")
        p = pair_loss(xb, tb, mask, phi="cosine", loss="kl")
    assert a.dtype == torch.float32 and p.dtype == torch.float32
    assert torch.isclose(a, angle_loss(xb.float(), tb.float(), mask, loss="kl"), rtol=1e-5)
    (a + p).backward()
    assert torch.isfinite(xb.grad.float()).all()


# ---------------------------------------------------------------------------------- validation

@pytest.mark.parametrize(
    "name,params,layer_pairs,match",
    [
        ("ckd_wr_pair", dict(phi="dot"), [(0, 0), (1, 2)], "phi"),
        ("ckd_wr_pair", dict(phi="cosine", normalize=True), [(0, 0), (1, 2)], "normalize"),
        ("ckd_wr_pair", dict(loss="kld"), [(0, 0), (1, 2)], "loss"),
        ("ckd_wr_angle", dict(window=0), [(0, 0), (1, 2)], "window"),
        ("ckd_wr_angle", dict(window=2.5), [(0, 0), (1, 2)], "window"),
        ("ckd_ltr_angle", dict(), [(1, 2)], "ltr_angle=false"),
        ("ckd_wr_pair", dict(reduction="pooled"), [(0, 0), (1, 2)], "objective.params.reduction"),
        ("ckd_ltr_angle", dict(reduction="sum"), [(0, 0), (1, 2)], "reduction"),
    ],
)
def test_bad_settings_fail_clearly(name, params, layer_pairs, match) -> None:
    info = {"layers": 2, "hidden": 32, "heads": 2}
    with pytest.raises(ValueError, match=match):
        get_loss(name).check(info, info, layer_pairs, **params)


# ------------------------------------------------------------------------------------- presets

def test_objective_weights_and_switches() -> None:
    from kdrun.engine.objective import plan_stages

    def weights(*overrides):
        cfg = compose(["objective=ckd", *overrides])
        return {t.key: t.weight for t in plan_stages(cfg.objective)[0].terms}

    w = weights("objective.alpha=0.7", "objective.params.lambda_ckd=10", "objective.params.lambda_wr=100")
    assert w == pytest.approx({"ce": 0.3, "logit_kd": 0.7, "ckd_wr_pair": 10, "ckd_wr_angle": 1000,
                               "ckd_ltr_pair": 10, "ckd_ltr_angle": 1000})
    untied = weights("objective.params.lambda_ckd=1", "objective.params.lambda_ltr=2")
    assert untied["ckd_ltr_angle"] == pytest.approx(2.0)  # lambda_ltr no longer follows lambda_wr
    full = weights()  # the defaults: lambda_ckd 0.01 (chosen on dev by the miniature GLUE study), lambda_wr 10
    assert full == pytest.approx({"ce": 0.1, "logit_kd": 0.9, "ckd_wr_pair": 0.01, "ckd_wr_angle": 0.1,
                                  "ckd_ltr_pair": 0.01, "ckd_ltr_angle": 0.1})
    for term in ("wr_pair", "wr_angle", "ltr_pair", "ltr_angle"):
        # a switched-off term weighs 0, so the objective drops it; nothing else changes
        assert weights(f"objective.params.{term}=false") == {k: v for k, v in full.items() if k != f"ckd_{term}"}
    assert set(weights("objective.params.lambda_ckd=0")) == {"ce", "logit_kd"}


# (alpha, T, wr_dist, wr_angle, lr, epochs) of the authors' per-task config for their 6-layer student
OFFICIAL = {"cola": (.7, 3, 1, 10, 5e-5, 4), "sst2": (.9, 4, 100, 1000, 4e-5, 4), "rte": (.9, 3, 1, 10, 5e-5, 6),
            "qnli": (.9, 3, 10, 1, 4e-5, 4), "mrpc": (.7, 4, 1, 1, 3e-5, 4), "stsb": (.9, 1, .1, .1, 5e-5, 4),
            "mnli": (.7, 4, 100, 1, 4e-5, 4), "qqp": (.9, 2, 10, 10, 5e-5, 4)}


@pytest.mark.parametrize("task", sorted(OFFICIAL))
def test_presets_are_the_authors_training(task) -> None:
    from kdrun.engine.objective import plan_stages

    cfg = compose([f"experiment=ckd_{task}"])
    alpha, temp, wr_dist, wr_angle, lr, epochs = OFFICIAL[task]
    (plan,) = plan_stages(cfg.objective)
    w = {t.key: t.weight for t in plan.terms}
    # CE + CKD, no logit-KD term, LTR at weight 1
    assert w == pytest.approx({"ce": 1.0, "ckd_wr_pair": wr_dist, "ckd_wr_angle": wr_angle,
                               "ckd_ltr_pair": 1.0, "ckd_ltr_angle": 1.0})
    params = {t.key: t.params.as_dict() for t in plan.terms}
    assert {p["reduction"] for k, p in params.items() if k.startswith("ckd")} == {"official"}
    assert params["ckd_wr_pair"]["window"] is None and params["ckd_wr_angle"]["window"] == 10
    assert (params["ckd_wr_pair"]["phi"], params["ckd_wr_pair"]["loss"], params["ckd_wr_angle"]["loss"]) == \
        ("cosine", "kl", "mse")
    st = plan.cfg
    assert (st["lr"], st["epochs"], st["batch_size"], st["warmup_ratio"], st["weight_decay"]) == (lr, epochs, 32, 0, 0)
    assert (cfg.task.name, cfg.task.max_seq_length, cfg.train.max_grad_norm) == (task, 128, 1.0)
    assert (cfg.objective.alpha, cfg.objective.temperature) == (alpha, temp)  # recorded, unused
    assert (cfg.teacher.name, cfg.student.name, cfg.mapping.name) == ("bert_base", "bert_L6_H768", "uniform")


def test_eq6_form_and_two_stage_keep_their_shape() -> None:
    two = compose(["objective=ckd_two_stage"]).objective
    assert [s.name for s in two.stages] == ["ckd", "prediction"]
    assert [x.name for x in two.stages[1].losses] == ["ce", "logit_kd"]
    eq6 = OmegaConf.to_container(compose(["objective=ckd", "objective.params.reduction=official"]).objective,
                                 resolve=True)
    assert {x["params"].get("reduction") for x in eq6["stages"][0]["losses"][2:]} == {"official"}


# ---------------------------------------------------------------------------------- end to end

SMALL = ["task=toy", "task.toy.num_train=64", "task.toy.num_validation=32", "objective=ckd",
         "objective.params.epochs=1", "objective.stages.0.batch_size=16"]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckd_cache")


def _logged_keys(run_dir: Path) -> set[str]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return set().union(*lines)


def _run(tmp_path: Path, cache: Path, *overrides: str) -> tuple[dict, set[str]]:
    from kdrun.app.run import run

    out = run(compose([*TINY, *SMALL, f"cache_dir={cache}", *overrides]), tmp_path)
    return out, _logged_keys(tmp_path)


def test_ckd_run_logs_each_term(tmp_path: Path, shared_cache: Path) -> None:
    out, keys = _run(tmp_path / "a", shared_cache)
    assert {f"train/{t}" for t in TERMS} | {"train/ce", "train/logit_kd"} <= keys
    assert [list(p) for p in out["layer_pairs"]] == [[0, 0], [1, 2], [2, 4]]
    # the relations picture from the saved student and teacher
    plot = load_script("plots/relations")
    png = plot.main(["--student", str(tmp_path / "a" / "student"), "--teacher", out["teacher"]["path"],
                     "--sentence", "the film is good and the plot is fine", "--out", str(tmp_path / "rel.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_switched_off_term_is_not_logged(tmp_path: Path, shared_cache: Path) -> None:
    _, keys = _run(tmp_path / "b", shared_cache, "objective.params.wr_angle=false")
    assert "train/ckd_wr_angle" not in keys and "train/ckd_wr_pair" in keys


def test_ckd_run_without_width_or_head_constraint(tmp_path: Path, shared_cache: Path) -> None:
    # a 4-layer, 32-wide, 2-head student of a 6-layer, 48-wide, 4-head teacher (4/256 of 6/384 in small)
    out, keys = _run(
        tmp_path / "c", shared_cache,
        "teacher.num_hidden_layers=6", "teacher.hidden_size=48", "teacher.num_attention_heads=4",
        "teacher.intermediate_size=96", "student.num_hidden_layers=4", "student.hidden_size=24",
        "student.num_attention_heads=3", "student.intermediate_size=48",
    )
    assert [list(p) for p in out["layer_pairs"]] == [[0, 0], [2, 3], [4, 6]]
    assert {f"train/{t}" for t in TERMS} <= keys
    lines = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(v)) for line in lines for k, v in line.items() if k.startswith("train/"))


# ------------------------------------------------------------------------------------- term group


def test_the_relations_group_expands_into_the_four_terms_as_written_out() -> None:
    """One ``ckd_relations`` entry stands for the four terms: weights are the hand-computed products
    (switches as 1 / 0, lambda_ltr following lambda_wr when null), every setting reaches the terms
    that read it, and its defaults are the terms' own."""
    from dataclasses import fields

    from kdrun.losses.ckd import PairParams, RelationsParams, WRAngleParams, WRPairParams, expand_relations

    p = RelationsParams(wr=0.5, ltr=2.0, lambda_wr=10.0, wr_angle=False, ltr_pair=0.25, pair_phi="l2",
                        pair_normalize=True, pair_loss="mse", angle_loss="huber", huber_beta=0.5, window_pair=3,
                        window_angle=7, reduction="official")
    got = {name: (w, params) for name, w, params in expand_relations(0.1, p)}
    common = {"huber_beta": 0.5, "reduction": "official"}
    pair = {**common, "phi": "l2", "normalize": True, "loss": "mse"}
    assert got == {"ckd_wr_pair": (0.1 * 0.5, {**pair, "window": 3}),
                   "ckd_wr_angle": (0.0, {**common, "loss": "huber", "window": 7}),
                   "ckd_ltr_pair": (0.1 * 2.0 * 0.25, pair),
                   "ckd_ltr_angle": (0.1 * 2.0 * 10.0, {**common, "loss": "huber"})}
    assert expand_relations(1.0, RelationsParams(lambda_ltr=3.0))[3][1] == 3.0
    defaults = {f.name: f.default for f in fields(RelationsParams)}
    pair_names = {"phi": "pair_phi", "normalize": "pair_normalize", "loss": "pair_loss"}
    for cls, names in ((WRPairParams, {**pair_names, "window": "window_pair"}), (PairParams, pair_names),
                       (WRAngleParams, {"loss": "angle_loss", "window": "window_angle"})):
        for f in fields(cls):
            assert defaults[names.get(f.name, f.name)] == f.default, (cls.__name__, f.name)


def test_the_ckd_objectives_write_the_four_terms_once_through_the_group() -> None:
    """No objective spells out CKD's terms: each writes one ckd_relations entry per stage; a wrong
    setting in it fails when the stages are planned, naming the entry and the setting."""
    from kdrun.engine.objective import plan_stages
    from kdrun.losses import ParamError

    for path in sorted((REPO / "conf" / "objective").glob("*.yaml")):
        body = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"ckd_(wr|ltr)_(pair|angle)", body), path.name
    for objective in ("ckd", "ckd_two_stage", "ckd_official", "ckd_general", "mlm_ckd", "dynabert_ckd"):
        plans = plan_stages(compose([f"objective={objective}"]).objective)
        assert [t.key for t in plans[0].terms if t.key.startswith("ckd")] == TERMS, objective
    with pytest.raises(ParamError, match=re.escape("objective.stages[0].losses[2]: ckd_relations") + ".*window_pair"):
        plan_stages(compose(["objective=ckd", "objective.params.window_pair=0"]).objective)
