"""The angle kernel of :mod:`kdrun.losses.relations`: matching losses of triple-wise relations,
swept in chunks of (point set, vertex) with the gradient fused into the forward pass.

:func:`kdrun.losses.relations.angle_loss` prepares the Gram matrices and per-vertex pieces of both
sides and calls :class:`AngleLoss`; nothing of size n^3 (or n w^2) outlives a chunk.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

# Row entries outside the valid set get this logit before a softmax: exp() underflows to exactly 0
# while everything stays finite (so no 0 * inf in forward or backward).
MASKED_LOGIT = -1e9
# Elements per chunk of the angle kernel: ~1 MiB of fp32 on CPU (stays in cache), 64 MiB on GPUs
# (enough work per kernel launch). Peak extra memory is a handful of chunks.
CHUNK_ELEMS = {"cpu": 1 << 18, "cuda": 1 << 24}


@contextmanager
def chunked_as(device_type: str) -> Iterator[None]:
    """Chunk the angle kernel on every device as on ``device_type`` while entered (a CPU then
    dispatches the ops a GPU step launches: kdrun.app.doctor_steps.step_ops)."""
    saved = dict(CHUNK_ELEMS)
    CHUNK_ELEMS.update(dict.fromkeys(saved, saved[device_type]))
    try:
        yield
    finally:
        CHUNK_ELEMS.update(saved)


def _chunks(P: int, n: int, w: int, chunk_elems: int) -> Iterator[tuple[int, int, int, int]]:
    """(p0, p1, j0, j1) blocks of (point set, vertex) whose (pc, jc, w, w) slab has ~chunk_elems."""
    per_vertex = w * w
    v = max(1, chunk_elems // per_vertex)
    if v >= n:
        pc = max(1, v // n)
        for p0 in range(0, P, pc):
            yield p0, min(P, p0 + pc), 0, n
    else:
        for p0 in range(P):
            for j0 in range(0, n, v):
                yield p0, p0 + 1, j0, min(n, j0 + v)


def cosines(H: torch.Tensor, c: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos[., j, a, b] = inv_a inv_b (H_ab + c_a + c_b), clamped to [-1, 1]; also the inv_a inv_b product."""
    cos = H + c[..., :, None]
    cos += c[..., None, :]
    scale = inv[..., :, None] * inv[..., None, :]
    cos *= scale
    cos.clamp_(-1.0, 1.0)
    return cos, scale


def _chunk_loss(
    cs: torch.Tensor, ct: torch.Tensor, valid: torch.Tensor, loss: str, beta: float, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """Summed loss of one chunk, E = dLoss/dcos_s (mse: half of it), and whether E is symmetric.

    ``ct`` is overwritten.
    """
    if loss == "kl":
        vb = valid[..., None, :].expand_as(cs)
        ls = F.log_softmax(cs.masked_fill(~vb, MASKED_LOGIT), dim=-1)
        lt = F.log_softmax(ct.masked_fill(~vb, MASKED_LOGIT), dim=-1)
        pt = lt.exp()
        rows = valid.to(cs.dtype)
        val = ((pt * (lt - ls)).sum(-1) * rows).sum()
        e = (ls.exp() - pt) * rows[..., :, None] if want_grad else None
        return val, e, False
    diff = torch.sub(cs, ct, out=ct)  # ct is not needed any more
    if loss == "mse":
        flat = diff.reshape(-1)
        return torch.dot(flat, flat), diff if want_grad else None, True
    if loss == "l1":
        return diff.abs().sum(), diff.sign() if want_grad else None, True
    val = F.smooth_l1_loss(diff, torch.zeros_like(diff), reduction="sum", beta=beta)
    return val, (diff.clamp(-beta, beta) / beta) if want_grad else None, True


class AngleLoss(torch.autograd.Function):
    """Sum over valid triples of LD(psi_s, psi_t), chunked over vertices, gradient fused into forward.

    Inputs are both sides' Gram matrices ``g`` (2, P, n, n) and per-vertex pieces ``c``, ``inv``
    (2, P, n, w) (``angle_pieces``), the student's at index 0 and the teacher's at 1 (no gradient
    flows to it), so each chunk's cosines of both sides are one set of ops. The forward sweeps
    (point set, vertex) chunks and, when a gradient is wanted, accumulates dL/dG, dL/dc, dL/dinv
    right away, so nothing of size n^3 (or n w^2) outlives a chunk and the backward pass only scales
    the stored gradients (the teacher's half stays 0).
    """

    @staticmethod
    def forward(ctx, g, c, inv, valid, window, loss, beta, chunk_elems, want):  # type: ignore[override]
        _, P, n, w = c.shape
        windowed = w < n
        if windowed:
            side = n + 2 * window
            src = F.pad(g, (window, window, window, window))
            # H[s, p, j, a, b] = Gpad[s, p, j + a, j + b]: a strided view, nothing gathered or copied.
            h_all = src.as_strided((2, P, n, w, w), (P * side * side, side * side, side + 1, side, 1))
            ar = torch.arange(w, device=g.device)
            flat_local = ar[:, None] * side + ar[None, :]  # (w, w) offsets from the vertex's corner
        grads = [torch.zeros_like(x) for x in ((src if windowed else g), c, inv)] if want else None
        total = torch.zeros((), dtype=torch.float64, device=g.device)  # no host sync per chunk
        for p0, p1, j0, j1 in _chunks(P, n, w, chunk_elems):
            h = h_all[:, p0:p1, j0:j1] if windowed else g[:, p0:p1, None]
            cos, scale = cosines(h, c[:, p0:p1, j0:j1], inv[:, p0:p1, j0:j1])
            val, e, sym = _chunk_loss(cos[0], cos[1], valid[p0:p1, j0:j1], loss, beta, want)
            total += val
            if want:
                _chunk_grads(grads, e, sym, cos[0], scale[0], inv[0, p0:p1, j0:j1], (p0, p1, j0, j1),
                             (side, flat_local) if windowed else None)
        if want:
            if windowed:
                grads[0] = grads[0][..., window:window + n, window:window + n].contiguous()
            ctx.save_for_backward(*grads)
            ctx.mse = loss == "mse"
        return total.to(g.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        k = 2.0 * grad_out if ctx.mse else grad_out  # mse: E is half the derivative
        return tuple(k * d for d in ctx.saved_tensors) + (None,) * 6


def _chunk_grads(grads, e, sym: bool, cos_s, scale, ich, block, windowed) -> None:
    """Add one chunk's dL/dG, dL/dc, dL/dinv (student half) to ``grads`` in place."""
    dg, dc, dinv = grads
    p0, p1, j0, j1 = block
    f = e * scale  # dL/dH_ab = dL/dc.. = E_ab inv_a inv_b
    ec = e.mul_(cos_s)  # dL/dinv_a = sum_b (E_ab + E_ba) cos_ab / inv_a
    if sym:
        dc[0, p0:p1, j0:j1].add_(f.sum(-1), alpha=2.0)
        t = 2.0 * ec.sum(-1)
    else:
        dc[0, p0:p1, j0:j1].add_(f.sum(-1) + f.sum(-2))
        t = ec.sum(-1) + ec.sum(-2)
    dinv[0, p0:p1, j0:j1].add_(t * torch.where(ich > 0, ich.reciprocal(), torch.zeros_like(ich)))
    if windowed is None:
        dg[0, p0:p1].add_(f.sum(1))
        return
    side, flat_local = windowed
    corner = torch.arange(j0, j1, device=dg.device) * (side + 1)
    index = (corner[:, None, None] + flat_local[None]).reshape(-1)
    dg[0, p0:p1].view(p1 - p0, -1).index_add_(1, index, f.reshape(p1 - p0, -1))
