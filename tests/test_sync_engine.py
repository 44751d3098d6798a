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
    for plan in session.pre.plans:
        plan.cfg["eval_every_steps"] = 3
    counter = _stage_steps_under_counter(parts, session.pre.plans, steps=6)
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
    counter = _stage_steps_under_counter(parts, session.pre.plans, steps=2)
    # located at the objective's call (the step's forward region calls it) or in the reading term
    assert counter.count >= 2 and all(any(w in where for w in ("objective", "forward_loss", "test_sync"))
                                      for _, where in counter.events)


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


def test_ddp_ignores_the_parameters_a_stage_leaves_unused_instead_of_searching_every_step(
        tmp_path: Path, run_cfg) -> None:
    """An intermediate-layer stage (the head is computed but never in the loss) finds its unused
    parameters once, on its first batch, and DDP ignores them without the per-step search (and its
    read-back of the used map). Sub-networks and a forced setting keep the search. Steps through the
    rewrapped student (a process group of one over gloo) give the unwrapped model's weights, and the
    probe leaves the run's random stream alone."""
    import copy
    import os
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from kdrun.engine.checkpoints import TrainState
    from kdrun.engine.trainer import ddp_settings, ignore_unused_parameters, setup_stage, train_step
    from kdrun.strategies.dynabert.strategy import STRATEGY as DYNABERT

    # the teacher runs live in every run (teacher.store=auto decides from timings)
    session, parts = session_parts(run_cfg("objective=tinybert", "teacher.store=off"), tmp_path / "run")
    inter, pred = session.pre.plans
    tcfg = parts.train_cfg
    assert ddp_settings(inter, None, tcfg) == (True, True) and ddp_settings(pred, None, tcfg) == (False, False)
    assert ddp_settings(inter, DYNABERT, tcfg) == (True, False)  # DynaBERT's sub-networks
    assert ddp_settings(inter, None, SimpleNamespace(find_unused_parameters=True)) == (True, False)

    module = parts.accelerator.unwrap_model(parts.student)
    init, init_objective = copy.deepcopy(module.state_dict()), copy.deepcopy(parts.objective.state_dict())
    head = sorted(n for n, _ in module.named_parameters() if n.startswith(("bert.pooler.", "classifier.")))
    found = {}

    def three_steps(ddp: bool, probe: bool = True) -> dict[str, torch.Tensor]:
        module.load_state_dict(init)
        parts.objective.load_state_dict(init_objective)  # its projections train too
        module._ddp_params_and_buffers_to_ignore = []
        parts.student = DDP(module, find_unused_parameters=True, broadcast_buffers=False) if ddp else module
        state = TrainState()
        loop = setup_stage(parts, inter, state, None)
        parts.student.train()
        for batch in loop.loader:
            torch.manual_seed(state.global_step)  # the same dropout masks in both runs
            if ddp and probe and state.global_step == 0:
                found["unused"] = sorted(ignore_unused_parameters(parts, loop, batch, state))
                found["wrapper"] = parts.student
            train_step(parts, loop, batch, state)
            loop.scheduler.step()
            state.global_step += 1
            if state.global_step == 3:
                break
        loop.pbar.close()
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    plain = three_steps(False)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 90))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        searching = three_steps(True, probe=False)  # the search at every step, as before
        wrapped = three_steps(True)
    finally:
        dist.destroy_process_group()
    assert found["unused"] == head, found["unused"]
    assert found["wrapper"].find_unused_parameters is False and found["wrapper"].parameters_to_ignore == set(head)
    moved = max(float((plain[k] - init[k]).abs().max()) for k in plain if plain[k].is_floating_point())
    assert moved > 1e-5  # three warm-up steps
    for k in plain:
        torch.testing.assert_close(wrapped[k], searching[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(wrapped[k], plain[k], rtol=0, atol=0, msg=k)


def _counts_worker(rank: int, port: int, out: str) -> None:
    import json
    from types import SimpleNamespace

    import torch.distributed as dist

    from kdrun.engine.trainer import _global_counts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        parts = SimpleNamespace(world_size=2, accelerator=SimpleNamespace(device=torch.device("cpu")))
        got = _global_counts(parts, examples=8 + rank, tokens=100 * (rank + 1))  # rank 1 saw more
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_ddp_logged_throughput_counts_every_process(tmp_path: Path) -> None:
    """Two gloo processes: the examples and tokens behind train/examples_per_s and tokens_per_s are the
    sum over the processes (each rank logs the run's throughput, not its own share)."""
    import json
    import os

    import torch.multiprocessing as mp

    from kdrun.engine.trainer import _global_counts

    mp.spawn(_counts_worker, args=(29500 + os.getpid() % 400, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [17, 300]
    from types import SimpleNamespace

    assert _global_counts(SimpleNamespace(world_size=1), 5, 60) == (5, 60)  # one process: no collective


def test_ddp_num_workers_auto_shares_the_node_cores_among_its_processes(monkeypatch) -> None:
    import kdrun.tasks.data.batches as P

    monkeypatch.setattr(P, "_available_cpus", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert P.resolve_num_workers("auto", "cuda") == 4  # alone: min(4, 16 / 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert P.resolve_num_workers("auto", "cuda") == 2  # 4 cores each: half of them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert P.resolve_num_workers("auto", "cuda") == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert P.resolve_num_workers("auto", "cuda") == 0  # one core each: collate in the training process
    assert P.resolve_num_workers("auto", "cpu") == 0 and P.resolve_num_workers(3, "cuda") == 3


@pytest.mark.parametrize("objective", ["ckd", "mgskd", "tinybert"])
def test_no_host_sync_inside_a_step_under_graph_replay_semantics(objective: str, tmp_path: Path, run_cfg,
                                                                 monkeypatch, library_mask_check_allowed) -> None:
    """The step as the compiled and graphed modes run it outside their region (outputs copied out of
    the graph's static tensors, meters and the non-finite watch summed in place), under CUDA-graph
    replay semantics, reads nothing on the host. Inside a compiled region a host read cannot hide:
    dynamo breaks the graph at ``item``, ``nonzero`` and data-dependent shapes, and every objective's
    run records zero graph breaks (tests/test_compile_runs.py). (The counter's dispatch mode itself
    makes dynamo run a region eagerly, so it cannot watch a compiled call.)"""
    import kdrun.engine.compiled as compiled

    monkeypatch.setattr(compiled, "step_mode", lambda *a, **k: "replayed")
    cfg = run_cfg(*objective_args(objective, tmp_path), "logger.log_every_steps=4", "train.pad_to_multiple_of=16")
    session, parts = session_parts(cfg, tmp_path / "run")
    counter = _stage_steps_under_counter(parts, session.pre.plans, steps=6)
    assert counter.count == 0, counter
