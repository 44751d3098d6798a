"""Question + context windows, as the Hugging Face QA examples make them (the idea, not their code).

Each question is tokenised with its context, truncating the context only: a context that does not
fit ``max_seq_length`` is split into windows that overlap by ``doc_stride`` tokens. A window's
label is the (start, end) token pair of the question's first gold answer when the answer lies
entirely inside the window's context, else (0, 0): the [CLS] token. Eval windows also keep what
post-processing needs: the example they belong to, the character offsets of their context tokens
((-1, -1) for question and special tokens), the context and the gold answer texts.

Columns of every split: ``input_ids``, ``attention_mask`` (``token_type_ids``), ``labels`` ([start,
end]), ``idx`` (window index), ``length``; eval splits add ``example_idx``, ``example_id``,
``offset_mapping``, ``context``, ``answers``; with a span extractor the train split adds ``spans``.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Sequence

import datasets

from kdrun.tasks.data.common import DataError, list_of

# Bumped when the layout of cached windows changes.
WINDOWS_VERSION = "1"
NO_OFFSET = (-1, -1)


def check_question_lengths(tokenizer: Any, questions: Sequence[str], ids: Sequence[str], max_seq_length: int,
                           doc_stride: int) -> None:
    """DataError naming the first example whose question leaves a window no more context tokens than
    ``doc_stride`` (the tokenizer could not make progress through the context)."""
    special = tokenizer.num_special_tokens_to_add(pair=True)
    lengths = [len(x) for x in tokenizer(list(questions), add_special_tokens=False)["input_ids"]]
    for qid, n in zip(ids, lengths):
        room = max_seq_length - special - n
        if room <= doc_stride:
            raise DataError(
                f"example {qid!r}: its question is {n} tokens long, which leaves {max(room, 0)} context tokens per "
                f"window with task.max_seq_length={max_seq_length} ({special} special tokens); a window needs more "
                f"than task.doc_stride={doc_stride}. Raise task.max_seq_length, lower task.doc_stride, or shorten or "
                "drop that question.")


def answer_tokens(offsets: Sequence[Sequence[int]], seq_ids: Sequence[int | None], start_char: int,
                  end_char: int) -> tuple[int, int]:
    """(start, end) token indices of the answer [start_char, end_char) in a window, or (0, 0) when
    it is not entirely inside the window's context tokens (sequence id 1)."""
    ctx = [i for i, s in enumerate(seq_ids) if s == 1]
    if not ctx:
        return 0, 0
    first, last = ctx[0], ctx[-1]
    if offsets[first][0] > start_char or offsets[last][1] < end_char:
        return 0, 0
    starts = [offsets[i][0] for i in range(first, last + 1)]
    ends = [offsets[i][1] for i in range(first, last + 1)]
    s = first + bisect.bisect_right(starts, start_char) - 1  # last token starting at or before the answer
    e = first + bisect.bisect_left(ends, end_char)  # first token ending at or after it
    return s, e


def make_windows(rows: dict[str, list[Any]], tokenizer: Any, max_seq_length: int, doc_stride: int,
                 for_eval: bool) -> tuple[dict[str, list[Any]], Any]:
    """Windows of a batch of examples (columns as in :data:`kdrun.tasks.qa.squad.FEATURES`).

    Returns (columns, the tokenizer's batch encoding) — the encoding for span extraction.
    """
    # Leading whitespace in a question pushes the context to the right (the HF examples strip it too).
    questions = [q.lstrip() for q in rows["question"]]
    enc = tokenizer(questions, rows["context"], truncation="only_second", max_length=max_seq_length,
                    stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True, padding=False)
    sample = enc["overflow_to_sample_mapping"]
    out: dict[str, list[Any]] = {k: list(enc[k]) for k in ("input_ids", "attention_mask", "token_type_ids")
                                 if k in enc}
    out["labels"], out["length"] = [], []
    if for_eval:
        for k in ("example_idx", "example_id", "offset_mapping", "context", "answers"):
            out[k] = []
    for w in range(len(enc["input_ids"])):
        ex = sample[w]
        seq_ids = enc.sequence_ids(w)
        offsets = enc["offset_mapping"][w]
        texts, starts = rows["answers"][ex]["text"], rows["answers"][ex]["answer_start"]
        label = answer_tokens(offsets, seq_ids, starts[0], starts[0] + len(texts[0])) if texts else (0, 0)
        out["labels"].append(list(label))
        out["length"].append(len(enc["input_ids"][w]))
        if for_eval:
            out["example_idx"].append(rows["idx"][ex])
            out["example_id"].append(rows["id"][ex])
            out["offset_mapping"].append([list(o) if s == 1 else list(NO_OFFSET) for o, s in zip(offsets, seq_ids)])
            out["context"].append(rows["context"][ex])
            out["answers"].append(list(texts))
    return out, enc


def _features(for_eval: bool, token_types: bool, spans: bool) -> datasets.Features:
    ints = list_of(datasets.Value("int32"))
    cols: dict[str, Any] = {"input_ids": ints, "attention_mask": list_of(datasets.Value("int8"))}
    if token_types:
        cols["token_type_ids"] = list_of(datasets.Value("int8"))
    cols |= {"labels": ints, "length": datasets.Value("int32"), "idx": datasets.Value("int64")}
    if for_eval:
        cols |= {"example_idx": datasets.Value("int64"), "example_id": datasets.Value("string"),
                 "offset_mapping": list_of(ints), "context": datasets.Value("string"),
                 "answers": list_of(datasets.Value("string"))}
    if spans:
        cols["spans"] = list_of(ints)
    return datasets.Features(cols)


def windows_split(ds: datasets.Dataset, tokenizer: Any, max_seq_length: int, doc_stride: int, for_eval: bool,
                  spans: Any = None) -> datasets.Dataset:
    """All windows of one split (``spans``: a SpanExtractor adding MGSKD's spans to each window)."""
    check_question_lengths(tokenizer, ds["question"], ds["id"], max_seq_length, doc_stride)
    cols: dict[str, list[Any]] = {}
    for lo in range(0, len(ds), 1000):
        rows = ds[lo:lo + 1000]
        part, enc = make_windows(rows, tokenizer, max_seq_length, doc_stride, for_eval)
        if spans is not None:
            from kdrun.tasks.qa.answers import window_spans

            part["spans"] = window_spans(spans, enc, [q.lstrip() for q in rows["question"]], rows["context"])
        for k, v in part.items():
            cols.setdefault(k, []).extend(v)
    cols["idx"] = list(range(len(cols.get("input_ids", []))))
    if not cols["idx"]:
        raise DataError("a question answering split has no examples; check task.max_*_samples and the data")
    feats = _features(for_eval, "token_type_ids" in cols, "spans" in cols)
    return datasets.Dataset.from_dict({k: cols[k] for k in feats}, features=feats)


def tokenize_qa_splits(dsd: datasets.DatasetDict, tokenizer: Any, task: Any, spans: Any = None,
                       span_splits: Sequence[str] | None = None, cache_dir: str | None = None,
                       cache_key: str | None = None) -> dict[str, datasets.Dataset]:
    """Windows of every split (the train split, ``task.train_split``, without eval columns), cached
    under ``<cache_dir>/tokenized/<hash>`` when ``cache_dir`` and ``cache_key`` (an identity of the
    raw data and the tokenizer) are given; ``spans`` is added to the splits in ``span_splits``."""
    train_split = str(task.train_split)
    span_splits = [s for s in (span_splits or []) if s in dsd] if spans is not None else []

    def build_all() -> dict[str, datasets.Dataset]:
        return {split: windows_split(ds, tokenizer, int(task.max_seq_length), int(task.doc_stride),
                                     for_eval=split != train_split, spans=spans if split in span_splits else None)
                for split, ds in dsd.items()}

    if cache_dir is None or cache_key is None:
        return build_all()
    from kdrun.runtime.cache import content_hash, get_or_build, is_complete

    key = content_hash({"qa_windows": WINDOWS_VERSION, "data": cache_key, "max_seq_length": int(task.max_seq_length),
                        "doc_stride": int(task.doc_stride), "train_split": train_split,
                        "spans": spans.key if span_splits else None, "span_splits": sorted(span_splits)})

    def build(tmp) -> None:
        for split, ds in build_all().items():
            ds.save_to_disk(str(tmp / split))

    if not is_complete(Path(cache_dir).expanduser() / "tokenized" / key):  # bad data fail before the cache is touched
        for ds in dsd.values():
            check_question_lengths(tokenizer, ds["question"], ds["id"], int(task.max_seq_length), int(task.doc_stride))
    entry, hit = get_or_build(cache_dir, "tokenized", key, build)
    out = {split: datasets.load_from_disk(str(entry / split)) for split in dsd}
    sizes = ", ".join(f"{s}: {len(dsd[s])} questions -> {len(out[s])} windows" for s in dsd)
    print(f"[kdrun] QA windows{' (cached)' if hit else ''}: {sizes} ({entry})", flush=True)
    return out
