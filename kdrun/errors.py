"""Errors a user fixes from the message alone.

``kdrun`` (and kdrun-augment) print a :class:`UserError` as one line, ``kdrun: error: <message>``,
and exit with status 2. Any other exception is a bug in kdrun or a library and keeps its traceback
(exit status 1), so it is never mistaken for a bad setting.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of kdrun's user-facing errors: the message names the key, file or model and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the key and what to do.

    Also a ValueError, so code that checked settings with ``except ValueError`` still catches it.
    """
