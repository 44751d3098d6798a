"""From start / end logits of windows to one answer text per question.

For every window: the ``n_best`` highest start and end logits among its context tokens, every
(start, end) pair of them scored start + end logit, pairs with end < start or longer than
``max_answer_length`` tokens ruled out — all as (W, k, k) tensors with broadcast masks, no Python
loop over pairs. For every question: the best-scoring pair over all its windows, mapped back to
the context through the tokens' character offsets. A question whose windows have no valid pair
gets the empty answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def best_window_spans(start: torch.Tensor, end: torch.Tensor, valid: torch.Tensor, n_best: int,
                      max_answer_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best (score, start, end) of each window.

    start, end: (W, n) logits; valid: (W, n) bool, the positions an answer may use (context tokens).
    Returns three (W,) tensors; a window without a valid pair has score -inf (start = end = 0).
    """
    w, n = start.shape
    k = min(n_best, n)
    neg = torch.tensor(float("-inf"), dtype=torch.float32, device=start.device)
    sv, si = torch.where(valid, start.float(), neg).topk(k, dim=1)  # (W, k)
    ev, ei = torch.where(valid, end.float(), neg).topk(k, dim=1)
    length = ei[:, None, :] - si[:, :, None]  # (W, k, k): end - start
    ok = (length >= 0) & (length < max_answer_length) & torch.isfinite(sv)[:, :, None] & torch.isfinite(ev)[:, None, :]
    score = torch.where(ok, sv[:, :, None] + ev[:, None, :], neg).view(w, k * k)
    best, at = score.max(dim=1)
    s = si.gather(1, (at // k)[:, None])[:, 0]
    e = ei.gather(1, (at % k)[:, None])[:, 0]
    found = torch.isfinite(best)
    return best, torch.where(found, s, 0), torch.where(found, e, 0)


@dataclass
class WindowIndex:
    """What post-processing needs of an eval split's windows, as arrays (built once per split)."""

    starts: np.ndarray  # (W, n) character start of each token; -1 outside the context / past the window
    ends: np.ndarray  # (W, n)
    example: np.ndarray  # (W,) position of the window's question in ``ids``
    ids: list[str]  # question ids, in split order
    contexts: list[str]  # per question
    references: dict[str, list[str]]  # question id -> gold answer texts

    @classmethod
    def from_windows(cls, windows: Any) -> WindowIndex:
        offsets = windows["offset_mapping"]
        n = max(len(o) for o in offsets)
        starts = np.full((len(offsets), n), -1, dtype=np.int64)
        ends = np.full((len(offsets), n), -1, dtype=np.int64)
        for i, o in enumerate(offsets):
            a = np.asarray(o, dtype=np.int64).reshape(-1, 2)
            starts[i, : len(a)], ends[i, : len(a)] = a[:, 0], a[:, 1]
        ids, contexts, refs, example = [], [], {}, []
        for ex_id, ctx, golds in zip(windows["example_id"], windows["context"], windows["answers"]):
            if ex_id not in refs:
                ids.append(ex_id)
                contexts.append(ctx)
                refs[ex_id] = list(golds)
            example.append(len(ids) - 1)
        return cls(starts, ends, np.asarray(example, dtype=np.int64), ids, contexts, refs)


def predict_answers(logits: Any, index: WindowIndex, n_best: int, max_answer_length: int) -> dict[str, str]:
    """Question id -> predicted answer text from the windows' (W, n', 2) logits (n' may be shorter
    or longer than the index's width; positions past a window's tokens are never chosen)."""
    z = torch.as_tensor(np.asarray(logits), dtype=torch.float32)
    w, n = index.starts.shape
    if z.shape[0] != w:
        raise ValueError(f"{z.shape[0]} windows of logits for {w} windows")
    width = min(n, z.shape[1])
    valid = torch.from_numpy(index.starts[:, :width] >= 0)
    score, s, e = best_window_spans(z[:, :width, 0], z[:, :width, 1], valid, n_best, max_answer_length)
    score, s, e = score.numpy(), s.numpy(), e.numpy()
    # best window per question: sort windows by (question, -score), take each question's first
    order = np.lexsort((-score, index.example))
    first = order[np.r_[True, index.example[order][1:] != index.example[order][:-1]]]
    answers = {qid: "" for qid in index.ids}
    for win in first.tolist():
        if np.isfinite(score[win]):
            ex = int(index.example[win])
            a, b = index.starts[win, s[win]], index.ends[win, e[win]]
            answers[index.ids[ex]] = index.contexts[ex][a:b]
    return answers
