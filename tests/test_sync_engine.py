"""No device→host sync inside a training step: every objective trains whole stages (steps, logging,
evaluation, checkpoints) under kdrun.runtime.syncs.SyncCounter, and every sync-forcing call (``item``,
``__bool__``, ``tolist``, ``cpu``, ``nonzero``, boolean masks, data-dependent shapes) must sit in a
host section: logging, evaluation and checkpoint steps, stage setup, fetching a batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import task_objectives
from tests.test_amp import objective_args, session_parts


def _stage_steps_under_counter(parts, plans, steps: int):
    """``steps`` optimizer steps of each stage through the engine's loop, counted; returns the counter."""
    from kdrun.engine.checkpoints import TrainState
    from kdrun.engine.trainer import _host_batches, after_step, setup_stage, to_device, train_step
    from kdrun.runtime.syncs import SyncCounter, host_section

    counter = SyncCounter()
    state = TrainState()
    for plan in plans:
        state.stage, state.stage_step = plan.index, 0
        with host_section():
            loop = setup_stage(parts, plan, state, None)
        parts.student.train()
        with counter:
            for batch, (examples, tokens) in _host_batches(loop.loader):
                batch = to_device(batch, parts.accelerator.device)
                loss, values = train_step(parts, loop, batch, state)
                loop.meter.add(values, loss, examples, tokens)
                loop.scheduler.step()
                state.stage_step += 1
                state.global_step += 1
                after_step(parts, loop, state)
                if state.stage_step >= steps:
                    break
        loop.pbar.close()
    return counter


@pytest.fixture
def library_mask_check_allowed(monkeypatch):
    """transformers' mask preparation asks once per forward pass whether a batch has no padding at all
    (``padding_mask.all()``, to skip the mask): a sync inside the library, not in kdrun, allowed here
    explicitly and only there."""
    import transformers.masking_utils as mu

    from kdrun.runtime.syncs import host_section

    real = mu._ignore_bidirectional_mask_sdpa

    def allowed(*a, **k):
        with host_section():
            return real(*a, **k)

    monkeypatch.setattr(mu, "_ignore_bidirectional_mask_sdpa", allowed)


@pytest.mark.parametrize("objective", task_objectives() + ["dynabert"])
def test_no_host_sync_inside_the_training_step(objective: str, tmp_path: Path, run_cfg,
                                               library_mask_check_allowed) -> None:
    args = objective_args(objective, tmp_path)
    if objective == "dynabert":  # two widths, two depths: sub-networks are a strategy of the same step
        args += ["student=truncated", "student.num_layers=2", "objective.params.widths=[1.0,0.5]",
                 "objective.params.depths=[1.0,0.5]"]
    # log and checkpoint every 4th step, evaluate every 3rd: those steps may read the device
    cfg = run_cfg(*args, "logger.log_every_steps=4", "train.checkpoint_every_steps=4", "logger.grad_shares=true",
                  "train.max_grad_norm=1.0")
    session, parts = session_parts(cfg, tmp_path / "run")
    for plan in session.pre["plans"]:
        plan.cfg["eval_every_steps"] = 3
    counter = _stage_steps_under_counter(parts, session.pre["plans"], steps=6)
    assert counter.count == 0, counter


def test_the_counter_sees_a_sync_in_the_step(tmp_path: Path, run_cfg, monkeypatch,
                                             library_mask_check_allowed) -> None:
    """The test above can fail: a term reading a value on the host inside the step is counted."""
    import kdrun.engine.objective as O

    session, parts = session_parts(run_cfg("objective=logit"), tmp_path / "run")
    real = O.Objective.forward

    def reading(self, *a, **k):
        loss, values = real(self, *a, **k)
        if loss > 1e9:  # __bool__ of a device tensor: a sync
            raise AssertionError
        return loss, values

    monkeypatch.setattr(O.Objective, "forward", reading)
    counter = _stage_steps_under_counter(parts, session.pre["plans"], steps=2)
    assert counter.count >= 2 and all("objective" in where or "test_sync" in where for _, where in counter.events)


def test_nonfinite_loss_is_caught_at_the_next_host_step_naming_stage_step_and_term(tmp_path: Path, run_cfg) -> None:
    from kdrun.engine.checkpoints import TrainState
    from kdrun.engine.trainer import FiniteWatch, TrainingDiverged

    watch = FiniteWatch()
    ok = {"ce": torch.tensor(0.5), "kd": torch.tensor(0.2)}
    watch.add(torch.tensor(0.7), ok, step=1)
    watch.add(torch.tensor(float("nan")), {"ce": torch.tensor(0.5), "kd": torch.tensor(float("inf"))}, step=2)
    watch.add(torch.tensor(0.7), ok, step=3)  # finite again: the first bad step is kept
    plan = type("P", (), {"name": "distil"})()
    with pytest.raises(TrainingDiverged, match=r"stage 'distil': loss term\(s\) kd became non-finite at step 2"):
        watch.check(plan, tmp_path)
    fine = FiniteWatch()
    fine.add(torch.tensor(0.7), ok, step=1)
    fine.check(plan, tmp_path)
    assert TrainState  # imported for the stage state type only
