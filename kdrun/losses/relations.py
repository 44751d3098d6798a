"""Relation kernels of Contextual KD: pair-wise and triple-wise (angle) relations among points.

Everything here works on a batch of *point sets* ``x`` (P, n, d) with a validity ``mask`` (P, n):
for the word relation (WR) a point set is one sentence at one layer (points = tokens); for the layer
transforming relation (LTR) it is one token (points = its representations at the aligned layers).
Student and teacher point sets share P, n and the mask but may differ in width d, since only
relations are compared, never vectors.

Relations come from Gram matrices ``G = X X^T`` (fp32, or fp64 when given fp64), never from
(n, n, d) tensors of difference vectors:

    ||r_i - r_j||^2           = G_ii + G_jj - 2 G_ij
    <r_i - r_j, r_k - r_j>    = G_ik - G_ij - G_jk + G_jj
    psi(r_i, r_j, r_k)        = <r_i - r_j, r_k - r_j> / (||r_i - r_j|| ||r_k - r_j||)   (vertex j)

Before distances or angles are taken, each point set is centred on the mean of its valid points:
both are translation invariant, and centring keeps the Gram entries (hence the cancellation in the
identities above) as small as the point cloud itself.

Conventions (documented once, used by every loss here):

- Pairs are ordered (i, j) with i != j, both valid, and |i - j| <= window when a window is given.
  Triples (i, j, k) have vertex j, i != j, k != j (i == k is allowed: its angle is 0, cos 1), all
  valid, and |i - j| <= window, |k - j| <= window. Padding and out-of-range neighbours never count
  (no clamped duplicates).
- Degenerate geometry: two points whose squared distance is below 32 eps (|r_i|^2 + |r_j|^2)
  (after centring; in fp32 closer than ~0.3% of their norms, where the Gram identity is rounding
  noise) have distance 0; an angle whose vertex coincides with one of its points has cosine 0 (the
  triple adds 0 when the teacher's is degenerate too). Gradients stay finite: no sqrt or division
  is ever evaluated at 0.
- Matching losses ``mse`` (squared error), ``l1``, ``huber`` (smooth L1 with ``huber_beta``) are
  averaged over all valid pairs / triples of the whole batch (the sum of errors divided by the
  number of valid entries as defined above; the official code's count also includes the diagonal /
  vertex-coinciding entries, see ``reduction="official"`` below). ``kl`` is
  ``KL(softmax(teacher row) || softmax(student row))`` over the valid entries of each row (a row is
  point i for pairs, (vertex j, point i) for angles), averaged over the valid rows.
  ``reduction="official"`` divides the same sums by the official CKD code's count instead: every
  mask entry of a valid point set, diagonal / degenerate entries and window slots included
  (:func:`official_count`), the scale its per-task loss weights were tuned on.
- The teacher's Gram matrices are computed under ``torch.no_grad()``; what follows from them
  (distances, cosines, angle pieces, the KL's log-softmax) is computed for both sides at once on
  the stacked (2, ...) Gram matrices, and no gradient reaches the teacher. Everything runs with
  autocast disabled and, on CUDA, with TF32 off (``train.tf32`` speeds up the models' matmuls, not
  these: the Gram identities above cancel, kdrun.runtime.precision).
- Layers stacked: the losses take x (L, P, n, d) with a mask (P, n) shared by the L layers and
  return the sum of the layers' values, in one call (few kernel launches; kdrun.runtime.ops).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from kdrun.losses.angle_kernel import CHUNK_ELEMS, MASKED_LOGIT, angle_sum, cosines
from kdrun.models.features import no_autocast
from kdrun.runtime.precision import exact_fp32_matmul

PHIS = ("l2", "cosine")
LOSSES = ("mse", "l1", "huber", "kl")
# How summed matching losses become a scalar: "mean" over the valid entries (rows for kl), or the
# official CKD code's pooled count, degenerate entries and window slots included (official_count).
REDUCTIONS = ("mean", "official")
# ------------------------------------------------------------------------------------------ helpers

def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction '{reduction}' must be one of {REDUCTIONS}")


def relation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half/bfloat16/fp32 inputs, fp64 kept (tests compare in fp64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Disable autocast so relations are computed in fp32 even inside a bf16/fp16 training step, and
    TF32 for CUDA matmuls (Gram identities cancel; kdrun.runtime.precision.exact_fp32_matmul)."""
    with no_autocast(device), exact_fp32_matmul(device.type):
        yield


def _tol(dtype: torch.dtype) -> float:
    """Relative size below which a Gram-computed squared distance is rounding noise."""
    return 32.0 * torch.finfo(dtype).eps


def _tiny(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).tiny)


def valid_points(mask: torch.Tensor) -> torch.Tensor:
    """(P, n) validity -> (P, 1, 1) integer count of each set's valid points (at least 1)."""
    return mask.bool().sum(-1)[..., None, None].clamp_min(1)


def center(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (..., P, n, d) minus the mean of each set's valid points; invalid points set to 0.

    Leading dims before P are stacked layers that share ``mask`` (P, n); ``count``: its
    :func:`valid_points`, when the caller shares them between several calls. Uses ``where``
    rather than multiplying by the mask, so whatever padding holds (even inf/NaN) cannot leak into
    the relations.
    """
    pad = ~mask.bool().unsqueeze(-1)
    x = x.masked_fill(pad, 0.0)
    mean = x.sum(-2, keepdim=True) / (valid_points(mask) if count is None else count)
    return (x - mean).masked_fill(pad, 0.0)


def gram(x: torch.Tensor) -> torch.Tensor:
    """(..., n, d) -> (..., n, n) inner products."""
    return x @ x.transpose(-1, -2)


def _safe_rsqrt(v: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """1/sqrt(v) where ``ok`` else 0, with finite gradients everywhere (1/sqrt(1) * 0 elsewhere)."""
    return torch.rsqrt(torch.where(ok, v, torch.ones_like(v))) * ok


def _safe_sqrt(v: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """sqrt(v) where ``ok`` else 0, with finite gradients everywhere (sqrt(1) * 0 elsewhere)."""
    return torch.sqrt(torch.where(ok, v, torch.ones_like(v))) * ok


def pair_mask(mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(P, n) validity -> (P, n, n): both points valid, i != j, and |i - j| <= window if given."""
    n = mask.shape[-1]
    ar = torch.arange(n, device=mask.device)
    off = (ar[:, None] - ar[None, :]).abs()
    keep = off > 0
    if window is not None:
        keep = keep & (off <= window)
    m = mask.bool()
    return m[..., :, None] & m[..., None, :] & keep


# ------------------------------------------------------------------------------- pair-wise relation

def pair_relation(
    x: torch.Tensor, mask: torch.Tensor, phi: str = "l2", normalize: bool = False, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair relation matrix of each point set and the mask of the pairs that count.

    x: (P, n, d); mask: (P, n). Returns (rel (P, n, n), valid (P, n, n) bool).
    phi ``l2``: Euclidean distance ||r_i - r_j||; with ``normalize`` divided by the set's mean
    distance over its valid pairs (scale invariant, as in relational KD).
    phi ``cosine``: cosine similarity <r_i, r_j> / (||r_i|| ||r_j||) (0 for a zero vector).
    Entries outside ``valid`` are 0.
    """
    _check_phi(phi, normalize)
    with full_precision(x.device):
        valid = pair_mask(mask, window)
        return _relation(_pair_gram(x.to(relation_dtype(x)), mask, phi), valid, phi, normalize), valid


def _check_phi(phi: str, normalize: bool) -> None:
    if phi not in PHIS:
        raise ValueError(f"pair relation phi='{phi}' must be one of {PHIS}")
    if normalize and phi != "l2":
        raise ValueError("normalize=true applies to distances (phi=l2), not to cosine similarities")


def _pair_gram(x: torch.Tensor, mask: torch.Tensor, phi: str, count: torch.Tensor | None = None) -> torch.Tensor:
    """The Gram matrix a pair relation is read from: of the centred points (``l2``; ``count``: the
    sets' :func:`valid_points`, computed when None) or of the points, padding zeroed (``cosine``)."""
    if phi == "l2":
        return gram(center(x, mask, count))
    return gram(x.masked_fill(~mask.bool().unsqueeze(-1), 0.0))


def _relation(g: torch.Tensor, valid: torch.Tensor, phi: str, normalize: bool) -> torch.Tensor:
    """:func:`pair_relation`'s matrix from :func:`_pair_gram`'s ``g`` (..., P, n, n) and the pairs'
    ``valid`` (P, n, n); leading dims (stacked layers, both sides) share the validity."""
    dt = g.dtype
    d = g.diagonal(dim1=-2, dim2=-1)
    if phi == "l2":
        s = d[..., :, None] + d[..., None, :]
        sq = s - 2.0 * g
        ok = valid & (sq > _tol(dt) * s + _tiny(dt))
        rel = _safe_sqrt(sq, ok)
        if normalize:
            cnt = valid.sum((-1, -2)).clamp_min(1).to(dt)
            mean = rel.sum((-1, -2)) / cnt
            rel = rel / mean.clamp_min(_tiny(dt))[..., None, None]
        return rel
    inv = _safe_rsqrt(d, d > _tiny(dt))
    rel = (g * inv[..., :, None] * inv[..., None, :]).clamp(-1.0, 1.0)
    return torch.where(valid, rel, torch.zeros_like(rel))


def _match_sum(rel: torch.Tensor, valid: torch.Tensor, loss: str,
               huber_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed matching loss over ``valid`` between ``rel[0]`` (student) and ``rel[1]`` (teacher),
    and its ``mean`` denominator (entries; rows for kl)."""
    if loss not in LOSSES:
        raise ValueError(f"matching loss '{loss}' must be one of {LOSSES}")
    rs, rt = rel[0], rel[1]
    if loss == "kl":
        ls, lt = F.log_softmax(rel.masked_fill(~valid, MASKED_LOGIT), dim=-1)
        rows = valid.any(-1)
        kl = (lt.exp() * (lt - ls)).sum(-1)
        return (kl * rows).sum(), rows.sum()
    diff = torch.where(valid, rs - rt, torch.zeros_like(rs))
    if loss == "mse":
        err = diff * diff
    elif loss == "l1":
        err = diff.abs()
    else:
        err = F.smooth_l1_loss(diff, torch.zeros_like(diff), reduction="none", beta=huber_beta)
    return err.sum(), valid.sum()


def official_count(mask: torch.Tensor, window: int | None, order: int) -> torch.Tensor:
    """The official code's denominator: its mask entries per point set, degenerate ones included.

    ``order`` 2 (pairs) or 3 (triples). A set of n valid points has n^order entries with no window,
    and n (2δ+1)^(order-1) with a window δ: every valid point owns 2δ+1 neighbour slots per
    position, edge slots included (the official code fills them with clamped duplicates; kdrun
    counts the slots but sums only true neighbours).
    """
    n = mask.bool().sum(-1).to(torch.float64)
    per = n ** (order - 1) if window is None else torch.full_like(n, float(2 * window + 1) ** (order - 1))
    return (n * per).sum()


def pair_loss(
    xs: torch.Tensor,
    xt: torch.Tensor,
    mask: torch.Tensor,
    *,
    phi: str = "l2",
    normalize: bool = False,
    loss: str = "mse",
    window: int | None = None,
    huber_beta: float = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Matching loss between the student's and the teacher's pair relations (see module doc).

    xs (P, n, ds) student points, xt (P, n, dt) teacher points, mask (P, n). Scalar: the summed
    loss divided by the batch's valid pairs (``kl``: its valid rows) with ``reduction="mean"``, or
    by :func:`official_count` (order 2) with ``"official"``. Stacked layers: xs (L, P, n, ds) and
    xt (L, P, n, dt) sharing ``mask`` give the sum over the L layers of each one's value (the pairs'
    validity and the sets' point counts computed once for all layers and both sides).
    """
    _check_reduction(reduction)
    _check_phi(phi, normalize)
    with full_precision(xs.device):
        valid = pair_mask(mask, window)
        count = valid_points(mask) if phi == "l2" else None
        gs = _pair_gram(xs.to(relation_dtype(xs)), mask, phi, count)
        with torch.no_grad():
            gt = _pair_gram(xt.to(relation_dtype(xt)), mask, phi, count).to(gs.dtype)
        # both sides' relations in one set of ops (none flows to the teacher)
        total, count = _match_sum(_relation(torch.stack([gs, gt]), valid, phi, normalize), valid, loss, huber_beta)
        if reduction == "official":
            count = official_count(mask, window, 2)
        return total / count.clamp_min(1).to(total.dtype)


# ----------------------------------------------------------------------------- triple-wise (angles)

def _angle_layout(n: int, window: int | None, device: torch.device) -> tuple[torch.Tensor | None, int]:
    """Neighbour slots of each vertex: (idx (n, w) token index of slot a of vertex j, w).

    ``idx`` is None for the full layout (slot a = token a, w = n). A window whose 2δ+1 slots would
    not be fewer than n uses the full layout with a band mask instead.
    """
    if window is None or 2 * window + 1 >= n:
        return None, n
    w = 2 * window + 1
    idx = torch.arange(n, device=device)[:, None] + torch.arange(-window, window + 1, device=device)[None, :]
    return idx, w


def angle_pieces(
    g: torch.Tensor, mask: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per vertex j and neighbour slot a, what the angles at j need (differentiable in ``g``).

    g: (P, n, n) Gram matrix of centred points; mask (P, n). Returns, each (P, n, w):
    c[j, a] = G_jj / 2 - G_j,a  (so <r_a - r_j, r_b - r_j> = G_ab + c_a + c_b),
    inv[j, a] = 1 / ||r_a - r_j|| for a valid, non-degenerate neighbour, else 0,
    valid[j, a] (bool): the neighbour slot counts (index-wise; degenerate geometry still counts).
    """
    layout = _angle_layout(g.shape[-1], window, g.device)
    valid = angle_valid(mask, window, layout)
    return (*angle_geometry(g, valid, layout), valid)


def angle_valid(mask: torch.Tensor, window: int | None, layout) -> torch.Tensor:
    """(P, n) validity -> (P, n, w): neighbour slot a of vertex j counts (``layout``: _angle_layout's)."""
    idx, w = layout
    n = mask.shape[-1]
    m = mask.bool()
    ar = torch.arange(n, device=mask.device)
    if idx is None:
        valid = m[..., :, None] & m[..., None, :] & (ar[:, None] != ar[None, :])
        return valid & ((ar[:, None] - ar[None, :]).abs() <= window) if window is not None else valid
    inside = (idx >= 0) & (idx < n) & (idx != ar[:, None])
    return m[..., :, None] & m[..., idx.clamp(0, n - 1)] & inside


def angle_geometry(g: torch.Tensor, valid: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`angle_pieces`' (c, inv) of ``g`` (..., P, n, n) given ``valid`` (P, n, w): leading dims
    are stacked layers sharing the validity."""
    idx, w = layout
    n, dt = g.shape[-1], g.dtype
    d = g.diagonal(dim1=-2, dim2=-1)
    if idx is None:
        gj, h = g, d[..., None, :].expand(g.shape)
    else:
        idc = idx.clamp(0, n - 1)
        gj, h = g.gather(-1, idc.expand(*g.shape[:-1], w)), d[..., idc]
    s = d[..., :, None] + h
    sq = s - 2.0 * gj
    ok = valid & (sq > _tol(dt) * s + _tiny(dt))
    return 0.5 * d[..., :, None] - gj, _safe_rsqrt(sq, ok)


def angle_loss(
    xs: torch.Tensor,
    xt: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss: str = "mse",
    window: int | None = None,
    huber_beta: float = 1.0,
    chunk_elems: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Matching loss between the student's and the teacher's angles psi (see module doc).

    xs (P, n, ds), xt (P, n, dt), mask (P, n). ``window`` δ: only neighbours within δ of the vertex
    (read as (n, 2δ+1, 2δ+1) slabs of a strided view of the Gram matrix); None: all n^2 pairs per
    vertex. Either way in chunks of vertices: peak extra memory is O(P n^2 + chunk_elems)
    (``chunk_elems`` None: a per-device default). Scalar: the summed loss divided by the batch's
    valid triples (``kl``: its valid (vertex, point) rows, softmax over the third point) with
    ``reduction="mean"``, or by :func:`official_count` (order 3) with ``"official"``. Stacked
    layers: xs (L, P, n, ds) and xt (L, P, n, dt) sharing ``mask`` give the sum over the L layers of
    each one's value, computed in one sweep (validity and point counts once for all layers and sides).
    """
    _check_reduction(reduction)
    if loss not in LOSSES:
        raise ValueError(f"matching loss '{loss}' must be one of {LOSSES}")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 or null")
    dt = relation_dtype(xs)
    n = mask.shape[-1]
    with full_precision(xs.device):
        layout = _angle_layout(n, window, xs.device)
        valid, points = angle_valid(mask, window, layout), valid_points(mask)
        gs = gram(center(xs.to(dt), mask, points))
        with torch.no_grad():
            gt = gram(center(xt.to(dt), mask, points))
        g = torch.stack([gs, gt])  # both sides' geometry in one set of ops; none flows to the teacher
        c, inv = angle_geometry(g, valid, layout)
        cnt = valid.sum(-1)
        count = cnt.sum() if loss == "kl" else (cnt * cnt).sum()
        if reduction == "official":
            count = official_count(mask, window, 3)
        w = c.shape[-1]
        want = torch.is_grad_enabled() and gs.requires_grad
        flat = [t.reshape(2, -1, n, t.shape[-1]) for t in (g, c, inv)]
        stacked = valid.expand(*c.shape[1:-3], *valid.shape).reshape(-1, n, w)
        total = angle_sum(*flat, stacked, window if w < n else None, loss, float(huber_beta),
                                int(chunk_elems or CHUNK_ELEMS.get(xs.device.type, CHUNK_ELEMS["cuda"])), want)
        return total / count.clamp_min(1).to(dt)


def all_triples_sum(gs: torch.Tensor, gt: torch.Tensor, loss: str = "mse", huber_beta: float = 1.0) -> torch.Tensor:
    """The summed matching loss over every triple of point sets whose points are all valid, from the
    student's and the teacher's Gram matrices ``gs``, ``gt`` (P, n, n) of centred points (no masks)."""
    P, n, _ = gs.shape
    g, ar = torch.stack([gs, gt]), torch.arange(n, device=gs.device)
    valid = (ar[:, None] != ar[None, :]).expand(P, n, n)  # every ordered pair of other points
    c, inv = angle_geometry(g, valid, (None, n))
    chunk = int(CHUNK_ELEMS.get(gs.device.type, CHUNK_ELEMS["cuda"]))
    return angle_sum(g, c, inv, valid, None, loss, float(huber_beta), chunk,
                           torch.is_grad_enabled() and gs.requires_grad)


def angle_matrix(x: torch.Tensor, mask: torch.Tensor, vertex: int) -> torch.Tensor:
    """cos of the angle at ``vertex`` for every pair of points: (P, n, d) -> (P, n, n) (for plots).

    Entries with an invalid or degenerate point are 0.
    """
    dt = relation_dtype(x)
    with torch.no_grad(), full_precision(x.device):
        g = gram(center(x.to(dt), mask))
        c, inv, _ = angle_pieces(g, mask, None)
        cos, _ = cosines(g, c[:, vertex], inv[:, vertex])
    return cos
