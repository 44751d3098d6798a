"""Loss terms compute in fp32 whatever precision their inputs have, and also under autocast.

The training step runs the models under autocast (bf16 or fp16) and the objective outside it, so
terms receive half-precision features. Each registered term, in each configuration of
tests/test_sync_losses.py, is compared with itself on the same values held in fp32 (the half
inputs rounded and cast back): the term itself must lose nothing, so the tolerance is that of fp32
arithmetic (summation order), far below half precision's 4e-3 (bf16) / 5e-4 (fp16) rounding.
"""

from __future__ import annotations

import pytest
import torch

from kdrun.losses.layerwise import Projections
from kdrun.losses.minilm import self_relation
from kdrun.models.features import AttentionInputs
from kdrun.models.mapping import LayerMap, Row
from tests.test_sync_losses import CASES, Case

RTOL, ATOL = 1e-5, 1e-7  # fp32 arithmetic (seen: bit-identical); input rounding moves values by up to 3e-3
HALF = (torch.bfloat16, torch.float16)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32, f"{what}: result is {got.dtype}, not float32"
    assert torch.allclose(got.detach(), want.detach(), rtol=RTOL, atol=ATOL), \
        f"{what}: {got.item():.9g} vs fp32 reference {want.item():.9g}"


def _bf16_autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_half_inputs_give_the_fp32_result(case: Case, dtype: torch.dtype) -> None:
    built = case.build()
    ref = built.rounded(dtype)(grad=True)  # fp32 inputs holding the half values
    got = built(dtype, grad=True)
    _close(got, ref, f"{case.id} on {dtype} inputs")
    got.backward()  # the backward pass runs on half inputs too


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_under_autocast_the_result_stays_fp32(case: Case) -> None:
    built = case.build()
    rounded = built.rounded(torch.bfloat16)
    ref = rounded()
    with _bf16_autocast():
        on_fp32 = rounded(grad=True)
        on_bf16 = built(torch.bfloat16, grad=True)
    _close(on_fp32, ref, f"{case.id} under bf16 autocast")
    _close(on_bf16, ref, f"{case.id} on bf16 inputs under bf16 autocast")
    on_bf16.backward()


def _record(dtype: torch.dtype) -> AttentionInputs:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, 8, generator=g).to(dtype) for _ in range(2))
    return AttentionInputs([q], [k], [k], heads=2, scaling=0.5)


@pytest.mark.parametrize("dtype", (torch.float32, *HALF), ids=str)
def test_scores_and_self_relations_are_fp32_under_autocast(dtype: torch.dtype) -> None:
    want_scores = _record(dtype).scores(1)
    x = torch.randn(2, 2, 5, 4).to(dtype)
    want_rel = self_relation(x)
    with _bf16_autocast():
        scores, rel = _record(dtype).scores(1), self_relation(x)
    assert want_scores.dtype == scores.dtype == torch.float32
    assert want_rel.dtype == rel.dtype == torch.float32
    torch.testing.assert_close(scores, want_scores, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rel, want_rel, rtol=1e-6, atol=1e-6)


def test_projections_and_attention_map_weights_are_fp32_under_autocast() -> None:
    proj = Projections([1], 8, 12, "shared")
    lmap = LayerMap("attention", [Row(1, (1, 2))])
    x, stacked = torch.randn(3, 8), torch.randn(3, 2, 12)
    want_p, want_a = proj(x.bfloat16(), 1), lmap.attention_weights(stacked[:, 0], stacked)
    with _bf16_autocast():
        got_p, got_a = proj(x.bfloat16(), 1), lmap.attention_weights(stacked[:, 0], stacked)
    assert got_p.dtype == got_a.dtype == torch.float32
    torch.testing.assert_close(got_p, want_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_a, want_a, rtol=1e-6, atol=1e-6)
