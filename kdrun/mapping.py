"""Layer mappings: which teacher representation each student layer learns from.

A mapping returns (student, teacher) index pairs over hidden states, where index 0 is the embedding
output and l = 1..L the transformer layers. Registered by name like loss terms.
"""

from __future__ import annotations

import math
from typing import Callable

MAPPINGS: dict[str, Callable[..., list[tuple[int, int]]]] = {}


def register_mapping(name: str):
    def deco(fn):
        if name in MAPPINGS:
            raise ValueError(f"mapping '{name}' registered twice")
        MAPPINGS[name] = fn
        return fn

    return deco


@register_mapping("uniform")
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


def build_layer_pairs(name: str, student_layers: int, teacher_layers: int, **kwargs) -> list[tuple[int, int]]:
    if name not in MAPPINGS:
        raise KeyError(f"mapping.name: unknown mapping '{name}'. Valid mappings: {', '.join(sorted(MAPPINGS))}")
    pairs = MAPPINGS[name](student_layers, teacher_layers, **kwargs)
    for s, t in pairs:
        if s > student_layers or t > teacher_layers:
            raise ValueError(
                f"mapping '{name}' asks for student layer {s} / teacher layer {t}, but the student has "
                f"{student_layers} and the teacher {teacher_layers} layers"
            )
    return pairs
