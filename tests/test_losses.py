"""Loss terms against hand computation; the uniform mapping against pairs worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kdrun.losses import LossContext, check_params, get_loss
from kdrun.models.features import Features
from kdrun.models.mapping import build_layer_pairs, uniform


def feats(logits, hidden=None, mask=None) -> Features:
    logits = torch.tensor(logits, dtype=torch.float32)
    if mask is None:
        mask = torch.ones(logits.shape[0], 3, dtype=torch.long)
    return Features(logits=logits, attention_mask=mask, hidden_states=hidden)


def test_ce_hand_computed() -> None:
    s = feats([[2.0, 0.0], [0.0, 1.0]])
    batch = {"labels": torch.tensor([0, 0])}
    got = get_loss("ce").fn(s, None, batch, LossContext(num_labels=2))
    # -log softmax: example 1: log(1+e^-2); example 2: log(1+e^1)
    want = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(1))) / 2
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_ce_regression_is_mse() -> None:
    s = feats([[1.0], [3.0]])
    got = get_loss("ce").fn(s, None, {"labels": torch.tensor([2.0, 2.0])}, LossContext(num_labels=1))
    assert got.item() == pytest.approx(1.0)


def test_logit_kd_hand_computed() -> None:
    zs, zt, T = [1.0, 0.0], [0.0, 2.0], 2.0
    ps = [math.exp(z / T) / sum(math.exp(x / T) for x in zs) for z in zs]
    pt = [math.exp(z / T) / sum(math.exp(x / T) for x in zt) for z in zt]
    kl = sum(p * math.log(p / q) for p, q in zip(pt, ps))
    got = get_loss("logit_kd").fn(feats([zs]), feats([zt]), {}, LossContext(num_labels=2), temperature=T)
    assert got.item() == pytest.approx(T * T * kl, rel=1e-6)


def test_logit_kd_zero_when_equal_and_regression_mse() -> None:
    z = [[0.3, -1.2, 2.0]]
    assert get_loss("logit_kd").fn(feats(z), feats(z), {}, LossContext(3), temperature=4.0).item() == \
        pytest.approx(0.0, abs=1e-7)
    got = get_loss("logit_kd").fn(feats([[1.0], [2.0]]), feats([[0.0], [4.0]]), {}, LossContext(1))
    assert got.item() == pytest.approx((1 + 4) / 2)


def test_soft_ce_hand_computed() -> None:
    zs, zt = [0.5, -0.5], [1.0, 0.0]
    pt = [math.exp(z) / sum(math.exp(x) for x in zt) for z in zt]
    log_ps = [z - math.log(sum(math.exp(x) for x in zs)) for z in zs]
    want = -sum(p * lp for p, lp in zip(pt, log_ps))
    got = get_loss("soft_ce").fn(feats([zs]), feats([zt]), {}, LossContext(2), temperature=1.0)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_hidden_mse_ignores_padding_and_follows_pairs() -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    hs = tuple(torch.randn(2, 3, 4) for _ in range(3))
    ht = tuple(torch.randn(2, 3, 4) for _ in range(5))
    pairs = [(0, 0), (1, 2), (2, 4)]
    got = get_loss("hidden_mse").fn(feats([[0, 0]] * 2, hs, mask), feats([[0, 0]] * 2, ht, mask), {},
                                     LossContext(2, layer_pairs=pairs))
    want = 0.0
    for si, ti in pairs:
        errs = [((hs[si][b, i] - ht[ti][b, i]) ** 2).mean().item() for b in range(2) for i in range(3) if mask[b, i]]
        want += sum(errs) / len(errs)
    assert got.item() == pytest.approx(want, rel=1e-5)
    # padded positions do not matter
    ht2 = tuple(h.clone() for h in ht)
    for h in ht2:
        h[0, 2] += 100.0
    again = get_loss("hidden_mse").fn(feats([[0, 0]] * 2, hs, mask), feats([[0, 0]] * 2, ht2, mask), {},
                                      LossContext(2, layer_pairs=pairs))
    assert again.item() == pytest.approx(got.item(), rel=1e-6)


def test_registry_errors_name_the_place() -> None:
    with pytest.raises(KeyError, match="objective.stages\\[0\\].losses\\[1\\].*Valid loss terms"):
        get_loss("nosuch", "objective.stages[0].losses[1]")
    with pytest.raises(KeyError, match="has no parameter"):
        check_params(get_loss("logit_kd"), {"temp": 2}, "x.params")


@pytest.mark.parametrize(
    "lt,ls,want",
    [
        (12, 4, [(0, 0), (1, 3), (2, 6), (3, 9), (4, 12)]),
        (12, 6, [(i, 2 * i) for i in range(7)]),
        (12, 8, [(0, 0), (2, 3), (4, 6), (6, 9), (8, 12)]),
        (6, 2, [(0, 0), (1, 3), (2, 6)]),
    ],
)
def test_uniform_mapping_tables(lt: int, ls: int, want: list[tuple[int, int]]) -> None:
    assert uniform(ls, lt) == want
    assert uniform(ls, lt, include_embeddings=False) == want[1:]


def test_unknown_mapping() -> None:
    with pytest.raises(KeyError, match="Valid mappings: uniform"):
        build_layer_pairs("nosuch", 2, 6)
