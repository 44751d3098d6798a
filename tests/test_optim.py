"""Optimizers and schedules from config: the defaults build torch's fused AdamW
with a linear warmup schedule (``fused: false``: the per-tensor loop kdrun used before), other
optimizers come by name with their kwargs, the cosine and constant schedules give the expected
learning rates, and bad names fail at preflight."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kdrun.app.run import ConfigError, preflight
from kdrun.engine.objective import StagePlan
from kdrun.engine.trainer import make_optimizer, make_scheduler
from tests.conftest import compose

STAGE = {"name": "s", "lr": 1e-2, "weight_decay": 0.01, "warmup_ratio": 0.25, "objective_lr": None,
         "optimizer": None, "scheduler": None}


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def parts(model: nn.Module, *overrides: str) -> SimpleNamespace:
    cfg = compose(list(overrides))
    return SimpleNamespace(student=model, objective=SimpleNamespace(stage_parameters=lambda i: []),
                           train_cfg=cfg.train)


def plan(**stage) -> StagePlan:
    return StagePlan(0, "s", {**STAGE, **stage}, [])


def train_steps(model: nn.Module, optimizer, scheduler, steps: int = 3) -> list[float]:
    torch.manual_seed(1)
    lrs = []
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def reference_adamw(ref: nn.Module, **kwargs):
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01, "lr": 1e-2},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}], lr=1e-2, **kwargs)


@pytest.mark.parametrize("overrides,kwargs", [((), {"fused": True}),
                                              (("train.optimizer.kwargs={fused: false}",), {"foreach": False})])
def test_default_is_fused_adamw_with_linear_warmup(overrides, kwargs) -> None:
    """The default is torch's fused AdamW with linear warmup, step for step; ``fused: false`` is the
    per-tensor loop kdrun used before, bit for bit."""
    from transformers import get_linear_schedule_with_warmup

    ours = tiny_model()
    opt = make_optimizer(parts(ours, *overrides), plan())
    sched = make_scheduler(plan(), parts(ours).train_cfg, opt, total_steps=8)
    ref = tiny_model()
    ref_opt = reference_adamw(ref, **kwargs)
    ref_sched = get_linear_schedule_with_warmup(ref_opt, 2, 8)
    assert type(opt) is torch.optim.AdamW
    assert train_steps(ours, opt, sched) == train_steps(ref, ref_opt, ref_sched)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


def test_fused_and_per_tensor_adamw_make_the_same_update() -> None:
    """Same mathematics, different summation: after 8 steps the weights agree to float32 rounding
    but a bug in the flag (another optimizer, lost weight decay) would move them by ~lr."""
    models = {}
    for kwargs in ({"fused": True}, {"foreach": False}):
        model = models[next(iter(kwargs))] = tiny_model()
        opt = reference_adamw(model, **kwargs)
        train_steps(model, opt, torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0), steps=8)
    with torch.no_grad():
        diffs = [float((a - b).abs().max()) for a, b in zip(models["fused"].parameters(),
                                                             models["foreach"].parameters())]
    assert max(diffs) < 1e-5, diffs


def test_an_explicit_implementation_is_kept() -> None:
    for kw, attr in (("{foreach: true}", "foreach"), ("{differentiable: false}", "differentiable")):
        opt = make_optimizer(parts(tiny_model(), f"train.optimizer.kwargs={kw}"), plan())
        assert not opt.defaults["fused"] and attr in opt.defaults
    opt = make_optimizer(parts(tiny_model(), "train.optimizer.name=SGD"), plan())
    assert not opt.defaults.get("fused")


def test_sgd_by_name_with_kwargs() -> None:
    p = parts(tiny_model(), "train.optimizer={name: SGD, kwargs: {momentum: 0.9, nesterov: true}}")
    opt = make_optimizer(p, plan())
    assert type(opt) is torch.optim.SGD
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]  # biases and LayerNorm not decayed
    assert all(g["momentum"] == 0.9 and g["nesterov"] and g["lr"] == 1e-2 for g in opt.param_groups)


def test_a_stage_may_use_its_own_optimizer_and_schedule() -> None:
    p = parts(tiny_model(), "train.optimizer.name=SGD")
    own = plan(optimizer={"name": "Adam", "kwargs": {"betas": [0.8, 0.9]}}, scheduler="constant")
    opt = make_optimizer(p, own)
    assert type(opt) is torch.optim.Adam and tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9)
    sched = make_scheduler(own, p.train_cfg, opt, total_steps=8)
    assert train_steps(p.student, opt, sched, steps=4)[-1] == pytest.approx(1e-2)  # no decay after warmup


@pytest.mark.parametrize("name,expected", [
    # warmup 2 of 10 steps, peak lr 1: lr(s) = s/2 during warmup, then progress p = (s - 2) / 8
    ("linear", {0: 0.0, 1: 0.5, 2: 1.0, 4: 0.75, 6: 0.5, 10: 0.0}),
    ("cosine", {0: 0.0, 1: 0.5, 2: 1.0, 4: 0.5 * (1 + math.cos(math.pi / 4)), 6: 0.5,
                8: 0.5 * (1 - math.cos(math.pi / 4)), 10: 0.0}),
    ("constant", {0: 0.0, 1: 0.5, 2: 1.0, 6: 1.0, 10: 1.0}),
])
def test_schedules_give_the_expected_lr(name: str, expected: dict[int, float]) -> None:
    p = parts(tiny_model(), f"train.scheduler={name}")
    opt = make_optimizer(p, plan(lr=1.0, warmup_ratio=0.2))
    sched = make_scheduler(plan(warmup_ratio=0.2), p.train_cfg, opt, total_steps=10)
    lrs = {0: sched.get_last_lr()[0]}
    for step in range(1, 11):
        opt.step()
        sched.step()
        lrs[step] = sched.get_last_lr()[0]
    for step, lr in expected.items():
        assert lrs[step] == pytest.approx(lr, abs=1e-12), (name, step)


TINY_RUN = ["teacher=tiny_random", "student=tiny_random", "logger=none", "task=toy"]


@pytest.mark.parametrize("overrides,message", [
    (["train.optimizer.name=Adamw"], r"train.optimizer.name='Adamw' is not a torch.optim optimizer .*'AdamW'"),
    (["train.optimizer.name=LBFGS"], r"train.optimizer.name='LBFGS' .*closure.*'SGD'"),
    (["train.optimizer.kwargs={betaz: [0.9, 0.98]}"], r"train.optimizer.kwargs.betaz: AdamW takes no such .*'betas'"),
    (["train.optimizer.kwargs={lr: 0.1}"], r"train.optimizer.kwargs.lr: set by the stage"),
    (["train.optimizer.kwargs={betas: [0.9, 1.5]}"], r"train.optimizer.kwargs=.*AdamW refuses them"),
    (["train.optimizer.kwargs={fused: maybe}"], r"train.optimizer.kwargs.fused='maybe' must be true or false"),
    (["train.optimizer.name=Rprop"], r"train.optimizer.name=Rprop has no weight decay"),
    (["train.scheduler=step"], r"train.scheduler='step' is not a schedule; choose one of \['linear', 'cosine', "),
    (["objective.stages.0.scheduler=exp"], r"objective.stages\[0\].scheduler='exp'"),
    (["objective.stages.0.optimizer={name: Adagrd}"], r"objective.stages\[0\].optimizer.name='Adagrd'.*'Adagrad'"),
    (["teacher.finetune.optimizer.name=Muon"], r"teacher.finetune.optimizer.name='Muon' .*2-D"),
    (["teacher.finetune.scheduler=cosin"], r"teacher.finetune.scheduler='cosin'"),
])
def test_bad_optimizer_or_schedule_fails_at_preflight(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        preflight(compose([*TINY_RUN, *overrides]))


def test_good_choices_pass_preflight_and_a_misspelt_key_fails_at_compose() -> None:
    preflight(compose([*TINY_RUN, "train.optimizer.name=SGD", "train.optimizer.kwargs={momentum: 0.9}",
                       "train.scheduler=cosine", "teacher.finetune.scheduler=constant"]))
    # a teacher that is loaded, not fine-tuned, is not checked
    preflight(compose([*TINY_RUN, "objective=finetune", "teacher.finetune.optimizer.name=nope"]))
    with pytest.raises(Exception, match="nme"):
        compose([*TINY_RUN, "train.optimizer.nme=SGD"])


def test_stage_optimizer_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"objective.stages\[0\].optimizer: takes name and kwargs .*'nme'"):
        preflight(compose([*TINY_RUN, "objective.stages.0.optimizer={nme: SGD}"]))
