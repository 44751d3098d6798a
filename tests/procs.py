"""The processes a test started, found after it ended: every child inherits ``KDRUN_TEST_TMP=<the
test's tmp dir>`` from the test's environment (set by the ``no_leftover_processes`` fixture of
tests/conftest.py), and kdrun's runs name the tmp dir on their command lines. A process in a
process group of its own (setsid: wandb's service, a SLURM job's steps, an orphaned torchrun worker) is
found the same way, which a walk of the test process's children would miss. Linux only (/proc)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

TAG = "KDRUN_TEST_TMP"


def _read(pid: str, name: str) -> bytes:
    try:
        return Path("/proc", pid, name).read_bytes()
    except OSError:  # gone meanwhile, or a kernel thread
        return b""


def command_line(pid: int) -> str:
    return _read(str(pid), "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


# Helpers that multiprocessing starts once for the test process and keeps for its life (mp.spawn
# starts the resource tracker): they end with the pytest process, not with the test.
OWN_HELPERS = (b"from multiprocessing.resource_tracker import main", b"from multiprocessing.forkserver import main")


def _own_helper(pid: str, cmd: bytes) -> bool:
    parent = _read(pid, "stat").rsplit(b")", 1)[-1].split()[1:2]  # after "pid (comm)": state, ppid
    return parent == [str(os.getpid()).encode()] and any(h in cmd for h in OWN_HELPERS)


def processes_of(tmp: Path) -> dict[int, str]:
    """Live processes other than this one whose environment holds ``KDRUN_TEST_TMP=<tmp>`` or whose
    command line names ``tmp`` or a path under it: pid -> command line (zombies, which have neither,
    are not counted: they have ended; nor this process's own multiprocessing helpers)."""
    tag, path = f"{TAG}={tmp}\0".encode(), str(tmp).encode()
    me, found = os.getpid(), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        cmd = _read(d.name, "cmdline")
        args = cmd.split(b"\0")
        named = any(a == path or a.startswith(path + b"/") or b"=" + path + b"/" in a for a in args)
        if (named or tag in b"\0" + _read(d.name, "environ")) and not _own_helper(d.name, cmd):
            found[int(d.name)] = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def wait_gone(find, timeout: float) -> dict[int, str]:
    """Poll ``find()`` (pid -> command line) until it is empty or ``timeout`` seconds have passed;
    what is left."""
    deadline = time.monotonic() + timeout
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def descendants(pid: int) -> list[int]:
    """The children of ``pid``, their children, and so on."""
    out, todo = [], [pid]
    while todo:
        for task in Path("/proc", str(todo.pop()), "task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def slurm_steps(conf: str, jobs: set[str] | None = None) -> dict[int, str]:
    """The slurmstepd processes of the SLURM whose configuration is ``conf`` (their environment names
    it; ``jobs``: only those of these job ids) and everything under them: pid -> command line."""
    want, found = f"SLURM_CONF={conf}\0".encode(), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or _read(d.name, "comm").strip() != b"slurmstepd":
            continue
        cmd = command_line(int(d.name))  # "slurmstepd: [12.batch]"
        if want in b"\0" + _read(d.name, "environ") and (jobs is None or any(f"[{j}." in cmd for j in jobs)):
            found[int(d.name)] = cmd
            found.update({p: command_line(p) for p in descendants(int(d.name))})
    return found


def slurm_daemons(conf: str) -> dict[int, str]:
    """slurmctld and slurmd processes started with ``-f <conf>``: pid -> command line."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            cmd = command_line(int(d.name))
            if cmd.split(" ")[0].rsplit("/", 1)[-1] in ("slurmctld", "slurmd") and f"-f {conf}" in cmd:
                found[int(d.name)] = cmd
    return found
