"""Task kinds as one seam: the registry, what each built-in kind answers, that no runner module names
a kind, and a new kind (token classification, tests/token_kind.py) run end to end through `kdrun`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kdrun.errors import ConfigError
from kdrun.runtime import forkrun
from kdrun.tasks.kinds import get_task_kind, kind_of, metric_sign, task_kinds
from tests.conftest import REPO, TINY, TOY, compose


def test_builtin_kinds_are_registered_with_their_answers() -> None:
    kinds = task_kinds()
    assert {"classification", "qa", "general"} <= set(kinds)
    assert kinds["qa"].head([], "student") == "qa" and kinds["classification"].head([], "teacher") == "classification"
    assert kinds["general"].fine_tunes_teacher is False and kinds["qa"].fine_tunes_teacher is True
    assert kinds["qa"].report_each_metric and not kinds["classification"].report_each_metric
    assert kinds["qa"].teacher_keyed == ("kind", "doc_stride", "max_answer_length", "n_best")
    assert kinds["general"].evaluator() is not None and kinds["classification"].evaluator() is None
    assert metric_sign("distill_loss") == -1.0 and metric_sign("accuracy") == 1.0 and metric_sign("f1") == 1.0


def test_kind_of_reads_typed_configs_and_plain_dicts() -> None:
    assert kind_of(compose(["task=squad"]).task).name == "qa"
    assert kind_of({"name": "x"}).name == "classification"
    assert kind_of({"name": "x", "kind": "general"}).name == "general"
    with pytest.raises(ConfigError, match=r"task.kind='nosuch' must be one of classification, general, qa"):
        get_task_kind("nosuch")


def test_metric_checks_belong_to_the_kind() -> None:
    task = compose(["task=stsb"]).task
    assert get_task_kind("classification").check_metrics(["pearson", "pearson"], task) == ["pearson"]
    with pytest.raises(ValueError, match="do not apply to a regression task"):
        get_task_kind("classification").check_metrics(["accuracy"], task)
    with pytest.raises(ValueError, match="question answering"):
        get_task_kind("qa").check_metrics(["accuracy"], task)
    with pytest.raises(ValueError, match="corpus task"):
        get_task_kind("general").check_metrics(["accuracy"], task)


def test_classification_metric_fn_scores_like_a_naive_count() -> None:
    task = compose(["task=sst2"]).task
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 1.0], [1.0, 0.0]])
    labels = np.array([1, 0, 0, 0])
    got = get_task_kind("classification").metric_fn(task, {})(logits, labels)
    assert got == {"accuracy": pytest.approx(3 / 4)}


# Modules that must not know which kinds exist (they ask the kind instead).
KIND_BLIND = ["kdrun/app/run.py", "kdrun/app/context.py", "kdrun/app/models.py", "kdrun/app/outputs.py",
              "kdrun/engine/trainer.py", "kdrun/engine/step.py", "kdrun/engine/evaluation.py",
              "kdrun/tasks/metrics/__init__.py",
              "kdrun/app/preflight.py", "kdrun/app/teacher.py", "kdrun/tasks/baselines.py", "kdrun/report/results.py",
              "kdrun/models/loading.py", "kdrun/tasks/data/sources.py"]


@pytest.mark.parametrize("path", KIND_BLIND)
def test_no_task_kind_branches(path: str) -> None:
    tree = ast.parse((REPO / path).read_text())
    names = {"qa", "general", "classification"}
    bad = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
           and any(isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators])]
    assert not bad, f"{path} compares with a task kind's name at lines {bad}; ask kdrun.tasks.kinds instead"


@pytest.mark.slow
def test_a_new_task_kind_runs_end_to_end(tmp_path: Path) -> None:
    """tests/token_kind.py: a token-classification kind + its head + two loss terms, outside kdrun."""
    cfg = compose([*TINY, *TOY, "task.kind=tokens", "task.imports=[tests.token_kind]"])
    assert kind_of(cfg.task).name == "tokens"
    stages = ("[{name: tags, epochs: 3, lr: 5e-3, batch_size: 16, losses: [{name: token_ce, weight: 0.5}, "
              "{name: token_kd, weight: 0.5}]}]")
    run_dir = tmp_path / "run"
    cmd = [*TINY, *TOY, "task.kind=tokens", "task.imports=[tests.token_kind]",
           "task.metrics=[token_accuracy]", "task.main_metric=token_accuracy", "task.max_seq_length=32",
           "objective=finetune", "objective.imports=[tests.token_kind]", f"objective.stages={stages}",
           "task.toy.num_train=800", "teacher.finetune.epochs=3", "teacher.finetune.lr=5e-3",
           "teacher.finetune.batch_size=16", "teacher.store=on",
           f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}"]
    out = forkrun.run(cmd, cwd=REPO, timeout=600)  # forked: kdrun.runtime.forkrun
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((run_dir / "results.json").read_text())
    teacher, student = res["teacher"]["metrics"]["validation"], res["student"]["metrics"]["validation"]
    # 85 % of the toy words are not sentiment words: both models learnt the tags, far above that
    assert teacher["token_accuracy"] > 0.95 and student["token_accuracy"] > 0.95, (teacher, student)
    assert res["baseline"] is None
    ce = stages.replace("token_ce", "ce")
    bad = forkrun.run([*(f"objective.stages={ce}" if a.startswith("objective.stages=") else a for a in cmd[:-1]),
                       f"hydra.run.dir={tmp_path / 'bad'}"], cwd=REPO, timeout=300)
    assert bad.returncode == 2
    assert "task.kind=tokens trains with ['token_ce', 'token_kd'] only, not ['ce']" in bad.stderr


def test_empty_task_imports_leave_run_identities_as_they_were() -> None:
    from kdrun.app.run import run_config_hash

    base = {"task": {"name": "x", "kind": "classification"}, "train": {"seed": 1}}
    assert run_config_hash({**base, "task": {**base["task"], "imports": []}}) == run_config_hash(base)
    assert run_config_hash({**base, "task": {**base["task"], "imports": ["m"]}}) != run_config_hash(base)


def test_preflight_returns_a_typed_plan_with_the_task_kind_resolved_once() -> None:
    """preflight's result is a RunPlan (attributes, not an untyped dict) holding the task kind, and the
    run's phases read the kind from it instead of looking it up again."""
    from kdrun.app.preflight import RunPlan, preflight
    from kdrun.tasks.kinds import kind_of

    cfg = compose(["experiment=quickstart", "logger=none"])
    plan = preflight(cfg)
    assert isinstance(plan, RunPlan) and plan.kind is kind_of(cfg.task)
    assert [p.name for p in plan.plans] == [s.name for s in cfg.objective.stages] and plan.uses_teacher
    for path in ("kdrun/app/run.py", "kdrun/app/context.py", "kdrun/app/models.py", "kdrun/app/outputs.py"):
        assert "kind_of(" not in (REPO / path).read_text(), path


def test_the_qa_kind_owns_its_per_token_logit_shape() -> None:
    """QA's (B, n, 2) logits: batches of different widths join padded with -inf to the widest (a
    padded position never wins an answer span); a batch's rows of the teacher's logit table are cut
    to its own width. A classification kind joins and looks up rows unchanged."""
    import torch

    from kdrun.engine.evaluation import LogitTable
    from kdrun.tasks.kinds import get_task_kind

    qa, cls = get_task_kind("qa"), get_task_kind("classification")
    a, b = torch.randn(2, 3, 2), torch.randn(1, 5, 2)
    joined = qa.join_logits([a, b])
    assert joined.shape == (3, 5, 2)
    assert torch.equal(joined[:2, :3], a) and torch.equal(joined[2:], b)
    assert torch.isinf(joined[:2, 3:]).all() and (joined[:2, 3:] < 0).all()
    flat = [torch.randn(2, 3), torch.randn(4, 3)]
    assert torch.equal(cls.join_logits(flat), torch.cat(flat))

    table = LogitTable(joined, torch.tensor([10, 11, 12]), fit=qa.batch_logits)
    batch = {"idx": torch.tensor([12, 10]), "attention_mask": torch.ones(2, 4)}
    assert torch.equal(table.for_batch(batch), torch.stack([b[0, :4], joined[0, :4]]))
    plain = LogitTable(torch.randn(3, 2), torch.tensor([10, 11, 12]))
    assert torch.equal(plain.for_batch(batch), plain[torch.tensor([12, 10])])


def test_former_names_of_the_general_kind_and_package_still_work_with_one_warning() -> None:
    """``task.kind=corpus`` and ``kdrun.strategies.task_agnostic`` are the general kind's and
    package's former names: they resolve to the same objects for one release and each warns once."""
    code = ("import kdrun.strategies.task_agnostic.kind as old, kdrun.strategies.general.kind as new, "
            "kdrun.strategies.task_agnostic.probe as probe, kdrun.strategies.general.cli as cli; "
            "from kdrun.tasks.kinds import get_task_kind, kind_of; "
            "assert old is new and probe is cli; "
            "assert get_task_kind('corpus') is get_task_kind('general'); "
            "assert kind_of({'name': 'x', 'kind': 'corpus'}).name == 'general'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines == [
        "kdrun: warning: the package kdrun.strategies.task_agnostic is deprecated and will be removed in the next "
        "release; use kdrun.strategies.general",
        "kdrun: warning: task.kind=corpus is deprecated and will be removed in the next release; use task.kind=general",
    ], lines
