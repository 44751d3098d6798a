"""An objective = stages of weighted loss terms, built from its YAML.

``plan_stages`` checks names and parameters against the loss registry with only the config at hand
(so typos fail before any model loads). :class:`Objective` then owns what the terms need at run
time: the mapping's layer pairs, and every learnable module the terms ask for, whose parameters
the trainer adds to the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from kdrun.features import Features
from kdrun.losses import LossContext, LossSpec, check_params, get_loss

VALID_DATA = ("original", "augmented")


@dataclass
class Term:
    key: str
    spec: LossSpec
    weight: float
    params: dict[str, Any]
    where: str


@dataclass
class StagePlan:
    index: int
    name: str
    cfg: dict[str, Any]
    terms: list[Term]

    @property
    def student_needs(self) -> frozenset[str]:
        return frozenset().union(*(t.spec.needs for t in self.terms)) if self.terms else frozenset({"logits"})

    @property
    def teacher_needs(self) -> frozenset[str]:
        return frozenset().union(*(t.spec.teacher_needs for t in self.terms)) if self.terms else frozenset()

    @property
    def uses_teacher(self) -> bool:
        return any(t.spec.uses_teacher for t in self.terms)

    @property
    def uses_labels(self) -> bool:
        return any(t.spec.uses_labels for t in self.terms)

    @property
    def teacher_logits_only(self) -> bool:
        return self.uses_teacher and self.teacher_needs <= {"logits"}


def plan_stages(objective_cfg: DictConfig, epochs: float | None = None, lr: float | None = None) -> list[StagePlan]:
    """Resolve and validate the objective's stages (no model needed).

    ``epochs`` / ``lr`` (train.epochs, train.lr) override every stage's value when given.
    """
    stages_cfg = OmegaConf.to_container(objective_cfg.stages, resolve=True)
    for st in stages_cfg:
        if epochs is not None:
            st["epochs"] = epochs
        if lr is not None:
            st["lr"] = lr
    if not stages_cfg:
        raise ValueError(f"objective '{objective_cfg.name}' has no stages; add objective.stages in its YAML")
    plans = []
    for i, st in enumerate(stages_cfg):
        where_stage = f"objective.stages[{i}]"
        if st["data"] not in VALID_DATA:
            raise ValueError(f"{where_stage}.data='{st['data']}' must be one of {VALID_DATA}")
        if not st["losses"]:
            raise ValueError(f"{where_stage} ('{st['name']}') lists no loss terms")
        if all(float(t["weight"]) == 0.0 for t in st["losses"]):
            raise ValueError(f"{where_stage} ('{st['name']}'): every loss term has weight 0")
        if st["epochs"] <= 0 or st["batch_size"] <= 0:
            raise ValueError(f"{where_stage}: epochs and batch_size must be positive")
        terms = []
        for j, term in enumerate(st["losses"]):
            where = f"{where_stage}.losses[{j}]"
            spec = get_loss(term["name"], where)
            params = dict(term.get("params") or {})
            check_params(spec, params, where + ".params")
            if float(term["weight"]) == 0.0:
                continue  # a switched-off term is neither computed nor logged
            terms.append(Term(f"{term['name']}", spec, float(term["weight"]), params, where))
        names = [t.key for t in terms]
        for t in terms:  # repeated names get a suffix so their logged values stay apart
            if names.count(t.key) > 1:
                t.key = f"{t.key}_{terms.index(t)}"
        plans.append(StagePlan(i, st["name"], st, terms))
    return plans


class Objective(nn.Module):
    """Computes a stage's weighted loss; owns the learnable parts of all loss terms."""

    def __init__(
        self,
        plans: list[StagePlan],
        layer_pairs: list[tuple[int, int]],
        num_labels: int,
        student_info: dict[str, int],
        teacher_info: dict[str, int] | None,
    ):
        super().__init__()
        self.plans = plans
        self.layer_pairs = list(layer_pairs)
        self.num_labels = num_labels
        self.term_modules = nn.ModuleDict()
        for plan in plans:
            for term in plan.terms:
                if term.spec.uses_teacher and teacher_info is None:
                    raise ValueError(f"{term.where}: loss '{term.spec.name}' needs a teacher")
                if term.spec.check is not None:
                    try:
                        term.spec.check(student_info, teacher_info, self.layer_pairs, **term.params)
                    except ValueError as e:
                        raise ValueError(f"{term.where} ({term.spec.name}): {e}") from None
                if term.spec.module_factory is not None:
                    module = term.spec.module_factory(student_info, teacher_info, self.layer_pairs, **term.params)
                    if module is not None:
                        self.term_modules[self._module_key(plan, term)] = module

    @staticmethod
    def _module_key(plan: StagePlan, term: Term) -> str:
        return f"stage{plan.index}_{term.key}"

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        plan = self.plans[stage]
        params: list[nn.Parameter] = []
        for term in plan.terms:
            key = self._module_key(plan, term)
            if key in self.term_modules:
                params.extend(p for p in self.term_modules[key].parameters() if p.requires_grad)
        return params

    def log_values(self, stage: int) -> dict[str, float]:
        """Scalars the stage's learnable modules want logged (e.g. learnable layer-map weights).

        A term module exposes them with a ``log_values() -> dict[str, float]`` method; keys are
        prefixed with the term's key. The trainer logs them with the training losses.
        """
        plan = self.plans[stage]
        out: dict[str, float] = {}
        for term in plan.terms:
            module = self.term_modules[self._module_key(plan, term)] if self._module_key(plan, term) in \
                self.term_modules else None
            if module is not None and hasattr(module, "log_values"):
                out.update({f"{term.key}/{k}": float(v) for k, v in module.log_values().items()})
        return out

    def forward(
        self, stage: int, student: Features, teacher: Features | None, batch: dict[str, Any], step: int = 0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns (weighted total, {term key: unweighted value (detached)})."""
        plan = self.plans[stage]
        total = student.logits.new_zeros((), dtype=torch.float32)
        values: dict[str, torch.Tensor] = {}
        for term in plan.terms:
            key = self._module_key(plan, term)
            ctx = LossContext(
                num_labels=self.num_labels,
                layer_pairs=self.layer_pairs,
                module=self.term_modules[key] if key in self.term_modules else None,
                step=step,
            )
            value = term.spec.fn(student, teacher if term.spec.uses_teacher else None, batch, ctx, **term.params)
            values[term.key] = value.detach()
            total = total + term.weight * value.float()
        return total, values
