"""Export round trip on a finished DynaBERT run: export one (m_w, m_d) sub-network with kdrun-export,
load it with plain ``from_pretrained``, evaluate it on the run's dev set, and compare its logits and
metrics with the same sub-network inside the run.

    python scripts/checks/export.py <run_dir> width=0.5 depth=0.75 <out_dir>
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from kdrun.runtime import harness


def parse_args(argv: list[str] | None):
    p = harness.parser(__doc__)
    p.add_argument("run_dir", type=Path, help="a finished DynaBERT run (kdrun ... objective=dynabert)")
    p.add_argument("width", help="width=<m_w>, one of the run's width multipliers")
    p.add_argument("depth", help="depth=<m_d>, one of the run's depth multipliers")
    p.add_argument("out_dir", type=Path, help="where kdrun-export writes the sub-network")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForSequenceClassification

    from kdrun.app.run import make_accelerator
    from kdrun.engine.trainer import predict
    from kdrun.models.loading import load_tokenizer
    from kdrun.strategies.dynabert.export import main as export_main
    from kdrun.strategies.dynabert.subnet import subnetwork
    from kdrun.tasks.data.batches import Collator, tokenize_splits
    from kdrun.tasks.data.sources import load_task_data
    from kdrun.tasks.kinds import kind_of

    args = parse_args(argv)
    run_dir, width_arg, depth_arg, out_dir = args.run_dir, args.width, args.depth, args.out_dir
    t0 = time.perf_counter()
    if export_main([str(run_dir), width_arg, depth_arg, str(out_dir)]) != 0:
        return 2
    width, depth = float(width_arg.split("=")[1]), float(depth_arg.split("=")[1])
    res = json.loads((run_dir / "results.json").read_text())
    cfg = OmegaConf.create(res["config"])
    tok = load_tokenizer(str(out_dir))
    split = cfg.task.eval_splits[0]
    data = tokenize_splits(load_task_data(cfg.task), tok, cfg.task.max_seq_length)[split]
    collator, acc = Collator(tok.pad_token_id, cfg.task.num_labels == 1), make_accelerator(OmegaConf.create(
        {"device": "cpu", "precision": "fp32", "gradient_accumulation_steps": 1}))
    exported = AutoModelForSequenceClassification.from_pretrained(out_dir).eval()
    run_model = AutoModelForSequenceClassification.from_pretrained(run_dir / "student").eval()
    logits_e, labels = predict(exported, data, collator, 128, acc)
    with torch.no_grad(), subnetwork(run_model, width, depth):
        logits_r, _ = predict(run_model, data, collator, 128, acc)
    metrics = kind_of(cfg.task).metric_fn(cfg.task, {split: data})
    row = next(r for r in res["subnetworks"]["rows"] if (r["width"], r["depth"]) == (width, depth))
    out = {"width": width, "depth": depth, "rows": len(labels),
           "max_abs_logit_diff": float(np.abs(logits_e - logits_r).max()),
           "exported": metrics(logits_e, labels), "in_run_now": metrics(logits_r, labels),
           "results_json": row["metrics"][split], "exported_params": sum(p.numel() for p in exported.parameters()),
           "config": {k: getattr(exported.config, k) for k in ("num_attention_heads", "intermediate_size",
                                                                 "num_hidden_layers", "hidden_size")},
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
