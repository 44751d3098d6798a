"""Several processes (DDP over gloo, 2 CPU processes under torchrun): an uncached teacher is fine-tuned
by rank 0 alone and equals a one-process run's; each process draws its own dropout masks (its own
RNG, kept per rank in checkpoints); a run killed inside its second stage resumes to exactly the
uninterrupted run's student; DDP searches for unused parameters only in stages that need it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY, TOY, compose
from tests.test_sweeps import env_for, kdrun, weights

# after each test no process it started may be left (tests/procs.py)
pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# tinybert: an intermediate-layer stage (the classifier gets no gradient: DDP must look for unused
# parameters) and a prediction stage (it must not); student dropout stays on.
ARGS = [*TINY, *TOY, "objective=tinybert", "objective.params.intermediate_epochs=1",
        "objective.params.prediction_epochs=1", "train.checkpoint_every_steps=2"]


def torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(29600 + os.getpid() % 1000), "-m", "kdrun", *args],
                          capture_output=True, text=True, timeout=600, cwd=tmp, env=env_for(tmp))


def teacher_weights(cache: Path) -> dict[str, torch.Tensor]:
    (path,) = list((cache / "teachers").glob("*/model/model.safetensors"))
    return load_file(str(path))


def test_ddp_teacher_rank_seeds_and_exact_resume(tmp_path: Path) -> None:
    # one process: the reference teacher (the student stops at once)
    kdrun(tmp_path, *ARGS, f"cache_dir={tmp_path}/cache1", f"output_dir={tmp_path}/single", "train.stop_after_steps=1",
          check=False)
    # two processes, no cached teacher, killed 2 steps into the second stage
    r = torchrun(tmp_path, *ARGS, f"cache_dir={tmp_path}/cache2", f"output_dir={tmp_path}/cut",
                 "train.stop_after_steps=7")
    assert "stopped after 7 steps" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    assert (r.stdout + r.stderr).count("fine-tuning the teacher") == 1  # rank 0 alone
    a, b = teacher_weights(tmp_path / "cache1"), teacher_weights(tmp_path / "cache2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    blob = torch.load(tmp_path / "cut" / "checkpoints" / "last" / "optim_rng.pt", weights_only=True)
    r0, r1 = blob["rng_per_rank"]
    assert not torch.equal(r0["torch"], r1["torch"])  # each process its own dropout masks

    r = torchrun(tmp_path, *ARGS, f"cache_dir={tmp_path}/cache2", f"output_dir={tmp_path}/cut")
    assert r.returncode == 0 and "resuming at stage 1" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    r = torchrun(tmp_path, *ARGS, f"cache_dir={tmp_path}/cache2", f"output_dir={tmp_path}/whole")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    wa, wb = weights(tmp_path / "cut"), weights(tmp_path / "whole")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    trained = weights(tmp_path / "whole")
    moved = max(float((trained[k] - a[k]).abs().max()) for k in trained if k in a and trained[k].shape == a[k].shape)
    assert moved > 1e-4  # the student trained, so equality above means something


def test_find_unused_parameters_only_where_a_stage_leaves_some_unused() -> None:
    from kdrun.engine.objective import plan_stages
    from kdrun.engine.strategies import strategy_of
    from kdrun.engine.trainer import leaves_parameters_unused

    def unused(objective: str) -> list[bool]:
        cfg = compose([*TINY, *TOY, f"objective={objective}"])
        return [leaves_parameters_unused(p, strategy_of(p.cfg)) for p in plan_stages(cfg.objective)]

    assert unused("tinybert") == [True, False]  # intermediate layers only, then the prediction layer
    assert unused("logit") == [False] and unused("finetune") == [False]
    assert unused("ckd") == [False]  # CKD's relations come with CE/KD on the logits
    plans = plan_stages(compose([*TINY, *TOY, "objective=dynabert"]).objective)
    assert all(leaves_parameters_unused(p, strategy_of(p.cfg)) for p in plans)  # sub-networks skip weights


@pytest.mark.parametrize("forced", [None, True])
def test_ddp_wrapper_follows_the_stage(forced) -> None:
    """One process group of size 1 over gloo: the wrapper is rebuilt when a stage needs the other
    setting, and the old wrapper's gradient hooks are removed (a step does not reduce twice)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from kdrun.engine.objective import plan_stages
    from kdrun.engine.trainer import wrap_for_stage
    from tests.test_layer_kd import tiny_bert

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29800 + os.getpid() % 100))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plans = plan_stages(compose([*TINY, *TOY, "objective=tinybert"]).objective)
        model = tiny_bert()
        acc = SimpleNamespace(device=torch.device("cpu"), local_process_index=0,
                              unwrap_model=lambda m: getattr(m, "module", m))
        parts = SimpleNamespace(world_size=2, student=model, accelerator=acc,
                                train_cfg=SimpleNamespace(find_unused_parameters=forced))
        wrap_for_stage(parts, plans[0], None)
        first = parts.student
        assert first.find_unused_parameters is True
        wrap_for_stage(parts, plans[1], None)
        assert parts.student.module is model
        assert parts.student.find_unused_parameters is (forced if forced is not None else False)
        assert (parts.student is first) == (forced is True)
    finally:
        dist.destroy_process_group()
