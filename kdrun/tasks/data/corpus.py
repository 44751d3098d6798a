"""Raw-text corpora for general (task-agnostic) distillation: documents → token segments.

Formats, detected per file from its first non-empty line:

* **WikiExtractor** output: ``<doc id=.. url=.. title=..>`` … ``</doc>`` blocks; a block is a
  document (its first line, the title, is kept as text).
* **Plain text**: documents separated by one or more blank lines (the BERT pre-training layout:
  one sentence or paragraph per line, a blank line between documents).

Files are read line by line (never the whole corpus in memory). Each document is tokenised without
special tokens and cut into segments of at most ``max_seq_length - 2`` tokens ([CLS] … [SEP] are
added by :func:`segment_document`). **Segments never cross a document boundary and are not
packed**: a document's last, shorter segment stays short (batches are padded dynamically, and
length-grouped batching keeps the padding small); a tail shorter than ``min_tokens`` is dropped.
Documents go to the held-out validation slice by a hash of their text (``validation_percent``), so
the split does not depend on file order.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kdrun.tasks.data.common import DataError

_DOC_OPEN = re.compile(r"^<doc(\s[^>]*)?>\s*$")
_TITLE = re.compile(r'title="([^"]*)"')
_BINARY_PROBE = 8192


@dataclass(frozen=True)
class Document:
    """One document: where it starts (``file:line``) and its text (lines joined by newlines)."""

    where: str
    text: str
    title: str | None = None


def corpus_files(spec: str | Path | Iterable[str | Path]) -> list[Path]:
    """The files of a corpus: one file, every regular file under a directory (sorted, hidden files
    skipped), or a list of files/globs. Raises DataError when nothing is found."""
    items = [spec] if isinstance(spec, (str, Path)) else list(spec)
    files: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.is_file() and not any(s.startswith(".") for s in
                                                                                  q.relative_to(p).parts))
        elif p.is_file():
            files.append(p)
        else:
            matched = sorted(Path().glob(str(item))) if any(c in str(item) for c in "*?[") else []
            if not matched:
                raise DataError(f"corpus file {item} does not exist; set task.data_files to text files, a "
                                "directory of them, or a glob")
            files += [m for m in matched if m.is_file()]
    if not files:
        raise DataError(f"no corpus files in {spec}; set task.data_files to plain-text or WikiExtractor files")
    return files


def _check_text(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(_BINARY_PROBE)
    if b"\x00" in head:
        raise DataError(f"{path} looks binary (it contains NUL bytes), not text: give plain-text or "
                        "WikiExtractor files (decompress .gz/.bz2 archives first)")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    _check_text(path)
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield n, line.rstrip("\n")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a read block); convert "
                        "it to UTF-8") from None


def _is_wikiextractor(path: Path) -> bool:
    for _, line in _lines(path):
        if line.strip():
            return bool(_DOC_OPEN.match(line.strip()))
    return False


def read_documents(path: Path) -> Iterator[Document]:
    """The documents of one file, lazily (see the module docstring for the formats)."""
    yield from (_wikiextractor_docs(path) if _is_wikiextractor(path) else _plain_docs(path))


def _plain_docs(path: Path) -> Iterator[Document]:
    buf: list[str] = []
    start = 0
    for n, line in _lines(path):
        if line.strip():
            if not buf:
                start = n
            buf.append(line)
        elif buf:
            yield Document(f"{path}:{start}", "\n".join(buf))
            buf = []
    if buf:
        yield Document(f"{path}:{start}", "\n".join(buf))


def _wikiextractor_docs(path: Path) -> Iterator[Document]:
    buf: list[str] | None = None
    start, title = 0, None
    for n, line in _lines(path):
        stripped = line.strip()
        if _DOC_OPEN.match(stripped):
            if buf is not None:
                raise DataError(f"{path}:{n}: a <doc> opens before the <doc> of line {start} is closed; the file "
                                "is not valid WikiExtractor output (a truncated copy?)")
            buf, start = [], n
            m = _TITLE.search(stripped)
            title = m.group(1) if m else None
        elif stripped == "</doc>":
            if buf is None:
                raise DataError(f"{path}:{n}: </doc> without an opening <doc ...> line")
            text = "\n".join(x for x in buf if x.strip())
            if text:
                yield Document(f"{path}:{start}", text, title)
            buf = None
        elif buf is not None:
            buf.append(line)
        elif stripped:
            raise DataError(f"{path}:{n}: text outside a <doc> ... </doc> block in a WikiExtractor file")
    if buf is not None:
        raise DataError(f"{path}:{start}: the <doc> opened here is never closed (a truncated file?)")


def iter_documents(files: Iterable[Path]) -> Iterator[Document]:
    for path in files:
        yield from read_documents(path)


def is_validation(doc: Document, validation_percent: float) -> bool:
    """Whether ``doc`` belongs to the held-out slice (by a hash of its text: stable under reordering)."""
    h = int.from_bytes(hashlib.sha256(doc.text.encode()).digest()[:8], "big")
    return (h % 10_000) < validation_percent * 100


def segment_document(ids: list[int], max_seq_length: int, cls_id: int, sep_id: int,
                     min_tokens: int) -> Iterator[list[int]]:
    """``[CLS] piece [SEP]`` segments of one document's token ids, each at most ``max_seq_length``
    long; the last piece may be shorter, and is dropped below ``min_tokens`` tokens."""
    if max_seq_length < 3:
        raise DataError(f"task.max_seq_length={max_seq_length} leaves no room for text besides [CLS]/[SEP]")
    width = max_seq_length - 2
    for i in range(0, len(ids), width):
        piece = ids[i:i + width]
        if len(piece) < min_tokens:
            continue
        yield [cls_id, *piece, sep_id]


def corpus_fingerprint(files: list[Path]) -> str:
    """SHA-256 over the files' names and contents (streamed): the corpus part of the cache key."""
    h = hashlib.sha256()
    for p in files:
        h.update(f"[{p.name}:{p.stat().st_size}]".encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


@dataclass
class SegmentStats:
    documents: int = 0
    tokens: int = 0
    segments: dict[str, int] | None = None


def _batched_documents(files: list[Path], size: int = 256) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for doc in iter_documents(files):
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_corpus_splits(files: list[Path], tokenizer, out_dir: Path, max_seq_length: int,
                        validation_percent: float, min_tokens: int, progress=None) -> SegmentStats:
    """Tokenise the corpus in one pass into ``out_dir/{train,validation}.arrow`` (columns
    ``input_ids``, ``length``, ``idx``; memory-mapped when loaded). Documents are tokenised 256 at a
    time (the fast tokenizer's batch path); ``progress.update(n_tokens)`` follows it. Raises
    DataError for an empty or too short corpus."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "length": datasets.Value("int32"), "idx": datasets.Value("int64")})
    stats = SegmentStats(segments={"train": 0, "validation": 0})
    writers = {s: ArrowWriter(path=str(out_dir / f"{s}.arrow"), features=features) for s in ("train", "validation")}
    try:
        for docs in _batched_documents(files):
            encoded = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
            for doc, ids in zip(docs, encoded):
                stats.documents += 1
                stats.tokens += len(ids)
                split = "validation" if is_validation(doc, validation_percent) else "train"
                for seg in segment_document(ids, max_seq_length, tokenizer.cls_token_id, tokenizer.sep_token_id,
                                            min_tokens):
                    writers[split].write({"input_ids": seg, "length": len(seg), "idx": stats.segments[split]})
                    stats.segments[split] += 1
            if progress is not None:
                progress.update(sum(len(x) for x in encoded))
    finally:
        for w in writers.values():
            w.finalize()
            w.close()
    _check_stats(stats, files, max_seq_length, validation_percent)
    return stats


def _check_stats(stats: SegmentStats, files: list[Path], max_seq_length: int, validation_percent: float) -> None:
    where = ", ".join(str(f) for f in files[:3]) + (" …" if len(files) > 3 else "")
    if stats.documents == 0:
        raise DataError(f"the corpus ({where}) holds no text: give non-empty plain-text or WikiExtractor files")
    if stats.tokens < max_seq_length - 2:
        raise DataError(f"the corpus ({where}) has {stats.tokens} tokens, less than one segment of "
                        f"task.max_seq_length={max_seq_length}: give more text or a smaller max_seq_length")
    for split, n in stats.segments.items():
        if n == 0:
            hint = ("raise task.validation_percent" if split == "validation" else "lower task.validation_percent")
            raise DataError(f"the corpus ({where}) gives no {split} segments ({stats.documents} documents): {hint}")
