"""The small harness the scripts under ``scripts/`` share: their command line (the docstring as
``--help``, a ``--fast`` mode for the tests), offline hub settings, where the real data lies,
timing (repeats with their median and interquartile range, contenders timed in alternating
rounds), a ratio line, JSON written atomically, and markdown tables."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from kdrun.runtime.cache import write_json_atomic

REPO = Path(__file__).resolve().parents[2]


def offline() -> None:
    """No hub or dataset downloads, no tokenizer threads (set unless the caller set them)."""
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def data_dir() -> Path:
    """The real data: ``$KDRUN_DATA``, else ``shared/data`` beside the repository."""
    return Path(os.environ.get("KDRUN_DATA") or REPO.parent / "shared" / "data")


def parser(doc: str | None, fast: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows the script's docstring (first paragraph as its
    description, the rest as its epilog); with ``fast``, a ``--fast`` flag with that help."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest or None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if fast:
        p.add_argument("--fast", action="store_true", help=fast)
    return p


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def alternating(contenders: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each contender, timed in ``rounds`` rounds whose order alternates (so a
    drift of the machine's speed falls on every contender alike), after ``warmup`` calls each."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(rounds):
        for name in (list(contenders) if r % 2 == 0 else list(reversed(contenders))):
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of ``xs`` (the quartiles equal the median for one value)."""
    if len(xs) < 2:
        return (xs[0],) * 3
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q2, q1, q3


def ratio_line(label: str, naive_s: float, fast_s: float, unit: str = "s") -> str:
    """``label: naive 1.20 s, kdrun 0.30 s, ratio 4.00x`` (the naive way measured in the same run)."""
    return f"{label}: naive {naive_s:.4g} {unit}, kdrun {fast_s:.4g} {unit}, ratio {naive_s / fast_s:.2f}x"


def write_json(path: Path | str, obj: Any) -> Path:
    """``obj`` as JSON at ``path`` (its folder made), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, obj)
    return path


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; floats with 4 significant digits."""
    def cell(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
