"""How many compute threads a run uses, decided once before its first tensor operation.

PyTorch starts as many intra-op threads as the machine has cores, so two runs on one machine
(``launcher=submitit_local``, a sweep's jobs sharing a node, two commands typed by hand) start
twice as many busy threads as there are cores and thrash: on a 2-core machine two quickstarts
together took 4× one of them. A run takes, in this order:

1. ``train.num_threads`` when set;
2. ``OMP_NUM_THREADS`` when the user exported it;
3. in a SLURM job, the CPUs SLURM gave each task (``SLURM_CPUS_PER_TASK``);
4. otherwise the cores it may run on divided by the kdrun runs alive on the host.

Every run registers in ``<tmp>/kdrun-runs-<uid>/`` with a file it holds an ``flock`` on for its
lifetime (the kernel drops it when the process dies, even after ``kill -9``), so counting the
held files counts live runs; jobs started together (a submitit_local array) register before any
of them counts, at the start of the task, seconds before torch is first used.

The number never changes during a run: thread counts change floating-point summation order, and a
run's result must not depend on when another run started or ended.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REGISTRATION: dict[str, Any] = {}


def registry_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kdrun-runs-{os.getuid()}"


def register_run() -> bool:
    """Count this process among the live kdrun runs on the host; False when it already counts."""
    if "fd" in _REGISTRATION:
        return False
    d = registry_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{os.getpid()}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # an unwritable tmp: the run counts as alone
        return False
    _REGISTRATION.update(fd=fd, path=path)
    return True


def release_run() -> None:
    """Stop counting this process (its run has ended but the process goes on: a notebook, pytest)."""
    fd, path = _REGISTRATION.pop("fd", None), _REGISTRATION.pop("path", None)
    if fd is not None:
        path.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def registered_run():
    """Counted among the live runs for the block, unless already counted (the kdrun command registers
    once for its whole process, before Hydra starts the jobs)."""
    mine = register_run()
    try:
        yield
    finally:
        if mine:
            release_run()


def live_runs() -> int:
    """kdrun runs alive on the host (this one included), removing entries of dead ones."""
    alive = 0
    for path in registry_dir().glob("*.lock"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            alive += 1  # held by a live run (this one's own file too: flock locks are per open file)
        else:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return max(alive, 1)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def choose_threads(num_threads: int | None, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(threads, why) for a run with ``train.num_threads=num_threads`` in environment ``env``."""
    env = os.environ if env is None else env
    if num_threads:
        return int(num_threads), "train.num_threads"
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    if env.get("SLURM_JOB_ID") and env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(env["SLURM_CPUS_PER_TASK"]), "SLURM cpus_per_task"
    cores, runs = usable_cores(), live_runs()
    return max(1, cores // runs), f"{cores} cores / {runs} kdrun runs on the host"


def apply_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for this run (see the module docstring); returns the number."""
    import torch

    n, why = choose_threads(num_threads)
    torch.set_num_threads(n)  # data-loading workers run single-threaded (torch's DataLoader sets it)
    print(f"[kdrun] {n} compute thread{'s' if n > 1 else ''} ({why}; train.num_threads=N to choose)", flush=True)
    return n
