"""Checks of a stage's ``adaptive`` settings with only the config at hand (before any model loads)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kdrun.strategies.dynabert.options import AdaptiveConfig
from kdrun.strategies.dynabert.subnet import depth_step

DEFAULTS = asdict(AdaptiveConfig())
PHASES = ("width", "depth")
# Sub-networks have fewer heads than the model's config says, which features built from Q/K/V
# projections (split by the configured head count) would get wrong.
UNSUPPORTED_NEEDS = frozenset({"qkv", "attention_scores"})


def adaptive_of(stage_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The stage's adaptive settings when it is a DynaBERT phase, else None; a block given without
    the typed schema (``+objective.stages.0.adaptive.phase=width`` on another objective) gets the
    schema's defaults."""
    a = stage_cfg.get("adaptive") or {}
    if not a.get("phase"):
        return None
    return a if DEFAULTS.keys() <= a.keys() else {**DEFAULTS, **a}


def without_default_adaptive(stage: dict[str, Any]) -> dict[str, Any]:
    """A resolved stage without its ``adaptive`` entry when the stage is an ordinary one, so checkpoint
    identities computed before the key existed keep matching (as kdrun.engine.optim.without_default_optim)."""
    return {k: v for k, v in stage.items() if k != "adaptive" or (v or {}).get("phase")}


def check_adaptive(stage_cfg: dict[str, Any], terms: list[Any], where: str) -> None:
    """Raise ValueError naming the key (``objective.stages[i].adaptive.<key>``) when a setting is wrong."""
    a = adaptive_of(stage_cfg)
    if a is None:
        return
    key = f"{where}.adaptive"
    unknown = sorted(set(a) - DEFAULTS.keys())
    if unknown:
        raise ValueError(f"{key}.{unknown[0]} is not a setting of DynaBERT's adaptive stages ({', '.join(DEFAULTS)})")
    if a["phase"] not in PHASES:
        raise ValueError(f"{key}.phase='{a['phase']}' must be null (an ordinary stage), width (DynaBERT's "
                         "phase 2) or depth (phase 3)")
    lists = [("widths", a["widths"])] + ([("depths", a["depths"])] if a["phase"] == "depth" else [])
    for name, values in lists:
        if not values:
            raise ValueError(f"{key}.{name} is empty; list at least one multiplier (e.g. [1.0, 0.5])")
        if len(set(values)) != len(values):
            raise ValueError(f"{key}.{name}={list(values)} repeats a multiplier")
        for j, v in enumerate(values):
            if not 0.0 < float(v) <= 1.0:
                raise ValueError(f"{key}.{name}[{j}]={v} must be in (0, 1]")
            if name == "depths":
                try:
                    depth_step(float(v))
                except ValueError as e:
                    raise ValueError(f"{key}.depths[{j}]={e}") from None
    n = a.get("importance_samples")
    if n is not None and n < 1:
        raise ValueError(f"{key}.importance_samples={n} must be a positive integer or null (all rows)")
    for t in terms:
        bad = (t.spec.needs | t.spec.teacher_needs) & UNSUPPORTED_NEEDS
        if bad:
            raise ValueError(
                f"{t.where} ('{t.spec.name}') reads {', '.join(sorted(bad))}, which adaptive stages ({key}.phase="
                f"{a['phase']}) cannot give for sub-networks with fewer heads; use terms on logits and hidden states")
