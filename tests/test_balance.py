"""objective.balance: learned loss weights. On a hand-built two-term case the factors move the way
each method says; ``fixed`` is today's weighted sum bit for bit; a run with each method trains and
logs its factors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kdrun.engine.balance import Balancer


def two_terms():
    """A shared weight vector W and two losses: S_1 = 4 ‖W − a‖² (steep), S_2 = ‖W − b‖² (shallow)."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    a, b = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([2.0, 1.0, 0.0])
    return w, [4 * (w - a).pow(2).sum(), (w - b).pow(2).sum()]


def test_uncertainty_lowers_the_factor_of_the_larger_loss_towards_one_over_it() -> None:
    bal = Balancer("uncertainty", {0: ["big", "small"]})
    s = [torch.tensor(4.0), torch.tensor(1.0)]
    total = bal.combine(0, s, None)
    assert float(total) == pytest.approx(5.0)  # s_i = 0: the YAML weights
    total.backward()
    # d/ds (e^{-s} S + s) = 1 - e^{-s} S: -3 for S = 4 (s rises, factor falls), 0 for S = 1 (optimum)
    torch.testing.assert_close(bal.factors["stage0"].grad, torch.tensor([-3.0, 0.0]))
    opt = torch.optim.SGD(bal.parameters(), lr=0.05)
    for _ in range(400):
        opt.zero_grad()
        bal.combine(0, s, None).backward()
        opt.step()
    w = bal.weights(0)
    assert float(w[0]) == pytest.approx(1 / 4, rel=1e-3) and float(w[1]) == pytest.approx(1.0, rel=1e-3)


def test_gradnorm_shifts_weight_to_the_term_with_the_smaller_gradient() -> None:
    w, s = two_terms()
    bal = Balancer("gradnorm", {0: ["steep", "shallow"]}, alpha=1.5)
    total = bal.combine(0, s, [w])
    assert float(total) == pytest.approx(float(s[0] + s[1]))  # factors start at 1: the same loss value
    total.backward(retain_graph=True)
    g1 = float(torch.autograd.grad(s[0], w, retain_graph=True)[0].norm())
    g2 = float(torch.autograd.grad(s[1], w, retain_graph=True)[0].norm())
    assert g1 > g2
    # at step 0 the training rates are equal (r_i = 1): target = mean(G); d|G_i - target|/dw_i
    # = sign(G_i - target) g_i: +g1 for the steep term, -g2 for the shallow one
    torch.testing.assert_close(bal.factors["stage0"].grad, torch.tensor([g1, -g2]))
    # the model's gradient is that of Σ w_i S_i with the factors held fixed (1, 1 here)
    expected = torch.autograd.grad(s[0] + s[1], w, retain_graph=True)[0]
    torch.testing.assert_close(w.grad, expected)
    opt = torch.optim.SGD(bal.parameters(), lr=0.01)
    opt.step()
    bal.combine(0, two_terms()[1], None)  # the next forward renormalises: Σ w = 2
    f = bal.weights(0).detach()
    assert float(f.sum()) == pytest.approx(2.0) and f[0] < 1 < f[1]


def test_fixed_is_the_plain_weighted_sum_bit_for_bit(run_cfg) -> None:
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.models.features import Features
    from kdrun.models.mapping import MappingSpec

    cfg = run_cfg("objective=logit")
    plans = plan_stages(cfg.objective)
    info = {"layers": 2, "hidden": 32, "heads": 2}
    g = torch.Generator().manual_seed(0)
    s = Features(logits=torch.randn(4, 2, generator=g), attention_mask=torch.ones(4, 3, dtype=torch.long))
    t = Features(logits=torch.randn(4, 2, generator=g), attention_mask=s.attention_mask)
    batch = {"labels": torch.tensor([0, 1, 1, 0])}
    plain = Objective(plans, MappingSpec.from_config(cfg.mapping), 2, info, info)
    fixed = Objective(plans, MappingSpec.from_config(cfg.mapping), 2, info, info, balance="fixed")
    assert fixed.balancer is None
    total, values = fixed(0, s, t, batch)
    by_hand = sum(term.weight * values[term.key].float() for term in plans[0].terms)
    assert torch.equal(total, plain(0, s, t, batch)[0]) and torch.equal(total, by_hand)


@pytest.mark.parametrize("method", ["gradnorm", "uncertainty"])
def test_balanced_run_trains_and_logs_its_factors(method: str, run_cfg, tmp_path: Path) -> None:
    from kdrun.app.run import run

    out = run(run_cfg("objective=ckd", f"objective.balance={method}", "train.epochs=1",
                      "logger.log_every_steps=1"), tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = sorted({k for x in lines for k in x if k.startswith("objective/balance/")})
    assert len(keys) >= 2, keys
    first = next(x for x in lines if keys[0] in x)
    last = [x for x in lines if keys[0] in x][-1]
    assert any(first[k] != last[k] for k in keys)  # the factors moved during training
    assert all(math.isfinite(x[k]) for x in lines for k in keys if k in x)
    assert out["student"]["metrics"]["validation"]["accuracy"] >= 0


def test_unknown_balance_method_is_refused_naming_the_key(run_cfg) -> None:
    # a closed set of the schema: refused when the config is composed, naming key and choices
    with pytest.raises(Exception) as e:
        run_cfg("objective=ckd", "objective.balance=gradnrom")
    reason = str(e.value.__cause__)
    assert "objective.balance" in reason and "'gradnrom', expected one of [fixed, gradnorm, uncertainty]" in reason


def _fp16_terms(scaled: bool | None):
    """A shared layer W in a model run under fp16 autocast (``None``: fp32), and two summands on its
    fp16 output as the objective computes them (fp32, outside autocast): one ordinary, one 1e-4 as
    large whose per-element gradient (~1e-9) is below fp16's smallest subnormal (6e-8)."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(64, 32, 16, generator=g), torch.randn(64, 32, 16, generator=g)
    layer = torch.nn.Linear(16, 16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 16, generator=g) / 4)
        layer.bias.zero_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaled is not None):
        h = layer(x)
    h = h.float()
    summands = [(h - t).pow(2).mean(), 1e-4 * (h - 0.5 * t).pow(2).mean()]
    bal = Balancer("gradnorm", {0: ["big", "tiny"]}, alpha=1.5)
    if scaled:
        from kdrun.runtime.precision import Precision

        prec = Precision("fp16", "cpu")
        bal.grad_scale = lambda: prec.scale_tensor("cpu")
    return bal, summands, list(layer.parameters())


def test_gradnorm_amp_fp16_measures_gradients_scaled_like_the_backward() -> None:
    from kdrun.engine.balance import _grad_norm

    ref_bal, ref_s, ref_w = _fp16_terms(None)
    ref = [float(_grad_norm(s, ref_w)) for s in ref_s]
    assert ref[1] > 1e-6  # in fp32 the tiny term has a gradient on W
    naive_bal, naive_s, naive_w = _fp16_terms(False)
    # unscaled fp16: nearly every per-element gradient flushed to zero (99% of the norm lost)
    assert float(_grad_norm(naive_s[1], naive_w)) < 0.01 * ref[1]
    bal, s, w = _fp16_terms(True)
    scale = bal.grad_scale()
    assert float(scale) == 2.0 ** 16  # GradScaler's initial scale, no scaled backward yet
    got = [float(_grad_norm(x, w, scale)) for x in s]
    assert got == pytest.approx(ref, rel=0.02)  # fp16 activations: within 2% of fp32's norms
    # the factors' gradient (GradNorm's own loss) follows fp32's; unscaled it does not
    for b, sums in ((ref_bal, ref_s), (bal, s), (naive_bal, naive_s)):
        b.combine(0, sums, w if b is not ref_bal else ref_w).backward()
    want = ref_bal.factors["stage0"].grad
    torch.testing.assert_close(bal.factors["stage0"].grad, want, rtol=0.03, atol=0)
    assert not torch.allclose(naive_bal.factors["stage0"].grad, want, rtol=0.3)
