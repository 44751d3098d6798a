"""DynaBERT's phases 2 and 3 as stages of kdrun's trainer (Algorithm 1 of Park, Kim & Yang 2021, EMNLP,
appendix D; Hou et al., 2020).

A stage whose ``adaptive.phase`` is set trains one network at several sizes. For each batch:

- ``width`` (phase 2): the teacher's features once (the run's teacher, i.e. the fine-tuned model);
  then for every width m_w the student's sub-network at (m_w, depth 1), its loss, ``backward``.
- ``depth`` (phase 3): for every width m_w the teacher's features at width m_w (the teacher is a
  frozen copy of the student as this stage starts, i.e. the width-adaptive phase-2 model, run at the
  same width, full depth), then for every depth m_d the student's (m_w, m_d) sub-network, its loss,
  ``backward``.

Gradients of all sub-networks accumulate, then one clipped optimizer step (one scheduler step).
Under DDP every pass but the last runs inside the wrapper's ``no_sync``: the gradients of all
sub-networks are all-reduced once per step, with the last pass's backward, not once per pass.
The loss of each sub-network is the stage's objective, so any label-free kdrun objective can be
used; in phase 3 the hidden state after each kept layer is matched with the teacher's after the
same layer (:func:`kdrun.strategies.dynabert.subnet.subnet_pairs`; the embeddings with the embeddings when the
mapping includes them), whatever the student's depth. At the start of a width phase (not
when resuming inside it) the student is rewired (phase 1, :mod:`kdrun.strategies.dynabert.rewire`) unless
``adaptive.rewire=false``. Phase 3's teacher is written to ``checkpoints/`` when the stage starts so
a resumed run distils from the same model.
"""

from __future__ import annotations

import copy
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kdrun.errors import ConfigError
from kdrun.models.features import Features, extract_features
from kdrun.strategies.dynabert.plan import adaptive_of
from kdrun.strategies.dynabert.subnet import check_model, kept_count, shape_of, subnet_pairs, subnetwork


@dataclass
class AdaptiveStage:
    """One adaptive stage's sizes and teacher (None: the run's teacher)."""

    phase: str
    widths: list[float]
    depths: list[float]
    teacher: nn.Module | None = None
    rewiring: dict[str, Any] | None = field(default=None)
    # Phase 3: the full-depth (student, teacher) pairs, each layer with itself (the teacher is the
    # student's own copy); None: the stage's layer map as built (phase 2 runs at full depth).
    pairs: list[tuple[int, int]] | None = None

    # ------------------------------------------------------------------------------------ the step
    def passes(self, parts, loop, batch: dict[str, Any], state):
        """Algorithm 1's inner loops for one batch, as a strategy of kdrun's training step: yield
        each sub-network's (loss, values); the engine runs its backward, and one optimizer step
        follows the last one."""
        from torch.nn.parallel import DistributedDataParallel

        from kdrun.engine.step import objective_loss, teacher_features

        acc, plan = parts.accelerator, loop.plan
        student = acc.unwrap_model(parts.student)
        ddp = parts.student if isinstance(parts.student, DistributedDataParallel) else None
        remaining = len(self.widths) * len(self.depths)
        shared = teacher_features(parts, loop, batch) if self.teacher is None else None
        for width in self.widths:
            t_feats: Features | None = shared
            if self.teacher is not None and plan.uses_teacher:
                with torch.no_grad(), acc.autocast(), subnetwork(self.teacher, width, 1.0):
                    t_feats = extract_features(self.teacher, batch, plan.teacher_needs)
            for depth in self.depths:
                remaining -= 1
                # forward and backward (run by the engine while this generator waits at the yield)
                # of every pass but the last accumulate locally; the last one all-reduces them all
                with ddp.no_sync() if ddp is not None and remaining else nullcontext():
                    with acc.autocast(), subnetwork(student, width, depth) as sub:
                        s_feats = extract_features(parts.student, batch, plan.student_needs)
                        pairs = subnet_pairs(self.pairs, sub["layers"]) if self.pairs is not None else None
                    loss, values = objective_loss(parts, loop, batch, state, s_feats, t_feats, layer_pairs=pairs)
                    yield loss, {**values, f"subnet/w{width:g}_d{depth:g}": loss.detach()}

    def combine(self, results: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
        """(sum of the sub-networks' losses, each term's mean over sub-networks and each
        sub-network's loss)."""
        total = torch.stack([loss for loss, _ in results]).sum()
        logged: dict[str, torch.Tensor] = {}
        for _, values in results:
            for k, v in values.items():
                logged[k] = logged[k] + v if k in logged else v
        n = len(results)
        return total, {k: (v / n if not k.startswith("subnet/") else v) for k, v in logged.items()}


# ----------------------------------------------------------------------------------------- setup

def _importance_batches(parts, a: dict[str, Any]):
    from kdrun.tasks.data.batches import make_loader

    split = a["importance_data"]
    if split == "train":
        data = parts.train_data
    elif split in parts.eval_data:
        data = parts.eval_data[split]
    else:
        raise ConfigError(f"adaptive.importance_data='{split}' is neither 'train' nor one of task.eval_splits "
                          f"{list(parts.eval_data)}")
    if a.get("importance_samples"):
        data = data.select(range(min(int(a["importance_samples"]), len(data))))
    loader, _ = make_loader(data, parts.train_cfg.eval_batch_size, parts.collator, seed=0, train=False)
    return loader, split, len(data)


def _rewire(parts, student: nn.Module, a: dict[str, Any]) -> dict[str, Any]:
    from kdrun.strategies.dynabert.rewire import importance, rewire

    t0 = time.perf_counter()
    loader, split, rows = _importance_batches(parts, a)
    regression = parts.objective.num_labels == 1
    head_imp, ffn_imp = importance(student, loader, regression=regression, device=parts.accelerator.device)
    orders = rewire(student, head_imp, ffn_imp)
    info = {"importance_data": split, "rows": rows, "seconds": round(time.perf_counter() - t0, 2),
            "head_importance": [[round(float(x), 6) for x in r] for r in head_imp], "head_order": orders["heads"]}
    print(f"[kdrun] DynaBERT phase 1: rewired heads and FFN neurons by importance on {rows} {split} rows "
          f"({info['seconds']:.1f}s)")
    return info


def _phase3_teacher(parts, plan, student: nn.Module, fresh: bool) -> nn.Module:
    """A frozen copy of the student as the stage starts; saved so that a resumed stage reloads it."""
    from safetensors.torch import load_model, save_model

    path = parts.run_dir / "checkpoints" / f"adaptive_teacher_stage{plan.index}.safetensors"
    teacher = copy.deepcopy(student)
    if fresh or not path.exists():
        if parts.accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_model(teacher, str(tmp))
            tmp.replace(path)
        parts.accelerator.wait_for_everyone()
    else:
        load_model(teacher, str(path), device=str(parts.accelerator.device))
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


def start_adaptive(parts, plan, state) -> AdaptiveStage | None:
    """The stage's adaptive setup (None for an ordinary stage): phase 1 at a fresh width phase, phase
    3's teacher at a depth phase."""
    a = adaptive_of(plan.cfg)
    if a is None:
        return None
    student = parts.accelerator.unwrap_model(parts.student)
    check_model(student)
    shape = shape_of(student)
    stage = AdaptiveStage(a["phase"], [float(w) for w in a["widths"]],
                          [float(d) for d in a["depths"]] if a["phase"] == "depth" else [1.0])
    fresh = state.stage_step == 0 and state.batch_in_epoch == 0
    if a["phase"] == "depth":
        maps = list(parts.objective._stage_maps(plan.index).values())
        if len(maps) > 1 or any(m.kind != "pairs" for m in maps):
            raise ConfigError(f"objective.stages[{plan.index}].adaptive.phase=depth pairs every kept layer with the "
                              "same layer of its full-depth teacher, which needs one one-to-one map for all its terms "
                              "(mapping=uniform, skip, first or last; no term with match_last=false)")
        if maps:  # the teacher is the student's own copy: each layer with itself (embeddings as mapped)
            first = 0 if any(si == 0 for si, _ in maps[0].pairs) else 1
            stage.pairs = [(i, i) for i in range(first, shape.layers + 1)]
        stage.teacher = _phase3_teacher(parts, plan, student, fresh)
    elif a["rewire"] and fresh:
        stage.rewiring = _rewire(parts, student, a)
        if parts.accelerator.is_main_process:
            (parts.run_dir / "rewiring.json").write_text(json.dumps(stage.rewiring))
    sizes = ", ".join(f"{w:g}: {kept_count(shape.heads, w)} heads / {kept_count(shape.ffn, w)} neurons"
                      for w in stage.widths)
    print(f"[kdrun] DynaBERT {a['phase']} phase '{plan.name}': widths ({sizes}), depths {stage.depths}")
    return stage
