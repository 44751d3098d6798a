"""scripts/reproduce_glue.py end to end with tiny models on the real GLUE files: the grid, the
choice on dev, the seeds at the chosen setting, and the report with p-values and the figure."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import GLUE, TINY, load_script


@pytest.mark.skipif(not (GLUE / "MRPC").exists(), reason="../shared/data/glue is absent")
def test_grid_choice_seeds_and_report(tmp_path: Path) -> None:
    script = load_script("reproduce_glue")
    out = tmp_path / "study"
    extra = [*TINY, "task.max_eval_samples=64", f"cache_dir={tmp_path}/cache"]
    rc = script.main(["--glue", str(GLUE), "--out", str(out), "--tasks", "mrpc", "--objectives", "finetune,logit",
                      "--grid-lr", "1e-4,3e-3", "--seeds", "1,2", "--max-train-samples", "64", "--epochs", "1",
                      *(f"--extra={e}" for e in extra)])
    assert rc == 0
    chosen = json.loads((out / "chosen.json").read_text())["chosen"]["mrpc"]
    for obj in ("finetune", "logit"):
        grid = [json.loads(p.read_text()) for p in (out / "grid" / "mrpc" / obj).rglob("results.json")]
        assert sorted(r["config"]["train"]["lr"] for r in grid) == [1e-4, 3e-3]
        assert {r["config"]["seed"] for r in grid} == {0}
        f1 = {r["config"]["train"]["lr"]: r["student"]["metrics"]["validation"]["f1"] for r in grid}
        lr = chosen[obj]["setting"]["train.lr"]
        assert f1[lr] == max(f1.values()) == chosen[obj]["dev"]  # MRPC's main metric, F1
        assert chosen[obj]["grid"] == {str(k): v for k, v in f1.items()}
        seeds = [json.loads(p.read_text()) for p in (out / "seeds" / "mrpc" / obj).rglob("results.json")]
        assert sorted(r["config"]["seed"] for r in seeds) == [1, 2]
        assert {r["config"]["train"]["lr"] for r in seeds} == {lr}
    with open(out / "report" / "table.csv") as f:
        rows = {r["objective"]: r for r in csv.DictReader(f)}
    assert rows["logit"]["n_pairs"] == "2" and rows["logit"]["p_vs_finetune"] != ""
    assert (out / "report" / "objectives.png").read_bytes()[:4] == b"\x89PNG"


def _fake_run(job: Path, lr: float, lam: float, seed: int) -> None:
    job.mkdir(parents=True)
    cfg = {"seed": seed, "task": {"name": "mrpc", "main_metric": "f1"}, "train": {"lr": lr},
           "objective": {"params": {"lambda_ckd": lam}}}
    (job / "results.json").write_text(json.dumps({
        "task": "mrpc", "objective": "ckd", "student": {"name": "s", "metrics": {"validation": {"f1": 0.8}}},
        "config": cfg}))


def test_a_changed_choice_retires_the_other_settings_seed_runs(tmp_path: Path) -> None:
    script = load_script("reproduce_glue")
    seeds = tmp_path / "seeds" / "mrpc" / "ckd"
    for i, (lr, lam) in enumerate([(2e-4, 1.0), (2e-4, 1.0), (5e-4, 1.0), (2e-4, 0.1)]):
        _fake_run(seeds / f"job{i}", lr, lam, seed=i)
    script.retire_other_settings(seeds, {"train.lr": "2e-4", "objective.params.lambda_ckd": 1.0}, tmp_path / "stale")
    assert sorted(p.name for p in seeds.iterdir()) == ["job0", "job1"]
    assert sorted(p.name for p in (tmp_path / "stale").iterdir()) == ["job2", "job3"]


def test_chosen_json_keeps_earlier_invocations(tmp_path: Path) -> None:
    script = load_script("reproduce_glue")
    path = tmp_path / "chosen.json"
    first = script.parse_args(["--glue", "g", "--tasks", "mrpc,sst2"])
    path.write_text(json.dumps(script.merged_choices(path, {"mrpc": {"ckd": {"dev": 1}, "logit": {"dev": 2}},
                                                            "sst2": {"ckd": {"dev": 3}}}, first, 10.0)))
    again = script.parse_args(["--glue", "g", "--tasks", "mrpc", "--objectives", "ckd"])
    merged = script.merged_choices(path, {"mrpc": {"ckd": {"dev": 9}}}, again, 5.0)
    assert merged["chosen"] == {"mrpc": {"ckd": {"dev": 9}, "logit": {"dev": 2}}, "sst2": {"ckd": {"dev": 3}}}
    assert [i["wall_seconds_until_report"] for i in merged["invocations"]] == [10.0, 5.0]
