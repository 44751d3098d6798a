"""Sampling augmented sentences from per-word candidate lists (Algorithm 1 in appendix B of CKD's
ICLR-submission version, Park et al. 2021)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from kdrun.strategies.augment.words import match_case


def make_variants(
    pieces: Sequence[str],
    candidates: Mapping[int, Sequence[str]],
    n: int,
    p_t: float,
    rng: np.random.Generator,
) -> list[str]:
    """The original sentence followed by up to ``n`` distinct augmented ones.

    ``pieces`` are the sentence's pieces (:func:`kdrun.strategies.augment.words.split_pieces`);
    ``candidates`` maps a piece index to its replacement words. Each of ``n`` rounds replaces every
    word that has candidates, independently with probability ``p_t``, by a uniformly drawn
    candidate (capitalised like the word it replaces). Rounds that reproduce the original or an
    earlier sentence are dropped, so the result has between 1 and ``n + 1`` entries, original first.
    """
    original = "".join(pieces)
    out = [original]
    slots = [i for i in sorted(candidates) if len(candidates[i]) > 0]
    if not slots or n <= 0:
        return out
    seen = {original}
    sizes = np.array([len(candidates[i]) for i in slots])
    replace = rng.random((n, len(slots))) < p_t
    picks = rng.integers(0, sizes, size=(n, len(slots)))
    for r in range(n):
        new = list(pieces)
        for j in np.flatnonzero(replace[r]):
            i = slots[j]
            new[i] = match_case(candidates[i][picks[r, j]], pieces[i])
        text = "".join(new)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
