"""RunParts: the trainer's view of a run — models, objective, data, metrics, settings, tracker.

A stage's strategy (its own step loop) comes from the stage's config through the registry of stage
strategies (kdrun/engine/strategies.py), not from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch import nn

from kdrun.engine.objective import Objective
from kdrun.runtime.preemption import PreemptionGuard


@dataclass
class RunParts:
    accelerator: Any
    student: nn.Module
    teacher: nn.Module | None
    objective: Objective
    train_data: Any
    eval_data: dict[str, Any]
    collator: Any
    # (logits, labels) -> metrics, or a dict of them per eval split (QA: each split's windows)
    metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]] | dict[str, Callable]
    main_metric: str
    train_cfg: Any
    tracker: Any
    run_dir: Path
    config_hash: str
    log_every: int = 10
    # Data parallelism: this process's rank and the number of processes (1 = not distributed).
    # Every process sees its slice of each global batch; evaluation is gathered on all of them.
    rank: int = 0
    world_size: int = 1
    guard: PreemptionGuard | None = None
    # The tokenised augmented training set, for stages with ``data: augmented``.
    augmented_data: Any = None
    # Replaces prediction + metric_fn: (parts, model, stage index or None) -> {split: metrics}
    # (corpus tasks: the held-out distillation loss, kdrun/strategies/general/evaluate.py).
    evaluator: Callable[..., dict[str, dict[str, float]]] | None = None
    # Model selection (task.selection_splits, task.selection_threshold; see main_score, evaluate_stage).
    selection_splits: Any = None
    selection_threshold: float | None = None
    # The teacher-output store's settings (kdrun/engine/teacher_store.py); None: the teacher runs live.
    store: Any = None
    # The task kind (kdrun.tasks.kinds.TaskKind): the shape of its logits (join_logits, batch_logits);
    # None: one row of logits per example.
    kind: Any = None
    # What the progress bars name: the student's stages are "stage <i>:<name>"; the teacher's
    # fine-tuning is "teacher: finetune".
    role: str = "student"
