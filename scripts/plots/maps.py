"""Draw a run's layer-map weights to PNG.

1. Learnable-map weights over training steps (Jassani, Dankar & Kumar, Fig. 3): one panel per student layer j, one
   line per teacher layer k of its bucket, v_j[k] = softmax(θ_j)[k] as logged in metrics.jsonl
   (``objective/<map>/s<j>/t<k>``). ALP-KD runs log the batch-mean attention weights the same way,
   so they are drawn too.
2. ALP-KD attention weights per example (Passban et al. 2021, Fig. 3), for runs whose map is ``attention``:
   the saved student and the run's teacher are run on ``--examples`` randomly chosen dev examples
   and α_jk = softmax_k(h_s^j · h_t^k) of each matched student layer is drawn as an examples ×
   teacher-layers heat map.

    python scripts/plots/maps.py <run dir> [--out <dir>] [--examples 10] [--seed 0]

Writes ``<out>/<map>_weights.png`` and ``<out>/alp_attention.png`` (``--out`` defaults to the run
directory) and prints their paths.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from kdrun.runtime import harness

harness.offline()

KEY = re.compile(r"^objective/(?P<map>map[^/]*)/s(?P<s>\d+)/t(?P<t>\d+)$")


def read_weights(metrics: Path) -> dict[str, dict[int, dict[int, list[tuple[int, float]]]]]:
    """{map: {student layer: {teacher layer: [(step, weight), ...]}}} from metrics.jsonl."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            m = KEY.match(k)
            if m:
                out[m["map"]][int(m["s"])][int(m["t"])].append((int(rec["step"]), float(v)))
    return out


def plot_weights(name: str, weights: dict, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    students = sorted(weights)
    fig, axes = plt.subplots(1, len(students), figsize=(max(6.5, 4.2 * len(students)), 3.6), squeeze=False)
    for ax, s in zip(axes[0], students):
        for j, t in enumerate(sorted(weights[s])):
            steps, vals = zip(*sorted(weights[s][t]))
            ax.plot(steps, vals, label=f"v({s})[{j}] = teacher layer {t}")
        ax.set_title(f"student layer {s}")
        ax.set_xlabel("step")
        ax.set_ylabel("weight")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / f"{name}_weights.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def alp_rows(results: dict) -> list[tuple[int, list[int]]]:
    """Matched student layers and their buckets from results.json's layer table (transformer layers)."""
    rows = []
    for s, t in results.get("layer_pairs") or []:
        if int(s) > 0:
            rows.append((int(s), [int(x) for x in (t if isinstance(t, list) else [t])]))
    return rows


def uses_attention_map(config: dict) -> bool:
    mapping = config.get("mapping", {}).get("name")
    if mapping == "attention":
        return True
    if mapping != "uniform":
        return False
    return any(term.get("params", {}).get("mapping") == "attention"
               for stage in config.get("objective", {}).get("stages", []) for term in stage.get("losses", []))


def plot_alp(run_dir: Path, results: dict, out: Path, n_examples: int, seed: int) -> Path:
    import matplotlib.pyplot as plt
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModel, AutoTokenizer

    from kdrun.models.mapping import LayerMap, Row
    from kdrun.tasks.data.sources import load_task_data

    config = results["config"]
    rows = alp_rows(results)
    if not rows:
        raise SystemExit("results.json lists no matched student layers (layer_pairs)")
    task = OmegaConf.create(config["task"])
    dev = load_task_data(task, seed=int(config.get("train", {}).get("seed", 42)))[task.eval_splits[0]]
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(dev), generator=g)[:n_examples].tolist()
    texts_a = [dev[i]["text_a"] for i in idx]
    texts_b = [dev[i]["text_b"] for i in idx] if "text_b" in dev.column_names else None
    tok = AutoTokenizer.from_pretrained(run_dir / "student")
    enc = tok(texts_a, texts_b, return_tensors="pt", padding=True, truncation=True,
              max_length=int(task.max_seq_length))
    student = AutoModel.from_pretrained(run_dir / "student").eval()
    teacher = AutoModel.from_pretrained(results["teacher"]["path"]).eval()
    temperature = (config.get("mapping", {}).get("params") or {}).get("temperature", 1.0)
    alp = LayerMap("attention", [Row(s, tuple(b)) for s, b in rows], temperature=temperature)
    with torch.no_grad():
        hs = student(**enc, output_hidden_states=True).hidden_states
        ht = teacher(**enc, output_hidden_states=True).hidden_states
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 0.45 * n_examples + 1.8), squeeze=False)
    for ax, (s, bucket) in zip(axes[0], rows):
        cls_t = torch.stack([ht[t][:, 0].float() for t in bucket], dim=1)  # (N, k, d)
        alpha = alp.attention_weights(hs[s][:, 0].float(), cls_t)
        im = ax.imshow(alpha.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(bucket)), [f"$h_T^{{{t}}}$" for t in bucket])
        ax.set_yticks(range(len(idx)), [f"Example-{i + 1}" for i in range(len(idx))], fontsize=7)
        ax.set_title(f"student layer {s}: α over teacher layers")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"ALP-KD attention weights, {len(idx)} random {task.name} dev examples", fontsize=10)
    fig.tight_layout()
    path = out / "alp_attention.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    ap = harness.parser(__doc__)
    ap.add_argument("run_dir", type=Path, help="a run directory (holds metrics.jsonl, results.json, student/)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: the run directory)")
    ap.add_argument("--examples", type=int, default=10, help="dev examples in the ALP picture")
    ap.add_argument("--seed", type=int, default=0, help="seed choosing the ALP picture's examples")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")

    run_dir = args.run_dir
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        sys.exit(f"{metrics} not found: give a kdrun run directory")
    out = args.out or run_dir
    out.mkdir(parents=True, exist_ok=True)
    results_path = run_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    written = []
    for name, weights in read_weights(metrics).items():
        what = "ALP attention (batch mean)" if "attention" in name or \
            results.get("config", {}).get("mapping", {}).get("name") == "attention" else "learnable map softmax(θ)"
        written.append(plot_weights(name, weights, out, f"{what} weights over training steps — {run_dir.name}"))
    if results and uses_attention_map(results.get("config", {})):
        written.append(plot_alp(run_dir, results, out, args.examples, args.seed))
    if not written:
        sys.exit(f"{metrics} holds no layer-map weights (objective/map*/s<j>/t<k>): run with mapping=learnable "
                 "or an ALP-KD objective")
    for p in written:
        print(f"wrote {p}")
    return written


if __name__ == "__main__":
    main()
