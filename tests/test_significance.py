"""The statistics the claims table's verdicts apply: equivalence by two one-sided t-tests (against
scipy's one-sided t-tests and a hand computation), Benjamini–Hochberg q-values (by hand), and the
minimal detectable effect of the rule that needs both the sign-flip test and the t-test (against an
independent simulation of that rule)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from kdrun.report.significance import (
    Comparison,
    bh_qvalues,
    comparison_qvalues,
    joint_mde,
    joint_mde_unit,
    min_detectable_effect,
    seeds_needed,
    tost_p,
)

DIFFS = [0.2, -0.3, 0.5, 0.1, -0.1, 0.4]  # mean 0.1333, sd 0.3011, standard error 0.1229


def test_tost_is_the_larger_one_sided_p_of_scipy() -> None:
    lower = stats.ttest_1samp(DIFFS, -1.0, alternative="greater").pvalue
    upper = stats.ttest_1samp(DIFFS, 1.0, alternative="less").pvalue
    assert tost_p(DIFFS, 1.0) == pytest.approx(max(lower, upper), rel=1e-9)
    # by hand: t = (0.1333 − 1) / 0.1229 = −7.05 with 5 df, P(T ≤ −7.05) = 4.44e-4
    assert tost_p(DIFFS, 1.0) == pytest.approx(4.435e-4, rel=1e-3)
    shifted = [d + 0.8 for d in DIFFS]  # mean 0.93: close to the upper margin, not equivalent
    assert tost_p(shifted, 1.0) == pytest.approx(stats.ttest_1samp(shifted, 1.0, alternative="less").pvalue)
    assert tost_p(shifted, 1.0) > 0.05
    assert tost_p([-d for d in shifted], 1.0) == pytest.approx(tost_p(shifted, 1.0))  # symmetric
    assert tost_p([1.0], 1.0) is None and tost_p([0.5] * 4, 1.0) is None


def test_bh_qvalues_by_hand() -> None:
    # sorted p 0.005, 0.01, 0.03, 0.04 times m/rank = 0.02, 0.02, 0.04, 0.04; running minimum from the top
    assert bh_qvalues([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    # 0.02·3/1 = 0.06 > 0.03·3/2 = 0.045: the step-up minimum lowers the first
    assert bh_qvalues([0.02, 0.03, 0.9]) == pytest.approx([0.045, 0.045, 0.9])
    assert bh_qvalues([0.5, 0.8]) == pytest.approx([0.8, 0.8]) and bh_qvalues([]) == []
    assert bh_qvalues([0.6, 0.7, 0.9]) == pytest.approx([0.9, 0.9, 0.9])


def test_comparison_qvalues_skip_cells_without_a_t_test() -> None:
    def c(p):
        return Comparison(("s", "finetune"), [1, 2], [0.1, 0.2], 0.5, p, True)

    q = comparison_qvalues({("s", "kd"): {"sst2": c(0.01), "cola": c(None)}, ("s", "ckd"): {"sst2": c(0.04)}})
    assert q == pytest.approx({(("s", "ckd"), "sst2"): 0.04, (("s", "kd"), "sst2"): 0.02})


def _independent_power(effect: float, n: int = 6, draws: int = 40_000, seed: int = 7) -> float:
    """With 6 pairs the exact sign-flip test rejects at 0.05 only when all six differences share a
    sign (2/64 = 0.031; the next value is 4/64): power of that and scipy's t-test, positive mean."""
    d = np.random.default_rng(seed).standard_normal((draws, n)) + effect
    t_ok = stats.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05
    return float(np.mean(t_ok & (d > 0).all(axis=1)))


def test_joint_mde_reaches_power_08_where_the_t_test_mde_reaches_061() -> None:
    unit = joint_mde_unit(6)
    assert unit == pytest.approx(1.80, abs=0.02)
    assert _independent_power(unit) == pytest.approx(0.80, abs=0.01)
    t_mde = min_detectable_effect(6, 1.0)  # 1.425: the t-test alone has power 0.8 there
    assert t_mde == pytest.approx(1.4248, abs=1e-4)
    assert _independent_power(t_mde) == pytest.approx(0.61, abs=0.015)
    assert joint_mde(6, 2.5) == pytest.approx(2.5 * unit)  # scales with the sd of the differences


def test_joint_mde_without_a_reachable_sign_flip_level() -> None:
    assert joint_mde(5, 1.0) == math.inf  # smallest sign-flip p with 5 pairs: 2/32 = 0.0625
    assert joint_mde(1, 1.0) is None and joint_mde(17, 1.0) is None
    assert min_detectable_effect(10, 1.0) < joint_mde(10, 1.0, draws=20_000) < joint_mde(6, 1.0)


def test_above_p_is_scipys_one_sided_one_sample_t_test() -> None:
    from scipy import stats

    from kdrun.report.significance import above_p

    x = [1.0, -1.0, 2.0, -2.0, 0.5, 3.0]
    assert above_p(x, 0.0) == pytest.approx(stats.ttest_1samp(x, 0.0, alternative="greater").pvalue, rel=1e-9)
    # by hand: mean 0.5833, sd 1.8552, t = 0.5833 / (1.8552 / √6) = 0.7702, 5 df: p = 0.238
    assert above_p(x, 0.0) == pytest.approx(0.238, abs=1e-3)
    assert above_p([5.0] * 4, 1.0) == 0.0 and above_p([1.0] * 4, 1.0) == 1.0 and above_p([3.0], 0.0) is None


def test_seeds_needed_by_hand() -> None:
    """(t_{.975,n-1} + t_{.8,n-1}) / √n ≤ effect/sd first at n = 10 for effect = sd: 3.145/3.162 = 0.995
    at n = 10, 3.195/3 = 1.065 at n = 9; the bisection agrees with a naive scan everywhere."""
    assert seeds_needed(1.0, 1.0) == 10
    assert seeds_needed(-1.0, 1.0) == 10
    for effect, sd in ((0.4, 2.11), (2.0, 2.54), (0.3, 1.04), (3.4, 3.07)):
        naive = next(n for n in range(2, 1001) if min_detectable_effect(n, sd) <= effect)
        assert seeds_needed(effect, sd) == naive
    assert seeds_needed(0.01, 5.0) is None and seeds_needed(1.0, 0.0) is None
