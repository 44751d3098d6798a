"""One writer per run directory: an exclusive lock held for the whole run.

Two processes training into one directory would interleave ``metrics.jsonl``, share a wandb run
id and overwrite each other's checkpoints, so :func:`run_dir_lock` takes ``<run_dir>/.kdrun.lock``
(``flock``: released by the kernel when the holder exits, even after ``kill -9``) and writes who
holds it into the file. A second process fails at once naming the holder, or with ``resume=wait``
waits for it and then resumes or reports what the first one left.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kdrun.errors import UserError

LOCK_NAME = ".kdrun.lock"


class RunDirBusy(UserError):
    """Another process holds the run directory's lock."""


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')} (since {started})"


def _write_holder(fd: int) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


@contextmanager
def run_dir_lock(run_dir: Path, wait: bool = False, claim: bool = True) -> Iterator[None]:
    """Hold ``run_dir``'s exclusive lock for the block; raise :class:`RunDirBusy` (or wait) if taken.
    ``claim=False`` (reporting a finished run) writes nothing: no lock file is created, no holder
    recorded."""
    if not claim and not (run_dir / LOCK_NAME).exists():
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | (os.O_CREAT if claim else 0), 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not wait:
                raise RunDirBusy(
                    f"run directory {run_dir} is in use by {holder}; wait for that run to end (or stop it), "
                    "rerun with resume=wait to wait for it, or choose another output_dir") from None
            print(f"[kdrun] run directory {run_dir} is in use by {holder}; waiting (resume=wait)", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        if claim:
            _write_holder(fd)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
