"""kdrun-report on hand-written results.json files: the numbers in the table are checked against
values computed here, and jobs without results are listed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kdrun.report import main, report


def write_run(root: Path, name: str, task: str, objective: str, seed: int, value: float, metric: str = "accuracy",
              student: str = "bert_L4_H312", **cfg_extra) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / ".hydra").mkdir()
    config = {"seed": seed, "task": {"name": task, "main_metric": metric}, "objective": {"name": objective},
              "train": {"seed": seed, "lr": cfg_extra.pop("lr", 5e-5)}, "logger": {"group": name}, **cfg_extra}
    evals = [{"stage": "s", "step": s, "metrics": {"validation": {metric: value * s / 10}}} for s in (5, 10)]
    (d / "results.json").write_text(json.dumps({
        "task": task, "objective": objective, "config": config, "evals": evals,
        "student": {"name": student, "metrics": {"validation": {metric: value, "other": 0.0}}}}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "train/loss": 1.0 / s}) for s in (1, 2, 3))
                                     + '\n{"step": 4, "train/lo')  # a line cut by a kill is skipped
    return d


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "multirun" / "sweep-1"
    # ckd on rte: two learning rates x 3 seeds; the better mean (lr 2e-5) must be chosen.
    for i, (lr, seed, v) in enumerate([(5e-5, 1, 0.60), (5e-5, 2, 0.70), (5e-5, 3, 0.65),
                                       (2e-5, 1, 0.66), (2e-5, 2, 0.68), (2e-5, 3, 0.67)]):
        write_run(root, f"rte-ckd-{i}", "rte", "ckd", seed, v, lr=lr)
    # ckd on cola (mcc), one setting, two seeds
    write_run(root, "cola-ckd-a", "cola", "ckd", 1, 0.30, metric="matthews_correlation")
    write_run(root, "cola-ckd-b", "cola", "ckd", 2, 0.34, metric="matthews_correlation")
    # logit on rte only
    write_run(root, "rte-logit", "rte", "logit", 1, 0.62)
    # a failed and an interrupted job
    failed = root / "rte-pkd-x"
    (failed / ".hydra").mkdir(parents=True)
    (failed / "error.json").write_text(json.dumps({"type": "ConfigError", "message": "bad key objective.foo"}))
    cut = root / "rte-alp-y"
    (cut / ".hydra").mkdir(parents=True)
    (cut / "checkpoints" / "last").mkdir(parents=True)
    (cut / "checkpoints" / "last" / "state.json").write_text(json.dumps({"stage": 1, "global_step": 37}))
    return root


def test_table_values_choice_and_problems(sweep: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    rep = report([sweep.parent], out)
    cells = rep["cells"]
    rte = cells[("bert_L4_H312", "ckd")]["rte"]
    assert rte.setting == {"train.lr": 2e-5} and rte.n_settings == 2
    assert rte.mean == pytest.approx(0.67) and rte.std == pytest.approx(statistics.stdev([0.66, 0.68, 0.67]))
    assert [r.seed for r in rte.runs] == [1, 2, 3]
    assert rep["swept"][("bert_L4_H312", "ckd")] == ["train.lr"]
    printed = capsys.readouterr().out
    # columns in GLUE order, ×100, average over the row's tasks (marked when a task is missing)
    assert "| student | objective | cola (matthews_correlation) | rte (accuracy) | avg |" in printed
    assert "| bert_L4_H312 | ckd | 32.00 ± 2.83 | 67.00 ± 1.00 | 49.50 |" in printed
    assert "| bert_L4_H312 | logit | — | 62.00 | 62.00* |" in printed
    assert "train.lr=2e-05 (n=3 seeds [1,2,3], best of 2 settings)" in printed
    assert "[failed]" in printed and "bad key objective.foo" in printed
    assert "[incomplete]" in printed and "checkpoint at stage 1 step 37" in printed

    rows = (out / "table.csv").read_text().splitlines()
    assert len(rows) == 4  # header + ckd/cola + ckd/rte + logit/rte
    ckd_rte = next(r for r in rows if r.startswith("bert_L4_H312,ckd,rte"))
    assert ",0.670000,0.010000,3,1 2 3," in ckd_rte
    tex = (out / "table.tex").read_text()
    assert "67.00 $\\pm$ 1.00" in tex and "matthews\\_correlation" in tex and tex.startswith("\\begin{tabular}")
    names = {p.name for p in out.iterdir()}
    assert {"table.csv", "table.tex", "table.md", "seed_spread.png", "curves_rte.png", "curves_cola.png"} <= names
    assert any(n.startswith("sweep_rte-bert_L4_H312-ckd") for n in names)
    assert not any(n.endswith(".tmp") for n in names)


def test_two_swept_keys_give_a_heatmap_and_rows_split_by_key(tmp_path: Path) -> None:
    root = tmp_path / "m"
    i = 0
    for alpha in (0.5, 0.9):
        for t in (1, 4):
            for mapping in ("uniform", "learnable"):
                write_run(root, f"r{i}", "sst2", "tinybert", 1, 0.8 + alpha / 10 + t / 100,
                          objective_params={"alpha": alpha, "t": t}, mapping={"name": mapping})
                i += 1
    rep = report([root], tmp_path / "out", row_keys=["mapping.name"])
    assert set(rep["cells"]) == {("bert_L4_H312", "tinybert", "mapping.name=uniform"),
                                 ("bert_L4_H312", "tinybert", "mapping.name=learnable")}
    cell = rep["cells"][("bert_L4_H312", "tinybert", "mapping.name=uniform")]["sst2"]
    assert cell.setting == {"objective_params.alpha": 0.9, "objective_params.t": 4}
    assert any(p.name.startswith("heatmap_sst2") for p in rep["files"])


def test_cli_errors_clearly_on_an_empty_path(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "empty")])
    assert e.value.code == 2
    assert "no results.json" in capsys.readouterr().err
