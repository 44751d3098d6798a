"""Loss terms: pure functions over feature records, registered by name."""

from kdrun.losses.registry import LOSSES, LossContext, LossSpec, check_params, get_loss, register_loss

__all__ = ["LOSSES", "LossContext", "LossSpec", "check_params", "get_loss", "register_loss"]
