"""What a run leaves behind for whoever reads its directory later: ``cli.log`` and ``error.json``.

kdrun reports through ``print``, so :func:`tee_output` copies everything the process writes to
stdout and stderr into ``<run_dir>/cli.log`` (appended, one section per invocation; a progress
bar's carriage-return updates collapse to their last state). A run that fails writes
:func:`record_failure`'s ``error.json``; ``kdrun-report`` lists it with its error.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

from kdrun.errors import UserError


class _LineLog:
    """Whole lines to a file; of a line rewritten with ``\\r`` only its final text is kept."""

    def __init__(self, file: TextIO):
        self.file = file
        self.pending = ""

    def write(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        if lines:
            self.file.write("".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines))
            self.file.flush()

    def close(self) -> None:
        if self.pending:
            self.write("\n")


# The console error that stopped kdrun's output (a closed pipe: ``kdrun ... | head``; a full disk
# under ``kdrun ... > file``), if any: the run goes on, logging to cli.log, and kdrun.cli ends quietly.
CONSOLE_LOST: list[OSError] = []


class _Tee:
    """A text stream that writes to ``stream`` and to a :class:`_LineLog`. When the stream fails (its
    reader went away, its disk is full) the run goes on: the text still reaches the log."""

    def __init__(self, stream: TextIO, log: _LineLog):
        self._stream = stream
        self._log = log

    def _to_stream(self, method: str, *args: str) -> None:
        if CONSOLE_LOST:
            return
        try:
            getattr(self._stream, method)(*args)
        except OSError as e:
            CONSOLE_LOST.append(e)

    def write(self, text: str) -> int:
        self._to_stream("write", text)
        try:
            self._log.write(text)
        except (OSError, ValueError):  # a full disk must not break the run's own output
            pass
        return len(text)

    def flush(self) -> None:
        self._to_stream("flush")

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the real stream
        return getattr(self._stream, name)


@contextmanager
def tee_output(path: Path, enabled: bool = True) -> Iterator[None]:
    """Copy stdout and stderr into ``path`` (appended) for the block."""
    if not enabled:
        yield
        return
    file = open(path, "a", encoding="utf-8")
    file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {socket.gethostname()}: {' '.join(sys.argv)}\n")
    file.flush()
    logs = _LineLog(file), _LineLog(file)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(saved[0], logs[0]), _Tee(saved[1], logs[1])
    records = _log_records_to(logs[1])
    try:
        yield
    finally:
        logging.getLogger().removeHandler(records)
        sys.stdout, sys.stderr = saved
        for log in logs:
            log.close()
        file.close()


def _log_records_to(log: _LineLog) -> logging.Handler:
    """Copy the logging module's records (Hydra's, libraries') into the log, as Hydra's format."""
    handler = logging.StreamHandler(log)  # type: ignore[arg-type]  # write() is all it needs
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def log_only(path: Path, text: str) -> None:
    """Append ``text`` to the log without printing it (a traceback the caller prints its own way)."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError:
        pass


def failure_record(error: BaseException, progress: dict[str, Any]) -> dict[str, Any]:
    """error.json's content: the error, its traceback and how far the run got."""
    return {
        "type": type(error).__name__,
        "message": str(error),
        "user_error": isinstance(error, UserError),
        "traceback": "".join(traceback.format_exception(error))[-8000:],
        **{k: v for k, v in progress.items() if v is not None},
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": socket.gethostname(),
        "command": " ".join(sys.argv),
    }


def record_failure(run_dir: Path, error: BaseException, progress: dict[str, Any]) -> None:
    """Write ``error.json`` (atomically; a failure to write it must not hide the error itself)."""
    from kdrun.runtime.cache import write_json_atomic

    record = failure_record(error, progress)
    try:
        write_json_atomic(run_dir / "error.json", record)
    except OSError:
        return
    log_only(run_dir / "cli.log", record["traceback"] if not record["user_error"] else f"kdrun: error: {error}")


class DiskFull(UserError):
    """A write failed for want of space; the message names the path and what to do."""


def _free_mib(path: Path) -> float | None:
    import os

    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize / 2**20
        except OSError:
            continue
    return None


def disk_full(error: BaseException, places: dict[str, Path]) -> DiskFull | None:
    """The one-line error for a write that failed on a full disk (ENOSPC or EDQUOT anywhere in the
    exception's chain, also as the text that safetensors and torch.save give), or None. It names the
    failed file when the error does, else the one of ``places`` (e.g. output_dir, cache_dir) with the
    least free space."""
    import errno

    seen, e = [], error
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    codes = {errno.ENOSPC, errno.EDQUOT}
    hit = next((x for x in seen if isinstance(x, OSError) and x.errno in codes), None)
    if hit is None and not any(s in str(x) for x in seen for s in ("No space left", "StorageFull", "Disk quota")):
        return None
    free = {name: _free_mib(Path(p)) for name, p in places.items()}
    name = min(free, key=lambda k: free[k] if free[k] is not None else float("inf"))
    where = getattr(hit, "filename", None) or places[name]
    return DiskFull(f"no space left on the device holding {where} ({name}={places[name]}, "
                    f"{free[name] or 0:.1f} MiB free): free space there or point {name} elsewhere, then rerun: "
                    "the run resumes from its last checkpoint and unfinished cache entries are rebuilt")
