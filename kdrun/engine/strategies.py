"""Stage strategies: training schemes that change how a stage's steps run, behind one registry.

A stage strategy owns one stage option (``objective.stages[i].<key>``, a block of settings typed by
its ``options`` dataclass). A stage that sets the block and is :meth:`StageStrategy.active` runs the
strategy's per-step loop (:meth:`StageStrategy.start`) instead of the engine's plain step. The
engine and the app ask the registry only: which strategy a stage uses, whether its stages need the
teacher live, whether they leave parameters unused under DDP, what it adds to a run's results.

Strategies are found like loss terms and task kinds: every module listed under the entry point
group ``kdrun.stage_strategies`` is imported and calls :func:`register_stage_strategy` on import;
a plug-in package adds one without editing kdrun. Registering also adds the option ``<key>`` to the
config group ``stage_strategy`` (:func:`kdrun.config.register_stage_options`): the stages of an
objective that chooses it carry the block, typed by the strategy's ``options`` (its defaults filled
in, a misspelt key refused when the config is composed); other objectives' stages have no such key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kdrun.config import STAGE_STRATEGIES_GROUP, register_stage_options, unregister_stage_options

_STRATEGIES: dict[str, StageStrategy] = {}
_LOADED = False


class StageStrategy:
    """What a stage strategy provides. Subclass it, set ``key`` and ``options``, override what applies."""

    # The stage option it owns: ``objective.stages[i].<key>``.
    key: str = ""
    # The dataclass of that option's block (defaults included); None: an untyped block.
    options: type | None = None
    # Why its stages run the teacher live (neither the teacher-output store nor the logit table
    # serves them); None: the teacher's outputs may come from either, as in any stage.
    teacher_live: str | None = None
    # Whether its steps run several different forward passes, each reaching other parameters: under
    # DDP the unused parameters are then searched at every step instead of found once per stage.
    leaves_parameters_unused: bool = False
    # Whether its student starts as a copy of the teacher (kdrun-doctor's tiny models follow it).
    student_is_teacher_copy: bool = False

    def active(self, stage_cfg: dict[str, Any]) -> bool:
        """Whether the stage uses the strategy (default: it sets the block)."""
        return bool(stage_cfg.get(self.key))

    def check(self, stage_cfg: dict[str, Any], terms: list[Any], where: str) -> None:
        """Check the stage's block with only the config at hand (plan time); raise ValueError naming
        the key (``<where>.<key>.<setting>``)."""

    def start(self, parts: Any, plan: Any, state: Any) -> Any:
        """The stage's per-step loop (an object with ``passes`` and ``combine``, as the engine's
        PlainStep), set up as the stage starts or resumes; None: plain steps."""
        return None

    def checked_plan(self, plan: Any) -> Any:
        """The stage as ``kdrun-doctor`` runs one step of it (e.g. without a slow setup pass)."""
        return plan

    def identity(self, stage: dict[str, Any]) -> dict[str, Any]:
        """The resolved stage as it counts for a run's identity (run_config_hash): e.g. without a
        block that changes nothing, so checkpoints of runs from before the option existed stay valid."""
        return stage

    def after_run(self, parts: Any, plans: list[Any]) -> dict[str, Any] | None:
        """Entries the strategy adds to results.json after the run (every process calls it; None: none)."""
        return None

    def report(self, results: dict[str, Any], run_dir: Path) -> None:
        """Print or plot what :meth:`after_run` added (the main process only)."""

    def export(self, argv: list[str]) -> int | None:
        """``kdrun-export`` with these arguments when they are the strategy's own (its exit status),
        else None."""
        return None


def register_stage_strategy(strategy: StageStrategy) -> StageStrategy:
    """Make ``strategy`` own the stage option ``strategy.key`` (a later registration replaces it) and
    give Hydra the schema of objectives that use it."""
    if not strategy.key:
        raise ValueError(f"{type(strategy).__name__} names no stage option (key)")
    _STRATEGIES[strategy.key] = strategy
    if strategy.options is not None:
        register_stage_options(strategy.key, strategy.options)
    return strategy


def unregister_stage_strategy(key: str) -> None:
    """Forget the strategy owning ``key`` and its block in the stages (a test's plug-in)."""
    _STRATEGIES.pop(key, None)
    unregister_stage_options(key)


def stage_strategies() -> dict[str, StageStrategy]:
    """Every registered strategy by its option key (installed ones found through entry points)."""
    global _LOADED
    if not _LOADED:
        from kdrun.runtime.plugins import import_entry_point_modules

        import_entry_point_modules(STAGE_STRATEGIES_GROUP, "stage strategy")
        _LOADED = True
    return dict(sorted(_STRATEGIES.items()))


def strategy_of(stage_cfg: dict[str, Any]) -> StageStrategy | None:
    """The strategy a (resolved) stage uses, or None for a plain stage."""
    used = [s for k, s in stage_strategies().items() if k in stage_cfg and s.active(stage_cfg)]
    return used[0] if used else None


def check_stage_options(stage_cfg: dict[str, Any], terms: list[Any], where: str, known: set[str]) -> None:
    """Plan-time checks of a stage's strategy options: each key beside the stage's own settings
    (``known``) must be a registered strategy's, at most one strategy per stage, and each
    strategy checks its block (ValueError naming the key)."""
    strategies = stage_strategies()
    for key in stage_cfg:
        if key not in known and key not in strategies:
            raise ValueError(f"{where}.{key} is neither a stage setting nor a registered stage strategy's option "
                             f"(strategies: {', '.join(strategies) or 'none'})")
    used = [k for k, s in strategies.items() if k in stage_cfg and s.active(stage_cfg)]
    if len(used) > 1:
        raise ValueError(f"{where} uses the stage strategies {', '.join(used)}; a stage runs one at most")
    for key, strategy in strategies.items():
        if key in stage_cfg:
            strategy.check(stage_cfg, terms, where)


def stage_identity(stage: dict[str, Any]) -> dict[str, Any]:
    """A resolved stage as it counts for a run's identity (each strategy's :meth:`StageStrategy.identity`)."""
    for strategy in stage_strategies().values():
        stage = strategy.identity(stage)
    return stage


def strategies_used(plans: list[Any]) -> list[StageStrategy]:
    """The strategies the stages use, once each, in stage order."""
    out: list[StageStrategy] = []
    for plan in plans:
        strategy = strategy_of(plan.cfg)
        if strategy is not None and strategy not in out:
            out.append(strategy)
    return out


def after_run(parts: Any, plans: list[Any]) -> list[tuple[StageStrategy, dict[str, Any]]]:
    """Each used strategy with the entries it adds to results.json (those that add any)."""
    out = []
    for strategy in strategies_used(plans):
        added = strategy.after_run(parts, plans)
        if added:
            out.append((strategy, added))
    return out


def export_with_strategy(argv: list[str]) -> int | None:
    """``kdrun-export`` through the strategy whose arguments these are (its exit status), else None."""
    for strategy in stage_strategies().values():
        status = strategy.export(argv)
        if status is not None:
            return status
    return None
