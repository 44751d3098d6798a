"""Importing plug-in modules: those an installed package lists under an entry-point group, and those
a config names (``objective.imports``, ``task.imports``). Their registration calls run on import."""

from __future__ import annotations

import importlib
from typing import Iterable


def import_entry_point_modules(group: str, what: str) -> None:
    """Import the module of every entry point of ``group``; ImportError naming the plug-in (``what``
    says what it provides, e.g. "loss plug-in")."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=group):
        try:
            importlib.import_module(ep.value.split(":")[0])
        except ImportError as e:
            raise ImportError(f"{what} '{ep.name}' ({ep.value}, entry point group {group}) cannot be imported: "
                              f"{e}") from e


def import_listed_modules(modules: Iterable[str] | None, where: str, error: type[Exception] = ValueError) -> None:
    """Import the modules a config key lists; ``error`` naming ``where[i]`` and what to do when one
    cannot be imported."""
    for i, module in enumerate(modules or ()):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise error(f"{where}[{i}]: cannot import '{module}' ({e}); install the package that provides it "
                        "or put its directory on PYTHONPATH") from None
