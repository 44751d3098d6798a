"""The settings of a DynaBERT stage (a stage's ``adaptive`` block), as a dataclass Hydra types it with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class AdaptiveConfig:
    """DynaBERT's width- and depth-adaptive training (Hou et al., 2020) for one stage (kdrun/strategies/dynabert).

    ``phase``: null (an ordinary stage), ``width`` (phase 2: each batch trains every width at full
    depth; the teacher is the run's teacher) or ``depth`` (phase 3: every width x depth; the teacher
    is this stage's starting student, run at the same width).
    """

    phase: Optional[str] = None
    widths: List[float] = field(default_factory=lambda: [1.0, 0.75, 0.5, 0.25])
    depths: List[float] = field(default_factory=lambda: [1.0, 0.75, 0.5])
    # Phase 1 at the start of a width phase: reorder heads and FFN neurons by importance.
    rewire: bool = True
    # Where importance is measured: an eval split (task.eval_splits) or ``train``; null = all rows.
    importance_data: str = "validation"
    importance_samples: Optional[int] = None
