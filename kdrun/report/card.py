"""The student's model card: a ``README.md`` with Hugging Face model-card metadata beside its weights.

Written from the run's results.json (the summary) alone, so every figure in it is one the run
measured: the base model (truncated from the teacher, a pretrained model, or a random config),
the teacher, the objective and its stages, the task and the rows used, the dev metrics with the
constant-predictor baseline, the cost figures (kdrun.report.cost) when measured, and the kdrun
version and exact command. The metadata block (``base_model``, ``datasets``, ``model-index`` with the
student's dev metrics) is built with huggingface_hub's ``ModelCardData``, so the hub's tools parse it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

# "corpus": the general kind's former name, in results.json of older runs.
PIPELINE_TAGS = {"classification": "text-classification", "qa": "question-answering", "general": "fill-mask",
                 "corpus": "fill-mask"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Licenses of the teachers kdrun names (their hub model cards), by hub id or hub-id prefix: a student
# distilled from a teacher is published under the teacher's license unless report.card.license says.
KNOWN_LICENSES = {"bert-base-uncased": "apache-2.0", "google/bert_uncased_L-": "apache-2.0",
                  "sentence-transformers/all-MiniLM-L6-v2": "apache-2.0"}
# Tasks whose rows are a hub dataset's, wherever they were read from (TSV files, JSON, the hub): the
# dataset as the hub names it, and its config.
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
HUB_DATASETS = {**{t: ("nyu-mll/glue", t) for t in GLUE_TASKS}, "squad": ("rajpurkar/squad", None)}


def hub_id(ref: str | None, fallback: str | None = None) -> str | None:
    """``ref`` when it names a Hugging Face hub model (``org/name`` or ``name``), the fallback hub id
    of a ``pkg:`` reference (the package ships that model), else None (a local directory)."""
    if not ref:
        return None
    if ref.startswith("pkg:"):
        return fallback
    if ref.startswith((".", "/", "~")) or Path(ref).expanduser().exists() or not HUB_ID.match(ref):
        return None
    return ref


def _model_ref(cfg: Mapping[str, Any]) -> str | None:
    return cfg.get("checkpoint") or cfg.get("name_or_path")


def _base_text(summary: Mapping[str, Any]) -> tuple[str, str | None]:
    """(how the student started, the hub id of the model its weights come from or None)."""
    cfg = summary.get("config") or {}
    sc, tc = cfg.get("student") or {}, cfg.get("teacher") or {}
    if sc.get("kind") == "truncated":
        if sc.get("source", "teacher") == "teacher":
            teacher_base = hub_id(tc.get("name_or_path"), tc.get("fallback_hub_id")) if tc.get("kind") != "random" \
                else None
            return (f"the embeddings and first {sc.get('num_layers')} layers (with the pooler and classifier) of "
                    f"the fine-tuned teacher `{tc.get('name')}`", teacher_base)
        src = sc.get("source")
        shown = _public_path(str(src), summary.get("run_dir")) if str(src).startswith(("/", "~")) else src
        return f"the embeddings and first {sc.get('num_layers')} layers of `{shown}`", hub_id(src)
    if sc.get("kind") == "random":
        return (f"randomly initialised ({sc.get('family', 'bert')}: {sc.get('num_hidden_layers')} layers, hidden "
                f"size {sc.get('hidden_size')}, {sc.get('num_attention_heads')} heads, FFN "
                f"{sc.get('intermediate_size')})", None)
    ref = sc.get("name_or_path")
    shown = _public_path(str(ref), summary.get("run_dir")) if str(ref).startswith(("/", "~")) else ref
    return f"the pretrained model `{shown}` (student `{sc.get('name')}`)", hub_id(ref, sc.get("fallback_hub_id"))


def _teacher_text(summary: Mapping[str, Any]) -> str:
    t = summary.get("teacher") or {}
    tc = (summary.get("config") or {}).get("teacher") or {}
    if not (t.get("path") or t.get("source") or t.get("metrics")):
        return "none (the objective uses no teacher)"
    info = t.get("info") or {}
    arch = (f"{info.get('family')}, {info.get('layers')} layers, hidden size {info.get('hidden')}, "
            f"{info.get('params_m')}M parameters" if info else "")
    ref = _model_ref(tc)
    hub = hub_id(ref, tc.get("fallback_hub_id"))
    shown = _public_path(str(ref), summary.get("run_dir")) if str(ref).startswith(("/", "~")) else ref
    start = "a random initialisation" if tc.get("kind") == "random" else \
        f"`{shown}`" + (f" (`{hub}`)" if hub and hub != ref else "")
    how = t.get("source") or (f"fine-tuned on the task from {start}"
                              + (f" ({t['train_rows']} training rows)" if t.get("train_rows") else ""))
    if t.get("source") == "teacher.checkpoint":
        how = f"loaded from teacher.checkpoint `{_public_path(str(t.get('path')), summary.get('run_dir'))}`"
    return f"`{t.get('name', tc.get('name'))}` ({arch}): {how}" if arch else f"`{t.get('name')}`: {how}"


def _stage_rows(summary: Mapping[str, Any]) -> list[str]:
    cfg = summary.get("config") or {}
    stages = (cfg.get("objective") or {}).get("stages") or []
    train = cfg.get("train") or {}
    steps = {s.get("stage"): s.get("steps") for s in summary.get("stages") or []}
    rows = ["| stage | loss terms (weight) | epochs | lr | data | optimizer steps |", "|---|---|---|---|---|---|"]
    for s in stages:
        terms = ", ".join(f"{t['name']} ({t.get('weight', 1.0):.3g})" for t in s.get("losses") or [])
        # train.epochs / train.lr, when set, replace every stage's own (kdrun.engine.objective.plan_stages)
        epochs = train.get("epochs") if train.get("epochs") is not None else s.get("epochs")
        lr = train.get("lr") if train.get("lr") is not None else s.get("lr")
        rows.append(f"| {s.get('name')} | {terms} | {epochs:g} | {lr:g} | "
                    f"{s.get('data', 'original')} | {steps.get(s.get('name'), '—')} |")
    return rows if stages else []


def hub_dataset(task: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(the hub dataset id, its config) of the task's rows, or (None, None) for other data."""
    if task.get("name") == "toy" or task.get("toy"):
        return None, None
    known = HUB_DATASETS.get(str(task.get("hub_config") or task.get("name")))
    if known:
        return known
    if task.get("data_dir") or task.get("data_files"):
        return None, None
    return task.get("hub_dataset"), task.get("hub_config")


def _data_text(summary: Mapping[str, Any]) -> tuple[str, str | None]:
    """(where the task's rows came from, without local paths; the hub dataset id or None)."""
    task = (summary.get("config") or {}).get("task") or {}
    if task.get("name") == "toy" or task.get("toy"):
        return "kdrun's synthetic `toy` task (generated by kdrun, no download)", None
    ds, conf = hub_dataset(task)
    named = f"the hub dataset `{ds}`" + (f" (config `{conf}`)" if conf else "") if ds else "local files"
    if task.get("data_dir"):
        return f"{named}, read from its files (`task.data_dir`)", ds
    if task.get("data_files"):
        return f"{named}, read from files (`task.data_files`)", ds
    return named, ds


def subsampled(summary: Mapping[str, Any]) -> int | None:
    """The dev rows kept when the dev set was cut (task.max_eval_samples), else None."""
    task = (summary.get("config") or {}).get("task") or {}
    return task.get("max_eval_samples")


def card_license(summary: Mapping[str, Any]) -> str:
    """report.card.license, else the teacher's license when known, else ``unknown``."""
    cfg = summary.get("config") or {}
    chosen = ((cfg.get("report") or {}).get("card") or {}).get("license")
    if chosen:
        return str(chosen)
    tc = cfg.get("teacher") or {}
    teacher = hub_id(_model_ref(tc), tc.get("fallback_hub_id")) or ""
    return next((lic for ref, lic in KNOWN_LICENSES.items() if teacher == ref or
                 (ref.endswith("-") and teacher.startswith(ref))), "unknown")


def public_command(command: str, run_dir: str | None = None) -> str:
    """The command without local paths: the program by its name, paths inside the run directory
    relative to it, GLUE/SQuAD data paths as ``$GLUE_DIR/...`` / ``$SQUAD_DIR/...``, other absolute
    paths as ``<path>/<last part>``."""
    words = command.split()
    if not words:
        return ""
    out = [Path(words[0]).name if words[0].startswith("/") else words[0]]
    for word in words[1:]:
        key, eq, value = word.rpartition("=")
        out.append(f"{key}{eq}{_public_path(value, run_dir)}" if value.startswith(("/", "~")) else word)
    return " ".join(out)


def _public_path(value: str, run_dir: str | None) -> str:
    path = Path(value).expanduser()
    if run_dir and (path == Path(run_dir) or Path(run_dir) in path.parents):
        return str(path.relative_to(run_dir)) or "."
    parts = [p.lower() for p in path.parts]
    for marker, env in (("glue", "$GLUE_DIR"), ("squad", "$SQUAD_DIR")):
        if marker in parts[:-1]:
            return "/".join([env, *path.parts[parts.index(marker) + 1:]])
    return f"<path>/{path.name}"


def _stage_hyperparameters(stage: Mapping[str, Any], train: Mapping[str, Any], accumulation: int) -> str:
    """One stage's batch size, accumulation, learning rate, warm-up, weight decay, optimizer and schedule,
    as the stage ran them (train.lr, train.optimizer and train.scheduler where the stage sets none)."""
    lr = train.get("lr") if train.get("lr") is not None else stage.get("lr")
    optimizer = (stage.get("optimizer") or train.get("optimizer") or {}).get("name") or "AdamW"
    batch = f"{stage.get('batch_size')}" + (f" × {accumulation} accumulation steps" if accumulation > 1 else "")
    return (f"- **Stage `{stage.get('name')}`:** batch size {batch}; learning rate {lr:g}; warm-up "
            f"{stage.get('warmup_ratio', 0):g} of the stage's steps; weight decay {stage.get('weight_decay', 0):g}; "
            f"optimizer {optimizer}, schedule `{stage.get('scheduler') or train.get('scheduler', 'linear')}`")


def _training_rows(summary: Mapping[str, Any]) -> list[str]:
    cfg = summary.get("config") or {}
    train, task = cfg.get("train") or {}, cfg.get("task") or {}
    accumulation = train.get("gradient_accumulation_steps") or 1
    stages = (cfg.get("objective") or {}).get("stages") or []
    return [f"- **Max sequence length:** {task.get('max_seq_length')}; **seed:** {train.get('seed', cfg.get('seed'))}; "
            f"**precision:** `{summary.get('precision')}` ({summary.get('processes', 1)} process(es) on "
            f"`{summary.get('device')}`); **gradient clipping** at {train.get('max_grad_norm')}",
            *(_stage_hyperparameters(s, train, accumulation) for s in stages)]


def _metric_rows(summary: Mapping[str, Any]) -> list[str]:
    from kdrun.tasks.baselines import split_values, table_cells

    base = summary.get("baseline")
    with_base = bool(split_values(base))
    head = "| model | split | metric | value |" + (" constant baseline | SE |" if with_base else "")
    rows = [head, "|" + "---|" * (6 if with_base else 4)]
    for who in ("teacher", "student"):
        for split, metrics in ((summary.get(who) or {}).get("metrics") or {}).items():
            for k, v in metrics.items():
                cells = " | ".join(table_cells(base, split, k)) + " |" if with_base else ""
                rows.append(f"| {who} | {split} | {k} | {v:.4f} |" + (f" {cells}" if cells else ""))
    return rows if len(rows) > 2 else []


def _cost_rows(cost: Mapping[str, Any] | None) -> list[str]:
    from kdrun.report.cost import latency_text, size_text, speed_unreliable, throughput_text, times

    if not cost or "student" not in cost:
        return []
    rows = [f"Measured by the run on `{cost['device']}` (threads: {cost['threads']}): latency at batch 1 × "
            f"{cost['latency_length']} tokens, throughput at batch {cost['throughput_batch']} × "
            f"{cost['throughput_length']} tokens of dev rows (medians and interquartile ranges, warm-up excluded).",
            "", "| model | parameters | without embeddings | size | latency | throughput |",
            "|---|---|---|---|---|---|"]
    for who in ("teacher", "student"):
        c = cost.get(who)
        if c:
            rows.append(f"| {who} | {c['total']:,} | {c['without_embeddings']:,} | {size_text(c['size_mb'])} "
                        f"({c['dtype']}) | {latency_text(c)} | {throughput_text(c)} |")
    r, why = cost.get("ratios"), speed_unreliable(cost)
    if why:
        rows += ["", f"Latency and throughput are unreliable: {why}. The student's speed is not compared with "
                     "the teacher's; measure it again on an idle machine."]
    if r:
        speed = "" if why else (f" and {times(r['faster'], 'faster', 'slower')} (latency) than the teacher, with "
                                f"{r['throughput']:.2f}× its throughput")
        rows += ["", f"The student is {times(r['smaller'], 'smaller', 'larger')} (parameters) and "
                     f"{times(r['smaller_size'], 'smaller', 'larger')} on disk" + (speed or " than the teacher") + "."]
    return rows


def card_data(summary: Mapping[str, Any]):
    """The metadata block: a huggingface_hub ``ModelCardData``. Dev scores measured on a subsample of
    the dev set are kept out of its model-index (the card's body gives them, marked)."""
    from huggingface_hub import EvalResult, ModelCardData

    cfg = summary.get("config") or {}
    task = cfg.get("task") or {}
    _, base = _base_text(summary)
    dataset, config = hub_dataset(task)
    pipeline = PIPELINE_TAGS.get(task.get("kind", "classification"))
    scores = [] if subsampled(summary) else [
        (split, k, v) for split, metrics in ((summary.get("student") or {}).get("metrics") or {}).items()
        for k, v in metrics.items()]
    results = [EvalResult(task_type=pipeline or "other", dataset_type=dataset or task.get("name", "task"),
                          dataset_name=_dataset_name(task, dataset, config), dataset_config=config if dataset else None,
                          dataset_split=split, metric_type=k, metric_value=float(v)) for split, k, v in scores]
    return ModelCardData(base_model=base, datasets=[dataset] if dataset else None, eval_results=results or None,
                         library_name="transformers", pipeline_tag=pipeline, model_name=_name(summary),
                         license=card_license(summary), metrics=sorted({r.metric_type for r in results}) or None,
                         tags=["kdrun", "knowledge-distillation", f"objective:{summary.get('objective')}"])


def _dataset_name(task: Mapping[str, Any], dataset: str | None, config: str | None) -> str:
    if dataset == "nyu-mll/glue":
        return f"GLUE {str(config).upper()}"
    return "SQuAD v1.1" if dataset == "rajpurkar/squad" else str(task.get("name", "task"))


def _name(summary: Mapping[str, Any]) -> str:
    cfg = summary.get("config") or {}
    student = (summary.get("student") or {}).get("name")
    return cfg.get("run_name") or f"{summary.get('task')}-{summary.get('objective')}-{student}"


def model_card(summary: Mapping[str, Any]) -> str:
    """The card's text (metadata block and body) from a run's summary (results.json)."""
    cfg = summary.get("config") or {}
    task = cfg.get("task") or {}
    info = (summary.get("student") or {}).get("info") or {}
    base, _ = _base_text(summary)
    source, _ = _data_text(summary)
    data = summary.get("data") or {}
    versions = summary.get("versions") or {}
    arch = (f"A {info.get('layers')}-layer {info.get('family')} model (hidden size {info.get('hidden')}, "
            f"{info.get('heads')} heads, {info.get('params_m')}M parameters)" if info else "A model")
    lines = [f"# {_name(summary)}", "",
             f"{arch} distilled with kdrun from the teacher below on the task "
             f"`{summary.get('task')}` with the objective `{summary.get('objective')}`.", "",
             "## How it was made", "",
             f"- **Base model:** {base}.",
             f"- **Teacher:** {_teacher_text(summary)}.",
             f"- **Objective:** `{summary.get('objective')}`"
             + (f", layer mapping `{(cfg.get('mapping') or {}).get('name')}`" if summary.get("layer_pairs") else "")
             + "; its stages:", ""]
    lines += _stage_rows(summary) + [""]
    lines += ["## Task and data", "",
              f"- **Task:** `{task.get('name')}` (kind `{task.get('kind', 'classification')}`), from {source}."]
    if data:
        evals = ", ".join(f"{s}: {n:,}" for s, n in (data.get("eval_rows") or {}).items())
        lines.append(f"- **Rows used:** {data.get('train_rows', 0):,} training rows; dev rows {evals}.")
    if summary.get("augmentation"):
        aug = summary["augmentation"]
        lines.append(f"- **Augmented training set:** {aug.get('rows')} rows (stages "
                     f"{', '.join(aug.get('stages', []))}).")
    lines += ["", "## Training", ""] + _training_rows(summary)
    lines += ["", "## Dev results", ""]
    if subsampled(summary):
        lines += [f"Measured on a subsample of the dev set (`task.max_eval_samples={subsampled(summary)}`), not "
                  "on all of it, so these scores are not comparable with published ones and are left out of "
                  "the card's model-index.", ""]
    metric_rows = _metric_rows(summary)
    lines += metric_rows or ["(no metrics recorded)"]
    selected = (summary.get("student") or {}).get("selected") or {}
    if selected.get("value") is not None:
        lines += ["", f"The student kept is the best by dev {selected.get('metric')} (stage {selected.get('stage')}, "
                      f"step {selected.get('step')})."]
    cost = _cost_rows(summary.get("cost"))
    if cost:
        lines += ["", "## Size and speed", ""] + cost
    auto = "AutoModelForSequenceClassification" if task.get("kind", "classification") == "classification" \
        else "AutoModel"
    lines += ["", "## Use", "", "```python", f"from transformers import {auto}, AutoTokenizer", "",
              'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
              f'model = {auto}.from_pretrained("path/to/this/directory")', "```", "",
              "`kdrun-export <run directory> --format both` writes an ONNX and an int8 model of it, checked against "
              "this one.", "",
              "## Provenance", "",
              f"- kdrun {versions.get('kdrun', '?')}" + (f" (git {summary['git_sha'][:12]})" if summary.get("git_sha")
                                                        else "")
              + f", torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}",
              f"- device `{summary.get('device')}`, {summary.get('processes', 1)} process(es), precision "
              f"`{summary.get('precision')}`, config hash `{summary.get('config_hash')}`",
              "- command (local paths left out):", "", "```", public_command(str(summary.get("command", "")),
                                                                            summary.get("run_dir")), "```", "",
              "## Publishing", "", "`hf upload <user>/<name> path/to/this/directory` puts this directory (weights, "
              "tokenizer, this card) on the Hugging Face Hub.", ""]
    return f"---\n{card_data(summary).to_yaml()}\n---\n\n" + "\n".join(lines)


def write_card(student_dir: Path, summary: Mapping[str, Any]) -> Path:
    """Write ``README.md`` (the model card) into ``student_dir``; returns its path."""
    path = Path(student_dir) / "README.md"
    path.write_text(model_card(summary), encoding="utf-8")
    return path
