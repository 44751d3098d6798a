"""CKD's word-relation angle loss: kdrun's Gram-matrix kernels vs the naive difference-tensor way.

Forward + backward of the WR-angle term (sum over aligned layers of the mean squared error between
student and teacher angle cosines) at the papers' size: B=32 sentences of n=128 tokens, 5 aligned
layers, teacher width 768, student width 768 and 384, locality window δ=21 and all triples.

  kdrun: distances and angle cosines from Gram matrices, windowed angles read as (n, w, w) slabs,
         all angles in chunks of vertices, gradient fused into the forward sweep.
  naive: the (n, n, d) / (n, w, d) tensors of difference vectors, normalised, then contracted
         (what the official code does; masking done correctly so values can be compared).

Every case runs in a fresh subprocess, so its peak memory is its own: on CPU the peak resident set
size above the process's size just before the loss (inputs already allocated); on CUDA
torch.cuda.max_memory_allocated above the inputs. Naive cases run under a memory cap
(--naive-cap-gb; CPU) and are reported as out of memory when they exceed it; the full-angle
comparison is then also measured at a batch that fits (--small-batch), same run, same inputs.
Both ways get identical inputs (same seed); their loss values must agree to 1e-5 relative.

    python scripts/bench/relations.py [--device cpu|cuda] [--threads N] [--json out.json]

Prints a table and the naive/kdrun ratios of time and memory. On a shared CPU, timings swing with
other processes (OpenMP threads that lose their core stall every parallel op): use --repeat 3, or
--threads 1 when the cores are busy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kdrun.runtime import harness

REPO = harness.REPO


# ------------------------------------------------------------------------------- the two losses

def naive_angle_loss(xs, xt, mask, window):
    """Mean squared error of angle cosines from explicit difference vectors (fp32)."""
    import torch

    def cosines(x, idx, valid):
        # diff[b, j, a] = x[b, idx[j, a]] - x[b, j]: (B, n, w, d)
        diff = x[:, idx] - x[:, :, None, :]
        norm = diff.norm(dim=-1, keepdim=True)
        ok = valid[..., None] & (norm > 0)
        unit = torch.where(ok, diff / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(diff))
        return torch.einsum("bjad,bjcd->bjac", unit, unit)

    n = mask.shape[1]
    ar = torch.arange(n, device=mask.device)
    if window is None:
        idx = ar[None, :].expand(n, n)
        inside = ar[:, None] != ar[None, :]
    else:
        raw = ar[:, None] + torch.arange(-window, window + 1, device=mask.device)[None, :]
        inside = (raw >= 0) & (raw < n) & (raw != ar[:, None])
        idx = raw.clamp(0, n - 1)
    valid = mask[:, :, None] & mask[:, idx] & inside  # (B, n, w)
    triple = valid[..., :, None] & valid[..., None, :]
    cs = cosines(xs.float(), idx, valid)
    with torch.no_grad():
        ct = cosines(xt.float(), idx, valid)
    err = torch.where(triple, cs - ct, torch.zeros_like(cs))
    return (err * err).sum() / triple.sum()


def kdrun_angle_loss(xs, xt, mask, window):
    from kdrun.losses.relations import angle_loss

    return angle_loss(xs, xt, mask, loss="mse", window=window)


# ----------------------------------------------------------------------------------------- worker

def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def worker(spec: dict) -> dict:
    """One case in this (fresh) process: build inputs, run forward + backward once, measure."""
    import resource

    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    dev = torch.device(spec["device"])
    g = torch.Generator(device="cpu").manual_seed(0)
    B, n, L = spec["batch"], spec["n"], spec["layers"]
    hs = [torch.randn(B, n, spec["d_student"], generator=g).to(dev).requires_grad_(True) for _ in range(L)]
    ht = [torch.randn(B, n, spec["d_teacher"], generator=g).to(dev) for _ in range(L)]
    mask = torch.ones(B, n, dtype=torch.bool, device=dev)
    fn = kdrun_angle_loss if spec["impl"] == "kdrun" else naive_angle_loss
    # load kernels / libraries on a tiny input first so the timed run measures the computation
    tiny = torch.randn(2, 8, 4, device=dev, requires_grad=True)
    fn(tiny, tiny.detach(), torch.ones(2, 8, dtype=torch.bool, device=dev), 2).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mb()
        if spec.get("cap_gb"):
            cap = _vm_bytes() + int(spec["cap_gb"] * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out = {"impl": spec["impl"]}
    try:
        times = []
        for _ in range(spec.get("repeat", 1)):
            for h in hs:
                h.grad = None
            t0 = time.perf_counter()
            total = sum(fn(a, b, mask, spec["window"]) for a, b in zip(hs, ht))
            total.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            out["value"] = float(total.detach())
            del total
        out["time_s"] = min(times)
        out["times_s"] = times
    except (RuntimeError, MemoryError) as e:  # torch's allocator raises RuntimeError when capped
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        out["oom"] = True
    if dev.type == "cuda":
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return out


def run_case(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        proc = subprocess.run([sys.executable, __file__, "--_worker", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": spec["impl"], "timeout": True}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        # killed by the kernel's OOM killer, or an allocation failure outside the guarded region
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return {"impl": spec["impl"], "oom": True, "error": tail[0][:200]}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------- main

def _fmt(r: dict, key: str, fmt: str) -> str:
    if r.get("oom"):
        return "OOM"
    if r.get("timeout"):
        return "timeout"
    if r.get("skipped"):
        return "-"
    return format(r[key], fmt)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--teacher-dim", type=int, default=768)
    ap.add_argument("--student-dims", default="768,384")
    ap.add_argument("--window", type=int, default=21)
    ap.add_argument("--small-batch", type=int, default=4, help="batch for the full-angle comparison when naive OOMs")
    ap.add_argument("--naive-cap-gb", type=float, default=12.0, help="memory cap of a naive case (CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per case (0 = torch's default)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case (same process); the fastest is reported")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--impls", default="kdrun,naive", help="which to run (kdrun,naive)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))), flush=True)
        return

    impls = set(args.impls.split(","))
    base = {"device": args.device, "n": args.n, "layers": args.layers, "d_teacher": args.teacher_dim,
            "threads": args.threads, "repeat": args.repeat}
    rows = []
    for ds in (int(x) for x in args.student_dims.split(",")):
        for window in (args.window, None):
            batches = [args.batch]
            for batch in batches:
                spec = {**base, "batch": batch, "d_student": ds, "window": window}
                skipped = {"skipped": True}
                ours = run_case({**spec, "impl": "kdrun"}, args.timeout) if "kdrun" in impls else skipped
                naive = (run_case({**spec, "impl": "naive", "cap_gb": args.naive_cap_gb}, args.timeout)
                         if "naive" in impls else skipped)
                rows.append({"d_student": ds, "window": window, "batch": batch, "kdrun": ours, "naive": naive})
                if (naive.get("oom") or naive.get("timeout")) and batch == args.batch and args.small_batch < batch:
                    batches.append(args.small_batch)
                print(_row_text(rows[-1], args), flush=True)

    goals = {21: (0.5 * 1024, 1.0), None: (2.0 * 1024, 5.0)}  # the CPU goals (MB, s): window, full
    print()
    print(f"WR-angle forward+backward, {args.layers} layers, n={args.n}, teacher d={args.teacher_dim}, "
          f"device {args.device}, threads {args.threads or 'default'}, best of {args.repeat}")
    header = (f"{'student d':>9} {'window':>6} {'B':>3} | {'kdrun s':>8} {'kdrun MB':>9} | {'naive s':>8} "
              f"{'naive MB':>9} | {'time x':>7} {'mem x':>7} | {'rel diff':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(_row_text(r, args))
    for r in rows:
        o = r["kdrun"]
        if r["batch"] == args.batch and "time_s" in o:
            mem_goal, time_goal = goals[21 if r["window"] is not None else None]
            ok = o["peak_mb"] <= mem_goal and o["time_s"] <= time_goal
            print(f"goal d={r['d_student']} window={r['window'] or 'full'}: <= {mem_goal:.0f} MB and "
                  f"<= {time_goal:.0f} s -> {o['peak_mb']:.0f} MB, {o['time_s']:.2f} s: {'met' if ok else 'NOT met'}")
        if "value" in o and "value" in r["naive"]:
            rel = abs(o["value"] - r["naive"]["value"]) / abs(r["naive"]["value"])
            if rel > 1e-5:
                print(f"VALUE MISMATCH d={r['d_student']} window={r['window']} B={r['batch']}: rel diff {rel:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "_worker"},
                                               "rows": rows}, indent=2))
        print(f"wrote {args.json}")


def _row_text(r: dict, args) -> str:
    o, v = r["kdrun"], r["naive"]
    both = "time_s" in o and "time_s" in v
    tx = f"{v['time_s'] / o['time_s']:7.1f}" if both else f"{'-':>7}"
    mx = f"{v['peak_mb'] / max(o['peak_mb'], 1e-9):7.1f}" if both else f"{'-':>7}"
    rel = (f"{abs(o['value'] - v['value']) / abs(v['value']):9.1e}" if both else f"{'-':>9}")
    naive_mb = _fmt(v, "peak_mb", "9.0f") if not v.get("oom") else f"{'OOM>' + format(args.naive_cap_gb, 'g') + 'G':>9}"
    return (f"{r['d_student']:>9} {str(r['window'] or 'full'):>6} {r['batch']:>3} | {_fmt(o, 'time_s', '8.2f'):>8} "
            f"{_fmt(o, 'peak_mb', '9.0f'):>9} | {_fmt(v, 'time_s', '8.2f'):>8} {naive_mb:>9} | {tx} {mx} | {rel}")


if __name__ == "__main__":
    main()
