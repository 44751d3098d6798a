"""The error augmentation raises for problems a user can fix from the message alone."""

from __future__ import annotations

from kdrun.errors import UserError


class AugmentationError(UserError, ValueError):
    """An augmentation setting that cannot work; the message names the config key and what to do."""
