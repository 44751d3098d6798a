"""The teacher's masked-LM distribution matched by the student's (general distillation).

CKD's task-agnostic setting (Park, Kim & Yang, 2021) trains the student on the masked-LM
probabilities of the teacher together with the contextual relations; DistilBERT (Sanh et al., 2019)
and TinyBERT's general stage use the same soft targets. Only the masked positions count: the batch
holds their flat indices (``mlm_positions``, made by the corpus collator, kdrun/strategies/general/data.py),
and the features record holds the two models' vocabulary logits there (``mlm_logits``, (M, V)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kdrun.losses.registry import LossContext, Params, param, positive, register_loss
from kdrun.models.features import Features, fp32


@dataclass(frozen=True)
class MLMParams(Params):
    temperature: float = param(1.0, check=positive)


@register_loss("mlm_kd", params=MLMParams, needs={"mlm_logits"})
def mlm_kd(s: Features, t: Features, batch, ctx: LossContext, p: MLMParams) -> torch.Tensor:
    """Soft cross-entropy -sum_v p_t(v) log p_s(v) at temperature T, mean over the masked tokens."""
    zs, zt = fp32(s.require("mlm_logits")), fp32(t.require("mlm_logits"))
    log_ps = F.log_softmax(zs / p.temperature, dim=-1)
    pt = F.softmax(zt / p.temperature, dim=-1)
    return -(pt * log_ps).sum(-1).mean()
