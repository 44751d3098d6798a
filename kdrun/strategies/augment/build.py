"""Building, caching and loading the augmented training set.

Entry point for the run flow::

    from kdrun.strategies.augment import get_augmented
    aug_train, info = get_augmented(cfg.augmentation, raw["train"], cfg.task.name, cfg.cache_dir,
                                    device=cfg.train.device)

The result has the task's columns (``text_a``, [``text_b``], ``label``, ``idx``) plus ``source_idx``
(the ``idx`` of the row it came from) and ``is_original``. Per source row: the original first, then
its distinct variants — single-sentence tasks up to ``n`` of them; pair tasks up to ``n`` with
``text_a`` augmented and ``text_b`` kept, then up to ``n`` with ``text_b`` augmented and ``text_a``
kept (each side augmented on its own, never mixing rows). ``idx`` numbers the rows of the augmented
set 0..R-1. Labels: original rows keep their gold label; augmented rows carry the source row's label
when ``augmentation.copy_labels=true``, else :data:`NO_LABEL` (-1) for classification or NaN for
regression.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from kdrun.runtime.cache import content_hash, file_fingerprint, load_or_build, write_json_atomic
from kdrun.strategies.augment.errors import AugmentationError
from kdrun.strategies.augment.generate import make_variants
from kdrun.strategies.augment.vectors import MLM_EMBEDDINGS
from kdrun.strategies.augment.words import is_replaceable, is_space, split_pieces

# Label of an augmented classification row without a gold label (regression rows get NaN).
NO_LABEL = -1
# Bump when the algorithm changes what it writes: old cache entries are then not reused.
ALGORITHM_VERSION = 1
KNOWN_NAMES = ("tinybert",)
# params keys: n_by_task feeds the `n` interpolation of conf/augmentation/tinybert.yaml;
# precision = auto | fp32 | bf16 | fp16 for the MLM forward; max_tokens caps padded tokens per batch.
KNOWN_PARAMS = ("n_by_task", "precision", "max_tokens")
_CHUNK_ROWS = 1024  # source rows whose sentences are searched together (sorted by length within)


@dataclass(frozen=True)
class AugmentSettings:
    """Validated ``augmentation`` config (see :func:`settings_from_config`)."""

    mlm: str
    word_vectors: str | None
    max_vectors: int
    m: int
    n: int
    p_t: float
    seed: int
    batch_size: int
    num_proc: int | None
    copy_labels: bool
    precision: str
    max_tokens: int | None


def _typed(cfg_aug: Any) -> Any:
    """The ``augmentation`` node (DictConfig, dataclass or dict) as a typed AugmentationConfig; a
    wrong key or a value of the wrong type fails naming the key."""
    from omegaconf.errors import OmegaConfBaseException

    from kdrun.config import AugmentationConfig, typed

    try:
        return typed(cfg_aug, AugmentationConfig)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise AugmentationError(f"augmentation.{key}: {str(e).splitlines()[0]}") from None


def settings_from_config(cfg_aug: Any) -> AugmentSettings:
    """Check an ``augmentation`` config node (DictConfig, dataclass or dict); errors name the key."""
    cfg_aug = _typed(cfg_aug)
    name = str(cfg_aug.name)
    if name not in KNOWN_NAMES:
        raise AugmentationError(
            f"augmentation.name={name!r}: no augmented data to build; choose augmentation=tinybert")
    params = dict(cfg_aug.params or {})
    unknown = sorted(set(params) - set(KNOWN_PARAMS))
    if unknown:
        raise AugmentationError(
            f"augmentation.params.{unknown[0]} is not a known option; known: {', '.join(KNOWN_PARAMS)}")

    def integer(key: str, low: int) -> int:
        value = cfg_aug[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise AugmentationError(f"augmentation.{key}={value!r} must be an integer >= {low}")
        return int(value)

    p_t = cfg_aug.p_t
    if isinstance(p_t, bool) or not isinstance(p_t, (int, float)) or not 0.0 <= float(p_t) <= 1.0:
        raise AugmentationError(f"augmentation.p_t={p_t!r} must be a probability in [0, 1]")
    mlm = cfg_aug.mlm
    if not mlm:
        raise AugmentationError("augmentation.mlm is empty; give a fill-mask model (hub id, directory or pkg:)")
    vectors = cfg_aug.word_vectors
    num_proc = cfg_aug.num_proc
    if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
        raise AugmentationError(f"augmentation.num_proc={num_proc!r} must be null or an integer >= 1")
    precision = str(params.get("precision", "auto"))
    if precision not in ("auto", "fp32", "bf16", "fp16"):
        raise AugmentationError(f"augmentation.params.precision={precision!r} must be auto, fp32, bf16 or fp16")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise AugmentationError(f"augmentation.params.max_tokens={max_tokens!r} must be null or an integer >= 1")
    return AugmentSettings(
        mlm=str(mlm),
        word_vectors=None if vectors in (None, "", "none", "null") else str(vectors),
        max_vectors=integer("max_vectors", 1),
        m=integer("m", 1),
        n=integer("n", 0),
        p_t=float(p_t),
        seed=integer("seed", 0),
        batch_size=integer("batch_size", 1),
        num_proc=num_proc,
        copy_labels=bool(cfg_aug.copy_labels),
        precision=precision,
        max_tokens=max_tokens,
    )


def check_augmentation(cfg_aug: Any) -> AugmentSettings:
    """Pre-flight (no weights loaded): valid settings, a resolvable MLM with a masked-LM head
    declared, an existing vectors file. Offline, an uncached hub MLM fails here within a second."""
    from kdrun.strategies.augment.mlm import check_mlm_architecture, resolve_mlm
    from kdrun.strategies.augment.vectors import check_vectors_file

    s = settings_from_config(cfg_aug)
    if s.word_vectors not in (None, MLM_EMBEDDINGS):
        check_vectors_file(s.word_vectors)
    check_mlm_architecture(resolve_mlm(s.mlm), s.mlm)
    return s


# ------------------------------------------------------------------------------------ cache key


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """Content hash of a split's columns (texts, labels, idx)."""
    h = hashlib.sha256(json.dumps(sorted(ds.column_names)).encode())
    for col in ("text_a", "text_b", "label", "idx"):
        if col in ds.column_names:
            h.update(f"[{col}]".encode())
            h.update(json.dumps(list(ds[col])).encode())
    return h.hexdigest()[:16]


def mlm_identity(ref: str) -> dict[str, Any]:
    """What identifies the MLM without loading it: a directory's files (size, mtime), or a hub id and
    the cached revision."""
    if ref.startswith("pkg:"):
        try:
            import importlib

            ref_dir = str(importlib.import_module(ref[4:]).get_model_path())
        except ImportError:
            return {"ref": ref}
    else:
        ref_dir = ref
    path = Path(ref_dir).expanduser()
    if path.is_dir():
        return {"path": str(path.resolve()), "files": file_fingerprint(path)}
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(ref, "config.json")
    except Exception:  # noqa: BLE001 - not cached: the id alone identifies it
        hit = None
    if isinstance(hit, str) and "/snapshots/" in hit:
        return {"hub": ref, "revision": hit.split("/snapshots/")[1].split("/")[0]}
    return {"hub": ref}


def forward_precision(precision: str, device: Any = None) -> str:
    """The MLM forward's precision (``fp32``/``bf16``/``fp16``) that ``precision`` means on ``device``."""
    import torch

    from kdrun.strategies.augment.mlm import _autocast_dtype, resolve_device

    dtype = _autocast_dtype(precision, resolve_device(device))
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def cache_key(s: AugmentSettings, raw_train: datasets.Dataset, device: Any = None) -> tuple[str, dict[str, Any]]:
    """(key, what it hashes): task data, MLM, vectors content, M, N, p_t, seed, label handling and the
    forward precision (a bf16 GPU build proposes slightly different candidates than an fp32 one)."""
    from kdrun.strategies.augment.vectors import vectors_identity

    if s.word_vectors is None or s.word_vectors == MLM_EMBEDDINGS:
        vectors: Any = s.word_vectors
    else:
        vectors = {"sha256": vectors_identity(s.word_vectors, s.max_vectors), "max_vectors": s.max_vectors}
    parts = {
        "v": ALGORITHM_VERSION,
        "data": dataset_fingerprint(raw_train),
        "mlm": mlm_identity(s.mlm),
        "vectors": vectors,
        "m": s.m,
        "n": s.n,
        "p_t": s.p_t,
        "seed": s.seed,
        "copy_labels": s.copy_labels,
        "precision": forward_precision(s.precision, device),
    }
    return content_hash(parts), parts


# ----------------------------------------------------------------------------------------- build


class _Tokenize:
    """``datasets.map`` function: pieces of each side and their WordPieces (picklable for num_proc)."""

    def __init__(self, tokenizer: Any, sides: list[str]):
        self.tokenizer = tokenizer
        self.sides = sides

    def __call__(self, rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for side in self.sides:
            pieces = [split_pieces(t) for t in rows[side]]
            words = [[p for p in ps if not is_space(p)] for ps in pieces]
            where = [[i for i, p in enumerate(ps) if not is_space(p)] for ps in pieces]
            nonempty = [w if w else [""] for w in words]
            enc = self.tokenizer(nonempty, is_split_into_words=True, add_special_tokens=False)
            piece_of = []
            for b in range(len(pieces)):
                piece_of.append([where[b][w] for w in enc.word_ids(b)] if words[b] else [])
            out[f"{side}_pieces"] = pieces
            out[f"{side}_ids"] = [ids if words[b] else [] for b, ids in enumerate(enc["input_ids"])]
            out[f"{side}_piece_of"] = piece_of
        return out


@dataclass
class _Stats:
    sentences: int = 0
    mlm_words: int = 0
    vector_words: int = 0
    words_without_candidates: int = 0
    rows: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _CandidateFinder:
    """Candidate lists for the replaceable words of many sentences at once."""

    def __init__(self, s: AugmentSettings, mlm: Any, vectors: Any, emb: Any, stats: _Stats):
        self.s, self.mlm, self.vectors, self.emb, self.stats = s, mlm, vectors, emb, stats
        self.memo: dict[str, list[str]] = {}  # multi-piece word -> neighbours (shared across chunks)

    def __call__(self, sents: list[tuple[list[str], list[int], list[int]]], on_batch) -> list[dict[int, list[str]]]:
        """For each ``(pieces, wordpiece ids, piece index of each wordpiece)``: piece index -> words."""
        from kdrun.strategies.augment.mlm import batched_candidates

        mlm, unk = self.mlm, self.mlm.tokenizer.unk_token_id
        jobs: list[tuple[int, int]] = []
        job_piece: list[int] = []
        multi: list[tuple[int, int, list[int]]] = []
        for si, (pieces, ids, piece_of) in enumerate(sents):
            first: dict[int, int] = {}
            count: dict[int, int] = {}
            for t, p in enumerate(piece_of):
                first.setdefault(p, t)
                count[p] = count.get(p, 0) + 1
            for p, piece in enumerate(pieces):
                if not is_replaceable(piece):
                    continue
                if count.get(p) == 1 and ids[first[p]] != unk:
                    if first[p] < mlm.max_pieces:  # beyond the MLM's window: kept as it is
                        jobs.append((si, first[p]))
                        job_piece.append(p)
                else:
                    multi.append((si, p, [ids[t] for t in range(len(ids)) if piece_of[t] == p]))
        out: list[dict[int, list[str]]] = [{} for _ in sents]
        found = batched_candidates(mlm, [s[1] for s in sents], jobs, min(self.s.m, len(mlm.vocab)),
                                   self.s.batch_size, self.s.max_tokens, lambda k: on_batch(k, len(jobs)))
        for (si, _), p, cand in zip(jobs, job_piece, found):
            out[si][p] = [mlm.vocab[i] for i in cand]
        self.stats.mlm_words += len(jobs)
        self.stats.vector_words += len(multi)
        if multi and self.vectors is not None:
            self._fill_memo(multi, sents)
            for si, p, _ in multi:
                out[si][p] = self.memo[sents[si][0][p]]
        self.stats.words_without_candidates += sum(1 for o in out for c in o.values() if not c) + (
            len(multi) if self.vectors is None else 0)
        return out

    def _fill_memo(self, multi: list[tuple[int, int, list[int]]], sents) -> None:
        import torch

        todo: dict[str, list[int]] = {}
        for si, p, piece_ids in multi:
            word = sents[si][0][p]
            if word not in self.memo and word not in todo:
                todo[word] = piece_ids
        if not todo:
            return
        words = list(todo)
        if self.emb is None:  # GloVe: the word's own row
            found = self.vectors.neighbours_of_words(words, self.s.m)
        else:  # mlm_embeddings: mean of the word's WordPiece embeddings
            queries = torch.stack([self.emb[todo[w]].mean(0) if todo[w] else self.emb.new_zeros(self.emb.shape[1])
                                   for w in words])
            found = self.vectors.search(queries, words, self.s.m)
        self.memo.update(zip(words, found))


def find_candidates(texts: list[str], mlm: Any, m: int, vectors: Any = None, emb: Any = None,
                    batch_size: int = 256) -> list[dict[int, list[str]]]:
    """Candidate words of each text's replaceable words, keyed by piece index (``split_pieces``).

    ``mlm`` is a :class:`kdrun.strategies.augment.mlm.MaskedLM`; ``vectors`` a :class:`NeighbourIndex` (GloVe) or,
    with ``emb`` the MLM's input-embedding matrix, the ``mlm_embeddings`` index; None = no candidates
    for multi-piece words.
    """
    rows = _Tokenize(mlm.tokenizer, ["text"])({"text": list(texts)})
    sents = list(zip(rows["text_pieces"], rows["text_ids"], rows["text_piece_of"]))
    s = AugmentSettings(mlm=mlm.ref, word_vectors=None, max_vectors=1, m=m, n=0, p_t=0.0, seed=0,
                        batch_size=batch_size, num_proc=None, copy_labels=False, precision="fp32", max_tokens=None)
    return _CandidateFinder(s, mlm, vectors, emb, _Stats())(sents, lambda k, total: None)


def _features(raw_train: datasets.Dataset) -> datasets.Features:
    feats = {c: raw_train.features[c] for c in ("text_a", "text_b", "label") if c in raw_train.column_names}
    feats["idx"] = datasets.Value("int64")
    feats["source_idx"] = datasets.Value("int64")
    feats["is_original"] = datasets.Value("bool")
    return datasets.Features(feats)


def _is_regression(raw_train: datasets.Dataset) -> bool:
    return str(getattr(raw_train.features["label"], "dtype", "int64")).startswith("float")


def _distinct_sentences(rows: dict[str, list[Any]], sides: list[str]):
    """The distinct sentences of a chunk (each searched once: MNLI repeats its premises) and, per side,
    the sentence index of every row."""
    keys: dict[str, int] = {}
    sents: list[tuple[list[str], list[int], list[int]]] = []
    where: dict[str, list[int]] = {}
    for side in sides:
        where[side] = []
        for r, text in enumerate(rows[side]):
            if text not in keys:
                keys[text] = len(sents)
                sents.append((rows[f"{side}_pieces"][r], rows[f"{side}_ids"][r], rows[f"{side}_piece_of"][r]))
            where[side].append(keys[text])
    return sents, where


def _emit(cols: dict[str, list[Any]], rows: dict[str, list[Any]], r: int, sides: list[str],
          variants: list[list[str]], copy_labels: bool, no_label: Any, stats: _Stats) -> None:
    """Append source row ``r``: the original, then each side's variants with the other side(s) kept."""
    original = {side: rows[side][r] for side in sides}
    out = [(original, True)]
    for side, texts in zip(sides, variants):
        out.extend(({**original, side: text}, False) for text in texts)
    for texts, is_orig in out:
        for side in sides:
            cols[side].append(texts[side])
        cols["label"].append(rows["label"][r] if is_orig or copy_labels else no_label)
        cols["idx"].append(stats.rows)
        cols["source_idx"].append(rows["idx"][r])
        cols["is_original"].append(is_orig)
        stats.rows += 1


def build_augmented(s: AugmentSettings, raw_train: datasets.Dataset, device: Any = None,
                    progress: bool = True) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Augment ``raw_train`` (not cached; see :func:`get_augmented`). Returns (dataset, stats)."""
    from tqdm.auto import tqdm

    from kdrun.strategies.augment.mlm import load_mlm
    from kdrun.strategies.augment.vectors import load_glove, mlm_embedding_index

    missing = [c for c in ("text_a", "label", "idx") if c not in raw_train.column_names]
    if missing:
        raise AugmentationError(f"the training data lacks column(s) {missing}; expected text_a, [text_b], label, idx "
                                "(kdrun.tasks.data.sources.load_task_data output)")
    t0 = time.perf_counter()
    mlm = load_mlm(s.mlm, device, s.precision)
    vectors, emb = None, None
    if s.word_vectors == MLM_EMBEDDINGS:
        vectors, emb = mlm_embedding_index(mlm.model, mlm.vocab, mlm.allowed)
    elif s.word_vectors is not None:
        vectors = load_glove(s.word_vectors, s.max_vectors, mlm.device)
    sides = ["text_a", "text_b"] if "text_b" in raw_train.column_names else ["text_a"]
    if s.num_proc and s.num_proc > 1:  # forked workers each tokenise; no nested Rust thread pools
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = raw_train.map(_Tokenize(mlm.tokenizer, sides), batched=True, batch_size=1000, num_proc=s.num_proc,
                        desc="augment: split and tokenise")
    stats = _Stats()
    finder = _CandidateFinder(s, mlm, vectors, emb, stats)
    regression = _is_regression(raw_train)
    no_label = math.nan if regression else NO_LABEL
    features = _features(raw_train)
    parts: list[datasets.Dataset] = []
    t_search = time.perf_counter()
    bar = tqdm(total=len(tok) * len(sides), unit="sent", desc="augment", disable=not progress, smoothing=0.1,
               bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]")
    for start in range(0, len(tok), _CHUNK_ROWS):
        rows = tok[start:start + _CHUNK_ROWS]
        n_rows = len(rows["idx"])
        sents, where = _distinct_sentences(rows, sides)
        n_sent = n_rows * len(sides)
        shown = [0.0]

        def on_batch(k: int, n_jobs: int, n_sent=n_sent, shown=shown) -> None:
            step = min(k * n_sent / max(1, n_jobs), n_sent - shown[0])
            shown[0] += step
            bar.update(step)

        cands = finder(sents, on_batch)
        bar.update(n_sent - shown[0])
        cols: dict[str, list[Any]] = {c: [] for c in features}
        for r in range(n_rows):
            variants = []
            for k, side in enumerate(sides):
                si = where[side][r]
                rng = np.random.default_rng([s.seed, start + r, k])  # one stream per (row, side)
                variants.append(make_variants(sents[si][0], cands[si], s.n, s.p_t, rng)[1:])
            _emit(cols, rows, r, sides, variants, s.copy_labels, no_label, stats)
        stats.sentences += n_sent
        parts.append(datasets.Dataset.from_dict(cols, features=features))
    bar.close()
    search_s = time.perf_counter() - t_search
    out = datasets.concatenate_datasets(parts) if parts else datasets.Dataset.from_dict(
        {c: [] for c in features}, features=features)
    info = {
        **stats.as_dict(),
        "source_rows": len(raw_train),
        "device": str(mlm.device),
        "build_s": round(time.perf_counter() - t0, 3),
        "sentences_per_s": round(stats.sentences / search_s, 2) if search_s > 0 else None,
    }
    return out, info


# ------------------------------------------------------------------------------------------ API


def get_augmented(cfg_aug: Any, raw_train: datasets.Dataset, task_name: str, cache_dir: str | Path,
                  device: Any = None, progress: bool = True) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The augmented training set for ``raw_train``, from ``cache_dir/augmented/<key>`` or built there.

    ``cfg_aug`` is the ``augmentation`` config node (``n`` already resolved for the task, see
    conf/augmentation/tinybert.yaml); ``raw_train`` the task's train split with canonical columns;
    ``device`` ``auto``/``cpu``/``cuda`` or a torch device for the MLM. The entry is built in a
    staging directory under a file lock and renamed into place, so concurrent jobs build it once.

    Returns ``(dataset, info)``: see the module docstring for the columns and labels; ``info`` has
    ``path``, ``key``, ``cached`` (bool), ``rows``, ``source_rows``, ``sentences``, ``mlm_words``,
    ``vector_words``, ``build_s``, ``sentences_per_s``, ``label`` (how augmented rows are labelled),
    and ``settings``.
    """
    s = settings_from_config(cfg_aug)
    key, key_parts = cache_key(s, raw_train, device)

    def build(tmp: Path) -> None:
        ds, stats = build_augmented(s, raw_train, device, progress)
        ds.save_to_disk(str(tmp / "data"))
        write_json_atomic(tmp / "meta.json", {"task": task_name, "key": key, "key_parts": key_parts,
                                              "settings": asdict(s), "stats": stats})

    (ds, meta), entry, cached = load_or_build(
        cache_dir, "augmented", key, build,
        lambda e: (datasets.load_from_disk(str(e / "data")), json.loads((e / "meta.json").read_text())))
    if s.copy_labels:
        label = "copied from the source row"
    else:
        label = "NaN on augmented rows" if _is_regression(raw_train) else f"{NO_LABEL} on augmented rows"
    info = {"path": str(entry), "key": key, "cached": cached, "task": task_name, "rows": len(ds),
            **meta["stats"], "label": label, "settings": meta["settings"]}
    return ds, info
