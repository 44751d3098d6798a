"""The teacher: loaded from a checkpoint, or fine-tuned on the task once and cached.

The cache key is a hash of everything that determines the fine-tuned weights (model reference,
task data content, tokenisation, fine-tuning hyperparameters and seed, precision). Entries are built
in a temporary directory under a file lock and renamed into place, so concurrent sweep jobs train
a teacher once and never read a half-written one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from kdrun.cache import content_hash, file_fingerprint, get_or_build, write_json_atomic
from kdrun.losses import get_loss
from kdrun.objective import StagePlan, Term

CACHE_VERSION = 1


def finetune_plan(finetune_cfg: Any) -> StagePlan:
    """A one-stage plan of plain cross-entropy (MSE for regression) with the teacher's hyperparameters."""
    cfg = OmegaConf.to_container(finetune_cfg, resolve=True) if not isinstance(finetune_cfg, dict) else finetune_cfg
    stage = {"name": "finetune", "epochs": cfg["epochs"], "lr": cfg["lr"], "batch_size": cfg["batch_size"],
             "warmup_ratio": cfg["warmup_ratio"], "weight_decay": cfg["weight_decay"], "objective_lr": None,
             "data": "original", "eval_every_steps": cfg.get("eval_every_steps"), "select_best": True, "losses": []}
    return StagePlan(0, "finetune", stage, [Term("ce", get_loss("ce"), 1.0, {}, "teacher.finetune")])


def teacher_cache_key(teacher_cfg: Any, resolved_ref: str, data_hash: str, tok_hash: str, task_cfg: Any,
                      train_cfg: Any, precision: str) -> str:
    ref_identity: Any = resolved_ref
    if Path(resolved_ref).is_dir():
        ref_identity = {"path": str(Path(resolved_ref).resolve()), "files": file_fingerprint(resolved_ref)}
    return content_hash({
        "v": CACHE_VERSION,
        "model": ref_identity,
        "kind": teacher_cfg.kind,
        "sizes": [teacher_cfg.hidden_size, teacher_cfg.num_hidden_layers, teacher_cfg.num_attention_heads,
                  teacher_cfg.intermediate_size] if teacher_cfg.kind == "random" else None,
        "dropout": teacher_cfg.dropout,
        "finetune": OmegaConf.to_container(teacher_cfg.finetune, resolve=True),
        "data": data_hash,
        "tokenizer": tok_hash,
        "num_labels": task_cfg.num_labels,
        "max_seq_length": task_cfg.max_seq_length,
        "seed": teacher_cfg.finetune.seed,
        "precision": precision,
        "group_by_length": train_cfg.group_by_length,
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
    Returns (model, info) where info has ``cached``, ``path``, ``metrics``, ``train_seconds``.
    """

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        metrics = train_fn(tmp)
        write_json_atomic(tmp / "teacher.json", {"metrics": metrics, "train_seconds": time.perf_counter() - t0,
                                                 "key": key})
        shutil.rmtree(tmp / "checkpoints", ignore_errors=True)  # only the model is kept

    entry, cached = get_or_build(cache_root, "teachers", key, build)
    meta = json.loads((entry / "teacher.json").read_text())
    model = load_fn(str(entry / "model"))
    return model, {"cached": cached, "path": str(entry / "model"), "metrics": meta["metrics"],
                   "train_seconds": meta["train_seconds"], "key": key}


def save_model_files(model: Any, out: Path) -> None:
    """``save_pretrained``'s files (config.json + model.safetensors) from any process.

    transformers writes nothing on a process other than rank 0 once torch.distributed is up, but in
    a data-parallel run whichever process holds the cache lock fine-tunes and saves the teacher.
    """
    from safetensors.torch import save_model

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))

