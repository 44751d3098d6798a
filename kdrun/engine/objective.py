"""An objective = stages of weighted loss terms, built from its YAML.

``plan_stages`` checks names and parameters against the loss registry with only the config at hand
(so typos fail before any model loads). :class:`Objective` then owns what the terms need at run
time: the layer maps built from the ``mapping`` group (shared by the terms that use them), and every
learnable module the terms ask for; the parameters of both go to the optimizer, into checkpoints
(objective.safetensors) and, where a module offers ``log_values``, into the logs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from kdrun.config import StageConfig
from kdrun.engine.balance import Balancer
from kdrun.engine.strategies import check_stage_options
from kdrun.errors import ConfigError
from kdrun.losses import LossContext, LossSpec, Params, check_params, get_loss
from kdrun.losses.registry import expand_terms, import_loss_modules
from kdrun.models.features import Features
from kdrun.models.mapping import MAPPINGS, STRATEGY_PARAMS, LayerMap, MappedPairs, MappingSpec, pairs_map

VALID_DATA = ("original", "augmented")
STAGE_KEYS = {f.name for f in fields(StageConfig)}  # a stage's own settings; other keys: strategies'


@dataclass
class Term:
    key: str
    spec: LossSpec
    weight: float
    params: Params  # the term's typed, validated parameters
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

    def label_terms(self, regression: bool) -> list[str]:
        """The terms that read the gold labels (on a regression task when ``regression``)."""
        return [t.key for t in self.terms if (t.spec.uses_labels(t.params, regression)
                                              if callable(t.spec.uses_labels) else t.spec.uses_labels)]

    @property
    def teacher_reads_padding(self) -> bool:
        """Whether a term reads the teacher's outputs at padded positions (declared ``reads_padding``)."""
        return any(t.spec.reads_padding is not None and t.spec.reads_padding(t.params) for t in self.terms)

    @property
    def teacher_logits_only(self) -> bool:
        return self.uses_teacher and self.teacher_needs <= {"logits"}


def plan_stages(objective_cfg: DictConfig, epochs: float | None = None, lr: float | None = None) -> list[StagePlan]:
    """Resolve and validate the objective's stages (no model needed).

    ``epochs`` / ``lr`` (train.epochs, train.lr) override every stage's value when given.
    """
    import_loss_modules(objective_cfg.get("imports") or [])
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
        for where, term in expand_terms(st["losses"], where_stage):  # a term group stands for its terms
            spec = get_loss(term["name"], where)
            params = check_params(spec, term.get("params") or {}, where)
            if float(term["weight"]) == 0.0:
                continue  # a switched-off term is neither computed nor logged
            terms.append(Term(f"{term['name']}", spec, float(term["weight"]), params, where))
        names = [t.key for t in terms]
        for t in terms:  # repeated names get a suffix so their logged values stay apart
            if names.count(t.key) > 1:
                t.key = f"{t.key}_{terms.index(t)}"
        check_stage_options(st, terms, where_stage, STAGE_KEYS)  # a stage strategy's block, if any
        plans.append(StagePlan(i, st["name"], st, terms))
    return plans


class Objective(nn.Module):
    """Computes a stage's weighted loss; owns the learnable parts of all loss terms and the layer maps.

    ``mapping`` is a :class:`~kdrun.models.mapping.MappingSpec` (the ``mapping`` group) or explicit
    (student, teacher) pairs. Maps are built for the models' depths and shared by the terms that use
    the same one; a term gets its own map when it leaves the student's last layer out
    (``match_last: false``) or names its paper's map (``mapping`` / ``buckets`` params, applied while
    the group is at its default ``uniform``). A term must handle its map's kind (one-to-one, weighted,
    per-example, concatenation): terms that only read ``ctx.layer_pairs`` get one-to-one maps only.
    Learnable parts (projections, θ) are parameters of this module: the trainer optimises
    :meth:`stage_parameters` and checkpoints the module's state.
    """

    def __init__(
        self,
        plans: list[StagePlan],
        mapping: MappingSpec | list[tuple[int, int]] | None,
        num_labels: int,
        student_info: dict[str, int],
        teacher_info: dict[str, int] | None,
        balance: str = "fixed",
        balance_alpha: float = 1.5,
    ):
        super().__init__()
        self.plans = plans
        self.num_labels = num_labels
        self.mapping = mapping if isinstance(mapping, MappingSpec) else None
        self._fixed_pairs = None if self.mapping is not None else [tuple(p) for p in (mapping or [])]
        self.term_modules = nn.ModuleDict()
        self.maps = nn.ModuleDict()
        self._term_map: dict[str, str] = {}  # module key of a term -> key of its map
        self._alias: dict[str, str] = {}  # module key of a term -> module key it shares (share_key)
        self._info = (student_info, teacher_info)
        for plan in plans:
            shared: dict[str, str] = {}
            for term in plan.terms:
                key = self._module_key(plan, term)
                if term.spec.uses_teacher and teacher_info is None:
                    raise ConfigError(f"{term.where}: loss '{term.spec.name}' needs a teacher")
                pairs = self._map_for(plan, term, key) if teacher_info is not None else MappedPairs([])
                try:
                    term.spec.check_models(student_info, teacher_info, pairs, term.params)
                except ValueError as e:
                    raise ConfigError(f"{term.where} ({term.spec.name}): {e}") from None
                share = term.spec.share_key(term.params)
                if share is not None and share in shared:
                    self._alias[key] = shared[share]
                    continue
                module = term.spec.build_module(student_info, teacher_info, pairs, term.params)
                if module is not None:
                    self.term_modules[key] = module
                    if share is not None:
                        shared[share] = key
        # objective.balance (kdrun/engine/balance.py): None keeps the YAML weights, bit for bit
        self.balancer = None if balance == "fixed" else Balancer(
            balance, {p.index: [t.key for t in p.terms] for p in plans}, balance_alpha)
        # GradNorm's shared parameters (the student's last encoder layer), set by the trainer
        self.balance_params: list[nn.Parameter] | None = None

    # ---- maps
    def _map_for(self, plan: StagePlan, term: Term, key: str) -> MappedPairs:
        kinds = term.spec.map_kinds
        if not kinds:
            return MappedPairs([])
        exclude_last = not getattr(term.params, "match_last", True)
        spec, map_key = self._spec_for(term)
        map_key += "_nolast" if exclude_last else ""
        if map_key not in self.maps:
            s_info, t_info = self._info
            if spec is None:
                lmap = pairs_map(self._fixed_pairs)
            else:
                stage_lr = plan.cfg.get("objective_lr") or plan.cfg.get("lr")
                try:
                    spec.check()
                    lmap = spec.build(s_info["layers"], t_info["layers"], exclude_last=exclude_last,
                                      stage_lr=stage_lr, name=map_key)
                except ValueError as e:
                    raise ConfigError(f"{term.where} ({term.spec.name}): {e}") from None
            self.maps[map_key] = lmap
        lmap = self.maps[map_key]
        if lmap.kind not in kinds:
            ok = [n for n, k in MAPPINGS.items() if k in kinds]
            raise ConfigError(
                f"{term.where} ({term.spec.name}): mapping={lmap.strategy} "
                f"{'combines teacher layers' if lmap.kind != 'pairs' else 'gives one-to-one pairs'}, which "
                f"'{term.spec.name}' does not support; choose mapping= one of {', '.join(ok)}")
        self._term_map[key] = map_key
        return MappedPairs(lmap.pairs, lmap)

    def _spec_for(self, term: Term) -> tuple[MappingSpec | None, str]:
        """The mapping a term uses: the ``mapping`` group, or the term's own choice (``mapping`` /
        ``buckets`` params, e.g. ALP's attention map) while the group is at its default (uniform)."""
        if self.mapping is None:
            return None, "map"
        pinned = getattr(term.params, "mapping", None)
        if pinned is None or self.mapping.name != "uniform" or pinned == "uniform":
            return self.mapping, "map"
        buckets = getattr(term.params, "buckets", None) or self.mapping.buckets
        params = {k: v for k, v in self.mapping.params.items() if k in STRATEGY_PARAMS.get(pinned, set())}
        spec = replace(self.mapping, name=pinned, buckets=buckets, params=params)
        return spec, f"map_{pinned}"

    @property
    def layer_pairs(self) -> list[Any]:
        """The main map's table for results.json: (s, t) pairs, or (s, [bucket]) for combining maps."""
        for lmap in self.maps.values():
            return lmap.describe()
        return [list(p) for p in self._fixed_pairs] if self._fixed_pairs is not None else []

    @staticmethod
    def _module_key(plan: StagePlan, term: Term) -> str:
        return f"stage{plan.index}_{term.key}"

    def _term_module(self, key: str) -> nn.Module | None:
        key = self._alias.get(key, key)
        return self.term_modules[key] if key in self.term_modules else None

    def _stage_maps(self, stage: int) -> dict[str, LayerMap]:
        plan = self.plans[stage]
        keys = [self._term_map.get(self._module_key(plan, t)) for t in plan.terms]
        return {k: self.maps[k] for k in dict.fromkeys(keys) if k is not None}

    def step_dependent(self, stage: int) -> bool:
        """Whether the stage's loss depends on the step number (a ``random`` layer map redraws its
        pairs every step): a compiled step would compile once per draw."""
        return any(lmap.strategy == "random" for lmap in self._stage_maps(stage).values())

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """Trainable parameters of the stage's term modules and layer maps (each once)."""
        plan = self.plans[stage]
        modules = [self._term_module(self._module_key(plan, t)) for t in plan.terms]
        modules += list(self._stage_maps(stage).values())
        params: dict[int, nn.Parameter] = {}
        for m in modules:
            if m is not None:
                params.update({id(p): p for p in m.parameters() if p.requires_grad})
        if self.balancer is not None and self.balancer.balances(stage):
            factors = self.balancer.factors[f"stage{stage}"]
            params[id(factors)] = factors
        return list(params.values())

    def log_values(self, stage: int) -> dict[str, float]:
        """Scalars the stage's learnable modules want logged (e.g. learnable layer-map weights).

        A term module exposes them with a ``log_values() -> dict[str, float]`` method; keys are
        prefixed with the term's key. Layer maps log theirs under their own key (``map/s1/t3``:
        the weight of teacher layer 3 for student layer 1). The trainer logs them with the losses.
        """
        plan = self.plans[stage]
        out: dict[str, float] = {}
        for term in plan.terms:
            module = self._term_module(self._module_key(plan, term))
            if module is not None and hasattr(module, "log_values"):
                out.update({f"{term.key}/{k}": float(v) for k, v in module.log_values().items()})
        for key, lmap in self._stage_maps(stage).items():
            out.update({f"{key}/{k}": v for k, v in lmap.log_values().items()})
        if self.balancer is not None:
            out.update({k: float(v) for k, v in self.balancer.log_values(stage).items()})
        return out

    def forward(
        self, stage: int, student: Features, teacher: Features | None, batch: dict[str, Any], step: int = 0,
        weighted: dict[str, torch.Tensor] | None = None, layer_pairs: list[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns (weighted total, {term key: unweighted value (detached)}).

        ``weighted``, when given, is filled with each term's weighted value still attached to the
        graph (the summands of the total), for per-term gradients (``logger.grad_shares``).
        ``layer_pairs``, when given, replaces the (student, teacher) pairs of every term's one-to-one
        map for this call (a stage strategy's sub-network: e.g. the kept layers of a shallower one, renumbered).
        """
        plan = self.plans[stage]
        total = student.attention_mask.new_zeros((), dtype=torch.float32)
        values: dict[str, torch.Tensor] = {}
        summands: list[torch.Tensor] = []
        for term in plan.terms:
            key = self._module_key(plan, term)
            map_key = self._term_map.get(key)
            lmap = self.maps[map_key] if map_key is not None else None
            pairs = lmap.pairs_at(step) if lmap is not None else []
            ctx = LossContext(
                num_labels=self.num_labels,
                layer_pairs=layer_pairs if layer_pairs is not None and lmap is not None else pairs,
                module=self._term_module(key),
                step=step,
                layer_map=lmap,
            )
            value = term.spec.impl(student, teacher if term.spec.uses_teacher else None, batch, ctx, term.params)
            values[term.key] = value.detach()
            values.update({f"{term.key}/{k}": v.detach() for k, v in ctx.parts.items()})
            summand = term.weight * value.float()
            if weighted is not None:
                weighted[term.key] = summand
            summands.append(summand)
            total = total + summand
        if self.balancer is not None and self.balancer.balances(stage):
            total = self.balancer.combine(stage, summands, self.balance_params)
        return total, values
