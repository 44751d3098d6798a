"""Draw a run's loss balance over training steps, to a PNG.

Reads the ``grad_share/<term>``, ``grad_cos/<term>`` and ``weighted/<term>`` values that a run
started with ``logger.grad_shares=true`` logs to metrics.jsonl (see README "Loss balance") and draws
three panels over optimizer steps, one line per loss term: its share of the summed per-term gradient
norms (the shares of a step add up to 1), the cosine between its gradient and the total gradient,
and its weighted value (log scale when all are positive). Dotted vertical lines mark where a new
stage starts.

    python scripts/plots/grad_shares.py <run dir> [--out grad_shares.png]

``--out`` defaults to ``<run dir>/grad_shares.png``; the file is replaced atomically.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kdrun.runtime import harness
from kdrun.runtime.cache import atomic_file

PANELS = (("grad_share", "gradient share"), ("grad_cos", "cos(term grad, total grad)"),
          ("weighted", "weighted value"))


def load_records(metrics: Path) -> list[dict]:
    """The records that carry gradient shares, one per step in step order (the last one logged
    for a step wins: a resumed run logs again the steps after its checkpoint)."""
    by_step: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if any(k.startswith("grad_share/") for k in rec):
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], prefix: str) -> dict[str, tuple[list[int], list[float]]]:
    """{term: (steps, values)} for the keys ``<prefix>/<term>``."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        for key, value in rec.items():
            if key.startswith(prefix + "/"):
                steps, values = out.setdefault(key[len(prefix) + 1:], ([], []))
                steps.append(int(rec["step"]))
                values.append(float(value))
    return out


def stage_starts(records: list[dict]) -> list[tuple[int, str]]:
    """(first logged step, stage name) of every stage after the first."""
    starts, last = [], None
    for rec in records:
        if rec.get("stage") != last and last is not None:
            starts.append((int(rec["step"]), str(rec.get("stage"))))
        last = rec.get("stage")
    return starts


def save_atomic(fig, out: Path) -> None:
    with atomic_file(out, "wb") as f:
        fig.savefig(f, dpi=110, format="png")


def plot(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 9), sharex=True)
    for ax, (prefix, label) in zip(axes, PANELS):
        lines = series(records, prefix)
        for term, (steps, values) in lines.items():
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=term)
        if prefix == "weighted" and all(v > 0 for _, vs in lines.values() for v in vs):
            ax.set_yscale("log")
        for step, name in stage_starts(records):
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
            if prefix == PANELS[0][0]:
                ax.annotate(name, (step, 1.0), xycoords=("data", "axes fraction"), fontsize=8, va="top")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_atomic(fig, out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    ap = harness.parser(__doc__)
    ap.add_argument("run_dir", type=Path, help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default: <run dir>/grad_shares.png)")
    args = ap.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    if not metrics.exists():
        sys.exit(f"{metrics} does not exist: is {args.run_dir} a run directory?")
    records = load_records(metrics)
    if not records:
        sys.exit(f"{metrics} holds no grad_share/* values: rerun with logger.grad_shares=true")
    out = args.out or args.run_dir / "grad_shares.png"
    plot(records, out, f"loss balance: {args.run_dir}")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
