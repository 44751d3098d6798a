"""Registry of loss terms by the name objective YAMLs use.

A loss term is a pure function ``fn(student: Features, teacher: Features | None, batch, ctx,
**params) -> scalar tensor``. The decorator records what it needs from each model so the trainer
computes nothing more; ``module_factory`` (optional) builds the term's learnable parameters
(projections, layer weights), which the objective owns and the optimizer trains.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from kdrun.features import KNOWN_NEEDS


@dataclass
class LossContext:
    """What a loss term may know besides the two feature records and the batch."""

    num_labels: int
    # (student layer, teacher layer) pairs of the mapping group; hidden-state indices (0 = embeddings).
    layer_pairs: list[tuple[int, int]] = field(default_factory=list)
    # The term's own learnable module (from module_factory), if any.
    module: nn.Module | None = None
    step: int = 0
    # The built mapping (kdrun.mapping.LayerMap) for terms that combine teacher layers; layer_pairs
    # is its one-to-one view (the current draw for mapping=random).
    layer_map: Any = None

    @property
    def regression(self) -> bool:
        return self.num_labels == 1


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[..., torch.Tensor]
    needs: frozenset[str]
    teacher_needs: frozenset[str]
    uses_teacher: bool
    uses_labels: bool
    module_factory: Callable[..., nn.Module | None] | None
    check: Callable[..., None] | None
    param_names: frozenset[str]
    doc: str


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    *,
    needs: set[str] | frozenset[str] = frozenset({"logits"}),
    teacher_needs: set[str] | frozenset[str] | None = None,
    uses_teacher: bool = True,
    uses_labels: bool = False,
    module_factory: Callable[..., nn.Module | None] | None = None,
    check: Callable[..., None] | None = None,
):
    """Register a loss term.

    ``check(student_info, teacher_info, layer_pairs, **params)`` (optional) validates the models
    before training starts (widths, head counts) and raises ValueError with what to change.
    ``*_info`` are dicts with ``layers``, ``hidden``, ``heads``.
    """
    needs = frozenset(needs) | {"logits"}
    t_needs = (frozenset(teacher_needs) | {"logits"}) if teacher_needs is not None else needs
    unknown = (needs | t_needs) - KNOWN_NEEDS
    if unknown:
        raise ValueError(f"loss '{name}': unknown needs {sorted(unknown)}; known: {sorted(KNOWN_NEEDS)}")

    def deco(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if name in LOSSES:
            raise ValueError(f"loss term '{name}' registered twice")
        sig = inspect.signature(fn)
        params = frozenset(list(sig.parameters)[4:])
        LOSSES[name] = LossSpec(
            name=name,
            fn=fn,
            needs=needs,
            teacher_needs=t_needs if uses_teacher else frozenset(),
            uses_teacher=uses_teacher,
            uses_labels=uses_labels,
            module_factory=module_factory,
            check=check,
            param_names=params,
            doc=(inspect.getdoc(fn) or "").split("\n")[0],
        )
        return fn

    return deco


def get_loss(name: str, where: str = "loss") -> LossSpec:
    _import_builtin_losses()
    if name not in LOSSES:
        raise KeyError(f"{where}: unknown loss term '{name}'. Valid loss terms: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


def check_params(spec: LossSpec, params: dict[str, Any], where: str) -> None:
    unknown = set(params) - spec.param_names
    if unknown:
        raise KeyError(
            f"{where}: loss term '{spec.name}' has no parameter(s) {sorted(unknown)}; "
            f"it accepts {sorted(spec.param_names) or 'none'}"
        )
    sig = inspect.signature(spec.fn)
    missing = [
        p.name
        for i, p in enumerate(sig.parameters.values())
        if i >= 4 and p.default is inspect.Parameter.empty and p.name not in params
    ]
    if missing:
        raise KeyError(f"{where}: loss term '{spec.name}' needs parameter(s) {missing}")


def _import_builtin_losses() -> None:
    # Importing the modules runs their @register_loss decorators.
    from kdrun.losses import ckd, hidden, layerwise, mgskd, minilm, prediction, tinybert  # noqa: F401
