"""Compare DynaBERT runs: every (m_w, m_d) sub-network's dev metric vs parameters and vs FLOPs.

    python scripts/plots/dynabert.py dynabert=outputs/.../dynabert dynabert_ckd=outputs/.../dynabert_ckd \
        --out docs/figures/dynabert_mrpc.png [--metrics f1 accuracy] [--markdown]

Each argument is ``label=<run directory>`` (a finished run: its results.json has ``subnetworks``).
Writes the plot (Park et al. 2021's figure 3 layout) and prints one table with a column per run.
"""

from __future__ import annotations

import json
from pathlib import Path

from kdrun.runtime import harness
from kdrun.strategies.dynabert.results import plot_subnetworks


def load(specs: list[str]) -> dict[str, dict]:
    runs = {}
    for spec in specs:
        label, _, path = spec.partition("=")
        res = json.loads((Path(path) / "results.json").read_text())
        if "subnetworks" not in res:
            raise SystemExit(f"{path}: results.json has no 'subnetworks' (not an adaptive run)")
        runs[label] = res
    return runs


def table(runs: dict[str, dict], markdown: bool = False) -> str:
    """One row per (m_w, m_d): sizes, then each run's metrics on the first eval split."""
    first = next(iter(runs.values()))["subnetworks"]
    split = next(iter(first["rows"][0]["metrics"]))
    metrics = list(first["rows"][0]["metrics"][split])
    head = ["m_w", "m_d", "heads", "FFN", "layers", "params (M)", "GFLOPs"]
    head += [f"{label} {m}" for label in runs for m in metrics]
    rows = []
    for i, r in enumerate(first["rows"]):
        row = [f"{r['width']:g}", f"{r['depth']:g}", str(r["heads"]), str(r["ffn"]), str(r["layers"]),
               f"{r['params'] / 1e6:.1f}", f"{r['flops'] / 1e9:.2f}"]
        for res in runs.values():
            other = res["subnetworks"]["rows"][i]
            assert (other["width"], other["depth"]) == (r["width"], r["depth"])
            row += [f"{other['metrics'][split][m]:.4f}" for m in metrics]
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("runs", nargs="+", help="label=<run directory>")
    p.add_argument("--out", type=Path, default=Path("dynabert.png"))
    p.add_argument("--title", default=None)
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--metrics", nargs="*", default=None, help="metrics to plot (default: the main metric)")
    args = p.parse_args(argv)
    runs = load(args.runs)
    plot_subnetworks({k: v["subnetworks"] for k, v in runs.items()}, args.out, title=args.title, metrics=args.metrics)
    print(table(runs, args.markdown))
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
