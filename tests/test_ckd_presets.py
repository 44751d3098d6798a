"""The CKD presets (experiment=ckd_<task>) train as the authors' GLUE code does (Park, Kim & Yang,
2021): per-task dev-evaluation interval, their selection metric (Spearman on STS-B, accuracy on
QQP, matched + mismatched accuracy on MNLI), a student kept only with a score above 0, random
batches and fp32; objective=ckd (eq. 6) has their locality windows. The two selection keys
(task.selection_splits, task.selection_threshold) are checked on hand-made evaluation results."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kdrun.engine import trainer as TR
from kdrun.engine.checkpoints import TrainState
from kdrun.errors import ConfigError
from tests.conftest import REPO, compose

MNLI_SUM = ["validation_matched", "validation_mismatched"]
# task: (dev evaluation every N steps, selection metric, selection splits) of the authors' code
AUTHORS = {
    "cola": (100, "matthews_correlation", None),
    "stsb": (100, "spearmanr", None),
    "sst2": (500, "accuracy", None),
    "mrpc": (500, "f1", None),
    "rte": (500, "accuracy", None),
    "qnli": (2000, "accuracy", None),
    "mnli": (2000, "accuracy", MNLI_SUM),
    "qqp": (2000, "accuracy", None),
}


def test_every_ckd_preset_is_listed() -> None:
    on_disk = {p.stem.removeprefix("ckd_") for p in (REPO / "conf" / "experiment").glob("ckd_*.yaml")}
    assert on_disk == set(AUTHORS)


@pytest.mark.parametrize("task", sorted(AUTHORS))
def test_preset_composes_with_the_authors_training_loop(task: str) -> None:
    from kdrun.engine.objective import plan_stages

    cfg = compose([f"experiment=ckd_{task}"])
    every, metric, splits = AUTHORS[task]
    (plan,) = plan_stages(cfg.objective)
    assert plan.cfg["eval_every_steps"] == every
    assert cfg.task.main_metric == metric
    assert (None if cfg.task.selection_splits is None else list(cfg.task.selection_splits)) == splits
    assert set(splits or []) <= set(cfg.task.eval_splits)
    assert cfg.task.selection_threshold == 0.0  # their best score starts at 0
    assert cfg.train.group_by_length is False and cfg.teacher.finetune.group_by_length is False
    assert cfg.train.precision == "fp32"
    assert cfg.task.teacher_max_train_samples == "same" and cfg.task.max_train_samples is None  # full data
    assert plan.cfg["batch_size"] == 32
    text = (REPO / "conf" / "experiment" / f"ckd_{task}.yaml").read_text()
    assert "base/ckd_official_glue" in text  # the settings common to the presets live in one file
    text += (REPO / "conf" / "experiment" / "base" / "ckd_official_glue.yaml").read_text()
    assert "Inferred" in text and "LTR weights 1" in text and "batch size 32" in text


def test_selection_keys_are_off_by_default() -> None:
    for task in ("mnli", "cola", "stsb", "qqp"):
        cfg = compose([f"task={task}"])
        assert cfg.task.selection_splits is None and cfg.task.selection_threshold is None
    assert compose(["task=stsb"]).task.main_metric == "pearson"
    assert compose(["task=qqp"]).task.main_metric == "f1"
    assert compose(["objective=ckd_official"]).objective.params.eval_every_steps == 500


def test_eq6_objective_has_the_authors_windows() -> None:
    for objective in ("ckd", "ckd_two_stage"):
        params = compose([f"objective={objective}"]).objective.params
        assert params.window_pair is None and params.window_angle == 10


# --------------------------------------------------------------------- selection on hand-made results


def _parts(main_metric: str, splits=None, threshold=None) -> SimpleNamespace:
    return SimpleNamespace(main_metric=main_metric, selection_splits=splits, selection_threshold=threshold,
                           student=SimpleNamespace(train=lambda: None),
                           tracker=SimpleNamespace(log=lambda *a, **k: None))


def test_main_score_default_is_the_first_split() -> None:
    results = {"validation_matched": {"accuracy": 0.8}, "validation_mismatched": {"accuracy": 0.7}}
    assert TR.main_score(_parts("accuracy"), results) == pytest.approx(0.8)
    assert TR.main_score(_parts("accuracy", MNLI_SUM), results) == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="selection_splits"):
        TR.main_score(_parts("accuracy", ["test"]), results)
    loss = {"validation": {"distill_loss": 2.0}, "other": {"distill_loss": 1.0}}
    assert TR.main_score(_parts("distill_loss", ["validation", "other"]), loss) == pytest.approx(-3.0)


def _select(monkeypatch, parts: SimpleNamespace, evals: list[dict]) -> tuple[TrainState, list[int]]:
    """Run evaluate_stage once per hand-made result; returns the state and the steps kept."""
    it = iter(evals)
    kept: list[int] = []
    monkeypatch.setattr(TR, "evaluate", lambda parts, model, stage=None: next(it))
    monkeypatch.setattr(TR, "save_best", lambda parts, state: kept.append(state.global_step))
    state, plan = TrainState(), SimpleNamespace(index=0, name="ckd", cfg={})
    for step in range(1, len(evals) + 1):
        state.global_step = state.stage_step = step * 100
        TR.evaluate_stage(parts, plan, state, "steps")
    return state, kept


def test_mnli_selects_on_the_matched_plus_mismatched_sum(monkeypatch) -> None:
    evals = [{"validation_matched": {"accuracy": m}, "validation_mismatched": {"accuracy": mm}}
             for m, mm in [(0.80, 0.70), (0.78, 0.75), (0.79, 0.73)]]
    state, kept = _select(monkeypatch, _parts("accuracy", MNLI_SUM, 0.0), evals)
    assert kept == [100, 200]  # 1.53 at step 200 beats 1.50 although its matched accuracy is lower
    assert state.best_metric == pytest.approx(1.53) and state.best_step == 200
    _, first_only = _select(monkeypatch, _parts("accuracy"), evals)
    assert first_only == [100]  # kdrun's default: the matched accuracy alone


def test_cola_keeps_a_student_only_above_mcc_zero(monkeypatch) -> None:
    mcc = [0.0, -0.05, 0.12, 0.08, 0.2]
    evals = [{"validation": {"matthews_correlation": v, "accuracy": 0.7}} for v in mcc]
    state, kept = _select(monkeypatch, _parts("matthews_correlation", None, 0.0), evals)
    assert kept == [300, 500] and state.best_metric == pytest.approx(0.2)
    _, unfloored = _select(monkeypatch, _parts("matthews_correlation"), evals)
    assert unfloored == [100, 300, 500]  # without the floor the majority-class student (MCC 0) is kept first
    majority = [{"validation": {"matthews_correlation": 0.0, "accuracy": 0.69}}] * 3
    state, kept = _select(monkeypatch, _parts("matthews_correlation", None, 0.0), majority)
    assert kept == [] and state.best_metric is None  # none kept: the run ends with its last student
    assert len(state.evals) == 3  # every evaluation is still recorded


def test_the_floor_of_a_loss_is_an_upper_bound(monkeypatch) -> None:
    evals = [{"validation": {"distill_loss": v}} for v in (3.0, 1.5, 0.9)]
    _, kept = _select(monkeypatch, _parts("distill_loss", None, 1.0), evals)
    assert kept == [300]  # only the loss below 1.0


def test_run_passes_the_selection_keys_to_the_trainer(tmp_path: Path) -> None:
    """A tiny real run with both keys: the kept student's selection value is the floor-passing sum."""
    from kdrun.app.run import run
    from tests.conftest import TINY, TOY

    res = run(compose([*TINY, *TOY, f"cache_dir={tmp_path / 'cache'}", "objective=finetune", "train.epochs=3",
                       "task.eval_splits=[validation,heldout]", "task.selection_splits=[validation,heldout]",
                       "task.selection_threshold=0.0"]), tmp_path / "run")
    sums = [e["metrics"]["validation"]["accuracy"] + e["metrics"]["heldout"]["accuracy"] for e in res["evals"]]
    assert len(sums) == 3 and res["student"]["selected"]["value"] == pytest.approx(max(sums))
    assert res["student"]["selected"]["step"] == res["evals"][sums.index(max(sums))]["step"]
