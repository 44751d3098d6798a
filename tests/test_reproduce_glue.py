"""scripts/study/reproduce_glue.py end to end with tiny models on the real GLUE files: the grid, the
choice on dev, the seeds at the chosen setting, and the report with p-values and the figure; the
tasks it covers, its dry run, its default seeds, and the teacher fine-tuned on more rows than its
students (task.teacher_max_train_samples) and shared by them through the cache."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import GLUE, REPO, TINY, compose, load_script

STUDY = REPO / "scripts" / "study" / "reproduce_glue.py"


@pytest.mark.skipif(not (GLUE / "MRPC").exists(), reason="GLUE data absent ($KDRUN_DATA/glue)")
def test_grid_choice_seeds_and_report(tmp_path: Path) -> None:
    script = load_script("study/reproduce_glue")
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
    script = load_script("study/reproduce_glue")
    seeds = tmp_path / "seeds" / "mrpc" / "ckd"
    for i, (lr, lam) in enumerate([(2e-4, 1.0), (2e-4, 1.0), (5e-4, 1.0), (2e-4, 0.1)]):
        _fake_run(seeds / f"job{i}", lr, lam, seed=i)
    script.retire_other_settings(seeds, {"train.lr": "2e-4", "objective.params.lambda_ckd": 1.0}, tmp_path / "stale")
    assert sorted(p.name for p in seeds.iterdir()) == ["job0", "job1"]
    assert sorted(p.name for p in (tmp_path / "stale").iterdir()) == ["job2", "job3"]


def test_chosen_json_keeps_earlier_invocations(tmp_path: Path) -> None:
    script = load_script("study/reproduce_glue")
    path = tmp_path / "chosen.json"
    first = script.parse_args(["--glue", "g", "--tasks", "mrpc,sst2"])
    path.write_text(json.dumps(script.merged_choices(path, {"mrpc": {"ckd": {"dev": 1}, "logit": {"dev": 2}},
                                                            "sst2": {"ckd": {"dev": 3}}}, first, 10.0)))
    again = script.parse_args(["--glue", "g", "--tasks", "mrpc", "--objectives", "ckd"])
    merged = script.merged_choices(path, {"mrpc": {"ckd": {"dev": 9}}}, again, 5.0)
    assert merged["chosen"] == {"mrpc": {"ckd": {"dev": 9}, "logit": {"dev": 2}}, "sst2": {"ckd": {"dev": 3}}}
    assert [i["wall_seconds_until_report"] for i in merged["invocations"]] == [10.0, 5.0]


# ------------------------------------------------------------------ tasks, seeds and the teacher's rows


def test_covers_every_glue_task_kdrun_knows() -> None:
    import yaml

    script = load_script("study/reproduce_glue")
    glue = {p.stem for p in (REPO / "conf" / "task").glob("*.yaml")
            if "hub_config" in (yaml.safe_load(p.read_text()) or {})}
    assert set(script.GLUE_DIRS) == glue == {"cola", "sst2", "mrpc", "stsb", "rte", "qnli", "mnli", "qqp", "wnli"}
    assert script.parse_args(["--glue", "g"]).tasks.split(",") == list(script.GLUE_DIRS)
    for task in script.GLUE_DIRS:  # every task composes with the study's preset and its teacher option
        cfg = compose(["experiment=mini_glue", f"task={task}", "task.teacher_max_train_samples=all"])
        assert cfg.task.name == task and cfg.task.max_train_samples == 1000
    with pytest.raises(SystemExit):
        script.parse_args(["--glue", "g", "--tasks", "rte,squad"])


def test_default_seeds_allow_a_significant_sign_flip_test() -> None:
    from kdrun.report.significance import min_seeds_for_sign_flip, min_sign_flip_p

    args = load_script("study/reproduce_glue").parse_args(["--glue", "g"])
    n = len(args.seeds.split(","))
    assert n >= 5 and min_sign_flip_p(n) < 0.05 <= min_sign_flip_p(n - 1)  # 2/2^6 = 0.031, 2/2^5 = 0.0625
    assert n == min_seeds_for_sign_flip(0.05) == 6
    assert str(args.grid_seed) not in args.seeds.split(",")  # reported seeds are not the grid's


def test_dry_run_prints_the_chosen_tasks_commands(tmp_path: Path) -> None:
    """The acceptance command: python scripts/study/reproduce_glue.py --glue <dir> --tasks rte,qnli --dry-run."""
    out = subprocess.run([sys.executable, str(STUDY), "--glue", str(tmp_path / "glue"),
                          "--tasks", "rte,qnli", "--dry-run", "--out", str(tmp_path / "study")],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    cmds = [line[2:].split() for line in out.splitlines() if line.startswith("$ ")]
    runs = [c for c in cmds if c[:2] == ["kdrun", "-m"]]
    objectives = load_script("study/reproduce_glue").OBJECTIVES
    assert len(runs) == 2 * 2 * len(objectives)  # grid + seeds per task and objective
    for task, folder in (("rte", "RTE"), ("qnli", "QNLI")):
        mine = [c for c in runs if f"task={task}" in c]
        assert len(mine) == 2 * len(objectives)
        for c in mine:
            assert "experiment=mini_glue" in c and f"task.data_dir={tmp_path / 'glue' / folder}" in c
            assert "task.teacher_max_train_samples=all" in c  # --teacher-full is the default
        assert sum("seed=1,2,3,4,5,6" in c for c in mine) == len(objectives)
    assert not any(f"task={t}" in c for c in runs for t in ("cola", "sst2", "mrpc", "stsb", "mnli", "qqp", "wnli"))
    assert cmds[-1][0] == "kdrun-report"
    assert not (tmp_path / "study").exists()  # a dry run writes nothing


def test_teacher_options() -> None:
    script = load_script("study/reproduce_glue")
    rows = [script.common_overrides(script.parse_args(["--glue", "g", *opts]), "mrpc")
            for opts in ([], ["--no-teacher-full"], ["--teacher-max-train-samples", "3000"])]
    assert [[o for o in r if o.startswith("task.teacher_max_train_samples=")] for r in rows] == \
        [["task.teacher_max_train_samples=all"], ["task.teacher_max_train_samples=same"],
         ["task.teacher_max_train_samples=3000"]]


TEACHER_RUN = [*TINY, "task=toy", "task.toy.num_train=160", "task.toy.num_validation=32", "objective=logit",
               "train.epochs=1"]


def test_teacher_trains_on_more_rows_and_is_shared_across_subsamples(tmp_path: Path) -> None:
    """With task.teacher_max_train_samples=all the teacher fine-tunes on the whole toy split (160
    rows) while the students train on 40 and 80: one cached teacher serves both. The default
    (same) fine-tunes a teacher on the student's own 40 rows, under another key."""
    import math

    from kdrun.app.run import run

    def go(name: str, *extra: str) -> dict:
        return run(compose([*TEACHER_RUN, f"cache_dir={tmp_path / 'cache'}", *extra]), tmp_path / name)

    a = go("a", "task.max_train_samples=40", "task.teacher_max_train_samples=all")
    b = go("b", "task.max_train_samples=80", "task.teacher_max_train_samples=all")
    batch = compose([*TEACHER_RUN, "objective=logit"]).objective.stages[0].batch_size
    assert a["stages"][0]["steps"] == math.ceil(40 / batch) and b["stages"][0]["steps"] == math.ceil(80 / batch)
    assert a["teacher"]["train_rows"] == 160 > 40 and not a["teacher"]["cached"]
    assert b["teacher"]["cached"] and (b["teacher"]["key"], b["teacher"]["path"]) == (a["teacher"]["key"],
                                                                                      a["teacher"]["path"])
    same = go("c", "task.max_train_samples=40")
    assert same["teacher"]["train_rows"] == 40 and not same["teacher"]["cached"]
    assert same["teacher"]["key"] != a["teacher"]["key"]
    assert len([p for p in (tmp_path / "cache" / "teachers").iterdir() if p.is_dir()]) == 2


def test_teachers_rows_contain_the_students() -> None:
    from kdrun.app.teacher import teacher_train_data
    from kdrun.tasks.data.sources import load_task_data

    cfg = compose([*TEACHER_RUN, "task.max_train_samples=40", "task.teacher_max_train_samples=100"])
    student = load_task_data(cfg.task)["train"]["text_a"]
    _, rows = teacher_train_data(cfg, "unused", None, _tokenizer(cfg))
    assert len(rows()) == 100
    teacher_cfg = compose([*TEACHER_RUN, "task.max_train_samples=100"])
    teacher = load_task_data(teacher_cfg.task)["train"]["text_a"]
    assert set(student) <= set(teacher) and teacher[:40] == student  # the same seeded shuffle, longer


def _tokenizer(cfg):
    from kdrun.app.preflight import preflight
    from kdrun.models import loading as M

    refs = preflight(cfg).refs
    return M.load_tokenizer(next(refs[k] for k in ("teacher", "teacher_tokenizer", "student_tokenizer") if k in refs))


@pytest.mark.parametrize("value,expected", [("same", (False, None)), ("all", (True, None)), (None, (True, None)),
                                            (100, (True, 100)), (40, (False, 40))])
def test_teacher_train_limit(value, expected) -> None:
    from omegaconf import OmegaConf

    from kdrun.app.teacher import teacher_train_limit

    task = OmegaConf.create({"max_train_samples": 40, "teacher_max_train_samples": value})
    assert teacher_train_limit(task) == expected


@pytest.mark.parametrize("value", ["half", 0, -3, True])
def test_teacher_train_limit_refuses_bad_values(value) -> None:
    from omegaconf import OmegaConf

    from kdrun.app.teacher import teacher_train_limit
    from kdrun.errors import ConfigError

    with pytest.raises(ConfigError, match="teacher_max_train_samples"):
        teacher_train_limit(OmegaConf.create({"max_train_samples": None, "teacher_max_train_samples": value}))


# ------------------------------------------------------------------ the glue_cpu recipe


def test_glue_cpu_dry_run_prints_the_studys_commands(tmp_path: Path) -> None:
    """The study's one command: python scripts/study/reproduce_glue.py --glue <dir> --recipe glue_cpu --dry-run."""
    out = subprocess.run([sys.executable, str(STUDY), "--glue", str(tmp_path / "glue"),
                          "--recipe", "glue_cpu", "--dry-run"], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    cmds = [line[2:].split() for line in out.splitlines() if line.startswith("$ ")]
    runs = [c for c in cmds if c[:2] == ["kdrun", "-m"]]
    every = ["finetune", "logit", "pkd", "tinybert", "minilm", "ckd", "mgskd", "alp", "ckd_gradnorm"]
    want = {"sst2": every, "stsb": every, "mrpc": ["finetune", "logit"], "cola": ["finetune", "logit"]}
    for task, objectives in want.items():
        mine = [c for c in runs if f"task={task}" in c]
        got = [next(a.split("=")[1] for a in c if a.startswith("objective=")) for c in mine]
        assert got == [o for o in objectives for _ in range(2)]  # grid, then seeds
        rows = "16000" if task == "sst2" else "all"  # SST-2's teacher capped, the others on the whole split
        for c in mine:
            assert "experiment=glue_cpu" in c and f"task.teacher_max_train_samples={rows}" in c
            assert any(a.startswith("hydra.sweep.dir=outputs/glue_cpu/") for a in c)
        grids = [c for c in mine if "seed=0" in c]
        assert all("train.lr=1e-4,3e-4" in c for c in grids)
        assert {next(a.split("=")[1] for a in c if a.startswith("objective=")) for c in grids
                if "objective.params.lambda_ckd=0.01,0.1" in c} == {"ckd", "ckd_gradnorm"} & set(objectives)
        assert sum("seed=1,2,3,4,5,6" in c for c in mine) == len(objectives)
    assert len(runs) == 2 * sum(map(len, want.values()))
    assert cmds[-1][:2] == ["kdrun-report", "outputs/glue_cpu/seeds"]
    assert not (tmp_path / "outputs").exists()  # a dry run writes nothing


def test_glue_cpu_preset_composes_for_every_study_task() -> None:
    script = load_script("study/reproduce_glue")
    for task in script.RECIPES["glue_cpu"].tasks:
        cfg = compose(["experiment=glue_cpu", f"task={task}"])
        assert (cfg.task.max_seq_length, cfg.task.max_train_samples, cfg.task.teacher_max_train_samples) == \
            (128, 2000, "all")
        assert (cfg.student.name, cfg.student.num_layers, cfg.teacher.name, cfg.train.epochs) == \
            ("truncated", 3, "minilm_l6", 3)


def _criterion_run(job: Path, task: str, metric: str, teacher: float, value: float, seed: int) -> None:
    job.mkdir(parents=True)
    (job / "results.json").write_text(json.dumps({
        "task": task, "objective": "finetune", "teacher": {"metrics": {"validation": {metric: teacher}}},
        "student": {"name": "truncated", "metrics": {"validation": {metric: value}}},
        "baseline": {"kind": "majority", "validation": {metric: 0.812 if task == "mrpc" else 0.0}},
        "config": {"seed": seed, "task": {"name": task, "main_metric": metric}}}))


def test_criterion_compares_the_finetune_student_with_its_teacher(tmp_path: Path) -> None:
    script = load_script("study/reproduce_glue")
    runs = {"sst2": ("accuracy", 0.88, [0.80, 0.78]),          # 90 % of 0.88 = 0.792; mean 0.79: missed by 0.2
            "mrpc": ("f1", 0.88, [0.81, 0.82]),               # 0.792 met, but the constant F1 0.812 meets it too
            "stsb": ("pearson", 0.87, [0.72, 0.70]),          # >= 0.70: met
            "cola": ("matthews_correlation", 0.40, [0.02, 0.0])}  # mean 0.01, 2 SE = 0.02: not clearly > 0
    for task, (metric, teacher, values) in runs.items():
        for seed, v in enumerate(values, 1):
            _criterion_run(tmp_path / "seeds" / task / "finetune" / f"job{seed}", task, metric, teacher, v, seed)
    rows = {r["task"]: r for r in script.criterion_rows(tmp_path / "seeds")}
    assert rows["sst2"]["threshold"] == pytest.approx(0.792) and rows["sst2"]["met"] is False
    assert rows["sst2"]["teacher"] == pytest.approx(0.88) and rows["sst2"]["mean"] == pytest.approx(0.79)
    assert rows["mrpc"]["met"] is True and rows["stsb"]["met"] is True
    assert rows["cola"]["threshold"] == pytest.approx(0.02)  # 2 * std / sqrt(n), std = 0.02 / sqrt(2)
    assert rows["cola"]["met"] is False
    lines = "\n".join(script.criterion_lines(tmp_path / "seeds"))
    assert "sst2 accuracy | 88.00 | 79.00 ± 1.41 (2) | >= 90% of the teacher | 79.20 | missed by 0.20" in lines
    assert "mrpc f1 | 88.00 | 81.50" in lines and "constant predictor's 81.20 meets this threshold too" in lines
    assert "stsb pearson | 87.00 | 71.00 ± 1.41 (2) | >= 70 | 70.00 | met" in lines


@pytest.mark.skipif(not (GLUE / "MRPC").exists(), reason="GLUE data absent ($KDRUN_DATA/glue)")
def test_measure_lengths_on_mrpc() -> None:
    script = load_script("study/reproduce_glue")
    lines = script.length_lines(script.parse_args(["--glue", str(GLUE), "--recipe", "glue_cpu", "--tasks", "mrpc"]))
    assert "mrpc train 3668: 19.96%, 0.00%, 0.00% (103)" in lines  # all-MiniLM-L6-v2's WordPiece
    assert "mrpc validation 408: 19.85%, 0.00%, 0.00% (86)" in lines


def test_versus_logit_pairs_by_seed(tmp_path: Path) -> None:
    script = load_script("study/reproduce_glue")
    logit = [0.70, 0.71, 0.72, 0.73, 0.74, 0.75]
    for seed, v in enumerate(logit, 1):
        for obj, value in (("logit", v), ("ckd", v + 0.01 * seed), ("finetune", v - 0.01 if seed % 2 else v + 0.01)):
            job = tmp_path / "seeds" / "stsb" / obj / f"job{seed}"
            job.mkdir(parents=True)
            (job / "results.json").write_text(json.dumps({
                "task": "stsb", "objective": obj,
                "student": {"name": "s", "metrics": {"validation": {"pearson": value}}},
                "config": {"seed": seed, "task": {"name": "stsb", "main_metric": "pearson"}}}))
    lines = script.versus_logit_lines(tmp_path / "seeds")
    # ckd beats logit on all six seeds by 1..6 points (mean 3.5): the exact sign-flip floor 2/2^6
    assert "  stsb ckd | 6 | +3.50 | 0.0312 |" in "\n".join(lines)
    # finetune: -1, +1, -1, +1, -1, +1: mean 0, every sign assignment as extreme: p = 1
    assert "  stsb finetune | 6 | +0.00 | 1 |" in "\n".join(lines)
    assert not any(" logit |" in line for line in lines[1:])


def test_jobs_fine_tune_each_teacher_once_before_the_tasks_other_objectives(monkeypatch) -> None:
    """--jobs N: each task's first objective starts first; the task's other objectives wait until its
    grid (whose first run fine-tunes the teacher) has finished; every pipeline's choice comes back."""
    import threading
    import time

    script = load_script("study/reproduce_glue")
    args = script.parse_args(["--glue", "g", "--recipe", "glue_cpu", "--tasks", "sst2,mrpc", "--jobs", "3"])
    events, lock = [], threading.Lock()

    def fake(args, task, objective, out, after_grid=None):
        with lock:
            events.append(("start", task, objective))
        time.sleep(0.05)
        with lock:
            events.append(("grid", task, objective))
        if after_grid:
            after_grid()
        return {"setting": objective}

    monkeypatch.setattr(script, "run_objective", fake)
    chosen = script.run_all(args, Path("out"))
    for task in ("sst2", "mrpc"):
        objectives = script.objectives_for(args, task)
        assert chosen[task] == {o: {"setting": o} for o in objectives}
        first_grid = events.index(("grid", task, objectives[0]))
        assert all(events.index(("start", task, o)) > first_grid for o in objectives[1:])
    assert [e[1] for e in events[:2]] == ["sst2", "mrpc"] and {e[0] for e in events[:2]} == {"start"}


def test_runs_csv_has_one_row_per_finished_run(tmp_path: Path) -> None:
    script = load_script("study/reproduce_glue")
    for phase, seed, value in (("grid", 0, 0.70), ("seeds", 1, 0.72), ("seeds", 2, 0.74)):
        job = tmp_path / phase / "stsb" / "ckd" / f"job{seed}"
        job.mkdir(parents=True)
        (job / "results.json").write_text(json.dumps({
            "task": "stsb", "objective": "ckd", "device": "cuda", "precision": "bf16", "timings": {"total_s": 12.34},
            "teacher": {"metrics": {"validation": {"pearson": 0.869}}},
            "student": {"name": "s", "metrics": {"validation": {"pearson": value}}},
            "config": {"seed": seed, "train": {"lr": 3e-4}, "objective": {"params": {"lambda_ckd": 0.1}},
                       "task": {"name": "stsb", "main_metric": "pearson"}}}))
    rows = list(csv.DictReader(script.runs_csv(tmp_path).splitlines()))
    assert [(r["phase"], r["seed"], r["dev"]) for r in rows] == [("grid", "0", "70.00"), ("seeds", "1", "72.00"),
                                                                 ("seeds", "2", "74.00")]
    assert rows[0] | {} == {**rows[0], "teacher_dev": "86.90", "lr": "0.0003", "lambda_ckd": "0.1",
                            "device": "cuda", "precision": "bf16", "run_seconds": "12.3", "metric": "pearson"}
