"""DynaBERT (Hou et al., 2020) with any label-free kdrun objective, e.g. CKD (Park, Kim & Yang, 2021, EMNLP).

- :mod:`kdrun.strategies.dynabert.subnet`: width / depth sub-networks by slicing the shared weights; the depth
  rule; parameter and FLOPs counts.
- :mod:`kdrun.strategies.dynabert.rewire`: phase 1, head and neuron importance and rewiring.
- :mod:`kdrun.strategies.dynabert.strategy`: the stage strategy that owns a stage's ``adaptive`` key (its
  schema, checks, per-step loop, results and export), registered with kdrun's engine.
- :mod:`kdrun.strategies.dynabert.train`: phases 2 and 3 as stages of kdrun's trainer (a stage's ``adaptive`` key).
- :mod:`kdrun.strategies.dynabert.results`: every (m_w, m_d) sub-network's dev metric, parameters and FLOPs; plots.
- :mod:`kdrun.strategies.dynabert.export`: ``kdrun-export``, a sub-network as a smaller standard BERT.
"""
