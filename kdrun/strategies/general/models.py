"""Teachers and students of a corpus task: bare encoders, or masked-LM models when a term reads the
masked-LM distribution (kdrun/strategies/general/__init__.py: ``head_for``)."""

from __future__ import annotations

from typing import Any

from kdrun.errors import ConfigError


def load_general(ref: str, head: str, need_attentions: bool = False):
    """A pre-trained teacher from ``ref`` with ``head`` (``encoder`` | ``mlm``) as it is: no task head.
    A checkpoint without masked-LM weights cannot give a masked-LM distribution: that is a
    ConfigError naming it, not a silently random head."""
    from transformers import AutoConfig

    from kdrun.models.loading import from_pretrained_quietly, missing_head_keys

    model, info = from_pretrained_quietly(ref, head, AutoConfig.from_pretrained(ref), need_attentions,
                                          output_loading_info=True)
    missing_head = missing_head_keys(model, info)
    if head == "mlm" and missing_head:
        raise ConfigError(
            f"teacher '{ref}' has no masked-LM head (its checkpoint lacks {missing_head[0]} …): the mlm_kd term "
            "needs the teacher's masked-LM distribution. Choose a teacher saved with its MLM head (e.g. "
            "bert-base-uncased) or an objective without mlm_kd (objective=ckd_general or tinybert_general)")
    return model


def general_teacher(cfg: Any, ref: str | None, head: str, vocab_size: int, pad_token_id: int, need_attentions: bool):
    """The teacher of a corpus run: the pre-trained model itself (random only in tests)."""
    from kdrun.models import loading as M

    tc = cfg.teacher
    if tc.kind == "random":
        return M.random_classifier(tc, vocab_size, 2, need_attentions, pad_token_id=pad_token_id, head=head)
    return load_general(ref, head, need_attentions)
