"""Layer mappings: which teacher representation each student layer learns from.

Hidden-state indices: 0 is the embedding output, l = 1..L the transformer layers. A mapping turns
(student layers, teacher layers, the ``mapping`` config group) into *rows*: for each matched student
layer, the teacher layers it may draw from (its bucket) and how they are combined:

=============  ===============================================================================
strategy       teacher representation of student layer j
=============  ===============================================================================
``uniform``    CKD's gcd alignment (one teacher layer; some student layers may stay unmatched)
``skip``       teacher layer floor(j * Lt / Ls): PKD-skip / TinyBERT's "k-th layer"
``first``      the first layer of j's bucket (Passban et al.'s PKD: 1, 5, 9 for 12 → 4, last unmatched)
``last``       the last layer of j's bucket (Jassani et al.'s uniform map: 3, 6, 9, 12 for 12 → 4)
``random``     one layer of j's bucket drawn uniformly, redrawn every optimizer step (Jassani et al.)
``mean``       the average of j's bucket (Jassani et al.)
``learnable``  softmax(θ_j) over j's bucket, θ trained with its own lr (Jassani et al.)
``attention``  ALP-KD: per example, softmax_k(h_s^j · h_t^k) over j's bucket (Passban et al. 2021)
``concat``     the concatenation of j's bucket (combinatorial KD; the loss term projects it)
=============  ===============================================================================

Buckets (``mapping.buckets``) split the teacher's layers 1..Lt among the m matched student layers:
``all`` (every bucket holds every layer), ``no`` (non-overlapping: bucket j = layers
floor((j-1) Lt/m)+1 .. floor(j Lt/m)) or ``po`` (partially overlapping: each bucket also takes the
first layer of the next, so buckets share their first layer with the previous one; 12 layers, 3
buckets: 1-5, 5-9, 9-12). With ``include_embeddings`` the student's embeddings (0) learn from the
teacher's (0) as a row of their own, whatever the strategy.

Loss terms see the built :class:`LayerMap` as ``ctx.layer_map`` and ask it for each row's target
(:meth:`LayerMap.target`); terms that only understand one-to-one pairs (``hidden_mse``, CKD) read
``ctx.layer_pairs``, which for ``random`` is the current step's draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from kdrun.config import MappingConfig
from kdrun.runtime.syncs import host_section

# Strategies in the order the docs list them (error messages name them in this order).
MAPPINGS: dict[str, str] = {
    "uniform": "pairs",
    "skip": "pairs",
    "last": "pairs",
    "first": "pairs",
    "random": "pairs",
    "mean": "weights",
    "learnable": "weights",
    "attention": "sample",
    "concat": "concat",
}
# How a strategy combines a bucket: one layer ("pairs"), fixed or learned weights shared by all
# examples ("weights"), weights per example ("sample"), or concatenation ("concat").
KINDS = ("pairs", "weights", "sample", "concat")
BUCKETS = ("all", "no", "po")
INITS = ("uniform", "last")
STRATEGY_PARAMS = {"attention": {"temperature"}}


@dataclass(frozen=True)
class Row:
    """One matched student layer and the teacher layers (its bucket) it learns from."""

    student: int
    teachers: tuple[int, ...]


class MappedPairs(list):
    """A list of (student, teacher) pairs that also carries the :class:`LayerMap` it came from.

    Loss-term ``check`` / ``module_factory`` functions receive this: terms that only need pairs use
    it as a list, terms that combine layers read ``.layer_map``.
    """

    def __init__(self, pairs: Iterable[tuple[int, int]], layer_map: LayerMap | None = None):
        super().__init__(pairs)
        self.layer_map = layer_map


def valid_mappings() -> str:
    return ", ".join(MAPPINGS)


# ------------------------------------------------------------------------------------ tables

def uniform(student_layers: int, teacher_layers: int, include_embeddings: bool = True) -> list[tuple[int, int]]:
    """The gcd alignment of CKD: g = gcd(Lt, Ls); pairs (Ls/g * t, Lt/g * t) for t = 0..g.

    12→4: (0,0) (1,3) (2,6) (3,9) (4,12); 12→8: (0,0) (2,3) (4,6) (6,9) (8,12).
    """
    if student_layers < 1 or teacher_layers < 1:
        raise ValueError(f"uniform mapping needs ≥1 layer, got student {student_layers}, teacher {teacher_layers}")
    g = math.gcd(teacher_layers, student_layers)
    step_s, step_t = student_layers // g, teacher_layers // g
    pairs = [(step_s * t, step_t * t) for t in range(g + 1)]
    return pairs if include_embeddings else pairs[1:]


def make_buckets(num_buckets: int, teacher_layers: int, kind: str, strategy: str = "") -> list[tuple[int, ...]]:
    """Teacher layers (1..Lt) of each of ``num_buckets`` buckets; see the module docstring."""
    if kind not in BUCKETS:
        raise ValueError(f"mapping.buckets='{kind}' must be one of {', '.join(BUCKETS)}")
    if kind == "all":
        return [tuple(range(1, teacher_layers + 1))] * num_buckets
    if num_buckets > teacher_layers:
        raise ValueError(
            f"mapping={strategy} buckets={kind} gives each of the {num_buckets} matched student layers its own "
            f"teacher layers, but the teacher has only {teacher_layers}; use mapping.buckets=all, a "
            "teacher with more layers or a student with fewer")
    ends = [j * teacher_layers // num_buckets for j in range(num_buckets + 1)]
    out = [tuple(range(ends[j] + 1, ends[j + 1] + 1)) for j in range(num_buckets)]
    if kind == "po":
        out = [b + (ends[j + 1] + 1,) if j + 1 < num_buckets else b for j, b in enumerate(out)]
    return out


def build_rows(strategy: str, student_layers: int, teacher_layers: int, *, include_embeddings: bool = True,
               buckets: str = "all", exclude_last: bool = False) -> list[Row]:
    """Rows of a mapping (no parameters): the table the tests compare with the papers."""
    if strategy not in MAPPINGS:
        raise KeyError(f"mapping.name: unknown mapping '{strategy}'. Valid mappings: {valid_mappings()}")
    if student_layers < 1 or teacher_layers < 1:
        raise ValueError(f"mapping={strategy} needs ≥1 layer, got student {student_layers}, "
                         f"teacher {teacher_layers}")
    students = list(range(1, student_layers + 1))
    if exclude_last:
        students = students[:-1]
        if not students:
            raise ValueError(
                f"the loss term leaves the student's last layer unmatched (match_last=false) and the student "
                f"has {student_layers} layer: nothing is left to match; set the term's match_last=true "
                "or use a deeper student")
    if strategy == "uniform":
        pairs = uniform(student_layers, teacher_layers, include_embeddings)
        return [Row(s, (t,)) for s, t in pairs if s in students or s == 0]
    rows = [Row(0, (0,))] if include_embeddings else []
    if strategy == "skip":
        if teacher_layers < student_layers:
            raise ValueError(
                f"mapping=skip maps student layer j to teacher layer j*Lt/Ls, which needs at least as many teacher "
                f"layers as student layers: the student has {student_layers}, the teacher {teacher_layers}; use "
                "mapping=uniform or a deeper teacher")
        return rows + [Row(j, (j * teacher_layers // student_layers,)) for j in students]
    bks = make_buckets(len(students), teacher_layers, buckets, strategy)
    if strategy == "first":
        return rows + [Row(j, (b[0],)) for j, b in zip(students, bks)]
    if strategy == "last":
        return rows + [Row(j, (b[-1],)) for j, b in zip(students, bks)]
    return rows + [Row(j, b) for j, b in zip(students, bks)]


def build_layer_pairs(name: str, student_layers: int, teacher_layers: int, include_embeddings: bool = True,
                      **kwargs) -> list[tuple[int, int]]:
    """(student, teacher) pairs of a one-to-one mapping (``random``: its buckets' last layers are not
    pairs; use :class:`LayerMap`)."""
    if name not in MAPPINGS:
        raise KeyError(f"mapping.name: unknown mapping '{name}'. Valid mappings: {valid_mappings()}")
    if MAPPINGS[name] != "pairs" or name == "random":
        raise ValueError(f"mapping '{name}' combines or draws teacher layers; build a LayerMap instead")
    rows = build_rows(name, student_layers, teacher_layers, include_embeddings=include_embeddings, **kwargs)
    return [(r.student, r.teachers[0]) for r in rows]


# ------------------------------------------------------------------------------------ the module

class LayerMap(nn.Module):
    """The built mapping: rows, and what combining them needs (θ of ``learnable``).

    ``learnable``: θ_j initialised to 0 (``init=uniform``: equal weights) or to (-1, …, -1, 1)
    (``init=last``: softmax ≈ (0.11, 0.11, 0.78) for 3 layers); weights = softmax(θ_j) over the bucket.
    θ is stored as φ = θ / lr_scale and used as θ = lr_scale * φ with the gradient of θ passed to φ
    unchanged: under Adam(W), whose steps do not depend on the gradient's scale, φ then moves
    lr_g per step and θ exactly ``lr_scale * lr_g`` — θ's own learning rate — while gradient
    clipping sees θ's true gradient.
    """

    def __init__(self, strategy: str, rows: Sequence[Row], *, init: str = "uniform", lr_scale: float = 1.0,
                 seed: int = 0, temperature: float | str = 1.0, name: str = "map"):
        super().__init__()
        if strategy not in MAPPINGS and strategy != "pairs":
            raise KeyError(f"mapping.name: unknown mapping '{strategy}'. Valid mappings: {valid_mappings()}")
        self.strategy = strategy
        self.kind = MAPPINGS.get(strategy, "pairs")
        self.rows = list(rows)
        self.name = name
        self.seed = int(seed)
        self.temperature = temperature if temperature == "sqrt_d" else float(temperature)
        self.lr_scale = float(lr_scale)
        self._draw: tuple[int, list[tuple[int, int]]] | None = None
        self.last_sample_weights: list[torch.Tensor | None] = [None] * len(self.rows)
        self.last_sample_entropy: list[torch.Tensor | None] = [None] * len(self.rows)
        if strategy == "learnable":
            if init not in INITS:
                raise ValueError(f"mapping.init='{init}' must be one of {', '.join(INITS)}")
            kmax = max(len(r.teachers) for r in self.rows)
            mask = torch.zeros(len(self.rows), kmax, dtype=torch.bool)
            theta = torch.zeros(len(self.rows), kmax)
            for i, r in enumerate(self.rows):
                mask[i, : len(r.teachers)] = True
                if init == "last" and len(r.teachers) > 1:
                    theta[i, : len(r.teachers)] = -1.0
                    theta[i, len(r.teachers) - 1] = 1.0
            self.register_buffer("mask", mask, persistent=False)
            self.phi = nn.Parameter(theta / self.lr_scale)
        if strategy == "mean":
            # 1/k per bucket as a buffer, so the weights move with the objective to the device once
            # instead of being copied from host memory every step (a blocking copy on CUDA);
            # float64 so that 1/k is exact enough for float64 representations
            kmax = max(len(r.teachers) for r in self.rows)
            mean = torch.zeros(len(self.rows), kmax, dtype=torch.float64)
            for i, r in enumerate(self.rows):
                mean[i, : len(r.teachers)] = 1.0 / len(r.teachers)
            self.register_buffer("mean_weights", mean, persistent=False)

    # ---- what the rows look like
    @property
    def pairs(self) -> list[tuple[int, int]]:
        """One-to-one pairs (the current draw for ``random``); every row's last layer otherwise."""
        if self.strategy == "random":
            return self.pairs_at(0)
        return [(r.student, r.teachers[-1]) for r in self.rows]

    def describe(self) -> list[Any]:
        """JSON-able table: (s, t) pairs for one-to-one maps, (s, [bucket]) otherwise."""
        if self.kind == "pairs" and self.strategy != "random":
            return [[r.student, r.teachers[0]] for r in self.rows]
        return [[r.student, list(r.teachers)] for r in self.rows]

    def pairs_at(self, step: int) -> list[tuple[int, int]]:
        """``random``: one teacher layer per row, drawn from a generator seeded by (seed, step), so a
        step's draw is the same for every loss term and after a resume."""
        if self.strategy != "random":
            return self.pairs
        if self._draw is None or self._draw[0] != step:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(step))
            with host_section():  # CPU generator and CPU tensors: no device involved
                draw = [(r.student, r.teachers[int(torch.randint(len(r.teachers), (1,), generator=g))])
                        for r in self.rows]
            self._draw = (step, draw)
        return list(self._draw[1])

    # ---- weights
    def theta(self) -> torch.Tensor:
        return self.phi + (self.lr_scale - 1.0) * self.phi.detach()

    def row_weights(self, step: int = 0) -> list[torch.Tensor | None]:
        """(k,) weights over each row's bucket for ``pairs``/``weights`` kinds; None otherwise."""
        if self.kind == "pairs":
            chosen = dict(self.pairs_at(step))
            return [torch.tensor([float(t == chosen[r.student]) for t in r.teachers], dtype=torch.float64)
                    for r in self.rows]
        if self.strategy == "mean":  # on the objective's device already (a buffer)
            return [self.mean_weights[i, : len(r.teachers)] for i, r in enumerate(self.rows)]
        if self.strategy == "learnable":
            w = self.theta().masked_fill(~self.mask, float("-inf")).softmax(-1)
            return [w[i, : len(r.teachers)] for i, r in enumerate(self.rows)]
        return [None] * len(self.rows)

    # ---- targets
    def target(self, index: int, teacher_rep: Callable[[int], torch.Tensor], student_rep: torch.Tensor | None = None,
               step: int = 0, weights: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """The teacher representation row ``index``'s student layer learns from.

        ``teacher_rep(layer)`` returns the teacher's representation of a layer (hidden states
        (B, n, d), [CLS] vectors (B, d), attention scores (B, h, n, n), …), computed only for the
        layers needed. ``student_rep`` (same shape as one teacher rep) is needed by ``attention``.
        ``weights`` (from :meth:`row_weights`) avoids recomputing them for every row.
        """
        row = self.rows[index]
        if len(row.teachers) == 1:
            return teacher_rep(row.teachers[0])
        if self.kind == "pairs":
            return teacher_rep(dict(self.pairs_at(step))[row.student])
        reps = [teacher_rep(t) for t in row.teachers]
        if self.kind == "concat":
            return torch.cat(reps, dim=-1)
        stacked = torch.stack(reps, dim=-2)  # (..., k, d)
        if self.kind == "weights":
            w = (weights or self.row_weights(step))[index].to(stacked.device, stacked.dtype)
            return (stacked * w.view(*([1] * (stacked.dim() - 2)), -1, 1)).sum(-2)
        if student_rep is None:
            raise ValueError("mapping=attention needs the student's representation to weight the teacher layers")
        alpha = self.attention_weights(student_rep, stacked)
        # kept on the device: read on the host by log_values, at log steps only
        flat = alpha.detach().reshape(-1, alpha.shape[-1]).float()
        self.last_sample_weights[index] = flat.mean(0)
        # the mean per-example entropy of α in nats: 0 one-hot, log(k) uniform over the k teacher layers
        self.last_sample_entropy[index] = -(flat * flat.clamp_min(1e-30).log()).sum(-1).mean()
        return (stacked * alpha.unsqueeze(-1).to(stacked.dtype)).sum(-2)

    def attention_weights(self, student_rep: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
        """ALP-KD's α: softmax over the bucket of dot products h_s · h_t^k (per example / token),
        divided by ``mapping.params.temperature``: 1 = the paper's plain dot product, ``sqrt_d`` =
        sqrt(d) as in scaled dot-product attention (with real BERT [CLS] vectors the plain dot products
        differ by tens, so the paper's weights are one-hot). ``stacked``: (..., k, d)."""
        if student_rep.shape[-1] != stacked.shape[-1]:
            raise ValueError(
                f"mapping=attention compares student and teacher vectors by dot product, but their widths are "
                f"{student_rep.shape[-1]} and {stacked.shape[-1]}; use a student of the teacher's width")
        dtype = torch.promote_types(torch.promote_types(student_rep.dtype, stacked.dtype), torch.float32)
        temperature = stacked.shape[-1] ** 0.5 if self.temperature == "sqrt_d" else self.temperature
        with torch.autocast(device_type=stacked.device.type, enabled=False):  # fp32 dot products
            logits = torch.einsum("...d,...kd->...k", student_rep.to(dtype), stacked.to(dtype)) / temperature
        return logits.softmax(-1)

    # ---- logging
    def log_values(self) -> dict[str, float]:
        """Per (student, teacher) weight: ``learnable``: softmax(θ); ``attention``: the last batch's mean α
        and ``s<j>/entropy``, its mean per-example entropy in nats (0: one-hot; log k: uniform)."""
        out: dict[str, float] = {}
        if self.strategy == "learnable":
            with torch.no_grad():
                for r, w in zip(self.rows, self.row_weights()):
                    if len(r.teachers) > 1:
                        out.update({f"s{r.student}/t{t}": x for t, x in zip(r.teachers, w.tolist())})
        elif self.strategy == "attention":
            for r, w, h in zip(self.rows, self.last_sample_weights, self.last_sample_entropy):
                if w is not None:  # one host read per student layer: the weights and the entropy together
                    *vals, ent = torch.cat([w.reshape(-1), h.reshape(1).to(w.dtype)]).tolist()
                    out.update({f"s{r.student}/t{t}": x for t, x in zip(r.teachers, vals)})
                    out[f"s{r.student}/entropy"] = ent
        return out


def pairs_map(pairs: Iterable[tuple[int, int]]) -> LayerMap:
    """A fixed one-to-one map from explicit pairs (tests, teacher fine-tuning with no mapping)."""
    return LayerMap("pairs", [Row(int(s), (int(t),)) for s, t in pairs])


# ------------------------------------------------------------------------------------ the spec

@dataclass
class MappingSpec(MappingConfig):
    """The ``mapping`` config group (kdrun.config.MappingConfig), ready to build maps for given
    model depths; ``seed`` seeds the random map's draws (train.seed)."""

    seed: int = 0

    @classmethod
    def from_config(cls, cfg: Any, seed: int = 0) -> MappingSpec:
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
        spec = cls(**{**values, "params": dict(values.get("params") or {})}, seed=int(seed))
        spec.check()
        return spec

    def check(self) -> None:
        """Validate the config keys alone (no model needed)."""
        if self.name not in MAPPINGS:
            raise ValueError(f"mapping.name='{self.name}' is unknown; valid: {valid_mappings()}")
        if self.buckets not in BUCKETS:
            raise ValueError(f"mapping.buckets='{self.buckets}' must be one of {', '.join(BUCKETS)}")
        if self.init not in INITS:
            raise ValueError(f"mapping.init='{self.init}' must be one of {', '.join(INITS)}")
        if self.lr is not None and not float(self.lr) > 0:
            raise ValueError(f"mapping.lr={self.lr} must be a positive learning rate (or null = the stage's)")
        # uniform, the group's default, also carries the parameters of the maps terms choose themselves
        # (objective=alp's attention map reads mapping.params.temperature)
        known = STRATEGY_PARAMS.get(self.name, set())
        if self.name == "uniform":
            known = set().union(*STRATEGY_PARAMS.values())
        unknown = set(self.params) - known
        if unknown:
            allowed = sorted(known) or "none"
            raise ValueError(f"mapping.params: mapping '{self.name}' has no parameter(s) {sorted(unknown)}; "
                             f"it accepts {allowed}")
        t = self.params.get("temperature", 1.0)
        if t != "sqrt_d" and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"mapping.params.temperature={t!r} must be a number > 0 or sqrt_d")

    def build(self, student_layers: int, teacher_layers: int, *, exclude_last: bool = False,
              stage_lr: float | None = None, name: str = "map") -> LayerMap:
        """The map for these depths. ``stage_lr``: the optimizer lr of the objective's parameters in
        the stage that trains θ (so that θ moves at ``mapping.lr``)."""
        rows = build_rows(self.name, student_layers, teacher_layers, include_embeddings=self.include_embeddings,
                          buckets=self.buckets, exclude_last=exclude_last)
        scale = float(self.lr) / float(stage_lr) if self.lr is not None and stage_lr else 1.0
        return LayerMap(self.name, rows, init=self.init, lr_scale=scale, seed=self.seed,
                        temperature=self.params.get("temperature", 1.0), name=name)
