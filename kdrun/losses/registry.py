"""Loss terms declare themselves; objectives find them by the name their YAML uses.

A loss term is a pure function ``fn(student: Features, teacher: Features | None, batch, ctx, p)
-> scalar tensor`` where ``p`` is an instance of the term's parameter dataclass (a subclass of
:class:`Params`). One ``@register_loss`` declaration says everything the rest of kdrun reads:

- ``params``: the dataclass — the single source of the term's parameters, their types, defaults
  and allowed values, validated when an objective is planned (before any data or model loads);
- ``needs`` / ``teacher_needs``: the features record entries it reads (nothing more is computed);
- ``map_kinds``: the layer-map kinds it handles (kdrun.models.mapping; one-to-one pairs by default for
  terms that read layers, none for prediction-layer terms);
- ``module`` (+ ``share``): the trainable module it owns (projections, layer weights), built once
  the model sizes are known; terms of a stage with the same ``share`` key use one module;
- ``check``: checks against the models' sizes (widths, head counts, depths).

Terms are found without editing kdrun: modules listed under the entry-point group
``kdrun.losses`` of any installed package (kdrun's own terms come this way, see pyproject.toml),
and modules named in an objective's ``imports`` key are imported before its terms are looked up.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterable, Mapping, Union

import torch
from torch import nn

from kdrun.errors import UserError
from kdrun.models.features import KNOWN_NEEDS
from kdrun.runtime.plugins import import_entry_point_modules, import_listed_modules

ENTRY_POINT_GROUP = "kdrun.losses"
# Needs that mean a term compares layer representations, so the mapping concerns it.
LAYER_NEEDS = frozenset({"hidden_states", "attentions", "qkv", "attention_scores"})


class ParamError(UserError, ValueError):
    """A loss-term parameter with a wrong type or value; the message names it and what is allowed."""


@dataclass
class LossContext:
    """What a loss term may know besides the two feature records and the batch."""

    num_labels: int
    # (student layer, teacher layer) pairs of the mapping group; hidden-state indices (0 = embeddings).
    layer_pairs: list[tuple[int, int]] = field(default_factory=list)
    # The term's own learnable module (from its ``module`` declaration), if any.
    module: nn.Module | None = None
    step: int = 0
    # The built mapping (kdrun.models.mapping.LayerMap) for terms that combine teacher layers; layer_pairs
    # is its one-to-one view (the current draw for mapping=random).
    layer_map: Any = None
    # Diagnostic parts of the term's value (0-dim tensors, e.g. MGSKD's pair and angle sums), which the
    # objective returns beside the term's value and the trainer logs as ``train/<term>/<part>``. Kept
    # by the step's meters, never by the term: nothing outside the step keeps a tensor of the step.
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def regression(self) -> bool:
        return self.num_labels == 1


# ------------------------------------------------------------------------------------ parameters

def param(default: Any = MISSING, *, choices: Iterable[Any] | None = None,
          check: Callable[[Any], str | None] | None = None, key: str | None = None) -> Any:
    """A field of a :class:`Params` dataclass.

    ``choices``: the allowed values; ``check(value)`` returns what is wrong (or None); ``key``: the
    shipped objectives' ``objective.params`` key that sets it, when it differs from the field's
    name (named in error messages).
    """
    meta = {"choices": tuple(choices) if choices is not None else None, "check": check, "key": key}
    return field(default=default, metadata=meta)


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be > 0"


def positive_int(value: Any) -> str | None:
    return None if value is None or value >= 1 else "must be a positive integer"


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


@dataclass(frozen=True)
class Params:
    """Base of every loss term's parameter dataclass (frozen; subclasses add fields with
    :func:`param`). Construction validates types and values; ``validate`` adds checks across fields.
    ``objective`` names the shipped objective whose ``objective.params`` keys set the fields (for
    messages), when there is one."""

    objective: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            tp = hints.get(f.name, Any)
            if not _type_ok(value, tp):
                self.fail(f.name, f"must be {_type_name(tp)}")
            if tp is float and isinstance(value, int):
                object.__setattr__(self, f.name, float(value))
            choices, check = f.metadata.get("choices"), f.metadata.get("check")
            if choices is not None and value not in choices:
                self.fail(f.name, f"must be one of {', '.join(map(str, choices))}")
            problem = check(value) if check is not None else None
            if problem:
                self.fail(f.name, problem)
        self.validate()

    def validate(self) -> None:
        """Checks that involve several fields (raise with :meth:`fail`)."""

    def fail(self, name: str, what: str) -> typing.NoReturn:
        meta = {f.name: f.metadata for f in fields(self)}.get(name, {})
        hint = ""
        if self.objective:
            hint = f" (with objective={self.objective}, set objective.params.{meta.get('key') or name})"
        raise ParamError(f"params.{name}={getattr(self, name, None)!r} {what}{hint}")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NoParams(Params):
    """A term without parameters."""


# ----------------------------------------------------------------------------------- declarations

def make_params(params: type[Params], owner: str, values: Mapping[str, Any] | None, where: str) -> Params:
    """Typed parameters of the term (or term group) ``owner`` from a YAML mapping; errors name
    ``where`` and the key."""
    values = dict(values or {})
    names = sorted(f.name for f in fields(params))
    unknown = set(values) - set(names)
    if unknown:
        raise KeyError(f"{where}: loss term '{owner}' has no parameter(s) {sorted(unknown)}; "
                       f"it accepts {names or 'none'}")
    missing = [f.name for f in fields(params)
               if f.default is MISSING and f.default_factory is MISSING and f.name not in values]
    if missing:
        raise KeyError(f"{where}: loss term '{owner}' needs parameter(s) {missing}")
    try:
        return params(**values)
    except ParamError as e:
        raise ParamError(f"{where}: {owner}: {e}") from None


@dataclass(frozen=True)
class LossSpec:
    """A registered loss term: its function and everything it declares (see the module doc)."""

    name: str
    impl: Callable[..., torch.Tensor]
    params: type[Params]
    needs: frozenset[str]
    teacher_needs: frozenset[str]
    uses_teacher: bool
    # Whether the term reads the gold labels: a bool, or ``(params, regression) -> bool`` for a term
    # that reads them only with some settings (TinyBERT's prediction loss on a regression task).
    uses_labels: bool | Callable[[Params, bool], bool]
    map_kinds: frozenset[str]
    module: Callable[..., nn.Module | None] | None
    share: Callable[[Params], str | None] | None
    model_check: Callable[..., None] | None
    doc: str
    # Whether the term reads the models' task outputs (it declared ``logits``, the default): a
    # corpus task (general distillation) has none.
    reads_logits: bool = True
    reads_padding: Callable[[Params], bool] | None = None

    @property
    def reads_task_outputs(self) -> bool:
        """Whether the term needs what only a labelled task has: gold labels or the task head's logits."""
        return bool(self.uses_labels) or self.reads_logits

    @property
    def param_names(self) -> frozenset[str]:
        return frozenset(f.name for f in fields(self.params))

    def make_params(self, values: Mapping[str, Any] | None = None, where: str = "params") -> Params:
        """The term's typed parameters from a YAML mapping; errors name ``where`` and the key."""
        return make_params(self.params, self.name, values, where)

    def fn(self, student, teacher, batch, ctx: LossContext, **params) -> torch.Tensor:
        """Call the term with keyword parameters (tests, notebooks); objectives pass typed params."""
        return self.impl(student, teacher, batch, ctx, self.make_params(params))

    def check(self, student_info: dict, teacher_info: dict | None, pairs: Any, **params) -> None:
        """Validate keyword parameters and, when declared, the models' sizes (raises ValueError)."""
        self.check_models(student_info, teacher_info, pairs, self.make_params(params))

    def check_models(self, student_info: dict, teacher_info: dict | None, pairs: Any, p: Params) -> None:
        if self.model_check is not None:
            self.model_check(student_info, teacher_info, pairs, p)

    def build_module(self, student_info: dict, teacher_info: dict | None, pairs: Any,
                     p: Params | None = None, **params) -> nn.Module | None:
        """The term's own trainable module for these model sizes (None when it has none)."""
        if self.module is None:
            return None
        return self.module(student_info, teacher_info, pairs, p if p is not None else self.make_params(params))

    def share_key(self, p: Params) -> str | None:
        return self.share(p) if self.share is not None else None


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    *,
    params: type[Params] = NoParams,
    needs: Iterable[str] = frozenset({"logits"}),
    teacher_needs: Iterable[str] | None = None,
    uses_teacher: bool = True,
    uses_labels: bool | Callable[[Params, bool], bool] = False,
    map_kinds: Iterable[str] | None = None,
    module: Callable[..., nn.Module | None] | None = None,
    share: Callable[[Params], str | None] | None = None,
    check: Callable[..., None] | None = None,
    reads_padding: Callable[[Params], bool] | None = None,
):
    """Declare a loss term (see the module doc).

    ``module(student_info, teacher_info, pairs, p)`` and ``check(student_info, teacher_info, pairs,
    p)`` receive the models' sizes as dicts with ``layers``, ``hidden``, ``heads``, the term's layer
    map (kdrun.models.mapping.MappedPairs) and its typed parameters; ``check`` raises ValueError saying what
    to change. ``reads_padding(p)``: whether, with these parameters, the term reads the teacher's
    outputs at padded positions (the teacher-output store keeps real tokens only, so such a stage
    runs the teacher live). ``uses_labels`` may be ``(p, regression) -> bool`` when the parameters
    and the task decide whether the term reads the gold labels.
    """
    reads_logits = "logits" in frozenset(needs) | frozenset(teacher_needs or ())
    needs = frozenset(needs) | {"logits"}
    t_needs = (frozenset(teacher_needs) | {"logits"}) if teacher_needs is not None else needs
    unknown = (needs | t_needs) - KNOWN_NEEDS
    if unknown:
        raise ValueError(f"loss '{name}': unknown needs {sorted(unknown)}; known: {sorted(KNOWN_NEEDS)}")
    if not (isinstance(params, type) and issubclass(params, Params)):
        raise TypeError(f"loss '{name}': params must be a dataclass derived from kdrun.losses.Params")
    if map_kinds is None:
        map_kinds = {"pairs"} if (needs | t_needs) & LAYER_NEEDS else ()

    def deco(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if name in LOSSES:
            raise ValueError(f"loss term '{name}' registered twice")
        LOSSES[name] = LossSpec(
            name=name, impl=fn, params=params, needs=needs, teacher_needs=t_needs if uses_teacher else frozenset(),
            uses_teacher=uses_teacher, uses_labels=uses_labels, map_kinds=frozenset(map_kinds), module=module,
            share=share, model_check=check, doc=((fn.__doc__ or "").strip().split("\n") or [""])[0],
            reads_logits=reads_logits, reads_padding=reads_padding,
        )
        return fn

    return deco


# -------------------------------------------------------------------------------------- discovery

_discovered = False


def discover_losses() -> None:
    """Import every module registered under the ``kdrun.losses`` entry-point group (once)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import_entry_point_modules(ENTRY_POINT_GROUP, "loss plug-in")


def import_loss_modules(modules: Iterable[str], where: str = "objective.imports") -> None:
    """Import the modules an objective lists (their ``@register_loss`` declarations run)."""
    import_listed_modules(modules, where)


def get_loss(name: str, where: str = "loss") -> LossSpec:
    discover_losses()
    if name not in LOSSES:
        known = sorted([*LOSSES, *(f"{g} (group)" for g in TERM_GROUPS)])
        raise KeyError(f"{where}: unknown loss term '{name}'. Valid loss terms: {', '.join(known)}")
    return LOSSES[name]


# ------------------------------------------------------------------------------------ term groups

@dataclass(frozen=True)
class TermGroup:
    """Several loss terms written as one entry of a stage's ``losses`` (e.g. CKD's four relation
    terms): its typed parameters (defaults in one place) and how it expands, when the stages are
    planned, into the terms it stands for (each then logged, balanced and switched off by weight 0
    as if written out)."""

    name: str
    params: type[Params]
    expand: Callable[[float, Params], list[tuple[str, float, dict[str, Any]]]]


TERM_GROUPS: dict[str, TermGroup] = {}


def register_term_group(name: str, params: type[Params],
                        expand: Callable[[float, Params], list[tuple[str, float, dict[str, Any]]]]) -> TermGroup:
    """Declare the group ``name``: ``expand(weight, typed params)`` returns its terms as
    ``(term name, weight, term params)``."""
    if name in LOSSES or name in TERM_GROUPS:
        raise ValueError(f"loss term or group '{name}' registered twice")
    TERM_GROUPS[name] = TermGroup(name, params, expand)
    return TERM_GROUPS[name]


def expand_terms(losses: list[dict[str, Any]], where_stage: str) -> list[tuple[str, dict[str, Any]]]:
    """A stage's ``losses`` with each group entry replaced by its terms, as (where, term) pairs
    (``where``: the entry's key, ``<stage>.losses[j]``, also for the terms of a group)."""
    discover_losses()
    out = []
    for j, term in enumerate(losses):
        where = f"{where_stage}.losses[{j}]"
        group = TERM_GROUPS.get(term["name"])
        if group is None:
            out.append((where, term))
            continue
        typed = make_params(group.params, group.name, term.get("params"), where)
        out += [(where, {"name": name, "weight": weight, "params": params})
                for name, weight, params in group.expand(float(term["weight"]), typed)]
    return out


def check_params(spec: LossSpec, params: Mapping[str, Any], where: str) -> Params:
    """The term's typed parameters (see :meth:`LossSpec.make_params`)."""
    return spec.make_params(params, where)
