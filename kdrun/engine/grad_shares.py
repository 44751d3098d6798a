"""Loss-balance diagnostics (``logger.grad_shares``): each weighted loss term's gradient on the
student, its share of the summed norms and its cosine with the total gradient."""

from __future__ import annotations

import torch


def _flat_grad(value: torch.Tensor, params: list[torch.Tensor], scale: float) -> torch.Tensor:
    """d value / d params as one float32 vector (zeros where value does not depend on a parameter);
    the graph is kept for the training step's backward, and no ``.grad`` is touched."""
    if not value.requires_grad:
        return torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    grads = torch.autograd.grad(value * scale, params, retain_graph=True, allow_unused=True)
    flat = [(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)]
    return torch.cat(flat) / scale


def grad_share_logs(weighted: dict[str, torch.Tensor], params: list[torch.Tensor],
                    scale: float = 1.0) -> dict[str, float]:
    """Loss-balance diagnostics (``logger.grad_shares``) for one batch's weighted terms L_i.

    With g_i = dL_i/dθ over ``params`` (the student's trainable parameters) and g = Σ_i g_i (the
    total loss's gradient, before clipping): ``grad_norm/<i>`` = ‖g_i‖, ``grad_share/<i>`` =
    ‖g_i‖ / Σ_j ‖g_j‖ (sums to 1), ``grad_cos/<i>`` = cos(g_i, g) (negative: the term pulls against
    the total), ``grad_norm/total`` = ‖g‖, ``weighted/<i>`` = L_i. ``scale`` (the fp16 loss scale)
    keeps small gradients from underflowing and is divided out.
    """
    keys = list(weighted)
    flats = [_flat_grad(weighted[k], params, scale) for k in keys]
    gram = torch.stack([torch.stack([a @ b for b in flats]) for a in flats]).double()
    norms = gram.diagonal().clamp_min(0).sqrt()
    total = gram.sum().clamp_min(0).sqrt()
    shares = norms / norms.sum() if norms.sum() > 0 else torch.full_like(norms, float("nan"))
    cos = gram.sum(1) / (norms * total)  # <g_i, g> / (‖g_i‖ ‖g‖); NaN where a norm is 0
    out = {"grad_norm/total": float(total)}
    for i, k in enumerate(keys):
        out.update({f"grad_norm/{k}": float(norms[i]), f"grad_share/{k}": float(shares[i]),
                    f"grad_cos/{k}": float(cos[i]), f"weighted/{k}": float(weighted[k].detach())})
    return out
