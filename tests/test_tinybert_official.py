"""objective=tinybert_official: every term reduces as TinyBERT's task-distillation code does, checked
against reductions computed by hand on a padded batch (and against kdrun's per-token tinybert)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kdrun.losses import LossContext, get_loss
from kdrun.losses.tinybert import attention_mse
from kdrun.models.features import Features
from kdrun.models.mapping import pairs_map
from tests.conftest import TINY, compose

# One batch of two rows, the second padded at position 1 (mask [[1, 1], [1, 0]]), width d = 1.
MASK = torch.tensor([[1, 1], [1, 0]])


def states(*layers: list[list[float]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(x, dtype=torch.float64)[..., None] for x in layers)


def features(hidden: tuple[torch.Tensor, ...] = (), logits=((0.0, 0.0), (0.0, 0.0))) -> Features:
    return Features(logits=torch.tensor(logits, dtype=torch.float64), attention_mask=MASK, hidden_states=hidden)


def call(name: str, s: Features, t: Features, num_labels: int = 2, rows=(), **params) -> float:
    ctx = LossContext(num_labels=num_labels, layer_pairs=list(rows), layer_map=pairs_map(list(rows)))
    return get_loss(name).fn(s, t, None, ctx, **params).item()


# student layers 0 (embeddings) and 1; teacher layers 0, 1, 2 (student layer 1 <- teacher layer 2)
S = features(states([[1, 2], [3, 5]], [[0, 1], [1, 1]]))
T = features(states([[0, 0], [1, 0]], [[9, 9], [9, 9]], [[0, 0], [0, -1]]))


def test_embedding_and_hidden_mse_over_all_entries_padding_included() -> None:
    # embeddings: differences 1, 2 | 2, (5 at the padded position): squares 1, 4, 4, 25
    assert call("tinybert_embedding", S, T, projection="none", reduction="all") == pytest.approx(34 / 4)
    assert call("tinybert_embedding", S, T, projection="none", reduction="tokens") == pytest.approx(9 / 3)
    # layer 1 against teacher layer 2: differences 0, 1 | 1, (2 padded): squares 0, 1, 1, 4
    rows = [(0, 0), (1, 2)]
    assert call("tinybert_hidden", S, T, rows=rows, projection="none", reduction="all") == pytest.approx(6 / 4)
    assert call("tinybert_hidden", S, T, rows=rows, projection="none", reduction="tokens") == pytest.approx(2 / 3)


def test_attention_mse_zeroes_padded_keys_and_scores_below_minus_100_then_averages_all_entries() -> None:
    ss = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]], [[[1.0, -5000.0], [2.0, 7.0]]]])
    st = torch.tensor([[[[0.0, 0.0], [0.0, 0.0]]], [[[-150.0, 3.0], [0.0, 1.0]]]])
    # row 0: squares 1, 4, 9, 16. row 1: key 1 is padding (0 in both maps); the teacher's -150 is
    # zeroed (<= -100), so (0, 0) gives (1 - 0)^2; the padded query row 1 counts: (2 - 0)^2.
    assert attention_mse(ss, st, MASK, "tinybert").item() == pytest.approx((30 + 1 + 4) / 8)
    # kdrun's default: real (query, key) pairs only, nothing zeroed: 30 and (1 + 150)^2 over 5
    assert attention_mse(ss, st, MASK, "exclude").item() == pytest.approx((30 + 151**2) / 5)


def test_soft_ce_is_a_mean_over_batch_and_classes() -> None:
    s = features(logits=((0.0, 0.0), (math.log(3), 0.0)))
    t = features(logits=((math.log(3), 0.0), (0.0, 0.0)))
    # row 0: p_t = (3/4, 1/4), p_s = (1/2, 1/2): -sum p_t log p_s = log 2
    # row 1: p_t = (1/2, 1/2), p_s = (3/4, 1/4): -(log 3/4 + log 1/4) / 2
    rows = [math.log(2), -(math.log(0.75) + math.log(0.25)) / 2]
    assert call("tinybert_soft_ce", s, t, temperature=1.0) == pytest.approx(sum(rows) / 4)
    assert call("soft_ce", s, t, temperature=1.0) == pytest.approx(sum(rows) / 2)  # kdrun's: C times larger
    # at T = 2 the logits are halved first
    half = [(0.0, 0.0), (math.log(3) / 2, 0.0)], [(math.log(3) / 2, 0.0), (0.0, 0.0)]
    want = call("tinybert_soft_ce", features(logits=half[0]), features(logits=half[1]), temperature=1.0)
    assert call("tinybert_soft_ce", s, t, temperature=2.0) == pytest.approx(want)
    # regression: MSE of the outputs, as theirs
    rs, rt = features(logits=((1.0,), (2.0,))), features(logits=((0.0,), (0.0,)))
    assert call("tinybert_soft_ce", rs, rt, num_labels=1, temperature=1.0) == pytest.approx((1 + 4) / 2)


def test_the_objective_composes_with_the_official_reductions() -> None:
    cfg = compose(["objective=tinybert_official"])
    inter, pred = cfg.objective.stages
    terms = {t.name: (t.weight, dict(t.get("params") or {})) for t in inter.losses}
    assert terms["tinybert_embedding"] == (1.0, {"projection": "shared", "reduction": "all"})
    assert terms["tinybert_hidden"] == (1.0, {"projection": "shared", "reduction": "all"})
    assert terms["tinybert_attention"] == (1.0, {"loss": "mse", "padding": "tinybert"})
    assert [t.name for t in pred.losses] == ["tinybert_soft_ce"]
    assert (inter.epochs, inter.lr, pred.epochs, pred.lr, inter.batch_size) == (10, 5e-5, 3, 3e-5, 32)


def test_runs_end_to_end(tmp_path) -> None:
    from kdrun.app.run import run

    cfg = compose([*TINY, "task=toy", "task.toy.num_train=64", "task.toy.num_validation=32",
                   "objective=tinybert_official", "train.epochs=1", f"cache_dir={tmp_path / 'cache'}"])
    res = run(cfg, tmp_path / "run")
    assert [s["stage"] for s in res["stages"]] == ["intermediate", "prediction"]
    assert all(s["steps"] == 2 for s in res["stages"])  # 64 rows at batch 32, one epoch each
    assert 0.0 <= res["student"]["metrics"]["validation"]["accuracy"] <= 1.0


def test_store_keeps_tinybert_official_stages_live_and_tinybert_stored() -> None:
    """The store keeps real tokens only: a stage whose terms read the teacher at padded positions
    (the official reductions) runs the teacher live; kdrun's tinybert (real tokens only) can be stored."""
    from kdrun.engine.objective import plan_stages

    official = plan_stages(compose(["objective=tinybert_official"]).objective)
    ours = plan_stages(compose(["objective=tinybert"]).objective)
    assert official[0].teacher_reads_padding and not ours[0].teacher_reads_padding
    assert not official[1].teacher_reads_padding  # the prediction stage reads logits only


def test_regression_prediction_stage_takes_the_mse_to_the_gold_scores() -> None:
    """As the authors' task distillation on STS-B: MSE(student output, gold score), the teacher unread."""
    rs, rt = features(logits=((1.0,), (2.0,))), features(logits=((0.0,), (0.0,)))
    gold = {"labels": torch.tensor([3.0, 2.0], dtype=torch.float64)}
    ctx = LossContext(num_labels=1, layer_pairs=[], layer_map=pairs_map([]))
    spec = get_loss("tinybert_soft_ce")
    assert spec.fn(rs, rt, gold, ctx, temperature=1.0, regression_target="gold").item() == pytest.approx((4 + 0) / 2)
    assert spec.fn(rs, rt, gold, ctx, temperature=1.0).item() == pytest.approx((1 + 4) / 2)  # the teacher's
    cfg = compose(["task=stsb", "objective=tinybert_official"])
    (term,) = cfg.objective.stages[1].losses
    assert term.params.regression_target == "gold"  # the preset follows the authors


def test_preset_prediction_stage_reads_labels_only_for_regression() -> None:
    from kdrun.engine.objective import plan_stages

    stsb = plan_stages(compose(["task=stsb", "objective=tinybert_official"]).objective)
    assert stsb[1].label_terms(regression=True) == ["tinybert_soft_ce"]
    assert stsb[1].label_terms(regression=False) == []  # classification reads the teacher alone
    assert stsb[0].label_terms(regression=True) == []


def test_intermediate_stage_runs_at_a_constant_learning_rate(tmp_path) -> None:
    """The authors' intermediate stage: no warm-up, no decay (the prediction stage warms up and decays)."""
    from kdrun.app.run import run

    cfg = compose([*TINY, "task=toy", "task.toy.num_train=64", "task.toy.num_validation=32",
                   "objective=tinybert_official", "objective.params.intermediate_epochs=2",
                   "objective.params.prediction_epochs=2", f"cache_dir={tmp_path / 'cache'}",
                   "logger.log_every_steps=1"])
    run(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {stage: [r["train/lr"] for r in rows if r.get("stage") == stage and "train/lr" in r]
           for stage in ("intermediate", "prediction")}
    assert lrs["intermediate"] == [5e-5] * 4  # 2 epochs of 2 steps, every one at 5e-5
    assert lrs["prediction"][0] < 3e-5 and lrs["prediction"][-1] < lrs["prediction"][1]  # warm-up, then decay
