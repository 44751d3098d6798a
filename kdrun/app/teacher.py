"""The teacher: loaded from a checkpoint, or fine-tuned on the task once and cached.

The cache key is a hash of everything that can change the fine-tuned teacher (model, task data
content, tokenizer, how the task's rows are used, ``teacher.finetune`` and the resolved precision).
The run's ``train`` settings are the student's: the teacher trains with ``teacher_train_cfg``, in
which every ``train.*`` key either comes from ``teacher.finetune`` (so it is keyed), is fixed, or is
one that cannot change the weights. The tables below classify every key of ``task``, ``teacher``,
``train`` and the rest of the run's config; tests/test_teacher_key.py fails for a schema key that
is missing from them. Entries are built in a temporary directory under a file lock and renamed into
place, so concurrent sweep jobs train a teacher once and never read a half-written one.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf

from kdrun.engine.objective import StagePlan, Term
from kdrun.engine.optim import without_default_optim
from kdrun.losses import get_loss
from kdrun.runtime.cache import content_hash, file_fingerprint, load_or_build, write_json_atomic
from kdrun.tasks.kinds import kind_of

# 2: task splits/metrics and all of teacher.finetune (with its own clipping, accumulation, best-keeping
# and batching settings) keyed; train.group_by_length no longer is (the teacher has its own).
CACHE_VERSION = 2

# ---------------------------------------------------------------------------------- classification

# teacher.*: in the key as they are.
TEACHER_KEYED = {
    "kind": "pretrained weights or a random initialisation",
    "hidden_size": "size of a random teacher (kind=random only; a pretrained one has its checkpoint's)",
    "num_hidden_layers": "size of a random teacher (kind=random only)",
    "num_attention_heads": "size of a random teacher (kind=random only)",
    "intermediate_size": "size of a random teacher (kind=random only)",
    "family": "model family of a random teacher (kind=random only; a pretrained one has its checkpoint's)",
    "dropout": "dropout while fine-tuning",
    "finetune": "every fine-tuning hyperparameter, the seed and the teacher's own train settings (optimizer and "
                "schedule: default values are left out of the hash, so the entries cached before they existed "
                "stay valid)",
}
_RANDOM_ONLY = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "family")
# teacher.*: in the key through what they resolve to.
TEACHER_KEYED_AS_RESOLVED = {
    "name_or_path": "keyed as the resolved model reference (a directory: its path and its files' sizes and mtimes)",
    "fallback_hub_id": "used only when name_or_path does not resolve; keyed as the resolved reference",
    "tokenizer": "keyed as the tokenizer's fingerprint (vocabulary, lower-casing), which also fixes a random "
                 "teacher's vocabulary size",
}
# teacher.*: not in the key because they cannot change a fine-tuned teacher.
TEACHER_NOT_IN_KEY = {
    "name": "a label; the model is identified by its resolved reference",
    "checkpoint": "a given checkpoint is loaded as it is: nothing is fine-tuned or cached",
    "store": "whether distillation reads the fine-tuned teacher's outputs from the teacher-output store (after "
             "fine-tuning; the store has its own key, kdrun/engine/teacher_store.py)",
    "store_dtype": "the dtype of the stored outputs (in the store's key, not the teacher's)",
    "store_max_gb": "a size cap for the store's entries (after fine-tuning)",
    "dtype": "the frozen teacher's dtype while distilling; it fine-tunes under the run's precision (keyed)",
}

# task.*: in the key as they are (how the rows are used; which rows there are is in the data hash).
TASK_KEYED = {
    "num_labels": "the classifier head and the loss (CE; MSE for 1)",
    "max_seq_length": "truncation of every row",
    "train_split": "which split the teacher trains on (the data hash covers every split, not which one is train)",
    "eval_splits": "the first one selects the kept teacher; the cached dev metrics are of these splits",
    "main_metric": "selects the kept teacher",
    "metrics": "the cached dev metrics are these (they do not change the weights)",
    # question answering only (task.kind=qa): left out of the key of classification teachers, so
    # their entries cached before these keys existed stay valid
    "kind": "the model head (sequence classification or start / end positions) and the data layout",
    "doc_stride": "QA: the overlap of the windows the teacher trains on",
    "max_answer_length": "QA: post-processing of the cached dev metrics, which select the kept teacher",
    "n_best": "QA: post-processing of the cached dev metrics, which select the kept teacher",
}
_KIND_ONLY = ("kind", "doc_stride", "max_answer_length", "n_best")  # keyed where the kind says (teacher_keyed)
# task.*: in the key through the content hash of the loaded splits (every text and label).
TASK_KEYED_AS_DATA = {
    name: "chooses or reads the rows; keyed as the data content hash"
    for name in ("text_columns", "label_column", "label_names", "hub_dataset", "hub_config", "data_dir",
                 "data_files", "tsv", "max_train_samples", "max_eval_samples", "sample_seed", "toy",
                 "split_by_article")
}
TASK_KEYED_AS_DATA["teacher_max_train_samples"] = (
    "chooses the teacher's own training rows (teacher_train_data): the key takes the content hash of the rows "
    "the teacher trains on, so students of different subsamples share the teacher fine-tuned on the same rows")
TASK_NOT_IN_KEY = {
    "name": "a label (names in error messages and run names); the data it stands for is in the data hash",
    "selection_splits": "selects the kept student only; the teacher selects on main_metric of the first eval split",
    "selection_threshold": "a floor for keeping a student only; the teacher's selection has none",
    # corpus tasks only (task.kind=general): their teacher is used as it is, never fine-tuned or cached
    "validation_percent": "corpus tasks only: no teacher is fine-tuned for them",
    "min_segment_tokens": "corpus tasks only: no teacher is fine-tuned for them",
    "mlm_probability": "corpus tasks only: no teacher is fine-tuned for them",
    "imports": "modules that register task kinds; the kind's own keys are keyed (TaskKind.teacher_keyed)",
}

# train.*: in the key as the value that reaches the teacher.
TRAIN_KEYED = {
    "precision": "the teacher trains under the run's accelerator; keyed as the resolved mixed precision "
                 "(no/bf16/fp16), so auto and fp32 on a CPU share an entry",
}
# train.*: not in the key because the teacher never sees the run's value; teacher_train_cfg replaces it
# with these (a teacher.finetune key, keyed with the rest of teacher.finetune, or a fixed value).
TRAIN_REPLACED: dict[str, Callable[[Any], Any]] = {
    "seed": lambda ft: ft.seed,  # teacher.finetune.seed: one teacher for a sweep over run seeds
    "epochs": lambda ft: None,  # the plan carries teacher.finetune.epochs; train.epochs sets the objective's
    "lr": lambda ft: None,  # the plan carries teacher.finetune.lr; train.lr sets the objective's stages
    "gradient_accumulation_steps": lambda ft: ft.gradient_accumulation_steps,
    "max_grad_norm": lambda ft: ft.max_grad_norm,
    "keep_best": lambda ft: ft.keep_best,
    "group_by_length": lambda ft: ft.group_by_length,
    "pad_to_max_length": lambda ft: False,  # batches padded to their longest row (padding is a benchmark knob)
    "pad_to_multiple_of": lambda ft: 0,  # likewise (widths rounded for a compiled distillation step)
    "compile": lambda ft: False,  # the distillation's steps compile; the teacher fine-tunes eagerly
    "cuda_graphs": lambda ft: False,
    "stop_after_steps": lambda ft: None,  # the testing aid stops the student only
    "cache_teacher_logits": lambda ft: False,  # the teacher learns from gold labels: it has no teacher
    "optimizer": lambda ft: ft.optimizer,
    "scheduler": lambda ft: ft.scheduler,
}
# train.*: they reach the teacher's fine-tuning but are not in the key because they cannot change its weights.
TRAIN_NOT_IN_KEY = {
    "device": "where it trains; the precision it implies is keyed as resolved. Only floating-point rounding "
              "differs between devices, which the cache ignores as it ignores GPU models and library versions",
    "eval_batch_size": "batching of the no-gradient dev passes: padding is masked, so a row's logits do not "
                       "depend on its batch beyond rounding (which could at most tip an exact tie between two "
                       "dev scores that select the kept teacher)",
    "num_workers": "data-loading processes; the batches and their order come from the sampler",
    "num_threads": "compute threads: they change floating-point summation order only",
    "tf32": "TensorFloat-32 for CUDA matmuls: floating-point rounding only, ignored as the device is",
    "find_unused_parameters": "DDP's search for unused parameters; the teacher fine-tunes on one process",
    "compile_backend": "compiles the distillation's steps; the teacher fine-tunes uncompiled",
    "checkpoint_every_steps": "how often the fine-tuning saves its progress (in the entry's staging directory); "
                              "a resume continues bit for bit, so it cannot change the weights",
    "keep_checkpoints": "what a finished run keeps of its resume state; the teacher's entry keeps its model only",
}

# The rest of the run's config: not in the key because none of it reaches the teacher's fine-tuning.
RUN_NOT_IN_KEY = {
    "seed": "the run's seed reaches the teacher only as train.seed, which it replaces with teacher.finetune.seed",
    "student": "built after the teacher (a random teacher without tokenizer takes the student's tokenizer, "
               "keyed as its fingerprint)",
    "objective": "the teacher's one stage is teacher.finetune's plain CE (MSE) stage (finetune_plan)",
    "mapping": "layer maps of the distillation only",
    "augmentation": "the teacher trains on the original training split only",
    "spans": "MGSKD spans; the teacher's CE loss ignores them",
    "logger": "the teacher's fine-tuning logs nothing (fine_tune_teacher)",
    "report": "what the run measures after training (kdrun.report.cost)",
    "sweep": "launching only", "launcher": "launching only",
    "cache_dir": "where the cache is", "resume": "the student's checkpoints",
    "cache_max_gb": "evicts cache entries after the run", "cache_wait_timeout_s": "how long other ranks wait for it",
    "output_dir": "where the run writes", "run_name": "a label",
}
# The sections of the run's config classified key by key above.
RUN_CLASSIFIED_BY_KEY = ("task", "teacher", "train")


def teacher_train_cfg(train_cfg: Any, finetune_cfg: Any) -> DictConfig:
    """The ``train`` settings the trainer gets while fine-tuning the teacher, built key by key: the
    run's value only for TRAIN_KEYED and TRAIN_NOT_IN_KEY keys, the TRAIN_REPLACED value (from
    ``teacher.finetune`` or fixed) for the rest. A train key missing from these tables does not
    reach the teacher at all (for the default config the values equal the run's where the trainer
    reads them, so defaults train the teacher as before)."""
    passed = {k: train_cfg[k] for k in (*TRAIN_KEYED, *TRAIN_NOT_IN_KEY)}
    return OmegaConf.create({**passed, **{k: fn(finetune_cfg) for k, fn in TRAIN_REPLACED.items()}})


def teacher_train_limit(task: Any) -> tuple[bool, int | None]:
    """(own rows, limit) from ``task.teacher_max_train_samples``: whether the teacher trains on other
    rows than the student and then how many (None = the whole training split)."""
    from kdrun.errors import ConfigError

    value = task.get("teacher_max_train_samples", "same")
    if value == "same":
        return False, None
    if value is None or value == "all":
        limit = None
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        limit = value
    else:
        raise ConfigError(f"task.teacher_max_train_samples={value!r}: use same (the student's rows), all (or null: "
                          "the whole training split) or a positive number of rows")
    return limit != task.get("max_train_samples"), limit


def teacher_train_data(cfg: Any, data_hash: str, train: Any, tokenizer: Any) -> tuple[str, Callable[[], Any]]:
    """The data hash for the teacher's cache key and a function that returns the tokenised training
    split the teacher fine-tunes on.

    By default these are the run's own (``data_hash``, ``train``). With ``task.teacher_max_train_samples``
    drawing other rows, the task is loaded again with that many training rows (the same seeded
    shuffle as the student's subsample), its content hash (the eval splits included, as for the
    student) replaces ``data_hash`` and the rows are tokenised only when called (a cache miss).
    """
    own, limit = teacher_train_limit(cfg.task)
    if not own:
        return data_hash, lambda: train
    import datasets

    from kdrun.tasks.data.common import data_fingerprint

    task = OmegaConf.merge(cfg.task, {"max_train_samples": limit})
    kind = kind_of(task)
    raw = kind.load_raw(task)
    split = task.train_split

    def tokenized() -> Any:
        return kind.tokenize(datasets.DatasetDict({split: raw[split]}), tokenizer, task)[split]

    return data_fingerprint(raw), tokenized


def fine_tune_teacher(out: Path, new_model: Callable[[], Any], cfg: Any, accelerator: Any, train_data: Any,
                      eval_data: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Fine-tune a new teacher (``new_model()``, built after seeding) on the task into ``out/model``
    and return its dev metrics. It trains with ``teacher.finetune`` (finetune_plan,
    teacher_train_cfg) and reads of the run's config only ``task`` and the ``train`` keys classified
    above as keyed or unable to change its weights; it logs nothing."""
    from kdrun.engine.objective import Objective
    from kdrun.engine.trainer import RunParts, evaluate, finalize_best, seed_everything
    from kdrun.models import loading as M
    from kdrun.runtime.tracking import Tracker

    task, ft = cfg.task, cfg.teacher.finetune
    ttcfg = teacher_train_cfg(cfg.train, ft)
    seed_everything(ttcfg.seed)
    # Whichever process takes the cache lock fine-tunes the teacher alone (the others wait for the
    # entry), so this is never data-parallel.
    model = accelerator.prepare_model(new_model()) if accelerator.num_processes == 1 else \
        new_model().to(accelerator.device)
    kind = kind_of(task)
    plan = finetune_plan(ft, kind.finetune_loss)
    parts = RunParts(
        accelerator=accelerator, student=model, teacher=None,
        objective=Objective([plan], [], task.num_labels, M.describe(model), None),
        train_data=train_data, eval_data=eval_data,
        collator=kind.collator(tokenizer, task, ttcfg.pad_to_max_length),
        metric_fn=kind.metric_fn(task, eval_data), main_metric=task.main_metric, train_cfg=ttcfg,
        tracker=Tracker(out, OmegaConf.create({"name": "none"}), {}, "teacher", enabled=False),
        run_dir=out, config_hash="teacher", kind=kind, role="teacher",
    )
    print(f"[kdrun] fine-tuning the teacher ({cfg.teacher.name}) on {task.name} ({len(train_data)} training rows)")
    with teacher_accelerator(accelerator, ttcfg.gradient_accumulation_steps):
        _train_resumably(parts, plan, out)
    finalize_best(parts)
    save_model_files(accelerator.unwrap_model(model), out / "model")
    tokenizer.save_pretrained(out / "model")
    write_json_atomic(out / "train_data.json", {"rows": len(train_data)})
    return evaluate(parts, model)


def _train_resumably(parts: Any, plan: StagePlan, out: Path) -> None:
    """Train the teacher's stage, continuing from ``out/checkpoints/last`` when an earlier attempt
    was interrupted (kdrun.engine.trainer.train_resumably, as the student's stages); ``out`` is the
    cache entry's resumable staging directory."""
    from kdrun.engine.trainer import train_resumably

    def resumed(state, ckpt: Path) -> None:
        print(f"[kdrun] resuming the teacher's fine-tuning at step {state.global_step} from {ckpt}", flush=True)

    train_resumably(parts, [plan], out, "teacher", on_resume=resumed)


@contextmanager
def teacher_accelerator(accelerator: Any, gradient_accumulation_steps: int) -> Iterator[None]:
    """Fine-tune the teacher on the run's accelerator with its own gradient accumulation, from and
    back to a fresh accumulation counter, with a loss scaler of its own: neither the student's
    settings nor a cache hit or miss leaks from one model's training into the other's."""
    saved = accelerator.gradient_accumulation_steps
    precision = accelerator.precision
    accelerator.gradient_accumulation_steps = gradient_accumulation_steps
    accelerator.step = 0
    accelerator.precision = precision.fresh()
    try:
        yield
    finally:
        accelerator.gradient_accumulation_steps = saved
        accelerator.step = 0
        accelerator.precision = precision


def finetune_plan(finetune_cfg: Any, loss: str = "ce") -> StagePlan:
    """A one-stage plan of the task kind's supervised loss (``ce``: cross-entropy, MSE for regression)
    with the teacher's hyperparameters."""
    cfg = OmegaConf.to_container(finetune_cfg, resolve=True) if not isinstance(finetune_cfg, dict) else finetune_cfg
    stage = {"name": "finetune", "epochs": cfg["epochs"], "lr": cfg["lr"], "batch_size": cfg["batch_size"],
             "warmup_ratio": cfg["warmup_ratio"], "weight_decay": cfg["weight_decay"], "objective_lr": None,
             "data": "original", "eval_every_steps": cfg.get("eval_every_steps"), "select_best": True, "losses": [],
             "optimizer": cfg.get("optimizer"), "scheduler": cfg.get("scheduler")}
    spec = get_loss(loss)
    return StagePlan(0, "finetune", stage, [Term(loss, spec, 1.0, spec.make_params(), "teacher.finetune")])


def teacher_cache_key(cfg: Any, resolved_ref: str, data_hash: str, tok_hash: str, precision: str) -> str:
    """The cache key of the teacher fine-tuned for run config ``cfg``.

    ``resolved_ref`` is the resolved teacher reference ("random" for kind=random), ``data_hash`` the
    content hash of the loaded splits, ``tok_hash`` the tokenizer's fingerprint and ``precision`` the
    accelerator's resolved mixed precision. Reads only the TEACHER_KEYED and TASK_KEYED keys of ``cfg``.
    """
    tc, task = cfg.teacher, cfg.task
    ref_identity: Any = resolved_ref
    if Path(resolved_ref).is_dir():
        ref_identity = {"path": str(Path(resolved_ref).resolve()), "files": file_fingerprint(resolved_ref)}
    random, kind_keyed = tc.kind == "random", kind_of(task).teacher_keyed
    return content_hash({
        "v": CACHE_VERSION,
        "model": ref_identity,
        "tokenizer": tok_hash,
        "data": data_hash,
        "teacher": {k: (without_default_optim(OmegaConf.to_container(tc[k], resolve=True)) if k == "finetune"
                        else tc[k])
                    for k in TEACHER_KEYED if random or k not in _RANDOM_ONLY},
        "task": {k: OmegaConf.to_container(task[k], resolve=True) if OmegaConf.is_config(task[k]) else task[k]
                 for k in TASK_KEYED if k not in _KIND_ONLY or k in kind_keyed},
        "precision": precision,
    })


def get_teacher(
    cache_root: str,
    key: str,
    train_fn: Callable[[Path], dict[str, Any]],
    load_fn: Callable[[str], Any],
    is_main_process: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Load the cached fine-tuned teacher for ``key``, training it with ``train_fn(dir)`` if absent.

    ``train_fn`` writes the model (save_pretrained) into ``dir/model`` and returns its dev metrics.
    Returns (model, info) where info has ``cached``, ``path``, ``metrics``, ``train_seconds``, ``key``
    and ``train_rows`` (the teacher's training rows; None for entries cached before it was recorded).
    """

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        metrics = train_fn(tmp)
        write_json_atomic(tmp / "teacher.json", {"metrics": metrics, "train_seconds": time.perf_counter() - t0,
                                                 "key": key})
        shutil.rmtree(tmp / "checkpoints", ignore_errors=True)  # only the model is kept

    def load(entry: Path) -> tuple[Any, dict[str, Any]]:
        return load_fn(str(entry / "model")), json.loads((entry / "teacher.json").read_text())

    (model, meta), entry, cached = load_or_build(cache_root, "teachers", key, build, load, resumable=True)
    rows = entry / "train_data.json"  # absent from entries cached before it was written
    return model, {"cached": cached, "path": str(entry / "model"), "metrics": meta["metrics"],
                   "train_seconds": meta["train_seconds"], "key": key,
                   "train_rows": json.loads(rows.read_text())["rows"] if rows.exists() else None}


def save_model_files(model: Any, out: Path) -> None:
    """``save_pretrained``'s files (config.json + model.safetensors) from any process.

    transformers writes nothing on a process other than rank 0 once torch.distributed is up, but in
    a data-parallel run whichever process holds the cache lock fine-tunes and saves the teacher.
    The file carries ``format: pt`` as save_pretrained's does: transformers 4.x refuses to load a
    safetensors file without it, so any reader of the cache can load the teacher.
    """
    from safetensors.torch import save_model

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})

