"""Loss terms: pure functions over feature records that declare themselves (see registry)."""

from kdrun.losses.registry import (
    LOSSES,
    LossContext,
    LossSpec,
    NoParams,
    ParamError,
    Params,
    check_params,
    get_loss,
    param,
    register_loss,
    register_term_group,
)

__all__ = ["LOSSES", "LossContext", "LossSpec", "NoParams", "ParamError", "Params", "check_params", "get_loss",
           "param", "register_loss", "register_term_group"]
