"""kdrun's console commands (pyproject.toml [project.scripts]): each command's ``main``, ended
quietly when its output closes early (kdrun.runtime.pipes). A command imports its module when it
starts, so each loads only what it needs."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from kdrun.runtime.pipes import quiet_on_closed_pipe

# command -> "module:function" of its main (kdrun.cli.main, the kdrun command, is wrapped where it is
# defined, as python -m kdrun runs it too)
MAINS = {
    "kdrun-report": "kdrun.report.cli:main",
    "kdrun-spans": "kdrun.strategies.phrases.cli:main",
    "kdrun-augment": "kdrun.strategies.augment.cli:main",
    "kdrun-export": "kdrun.app.export:main",
    "kdrun-general": "kdrun.strategies.general.cli:main",
    "kdrun-doctor": "kdrun.app.doctor:main",
    "kdrun-cache": "kdrun.runtime.cache_cli:main",
}


def _command(name: str) -> Callable[[], Any]:
    module, function = MAINS[name].split(":")

    @quiet_on_closed_pipe
    def command(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), function)(*args, **kwargs)

    command.__name__ = command.__qualname__ = name.replace("-", "_")
    command.target = MAINS[name]  # type: ignore[attr-defined]  # the main it runs, "module:function"
    return command


report = _command("kdrun-report")
spans = _command("kdrun-spans")
augment = _command("kdrun-augment")
export = _command("kdrun-export")
general = _command("kdrun-general")
doctor = _command("kdrun-doctor")
cache = _command("kdrun-cache")
