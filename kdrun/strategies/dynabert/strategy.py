"""DynaBERT as a stage strategy of kdrun's engine: the stage option ``adaptive`` (kdrun/engine/strategies.py).

Registered on import (entry point group ``kdrun.stage_strategies``); the objectives that use it
(conf/objective/dynabert*.yaml) choose it in their defaults
(``- override /stage_strategy@_global_.stage_strategy: adaptive``), so their stages carry the typed
``adaptive`` block below; other objectives' stages have no such key. Imports nothing heavy at module level: Hydra's
schema registration imports this module.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kdrun.engine.strategies import StageStrategy, register_stage_strategy
from kdrun.strategies.dynabert.options import AdaptiveConfig


class DynaBERT(StageStrategy):
    """Stages with ``adaptive.phase`` set train every sub-network of one network per batch."""

    key = "adaptive"
    options = AdaptiveConfig
    teacher_live = "DynaBERT's adaptive stages run the teacher live"
    leaves_parameters_unused = True  # every sub-network reaches other heads, neurons and layers
    student_is_teacher_copy = True  # the teacher's own copy, trained at several widths and depths

    def active(self, stage_cfg: dict[str, Any]) -> bool:
        from kdrun.strategies.dynabert.plan import adaptive_of

        return adaptive_of(stage_cfg) is not None

    def check(self, stage_cfg: dict[str, Any], terms: list[Any], where: str) -> None:
        from kdrun.strategies.dynabert.plan import check_adaptive

        check_adaptive(stage_cfg, terms, where)

    def start(self, parts: Any, plan: Any, state: Any) -> Any:
        from kdrun.strategies.dynabert.train import start_adaptive

        return start_adaptive(parts, plan, state)

    def checked_plan(self, plan: Any) -> Any:
        """Without phase 1's rewiring (an importance pass over the data)."""
        return replace(plan, cfg={**plan.cfg, "adaptive": {**plan.cfg["adaptive"], "rewire": False}})

    def identity(self, stage: dict[str, Any]) -> dict[str, Any]:
        from kdrun.strategies.dynabert.plan import without_default_adaptive

        return without_default_adaptive(stage)

    def after_run(self, parts: Any, plans: list[Any]) -> dict[str, Any] | None:
        from kdrun.strategies.dynabert.results import evaluate_subnetworks

        subnets = evaluate_subnetworks(parts, plans)  # every (m_w, m_d)
        return {"subnetworks": subnets} if subnets is not None else None

    def report(self, results: dict[str, Any], run_dir: Path) -> None:
        from kdrun.strategies.dynabert.results import report

        report(results["subnetworks"], run_dir)

    def export(self, argv: list[str]) -> int | None:
        """``kdrun-export RUN_DIR width=<m_w> depth=<m_d> OUT_DIR`` (kdrun.strategies.dynabert.export)."""
        if any(a == "--format" or a.startswith("--format=") for a in argv) or \
                not any(a.startswith(("width=", "depth=")) for a in argv):
            return None
        from kdrun.strategies.dynabert.export import main

        return main(list(argv))


STRATEGY = register_stage_strategy(DynaBERT())
