"""Swapping a checkpoint (or cache entry) in is safe at every point: a process killed between the
two renames of :func:`kdrun.runtime.cache.replace_dir` leaves ``<dir>.old``, which the next resume
puts back; a resumed run then ends exactly like an uninterrupted one. A damaged ``best`` makes the
run start over (the best student cannot be recomputed otherwise); in a data-parallel run rank 0
alone sets a damaged checkpoint aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kdrun.app.run import run
from kdrun.runtime.cache import manifest_problem, recover_dir, replace_dir, write_manifest
from tests.conftest import REPO
from tests.test_e2e import TWO_STAGES
from tests.test_sweeps import weights

# 30 steps: checkpoints at 5, 10, ...; evals at 10, 17, 24, 30 (a student kept from stage 0 too, so
# that the first evaluation of stage 1 replaces checkpoints/best); the teacher runs in every step
# (teacher.store=auto decides by timing, which need not come out the same in two runs)
# One compute thread for every run: kdrun gives a run fewer threads while other kdrun runs are alive on the
# host, and a reference and its resumed twin given different thread counts differ by rounding.
BASE = [*TWO_STAGES, "train.checkpoint_every_steps=5", "teacher.store=off", "train.num_threads=1"]
ARGS = [*BASE, "objective.stages.0.select_best=true"]


def _version(d: Path, n: int) -> Path:
    """A directory holding version ``n`` (two files and a manifest)."""
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(bytes([n]) * 5000)
    (d / "state.json").write_text(json.dumps({"version": n}))
    write_manifest(d)
    return d


def _version_of(d: Path) -> int:
    assert manifest_problem(d) is None, manifest_problem(d)
    return json.loads((d / "state.json").read_text())["version"]


# the child replaces final (version 1) with tmp (version 2) and SIGKILLs itself after the N-th
# os.replace, or inside the deletion of the replaced copy (N = 0)
_CHILD = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from kdrun.runtime import cache
    kill_after, calls, real = int(sys.argv[3]), [], os.replace
    def replace(src, dst):
        real(src, dst)
        calls.append(dst)
        if len(calls) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    def rmtree(path, *a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace
    if kill_after == 0:
        shutil.rmtree = rmtree
    cache.replace_dir(Path(sys.argv[1]), Path(sys.argv[2]))
""")


@pytest.mark.parametrize("kill_after", [1, 2, 3, 0])
def test_cache_replace_dir_killed_at_any_point_leaves_a_whole_copy(tmp_path: Path, kill_after: int) -> None:
    """Kill after the first rename (final -> final.old: the cut the old two-rename swap lost
    ``last`` to), after the second (tmp -> final), after the old copy is renamed for deletion, and
    inside that deletion: a whole version is always found, and the next swap goes through."""
    final, tmp = _version(tmp_path / "last", 1), _version(tmp_path / ".last.tmp-x", 2)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp), str(final), str(kill_after)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr
    if kill_after == 1:
        assert not final.exists() and _version_of(tmp_path / "last.old") == 1
    assert recover_dir(final) == (kill_after == 1)
    assert _version_of(final) == (1 if kill_after == 1 else 2)
    # the next swap, as the next save would do it, leaves only the new version
    replace_dir(_version(tmp_path / ".last.tmp-y", 3), final)
    assert _version_of(final) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ([".last.tmp-x", "last"] if kill_after == 1 else ["last"])


def test_cache_replace_dir_after_a_cut_swap_keeps_the_only_copy_until_the_new_one_is_in(tmp_path: Path) -> None:
    """A save that comes before any resume (``last`` missing, ``last.old`` the only copy) must not
    delete that copy before the new one is in place."""
    _version(tmp_path / "last.old", 1)
    new = _version(tmp_path / ".last.tmp-z", 2)
    seen = []
    real = os.replace

    def replace(src, dst):
        seen.append((Path(src).name, Path(dst).name, (tmp_path / "last.old").exists() or (tmp_path / "last").exists()))
        real(src, dst)

    os.replace = replace
    try:
        replace_dir(new, tmp_path / "last")
    finally:
        os.replace = real
    assert seen[0][:2] == (".last.tmp-z", "last") and all(whole for *_, whole in seen)
    assert _version_of(tmp_path / "last") == 2 and not (tmp_path / "last.old").exists()


class _Cut(BaseException):
    """Stands for a kill: nothing after it runs in the process (not caught as an Exception)."""


def _cut_swap_of(monkeypatch, name: str, nth: int) -> None:
    """Make the ``nth`` swap of ``checkpoints/<name>`` stop between its two renames."""
    from kdrun.runtime import cache

    real, count = os.replace, [0]

    class _Os:
        def __getattr__(self, attr):
            return getattr(os, attr)

        @staticmethod
        def replace(src, dst):
            real(src, dst)
            if Path(dst).name == f"{name}.old" and Path(src).name == name:
                count[0] += 1
                if count[0] == nth:
                    raise _Cut()

    monkeypatch.setattr(cache, "os", _Os())


@pytest.mark.parametrize("name,nth", [("last", 3), ("best", 1)])
def test_cache_swap_cut_between_renames_resumes_and_ends_identically(run_cfg, tmp_path: Path, monkeypatch, capsys,
                                                                      name: str, nth: int) -> None:
    """A run stopped between the renames of its ``nth`` swap of ``checkpoints/<name>`` resumes from
    what was there before (``<name>.old``, put back) and ends with the uninterrupted run's student."""
    ref = run(run_cfg(*ARGS), tmp_path / "ref")
    rd = tmp_path / "cut"
    with monkeypatch.context() as m:
        _cut_swap_of(m, name, nth)
        with pytest.raises(_Cut):
            run(run_cfg(*ARGS), rd)
    ckpts = rd / "checkpoints"
    assert not (ckpts / name).exists() and manifest_problem(ckpts / f"{name}.old") is None
    step = json.loads((ckpts / ("last.old" if name == "last" else "last") / "state.json").read_text())["global_step"]
    capsys.readouterr()
    res = run(run_cfg(*ARGS), rd)
    out = capsys.readouterr().out
    assert f"{ckpts / name} was being replaced when the run stopped; the previous one is put back" in out
    assert f"step {step} from" in out and step > 0  # resumed, not started over
    a, b = weights(tmp_path / "ref"), weights(rd)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert res["student"]["metrics"] == ref["student"]["metrics"]
    assert not (ckpts / f"{name}.old").exists()


@pytest.mark.parametrize("stage0_best", [False, True])
def test_cache_damaged_best_at_resume_is_redone_and_the_run_ends_identically(run_cfg, tmp_path: Path, capsys,
                                                                             stage0_best: bool) -> None:
    """A resume must not end without its best student. Stopped at 17, ``last`` is from step 15 and
    ``best`` from 17. Without a stage-0 best, ``last`` refers to none: the resume saves step 17's
    again. With one, ``last`` refers to step 10's, which nothing recomputes: ``last`` is set aside
    too and the run starts over. Both end as the uninterrupted run."""
    from kdrun.engine.trainer import SimulatedInterrupt

    args = ARGS if stage0_best else BASE
    run(run_cfg(*args), tmp_path / "ref")
    rd = tmp_path / "cut"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg(*args, "train.stop_after_steps=17"), rd)
    best = rd / "checkpoints" / "best"
    assert json.loads((best / "best.json").read_text())["step"] == 17
    with open(best / "student.safetensors", "r+b") as f:
        f.truncate(100)
    capsys.readouterr()
    run(run_cfg(*args), rd)
    out = capsys.readouterr().out
    assert f"[kdrun] {best} is damaged (student.safetensors has 100 bytes" in out
    if not stage0_best:
        assert "resuming at stage 1 step 15" in out
    else:
        assert "starts over from the beginning" in out and "resuming at" not in out
    a, b = weights(tmp_path / "ref"), weights(rd)
    assert all(torch.equal(a[k], b[k]) for k in a)
    names = sorted(p.name.split("-")[0] for p in (rd / "checkpoints").iterdir())
    assert names == ["best", "best.damaged", "last"] + (["last.unusable"] if stage0_best else [])


def test_ddp_damaged_checkpoint_is_set_aside_by_rank_0_alone(tmp_path: Path) -> None:
    """Two processes resume a run whose checkpoint is damaged: one message, one set-aside copy, and
    both processes start over together (every process used to move it aside at once, and the
    losers crashed)."""
    from tests.test_ddp import ARGS, torchrun

    run_dir = tmp_path / "run"
    r = torchrun(tmp_path, *ARGS, f"cache_dir={tmp_path}/cache", f"output_dir={run_dir}", "train.stop_after_steps=3")
    assert "stopped after 3 steps" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    last = run_dir / "checkpoints" / "last"
    with open(last / "student.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    r = torchrun(tmp_path, *ARGS, f"cache_dir={tmp_path}/cache", f"output_dir={run_dir}")
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert text.count(f"[kdrun] {last} is damaged (student.safetensors does not match its checksum)") == 1, text[-4000:]
    assert len(list(last.parent.glob("last.damaged-*"))) == 1
    assert "resuming at" not in text and (run_dir / "results.json").exists()
