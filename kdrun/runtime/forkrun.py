"""``python -m kdrun ARGS`` runs forked from a server process that imported kdrun's libraries once.

A process of ``python -m kdrun`` spends some 5 s of a 2-core CPU importing torch, transformers,
datasets, evaluate and accelerate before kdrun reads its command line: most of a tiny run. Scripts
that start many tiny runs (the fuzz scripts) start them with :func:`start` or :func:`call` instead.
A server process (Python's ``multiprocessing`` forkserver, :data:`PRELOAD` imported once) forks each
run; the fork then does what ``python -m kdrun ARGS`` does (``runpy`` runs the ``kdrun`` package as
``__main__``, ``sys.argv[1:]`` = ARGS) in the run's environment, working directory and output file,
leading a process group of its own (setsid) if asked. It is the run's process: its ``pid`` takes
signals; its exit status reads as ``subprocess.Popen.returncode`` does (negative: the signal that
ended it); at its end it runs the ``atexit`` handlers and waits for its threads as an interpreter does.

What differs from a fresh process is what the server did before the fork: it imported
:data:`PRELOAD` under the environment of the first run, and libraries read some settings while they
are imported (``HF_HUB_OFFLINE``, ``HF_DATASETS_CACHE`` ...). So a run whose environment differs from
the first run's in anything but ``PYTHONPATH`` (the fork puts its entries on ``sys.path`` as the
interpreter would), kdrun's own ``KDRUN_*`` settings (read while it runs) and pytest's
``PYTEST_CURRENT_TEST`` gets a plain ``python -m kdrun`` process (``subprocess.Popen``), as does
every run under ``KDRUN_FORKRUN=0``.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Iterator

PRELOAD = ("kdrun.cli", "kdrun.app.run", "transformers.models.bert.modeling_bert", "datasets", "evaluate",
           "sklearn.metrics", "scipy.stats", "accelerate")
RUN_TIME = ("PYTHONPATH", "PYTEST_CURRENT_TEST")  # with KDRUN_*: read while a run runs, not at import
_SERVER: dict[str, Any] = {}  # "env": the environment the server imported PRELOAD under


def _run_as_main(args: list[str], env: dict[str, str], cwd: str, out: str, new_session: bool) -> None:
    """The forked run: ``python -m kdrun *args`` in ``env`` and ``cwd``, stdout and stderr to ``out``."""
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    first = [cwd, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:] = [*first, *(p for p in sys.path if p not in first and p not in ("", "."))]
    sys.argv = ["-m", *args]  # runpy puts the package's __main__.py first, as python -m does
    try:
        runpy.run_module("kdrun", run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # the fork ends with os._exit: run what an interpreter runs at its end


class Run:
    """A forked run, read as a ``subprocess.Popen``: ``pid``, ``poll()``, ``wait(timeout)``,
    ``returncode``, ``send_signal``, ``kill``."""

    def __init__(self, process: Any, args: list[str]) -> None:
        self._process, self.pid, self.args = process, process.pid, args

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["kdrun", *self.args], timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """multiprocessing imports the caller's ``__main__`` into each child it starts (for the targets
    pickled by reference to it); the run's target is kdrun's, so the child gets no ``__main__`` to import."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _context(env: dict[str, str]):
    """The forkserver context, its server started under ``env``; None where ``env`` is not the server's."""
    if "env" not in _SERVER:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(_at_import(env))  # not the first run's own settings: the server is no run's process
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _SERVER.update(env=dict(env), ctx=ctx)
    return _SERVER["ctx"] if _at_import(_SERVER["env"]) == _at_import(env) else None


def _at_import(env: dict[str, str]) -> dict[str, str]:
    """The settings a library may read while it is imported: all but PYTHONPATH, kdrun's own and the
    name of the test pytest is running."""
    return {k: v for k, v in env.items() if k not in RUN_TIME and not k.startswith("KDRUN_")}


def start(args: list[str], env: dict[str, str], out: Path, cwd: Path | None = None,
          new_session: bool = False) -> Run | subprocess.Popen:
    """Start ``python -m kdrun *args`` (output appended to ``out``): forked where it can be."""
    cwd = str(cwd or os.getcwd())
    if env.get("KDRUN_FORKRUN", os.environ.get("KDRUN_FORKRUN", "1")) != "0" and os.name == "posix":
        ctx = _context(env)
        if ctx is not None:
            process = ctx.Process(target=_run_as_main, args=(list(args), env, cwd, str(out), new_session))
            with _main_hidden():
                process.start()
            return Run(process, list(args))
    with open(out, "a") as f:
        return subprocess.Popen([sys.executable, "-m", "kdrun", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=new_session)


def call(args: list[str], env: dict[str, str], out: Path, cwd: Path | None = None) -> int:
    """Run ``python -m kdrun *args`` to its end (output appended to ``out``); its exit status."""
    return start(args, env, out, cwd).wait()
