"""Benchmark: MGSKD's pair-wise relation MSE, the (a+b)² kernel form against the n x n form, per head count.

Per relation head the loss is ``||X_s X_s^T/√a - X_t X_t^T/√b||²`` over n points of widths a = ds/m and
b = dt/m. kdrun computes it in one of two forms:

  kernel: ``Σ_ij u_i u_j K_ij²`` with ``K = Y^T Y``, ``Y = [X_s | X_t]``: O(n (a+b)²) per head, in fp64;
  direct: the n x n interaction matrices of both sides and their difference: O(n² (a+b)) per head.

and picks the direct form when n < a + b (``auto``, what training runs). With the default 64 heads
the kernel is cheaper; with one head (the paper's relation-heads ablation) a head is the whole
width and the kernel costs (a+b)/n times the direct form. Each case times forward + backward of the
token-level term over stacked layers (the best of ``--repeats``), checks that the two forms agree to
1e-6 relative, and prints the time of each and kernel / auto.

    python scripts/bench/mgskd_pair.py                  # GLUE-CPU shapes (3 layers, 32 rows, 384 wide)
    python scripts/bench/mgskd_pair.py --fast           # a tiny run (tests)
"""

from __future__ import annotations

import time

import torch

from kdrun.losses.mgskd import _pair_mse, _pair_sq_direct, _pair_sq_kernel, pair_direct_form
from kdrun.runtime import harness


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def forms(y: torch.Tensor, ds: int, mask: torch.Tensor, m: int) -> dict:
    """The three ways to the loss on the same inputs: each returns a callable running forward + backward."""
    nn = mask.sum(-1, dtype=torch.float64) @ mask.sum(-1, dtype=torch.float64)

    def run(per_layer_fn):
        def step():
            leaf = y.detach().requires_grad_(True)
            loss = (per_layer_fn(leaf) / nn).sum()
            loss.backward()
            return float(loss.detach())
        return step
    return {"kernel": run(lambda v: _pair_sq_kernel(v, ds, m)),
            "direct": run(lambda v: _pair_sq_direct(v, ds, m)),
            "auto": run(lambda v: _pair_mse(v, ds, mask, m) * nn)}


def case(layers: int, batch: int, n: int, width: int, m: int, repeats: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(n // 2, n + 1, (batch,), generator=g)
    mask = torch.arange(n)[None] < lengths[:, None]
    y = torch.randn(layers, batch, n, 2 * width, generator=g).masked_fill(~mask[..., None], 0.0)
    fns = forms(y, width, mask, m)
    values = {k: f() for k, f in fns.items()}
    if abs(values["kernel"] - values["direct"]) > 1e-6 * abs(values["kernel"]):
        raise SystemExit(f"the two forms disagree at heads={m}, n={n}: {values}")
    ms = {k: best_ms(f, repeats) for k, f in fns.items()}
    chosen = "direct" if pair_direct_form(n, 2 * width, m) else "kernel"
    print(f"| {m} | {n} | {2 * width // m} | {ms['kernel']:.1f} | {ms['direct']:.1f} | {chosen} | "
          f"{ms['kernel'] / ms['auto']:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--layers", type=int, default=3, help="stacked layer pairs (the token level's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=384, help="student = teacher width")
    ap.add_argument("--lengths", default="48,128", help="padded row lengths n, comma-separated")
    ap.add_argument("--heads", default="1,8,64", help="relation head counts m, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--fast", action="store_true", help="a tiny run for tests")
    args = ap.parse_args(argv)
    if args.fast:
        args.layers, args.batch, args.width, args.lengths, args.heads, args.repeats = 1, 4, 32, "8,40", "1,16", 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"MGSKD pair MSE, forward + backward: {args.layers} layers x {args.batch} rows, width {args.width}, "
          f"cpu, {torch.get_num_threads()} threads, best of {args.repeats}")
    print("| heads | n | a+b | kernel ms | direct ms | auto picks | kernel / auto |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for n in (int(v) for v in args.lengths.split(",")):
        for m in (int(v) for v in args.heads.split(",")):
            case(args.layers, args.batch, n, args.width, m, args.repeats)


if __name__ == "__main__":
    main()
