"""Reversible word splitting and the rules for which words may be replaced."""

from __future__ import annotations

import re

from kdrun.strategies.augment.stopwords import STOP_WORDS

# Runs of whitespace, runs of word characters, or one other character: every character of a text
# falls in exactly one piece, so "".join(split_pieces(t)) == t and untouched words, punctuation and
# spacing survive augmentation byte for byte.
_PIECE = re.compile(r"\s+|\w+|[^\w\s]")


def split_pieces(text: str) -> list[str]:
    """Split ``text`` into pieces (words, single punctuation characters, whitespace runs)."""
    return _PIECE.findall(text)


def is_space(piece: str) -> bool:
    return piece[:1].isspace()


def is_replaceable(piece: str) -> bool:
    """Alphabetic and not a stop word (numbers, punctuation, ``abc123``, ``foo_bar`` are kept)."""
    return piece.isalpha() and piece.lower() not in STOP_WORDS


def match_case(candidate: str, original: str) -> str:
    """Give ``candidate`` the capitalisation pattern of ``original`` (uncased models predict lower case)."""
    if len(original) > 1 and original.isupper():
        return candidate.upper()
    if original[:1].isupper():
        return candidate[:1].upper() + candidate[1:]
    return candidate
