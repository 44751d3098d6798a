"""MGSKD's spans (multi-piece words, chunker phrases) located in question + context windows.

Classification inputs get their spans from :meth:`kdrun.strategies.phrases.align.SpanExtractor.spans`, which
assumes each segment's tokens start at the segment's first token (true for truncation at the end).
A QA window holds a slice of its context that may start anywhere, so here each distinct question
and context is analysed once, alone (``SpanExtractor.analyse``: words, chunks, spans in the
segment's own token indices), and a window keeps the spans that lie entirely inside its slice,
shifted to the window's token positions. The slice's first token is found from its character
offset; a slice whose token ids differ from the segment tokenised alone contributes no spans (as
for classification). Phrases cut by a window border are left out, as truncated ones are.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence


def window_spans(extractor: Any, enc: Any, questions: Sequence[str], contexts: Sequence[str]) -> list[list[list[int]]]:
    """Spans ``[[start, end), ...]`` (window token indices) of every window of a batch encoding made
    from ``questions`` and ``contexts`` with ``return_overflowing_tokens`` and offsets."""
    texts = [list(dict.fromkeys(questions)), list(dict.fromkeys(contexts))]
    analysed = [dict(zip(t, extractor.analyse(t))) for t in texts]
    ctx_starts = {c: [a for a, _ in o] for c, o in zip(texts[1], extractor.tokenizer(
        texts[1], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])}
    out: list[list[list[int]]] = []
    for w, ex in enumerate(enc["overflow_to_sample_mapping"]):
        seq_ids, ids, offsets = enc.sequence_ids(w), enc["input_ids"][w], enc["offset_mapping"][w]
        found: set[tuple[int, int]] = set()
        for k, text in enumerate((questions[ex], contexts[ex])):
            pos = [p for p, s in enumerate(seq_ids) if s == k]
            if not pos:
                continue
            first, count = pos[0], len(pos)
            local = analysed[k][text]
            j0 = 0 if k == 0 else bisect.bisect_left(ctx_starts[text], offsets[first][0])
            if ids[first:first + count] != local["input_ids"][j0:j0 + count]:
                continue
            for s, e in local["spans"]:
                if j0 <= s and e <= j0 + count:
                    found.add((first + s - j0, first + e - j0))
        out.append([[s, e] for s, e in sorted(found)])
    return out
