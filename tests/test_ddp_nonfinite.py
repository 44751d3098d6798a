"""Several processes and a non-finite loss on one rank only: every rank stops at the same check with
the step and the rank that diverged, none is left blocked in the next all-reduce — both through the
non-finite watch itself (2 gloo processes) and through a whole 2-process run under torchrun whose
plug-in loss term turns NaN on rank 1 alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import TINY, TOY
from tests.test_sweeps import env_for

# after each test no process it started may be left (tests/procs.py)
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _watch_worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from kdrun.engine.trainer import FiniteWatch, TrainingDiverged

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    watch = FiniteWatch(world_size=2)
    for step in range(1, 6):
        bad = rank == 1 and step >= 3
        watch.add(torch.tensor(float("nan") if bad else 1.0), {"ce": torch.tensor(1.0)}, step)
    plan = type("Plan", (), {"name": "s0"})()
    try:
        watch.check(plan, Path(out))
        result = "no error"
    except TrainingDiverged as e:
        result = str(e)
    dist.all_reduce(torch.ones(1))  # both ranks reach the next collective: nobody hangs
    Path(out, f"rank{rank}.txt").write_text(result)
    dist.destroy_process_group()


def test_ddp_nan_on_one_rank_stops_every_rank_at_the_same_check(tmp_path: Path) -> None:
    port = 29000 + os.getpid() % 1000
    mp.spawn(_watch_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (tmp_path / "rank0.txt").read_text(), (tmp_path / "rank1.txt").read_text()
    assert "became non-finite at step 3 on process 1" in r0 and "every process stops" in r0, r0
    assert "loss term(s) total (weighted sum) became non-finite at step 3" in r1, r1


PLUGIN = textwrap.dedent('''
    import os

    import torch

    from kdrun.losses.registry import register_loss
    from kdrun.losses.prediction import NoParams

    CALLS = [0]


    @register_loss("nan_on_rank1", uses_teacher=False, uses_labels=True)
    def nan_on_rank1(s, t, batch, ctx, p: NoParams):
        CALLS[0] += 1
        bad = os.environ.get("RANK") == "1" and CALLS[0] >= 3
        return s.logits.float().sum() * (float("nan") if bad else 0.0)
''')


def test_ddp_run_with_nan_on_rank1_only_stops_both_ranks(tmp_path: Path) -> None:
    (tmp_path / "nan_plugin.py").write_text(PLUGIN)
    env = env_for(tmp_path) | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [*TINY, *TOY, "objective=finetune", "objective.imports=[nan_plugin]",
            "objective.stages.0.losses=[{name:ce},{name:nan_on_rank1}]", "train.epochs=2",
            f"cache_dir={tmp_path}/cache", f"output_dir={tmp_path}/run"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(29700 + os.getpid() % 1000), "-m", "kdrun", *args],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    # Rank 1 names its term at step 3; DDP's gradient all-reduce carries the NaN into rank 0's weights,
    # whose own loss is then non-finite, or, when it is not yet, the agreement names rank 1: both stop.
    assert "nan_on_rank1 became non-finite at step 3" in out, out[-3000:]
    assert out.count("kdrun: error: stage 'finetune'") == 2, out[-3000:]
    assert not (tmp_path / "run" / "student").exists()


def test_ddp_a_teacher_fine_tuned_by_rank1_alone_is_checkpointed(tmp_path: Path) -> None:
    """The rank that takes the teacher's cache lock trains it alone (world_size 1 in its parts) and
    writes its checkpoints even when it is not the run's main process; a data-parallel student's
    checkpoints are written by the main process only."""
    from types import SimpleNamespace

    from kdrun.engine.checkpoints import TrainState, checkpoint_dir, save_checkpoint

    model = torch.nn.Linear(3, 2)
    rank1 = SimpleNamespace(is_main_process=False, unwrap_model=lambda m: m)
    for world_size, written in ((1, True), (2, False)):
        run_dir = tmp_path / f"w{world_size}"
        parts = SimpleNamespace(accelerator=rank1, student=model, objective=torch.nn.Module(), tracker=None,
                                run_dir=run_dir, config_hash="teacher", world_size=world_size, rank=0)
        if world_size == 2:  # the RNG gather needs the other rank: stand in for it
            import kdrun.engine.checkpoints as C

            saved, C._rng_states = C._rng_states, lambda parts: [C.rng_state(), C.rng_state()]
        try:
            save_checkpoint(parts, TrainState(global_step=4), None, None)
        finally:
            if world_size == 2:
                C._rng_states = saved
        assert (checkpoint_dir(run_dir) / "state.json").exists() == written
