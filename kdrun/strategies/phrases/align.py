"""Spans of an example in token indices: multi-piece words and chunker phrases (MGSKD, Liu et al. 2022).

For each text segment (pair tasks: each side on its own):

1. words for the chunker: NLTK's Treebank tokenizer with character offsets (the CoNLL-2000
   tokenisation), falling back to ``\\w+|[^\\w\\s]`` when its offsets cannot be aligned;
2. phrases: the chunker's chunks of the configured types (NP / VP / PP), as character ranges;
3. WordPieces: the fast tokenizer on the segment alone (no special tokens), with offsets and
   word ids. A *whole word* is a run of tokens with one word id (the tokenizer's own
   pre-tokenisation); it is a span when it has at least ``min_word_pieces`` pieces. A phrase
   covers every token whose characters overlap its character range;
4. the segment's tokens are located in the model input (``sequence_ids`` of the truncated pair
   encoding): a span is kept only when all its tokens survived truncation.

Spans are ``[start, end)`` token indices into ``input_ids`` (special tokens counted), sorted and
without duplicates (a one-word phrase made of a multi-piece word appears once).
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Sequence

from kdrun.errors import ConfigError
from kdrun.strategies.phrases.chunker import Chunker

ALIGN_VERSION = "1"
_FALLBACK = re.compile(r"\w+|[^\w\s]")
_treebank = None


def word_char_spans(text: str) -> list[tuple[int, int]]:
    """Character ranges of the Treebank words of ``text`` (CoNLL-2000 tokenisation)."""
    global _treebank
    if _treebank is None:
        from nltk.tokenize import TreebankWordTokenizer

        _treebank = TreebankWordTokenizer()
    try:
        return [(int(a), int(b)) for a, b in _treebank.span_tokenize(text)]
    except (ValueError, LookupError):  # offsets that cannot be aligned (rare quote patterns)
        return [m.span() for m in _FALLBACK.finditer(text)]


def _token_range(starts: list[int], ends: list[int], cs: int, ce: int) -> tuple[int, int] | None:
    """Tokens whose characters overlap [cs, ce): (first, last + 1), or None."""
    i = bisect.bisect_right(ends, cs)
    j = bisect.bisect_left(starts, ce) - 1
    return (i, j + 1) if i <= j else None


class SpanExtractor:
    """Computes spans for batches of examples; ``key`` identifies its output for caches."""

    def __init__(self, tokenizer: Any, chunker: Chunker, min_word_pieces: int = 2):
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("spans need a fast tokenizer (character offsets); choose a model that has one")
        if min_word_pieces < 1:
            raise ValueError(f"spans.min_word_pieces={min_word_pieces} must be >= 1 (the paper's setting is 2)")
        self.tokenizer = tokenizer
        self.chunker = chunker
        self.min_word_pieces = int(min_word_pieces)

    @property
    def key(self) -> dict[str, Any]:
        return {"chunker": self.chunker.key, "min_word_pieces": self.min_word_pieces, "align": ALIGN_VERSION}

    # ------------------------------------------------------------------------------ one segment

    def analyse(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        """Per text: words, chunks (type, word range, token range), token pieces and local spans."""
        words = [word_char_spans(t) for t in texts]
        chunks = self.chunker.chunks([[t[a:b] for a, b in ws] for t, ws in zip(texts, words)])
        enc = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for i, text in enumerate(texts):
            offsets = enc["offset_mapping"][i]
            starts = [a for a, _ in offsets]
            ends = [b for _, b in offsets]
            word_spans = []
            wids = enc.word_ids(i)
            run_start = 0
            for k in range(1, len(wids) + 1):
                if k == len(wids) or wids[k] != wids[run_start] or wids[k] is None:
                    if wids[run_start] is not None and k - run_start >= self.min_word_pieces:
                        word_spans.append((run_start, k))
                    run_start = k
            spans = set(word_spans)
            phrase_tokens = []
            for typ, w0, w1 in chunks[i]:
                rng = _token_range(starts, ends, words[i][w0][0], words[i][w1 - 1][1])
                phrase_tokens.append((typ, w0, w1, rng))
                if rng is not None:
                    spans.add(rng)
            out.append({"text": text, "words": [text[a:b] for a, b in words[i]], "chunks": phrase_tokens,
                        "input_ids": enc["input_ids"][i], "word_spans": word_spans, "spans": sorted(spans)})
        return out

    # ----------------------------------------------------------------------------- model inputs

    def spans(self, enc: Any, texts_a: Sequence[str], texts_b: Sequence[str] | None = None
              ) -> tuple[list[list[list[int]]], int]:
        """Spans of each example of a batch encoding ``enc`` (from the same tokenizer, on these texts).

        Returns (spans per example as [[start, end], ...], number of segments whose tokens did not
        match the segment tokenised alone; those contribute no spans).
        """
        segs = [self.analyse(texts_a)]
        if texts_b is not None:
            segs.append(self.analyse(texts_b))
        out: list[list[list[int]]] = []
        mismatched = 0
        for i in range(len(texts_a)):
            seq_ids = enc.sequence_ids(i)
            ids = enc["input_ids"][i]
            found: set[tuple[int, int]] = set()
            for k, seg in enumerate(segs):
                pos = [p for p, s in enumerate(seq_ids) if s == k]
                if not pos:
                    continue
                first, count = pos[0], len(pos)
                local = seg[i]
                if ids[first:first + count] != local["input_ids"][:count]:
                    mismatched += 1
                    continue
                for s, e in local["spans"]:
                    if e <= count:
                        found.add((first + s, first + e))
            out.append([[s, e] for s, e in sorted(found)])
        return out, mismatched
