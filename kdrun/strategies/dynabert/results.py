"""Every (m_w, m_d) sub-network of an adaptive run: dev metrics, parameters, FLOPs; table and plots.

``results.json["subnetworks"]`` holds ``rows`` (one per width x depth: the multipliers, kept heads /
FFN neurons / layers, ``params`` (embeddings included), ``params_no_embeddings``, ``flops`` per
example at ``flops_seq_len`` tokens (formula: :func:`kdrun.strategies.dynabert.subnet.count_flops`) and the
metrics of every eval split), the main metric's name, and the rewiring summary of phase 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdrun.strategies.dynabert.plan import adaptive_of
from kdrun.strategies.dynabert.subnet import FLOPS_SEQ_LEN, count_flops, count_params, kept_count, shape_of, subnetwork


def grid(plans: list[Any]) -> tuple[list[float], list[float]] | None:
    """(widths, depths) to report: the adaptive stages' widths and the depth phases' depths ([1.0]
    without one), largest first; None when no stage is adaptive."""
    widths: list[float] = []
    depths: list[float] = [1.0]
    found = False
    for plan in plans:
        a = adaptive_of(plan.cfg)
        if a is None:
            continue
        found = True
        widths += [float(w) for w in a["widths"]]
        if a["phase"] == "depth":
            depths += [float(d) for d in a["depths"]]
    if not found:
        return None
    return sorted(set(widths), reverse=True), sorted(set(depths), reverse=True)


def evaluate_subnetworks(parts, plans: list[Any]) -> dict[str, Any] | None:
    """Evaluate every sub-network of the trained student on the eval splits (None without adaptive stages)."""
    from kdrun.engine.evaluation import evaluate

    g = grid(plans)
    if g is None:
        return None
    student = parts.accelerator.unwrap_model(parts.student)
    shape = shape_of(student)
    rows = []
    for width in g[0]:
        for depth in g[1]:
            with subnetwork(student, width, depth) as sub:
                metrics = evaluate(parts, parts.student)
            rows.append({"width": width, "depth": depth, "heads": sub["heads"], "ffn": sub["ffn"],
                         "layers": len(sub["layers"]), "kept_layers": sub["layers"],
                         "params": count_params(shape, width, depth),
                         "params_no_embeddings": count_params(shape, width, depth, embeddings=False),
                         "flops": count_flops(shape, width, depth), "metrics": metrics})
    out: dict[str, Any] = {"main_metric": parts.main_metric, "flops_seq_len": FLOPS_SEQ_LEN,
                           "shape": shape.__dict__, "rows": rows}
    rew = parts.run_dir / "rewiring.json"
    if rew.exists():
        info = json.loads(rew.read_text())
        out["rewiring"] = {k: info[k] for k in ("importance_data", "rows", "seconds")}
    return out


def format_table(sub: dict[str, Any]) -> str:
    """The (m_w, m_d) table as text: one row per sub-network, its sizes and the first split's metrics."""
    rows = sub["rows"]
    split = next(iter(rows[0]["metrics"]))
    names = list(rows[0]["metrics"][split])
    head = ["m_w", "m_d", "heads", "ffn", "layers", "params (M)", "GFLOPs"] + [f"{split} {m}" for m in names]
    body = [[f"{r['width']:g}", f"{r['depth']:g}", str(r["heads"]), str(r["ffn"]), str(r["layers"]),
             f"{r['params'] / 1e6:.2f}", f"{r['flops'] / 1e9:.3f}"]
            + [f"{r['metrics'][split][m]:.4f}" for m in names] for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def plot_subnetworks(runs: dict[str, dict[str, Any]], out: Path, title: str | None = None,
                     split: str | None = None, metrics: list[str] | None = None) -> Path:
    """Dev metric vs parameters and vs FLOPs (Park et al. 2021's figure 3), one colour per run and
    one row of two panels per metric (default: the main metric).

    ``runs`` maps a label to a run's ``results.json["subnetworks"]``. Markers: every sub-network;
    line: the run's frontier (at each size, the best metric of the sub-networks no larger)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(runs.values()))
    metrics = metrics or [first["main_metric"]]
    fig, axes = plt.subplots(len(metrics), 2, figsize=(11, 4.2 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        for k, (label, sub) in enumerate(runs.items()):
            sp = split or next(iter(sub["rows"][0]["metrics"]))
            pts = [(r["params"] / 1e6, r["flops"] / 1e9, r["metrics"][sp][metric]) for r in sub["rows"]]
            color = f"C{k}"
            for ax, i in ((axes[row][0], 0), (axes[row][1], 1)):
                xs = sorted(pts, key=lambda p: (p[i], -p[2]))
                ax.scatter([p[i] for p in xs], [p[2] for p in xs], color=color, s=18, alpha=0.6)
                front, best = [], float("-inf")
                for p in xs:
                    if p[2] > best:
                        best = p[2]
                        front.append((p[i], best))
                front.append((xs[-1][i], best))  # the frontier runs on to the largest sub-network
                ax.step([f[0] for f in front], [f[1] for f in front], where="post", color=color, label=label)
        axes[row][0].set_xlabel("parameters (M, embeddings included)")
        axes[row][1].set_xlabel(f"GFLOPs per example ({FLOPS_SEQ_LEN} tokens)")
        for ax in axes[row]:
            ax.set_ylabel(f"dev {metric}")
            ax.grid(alpha=0.3)
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def report(sub: dict[str, Any], run_dir: Path) -> None:
    """Print the table and write ``subnetworks.png`` into the run directory."""
    print("\nDynaBERT sub-networks (m_w: width multiplier, m_d: depth multiplier):")
    print(format_table(sub))
    path = plot_subnetworks({run_dir.name: sub}, run_dir / "subnetworks.png")
    print(f"plot: {path}")


__all__ = ["grid", "evaluate_subnetworks", "format_table", "plot_subnetworks", "report", "kept_count"]
