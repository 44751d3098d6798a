"""Classifier-based sequence taggers (the NLTK book, chapter 7): a POS tagger and an IOB chunk tagger.

Each token is labelled by a linear classifier over features of the token, its neighbours and the
labels already assigned to the two tokens before it (greedy, left to right), as in the book's
``ConsecutiveNPChunkTagger``. Training goes through NLTK's ``SklearnClassifier`` wrapper
(feature dicts → scikit-learn's ``SGDClassifier`` with the hinge loss, a linear SVM), with the
gold previous labels as history.

Only the learnt linear model is kept: the feature names, the class labels and the weight matrix.
That makes the saved form safe (JSON + safetensors, no pickle) and lets decoding run batched:
the static features of every token of many sentences are scored with one sparse product, then a
loop over positions adds the history features' weights for all sentences at once.

Feature templates (``name=value`` strings, as NLTK's wrapper names one-hot features):

- POS tagger: the lowercased word, its 1–3 letter suffixes and first letter, a compressed shape
  (``Xx``, ``d.d``), whether it is capitalised / has a digit or hyphen, the words at ±1 and ±2,
  the 3-letter suffixes at ±1; history: previous tag, previous two tags, previous tag + word.
- Chunker: the lowercased word, its POS tag, the tags at ±1 and ±2, tag bigrams and the trigram
  around it, the words at ±1, the set of tags since the last determiner (the book's
  ``tags-since-dt``); history: previous chunk tag, previous two, previous chunk tag + POS tag.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kdrun.strategies.phrases.corpus import CorpusError

START = "<s>"
KINDS = ("pos", "chunk")
FORMAT_VERSION = 1
# History templates: p1 = previous label, p2p1 = previous two, p1k = previous label + the token's key
# (the lowercased word for the POS tagger, the POS tag for the chunker).
HISTORY = ("p1", "p2p1", "p1k")

_SHAPE_MAP = str.maketrans(
    {**{c: "X" for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}, **{c: "x" for c in "abcdefghijklmnopqrstuvwxyz"},
     **{c: "d" for c in "0123456789"}})
_RUNS = re.compile(r"(.)\1+")


def word_shape(word: str) -> str:
    """``Confidence`` -> ``Xx``, ``5.50`` -> ``d.d``, ``e-mail`` -> ``x-x`` (runs compressed)."""
    return _RUNS.sub(r"\1", word.translate(_SHAPE_MAP))[:6]


# ----------------------------------------------------------------------------------------- features

def pos_static_features(words: Sequence[str]) -> tuple[list[dict[str, str]], list[str]]:
    """Per-token static features of the POS tagger and each token's history key (lowercased word)."""
    low = [w.lower() for w in words]
    n = len(words)
    pad = ["<s2>", "<s1>", *low, "</s1>", "</s2>"]
    out = []
    for i, w in enumerate(words):
        lw = low[i]
        f = {
            "w": lw, "s1": lw[-1:], "s2": lw[-2:], "s3": lw[-3:], "f1": lw[:1], "shape": word_shape(w),
            "w-1": pad[i + 1], "w+1": pad[i + 3], "w-2": pad[i], "w+2": pad[i + 4],
            "s3-1": pad[i + 1][-3:], "s3+1": pad[i + 3][-3:],
        }
        if w[:1].isupper():
            f["cap"] = "first" if i == 0 else "mid"
        if any(c.isdigit() for c in w):
            f["digit"] = "y"
        if "-" in w and len(w) > 1:
            f["hyphen"] = "y"
        if i == n - 1:
            f["last"] = "y"
        out.append(f)
    return out, low


def chunk_static_features(words: Sequence[str], tags: Sequence[str]) -> tuple[list[dict[str, str]], list[str]]:
    """Per-token static features of the chunker and each token's history key (its POS tag)."""
    low = [w.lower() for w in words]
    pt = ["<s2>", "<s1>", *tags, "</s1>", "</s2>"]
    pw = ["<s1>", *low, "</s1>"]
    out = []
    since: set[str] = set()
    for i in range(len(words)):
        p = i + 2
        out.append({
            "w": low[i], "pos": tags[i], "pos-1": pt[p - 1], "pos+1": pt[p + 1], "pos-2": pt[p - 2],
            "pos+2": pt[p + 2], "pos-1,pos": f"{pt[p - 1]}|{tags[i]}", "pos,pos+1": f"{tags[i]}|{pt[p + 1]}",
            "pos-2,pos-1": f"{pt[p - 2]}|{pt[p - 1]}", "pos+1,pos+2": f"{pt[p + 1]}|{pt[p + 2]}",
            "pos-1,pos,pos+1": f"{pt[p - 1]}|{tags[i]}|{pt[p + 1]}", "w-1": pw[i], "w+1": pw[i + 2],
            "w,pos+1": f"{low[i]}|{pt[p + 1]}", "since-dt": "+".join(sorted(since)),
        })
        if tags[i] == "DT":
            since = set()
        else:
            since.add(tags[i])
    return out, list(tags)


def static_features(kind: str, columns: Sequence[Sequence[str]]) -> tuple[list[dict[str, str]], list[str]]:
    """``columns``: (words,) for ``pos``, (words, pos tags) for ``chunk``."""
    if kind == "pos":
        return pos_static_features(columns[0])
    return chunk_static_features(columns[0], columns[1])


def history_features(p2: str, p1: str, key: str) -> dict[str, str]:
    return {"p1": p1, "p2p1": f"{p2}|{p1}", "p1k": f"{p1}|{key}"}


# -------------------------------------------------------------------------------------------- model

@dataclass
class LinearTagger:
    """A trained greedy tagger: ``kind``, class labels, feature names and weights (F, C) + bias (C,)."""

    kind: str
    classes: list[str]
    features: list[str]
    weights: np.ndarray  # (F, C) float32
    bias: np.ndarray  # (C,) float32
    settings: dict

    def __post_init__(self) -> None:
        self.index = {name: i for i, name in enumerate(self.features)}
        F, C = self.weights.shape
        # a zero row at index F stands for "feature never seen in training"
        self._wz = np.vstack([self.weights, np.zeros((1, C), dtype=self.weights.dtype)])
        labels = [*self.classes, START]
        L = len(labels)
        self._t_p1 = np.array([self.index.get(f"p1={a}", F) for a in labels], dtype=np.int64)
        self._t_p2p1 = np.array([[self.index.get(f"p2p1={a}|{b}", F) for b in labels] for a in labels],
                                dtype=np.int64)
        keys: dict[str, int] = {}
        pairs: list[tuple[int, str, int]] = []
        lab_index = {a: i for i, a in enumerate(labels)}
        for name, fid in self.index.items():
            if name.startswith("p1k="):
                lab, key = name[4:].split("|", 1)
                if lab in lab_index:
                    pairs.append((lab_index[lab], key, fid))
                    keys.setdefault(key, len(keys))
        self._keys = keys
        self._t_p1k = np.full((L, len(keys) + 1), F, dtype=np.int64)  # last column: unseen key
        for li, key, fid in pairs:
            self._t_p1k[li, keys[key]] = fid

    # ------------------------------------------------------------------------------------ decode

    def tag_many(self, sentences: Sequence[Sequence[Sequence[str]]]) -> list[list[str]]:
        """Labels for each sentence; a sentence is its columns ((words,) or (words, pos tags))."""
        from scipy import sparse

        lengths = np.array([len(s[0]) for s in sentences], dtype=np.int64)
        if lengths.sum() == 0:
            return [[] for _ in sentences]
        rows, cols, keys = [], [], []
        r = 0
        for cols_ in sentences:
            feats, key = static_features(self.kind, cols_)
            for f in feats:
                for name, value in f.items():
                    j = self.index.get(f"{name}={value}")
                    if j is not None:
                        rows.append(r)
                        cols.append(j)
                r += 1
            keys.extend(self._keys.get(k, len(self._keys)) for k in key)
        N, F = int(lengths.sum()), len(self.features)
        x = sparse.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(N, F))
        static = np.asarray(x @ self.weights) + self.bias  # (N, C)
        keys_a = np.asarray(keys, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        start = len(self.classes)
        p1 = np.full(len(sentences), start, dtype=np.int64)
        p2 = p1.copy()
        pred = np.empty(N, dtype=np.int64)
        for t in range(int(lengths.max())):
            s = np.nonzero(lengths > t)[0]
            rr = offsets[s] + t
            sc = (static[rr] + self._wz[self._t_p1[p1[s]]] + self._wz[self._t_p2p1[p2[s], p1[s]]]
                  + self._wz[self._t_p1k[p1[s], keys_a[rr]]])
            y = sc.argmax(1)
            pred[rr] = y
            p2[s] = p1[s]
            p1[s] = y
        out, o = [], 0
        for n in lengths.tolist():
            out.append([self.classes[i] for i in pred[o:o + n]])
            o += n
        return out

    # ------------------------------------------------------------------------------ save / load

    def save(self, directory: Path, name: str) -> None:
        from safetensors.numpy import save_file

        meta = {"format": FORMAT_VERSION, "kind": self.kind, "classes": self.classes, "features": self.features,
                "settings": self.settings}
        (directory / f"{name}.json").write_text(json.dumps(meta))
        save_file({"weights": np.ascontiguousarray(self.weights), "bias": np.ascontiguousarray(self.bias)},
                  str(directory / f"{name}.safetensors"))

    @classmethod
    def load(cls, directory: Path, name: str) -> LinearTagger:
        from safetensors.numpy import load_file

        meta = json.loads((directory / f"{name}.json").read_text())
        if meta.get("format") != FORMAT_VERSION or meta.get("kind") not in KINDS:
            raise ValueError(f"{directory / name}.json: not a kdrun tagger of format {FORMAT_VERSION}; delete the "
                             "directory to retrain")
        arrays = load_file(str(directory / f"{name}.safetensors"))
        return cls(meta["kind"], meta["classes"], meta["features"], arrays["weights"], arrays["bias"],
                   meta["settings"])


# ------------------------------------------------------------------------------------------ training

# SGD on the hinge loss (a linear SVM), one-vs-rest: ~10 s for the POS tagger on CoNLL-2000's
# 212k training tokens, 2 cores. ``prune``: weights below it are dropped (smaller files, same tags).
DEFAULT_SETTINGS = {"alpha": 1e-5, "epochs": 5, "prune": 1e-4, "seed": 0}


def training_instances(kind: str, sentences: Sequence[tuple[Sequence[Sequence[str]], Sequence[str]]]):
    """(feature dict, gold label) per token, with the gold previous labels as history."""
    out = []
    for columns, labels in sentences:
        feats, key = static_features(kind, columns)
        p2 = p1 = START
        for f, k, y in zip(feats, key, labels):
            out.append(({**f, **history_features(p2, p1, k)}, y))
            p2, p1 = p1, y
    return out


def _int32_indices(x):
    x = x.tocsr()
    x.indices = x.indices.astype(np.int32)
    x.indptr = x.indptr.astype(np.int32)
    return x


def train_tagger(kind: str, sentences, settings: dict | None = None) -> tuple[LinearTagger, object]:
    """Fit a tagger on ``[(columns, labels), ...]``; returns it and the NLTK classifier it came from.

    settings: ``alpha`` (L2 strength of scikit-learn's SGDClassifier), ``epochs``, ``seed``, ``prune``
    (weights below this magnitude are dropped, and features left without weights leave the model;
    0 keeps all). Deterministic for given data and settings.
    """
    from nltk.classify.scikitlearn import SklearnClassifier
    from sklearn.linear_model import SGDClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    s = {**DEFAULT_SETTINGS, **(settings or {})}
    data = training_instances(kind, sentences)
    labels = sorted({y for _, y in data})
    if len(labels) < 2:
        raise CorpusError(f"{kind} tagger: the training corpus has {len(labels)} distinct label(s) {labels}; "
                         "it needs at least 2 (is the corpus too small?)")
    # scikit-learn's linear models take 32-bit sparse indices only; the wrapper's DictVectorizer may
    # hand them 64-bit ones.
    svm = SGDClassifier(loss="hinge", alpha=float(s["alpha"]), max_iter=int(s["epochs"]), tol=None,
                        random_state=int(s["seed"]), n_jobs=2)
    clf = SklearnClassifier(make_pipeline(FunctionTransformer(_int32_indices, accept_sparse=True), svm)).train(data)
    # The wrapper's fitted parts: feature vectorizer and label encoder.
    vec, enc, est = clf._vectorizer, clf._encoder, svm
    coef = np.asarray(est.coef_, dtype=np.float32)
    bias = np.asarray(est.intercept_, dtype=np.float32)
    classes = [str(c) for c in enc.classes_]
    if coef.shape[0] == 1:  # binary: decision > 0 means class 1
        coef = np.vstack([np.zeros_like(coef), coef])
        bias = np.concatenate([np.zeros(1, np.float32), bias])
    weights = coef.T.copy()  # (F, C)
    names = vec.get_feature_names_out().tolist()
    prune = float(s["prune"])
    if prune > 0:
        weights[np.abs(weights) < prune] = 0.0
        keep = np.abs(weights).max(1) > 0
        weights = weights[keep]
        names = [n for n, k in zip(names, keep) if k]
    tagger = LinearTagger(kind, classes, names, np.ascontiguousarray(weights), bias, s)
    return tagger, clf
