"""SQuAD v1.1 data: read and validate the JSON, split by article, subsample, as a DatasetDict.

Every split has one row per question: ``id`` (str), ``title`` (the article), ``context``,
``question``, ``answers`` ({``text``: [str], ``answer_start``: [int]}, the hub's layout) and ``idx``
(the row's position in the split after subsampling).

Sources, tried in this order:

1. ``task.data_files``: one SQuAD JSON file per split (``{train: a.json, validation: b.json}``), or a
   single file (a string) when ``task.split_by_article`` is set;
2. ``task.data_dir``: a directory with the official ``train-v1.1.json`` and ``dev-v1.1.json``;
3. the hub dataset ``task.hub_dataset`` (``rajpurkar/squad``; the legacy id ``squad`` is still
   accepted, see :data:`kdrun.tasks.data.sources.LEGACY_HUB_IDS`).

``task.split_by_article=N`` reads only the eval split's file (``dev-v1.1.json``: the train file is
not needed) and splits it by article, in file order: the first N articles become the train split,
the remaining ones the eval split. Questions of one article never land on both sides.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from kdrun.config import task_config
from kdrun.tasks.data.common import DataError, list_of, task_splits
from kdrun.tasks.data.hub import check_hub, load_hub

DEFAULT_FILES = {"train": "train-v1.1.json", "validation": "dev-v1.1.json"}
HUB_DATASET = "rajpurkar/squad"  # SQuAD v1.1 on the hub (formerly ``squad``)
_FORMAT = ('SQuAD v1.1 JSON is {"data": [{"title": str, "paragraphs": [{"context": str, "qas": [{"id": str, '
           '"question": str, "answers": [{"text": str, "answer_start": int}]}]}]}]}')

FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "title": datasets.Value("string"),
    "context": datasets.Value("string"),
    "question": datasets.Value("string"),
    "answers": {"text": list_of(datasets.Value("string")),
                "answer_start": list_of(datasets.Value("int32"))},
    "idx": datasets.Value("int64"),
})


# ------------------------------------------------------------------------------------- reading

def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise DataError(f"{where}: {what}. {_FORMAT}.")


def check_example(row: dict[str, Any], where: str) -> None:
    """A question's fields: non-empty question, and every answer's text found at its answer_start."""
    qid = row["id"]
    if not str(row["question"]).strip():
        raise DataError(f"{where}: example {qid!r} has an empty question. Fix or remove it.")
    context = row["context"]
    for k, (text, start) in enumerate(zip(row["answers"]["text"], row["answers"]["answer_start"])):
        if not text.strip():
            raise DataError(f"{where}: example {qid!r}: answer {k} is empty. Fix or remove it.")
        found = context[start:start + len(text)] if 0 <= start <= len(context) else None
        if found != text:
            raise DataError(
                f"{where}: example {qid!r}: answer {k} {text!r} does not match its context at answer_start="
                f"{start} (the context there reads {found!r}). Fix answer_start (a character offset into the "
                "context) or the answer text.")


def parse_squad(obj: Any, where: str) -> list[dict[str, Any]]:
    """Rows (one per question, file order) of a parsed SQuAD v1.1 object; DataError naming the
    article, paragraph or example id that does not fit the format."""
    _need(isinstance(obj, dict) and isinstance(obj.get("data"), list), where,
          f"expected an object with a 'data' list, found {type(obj).__name__}"
          + (f" with keys {sorted(obj)[:8]}" if isinstance(obj, dict) else ""))
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for a, article in enumerate(obj["data"]):
        at = f"{where}: data[{a}]"
        _need(isinstance(article, dict) and isinstance(article.get("paragraphs"), list), at,
              "expected an article with a 'paragraphs' list")
        title = str(article.get("title", f"article {a}"))
        for p, par in enumerate(article["paragraphs"]):
            pt = f"{at}.paragraphs[{p}]"
            _need(isinstance(par, dict) and isinstance(par.get("context"), str) and isinstance(par.get("qas"), list),
                  pt, "expected a paragraph with a 'context' string and a 'qas' list")
            for q, qa in enumerate(par["qas"]):
                qt = f"{pt}.qas[{q}]"
                _need(isinstance(qa, dict) and isinstance(qa.get("id"), (str, int)), qt,
                      "expected a question with an 'id'")
                qid = str(qa["id"])
                _need(isinstance(qa.get("question"), str), f"{where}: example {qid!r}", "no 'question' string")
                answers = qa.get("answers")
                _need(isinstance(answers, list) and all(
                    isinstance(x, dict) and isinstance(x.get("text"), str) and isinstance(x.get("answer_start"), int)
                    and not isinstance(x.get("answer_start"), bool) for x in answers),
                    f"{where}: example {qid!r}", "'answers' must be a list of {text: str, answer_start: int}")
                if qid in seen:
                    raise DataError(f"{where}: example id {qid!r} appears twice; ids must be unique.")
                seen.add(qid)
                row = {"id": qid, "title": title, "context": par["context"], "question": qa["question"],
                       "answers": {"text": [x["text"] for x in answers],
                                   "answer_start": [x["answer_start"] for x in answers]}}
                check_example(row, where)
                rows.append(row)
    return rows


@functools.lru_cache(maxsize=8)
def _read_cached(path: str, size: int, mtime: float) -> tuple[dict[str, Any], ...]:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot be read as JSON ({type(e).__name__}: {e}). {_FORMAT}.") from e
    return tuple(parse_squad(obj, path))


def read_squad(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The validated rows of a SQuAD v1.1 JSON file (parsed once per process and file version)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: SQuAD file not found. Check task.data_dir / task.data_files.")
    st = p.stat()
    return [dict(r) for r in _read_cached(str(p), st.st_size, st.st_mtime)]


def split_by_article(rows: list[dict[str, Any]], n: int, where: str) -> tuple[list[dict], list[dict]]:
    """(rows of the first ``n`` articles, rows of the rest), articles in file order."""
    titles = list(dict.fromkeys(r["title"] for r in rows))
    if not 1 <= n < len(titles):
        raise DataError(f"task.split_by_article={n}: {where} has {len(titles)} articles; choose 1..{len(titles) - 1} "
                        "so that both the train and the eval split get articles.")
    first = set(titles[:n])
    return [r for r in rows if r["title"] in first], [r for r in rows if r["title"] not in first]


# ------------------------------------------------------------------------------------- sources

def _file_sources(task: Any) -> dict[str, Path]:
    """The file of each split that is read (only the eval split's file with split_by_article)."""
    splits = task_splits(task)
    files = task.data_files
    if files and not isinstance(files, str):
        files = {k: Path(os.path.expanduser(str(v))) for k, v in dict(files).items()}
    elif files:
        files = {splits[1]: Path(os.path.expanduser(str(files)))}
    else:
        root = Path(os.path.expanduser(str(task.data_dir)))
        files = {s: root / DEFAULT_FILES.get(s, f"{s}.json") for s in splits}
    need = [splits[1]] if task.split_by_article else splits
    if task.split_by_article and len(files) == 1:  # a single file, whatever split it is filed under
        files = {splits[1]: next(iter(files.values()))}
    missing = [s for s in need if s not in files]
    if missing:
        raise DataError(f"task '{task.name}': task.data_files has no file for split(s) {missing}; give one "
                        f"SQuAD JSON file per split, or one file with task.split_by_article=N.")
    absent = {s: files[s] for s in need if not files[s].is_file()}
    if absent:
        listing = "\n".join(f"  {s}: {p}" for s, p in absent.items())
        hint = (" The official train file is often not at hand: task.split_by_article=40 splits dev-v1.1.json by "
                "article instead." if not task.split_by_article else "")
        raise DataError(f"task '{task.name}': SQuAD file(s) not found:\n{listing}\nCheck task.data_dir or "
                        f"task.data_files (paths are relative to the working directory).{hint}")
    return {s: files[s] for s in need}


def _hub_rows(task: Any) -> dict[str, list[dict[str, Any]]]:
    out = {}
    splits = task_splits(task)
    if task.split_by_article:
        splits = splits[1:2]
    task = {"name": task.name, "hub_dataset": task.hub_dataset or HUB_DATASET,
            "hub_config": task.hub_config, "train_split": splits[0], "eval_splits": splits[1:]}
    for split, ds in load_hub(task).items():
        where = f"hub dataset {task['hub_dataset']!r} split {split!r}"
        rows = [{k: r[k] for k in ("id", "title", "context", "question", "answers")} for r in ds]
        for r in rows:
            r["answers"] = {"text": list(r["answers"]["text"]), "answer_start": list(r["answers"]["answer_start"])}
            check_example(r, where)
        out[split] = rows
    return out


def check_qa_data(task: Any) -> None:
    """Preflight: the SQuAD files exist and are valid (parsing them takes well under a second)."""
    task = task_config(task)
    if task.data_files or task.data_dir:
        for path in _file_sources(task).values():
            rows = read_squad(path)
            if task.split_by_article:
                split_by_article(rows, int(task.split_by_article), str(path))
        return
    check_hub({"name": task.name, "hub_dataset": task.hub_dataset or HUB_DATASET})


def _subsample(rows: list[dict[str, Any]], limit: int | None, seed: int, what: str) -> list[dict[str, Any]]:
    """The first ``limit`` questions of a seeded shuffle, kept in file order."""
    if limit is None:
        return rows
    if int(limit) < 1:
        raise DataError(f"task.{what} must be a positive integer or null, got {limit}")
    if limit >= len(rows):
        return rows
    keep = np.sort(np.random.default_rng(seed).permutation(len(rows))[: int(limit)])
    return [rows[i] for i in keep.tolist()]


def load_qa_data(task: Any, seed: int | None = None) -> datasets.DatasetDict:
    """The train and eval splits of a SQuAD-format task (see the module doc); ``max_train_samples``
    and ``max_eval_samples`` count questions, drawn with ``task.sample_seed`` (``seed`` overrides it)."""
    task = task_config(task)
    seed = int(task.sample_seed) if seed is None else seed
    splits = task_splits(task)
    if len(splits) < 2:
        raise DataError(f"task '{task.name}': a question answering task needs an eval split (task.eval_splits)")
    n_articles = task.split_by_article
    if task.data_files or task.data_dir:
        raw = {s: read_squad(p) for s, p in _file_sources(task).items()}
        where = str(next(iter(_file_sources(task).values())))
    else:
        raw = _hub_rows(task)
        where = f"hub dataset {task.hub_dataset or HUB_DATASET!r}"
    if n_articles:
        raw = dict(zip(splits[:2], split_by_article(raw[splits[1]], int(n_articles), where)))
        if len(splits) > 2:
            raise DataError("task.split_by_article makes one train and one eval split; set one task.eval_splits")
    out = datasets.DatasetDict()
    for split in splits:
        limit, what = (("max_train_samples", "max_train_samples") if split == splits[0] else
                       ("max_eval_samples", "max_eval_samples"))
        rows = _subsample(raw[split], task[limit], seed, what)
        if split == splits[0]:
            for r in rows:
                if not r["answers"]["text"]:
                    raise DataError(f"{where}: training example {r['id']!r} has no answer; every training question "
                                    "needs one (SQuAD v1.1 has no unanswerable questions).")
        cols = {k: [r[k] for r in rows] for k in ("id", "title", "context", "question", "answers")}
        cols["idx"] = list(range(len(rows)))
        out[split] = datasets.Dataset.from_dict(cols, features=FEATURES)
    return out
