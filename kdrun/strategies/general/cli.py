"""``kdrun-general probe``: fine-tune general students on GLUE tasks next to a random-init twin.

    kdrun-general probe RUN_OR_STUDENT_DIR [...] --tasks sst2,mrpc --seeds 1,2,3 \\
        --glue-dir /path/to/glue --out probe/ [kdrun overrides, e.g. train.lr=1e-4]

For every student directory (a corpus run's directory or its ``student/``) and task, one
``kdrun -m`` sweep over the seeds fine-tunes it (``objective=finetune``: cross-entropy on the gold
labels, no teacher) as ``student=pretrained``; the same sweep runs for a randomly initialised student
of the same shape (family, layers, width, heads, FFN; read from the first student's config.json)
unless ``--no-random``. The table (mean ± std over seeds of each task's main dev metric) is printed
and written to ``<out>/probe.md`` and ``probe.json``. Reruns skip finished jobs (kdrun resumes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from kdrun.errors import UserError

GLUE_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "mnli": "MNLI",
             "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}
RANDOM_LABEL = "random-init"


def student_dir(path: str) -> Path:
    """The saved student of a corpus run directory, or the model directory itself."""
    p = Path(path).expanduser()
    for cand in (p / "student", p):
        if (cand / "config.json").is_file():
            return cand.resolve()
    raise UserError(f"{path}: no saved model here (no config.json in it or in its student/); give a corpus run's "
                    "directory or a directory written by save_pretrained")


def label_of(path: str, model: Path) -> str:
    """A short name for reports: the corpus run's objective, else the directory's name."""
    res = model.parent / "results.json"
    if model.name == "student" and res.is_file():
        return f"{json.loads(res.read_text()).get('objective', model.parent.name)}"
    return Path(path).name


def random_twin(model: Path) -> list[str]:
    """Overrides for a randomly initialised student of ``model``'s shape and vocabulary."""
    cfg = json.loads((model / "config.json").read_text())
    if cfg.get("model_type") != "bert":
        raise UserError(f"{model}: the random-init twin is built for BERT students; this one is "
                        f"'{cfg.get('model_type')}' (use --no-random)")
    return ["student=general_L4_H256", f"student.name={RANDOM_LABEL}", "student.kind=random",
            f"student.num_hidden_layers={cfg['num_hidden_layers']}", f"student.hidden_size={cfg['hidden_size']}",
            f"student.num_attention_heads={cfg['num_attention_heads']}",
            f"student.intermediate_size={cfg['intermediate_size']}", f"student.tokenizer={model}"]


def sweep_command(task: str, student: list[str], seeds: str, out: Path, glue_dir: str | None,
                  overrides: list[str]) -> list[str]:
    data = [f"task.data_dir={Path(glue_dir) / GLUE_DIRS.get(task, task)}"] if glue_dir else []
    return [sys.executable, "-m", "kdrun", "-m", f"task={task}", *data, "objective=finetune", "logger=none",
            *student, f"seed={seeds}", f"hydra.sweep.dir={out}", *overrides]


def summarise(out: Path) -> dict[str, dict[str, Any]]:
    """{student: {task: {metric, mean, std, n, values}}} over the finished runs under ``out``."""
    table: dict[str, dict[str, Any]] = {}
    for res_path in sorted(out.rglob("results.json")):
        if "checkpoints" in res_path.parts:
            continue
        res = json.loads(res_path.read_text())
        metric = res["config"]["task"]["main_metric"]
        value = float(next(iter(res["student"]["metrics"].values()))[metric])
        cell = table.setdefault(res["student"]["name"], {}).setdefault(res["task"], {"metric": metric, "values": []})
        cell["values"].append(value)
    for row in table.values():
        for cell in row.values():
            v = cell["values"]
            cell.update(n=len(v), mean=statistics.fmean(v), std=statistics.stdev(v) if len(v) > 1 else 0.0)
    return table


def render(table: dict[str, dict[str, Any]]) -> str:
    tasks = sorted({t for row in table.values() for t in row})
    head = "| student | " + " | ".join(f"{t} ({next(r[t]['metric'] for r in table.values() if t in r)})"
                                       for t in tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 1)]
    for name, row in table.items():
        cells = [f"{row[t]['mean']:.4f} ± {row[t]['std']:.4f} (n={row[t]['n']})" if t in row else "–" for t in tasks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kdrun-general", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="fine-tune general students on GLUE tasks next to a random-init student")
    p.add_argument("students", nargs="+", help="corpus run directories or saved model directories; then kdrun "
                   "overrides (key=value) applied to every run")
    p.add_argument("--tasks", default="sst2,mrpc")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--glue-dir", default=None, help="directory with the GLUE task folders (SST-2, MRPC, ...)")
    p.add_argument("--out", default="probe")
    p.add_argument("--no-random", action="store_true", help="skip the random-init student")
    args, rest = ap.parse_known_args(argv)
    unknown = [s for s in rest if "=" not in s or s.startswith("-")]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    overrides = [s for s in args.students if "=" in s] + rest
    paths = [s for s in args.students if "=" not in s]
    out = Path(args.out).resolve()
    try:
        models = [(label_of(s, m), m) for s, m in ((s, student_dir(s)) for s in paths)]
        students = [(name, ["student=pretrained", f"student.name={name}", f"student.name_or_path={m}"])
                    for name, m in models]
        if not args.no_random:
            students.append((RANDOM_LABEL, random_twin(models[0][1])))
    except UserError as e:
        sys.exit(f"kdrun-general: error: {e}")
    failed = []
    for task in args.tasks.split(","):
        for name, student in students:
            cmd = sweep_command(task, student, args.seeds, out / task / name, args.glue_dir, overrides)
            print(f"[kdrun-general] {task} / {name}: {' '.join(cmd[2:])}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                failed.append(f"{task}/{name}")
    _write_report(out, failed)
    if failed:
        sys.exit(f"kdrun-general: error: sweeps failed: {', '.join(failed)} (see their cli.log / error.json)")


def _write_report(out: Path, failed: list[str]) -> None:
    from kdrun.runtime.cache import atomic_file

    table = summarise(out)
    text = render(table)
    with atomic_file(out / "probe.md") as f:
        f.write(text)
    with atomic_file(out / "probe.json") as f:
        json.dump(table, f, indent=2)
    print("\n" + text + f"\n(written to {out / 'probe.md'})")


if __name__ == "__main__":
    main()
