"""Word and phrase spans for MGSKD: a CoNLL-2000-trained NLTK chunker aligned to WordPieces.

- :mod:`kdrun.strategies.phrases.corpus`: the CoNLL-2000 corpus (``spans.corpus_dir`` or NLTK's copy);
- :mod:`kdrun.strategies.phrases.tagger`: classifier-based greedy taggers (NLTK book, chapter 7);
- :mod:`kdrun.strategies.phrases.chunker`: POS tagger + chunker, cached; CoNLL evaluation;
- :mod:`kdrun.strategies.phrases.align`: spans of an example in token indices;
- :mod:`kdrun.strategies.phrases.cli`: ``kdrun-spans eval`` / ``kdrun-spans show``.
"""

from __future__ import annotations

from typing import Any

from kdrun.config import SpansConfig, typed


def check_spans_config(spans_cfg: Any) -> None:
    """Cheap checks of the ``spans`` group (no training): raises ValueError naming the key."""
    from kdrun.strategies.phrases.chunker import check_chunk_types, check_settings
    from kdrun.strategies.phrases.corpus import check_corpus_dir, nltk_corpus_available

    spans_cfg = typed(spans_cfg, SpansConfig)
    check_chunk_types(list(spans_cfg.chunk_types))
    mwp = spans_cfg.min_word_pieces
    if isinstance(mwp, bool) or not isinstance(mwp, int) or mwp < 1:
        raise ValueError(f"spans.min_word_pieces={mwp!r} must be an integer >= 1 (the paper's setting is 2)")
    check_settings(dict(spans_cfg.params or {}))
    corpus_dir = spans_cfg.corpus_dir
    if corpus_dir:
        check_corpus_dir(corpus_dir)
    elif not nltk_corpus_available():
        raise ValueError(
            "this objective needs spans, which come from a chunker trained on CoNLL-2000, but spans.corpus_dir "
            "is not set and NLTK's conll2000 data are not installed: set spans.corpus_dir=<directory with the "
            "CoNLL-2000 train.txt/test.txt> or run `python -m nltk.downloader conll2000`")


def span_extractor_for(spans_cfg: Any, tokenizer: Any, cache_dir: str | None):
    """The :class:`~kdrun.strategies.phrases.align.SpanExtractor` of a ``spans`` config (trains the chunker once)."""
    from kdrun.strategies.phrases.align import SpanExtractor
    from kdrun.strategies.phrases.chunker import get_chunker

    spans_cfg = typed(spans_cfg, SpansConfig)
    chunker = get_chunker(spans_cfg.corpus_dir, list(spans_cfg.chunk_types), cache_dir, dict(spans_cfg.params or {}))
    return SpanExtractor(tokenizer, chunker, int(spans_cfg.min_word_pieces))
