"""Benchmark: QA post-processing, vectorised (kdrun.tasks.qa.postprocess) against a Python double loop.

Both pick, for every window, the best (start, end) pair among the n-best start and end candidates
of its context tokens (end >= start, at most max_answer_length tokens); the script checks that they
agree and prints the time of each and their ratio.

    python scripts/bench/qa_postprocess.py --windows 2000 --length 384
"""

from __future__ import annotations

import math
import time

import torch

from kdrun.runtime import harness
from kdrun.tasks.qa.postprocess import best_window_spans


def naive(start: list[float], end: list[float], valid: list[bool], n_best: int, max_len: int) -> tuple:
    def top(z: list[float]) -> list[int]:
        return sorted((i for i in range(len(z)) if valid[i]), key=lambda i: -z[i])[:n_best]

    best = (-math.inf, 0, 0)
    for i in top(start):
        for j in top(end):
            if i <= j < i + max_len and start[i] + end[j] > best[0]:
                best = (start[i] + end[j], i, j)
    return best


def main(argv: list[str] | None = None) -> float:
    ap = harness.parser(__doc__)
    ap.add_argument("--windows", type=int, default=2000)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--n-best", type=int, default=20)
    ap.add_argument("--max-answer-length", type=int, default=30)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    start = torch.randn(args.windows, args.length, generator=g)
    end = torch.randn(args.windows, args.length, generator=g)
    valid = torch.zeros(args.windows, args.length, dtype=torch.bool)
    valid[:, 20:-1] = True  # question and special tokens are not context
    t0 = time.perf_counter()
    score, s, e = best_window_spans(start, end, valid, args.n_best, args.max_answer_length)
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = [naive(a, b, v, args.n_best, args.max_answer_length)
           for a, b, v in zip(start.tolist(), end.tolist(), valid.tolist())]
    slow = time.perf_counter() - t0
    assert [(int(i), int(j)) for i, j in zip(s, e)] == [(i, j) for _, i, j in ref], "the two paths disagree"
    print(f"{args.windows} windows x {args.length} tokens, n_best {args.n_best}: vectorised {fast * 1e3:.1f} ms, "
          f"double loop {slow * 1e3:.1f} ms, ratio {slow / fast:.1f}x")
    return slow / fast


if __name__ == "__main__":
    main()
