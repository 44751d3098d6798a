"""The stacked computation of the layer-pair terms equals the per-pair one in fp64.

CKD's word-relation terms and MGSKD's three levels stack their aligned layers along the batch and
call the relation kernels once; here every term is compared with the same kernels called once per
layer pair on unstacked (B, n, d) inputs and summed (``official``: the layers' mean), values and
gradients of every student layer, on a padded and an unpadded batch, under every reduction.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kdrun.losses.ckd import AngleParams, PairParams
from kdrun.losses.mgskd import (
    MGSKDModule,
    pair_mse,
    sample_points,
    span_mask,
    span_points,
    split_heads,
    structure_losses,
)
from kdrun.losses.registry import LossContext, get_loss
from kdrun.losses.relations import angle_loss, pair_loss
from kdrun.models.features import Features

PAIRS = [(0, 0), (1, 2), (2, 4), (3, 6)]
RTOL = 1e-12


def features(padded: bool, B: int = 3, n: int = 10, ds: int = 16, dt: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, n, dtype=torch.long)
    if padded:
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    hs = tuple(torch.randn(B, n, ds, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(4))
    ht = tuple(torch.randn(B, n, dt, generator=g, dtype=torch.float64) for _ in range(7))
    spans = torch.tensor([[1, 3], [3, 4], [4, 7], [2, 6]]).expand(B, -1, -1).clone()
    if padded:
        spans[2, 2:] = -1  # example 2: two spans, left out of the span level
    s = Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=hs, spans=spans)
    t = Features(logits=torch.zeros(B, 2), attention_mask=mask, hidden_states=ht)
    return s, t


def assert_equal_with_grads(got: torch.Tensor, want: torch.Tensor, leaves) -> None:
    assert got.dtype == torch.float64
    assert torch.isclose(got, want, rtol=RTOL, atol=0), (got.item(), want.item())
    g_got = torch.autograd.grad(got, leaves, retain_graph=True, allow_unused=True)
    g_want = torch.autograd.grad(want, leaves, retain_graph=True, allow_unused=True)
    for a, b in zip(g_got, g_want):
        a = torch.zeros_like(leaves[0]) if a is None else a
        b = torch.zeros_like(leaves[0]) if b is None else b
        assert (a - b).abs().max() <= RTOL * max(b.abs().max(), 1e-300), ((a - b).abs().max().item())
    assert any(g is not None and g.abs().max() > 0 for g in g_got)  # the loss reaches the student


# ------------------------------------------------------------------------------------------- CKD

WR_CASES = [("ckd_wr_pair", dict(phi=phi, normalize=nz, loss=lo, window=w, reduction=r))
            for (phi, nz), lo, w, r in itertools.product([("cosine", False), ("l2", False), ("l2", True)],
                                                         ["kl", "mse", "huber"], [None, 2], ["mean", "official"])]
WR_CASES += [("ckd_wr_angle", dict(loss=lo, window=w, reduction=r))
             for lo, w, r in itertools.product(["mse", "kl", "l1"], [None, 2], ["mean", "official"])]


def per_pair_wr(name: str, s: Features, t: Features, params: dict) -> torch.Tensor:
    """The word relation as it was computed: one kernel call per layer pair, summed (official: mean)."""
    mask = s.attention_mask.bool()
    fn = pair_loss if name == "ckd_wr_pair" else angle_loss
    total = sum(fn(s.hidden_states[si], t.hidden_states[ti], mask, **params) for si, ti in PAIRS)
    return total / len(PAIRS) if params["reduction"] == "official" else total


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name,params", WR_CASES)
def test_ckd_word_relation_stacked_equals_per_pair(name: str, params: dict, padded: bool) -> None:
    s, t = features(padded)
    cls = PairParams if name == "ckd_wr_pair" else AngleParams
    assert set(params) - {"window"} <= {f.name for f in cls.__dataclass_fields__.values()}
    got = get_loss(name).fn(s, t, None, LossContext(num_labels=2, layer_pairs=PAIRS), **params)
    assert_equal_with_grads(got, per_pair_wr(name, s, t, params), s.hidden_states)


# ----------------------------------------------------------------------------------------- MGSKD

def per_pair_level(s: Features, t: Features, module, points, mask, **kw) -> torch.Tensor:
    """MGSKD's token / span level as it was computed: structure_losses per layer pair on (B, n, d)."""
    total = 0.0
    for si, ti in PAIRS[:2]:
        p, a = structure_losses(points(module(s.hidden_states[si])), points(t.hidden_states[ti]), mask, **kw)
        total = total + p + a
    return total


def per_pair_sample(s: Features, t: Features, module, heads: int, pair: bool, beta: float) -> torch.Tensor:
    mask = s.attention_mask.bool()
    total = 0.0
    for si, ti in PAIRS[2:]:
        vs, vt = sample_points(module(s.hidden_states[si]), mask), sample_points(t.hidden_states[ti], mask)
        ones = torch.ones((heads, vs.shape[0]), dtype=torch.bool)
        total = total + angle_loss(split_heads(vs[None], heads)[0], split_heads(vt[None], heads)[0], ones,
                                   loss="huber", huber_beta=beta)
        if pair:
            total = total + pair_mse(vs[None], vt[None], torch.ones((1, vs.shape[0]), dtype=torch.bool), heads)
    return total


def mgskd_call(name: str, s: Features, t: Features, module, **params) -> torch.Tensor:
    ctx = LossContext(num_labels=2, layer_pairs=PAIRS, module=module)
    return get_loss(name).fn(s, t, None, ctx, boundary=2, **params)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("level", ["token", "span"])
@pytest.mark.parametrize("pair,angle,k1,k2", [(True, True, 20, 20), (True, True, 3, 2), (False, True, 4, 3),
                                              (True, False, 20, 20)])
def test_mgskd_within_examples_stacked_equals_per_pair(level: str, pair: bool, angle: bool, k1: int, k2: int,
                                                       padded: bool) -> None:
    s, t = features(padded)
    torch.manual_seed(0)
    module = MGSKDModule(16, 24, project=True).double()
    kw = dict(heads=4, pair=pair, angle=angle, k1=k1, k2=k2, huber_beta=0.5)
    got = mgskd_call(f"mgskd_{level}", s, t, module, **kw)
    if level == "token":
        want = per_pair_level(s, t, module, lambda x: x, s.attention_mask.bool(), **kw)
    else:
        spans = s.spans
        want = per_pair_level(s, t, module, lambda x: span_points(x, spans), span_mask(spans, 3), **kw)
    assert_equal_with_grads(got, want, [*s.hidden_states, module.proj.weight])


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("pair", [False, True])
def test_mgskd_sample_stacked_equals_per_pair(pair: bool, padded: bool) -> None:
    s, t = features(padded)
    module = MGSKDModule(16, 24, project=False).double()
    got = mgskd_call("mgskd_sample", s, t, module, heads=4, pair=pair, angle=True, huber_beta=0.5)
    want = per_pair_sample(s, t, module, 4, pair, 0.5)
    assert_equal_with_grads(got, want, s.hidden_states)


# -------------------------------------------------------------------------------------- TinyBERT

def attention_features(padded: bool, B: int = 3, h: int = 2, n: int = 7, seed: int = 0):
    """Features whose attention scores are given directly (layers 1..4 student, 1..6 teacher)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, n, dtype=torch.long)
    if padded:
        mask[1, 5:] = 0
        mask[2, 3:] = 0
    scores_s = {i: torch.randn(B, h, n, n, generator=g, dtype=torch.float64).requires_grad_(True) for i in range(1, 5)}
    scores_t = {i: torch.randn(B, h, n, n, generator=g, dtype=torch.float64) * 3.0 for i in range(1, 7)}
    scores_t[2][..., 0] = -10000.0  # below the official code's floor: zeroed under padding=tinybert

    class Scored(Features):
        def __init__(self, scores):
            super().__init__(logits=torch.zeros(B, 2), attention_mask=mask)
            object.__setattr__(self, "_scores", scores)

        def attention_scores(self, layer):
            return self._scores[layer]

    return Scored(scores_s), Scored(scores_t), scores_s


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("loss,padding", [("mse", "exclude"), ("mse", "tinybert"), ("kl", "exclude")])
def test_tinybert_attention_stacked_equals_per_layer(loss: str, padding: str, padded: bool) -> None:
    from kdrun.losses.layerwise import attention_kl, masked_log_softmax
    from kdrun.losses.tinybert import attention_mse

    s, t, leaves = attention_features(padded)
    pairs = [(0, 0), (1, 2), (2, 3), (3, 5), (4, 6)]
    got = get_loss("tinybert_attention").fn(s, t, None, LossContext(num_labels=2, layer_pairs=pairs),
                                            loss=loss, padding=padding)
    mask = s.attention_mask
    want = 0.0
    for si, ti in pairs[1:]:
        ss, st = s.attention_scores(si), t.attention_scores(ti)
        want = want + (attention_mse(ss, st, mask, padding) if loss == "mse" else
                       attention_kl(masked_log_softmax(ss, mask), masked_log_softmax(st, mask).exp(), mask))
    assert_equal_with_grads(got, want, list(leaves.values()))
