"""Blocking host→device copies inside a step: the sync counter (kdrun.runtime.syncs) records copies of
pageable CPU memory to the device, and kdrun's mapping weights are placed on the device once instead of
being copied every step. ``meta`` stands in for the CUDA device (any non-CPU device counts)."""

from __future__ import annotations

import pytest
import torch

from kdrun.runtime.syncs import SyncCounter, h2d_kind, host_section

DEVICE = "meta"


def test_sync_counter_flags_pageable_host_to_device_copies() -> None:
    x = torch.ones(3)
    on_device = torch.empty(3, device=DEVICE)
    with SyncCounter() as c:
        x.to(DEVICE, torch.float16, non_blocking=True)  # pageable: non_blocking does not help
        on_device.copy_(x)
        torch.tensor([1.0, 2.0], device=DEVICE)  # Python data → the device
        x.to(on_device)  # the device of another tensor
        x.to(device=DEVICE)
    names = [n for n, _ in c.events]
    assert names == ["to: h2d(pageable)", "copy_: h2d(pageable)", "tensor: tensor(h2d)", "to: h2d(pageable)",
                     "to: h2d(pageable)"], c
    assert all("test_sync_h2d.py" in where for _, where in c.events), c


def test_sync_counter_ignores_device_work_host_work_and_host_sections() -> None:
    x = torch.ones(3)
    on_device = torch.empty(3, device=DEVICE)
    with SyncCounter() as c:
        torch.full((), 0.5, dtype=torch.float64, device=DEVICE)  # made on the device: no copy
        (on_device * 2).to(DEVICE, torch.float16)  # device → device
        x.to(torch.float16)  # host → host
        x.to("cpu")
        torch.tensor([1.0])  # host tensor, stays on the host
        with host_section():  # allowed by design (fetching a batch)
            x.to(DEVICE)
    assert c.count == 0, c


def test_sync_pinned_copies_wait_only_without_non_blocking(monkeypatch) -> None:
    """Pinned memory (needs CUDA to allocate): copied with non_blocking=True the host does not wait."""
    x = torch.ones(3)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    target = torch.device(DEVICE)
    assert h2d_kind(x, target, non_blocking=True) is None
    assert h2d_kind(x, target, non_blocking=False) == "h2d(blocking)"
    monkeypatch.undo()
    assert h2d_kind(x, target, non_blocking=True) == "h2d(pageable)"
    assert h2d_kind(x, torch.device("cpu"), non_blocking=False) is None


@pytest.mark.parametrize("strategy", ["mean", "learnable"])
def test_sync_mapping_weights_stay_on_the_device(strategy: str) -> None:
    """``mapping=mean`` combined its bucket with 1/k weights made on the host and copied to the device
    at every step (a blocking copy on CUDA); they are a buffer now, moved with the objective once."""
    from kdrun.models.mapping import LayerMap, build_rows

    rows = build_rows(strategy, 2, 4, buckets="no", include_embeddings=False)
    lmap = LayerMap(strategy, rows).to(DEVICE)
    reps = {t: torch.randn(2, 5, 8, device=DEVICE) for t in range(5)}
    with SyncCounter() as c:
        for i in range(len(rows)):
            out = lmap.target(i, lambda layer: reps[layer], step=3)
            assert out.shape == (2, 5, 8) and out.device.type == DEVICE
    assert c.count == 0, c
    # the values, on the CPU: the mean of the bucket, exactly as before
    cpu = LayerMap(strategy, rows)
    host_reps = {t: torch.randn(2, 5, 8, dtype=torch.float64) for t in range(5)}
    got = cpu.target(1, lambda layer: host_reps[layer])
    if strategy == "mean":
        assert torch.allclose(got, (host_reps[3] + host_reps[4]) / 2, rtol=0, atol=1e-15)
    assert "mean_weights" not in cpu.state_dict()  # not persistent: checkpoints are unchanged
