"""Is the data path of general distillation a bottleneck? Tokens/s of loading batches alone (the
cached, memory-mapped segments through the sampler and the masking collator) vs tokens/s of the
training step (teacher forward + student forward/backward + optimizer step), on the same batches,
in one process; and, for reference, the naive data path (reading and tokenising the documents for
every batch instead of the cached segments).

    python scripts/bench/corpus.py --data /path/to/wikipedia            # minilm_l6 → L4-H312, ckd_general
    python scripts/bench/corpus.py --data /path/to/wikipedia --steps 20 objective=mlm_ckd teacher=...
    python scripts/bench/corpus.py --data corpus.txt --fast cache_dir=/tmp/c  # tiny models, 3 steps

The corpus shards are built (or taken from the cache) first and not timed. Take the figures on an
otherwise idle machine. Ratio = data tokens/s ÷ training tokens/s: far above 1 means the data path
is not the bottleneck.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from kdrun.runtime import harness

# --fast: tiny random teacher and student (all-MiniLM-L6-v2's tokenizer, no download), segments of
# at most 32 tokens in batches of 8, 3 timed steps: seconds on a small corpus, for checking the
# script, not for figures. Overrides given on the command line come after these.
FAST = ["teacher=tiny_random", "student=tiny_random", "task.max_seq_length=32", "objective.stages.0.batch_size=8"]


def tokens(batch) -> int:
    return int(batch["attention_mask"].sum())


def time_loading(loop, steps: int) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    for i, batch in enumerate(loop.loader):
        n += tokens(batch)
        if i + 1 == steps:
            break
    return time.perf_counter() - t0, n


def time_naive_loading(files, tokenizer, batch_size: int, max_len: int, steps: int) -> tuple[float, int]:
    """Read and tokenise documents for every batch (no segment cache)."""
    from kdrun.tasks.data.corpus import iter_documents

    t0, n, docs = time.perf_counter(), 0, iter_documents(files)
    for _ in range(steps):
        texts = [next(docs).text for _ in range(batch_size)]
        enc = tokenizer(texts, truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        n += int(enc["attention_mask"].sum())
    return time.perf_counter() - t0, n


def time_training(parts, loop, state, steps: int) -> tuple[float, int]:
    from kdrun.engine.trainer import to_device, train_step

    it = iter(loop.loader)
    batch = to_device(next(it), parts.accelerator.device)
    train_step(parts, loop, batch, state)  # warm-up step, not timed
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        batch = to_device(next(it), parts.accelerator.device)
        train_step(parts, loop, batch, state)
        n += tokens(batch)
    return time.perf_counter() - t0, n


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--data", required=True, help="corpus files or directory (task.data_files)")
    ap.add_argument("--steps", type=int, default=None, help="timed batches (default 15; 3 with --fast)")
    ap.add_argument("--fast", action="store_true", help="tiny random models, short segments, small batches")
    args, overrides = ap.parse_known_args(argv)
    if args.steps is None:
        args.steps = 3 if args.fast else 15
    from kdrun.app.context import load_data, make_parts, start_session
    from kdrun.app.models import build_student, load_teacher
    from kdrun.app.preflight import preflight
    from kdrun.config import compose
    from kdrun.engine.trainer import TrainState, setup_stage
    from kdrun.tasks.data.corpus import corpus_files

    cfg = compose(["task=wikipedia", f"task.data_files={args.data}", "teacher=minilm_l6", "student=general_L4_H312",
                   "objective=ckd_general", "logger=none", *(FAST if args.fast else []), *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        session = start_session(cfg, Path(tmp), preflight(cfg), time.perf_counter())
        data = load_data(session)  # builds or loads the cached shards (not timed)
        from kdrun.runtime.tracking import Tracker

        session.tracker = Tracker(Path(tmp), cfg.logger, {}, "bench", enabled=False)
        models = build_student(session, data, load_teacher(session, data))
        parts = make_parts(session, data, models)
        plan = session.pre.plans[0]
        loop = setup_stage(parts, plan, TrainState(), None)
        loop.sampler.set_epoch(0)
        torch.set_grad_enabled(True)
        load_s, load_n = time_loading(loop, args.steps)
        naive_s, naive_n = time_naive_loading(corpus_files(args.data), data.tokenizer, plan.cfg["batch_size"],
                                              cfg.task.max_seq_length, args.steps)
        parts.student.train()
        train_s, train_n = time_training(parts, loop, TrainState(), args.steps)
    load_tps, naive_tps, train_tps = load_n / load_s, naive_n / naive_s, train_n / train_s
    print(f"{args.steps} batches of {plan.cfg['batch_size']} segments (max {cfg.task.max_seq_length} tokens), "
          f"objective {cfg.objective.name}, {torch.get_num_threads()} threads")
    print(f"data loading (cached segments + collator{' + masking' if data.collator.masks else ''}): "
          f"{load_tps:,.0f} tokens/s")
    print(f"naive data path (read + tokenise per batch):              {naive_tps:,.0f} tokens/s")
    print(f"training step (teacher fwd + student fwd/bwd + update):   {train_tps:,.0f} tokens/s")
    print(f"ratio data loading / training step: {load_tps / train_tps:,.1f}x "
          f"(cached vs naive data path: {load_tps / naive_tps:,.1f}x)")


if __name__ == "__main__":
    sys.exit(main())
