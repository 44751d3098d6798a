"""Deprecated names: kept working for one release, each with a one-line warning (once per process)."""

from __future__ import annotations

import sys

_WARNED: set[str] = set()


def deprecated(old: str, new: str) -> None:
    """Print once per process that ``old`` is a deprecated name of ``new``."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    print(f"kdrun: warning: {old} is deprecated and will be removed in the next release; use {new}", file=sys.stderr)
