"""A small synthetic, learnable sentence-classification task generated from code.

Every sentence is a sequence of plain lowercase English words: neutral fillers with a few
evaluative words mixed in. Each evaluative word has a polarity (+1 or -1); a negator ("not",
"never") immediately before an evaluative word flips its polarity. The label is 1 when the sum of
polarities is positive and 0 otherwise; sentences whose sum is 0 are never generated, so the rule
is unambiguous. Output depends only on the :class:`~kdrun.config.ToyConfig` values.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

from kdrun.errors import ConfigError

# Word lists written for kdrun; common words from BERT's uncased vocabulary.
POSITIVE_WORDS: tuple[str, ...] = (
    "good", "great", "excellent", "wonderful", "nice", "happy", "lovely", "perfect", "brilliant",
    "pleasant", "beautiful", "amazing", "fantastic", "fun", "best", "fine", "superb", "charming",
)
NEGATIVE_WORDS: tuple[str, ...] = (
    "bad", "terrible", "awful", "horrible", "poor", "sad", "boring", "ugly", "worst", "dull",
    "weak", "nasty", "annoying", "painful", "stupid", "dreadful", "miserable", "disappointing",
)
NEGATORS: tuple[str, ...] = ("not", "never")
FILLER_WORDS: tuple[str, ...] = (
    "the", "a", "this", "that", "movie", "film", "story", "food", "room", "day", "it", "was", "is",
    "and", "with", "very", "really", "quite", "people", "music", "plot", "actors", "service",
    "place", "book", "game", "city", "weather", "team", "show", "felt", "seemed", "looked", "we",
    "they", "i", "some", "of", "in", "on", "at", "our", "trip", "evening", "song", "house", "car",
    "dinner", "friends", "ending", "year", "night", "hotel", "staff", "also", "so", "still",
)

_POLARITY: dict[str, int] = {**{w: 1 for w in POSITIVE_WORDS}, **{w: -1 for w in NEGATIVE_WORDS}}
_NEGATORS = frozenset(NEGATORS)
# Probability that an evaluative word is preceded by a negator.
_NEGATION_PROB = 0.3


def toy_score(words: Sequence[str]) -> int:
    """Sum of polarities of the evaluative words; a negator right before one flips it."""
    total = 0
    prev = ""
    for w in words:
        pol = _POLARITY.get(w)
        if pol is not None:
            total += -pol if prev in _NEGATORS else pol
        prev = w
    return total


def toy_label(words: Sequence[str] | str) -> int:
    """The toy task's label: 1 if :func:`toy_score` is positive, else 0 (a string is split on spaces)."""
    if isinstance(words, str):
        words = words.split()
    return 1 if toy_score(words) > 0 else 0


def _cfg(toy_cfg: Any, name: str, default: Any) -> Any:
    if isinstance(toy_cfg, dict):
        return toy_cfg.get(name, default)
    value = getattr(toy_cfg, name, default)
    return default if value is None else value


def _sentence(rng: random.Random, min_words: int, max_words: int) -> list[str]:
    """One random sentence (may have a zero score; the caller resamples those)."""
    length = rng.randint(min_words, max_words)
    n_eval = rng.randint(1, max(1, min(4, length // 3)))
    units: list[list[str]] = []
    budget = length
    for _ in range(n_eval):
        if budget <= 0:
            break
        word = rng.choice(POSITIVE_WORDS if rng.random() < 0.5 else NEGATIVE_WORDS)
        if budget >= 2 and rng.random() < _NEGATION_PROB:
            units.append([rng.choice(NEGATORS), word])
        else:
            units.append([word])
        budget -= len(units[-1])
    units.extend([rng.choice(FILLER_WORDS)] for _ in range(budget))
    rng.shuffle(units)
    return [w for unit in units for w in unit]


def _stream(seed_key: str, n: int, min_words: int, max_words: int) -> dict[str, list[Any]]:
    rng = random.Random(seed_key)
    # Exactly balanced targets in a random order; sentences are drawn until one matches.
    targets = [i % 2 for i in range(n)]
    rng.shuffle(targets)
    texts: list[str] = []
    labels: list[int] = []
    for target in targets:
        while True:
            words = _sentence(rng, min_words, max_words)
            score = toy_score(words)
            if score != 0 and int(score > 0) == target:
                break
        texts.append(" ".join(words))
        labels.append(target)
    return {"text_a": texts, "label": labels}


def make_toy_splits(
    toy_cfg: Any, train_split: str = "train", eval_splits: Iterable[str] = ("validation",)
) -> dict[str, dict[str, list[Any]]]:
    """Generate the toy task: ``{split: {"text_a": [...], "label": [...]}}``.

    The train split has ``num_train`` rows and every eval split ``num_validation`` rows; each split
    uses its own random stream derived from ``toy_cfg.seed`` and the split name, so the same config
    always gives identical output.
    """
    min_words = int(_cfg(toy_cfg, "min_words", 4))
    max_words = int(_cfg(toy_cfg, "max_words", 24))
    seed = int(_cfg(toy_cfg, "seed", 1234))
    num_train = int(_cfg(toy_cfg, "num_train", 2000))
    num_validation = int(_cfg(toy_cfg, "num_validation", 500))
    if min_words < 1 or max_words < min_words:
        raise ConfigError(
            f"toy task: need 1 <= task.toy.min_words <= task.toy.max_words, got min_words={min_words}, "
            f"max_words={max_words}"
        )
    if num_train < 0 or num_validation < 0:
        raise ConfigError("toy task: task.toy.num_train and task.toy.num_validation must be >= 0")
    out: dict[str, dict[str, list[Any]]] = {}
    out[train_split] = _stream(f"kdrun-toy:{seed}:train", num_train, min_words, max_words)
    for split in eval_splits:
        if split in out:
            continue
        out[split] = _stream(f"kdrun-toy:{seed}:eval:{split}", num_validation, min_words, max_words)
    return out
