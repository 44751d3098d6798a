"""What a model costs to run, measured beside its score: parameters, weight size, latency, throughput.

Every figure is measured on the run's own device and dev rows, with the compute threads stated:

- parameters: all of them, and without the embeddings (every module named ``embeddings``: word,
  position and token-type tables and their LayerNorm), as the papers count "without embeddings";
- size: the bytes of the weights in the dtype they are saved in, i.e. ``model.safetensors`` less
  its JSON header (tied weights counted once, as ``save_pretrained`` writes them once);
- latency: one dev row of the dev set's median length, batch 1, no padding;
- throughput: one batch of ``train.eval_batch_size`` dev rows padded to its longest row, in rows/s.

Timings exclude warm-up calls and are the median of several repeats; the repeats stop early once a
measurement has used its time budget (at least ``MIN_REPEATS`` are always timed), so the whole
measurement costs seconds on the quickstart. ``report.cost=false`` skips it.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

LATENCY_REPEATS = 20
THROUGHPUT_REPEATS = 5
MIN_REPEATS = 3
WARMUP = 2
BUDGET_S = 1.0  # per measurement, after warm-up
LENGTH_SAMPLE = 2000  # dev rows read to find the median length


# ------------------------------------------------------------------------------------ static costs

def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"total", "without_embeddings"}``: parameters, each shared tensor counted once."""
    def unique(params: Iterable[nn.Parameter]) -> dict[int, int]:
        return {id(p): p.numel() for p in params}

    total = unique(model.parameters())
    emb: dict[int, int] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "embeddings":
            emb |= unique(module.parameters())
    return {"total": sum(total.values()), "without_embeddings": sum(v for k, v in total.items() if k not in emb)}


def weights_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``model``'s state dict (in ``dtype`` for floating tensors when given), each storage
    once: the payload of the ``model.safetensors`` that ``save_pretrained`` writes."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        size = torch.empty((), dtype=dtype).element_size() if dtype is not None and t.is_floating_point() \
            else t.element_size()
        total += t.numel() * size
    return total


def saved_weights_bytes(path: Any) -> int:
    """The weights' bytes of a ``model.safetensors`` file: its size less the 8-byte length and the
    JSON header, i.e. what :func:`weights_bytes` counts for the model saved in it."""
    import os

    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header


def size_text(size_mb: float | None) -> str:
    """A size in MB (1e6 bytes) as every table prints it: one decimal, or ``—`` when unknown."""
    return "—" if size_mb is None else f"{size_mb:.1f} MB"


# ---------------------------------------------------------------------------------------- timing

def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = WARMUP, budget_s: float = BUDGET_S,
                   sync: Callable[[], None] | None = None) -> tuple[float, int]:
    """(median seconds of one call of ``fn``, calls timed): ``warmup`` untimed calls, then up to
    ``repeats`` timed ones, fewer once ``budget_s`` is used (never fewer than ``MIN_REPEATS``)."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats and (len(times) < MIN_REPEATS or spent < budget_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return statistics.median(times), len(times)


def _sync_for(device: torch.device) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


# -------------------------------------------------------------------------------------- the rows

def pad_batch(rows: list[Mapping[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The token columns of ``rows`` padded to the longest (input ids with ``pad_token_id``, the
    attention mask and token types with 0): (B, n) long tensors."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {}
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        if key not in rows[0]:
            continue
        fill = pad_token_id if key == "input_ids" else 0
        out[key] = torch.tensor([list(r[key]) + [fill] * (width - len(r[key])) for r in rows], dtype=torch.long)
    if "attention_mask" not in out:
        out["attention_mask"] = (out["input_ids"] != pad_token_id).long()
    return out


def cost_inputs(dev_rows: Any, batch_size: int, pad_token_id: int) -> dict[str, Any]:
    """The inputs every model of a run is timed on: the dev row of median length (batch 1) and the
    first ``batch_size`` dev rows (one padded batch). ``dev_rows``: a sequence of tokenised rows
    (a ``datasets.Dataset`` or a list of dicts with ``input_ids``)."""
    n = len(dev_rows)
    if n == 0:
        raise ValueError("no dev rows to time the models on")
    sample = dev_rows.select(range(min(n, LENGTH_SAMPLE))) if hasattr(dev_rows, "select") else dev_rows[:LENGTH_SAMPLE]
    lengths = [len(ids) for ids in (sample["input_ids"] if hasattr(sample, "column_names")
                                    else [r["input_ids"] for r in sample])]
    median = sorted(lengths)[(len(lengths) - 1) // 2]  # a length that occurs (the lower median)
    row = sample[lengths.index(median)]
    first = [dev_rows[i] for i in range(min(n, batch_size))]
    batch = pad_batch(first, pad_token_id)
    return {"single": pad_batch([row], pad_token_id), "batch": batch, "length": median,
            "batch_rows": len(first), "batch_length": int(batch["input_ids"].shape[1])}


# ---------------------------------------------------------------------------------------- models

def _inner(model: nn.Module) -> nn.Module:
    """The model inside DDP (``module``) or torch.compile (``_orig_mod``) wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module) or isinstance(getattr(model, "_orig_mod", None),
                                                                                  nn.Module):
        model = getattr(model, "module", None) or model._orig_mod
    return model


@torch.no_grad()
def model_cost(model: nn.Module, inputs: dict[str, Any], saved_dtype: torch.dtype | None = None,
               autocast: Callable[[], Any] | None = None, budget_s: float = BUDGET_S) -> dict[str, Any]:
    """One model's cost on ``inputs`` (:func:`cost_inputs`): parameters, size (MB, 1e6 bytes; in
    ``saved_dtype`` when given), latency (ms, batch 1) and throughput (rows/s, one batch)."""
    from kdrun.models.features import model_inputs

    model = _inner(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sync = _sync_for(device)
    ctx = autocast or nullcontext
    single = {k: v.to(device) for k, v in model_inputs(inputs["single"], model).items()}
    batch = {k: v.to(device) for k, v in model_inputs(inputs["batch"], model).items()}

    def call(x):
        def go():
            with ctx():
                model(**x)
        return go

    try:
        lat, n_lat = median_seconds(call(single), LATENCY_REPEATS, budget_s=budget_s, sync=sync)
        thr, n_thr = median_seconds(call(batch), THROUGHPUT_REPEATS, warmup=1, budget_s=budget_s, sync=sync)
    finally:
        model.train(was_training)
    dtype = saved_dtype or next(model.parameters()).dtype
    return {**count_parameters(model), "size_mb": weights_bytes(model, saved_dtype) / 1e6,
            "dtype": str(dtype).removeprefix("torch."), "run_dtype": str(next(model.parameters()).dtype)
            .removeprefix("torch."), "latency_ms": lat * 1e3, "latency_repeats": n_lat,
            "throughput_rows_s": inputs["batch_rows"] / thr, "throughput_repeats": n_thr}


def ratios(teacher: Mapping[str, Any], student: Mapping[str, Any]) -> dict[str, float]:
    """Teacher / student: ``smaller`` (parameters), ``smaller_size`` (bytes), ``faster`` (latency)
    and ``throughput`` (student's rows/s over the teacher's)."""
    return {"smaller": teacher["total"] / student["total"], "smaller_size": teacher["size_mb"] / student["size_mb"],
            "faster": teacher["latency_ms"] / student["latency_ms"],
            "throughput": student["throughput_rows_s"] / teacher["throughput_rows_s"]}


def run_cost(student: nn.Module, teacher: nn.Module | None, dev_rows: Any, batch_size: int, pad_token_id: int,
             device: str, student_dtype: torch.dtype | None = None, autocast: Callable[[], Any] | None = None,
             budget_s: float = BUDGET_S) -> dict[str, Any]:
    """results.json's ``cost``: the student's and the teacher's (when there is one) costs on the
    same inputs, their ratios, and how they were measured (device, threads, lengths, seconds)."""
    t0 = time.perf_counter()
    inputs = cost_inputs(dev_rows, batch_size, pad_token_id)
    out: dict[str, Any] = {
        "device": device, "threads": torch.get_num_threads(), "latency_length": inputs["length"],
        "throughput_batch": inputs["batch_rows"], "throughput_length": inputs["batch_length"],
        "warmup": WARMUP, "student": model_cost(student, inputs, student_dtype, autocast, budget_s)}
    if teacher is not None:
        out["teacher"] = model_cost(teacher, inputs, None, autocast, budget_s)
        out["ratios"] = ratios(out["teacher"], out["student"])
    out["seconds"] = time.perf_counter() - t0
    return out


# -------------------------------------------------------------------------------------- printing

def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def cost_lines(cost: Mapping[str, Any] | None) -> list[str]:
    """The printed cost table: one line per model and a ratio line (nothing when not measured)."""
    if not cost:
        return []
    if "error" in cost:
        return [f"cost: not measured ({cost['error']})"]
    rows = [("model", "params", "w/o emb", "size", "latency", "throughput")]
    for who in ("teacher", "student"):
        c = cost.get(who)
        if c:
            rows.append((who, _millions(c["total"]), _millions(c["without_embeddings"]),
                         f"{size_text(c['size_mb'])} ({c['dtype']})", f"{c['latency_ms']:.2f} ms",
                         f"{c['throughput_rows_s']:,.0f} rows/s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"\ncost on {cost['device']} (threads: {cost['threads']}): latency at batch 1 × {cost['latency_length']} "
             f"tokens, throughput at batch {cost['throughput_batch']} × {cost['throughput_length']} tokens "
             "(dev rows; medians, warm-up excluded)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    r = cost.get("ratios")
    if r:
        lines.append(f"student vs teacher: {times(r['smaller'], 'smaller', 'larger')} (parameters), "
                     f"{times(r['smaller_size'], 'smaller', 'larger')} on disk, "
                     f"{times(r['faster'], 'faster', 'slower')} (latency), {r['throughput']:.1f}× the throughput")
    return lines


def times(ratio: float, more: str, less: str) -> str:
    """A teacher / student ratio in words: ``2.0× smaller`` at 2, ``1.4× larger`` at 0.7 (never
    "0.7× smaller", e.g. a student saved in fp32 beside an fp16 teacher)."""
    return f"{ratio:.1f}× {more}" if ratio >= 1 else f"{1 / ratio:.1f}× {less}"
