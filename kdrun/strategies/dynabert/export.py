"""``kdrun-export``: one sub-network of a DynaBERT run as a smaller standard Hugging Face BERT.

    kdrun-export <run_dir> width=0.5 depth=0.75 <out_dir>

reads the run's trained student (``<run_dir>/student``, rewired, so the sub-network is defined by
the weights alone) and writes ``<out_dir>`` with ``save_pretrained``: the same model class and
config with ``intermediate_size`` = the kept FFN neurons, ``num_hidden_layers`` = the kept layers
(DynaBERT's depth rule) and only their weights, the tokenizer, and ``dynabert.json`` (what was
kept, parameter counts). ``from_pretrained(<out_dir>)`` loads it with no kdrun code and it computes
the same logits as the sub-network inside the run.

Attention heads: a standard BERT derives its head size as ``hidden_size / num_attention_heads``,
so its Q/K/V/output projections are always hidden x hidden, whatever the head count. The kept k
heads (head size dh, hidden size unchanged) are therefore written as ``h'`` standard heads, h' the
smallest divisor of the hidden size with h' >= k (h' = k when k divides it): each kept head fills the
first dh dimensions of one standard head of size hidden / h', its other dimensions and any spare
heads have zero weights, and the queries are scaled by sqrt((hidden/h') / dh) so the attention
scores stay ``q.k / sqrt(dh)``. Exact, but the attention matrices keep their full size; the FFN
and the dropped layers are physically removed. ``dynabert.json`` gives both the sub-network's own
parameter count and the exported file's.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdrun.errors import UserError
from kdrun.strategies.dynabert.subnet import check_model, count_params, kept_count, kept_layers, layer_list, shape_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                   "merges.txt", "vocab.json")


def standard_heads(hidden: int, heads: int) -> int:
    """h': the smallest divisor of ``hidden`` that is >= ``heads`` (module doc)."""
    return next(h for h in range(heads, hidden + 1) if hidden % h == 0)


@torch.no_grad()
def export_subnetwork(model: nn.Module, width: float, depth: float) -> tuple[nn.Module, dict[str, Any]]:
    """A new, physically smaller model of ``model``'s class computing its (width, depth) sub-network."""
    check_model(model, "kdrun-export")
    shape = shape_of(model)
    k, f = kept_count(shape.heads, width), kept_count(shape.ffn, width)
    keep = kept_layers(shape.layers, depth)
    d, dh = shape.hidden, shape.head_dim
    h2 = standard_heads(d, k) if k * dh != d else k
    dh2 = d // h2
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_attention_heads, config.intermediate_size, config.num_hidden_layers = h2, f, len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    small = model.__class__(config).to(next(model.parameters()).dtype).eval()
    state = model.state_dict()
    layer_keys = {n for n in state if ".encoder.layer." in n}
    small.load_state_dict({n: v for n, v in state.items() if n not in layer_keys}, strict=False)
    src, dst = layer_list(model), layer_list(small)
    rows = torch.cat([torch.arange(j * dh2, j * dh2 + dh) for j in range(k)])  # kept heads' slots
    for new, old in enumerate(keep):
        a, b = src[old], dst[new]
        for name, scale in (("query", math.sqrt(dh2 / dh)), ("key", 1.0), ("value", 1.0)):
            lin_a, lin_b = getattr(a.attention.self, name), getattr(b.attention.self, name)
            lin_b.weight.zero_()
            lin_b.bias.zero_()
            lin_b.weight[rows] = lin_a.weight[: k * dh] * scale
            lin_b.bias[rows] = lin_a.bias[: k * dh] * scale
        b.attention.output.dense.weight.zero_()
        b.attention.output.dense.weight[:, rows] = a.attention.output.dense.weight[:, : k * dh]
        b.attention.output.dense.bias.copy_(a.attention.output.dense.bias)
        b.attention.output.LayerNorm.load_state_dict(a.attention.output.LayerNorm.state_dict())
        b.intermediate.dense.weight.copy_(a.intermediate.dense.weight[:f])
        b.intermediate.dense.bias.copy_(a.intermediate.dense.bias[:f])
        b.output.dense.weight.copy_(a.output.dense.weight[:, :f])
        b.output.dense.bias.copy_(a.output.dense.bias)
        b.output.LayerNorm.load_state_dict(a.output.LayerNorm.state_dict())
    info = {"width": width, "depth": depth, "kept_heads": k, "head_size": dh, "ffn": f, "kept_layers": keep,
            "standard_heads": h2, "standard_head_size": dh2,
            "params_subnetwork": count_params(shape, width, depth),
            "params_exported": sum(p.numel() for p in small.parameters())}
    return small, info


@torch.no_grad()
def max_logit_difference(model: nn.Module, small: nn.Module, width: float, depth: float, n: int = 8,
                         length: int = 32, seed: int = 0) -> float:
    """Largest |logit difference| between ``model``'s (width, depth) sub-network and ``small`` on ``n``
    random token sequences of ``length`` (the last quarter of the second one padding)."""
    from kdrun.strategies.dynabert.subnet import subnetwork

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, model.config.vocab_size, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1 % n, 3 * length // 4:] = 0
    inputs = {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}
    with subnetwork(model, width, depth):
        ref = model(**inputs).logits
    return float((small(**inputs).logits - ref).abs().max())


def export_run(run_dir: Path, width: float, depth: float, out_dir: Path) -> dict[str, Any]:
    """Export the (width, depth) sub-network of the run in ``run_dir`` to ``out_dir`` (module doc)."""
    from transformers import AutoModelForSequenceClassification

    src = Path(run_dir) / "student"
    if not (src / "config.json").exists():
        raise UserError(f"{src} has no config.json: give the directory of a finished kdrun run (it holds student/)")
    model = AutoModelForSequenceClassification.from_pretrained(src).eval()
    small, info = export_subnetwork(model, width, depth)
    info["max_abs_logit_diff_random_inputs"] = max_logit_difference(model, small, width, depth)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    small.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, out_dir / name)
    info["source"] = str(src.resolve())
    (out_dir / "dynabert.json").write_text(json.dumps(info, indent=2))
    return info


def _multiplier(text: str, key: str) -> float:
    if not text.startswith(f"{key}="):
        raise UserError(f"expected {key}=<multiplier>, got '{text}'")
    try:
        return float(text.split("=", 1)[1])
    except ValueError:
        raise UserError(f"{key}: '{text.split('=', 1)[1]}' is not a number") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kdrun-export", description="Write one (width, depth) sub-network of a "
                                "DynaBERT run as a smaller standard Hugging Face model (README 'DynaBERT').")
    p.add_argument("run_dir", type=Path, help="a finished kdrun run directory (holds student/)")
    p.add_argument("width", help="width=<m_w>, e.g. width=0.5")
    p.add_argument("depth", help="depth=<m_d>, e.g. depth=0.75 (DynaBERT's rule: 1/(1-m_d) an integer, or 1)")
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    try:
        width, depth = _multiplier(args.width, "width"), _multiplier(args.depth, "depth")
        kept_count(1, width)
        kept_layers(1, depth)
        info = export_run(args.run_dir, width, depth, args.out_dir)
    except (UserError, ValueError) as e:
        print(f"kdrun-export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}: {info['kept_heads']} heads of size {info['head_size']} kept (written as "
          f"{info['standard_heads']} standard heads of size {info['standard_head_size']}), FFN {info['ffn']}, "
          f"layers {info['kept_layers']}; parameters {info['params_subnetwork']:,} (sub-network), "
          f"{info['params_exported']:,} (exported file); max |logit difference| to the sub-network on random "
          f"inputs {info['max_abs_logit_diff_random_inputs']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
