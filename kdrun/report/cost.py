"""What a model costs to run, measured beside its score: parameters, weight size, latency, throughput.

Every figure is measured on the run's own device and dev rows, with the compute threads stated:

- parameters: all of them, and without the embeddings (every module named ``embeddings``: word,
  position and token-type tables and their LayerNorm), as the papers count "without embeddings";
- size: the bytes of the weights in the dtype they are saved in, i.e. ``model.safetensors`` less
  its JSON header (tied weights counted once, as ``save_pretrained`` writes them once);
- latency: one dev row of the dev set's median length, batch 1, no padding;
- throughput: one batch of ``train.eval_batch_size`` dev rows padded to its longest row, in rows/s.

Timings exclude warm-up calls and are the median of several repeats, given with their interquartile
range; the repeats stop once their spread is small (``SETTLED_SPREAD`` of the median after
``SETTLE_REPEATS`` calls) or the measurement has used its time budget (at least ``MIN_REPEATS`` are
always timed), so the whole measurement costs seconds on the quickstart. ``report.cost=false`` skips it.

A timing on a busy CPU says little: other processes' CPU time during the measurement (``/proc/stat``;
the load average where there is none) and the spread of the repeats are recorded, and when other
processes left kdrun's threads no free core, or the repeats spread by more than ``UNRELIABLE_SPREAD``
of their median, the cost says why in ``unreliable`` and the speed ratios are printed, carded and
reported as unreliable rather than as figures.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

LATENCY_REPEATS = 50  # at most, per measurement
THROUGHPUT_REPEATS = 20
MIN_REPEATS = 3
SETTLE_REPEATS = 10  # calls timed before a small spread may end a measurement
SETTLED_SPREAD = 0.05  # interquartile range / median that ends it
UNRELIABLE_SPREAD = 0.5  # interquartile range / median above which a timing is not trusted
BUSY_MARGIN = 0.25  # cores others may use beyond the ones kdrun's threads leave free
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

_clock = time.perf_counter  # the timer (tests replace it to inject timings)


@dataclass
class Timing:
    """Seconds of one call: the median and quartiles over ``n`` timed calls."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def spread(self) -> float:
        """The interquartile range as a fraction of the median."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0


def quartiles(times: list[float]) -> Timing:
    if len(times) < 2:
        return Timing(times[0], times[0], times[0], len(times))
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Timing(median, q1, q3, len(times))


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = WARMUP, budget_s: float = BUDGET_S,
               sync: Callable[[], None] | None = None) -> Timing:
    """``warmup`` untimed calls of ``fn``, then timed ones until their spread settles (at most
    ``SETTLED_SPREAD`` after ``SETTLE_REPEATS`` calls), ``budget_s`` is used or ``repeats`` are timed;
    never fewer than ``MIN_REPEATS``."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    while len(times) < repeats and (len(times) < MIN_REPEATS or sum(times) < budget_s):
        t0 = _clock()
        fn()
        sync()
        times.append(_clock() - t0)
        if len(times) >= SETTLE_REPEATS and quartiles(times).spread <= SETTLED_SPREAD:
            break
    return quartiles(times)


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = WARMUP, budget_s: float = BUDGET_S,
                   sync: Callable[[], None] | None = None) -> tuple[float, int]:
    """(median seconds of one call of ``fn``, calls timed) by :func:`time_calls`."""
    t = time_calls(fn, repeats, warmup, budget_s, sync)
    return t.median, t.n


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
        lat = time_calls(call(single), LATENCY_REPEATS, budget_s=budget_s, sync=sync)
        thr = time_calls(call(batch), THROUGHPUT_REPEATS, warmup=1, budget_s=budget_s, sync=sync)
    finally:
        model.train(was_training)
    dtype = saved_dtype or next(model.parameters()).dtype
    rows = inputs["batch_rows"]
    return {**count_parameters(model), "size_mb": weights_bytes(model, saved_dtype) / 1e6,
            "dtype": str(dtype).removeprefix("torch."), "run_dtype": str(next(model.parameters()).dtype)
            .removeprefix("torch."), "latency_ms": lat.median * 1e3, "latency_iqr_ms": [lat.q1 * 1e3, lat.q3 * 1e3],
            "latency_repeats": lat.n, "throughput_rows_s": rows / thr.median,
            "throughput_iqr_rows_s": [rows / thr.q3, rows / thr.q1], "throughput_repeats": thr.n}


def ratios(teacher: Mapping[str, Any], student: Mapping[str, Any]) -> dict[str, float]:
    """Teacher / student: ``smaller`` (parameters), ``smaller_size`` (bytes), ``faster`` (latency)
    and ``throughput`` (student's rows/s over the teacher's)."""
    return {"smaller": teacher["total"] / student["total"], "smaller_size": teacher["size_mb"] / student["size_mb"],
            "faster": teacher["latency_ms"] / student["latency_ms"],
            "throughput": student["throughput_rows_s"] / teacher["throughput_rows_s"]}


def ratio_ranges(teacher: Mapping[str, Any], student: Mapping[str, Any]) -> dict[str, list[float]]:
    """The speed ratios at the ends of the two models' interquartile ranges: [lowest, highest]."""
    (t1, t3), (s1, s3) = teacher["latency_iqr_ms"], student["latency_iqr_ms"]
    (u1, u3), (v1, v3) = teacher["throughput_iqr_rows_s"], student["throughput_iqr_rows_s"]
    return {"faster": [t1 / s3, t3 / s1], "throughput": [v1 / u3, v3 / u1]}


# ------------------------------------------------------------------------------- a busy machine

def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent (``/proc/stat``), or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class MachineWatch:
    """CPU use while kdrun times its models, per second of wall time: this process's (``own_cores``) and
    all other processes' (``others_cores``: all CPU time in ``/proc/stat`` less this process's); the
    load average besides."""

    def __enter__(self) -> MachineWatch:
        self.t0, self.own0, self.busy0 = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        busy = _busy_cpu_seconds()
        own = time.process_time() - self.own0
        self.own_cores = own / wall
        self.others_cores = None if busy is None or self.busy0 is None \
            else max(0.0, (busy - self.busy0 - own) / wall)

    def facts(self, threads: int) -> dict[str, Any]:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        others = None if self.others_cores is None else round(self.others_cores, 2)
        return {"cores": os.cpu_count() or 1, "threads": threads, "load_avg_1min": load,
                "own_cores": round(self.own_cores, 2), "others_cores": others}


def busy_reason(machine: Mapping[str, Any]) -> str | None:
    """Why the machine was too busy for timings, or None: other processes ran while the cores were
    all in use (less than ``BUSY_MARGIN`` of a core idle), so kdrun's threads waited for a core."""
    cores, others = machine["cores"], machine.get("others_cores")
    if others is None:  # no /proc/stat: the load average, which counts kdrun's own threads too
        load = machine.get("load_avg_1min")
        if load is not None and load > cores + BUSY_MARGIN:
            return f"measured on a busy machine (load average {load:.1f} on {cores} cores)"
        return None
    if others >= BUSY_MARGIN and others + machine["own_cores"] > cores - BUSY_MARGIN:
        return (f"measured on a busy machine (other processes kept {others:.1f} of {cores} cores busy while kdrun "
                f"timed on {machine['threads']} thread(s); no core was left idle)")
    return None


def spread_reason(models: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why the timings are not trusted for their spread (interquartile range over the median), or None."""
    for who, c in models.items():
        for key, label in (("latency_iqr_ms", "latency"), ("throughput_iqr_rows_s", "throughput")):
            lo, hi = c[key]
            median = c["latency_ms" if label == "latency" else "throughput_rows_s"]
            if median > 0 and (hi - lo) / median > UNRELIABLE_SPREAD:
                return (f"measured on a busy machine? the {who}'s {label} timings spread by {(hi - lo) / median:.0%} "
                        "of their median (interquartile range)")
    return None


def speed_unreliable(cost: Mapping[str, Any] | None) -> str | None:
    """Why the cost's latency and throughput figures are not to be trusted, or None."""
    return (cost or {}).get("unreliable")


def run_cost(student: nn.Module, teacher: nn.Module | None, dev_rows: Any, batch_size: int, pad_token_id: int,
             device: str, student_dtype: torch.dtype | None = None, autocast: Callable[[], Any] | None = None,
             budget_s: float = BUDGET_S) -> dict[str, Any]:
    """results.json's ``cost``: the student's and the teacher's (when there is one) costs on the
    same inputs, their ratios, and how they were measured (device, threads, lengths, seconds)."""
    t0 = time.perf_counter()
    inputs = cost_inputs(dev_rows, batch_size, pad_token_id)
    out: dict[str, Any] = {
        "device": device, "threads": torch.get_num_threads(), "latency_length": inputs["length"],
        "throughput_batch": inputs["batch_rows"], "throughput_length": inputs["batch_length"], "warmup": WARMUP}
    with MachineWatch() as watch:
        out["student"] = model_cost(student, inputs, student_dtype, autocast, budget_s)
        if teacher is not None:
            out["teacher"] = model_cost(teacher, inputs, None, autocast, budget_s)
    if teacher is not None:
        out["ratios"] = ratios(out["teacher"], out["student"])
        out["ratio_ranges"] = ratio_ranges(out["teacher"], out["student"])
    out["machine"] = watch.facts(out["threads"])
    timed = {who: out[who] for who in ("teacher", "student") if who in out}
    out["unreliable"] = busy_reason(out["machine"]) if device.startswith("cpu") else None
    out["unreliable"] = out["unreliable"] or spread_reason(timed)
    out["seconds"] = time.perf_counter() - t0
    return out


# -------------------------------------------------------------------------------------- printing

def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def latency_text(c: Mapping[str, Any]) -> str:
    """``0.66 ms (IQR 0.64–0.70)``: the median latency and its interquartile range when recorded."""
    iqr = c.get("latency_iqr_ms")
    return f"{c['latency_ms']:.2f} ms" + (f" (IQR {iqr[0]:.2f}–{iqr[1]:.2f})" if iqr else "")


def throughput_text(c: Mapping[str, Any]) -> str:
    iqr = c.get("throughput_iqr_rows_s")
    return f"{c['throughput_rows_s']:,.0f} rows/s" + (f" (IQR {iqr[0]:,.0f}–{iqr[1]:,.0f})" if iqr else "")


def speed_text(cost: Mapping[str, Any]) -> str:
    """The speed ratios with their range over the quartiles, or why they are not given."""
    why = speed_unreliable(cost)
    if why:
        return f"speed ratios unreliable: {why}; latency and throughput not compared"
    r, ranges = cost["ratios"], cost.get("ratio_ranges") or {}

    def span(key: str) -> str:
        lo, hi = ranges.get(key) or (None, None)
        return f", {lo:.2f}–{hi:.2f}× over the quartiles" if lo is not None else ""

    return (f"{times(r['faster'], 'faster', 'slower')} (latency{span('faster')}), {r['throughput']:.2f}× the "
            f"throughput{' (' + span('throughput')[2:] + ')' if span('throughput') else ''}")


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
                         f"{size_text(c['size_mb'])} ({c['dtype']})", latency_text(c), throughput_text(c)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"\ncost on {cost['device']} (threads: {cost['threads']}): latency at batch 1 × {cost['latency_length']} "
             f"tokens, throughput at batch {cost['throughput_batch']} × {cost['throughput_length']} tokens "
             "(dev rows; medians and interquartile ranges, warm-up excluded)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    r = cost.get("ratios")
    if r:
        lines.append(f"student vs teacher: {times(r['smaller'], 'smaller', 'larger')} (parameters), "
                     f"{times(r['smaller_size'], 'smaller', 'larger')} on disk, {speed_text(cost)}")
    elif speed_unreliable(cost):
        lines.append(f"latency and throughput unreliable: {speed_unreliable(cost)}")
    return lines


def times(ratio: float, more: str, less: str) -> str:
    """A teacher / student ratio in words: ``2.0× smaller`` at 2, ``1.4× larger`` at 0.7 (never
    "0.7× smaller", e.g. a student saved in fp32 beside an fp16 teacher)."""
    return f"{ratio:.1f}× {more}" if ratio >= 1 else f"{1 / ratio:.1f}× {less}"
