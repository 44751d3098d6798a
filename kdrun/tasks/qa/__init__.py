"""Extractive question answering (SQuAD v1.1) as a kind of task: ``task.kind=qa`` (``task=squad``).

What a QA task adds to the classification pipeline, each in its own module:

- :mod:`kdrun.tasks.qa.squad`: SQuAD v1.1 JSON (files, a directory, the hub), validated, optionally
  split by article (``task.split_by_article``);
- :mod:`kdrun.tasks.qa.windows`: question + context windows (context-only truncation with a document
  stride, offsets kept, answers outside a window labelled at [CLS]), cached by content hash;
- :mod:`kdrun.tasks.qa.answers`: MGSKD's word and phrase spans located in the windows;
- :mod:`kdrun.tasks.qa.postprocess`: the best answer span of an example over all its windows (n-best
  start / end candidates, maximum answer length; vectorised);
- :mod:`kdrun.tasks.qa.metric`: the official v1.1 exact match and F1;
- :mod:`kdrun.tasks.qa.kind`: the ``qa`` task kind that puts them together.

The model is the family's question-answering head (start / end logits over the window's tokens);
the features record carries them as ``logits`` of shape (B, n, 2), which the prediction-layer loss
terms (kdrun/losses/prediction.py) read as 2B distributions over the n positions. The
intermediate-layer terms see hidden states and attention masks as for any other task.
"""

from __future__ import annotations

QA_METRICS = ("exact_match", "f1")
