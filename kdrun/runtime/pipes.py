"""Every kdrun command ends quietly when its output closes early (``kdrun-cache list | head -1``):
no traceback, no logging error, and the exit status of a process that SIGPIPE ended (141, as the
shell reports ``yes | head -1``), unless the command already failed with its own status.

:func:`quiet_on_closed_pipe` wraps a command's ``main`` (kdrun.app.commands wraps each console
script of pyproject.toml); :func:`end_quietly` is its ending, also called where a command catches
the error itself.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable

from kdrun.runtime.logs import CONSOLE_LOST

CLOSED_PIPE_STATUS = 141  # 128 + SIGPIPE


def quiet_on_closed_pipe(main: Callable[..., Any]) -> Callable[..., Any]:
    """``main`` ending quietly when stdout is gone: its own status otherwise."""

    @functools.wraps(main)
    def command(*args: Any, **kwargs: Any) -> Any:
        quiet_logging_on_closed_pipe()
        try:
            status = main(*args, **kwargs)
        except BrokenPipeError as e:
            end_quietly(0, e)
            raise  # not reached: end_quietly exits
        except SystemExit as e:
            end_quietly(e.code)
            raise
        end_quietly(status)
        return status

    return command


def end_quietly(status: int | str | None, lost: OSError | None = None) -> None:
    """End without a traceback when stdout is gone: a closed pipe with status 141; another output
    error (a full disk under ``kdrun ... > file``) with one line on stderr and status 1, unless the
    command already failed with its own status. Returns when stdout works."""
    lost = lost or (CONSOLE_LOST[0] if CONSOLE_LOST else None)
    try:
        sys.stdout.flush()
    except OSError as e:
        lost = lost or e
    except ValueError:  # stdout closed by the command itself
        return
    if lost is None:
        return
    _stdout_to_devnull()
    failed = status not in (0, None)
    if isinstance(lost, BrokenPipeError):
        sys.exit(status if isinstance(status, int) and failed else CLOSED_PIPE_STATUS)
    if not failed:
        prog = os.path.basename(sys.argv[0]) or "kdrun"
        print(f"{prog}: error: the output could not be written ({lost.strerror}); the command itself is complete",
              file=sys.stderr)
    sys.exit(status if isinstance(status, int) and failed else 1)


def _stdout_to_devnull() -> None:
    """Point stdout's descriptor at /dev/null, so Python's own flush at exit finds a working stdout."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no descriptor behind sys.stdout (a test's capture)
        pass
    finally:
        os.close(devnull)


def quiet_logging_on_closed_pipe() -> None:
    """Logging handlers (Hydra's console log among them) drop a record quietly when their stream's
    reader went away, instead of printing "--- Logging error ---" with a traceback; other handler
    errors are reported as before. Idempotent."""
    original = logging.Handler.handleError
    if getattr(original, "quiet_on_closed_pipe", False):
        return

    def handle_error(self: logging.Handler, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            original(self, record)

    handle_error.quiet_on_closed_pipe = True  # type: ignore[attr-defined]
    logging.Handler.handleError = handle_error  # type: ignore[method-assign]
