"""Nearest-neighbour candidates for multi-piece words: a GloVe-format file or the MLM's embeddings.

Both sources become a :class:`NeighbourIndex`: a unit-normalised matrix of candidate word vectors
on the device, searched for many query words at once by one matrix product (cosine similarity)
and a top-k on the device.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kdrun.strategies.augment.errors import AugmentationError
from kdrun.strategies.augment.words import is_replaceable

log = logging.getLogger(__name__)

MLM_EMBEDDINGS = "mlm_embeddings"
_QUERY_CHUNK = 1024  # query rows per matrix product (bounds the score matrix to 1024 x vocabulary)


class NeighbourIndex:
    """Candidate words and their unit-normalised vectors (``(V, d)`` float32 on ``device``)."""

    def __init__(self, words: Sequence[str], vectors: torch.Tensor | np.ndarray, device: torch.device | str = "cpu"):
        self.words = list(words)
        mat = torch.as_tensor(vectors, dtype=torch.float32)
        self.matrix = F.normalize(mat, dim=1).to(device)
        self.device = self.matrix.device
        self.lookup: dict[str, int] = {}
        for i, w in enumerate(self.words):  # first occurrence wins (GloVe files are frequency-ordered)
            self.lookup.setdefault(w, i)
        for i, w in enumerate(self.words):
            self.lookup.setdefault(w.lower(), i)

    def __len__(self) -> int:
        return len(self.words)

    def find(self, word: str) -> int | None:
        """Row of ``word`` (exact, else lower-cased), or None."""
        hit = self.lookup.get(word)
        return self.lookup.get(word.lower()) if hit is None else hit

    def search(self, queries: torch.Tensor, exclude: Sequence[str], m: int) -> list[list[str]]:
        """The ``m`` most cosine-similar words for each query vector (``(u, d)``), best first.

        Words equal to ``exclude[i]`` (ignoring case) and case variants of earlier results are skipped.
        """
        if len(queries) == 0 or len(self.words) == 0:
            return [[] for _ in range(len(queries))]
        k = min(len(self.words), 2 * m + 2)  # room for the skipped ones
        q = F.normalize(queries.to(self.device, torch.float32), dim=1)
        tops = []
        for start in range(0, len(q), _QUERY_CHUNK):
            scores = q[start:start + _QUERY_CHUNK] @ self.matrix.T
            tops.append(torch.topk(scores, k, dim=1).indices.cpu())
        top = torch.cat(tops).numpy()
        out = []
        for row, word in zip(top, exclude):
            seen = {word.lower()}
            found: list[str] = []
            for i in row:
                cand = self.words[i]
                if cand.lower() not in seen:
                    seen.add(cand.lower())
                    found.append(cand)
                    if len(found) == m:
                        break
            out.append(found)
        return out

    def neighbours_of_words(self, words: Sequence[str], m: int) -> list[list[str]]:
        """Neighbours of words looked up in the index itself (GloVe); unknown words get none."""
        rows = [self.find(w) for w in words]
        known = [i for i, r in enumerate(rows) if r is not None]
        found = self.search(self.matrix[[rows[i] for i in known]], [words[i] for i in known], m)
        out: list[list[str]] = [[] for _ in words]
        for i, f in zip(known, found):
            out[i] = f
        return out


def _glove_lines(path: Path, max_vectors: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of the first ``max_vectors`` vectors; a word2vec ``count dim`` header is skipped."""
    with open(path, "rb") as f:
        taken = 0
        for lineno, line in enumerate(f, start=1):
            if taken >= max_vectors:
                return
            if lineno == 1 and len(line.split()) == 2 and all(t.isdigit() for t in line.split()):
                yield lineno, line  # header: part of the content identity, not a vector
                continue
            taken += 1
            yield lineno, line


def check_vectors_file(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise AugmentationError(
            f"augmentation.word_vectors={str(path)!r}: no such file. Give a GloVe-format text file (one "
            f"'word v1 .. vd' per line, e.g. glove.840B.300d.txt), {MLM_EMBEDDINGS} (neighbours in the "
            "MLM's own embeddings) or null (multi-piece words keep no candidates).")
    return p


def vectors_identity(path: str | Path, max_vectors: int) -> str:
    """Content hash of exactly the lines that are read (the first ``max_vectors`` vectors)."""
    h = hashlib.sha256()
    for _, line in _glove_lines(check_vectors_file(path), max_vectors):
        h.update(line)
    return h.hexdigest()[:16]


def load_glove(path: str | Path, max_vectors: int, device: torch.device | str = "cpu") -> NeighbourIndex:
    """The alphabetic non-stop-words among the first ``max_vectors`` vectors of a GloVe/word2vec text file."""
    p = check_vectors_file(path)
    words: list[str] = []
    rows: list[np.ndarray] = []
    dim = None
    for lineno, raw in _glove_lines(p, max_vectors):
        parts = raw.decode("utf-8", errors="replace").rstrip("\r\n").rstrip(" ").split(" ")
        if lineno == 1 and len(parts) == 2 and all(t.isdigit() for t in parts):
            continue
        if dim is None:
            dim = len(parts) - 1
            if dim < 1:
                raise AugmentationError(f"{p}:{lineno}: expected 'word v1 .. vd' (augmentation.word_vectors)")
        if len(parts) < dim + 1:
            raise AugmentationError(
                f"{p}:{lineno}: expected a word and {dim} numbers, found {len(parts)} fields "
                "(augmentation.word_vectors must be a GloVe-format text file)")
        word = " ".join(parts[: len(parts) - dim])  # a few GloVe tokens contain spaces
        if not is_replaceable(word):
            continue  # punctuation, numbers and stop words are never candidates, nor queried
        try:
            rows.append(np.asarray(parts[len(parts) - dim:], dtype=np.float32))
        except ValueError:
            raise AugmentationError(f"{p}:{lineno}: non-numeric vector entry (augmentation.word_vectors)") from None
        words.append(word)
    if not words:
        raise AugmentationError(f"{p}: no alphabetic non-stop-words among its first {max_vectors} vectors "
                                "(augmentation.word_vectors / augmentation.max_vectors)")
    return NeighbourIndex(words, np.stack(rows), device)


_DEVIATION_LOGGED = False


def mlm_embedding_index(model, vocab: Sequence[str], allowed: np.ndarray) -> tuple[NeighbourIndex, torch.Tensor]:
    """(index over the MLM's alphabetic non-stop-word tokens, input-embedding matrix) for ``mlm_embeddings``.

    A multi-piece word's query vector is the mean of its WordPieces' input embeddings — a deviation
    from the paper (which uses GloVe), logged once per process.
    """
    global _DEVIATION_LOGGED
    if not _DEVIATION_LOGGED:
        log.warning(
            "augmentation.word_vectors=mlm_embeddings: multi-piece words get the neighbours of their mean "
            "WordPiece embedding in the MLM's input embeddings, not GloVe neighbours as in the paper "
            "(a deviation; give a GloVe file for the paper's setting)")
        _DEVIATION_LOGGED = True
    emb = model.get_input_embeddings().weight.detach().float()
    ids = [i for i, tok in enumerate(vocab) if allowed[i] and is_replaceable(tok)]
    index = NeighbourIndex([vocab[i] for i in ids], emb[ids], emb.device)
    return index, emb
