"""``python -m kdrun ARGS`` runs forked from a server process that imported kdrun's libraries once.

A process of ``python -m kdrun`` spends some 5 s of a 2-core CPU importing torch, transformers,
datasets, evaluate and accelerate before kdrun reads its command line: most of a tiny run. Scripts
that start many tiny runs (the fuzz scripts) start them with :func:`start` or :func:`call` instead.
A server process (Python's ``multiprocessing`` forkserver, :data:`PRELOAD` imported once) forks each
run; the fork then does what ``python -m kdrun ARGS`` does (``runpy`` runs the ``kdrun`` package as
``__main__``, ``sys.argv[1:]`` = ARGS; ``module=``: another module, ``script=``: ``python SCRIPT ARGS``)
in the run's environment, working directory and output file,
leading a process group of its own (setsid) if asked. It is the run's process: its ``pid`` takes
signals; its exit status reads as ``subprocess.Popen.returncode`` does (negative: the signal that
ended it); at its end it runs the ``atexit`` handlers and waits for its threads as an interpreter does.

What differs from a fresh process is what the server did before the fork: it imported
:data:`PRELOAD` under the environment of the first run, and libraries read some settings while they
are imported (``HF_HUB_OFFLINE``, ``HF_DATASETS_CACHE``, ``OMP_NUM_THREADS`` ...). So a run whose
environment differs from the first run's in anything but the settings read only while a run runs
(:data:`RUN_TIME`: ``PYTHONPATH``, whose entries the fork puts on ``sys.path`` as the interpreter
would; kdrun's own ``KDRUN_*``; wandb's ``WANDB_*``, wandb being imported by the run, not the
server; Hydra's ``HYDRA_FULL_ERROR``; ``TOKENIZERS_PARALLELISM``, read when tokenizers parallelise;
torch.distributed's ``MASTER_ADDR`` and ``MASTER_PORT``, read when a process group starts;
pytest's ``PYTEST_CURRENT_TEST``) gets a plain ``python -m kdrun`` process (``subprocess.Popen``),
as does every run under ``KDRUN_FORKRUN=0``. Settings a preloaded library sets itself when imported
(:data:`SET_BY_IMPORT`: scikit-learn's ``KMP_*``) do not count: the fork has them as a fresh
process would after the import.

The forked run's ``/proc/PID/environ`` shows the server's environment: the run's own is set with
``os.environ`` after the fork (the processes it starts get the run's).

:func:`fork_module` forks from the calling process instead of a server (the CPU device check's
checks, forked from the doctor after it imported their libraries).
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
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any, Iterator

PRELOAD = ("kdrun.cli", "kdrun.app.run", "transformers.models.bert.modeling_bert", "datasets", "evaluate",
           "sklearn.metrics", "scipy.stats", "accelerate")
RUN_TIME = ("PYTHONPATH", "PYTEST_CURRENT_TEST", "HYDRA_FULL_ERROR", "TOKENIZERS_PARALLELISM", "KDRUN_*",
            "WANDB_*", "MASTER_ADDR", "MASTER_PORT")  # read while a run runs, not at import ("X_*": X_ and more)
# Set by a preloaded library when it is imported (scikit-learn: os.environ.setdefault), so a caller that
# has imported it carries them and one that has not does not: the fork sets them as the import would.
SET_BY_IMPORT = ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")
_SERVER: dict[str, Any] = {}  # "env": the environment the server imported PRELOAD under


def _run_as_main(args: list[str], env: dict[str, str], cwd: str, out: str, new_session: bool,
                 err: str | None = None, script: str | None = None, module: str = "kdrun") -> None:
    """The forked run: ``python -m MODULE *args`` (``script``: ``python SCRIPT *args``) in ``env`` and
    ``cwd``, stdout to ``out`` and stderr to ``err`` (None: to ``out`` too), both appended."""
    if new_session:
        os.setsid()
    imported = {k: os.environ[k] for k in SET_BY_IMPORT if k in os.environ}
    os.environ.clear()
    os.environ.update({**imported, **env})
    sys.stdout.flush()
    sys.stderr.flush()
    for target, path in ((1, out), (2, err or out)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    # sys.path[0]: the script's folder (python SCRIPT) or the working directory (python -m)
    first = [os.path.dirname(os.path.abspath(script)) if script else cwd,
             *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:] = [*first, *(p for p in sys.path if p not in first and p not in ("", "."))]
    sys.argv = [script, *args] if script else ["-m", *args]  # runpy puts the module's path first, as -m does
    try:
        if script:
            runpy.run_path(os.path.abspath(script), run_name="__main__")  # __file__ and sys.argv[0] absolute
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
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
    """The settings a library may read while it is imported: all but :data:`RUN_TIME`'s and those a
    preloaded library sets itself (:data:`SET_BY_IMPORT`)."""
    return {k: v for k, v in env.items() if k not in SET_BY_IMPORT and not any(
        k == r or r.endswith("*") and k.startswith(r[:-1]) for r in RUN_TIME)}


def _command(args: list[str], script: str | None, module: str) -> list[str]:
    """The new interpreter's command: ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``."""
    return [sys.executable, *([script] if script else ["-m", module]), *args]


def enabled(env: dict[str, str] | None = None) -> bool:
    """Whether processes are forked here: on POSIX, unless ``KDRUN_FORKRUN=0`` (in ``env``, else in this
    process's environment)."""
    value = (env or {}).get("KDRUN_FORKRUN", os.environ.get("KDRUN_FORKRUN", "1"))
    return value != "0" and os.name == "posix"


def start(args: list[str], env: dict[str, str], out: Path, cwd: Path | None = None,
          new_session: bool = False, err: Path | None = None, script: str | None = None,
          module: str = "kdrun") -> Run | subprocess.Popen:
    """Start ``python -m MODULE *args`` (``script``: ``python SCRIPT *args``, the path relative to
    ``cwd``; stdout appended to ``out``, stderr to ``err`` or else ``out``): forked where it can be."""
    cwd = str(cwd or os.getcwd())
    if enabled(env):
        ctx = _context(env)
        if ctx is not None:
            process = ctx.Process(target=_run_as_main,
                                  args=(list(args), env, cwd, str(out), new_session, err and str(err), script,
                                        module))
            with _main_hidden():
                process.start()
            return Run(process, list(args))
    with contextlib.ExitStack() as files:
        f = files.enter_context(open(out, "a"))
        e = files.enter_context(open(err, "a")) if err else subprocess.STDOUT
        return subprocess.Popen(_command(args, script, module), stdout=f, stderr=e, env=env, cwd=cwd,
                                start_new_session=new_session)


def call(args: list[str], env: dict[str, str], out: Path, cwd: Path | None = None) -> int:
    """Run ``python -m kdrun *args`` to its end (output appended to ``out``); its exit status."""
    return start(args, env, out, cwd).wait()


def run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float | None = None, script: str | None = None, module: str = "kdrun") -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, MODULE, *args], capture_output=True, text=True, timeout=...)``
    (``script``: ``[python, SCRIPT, *args]``), forked where it can be: the run is killed at the timeout
    (``subprocess.TimeoutExpired``)."""
    with tempfile.TemporaryDirectory(prefix="kdrun-forkrun-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = start(list(args), dict(os.environ if env is None else env), out, cwd, err=err, script=script,
                     module=module)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(_command(args, script, module), rc, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


# ------------------------------------------------------- ``python -m MODULE`` forked from this process

class Forked:
    """A child forked by :func:`fork_module`, read as a ``subprocess.Popen``: ``pid``, ``poll()``,
    ``wait(timeout)``, ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Blocks without a timeout; with one, polls every millisecond at most and never sleeps past it."""
        if timeout is None:
            if self.returncode is None:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(min(0.001, left))
        return self.returncode


def _exit_status(module: str, args: list[str]) -> int:
    """``sys.exit(MODULE.main(ARGS))`` as an interpreter ends: its exit status."""
    import importlib

    try:
        code = importlib.import_module(module).main(list(args))
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - printed and exit status 1, as an interpreter does
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def fork_module(module: str, args: list[str], env: dict[str, str] | None = None, stdout: int | None = None,
                stderr: int | None = None, new_session: bool = False) -> Forked:
    """``python -m MODULE ARGS`` (MODULE's ``main(argv)``) in a child forked from this process, which has
    its imports: for a process that has imported libraries and run nothing on them yet (no thread pool
    started, no CUDA initialised), as a preloading server has. ``stdout``/``stderr``: file descriptors
    (None: this process's); ``env``: the child's environment (None: this one's). The child runs the
    ``atexit`` handlers it registers itself, not this process's (which may remove this process's files)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid, [module, *args])
    code = 1
    try:
        atexit._clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if new_session:
            os.setsid()
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for target, fd in ((1, stdout), (2, stderr)):
            if fd is not None:
                os.dup2(fd, target)
        sys.argv = [module, *args]
        code = _exit_status(module, args)
        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def start_module(module: str, args: list[str], fork: bool, env: dict[str, str] | None = None,
                 stdout: int | None = None, stderr: int | None = None,
                 new_session: bool = False) -> Forked | subprocess.Popen:
    """``python -m MODULE ARGS``: forked from this process (:func:`fork_module`) where ``fork``, else a
    new interpreter."""
    if fork and os.name == "posix":
        return fork_module(module, args, env, stdout, stderr, new_session)
    return subprocess.Popen(_command(args, None, module), stdout=stdout, stderr=stderr, env=env,
                            start_new_session=new_session)
