"""The angle kernel of :mod:`kdrun.losses.relations`: matching losses of triple-wise relations,
swept in chunks of (point set, vertex) with the gradient fused into the forward pass.

:func:`kdrun.losses.relations.angle_loss` prepares the Gram matrices and per-vertex pieces of both
sides and calls :func:`angle_sum`; nothing of size n^3 (or n w^2) outlives a chunk. MGSKD's
salient triples (chosen vertices, each with its chosen neighbours) go through
:class:`SalientAngleLoss`, which reads the Gram entries it needs in one gather.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

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
    """Summed loss of one chunk, E = dLoss/dcos_s (mse: half of it; huber: beta times it), and whether E is
    symmetric.

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
    val = F.smooth_l1_loss(cs, ct, reduction="sum", beta=beta) if loss == "huber" else None
    diff = torch.sub(cs, ct, out=ct)  # ct is not needed any more
    if loss == "mse":
        flat = diff.reshape(-1)
        return torch.dot(flat, flat), diff if want_grad else None, True
    if loss == "l1":
        return diff.abs().sum(), diff.sign() if want_grad else None, True
    return val, diff.clamp_(-beta, beta) if want_grad else None, True  # 1/beta: the backward's factor


def angle_sum(g, c, inv, valid, window, loss: str, beta: float, chunk_elems: int, want: bool) -> torch.Tensor:
    """Sum over valid triples of LD(psi_s, psi_t), chunked over vertices, gradient fused into forward.

    Inputs are both sides' Gram matrices ``g`` (2, P, n, n) and per-vertex pieces ``c``, ``inv``
    (2, P, n, w) (``angle_pieces``), the student's at index 0 and the teacher's at 1 (no gradient
    flows to it), so each chunk's cosines of both sides are one set of ops. The forward sweeps
    (point set, vertex) chunks and, when a gradient is wanted (``want``), accumulates dL/dG, dL/dc,
    dL/dinv right away, so nothing of size n^3 (or n w^2) outlives a chunk and the backward pass only
    scales the stored gradients (the teacher's half stays 0).

    The sweep is one operator of its own (``kdrun::angle_sum``, :func:`torch.library.custom_op`):
    opaque to ``torch.compile``, which calls it as it is instead of tracing its chunk loop and its
    in-place accumulation (torch 2.11's tracing of that loop as an autograd.Function lost the
    gradients: zero under compile, right eagerly).
    """
    return _angle_op(g, c, inv, valid, window, loss, float(beta), int(chunk_elems), bool(want))[0]


# The schema is given, not inferred from the annotations, which this module postpones
# (``from __future__ import annotations``) and which older torch's inference could not read.
@torch.library.custom_op("kdrun::angle_sum", mutates_args=(), schema=(
    "(Tensor g, Tensor c, Tensor inv, Tensor valid, int? window, str loss, float beta, int chunk_elems, bool want)"
    " -> (Tensor, Tensor, Tensor, Tensor)"))
def _angle_op(g: torch.Tensor, c: torch.Tensor, inv: torch.Tensor, valid: torch.Tensor, window: Optional[int],
              loss: str, beta: float, chunk_elems: int, want: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, dL/dg, dL/dc, dL/dinv); the gradients empty when not ``want``."""
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
    total = None  # summed in fp64 over several chunks, no host sync per chunk
    for p0, p1, j0, j1 in _chunks(P, n, w, chunk_elems):
        h = h_all[:, p0:p1, j0:j1] if windowed else g[:, p0:p1, None]
        cos, scale = cosines(h, c[:, p0:p1, j0:j1], inv[:, p0:p1, j0:j1])
        val, e, sym = _chunk_loss(cos[0], cos[1], valid[p0:p1, j0:j1], loss, beta, want)
        total = val if total is None else (total if total.dtype == torch.float64 else total.double()) + val
        if want:
            _chunk_grads(grads, e, sym, cos[0], scale[0], inv[0, p0:p1, j0:j1], (p0, p1, j0, j1),
                         (side, flat_local) if windowed else None)
    total = total.to(g.dtype) if total is not None else g.new_zeros(())
    if not want:
        return total, *(x.new_empty(0) for x in (g, c, inv))
    if windowed:
        grads[0] = grads[0][..., window:window + n, window:window + n].contiguous()
    factor = 2.0 if loss == "mse" else 1.0 / beta if loss == "huber" else 1.0  # E is dL/dcos up to this
    return (total, *(d.mul_(factor) if factor != 1.0 else d for d in grads))


@_angle_op.register_fake
def _angle_shapes(g, c, inv, valid, window, loss, beta, chunk_elems, want):
    return (g.new_empty(()), *((x.new_empty(x.shape) if want else x.new_empty(0)) for x in (g, c, inv)))


def _angle_save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])


def _angle_backward(ctx, grad_total, *_):
    return (*(grad_total * d for d in ctx.saved_tensors), None, None, None, None, None, None)


_angle_op.register_autograd(_angle_backward, setup_context=_angle_save)


def _chunk_grads(grads, e, sym: bool, cos_s, scale, ich, block, windowed) -> None:
    """Add one chunk's dL/dG, dL/dc, dL/dinv (student half) to ``grads`` in place."""
    dg, dc, dinv = grads
    p0, p1, j0, j1 = block
    f = e * scale  # dL/dH_ab = dL/dc.. = E_ab inv_a inv_b
    ec = e.mul_(cos_s)  # dL/dinv_a = sum_b (E_ab + E_ba) cos_ab / inv_a
    if sym:
        dc[0, p0:p1, j0:j1].add_(f.sum(-1), alpha=2.0)
        t, k = ec.sum(-1), 2.0
    else:
        dc[0, p0:p1, j0:j1].add_(f.sum(-1) + f.sum(-2))
        t, k = ec.sum(-1) + ec.sum(-2), 1.0
    dinv[0, p0:p1, j0:j1].addcmul_(t, ich.reciprocal().nan_to_num_(posinf=0.0), value=k)  # 1/inv, 0 where inv is 0
    if windowed is None:
        dg[0, p0:p1].add_(f.sum(1))
        return
    side, flat_local = windowed
    corner = torch.arange(j0, j1, device=dg.device) * (side + 1)
    index = (corner[:, None, None] + flat_local[None]).reshape(-1)
    dg[0, p0:p1].view(p1 - p0, -1).index_add_(1, index, f.reshape(p1 - p0, -1))


# ----------------------------------------------------------------------------- salient triples

class SalientAngleLoss(torch.autograd.Function):
    """Σ over stacked layers of the mean smooth-L1 between the student's and the teacher's cosines at
    chosen vertices, each between every ordered pair of its chosen neighbours (MGSKD's salient
    triples), read from Gram matrices of centred points, gradient fused into the forward pass.

    Inputs: ``gs`` (P, n, n) the student's Gram matrices, ``gt`` the teacher's (no gradient), ``idx``
    (P, K1, 1 + K2) per vertex its index then its neighbours', ``valid`` (P, K1, K2) the neighbours
    that count, ``beta``, ``layers`` (P = layers x examples) and whether a gradient is wanted. Per
    vertex the (1 + K2)² Gram entries are gathered at once; a neighbour that is invalid or coincides
    with its vertex (squared distance below the tolerance ``tol`` s + ``tiny``) gives cos 0, and a
    pair of valid neighbours counts as a triple (a = b included: cos 1 on both sides).
    """

    @staticmethod
    def forward(ctx, gs, gt, idx, valid, beta, layers, tol, tiny, want):  # type: ignore[override]
        P, n, _ = gs.shape
        K = idx.shape[-1]
        flat = (idx[..., :, None] * n + idx[..., None, :]).view(P, -1)
        g = torch.stack([gs, gt]).view(2, P, n * n)
        m = g.gather(-1, flat.expand(2, P, -1)).view(2, P, -1, K, K)  # vertex at 0, then its neighbours
        r, gvv = m[..., 0, :], m[..., :1, 0]  # G_v., G_vv
        c = gvv * 0.5 - r  # <r_a - r_v, r_b - r_v> = G_ab + c_a + c_b
        s = m.diagonal(dim1=-2, dim2=-1) + gvv
        sq = torch.sub(s, r, alpha=2.0)  # squared distance to the vertex (0 at the vertex itself)
        ok = sq > s * tol + tiny
        ok[..., 1:].bitwise_and_(valid)
        inv = torch.rsqrt(sq.clamp_min(tiny)).mul_(ok)
        scale = inv[..., :, None] * inv[..., None, :]
        cos = m + c[..., :, None]
        cos += c[..., None, :]
        cos.mul_(scale).clamp_(-1.0, 1.0)
        per = F.smooth_l1_loss(cos[0], cos[1], reduction="none", beta=beta).view(layers, -1).sum(-1)
        nv = valid.sum(-1, dtype=gs.dtype)
        count = (nv * nv).view(layers, -1).sum(-1).clamp_min(1)  # valid triples per layer
        if want:
            ctx.save_for_backward(_salient_grad(cos, scale[0], inv[0], flat, (P, n), beta, count, layers))
        return (per / count).sum()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (dg,) = ctx.saved_tensors
        return grad_out * dg, None, None, None, None, None, None, None, None


def _salient_grad(cos, scale, inv, flat, shape, beta, count, layers) -> torch.Tensor:
    """dLoss/dG of :class:`SalientAngleLoss` for the student (cos (2, P, K1, K, K) both sides')."""
    P, n = shape
    e = (cos[0] - cos[1]).clamp_(-beta, beta)  # beta x dHuber/dcos
    f = e * scale  # dcos_ab/dG_ab = inv_a inv_b
    t = e.mul_(cos[0]).sum(-1).mul_(inv).mul_(inv)  # -dLoss/dsq_a
    q = f.sum(-1) - t  # dLoss/dc_a / 2 + dLoss/dsq_a (both sides of the symmetric cos)
    f[..., 0, :].sub_(q, alpha=2.0)  # G_va, through c_a and sq_a
    f.diagonal(dim1=-2, dim2=-1).sub_(t)  # G_aa, through sq_a
    f[..., 0, 0].add_(q.sum(-1))  # G_vv, through every c_a and sq_a
    f = f.view(layers, -1).mul_((count * beta).reciprocal()[:, None])
    return torch.zeros((P, n * n), dtype=f.dtype, device=f.device).scatter_add_(-1, flat, f.view(P, -1)).view(P, n, n)
