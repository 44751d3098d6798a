"""The summary table a run prints (kdrun.app.run) from its results.json."""

from __future__ import annotations

from typing import Any


def print_summary(summary: dict[str, Any]) -> None:
    """The table a run prints at its end: teacher and student scores beside the constant-predictor
    baseline, the cost lines, where the teacher came from and the wall time."""
    from kdrun.tasks.baselines import describe, noise_warnings, split_values, table_cells

    base = summary.get("baseline")
    rows = [("model", "split", "metric", "value", "baseline", "SE")]
    for who in ("teacher", "student"):
        for split, metrics in (summary[who].get("metrics") or {}).items():
            for k, v in metrics.items():
                rows.append((who, split, k, f"{v:.4f}", *table_cells(base, split, k)))
    rows = rows if split_values(base) else [r[:4] for r in rows]  # corpus / QA: no baseline columns
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = "  ".join("-" * w for w in widths)
    print("\n" + "  ".join(c.ljust(w) for c, w in zip(rows[0], widths)))
    print(line)
    for r in rows[1:]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    for note in filter(None, [describe(base), *noise_warnings(summary)]):
        print(note)
    from kdrun.report.cost import cost_lines

    for line in cost_lines(summary.get("cost")):
        print(line)
    t = summary["timings"]
    teacher = summary["teacher"]
    if teacher.get("path") or teacher.get("source"):
        how = "cache hit" if teacher.get("cached") else teacher.get("source", "fine-tuned and cached")
        print(f"\nteacher: {how} ({teacher.get('path') or 'random'})")
    else:
        print("\nteacher: none (the objective uses no teacher)")
    print(f"wall time {t['total_s']:.1f}s (teacher {t['teacher_s']:.1f}s, distillation {t['stages_s']:.1f}s)")
