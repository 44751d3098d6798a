"""Draw what CKD matches: teacher vs student relations for one sentence, to a PNG.

Top row teacher, bottom row student; columns: the word-relation (WR) pair matrix of one aligned
layer pair (distance, or cosine with --phi cosine), the WR angle matrix at one vertex token (cosine
of the angle i-vertex-k for every token pair), and the layer-transforming-relation (LTR) matrix
(distances among the aligned layers' representations, averaged over the sentence's tokens).
Layers are aligned with CKD's uniform (gcd) map, embeddings included.

    python scripts/plots/relations.py --student outputs/runs/.../student --teacher <teacher dir> \
        --sentence "a gripping , funny film" [--pair "second sentence"] [--vertex 3] \
        [--layer-pair -1] [--phi l2|cosine] [--out relations.png]

The teacher directory of a run is printed at its end and stored in results.json (teacher.path).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kdrun.runtime import harness

harness.offline()


def load_model(path: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path).eval()


def load_tokenizer(*paths: str):
    """The first of ``paths`` that holds a tokenizer (both models share it)."""
    from transformers import AutoTokenizer

    for i, path in enumerate(paths):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            if i == len(paths) - 1:
                raise


def relations(hidden, layers, layer_pair, vertex, phi):
    """WR pair and angle matrices at hidden[layers[layer_pair]] and the token-averaged LTR distances."""
    import torch

    from kdrun.losses.relations import angle_matrix, pair_relation

    x = hidden[layers[layer_pair]][:1].float()
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    wr, _ = pair_relation(x, mask, phi)
    angle = angle_matrix(x, mask, vertex)
    pts = torch.stack([hidden[i][0].float() for i in layers], dim=1)  # (n, l, d)
    ltr, _ = pair_relation(pts, torch.ones(pts.shape[:2], dtype=torch.bool), phi)
    return wr[0], angle[0], ltr.mean(0)


def main(argv: list[str] | None = None) -> Path:
    ap = harness.parser(__doc__)
    ap.add_argument("--student", required=True, help="saved student directory (run_dir/student)")
    ap.add_argument("--teacher", required=True, help="fine-tuned teacher directory")
    ap.add_argument("--sentence", required=True)
    ap.add_argument("--pair", default=None, help="second sentence of a sentence-pair task")
    ap.add_argument("--vertex", type=int, default=None, help="token index of the angle's vertex (default: middle)")
    ap.add_argument("--layer-pair", type=int, default=-1, help="which aligned layer pair the WR panels show")
    ap.add_argument("--phi", default="l2", choices=["l2", "cosine"])
    ap.add_argument("--out", default="relations.png")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from kdrun.models.mapping import build_layer_pairs

    student, teacher = load_model(args.student), load_model(args.teacher)
    tok = load_tokenizer(args.student, args.teacher)
    enc = tok(args.sentence, args.pair, return_tensors="pt", truncation=True, max_length=128)
    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
    n = len(tokens)
    vertex = n // 2 if args.vertex is None else args.vertex
    if not 0 <= vertex < n:
        sys.exit(f"--vertex {vertex} is outside the sentence's {n} tokens")
    pairs = build_layer_pairs("uniform", student.config.num_hidden_layers, teacher.config.num_hidden_layers)
    with torch.no_grad():
        hs = student(**enc, output_hidden_states=True).hidden_states
        ht = teacher(**enc, output_hidden_states=True).hidden_states
    rows = {
        "teacher": relations(ht, [t for _, t in pairs], args.layer_pair, vertex, args.phi),
        "student": relations(hs, [s for s, _ in pairs], args.layer_pair, vertex, args.phi),
    }
    si, ti = pairs[args.layer_pair]
    pair_name = "distance" if args.phi == "l2" else "cosine"
    fig, axes = plt.subplots(2, 3, figsize=(15, 9.5), gridspec_kw={"width_ratios": [1, 1, 0.6]})
    for r, (who, (wr, angle, ltr)) in enumerate(rows.items()):
        layer = ti if who == "teacher" else si
        for c, (mat, title, cmap, vmin, vmax) in enumerate([
            (wr, f"{who} WR {pair_name}, layer {layer}", "viridis", None, None),
            (angle, f"{who} WR angle cos at '{tokens[vertex]}' ({vertex}), layer {layer}", "coolwarm", -1, 1),
            (ltr, f"{who} LTR {pair_name} (mean over tokens)", "viridis", None, None),
        ]):
            ax = axes[r, c]
            im = ax.imshow(mat.numpy(), cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_title(title, fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
            if c < 2 and n <= 40:
                ax.set_xticks(range(n), tokens, rotation=90, fontsize=6)
                ax.set_yticks(range(n), tokens, fontsize=6)
            elif c == 2:
                labels = [str(s if who == "student" else t) for s, t in pairs]
                ax.set_xticks(range(len(pairs)), labels)
                ax.set_yticks(range(len(pairs)), labels)
                ax.set_xlabel("layer")
    fig.suptitle(f"CKD relations: teacher ({teacher.config.num_hidden_layers} layers) vs student "
                 f"({student.config.num_hidden_layers} layers); aligned pairs {pairs}", fontsize=10)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
