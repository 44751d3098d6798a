"""Stage strategies (kdrun/engine/strategies.py): a plug-in strategy registered in a test owns its
stage option (typed at composition, checked when planned, its step loop used by the trainer, its
results added after the run); DynaBERT is found through the entry point group; the engine and the
app name no strategy; ordinary stages carry no strategy block."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from omegaconf import OmegaConf

from kdrun.engine.strategies import (
    StageStrategy,
    after_run,
    register_stage_strategy,
    stage_identity,
    stage_strategies,
    strategy_of,
    unregister_stage_strategy,
)
from tests.conftest import REPO, TINY, compose


@dataclass
class EchoOptions:
    on: bool = False
    times: int = 1


class Echo(StageStrategy):
    """A strategy that runs the plain step ``times`` times per batch."""

    key = "echo"
    options = EchoOptions
    teacher_live = "the echo strategy runs the teacher live"
    leaves_parameters_unused = True

    def __init__(self) -> None:
        self.started: list[str] = []

    def active(self, stage_cfg: dict[str, Any]) -> bool:
        return bool((stage_cfg.get("echo") or {}).get("on"))

    def check(self, stage_cfg: dict[str, Any], terms: list[Any], where: str) -> None:
        block = stage_cfg.get("echo") or {}
        if block.get("on") and block["times"] < 1:
            raise ValueError(f"{where}.echo.times={block['times']} must be at least 1")

    def start(self, parts: Any, plan: Any, state: Any) -> Any:
        from kdrun.engine.trainer import PlainStep

        self.started.append(plan.name)
        times, plain = plan.cfg["echo"]["times"], PlainStep()

        class Step:
            def passes(self, parts, loop, batch, state):
                for _ in range(times):
                    yield from plain.passes(parts, loop, batch, state)

            def combine(self, results):
                return results[-1]

        return Step()

    def identity(self, stage: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in stage.items() if k != "echo" or (v or {}).get("on")}

    def after_run(self, parts: Any, plans: list[Any]) -> dict[str, Any] | None:
        return {"echo": {"stages": list(self.started)}}


def echo_stage(block: str) -> str:
    """The whole stages list, one stage with the echo block (a block is set where the stage is written)."""
    return ("objective.stages=[{name: only, epochs: 1, lr: 1e-3, batch_size: 16, "
            f"losses: [{{name: ce, weight: 1.0}}], echo: {block}}}]")


@pytest.fixture
def echo():
    strategy = register_stage_strategy(Echo())
    yield strategy
    unregister_stage_strategy("echo")


def test_dynabert_is_found_through_the_entry_point_group() -> None:
    from kdrun.strategies.dynabert.strategy import DynaBERT

    assert isinstance(stage_strategies()["adaptive"], DynaBERT)
    stages = compose(["objective=dynabert"]).objective.stages
    assert all(strategy_of(OmegaConf.to_container(s, resolve=True)) is stage_strategies()["adaptive"] for s in stages)


def test_ordinary_stages_carry_no_strategy_block() -> None:
    stage = OmegaConf.to_container(compose(["objective=ckd"]).objective.stages[0], resolve=True)
    assert not set(stage) & set(stage_strategies())  # no key of any strategy, not even a null one
    assert stage_identity(stage) == stage
    assert strategy_of(stage) is None


def test_a_plugin_strategy_owns_its_stage_option(echo) -> None:
    from hydra.errors import ConfigCompositionException

    from kdrun.engine.objective import plan_stages

    cfg = compose([*TINY, "objective=logit", "stage_strategy=echo", echo_stage("{on: true, times: 2}")])
    assert cfg.objective.stages[0].echo.times == 2
    plans = plan_stages(cfg.objective)
    assert strategy_of(plans[0].cfg) is echo
    with pytest.raises(ConfigCompositionException, match="tmies"):
        compose([*TINY, "objective=logit", "stage_strategy=echo", echo_stage("{on: true, tmies: 2}")])
    with pytest.raises(ConfigCompositionException, match="tmies"):
        compose([*TINY, "objective=logit", "stage_strategy=echo", echo_stage("{on: true}"),
                 "objective.stages.0.echo.tmies=2"])
    bad = compose([*TINY, "objective=logit", "stage_strategy=echo", echo_stage("{on: true}"),
                   "objective.stages.0.echo.times=0"])
    with pytest.raises(ValueError, match=re.escape("objective.stages[0].echo.times=0")):
        plan_stages(bad.objective)
    off = OmegaConf.to_container(compose([*TINY, "objective=logit"]).objective.stages[0], resolve=True)
    assert "echo" not in stage_identity(off)  # a stage without the block counts as before the option existed


def test_a_strategy_block_without_the_strategy_fails_at_composition_with_a_hint() -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", "task=toy", "objective=logit", echo_stage("{phase: width}")
                        .replace("echo:", "adaptive:"), "--cfg", "job"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Key 'adaptive' not in 'StageConfig'" in r.stderr
    assert "override /stage_strategy@_global_.stage_strategy: adaptive" in r.stderr


def test_unknown_stage_keys_fail_when_planned() -> None:
    from kdrun.engine.objective import plan_stages

    cfg = compose([*TINY, "objective=logit", "+objective.stages.0.no_such_option=1"])
    with pytest.raises(ValueError, match=re.escape("objective.stages[0].no_such_option")):
        plan_stages(cfg.objective)


def test_the_trainer_runs_the_strategy_and_the_run_reports_it(echo, run_cfg, tmp_path) -> None:
    from kdrun.app.run import run
    from kdrun.engine.objective import plan_stages
    from kdrun.engine.trainer import ddp_settings, leaves_parameters_unused

    args = ("objective=logit", "stage_strategy=echo", echo_stage("{on: true, times: 2}"))
    plans = plan_stages(run_cfg(*args).objective)
    assert leaves_parameters_unused(plans[0], echo) and ddp_settings(plans[0], echo, run_cfg().train) == (True, False)
    out = run(run_cfg(*args), tmp_path / "run")
    assert echo.started == [plans[0].name]
    assert out["echo"] == {"stages": [plans[0].name]}
    assert after_run(None, plans)[0][0] is echo


def test_app_and_engine_name_no_strategy() -> None:
    r = subprocess.run(["grep", "-rn", "-i", r"dynabert\|adaptive", "kdrun/app", "kdrun/engine"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.stdout == "", r.stdout


def test_kdrun_export_dispatches_to_the_strategy(echo, monkeypatch) -> None:
    from kdrun.app.export import main

    monkeypatch.setattr(Echo, "export", lambda self, argv: 7 if argv == ["echo-export"] else None)
    assert main(["echo-export"]) == 7


def test_cfg_job_prints_no_strategy_block_for_ordinary_stages() -> None:
    r = subprocess.run([sys.executable, "-m", "kdrun", "task=toy", "objective=ckd", "--cfg", "job"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "adaptive" not in r.stdout and "phase:" not in r.stdout and "widths:" not in r.stdout
    assert "stage_strategy" not in r.stdout  # the group types the stages; it adds no key of its own


def test_the_extended_schema_unpickles_in_a_fresh_process(tmp_path) -> None:
    """Launchers (submitit, SLURM) send Hydra's config store and the composed config to a fresh
    process: the schema extended by the strategies' blocks must unpickle there (it once failed
    with 'object_type=None' in every job)."""
    import pickle
    import subprocess
    import sys

    from tests.conftest import REPO, compose

    cfg = compose(["objective=dynabert"])
    (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(cfg))
    code = ("import pickle, sys; cfg = pickle.loads(open(sys.argv[1], 'rb').read()); stage = cfg.objective.stages[0]; "
            "print(type(stage._metadata.object_type).__name__, stage.adaptive.phase)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cfg.pkl")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "type"
    assert out.stdout.split()[1] == str(cfg.objective.stages[0].adaptive.phase)
