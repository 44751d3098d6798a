"""POS tagger + IOB chunker trained on CoNLL-2000, cached, and evaluated the CoNLL way.

``get_chunker(corpus_dir, chunk_types, cache_dir)`` returns a :class:`Chunker`, training it on the
corpus's ``train.txt`` the first time and loading it from ``<cache_dir>/chunkers/<key>`` after
(key = content hash of ``train.txt`` + chunk types + training settings + feature version). The
entry is written to a temporary directory under a file lock and renamed into place, and holds
JSON (labels, feature names, settings) and safetensors (weights): no pickle.

The chunker reads POS tags predicted by the project's own tagger (at training time the gold tags,
as the NLTK book does); ``evaluate`` reports POS accuracy and chunk precision / recall / F1 per
type and overall (a chunk counts when its type and both boundaries match), with predicted tags.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kdrun.strategies.phrases.corpus import Corpus, Sentence, load_corpus
from kdrun.strategies.phrases.tagger import DEFAULT_SETTINGS, FORMAT_VERSION, LinearTagger, train_tagger

# All CoNLL-2000 chunk types; MGSKD uses NP, VP and PP.
CHUNK_TYPES = ("NP", "VP", "PP", "ADJP", "ADVP", "SBAR", "PRT", "CONJP", "INTJ", "LST", "UCP")
# Bumped when features or training change, so old cache entries are not reused.
FEATURE_VERSION = f"{FORMAT_VERSION}.1"
SETTING_KEYS = frozenset(DEFAULT_SETTINGS)


def check_chunk_types(chunk_types: Sequence[str], key: str = "spans.chunk_types") -> list[str]:
    types = [str(t) for t in chunk_types]
    bad = [t for t in types if t not in CHUNK_TYPES]
    if bad or not types:
        raise ValueError(f"{key}={types}: {'unknown type(s) ' + str(bad) if bad else 'empty'}; choose among "
                         f"the CoNLL-2000 chunk types {', '.join(CHUNK_TYPES)}")
    return types


def check_settings(settings: dict[str, Any] | None, key: str = "spans.params") -> dict[str, Any]:
    settings = dict(settings or {})
    unknown = set(settings) - SETTING_KEYS
    if unknown:
        raise ValueError(f"{key}: unknown chunker setting(s) {sorted(unknown)}; known: {sorted(SETTING_KEYS)} "
                         f"(defaults {DEFAULT_SETTINGS})")
    return {**DEFAULT_SETTINGS, **settings}


def restrict_iob(tags: Sequence[str], chunk_types: Sequence[str]) -> list[str]:
    """IOB tags with chunks of other types turned into O."""
    keep = set(chunk_types)
    return [t if t != "O" and t[2:] in keep else "O" for t in tags]


def iob_chunks(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, start, end) word ranges (end exclusive) of IOB tags, the conlleval way: a chunk starts
    at B-X, or at I-X after O or after a chunk of another type."""
    out: list[tuple[str, int, int]] = []
    cur: list[Any] | None = None
    for i, t in enumerate(tags):
        kind = t[2:] if t != "O" else None
        if kind is not None and cur is not None and t[:2] == "I-" and cur[0] == kind:
            cur[2] = i + 1
            continue
        if cur is not None:
            out.append(tuple(cur))
            cur = None
        if kind is not None:
            cur = [kind, i, i + 1]
    if cur is not None:
        out.append(tuple(cur))
    return out


@dataclass
class Chunker:
    """A POS tagger and a chunk tagger; ``key`` identifies the cached entry they came from."""

    pos: LinearTagger
    chunk: LinearTagger
    chunk_types: list[str]
    key: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def tag(self, sentences: Sequence[Sequence[str]]) -> list[list[str]]:
        """POS tags of tokenised sentences."""
        return self.pos.tag_many([(list(s),) for s in sentences])

    def chunk_tags(self, sentences: Sequence[Sequence[str]], tags: Sequence[Sequence[str]] | None = None
                   ) -> list[list[str]]:
        """IOB chunk tags (with the tagger's POS tags unless ``tags`` are given)."""
        if tags is None:
            tags = self.tag(sentences)
        return self.chunk.tag_many([(list(s), list(t)) for s, t in zip(sentences, tags)])

    def chunks(self, sentences: Sequence[Sequence[str]]) -> list[list[tuple[str, int, int]]]:
        """(type, start word, end word exclusive) of each sentence's chunks."""
        return [iob_chunks(t) for t in self.chunk_tags(sentences)]

    def save(self, directory: Path) -> None:
        self.pos.save(directory, "pos")
        self.chunk.save(directory, "chunk")

    @classmethod
    def load(cls, directory: Path, key: str = "") -> Chunker:
        import json

        pos, chunk = LinearTagger.load(directory, "pos"), LinearTagger.load(directory, "chunk")
        info = json.loads((directory / "info.json").read_text()) if (directory / "info.json").exists() else {}
        types = sorted({c[2:] for c in chunk.classes if c != "O"})
        return cls(pos, chunk, info.get("chunk_types", types), key=key, info=info)


def train_chunker(train: list[Sentence], chunk_types: Sequence[str], settings: dict[str, Any] | None = None
                  ) -> Chunker:
    """Train the POS tagger and the chunker (on gold POS tags) from CoNLL sentences."""
    settings = check_settings(settings)
    t0 = time.perf_counter()
    pos, _ = train_tagger("pos", [(([w for w, _, _ in s],), [p for _, p, _ in s]) for s in train], settings)
    t1 = time.perf_counter()
    chunk, _ = train_tagger(
        "chunk",
        [(([w for w, _, _ in s], [p for _, p, _ in s]), restrict_iob([c for _, _, c in s], chunk_types))
         for s in train],
        settings,
    )
    t2 = time.perf_counter()
    info = {"chunk_types": list(chunk_types), "settings": settings, "train_sentences": len(train),
            "train_tokens": sum(len(s) for s in train), "pos_train_s": round(t1 - t0, 2),
            "chunk_train_s": round(t2 - t1, 2), "pos_features": len(pos.features),
            "chunk_features": len(chunk.features)}
    return Chunker(pos, chunk, list(chunk_types), info=info)


def chunker_key(corpus: Corpus, chunk_types: Sequence[str], settings: dict[str, Any]) -> str:
    from kdrun.runtime.cache import content_hash

    return content_hash({"train": corpus.content_hash("train.txt"), "types": list(chunk_types),
                         "settings": settings, "version": FEATURE_VERSION})


def default_cache_dir() -> str:
    import os

    return os.environ.get("KDRUN_CACHE_DIR") or str(Path(os.environ.get("HOME", ".")) / ".cache" / "kdrun")


def get_chunker(corpus_dir: str | Path | None, chunk_types: Sequence[str] = ("NP", "VP", "PP"),
                cache_dir: str | Path | None = None, settings: dict[str, Any] | None = None,
                verbose: bool = True) -> Chunker:
    """The chunker for this corpus and settings: from the cache, or trained and cached."""
    from kdrun.runtime.cache import load_or_build, write_json_atomic

    chunk_types = check_chunk_types(chunk_types)
    settings = check_settings(settings)
    corpus = load_corpus(corpus_dir)
    key = chunker_key(corpus, chunk_types, settings)
    root = Path(cache_dir or default_cache_dir()).expanduser()

    def build(tmp: Path) -> None:
        if verbose:
            print(f"[kdrun] training the POS tagger and chunker on {corpus.where}/train.txt "
                  f"({', '.join(chunk_types)})", flush=True)
        ch = train_chunker(corpus.sentences("train.txt"), chunk_types, settings)
        ch.save(tmp)
        write_json_atomic(tmp / "info.json", {**ch.info, "corpus": corpus.where, "key": key,
                                              "version": FEATURE_VERSION})
        if verbose:
            print(f"[kdrun] trained in {ch.info['pos_train_s'] + ch.info['chunk_train_s']:.1f}s", flush=True)

    chunker, _entry, _cached = load_or_build(root, "chunkers", key, build, lambda e: Chunker.load(e, key=key))
    return chunker


def find_cached_chunker(chunk_types: Sequence[str] = ("NP", "VP", "PP"), cache_dir: str | Path | None = None,
                        settings: dict[str, Any] | None = None) -> Chunker | None:
    """The most recently trained cached chunker with these types and settings (any corpus), or None.

    For ``kdrun-spans show`` without a corpus at hand: a chunker trained earlier is used as is.
    """
    import json

    from kdrun.runtime.cache import is_complete

    chunk_types, settings = check_chunk_types(chunk_types), check_settings(settings)
    root = Path(cache_dir or default_cache_dir()).expanduser() / "chunkers"
    found = []
    for entry in root.glob("*/") if root.is_dir() else []:
        info_path = entry / "info.json"
        if not is_complete(entry) or not info_path.exists():
            continue
        info = json.loads(info_path.read_text())
        if (info.get("version") == FEATURE_VERSION and info.get("chunk_types") == chunk_types
                and info.get("settings") == settings):
            found.append((info_path.stat().st_mtime, entry, info.get("key", entry.name)))
    if not found:
        return None
    _, entry, key = max(found)
    return Chunker.load(entry, key=key)


# ---------------------------------------------------------------------------------------- evaluation

def _prf(correct: int, guessed: int, gold: int) -> dict[str, float]:
    p = correct / guessed if guessed else 0.0
    r = correct / gold if gold else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": p, "recall": r, "f1": f, "gold": gold, "predicted": guessed}


def evaluate(chunker: Chunker, test: list[Sentence]) -> dict[str, Any]:
    """POS accuracy and chunk P/R/F1 per type and overall, chunking with predicted POS tags."""
    words = [[w for w, _, _ in s] for s in test]
    gold_pos = [[p for _, p, _ in s] for s in test]
    pred_pos = chunker.tag(words)
    n = sum(len(s) for s in gold_pos)
    pos_acc = sum(a == b for g, q in zip(gold_pos, pred_pos) for a, b in zip(g, q)) / max(n, 1)
    pred_iob = chunker.chunk_tags(words, pred_pos)
    types = chunker.chunk_types
    counts = {t: [0, 0, 0] for t in types}  # correct, predicted, gold
    for s, pred in zip(test, pred_iob):
        gold_c = set(iob_chunks(restrict_iob([c for _, _, c in s], types)))
        pred_c = set(iob_chunks(pred))
        for t in types:
            g = {c for c in gold_c if c[0] == t}
            q = {c for c in pred_c if c[0] == t}
            counts[t][0] += len(g & q)
            counts[t][1] += len(q)
            counts[t][2] += len(g)
    per_type = {t: _prf(c[0], c[1], c[2]) for t, c in counts.items()}
    tot = [sum(c[i] for c in counts.values()) for i in range(3)]
    return {"pos_accuracy": pos_acc, "tokens": n, "sentences": len(test), "chunks": per_type,
            "overall": _prf(*tot)}
