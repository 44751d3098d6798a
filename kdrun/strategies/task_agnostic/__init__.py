"""Deprecated name of :mod:`kdrun.strategies.general` (general, task-agnostic distillation), kept for
one release: importing it warns once and makes its modules (``kind``, ``data``, ``evaluate``,
``models``, and ``probe`` for ``kdrun.strategies.general.cli``) the new package's."""

from __future__ import annotations

import importlib
import sys

from kdrun.runtime.deprecation import deprecated
from kdrun.strategies.general import *  # noqa: F401,F403  (the package's names, as before)

deprecated("the package kdrun.strategies.task_agnostic", "kdrun.strategies.general")
for _old, _new in (("kind", "kind"), ("data", "data"), ("evaluate", "evaluate"), ("models", "models"),
                   ("probe", "cli")):
    globals()[_old] = sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f"kdrun.strategies.general.{_new}")
