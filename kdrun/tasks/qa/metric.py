"""SQuAD v1.1 exact match and F1, offline (the hub's ``squad`` metric needs the network).

The official v1.1 evaluation (Rajpurkar et al. 2016): answers are normalised (lower case,
punctuation removed, the articles a / an / the removed, whitespace collapsed); exact match is
equality of the normalised strings, F1 the harmonic mean of precision and recall of their
bag-of-tokens overlap; each question scores the maximum over its gold answers, and a split the
mean over its questions, times 100.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Mapping, Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the official v1.1 order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the normalised token bags (0 when they share no token, as in the v1.1 script)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """``{"exact_match", "f1"}`` ×100 over the questions of ``references`` (id -> gold answer texts);
    a question without a prediction scores 0, as in the official script."""
    if not references:
        raise ValueError("no questions to score")
    em = f1 = 0.0
    for qid, golds in references.items():
        if not golds:
            raise ValueError(f"question {qid!r} has no gold answer")
        pred = predictions.get(qid)
        if pred is None:
            continue
        em += max(exact_match(pred, g) for g in golds)
        f1 += max(token_f1(pred, g) for g in golds)
    return {"exact_match": 100.0 * em / len(references), "f1": 100.0 * f1 / len(references)}


def qa_metric_fn(windows: Any, n_best: int, max_answer_length: int):
    """``(logits, labels) -> {"exact_match", "f1"}`` for one eval split's windows, as fractions (kdrun
    stores every metric in [0, 1]; ``kdrun-report`` and the papers show ×100). ``logits`` are the
    windows' (W, n, 2) start / end logits in window order."""
    from kdrun.tasks.qa.postprocess import WindowIndex, predict_answers

    index: list[WindowIndex] = []  # built on first use, reused by every evaluation of the run

    def compute(logits: Any, labels: Any = None) -> dict[str, float]:
        if not index:
            index.append(WindowIndex.from_windows(windows))
        ix = index[0]
        answers = predict_answers(logits, ix, n_best, max_answer_length)
        scores = squad_scores(answers, ix.references)
        return {k: v / 100.0 for k, v in scores.items()}

    return compute
