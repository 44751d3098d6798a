"""Checkpoints: the training state, module weights, optimizer/scheduler and RNG states.

``checkpoints/last`` holds everything a resume needs; ``checkpoints/best`` the best dev student so
far. Both are swapped in whole (:func:`kdrun.runtime.cache.replace_dir`): a process killed between
the swap's two renames leaves ``last.old`` (``best.old``), which the next resume puts back. A
resumed run continues bit for bit as if it had never stopped. In a data-parallel run, rank 0 alone
checks the checkpoints and sets a damaged one aside while the other processes wait; all then resume
from what rank 0 decided.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kdrun.engine.run_parts import RunParts
from kdrun.errors import ConfigError, UserError
from kdrun.runtime.cache import manifest_problem, recover_dir, staging_dir, write_json_atomic, write_manifest


@dataclass
class TrainState:
    """Where training is; saved in every checkpoint (JSON)."""

    stage: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    stage_step: int = 0  # optimizer steps in the current stage
    global_step: int = 0  # optimizer steps over all stages
    best_metric: float | None = None
    best_stage: int | None = None
    best_step: int | None = None
    stage_results: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    # per stage ("<index>:<name>"): rank 0's teacher-store decision (kdrun/engine/teacher_store.py)
    store_decisions: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------ RNG

def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# -------------------------------------------------------------------------------------- modules

def _state_dict_cpu(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def save_module(module: nn.Module, path: Path) -> None:
    sd = _state_dict_cpu(module)
    # safetensors refuses tensors that share storage (tied embeddings): store clones.
    save_file({k: v.clone() for k, v in sd.items()}, str(path))


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file, so that a full disk raises OSError(ENOSPC) naming
    ``path`` (torch's own writer reports it as an unexplained RuntimeError)."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e


def load_module(module: nn.Module, path: Path) -> None:
    module.load_state_dict(load_file(str(path)), strict=True)


# ---------------------------------------------------------------------------------- checkpoints

def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last"


def _rng_states(parts: RunParts) -> list[dict[str, Any]]:
    """Every process's RNG state, in rank order (each process draws its own dropout masks)."""
    if parts.world_size <= 1:
        return [rng_state()]
    from accelerate.utils import gather_object

    return gather_object([rng_state()])


def save_checkpoint(parts: RunParts, state: TrainState, optimizer, scheduler, precision=None, meter=None) -> None:
    """Atomically replace checkpoints/last with the current training state (called on every
    process: the RNG states of all of them are kept; the main process writes). ``meter``: the loss
    sums since the last log line, so that a resumed run logs the same means."""
    rngs = _rng_states(parts)
    if not writes(parts):
        return
    final = checkpoint_dir(parts.run_dir)
    with staging_dir(final) as tmp:
        save_module(parts.accelerator.unwrap_model(parts.student), tmp / "student.safetensors")
        save_module(parts.objective, tmp / "objective.safetensors")
        save_torch(
            {"optimizer": optimizer.state_dict() if optimizer else None,
             "scheduler": scheduler.state_dict() if scheduler else None,
             "scaler": precision.state_dict() if precision is not None else None,
             "rng": rngs[0], "rng_per_rank": rngs,
             "meter": None if meter is None else {"sums": {k: v.detach().cpu() for k, v in meter.sums.items()},
                                                  "batches": meter.batches}},
            tmp / "optim_rng.pt",
        )
        log = parts.tracker.path if parts.tracker is not None else None
        write_json_atomic(tmp / "state.json", {"config_hash": parts.config_hash, **state.to_dict(),
                                               "metrics_bytes": log.stat().st_size if log and log.exists() else 0})
        write_manifest(tmp)  # sizes and checksums: a damaged checkpoint is never resumed from


def set_aside(ckpt: Path, problem: str, what: str) -> Path:
    """Move a damaged checkpoint next to itself (kept for inspection) and say so in one line."""
    dest = ckpt.with_name(f"{ckpt.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.replace(ckpt, dest)
    print(f"[kdrun] {ckpt} is damaged ({problem}); moved to {dest}; {what}", flush=True)
    return dest


def best_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "best"


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a resume finds a checkpoint (also one that a cut swap left as ``last.old``)."""
    ckpt = checkpoint_dir(run_dir)
    return (ckpt / "state.json").exists() or (ckpt.with_name(ckpt.name + ".old") / "state.json").exists()


def _settle(run_dir: Path, config_hash: str) -> dict[str, Any] | None:
    """What to resume from, decided by one process: ``{"state": ...}``, ``{"error": ...}`` or None
    (start from the beginning). Puts back a checkpoint that a cut swap left as ``.old``, removes
    staging directories a killed save left, and moves a damaged ``last`` aside. A damaged ``best``
    is set aside too; when ``last`` refers to it (the best student so far cannot be recomputed
    without training again), ``last`` goes with it and the run starts over, ending as it would have."""
    ckpt, best = checkpoint_dir(run_dir), best_dir(run_dir)
    for d in (ckpt, best):
        if recover_dir(d):
            print(f"[kdrun] {d} was being replaced when the run stopped; the previous one is put back", flush=True)
        for tmp in d.parent.glob(f".{d.name}.tmp-*"):  # a save cut short (one writer per run directory)
            shutil.rmtree(tmp, ignore_errors=True)
    if not ckpt.exists():
        return None
    problem = manifest_problem(ckpt)
    if problem is not None:
        set_aside(ckpt, problem, "the run starts over from the beginning")
        return None
    meta = json.loads((ckpt / "state.json").read_text())
    meta.pop("metrics_bytes", None)
    if meta.pop("config_hash") != config_hash:
        return {"error": f"{ckpt} belongs to a run with a different configuration; use a new run directory "
                         "(hydra.run.dir=...) or resume=false to start over"}
    best_problem = manifest_problem(best) if best.exists() else None
    if best_problem is not None and meta.get("best_step") is None:  # saved after last: the resume redoes it
        set_aside(best, best_problem, f"{ckpt} does not need it (the resumed run saves it again)")
    elif best_problem is not None:
        dest = ckpt.with_name(f"{ckpt.name}.unusable-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(ckpt, dest)  # resuming it would end without the best student
        set_aside(best, best_problem, f"the best student so far cannot be recomputed from {ckpt} (moved to "
                                      f"{dest}), so the run starts over from the beginning")
        return None
    return {"state": meta}


def load_checkpoint_state(run_dir: Path, config_hash: str, accelerator: Any = None) -> TrainState | None:
    """The state to resume from, or None to start from the beginning (no checkpoint, or a damaged
    one, which is moved aside). ``accelerator``: a data-parallel run's (every process calls this);
    rank 0 decides alone while the others wait, then tells them."""
    multi = accelerator is not None and accelerator.num_processes > 1
    decision = _settle(run_dir, config_hash) if not multi or accelerator.is_main_process else None
    if multi:
        from accelerate.utils import broadcast_object_list

        accelerator.wait_for_everyone()  # rank 0 has put back or moved aside what it had to
        decision = broadcast_object_list([decision], from_process=0)[0]
        if decision is not None and "state" in decision and not (checkpoint_dir(run_dir) / "state.json").exists():
            raise UserError(f"process {accelerator.process_index} cannot see {checkpoint_dir(run_dir)}, which rank 0 "
                            "resumes from: put output_dir on a file system every process shares")
    if decision is None:
        return None
    if "error" in decision:
        raise ConfigError(decision["error"])
    return TrainState(**decision["state"])


def rewind_metrics_log(run_dir: Path) -> None:
    """Cut metrics.jsonl back to what was logged when checkpoints/last was written: the steps a
    killed run logged after its last checkpoint are trained, and logged, again after the resume."""
    log = run_dir / "metrics.jsonl"
    meta = json.loads((checkpoint_dir(run_dir) / "state.json").read_text())
    size = meta.get("metrics_bytes")
    if size is not None and log.exists() and log.stat().st_size > size:
        with open(log, "r+b") as f:
            f.truncate(size)


def load_optim_rng(resume_from: Path, optimizer, scheduler, rank: int = 0, precision=None) -> dict | None:
    """Restore a stage's optimizer and scheduler (unless the checkpoint closed the previous stage),
    the loss scaler and this process's RNG states from ``resume_from``; returns the saved loss
    meter (sums and batches since the last log line), or None."""
    blob = torch.load(resume_from / "optim_rng.pt", weights_only=True, map_location="cpu")
    if blob["optimizer"] is not None:  # None: the checkpoint closed the previous stage
        optimizer.load_state_dict(blob["optimizer"])
        scheduler.load_state_dict(blob["scheduler"])
    if precision is not None:
        precision.load_state_dict(blob.get("scaler"))
    per_rank = blob.get("rng_per_rank") or [blob["rng"]]
    if rank >= len(per_rank):
        raise ConfigError(f"{resume_from} was written by {len(per_rank)} process(es); resume it with as many "
                          "(or start over with resume=false)")
    set_rng_state(per_rank[rank])
    return blob.get("meter")


def seed_for_rank(seed: int, rank: int) -> None:
    """Reseed process ``rank`` of a data-parallel run so that its dropout masks differ from the
    other processes' (rank 0 keeps ``seed``: a one-process run is unchanged). Data order is drawn
    from its own generators and stays global."""
    if rank > 0:
        seed_everything(seed + 1_000_003 * rank)


def writes(parts: RunParts) -> bool:
    """Whether this process writes the model's checkpoints: the main one of a data-parallel run, or
    whichever process trains a model alone (a teacher fine-tuned by the rank that took the cache
    lock, while the others wait for its entry)."""
    return parts.world_size <= 1 or parts.accelerator.is_main_process


def save_best(parts: RunParts, state: TrainState) -> None:
    if not writes(parts):
        return
    final = best_dir(parts.run_dir)
    with staging_dir(final) as tmp:
        save_module(parts.accelerator.unwrap_model(parts.student), tmp / "student.safetensors")
        write_json_atomic(tmp / "best.json", {"metric": state.best_metric, "stage": state.best_stage,
                                              "step": state.best_step})
        write_manifest(tmp)


def restore_models(parts: RunParts, ckpt: Path) -> None:
    load_module(parts.accelerator.unwrap_model(parts.student), ckpt / "student.safetensors")
    load_module(parts.objective, ckpt / "objective.safetensors")


def finalize_best(parts: RunParts) -> None:
    """Load the kept best student (when selecting) into ``parts.student``."""
    best = parts.run_dir / "checkpoints" / "best" / "student.safetensors"
    if not parts.train_cfg.keep_best or not best.parent.exists():
        return
    problem = manifest_problem(best.parent)
    if problem is not None:
        raise UserError(f"{best.parent} (the best student so far) is damaged ({problem}); it cannot be recomputed "
                        "without training again: rerun with resume=false")
    load_module(parts.accelerator.unwrap_model(parts.student), best)
