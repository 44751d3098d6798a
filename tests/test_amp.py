"""Mixed precision on CPU stand-ins of the GPU paths: every objective takes training steps under bf16
autocast and under fp16 autocast with a ``torch.amp.GradScaler("cpu")`` (kdrun.runtime.precision), with
losses close to fp32's from the same weights and batches; the run's one scaler unscales each stage's
gradients exactly once (a second stage's gradients equal fp32's, not fp32's / scale)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, TOY, compose, task_objectives

STEPS = 3
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per value), fp16 11 bits; a few steps of
# forward passes through tiny random models stay within these of the fp32 loss.
REL_TOL = {"bf16": 0.05, "fp16": 0.01}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("amp-cache")


def session_parts(cfg, run_dir: Path):
    """The run's parts (data, cached teacher, student, objective) as kdrun.app.run builds them."""
    from kdrun.app.run import open_run

    session, _, _, parts = open_run(cfg, run_dir)
    return session, parts


def steps_in(parts, plans, precision: str) -> list[float]:
    """STEPS optimizer steps of every stage from the parts' current weights, in ``precision``."""
    from kdrun.app.models import cast_teacher
    from kdrun.engine.checkpoints import TrainState
    from kdrun.engine.trainer import setup_stage, train_step
    from kdrun.runtime.precision import Precision

    acc = parts.accelerator
    acc.precision = Precision(precision, "cpu")
    if parts.teacher is not None:
        parts.teacher = cast_teacher(parts.teacher, "auto", acc.precision)
    losses = []
    for plan in plans:
        state = TrainState(stage=plan.index)
        loop = setup_stage(parts, plan, state, None)
        parts.student.train()
        for batch in loop.loader:
            if state.stage_step >= STEPS:
                break
            torch.manual_seed(state.global_step)  # the same dropout masks in every precision
            loss, _ = train_step(parts, loop, batch, state)
            losses.append(float(loss))
            state.stage_step += 1
            state.global_step += 1
            loop.scheduler.step()
        loop.pbar.close()
        loop.watch.check(plan, parts.run_dir)
    return losses


def objective_args(objective: str, tmp: Path) -> list[str]:
    if objective == "minilmv2":  # relation heads that divide the tiny models' width
        return ["objective=minilmv2", "objective.params.relation_heads=4"]
    if objective != "mgskd":
        return [f"objective={objective}"]
    from tests.test_mgskd import write_corpus

    return ["objective=mgskd", "objective.params.heads=8", f"spans.corpus_dir={write_corpus(tmp / 'conll')}"]


@pytest.mark.parametrize("objective", task_objectives())
def test_every_objective_steps_under_bf16_and_fp16_autocast_near_fp32(objective: str, cache: Path,
                                                                       tmp_path: Path) -> None:
    cfg = compose([*TINY, *TOY, f"cache_dir={cache}", "train.precision=fp32", "student.dropout=0.0",
                   *objective_args(objective, tmp_path)])
    session, parts = session_parts(cfg, tmp_path / "run")
    init_s = copy.deepcopy(parts.accelerator.unwrap_model(parts.student).state_dict())
    init_o = copy.deepcopy(parts.objective.state_dict())
    teacher = parts.teacher
    got = {}
    for precision in ("no", "bf16", "fp16"):
        parts.accelerator.unwrap_model(parts.student).load_state_dict(init_s)
        parts.objective.load_state_dict(init_o)
        parts.teacher = copy.deepcopy(teacher) if teacher is not None else None
        got[precision] = steps_in(parts, session.pre.plans, precision)
    ref = torch.tensor(got["no"])
    assert torch.isfinite(ref).all() and len(ref) == STEPS * len(session.pre.plans)
    for precision in ("bf16", "fp16"):
        have = torch.tensor(got[precision])
        rel = ((have - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
        assert rel < REL_TOL[precision], (objective, precision, got)
    assert got["bf16"] != got["no"]  # autocast did run in half precision


def test_autocast_runs_the_models_in_half_and_the_objective_in_fp32(run_cfg, tmp_path: Path) -> None:
    """Under bf16 the student's features are bf16 (autocast is on), the loss and each term fp32."""
    from kdrun.engine.checkpoints import TrainState
    from kdrun.engine.trainer import objective_loss, setup_stage
    from kdrun.models.features import extract_features
    from kdrun.runtime.precision import Precision

    session, parts = session_parts(run_cfg("objective=tinybert"), tmp_path / "run")
    parts.accelerator.precision = Precision("bf16", "cpu")
    plan = session.pre.plans[0]
    loop = setup_stage(parts, plan, TrainState(), None)
    batch = next(iter(loop.loader))
    with parts.accelerator.autocast():
        s = extract_features(parts.student, batch, plan.student_needs)
    assert s.hidden_states[-1].dtype == torch.bfloat16 or s.logits.dtype == torch.bfloat16
    with torch.no_grad(), parts.accelerator.autocast():
        t = extract_features(parts.teacher, batch, plan.teacher_needs)
    loss, values = objective_loss(parts, loop, batch, TrainState(), s, t)
    assert loss.dtype == torch.float32 and all(v.dtype == torch.float32 for v in values.values()), values
    loop.pbar.close()


def test_precision_auto_takes_native_bf16_only(monkeypatch) -> None:
    import kdrun.runtime.precision as P

    assert P.resolve_precision("auto", "cpu") == "no"
    monkeypatch.setattr(P, "native_bf16", lambda: True)
    assert P.resolve_precision("auto", "cuda") == "bf16"
    monkeypatch.setattr(P, "native_bf16", lambda: False)  # V100/T4: emulated bf16 is not taken
    assert P.resolve_precision("auto", "cuda") == "fp16"
    monkeypatch.undo()
    seen = {}

    def supported(including_emulation=True):
        seen["emulation"] = including_emulation
        return including_emulation  # a pre-Ampere GPU: only emulated bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert P.native_bf16() is False and seen == {"emulation": False}
    with pytest.raises(Exception, match="train.precision"):
        P.resolve_precision("half", "cpu")


def _grads_at_steps(parts, session, precision: str) -> list[tuple[int, torch.Tensor]]:
    """The (stage, unscaled gradient of the student's decayed weights) the optimizer applies at each
    step of a whole run's stages; patched into the run's one Precision object."""
    from kdrun.runtime.precision import Precision

    seen: list[tuple[int, torch.Tensor]] = []
    prec = Precision(precision, "cpu")
    step = prec.step

    def recording(optimizer):
        grads = [p.grad.reshape(-1) for p in optimizer.param_groups[0]["params"] if p.grad is not None]
        seen.append((len(optimizer.param_groups), torch.cat(grads).float().clone()))
        step(optimizer)

    prec.step = recording
    parts.accelerator.precision = prec
    return seen


def test_second_stage_fp16_gradients_are_unscaled_once(run_cfg, tmp_path: Path) -> None:
    """Two stages under fp16 + GradScaler: every optimizer step sees the true gradient (close to the
    fp32 run's at the same step), in stage 2 as in stage 1. Unscaling every stage's optimizer at each
    clipping (one scaler registered per stage) divides stage-2 gradients by the loss scale again."""
    from kdrun.app.run import train_stages

    args = ("objective=two_stage_logit", "student.dropout=0.0", "train.max_grad_norm=1000.0",
            "train.checkpoint_every_steps=1000")
    runs = {}
    for precision in ("no", "fp16"):
        session, parts = session_parts(run_cfg(*args, "train.precision=fp32", "train.epochs=1"),
                                       tmp_path / precision)
        seen = _grads_at_steps(parts, session, precision)
        train_stages(session, parts)
        runs[precision] = seen
        assert len(session.pre.plans) == 2
    assert len(runs["no"]) == len(runs["fp16"]) > 4
    stage_of = [n for n, _ in runs["no"]]
    compared = 0
    for i, ((_, g32), (_, g16)) in enumerate(zip(runs["no"], runs["fp16"])):
        if not torch.isfinite(g16).all():  # the scaler skips a step whose scaled gradients overflowed
            continue
        ratio = (g16.norm() / g32.norm()).item()
        cos = torch.nn.functional.cosine_similarity(g16, g32, dim=0).item()
        assert 0.9 < ratio < 1.1 and cos > 0.99, (i, stage_of[i], ratio, cos)
        compared += 1
    assert compared >= len(runs["no"]) - 2


def test_scaler_state_is_checkpointed_and_restored(run_cfg, tmp_path: Path) -> None:
    from kdrun.app.run import train_stages
    from kdrun.engine.trainer import SimulatedInterrupt
    from kdrun.runtime.precision import Precision

    session, parts = session_parts(run_cfg("objective=logit", "train.stop_after_steps=3",
                                           "train.checkpoint_every_steps=3"), tmp_path / "run")
    parts.accelerator.precision = Precision("fp16", "cpu")
    parts.accelerator.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
    with pytest.raises(SimulatedInterrupt):
        train_stages(session, parts)
    scale = parts.accelerator.precision.loss_scale()
    assert scale != 2.0**20  # it moved (grown or backed off), so the restored value means something
    blob = torch.load(tmp_path / "run" / "checkpoints" / "last" / "optim_rng.pt", weights_only=True)
    assert blob["scaler"]["scale"] == scale
    fresh = Precision("fp16", "cpu")
    fresh.load_state_dict(blob["scaler"])
    assert fresh.loss_scale() == scale
