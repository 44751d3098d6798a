"""The CoNLL-2000 chunking corpus: where it comes from and how it is read.

Source, in this order: ``spans.corpus_dir`` (a directory holding the CoNLL-2000 ``train.txt`` and
``test.txt``) when set, else NLTK's ``conll2000`` corpus when its data are installed
(``python -m nltk.downloader conll2000``). Neither → :class:`CorpusError` saying both ways.

File format: one token per line, ``word POS chunk-tag`` separated by single spaces, chunk tags in
IOB form (``B-NP``, ``I-NP``, ``O``), a blank line between sentences.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kdrun.errors import UserError

FILES = ("train.txt", "test.txt")

# (word, POS tag, IOB chunk tag)
Token = tuple[str, str, str]
Sentence = list[Token]


class CorpusError(UserError, ValueError):
    """No usable CoNLL-2000 corpus, or a malformed file; the message says where and what to do."""


@dataclass(frozen=True)
class Corpus:
    """The text of the corpus files and where they came from."""

    where: str
    texts: dict[str, str]  # file name -> content

    def sentences(self, name: str) -> list[Sentence]:
        if name not in self.texts:
            raise CorpusError(f"{self.where}: no '{name}' in this corpus (it has {sorted(self.texts)})")
        return parse_conll(self.texts[name], f"{self.where}/{name}")

    def content_hash(self, name: str) -> str:
        return hashlib.sha256(self.texts[name].encode()).hexdigest()[:16]


def parse_conll(text: str, where: str = "<text>") -> list[Sentence]:
    """Sentences of a CoNLL-2000 file; a malformed line raises CorpusError naming file and line."""
    sents: list[Sentence] = []
    cur: Sentence = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            if cur:
                sents.append(cur)
                cur = []
            continue
        parts = line.split(" ")
        if len(parts) != 3 or not all(parts):
            raise CorpusError(
                f"{where}, line {lineno}: expected 'word POS chunk-tag' separated by single spaces, got {line!r}")
        word, pos, chunk = parts
        if chunk != "O" and not (chunk[:2] in ("B-", "I-") and len(chunk) > 2):
            raise CorpusError(f"{where}, line {lineno}: chunk tag {chunk!r} is not IOB (B-X, I-X or O)")
        cur.append((word, pos, chunk))
    if cur:
        sents.append(cur)
    return sents


def _nltk_corpus() -> Corpus | None:
    try:
        import nltk

        nltk.data.find("corpora/conll2000")
    except (ImportError, LookupError):
        return None
    from nltk.corpus import conll2000

    return Corpus(where="nltk:conll2000", texts={f: conll2000.raw(f) for f in FILES})


def nltk_corpus_available() -> bool:
    try:
        import nltk

        nltk.data.find("corpora/conll2000")
        return True
    except (ImportError, LookupError):
        return False


def check_corpus_dir(corpus_dir: str | Path, key: str = "spans.corpus_dir",
                     need: tuple[str, ...] = ("train.txt",)) -> Path:
    """The directory, or CorpusError naming the missing path."""
    d = Path(corpus_dir).expanduser()
    if not d.is_dir():
        raise CorpusError(f"{key}={corpus_dir}: no such directory; point it at a directory with the CoNLL-2000 "
                          f"files {', '.join(FILES)}")
    missing = [f for f in need if not (d / f).is_file()]
    if missing:
        raise CorpusError(f"{key}={corpus_dir}: missing {', '.join(str(d / f) for f in missing)} (the CoNLL-2000 "
                          "chunking files, 'word POS chunk-tag' per line)")
    return d


def load_corpus(corpus_dir: str | Path | None, key: str = "spans.corpus_dir",
                need: tuple[str, ...] = ("train.txt",)) -> Corpus:
    """The corpus from ``corpus_dir`` when given, else NLTK's; CorpusError when there is neither."""
    if corpus_dir:
        d = check_corpus_dir(corpus_dir, key, need)
        texts = {f: (d / f).read_text(encoding="utf-8") for f in FILES if (d / f).is_file()}
        return Corpus(where=str(d.resolve()), texts=texts)
    corpus = _nltk_corpus()
    if corpus is None:
        raise CorpusError(
            f"no CoNLL-2000 corpus: {key} is not set and NLTK's conll2000 data are not installed. Either set "
            f"{key}=<directory with train.txt and test.txt> or install NLTK's copy "
            "(python -m nltk.downloader conll2000)")
    return corpus
