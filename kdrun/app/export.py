"""``kdrun-export``: a finished run's student as ONNX and as int8, each checked against the PyTorch student.

    kdrun-export RUN_DIR [--format onnx|int8|both] [--out DIR]     (default: both)
    kdrun-export RUN_DIR <a stage strategy's own arguments>  (e.g. a sub-network: width=0.5 depth=0.75 OUT_DIR)

``--format onnx`` writes ``model.onnx``: the student's logits from ``input_ids``, ``attention_mask``
(and ``token_type_ids`` for families that use them), with dynamic batch and sequence axes.
``--format int8`` writes ``model.int8.onnx``: the same graph with onnxruntime's dynamic quantisation
(int8 weights of the MatMul/Gemm layers, activations quantised on the fly). ``both``, the default,
writes both.

Each file is then run with onnxruntime on the run's dev set and compared with the PyTorch student
on the same padded batches: prediction agreement (the share of equal argmaxes; for regression the
Pearson correlation of the two models' scores),
the largest logit difference, and the task metrics with their delta; and timed like a run's cost
(kdrun.report.cost: batch-1 latency at the dev set's median length, throughput on one eval batch,
medians after warm-up, the same thread count for PyTorch and onnxruntime). ``export.json`` beside
the files holds all of it; the tokenizer and ``config.json`` are copied so the directory is usable
alone.

The graph comes from PyTorch's TorchScript-based exporter (``torch.onnx.export(..., dynamo=False)``):
it needs only ``onnx``, while the torch.export-based exporter (the default since torch 2.9) needs
``onnxscript`` on top, one more package for the same graph of these encoder models. ``optimum-onnx``
is not used: its releases pin transformers < 4.58, and kdrun runs on transformers 5.

onnx and onnxruntime come with the ``export`` extra: ``pip install -e ".[export]"``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from kdrun.errors import UserError

FORMATS = ("onnx", "int8", "both")
# Families whose sequence-classification models the TorchScript exporter traces into one graph for any
# batch and sequence length (checked by tests/test_export.py).
FAMILIES = ("bert", "roberta", "electra", "distilbert", "deberta-v2")
OPSET = 17
FILES = {"onnx": "model.onnx", "int8": "model.int8.onnx"}
EXTRA = 'pip install -e ".[export]"  (or: pip install "kdrun[export]")'


# ------------------------------------------------------------------------------------- the student

def _runtime():
    """onnx and onnxruntime, or a one-line refusal naming the extra."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError as e:
        raise UserError(f"--format needs onnx and onnxruntime ({e.name} is not installed): {EXTRA}") from None
    return onnxruntime


def load_run(run_dir: Path) -> tuple[dict[str, Any], Path]:
    """(results.json, the student directory) of a finished run."""
    run_dir = Path(run_dir)
    results, student = run_dir / "results.json", run_dir / "student"
    if not results.is_file() or not (student / "config.json").is_file():
        raise UserError(f"{run_dir} holds no results.json and student/: give the directory of a finished kdrun run")
    return json.loads(results.read_text()), student


def check_exportable(summary: dict[str, Any], student_dir: Path) -> None:
    """Refuse (one line, naming what) a student that the ONNX export does not cover."""
    config = json.loads((student_dir / "config.json").read_text())
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"the student's family '{family}' ({student_dir / 'config.json'}) is not supported by the "
                        f"ONNX export; supported families: {', '.join(FAMILIES)}")
    kind = ((summary.get("config") or {}).get("task") or {}).get("kind", "classification")
    if kind != "classification":
        raise UserError(f"task.kind={kind}: the ONNX export writes sequence-classification students only "
                        "(task.kind=classification)")


def load_student(student_dir: Path):
    """The saved student in fp32 (a bf16/fp16 save is upcast: ONNX and int8 start from fp32), eval mode."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(student_dir).float().eval()


def dev_rows(summary: dict[str, Any], tokenizer, max_rows: int | None = None) -> tuple[str, Any]:
    """(split, tokenised rows) of the run's first dev split, loaded as the run loaded it."""
    import datasets

    from kdrun.config import task_config
    from kdrun.tasks.kinds import kind_of

    task = task_config((summary.get("config") or {})["task"])
    kind = kind_of(task)
    split = task.eval_splits[0]
    raw = kind.load_raw(task)
    rows = kind.tokenize(datasets.DatasetDict({split: raw[split]}), tokenizer, task)[split]
    if max_rows is not None and len(rows) > max_rows:
        rows = rows.select(range(max_rows))
    return split, rows


# -------------------------------------------------------------------------------------- the export

class LogitsOf(torch.nn.Module):
    """The student as a function of its token tensors (in ``names`` order) returning its logits: what
    the graph computes."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, tensors))).logits


def input_names(model) -> list[str]:
    """The token inputs the student reads: input_ids, attention_mask, and token_type_ids where used."""
    from kdrun.models.features import model_inputs

    dummy = {k: torch.zeros(1, 1, dtype=torch.long) for k in ("input_ids", "attention_mask", "token_type_ids")}
    return list(model_inputs(dummy, model))


def export_onnx(model, path: Path, pad_token_id: int, opset: int = OPSET) -> list[str]:
    """Write ``model``'s logits graph to ``path`` with dynamic batch and sequence axes; returns the input names.

    Traced on a padded batch of two rows, so the attention-mask path is in the graph."""
    names = input_names(model)
    ids = torch.full((2, 8), 5, dtype=torch.long)
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = pad_token_id, 0
    example = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {"logits": {0: "batch"}}
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation and tracer notices
        warnings.simplefilter("ignore")
        # eval(): the exporter puts the wrapper's mode back on it afterwards, the student's included
        torch.onnx.export(LogitsOf(model, names).eval(), tuple(example[n] for n in names), str(path), dynamo=False,
                          input_names=names, output_names=["logits"], dynamic_axes=axes, opset_version=opset)
    return names


def quantize_int8(src: Path, dst: Path) -> None:
    """onnxruntime's dynamic quantisation of ``src``: int8 weights, activations quantised at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its advice to pre-process the graph first (shape inference) is for static
    try:                           # quantisation of vision models; dynamic quantisation of MatMuls needs none
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)


def ort_graph(path: Path, threads: int):
    """An onnxruntime CPU inference session with ``threads`` compute threads (the PyTorch side's count)."""
    ort = _runtime()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _ort_call(graph, batch: dict[str, Any]):
    names = [i.name for i in graph.get_inputs()]
    feed = {n: batch[n].numpy() for n in names}
    return lambda: graph.run(None, feed)[0]


# ------------------------------------------------------------------------------------------ checks

def predictions(model, graphs: dict[str, Any], rows, collator, batch_size: int) -> tuple[dict[str, Any], Any]:
    """Logits of the PyTorch student (``pytorch``) and of each ONNX graph on the same padded dev batches,
    and the labels: ({name: (N, C) float array}, (N,) labels)."""
    import numpy as np

    from kdrun.models.features import model_inputs

    out: dict[str, list] = {"pytorch": [], **{k: [] for k in graphs}}
    labels = []
    for i in range(0, len(rows), batch_size):
        batch = collator([rows[j] for j in range(i, min(i + batch_size, len(rows)))])
        inputs = model_inputs(batch, model)
        with torch.no_grad():
            out["pytorch"].append(model(**inputs).logits.float().numpy())
        for name, graph in graphs.items():
            out[name].append(_ort_call(graph, inputs)())
        labels.append(batch["labels"].numpy())
    return {k: np.concatenate(v) for k, v in out.items()}, np.concatenate(labels)


def agreement(reference, other, regression: bool) -> float:
    """How far the two models' predictions agree: the share of rows with the same argmax
    (classification), or the Pearson correlation of the two models' scores (regression: a share of
    scores within a tolerance said 100 % where the task's Pearson had dropped by 0.016)."""
    import numpy as np

    if regression:
        a, b = reference.reshape(-1).astype(np.float64), other.reshape(-1).astype(np.float64)
        if a.std() == 0 or b.std() == 0:
            return float(np.array_equal(a, b))
        return float(np.corrcoef(a, b)[0, 1])
    return float(np.mean(reference.argmax(-1) == other.argmax(-1)))


def agreement_text(value: float, regression: bool) -> str:
    return f"r {value:.4f}" if regression else f"{100 * value:.2f} %"


def timings(model, graphs: dict[str, Any], rows, batch_size: int, pad_token_id: int) -> dict[str, Any]:
    """Latency (ms, batch 1) and throughput (rows/s, one eval batch) of the PyTorch student and of each
    ONNX graph, on the inputs a run's cost uses (kdrun.report.cost.cost_inputs)."""
    from kdrun.models.features import model_inputs
    from kdrun.report.cost import LATENCY_REPEATS, THROUGHPUT_REPEATS, cost_inputs, median_seconds

    inputs = cost_inputs(rows, batch_size, pad_token_id)
    single, batch = model_inputs(inputs["single"], model), model_inputs(inputs["batch"], model)

    def torch_call(x):
        def go():
            with torch.no_grad():
                model(**x)
        return go

    calls = {"pytorch": (torch_call(single), torch_call(batch))}
    calls |= {name: (_ort_call(s, single), _ort_call(s, batch)) for name, s in graphs.items()}
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "latency_length": inputs["length"],
                           "throughput_batch": inputs["batch_rows"], "throughput_length": inputs["batch_length"]}
    for name, (one, many) in calls.items():
        lat, _ = median_seconds(one, LATENCY_REPEATS)
        thr, _ = median_seconds(many, THROUGHPUT_REPEATS, warmup=1)
        out[name] = {"latency_ms": lat * 1e3, "throughput_rows_s": inputs["batch_rows"] / thr}
    return out


# ------------------------------------------------------------------------------------------- the run

def export(run_dir: Path, fmt: str = "both", out: Path | None = None, max_rows: int | None = None,
           batch_size: int | None = None) -> dict[str, Any]:
    """Export the student of the run in ``run_dir`` as ``fmt`` (onnx, int8, both) into ``out``
    (default ``<run_dir>/export``), check it on the dev set and time it; returns export.json's content
    (paths relative to the run directory; ``run_dir`` relative to ``out``)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kdrun.config import task_config
    from kdrun.runtime.cache import write_json_atomic

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: one of {', '.join(FORMATS)}")
    _runtime()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    summary, student_dir = load_run(run_dir)
    check_exportable(summary, student_dir)
    out = Path(out) if out is not None else run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_student(student_dir), AutoTokenizer.from_pretrained(student_dir)
    names, paths = write_graphs(model, tokenizer.pad_token_id, out, fmt)
    copy_model_files(student_dir, out)
    task = task_config(summary["config"]["task"])
    split, rows = dev_rows(summary, tokenizer, max_rows)
    asked = batch_size or int((summary["config"].get("train") or {}).get("eval_batch_size", 128))
    result: dict[str, Any] = {
        "run_dir": os.path.relpath(run_dir, out), "student": os.path.relpath(student_dir, run_dir), "format": fmt,
        "inputs": names, "opset": OPSET, "exporter": "torch.onnx.export (TorchScript, dynamo=False)",
        "int8": "onnxruntime.quantization.quantize_dynamic (QInt8 weights)" if "int8" in paths else None,
        "dev": {"split": split, "rows": len(rows), "batch_size": min(asked, len(rows))},
    }
    result |= compare(model, tokenizer, task, paths, rows, result["dev"]["batch_size"], run_dir)
    result["pytorch"] |= {"size_mb": _size_mb(student_dir / "model.safetensors"),
                          "recorded_metrics": ((summary.get("student") or {}).get("metrics") or {}).get(split)}
    result["seconds"] = time.perf_counter() - t0
    write_json_atomic(out / "export.json", result)
    return result


def write_graphs(model, pad_token_id: int, out: Path, fmt: str) -> tuple[list[str], dict[str, Path]]:
    """Write the ONNX file(s) of ``fmt`` into ``out`` (int8 alone: the fp32 graph only in a temporary
    directory); returns (the graph's input names, {format: file})."""
    wanted = ["onnx", "int8"] if fmt == "both" else [fmt]
    paths: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        fp32 = out / FILES["onnx"] if "onnx" in wanted else Path(tmp) / FILES["onnx"]
        names = export_onnx(model, fp32, pad_token_id)
        if "onnx" in wanted:
            paths["onnx"] = fp32
        if "int8" in wanted:
            paths["int8"] = out / FILES["int8"]
            quantize_int8(fp32, paths["int8"])
    return names, paths


def copy_model_files(student_dir: Path, out: Path) -> None:
    """The tokenizer and ``config.json`` beside the graphs, so the directory is usable alone."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                 "vocab.json", "merges.txt"):
        if (student_dir / name).exists():
            shutil.copy2(student_dir / name, out / name)


def compare(model, tokenizer, task, paths: dict[str, Path], rows, batch_size: int, run_dir: Path) -> dict[str, Any]:
    """export.json's ``pytorch`` metrics, one entry per graph (file relative to ``run_dir``, size,
    metrics, agreement) and ``timing``, on ``rows`` in batches of ``batch_size``."""
    from kdrun.tasks.kinds import kind_of
    from kdrun.tasks.metrics import compute_task_metrics

    regression = task.num_labels == 1
    graphs = {k: ort_graph(p, torch.get_num_threads()) for k, p in paths.items()}
    collator = kind_of(task).collator(tokenizer, task, False)
    logits, labels = predictions(model, graphs, rows, collator, batch_size)
    metrics = {k: compute_task_metrics(list(task.metrics), v, labels, regression) for k, v in logits.items()}
    result: dict[str, Any] = {"pytorch": {"metrics": metrics["pytorch"]},
                              "agreement_measure": "pearson" if regression else "argmax"}
    for k, p in paths.items():
        result[k] = {"file": os.path.relpath(p, run_dir), "size_mb": p.stat().st_size / 1e6, "metrics": metrics[k],
                     "metric_delta": {m: metrics[k][m] - metrics["pytorch"][m] for m in metrics[k]},
                     "agreement": agreement(logits["pytorch"], logits[k], regression),
                     "max_abs_logit_diff": float(abs(logits[k] - logits["pytorch"]).max())}
    result["timing"] = timings(model, graphs, rows, batch_size, tokenizer.pad_token_id)
    return result


def _size_mb(weights: Path) -> float | None:
    """The saved student's weights in MB as a run's cost counts them (kdrun.report.cost: the
    ``model.safetensors`` payload, without its header)."""
    from kdrun.report.cost import saved_weights_bytes

    return saved_weights_bytes(weights) / 1e6 if weights.exists() else None


def report_lines(result: dict[str, Any], run_dir: Path) -> list[str]:
    """The printed summary: one row per format (PyTorch first), then where everything is."""
    from kdrun.report.cost import size_text

    t, dev = result["timing"], result["dev"]
    main = next(iter(result["pytorch"]["metrics"]))
    head = ("format", "file", "size", "agreement", "max |Δ logit|", f"{main} (Δ)", "latency", "throughput")
    rows = [head]
    for k in ("pytorch", "onnx", "int8"):
        if k not in result or result[k] is None or not isinstance(result[k], dict):
            continue
        r, tk = result[k], t[k]
        value = r["metrics"][main]
        if k == "pytorch":
            cells = ("student/", size_text(r.get("size_mb")), "—", "—", f"{value:.4f}")
        else:
            cells = (Path(r["file"]).name, size_text(r["size_mb"]),
                     agreement_text(r["agreement"], result.get("agreement_measure") == "pearson"),
                     f"{r['max_abs_logit_diff']:.1e}", f"{value:.4f} ({r['metric_delta'][main]:+.4f})")
        rows.append((k, *cells, f"{tk['latency_ms']:.2f} ms", f"{tk['throughput_rows_s']:,.0f} rows/s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"kdrun-export: {dev['split']} ({dev['rows']} rows, batch {dev['batch_size']}), predictions compared "
             f"with the PyTorch student; latency at batch 1 × {t['latency_length']} tokens, throughput at batch "
             f"{t['throughput_batch']} × {t['throughput_length']} tokens (threads: {t['threads']}; medians, warm-up "
             "excluded)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    first = next(result[k]["file"] for k in ("onnx", "int8") if isinstance(result.get(k), dict))
    out = Path(os.path.abspath(Path(run_dir) / first)).parent  # the folder as an absolute path, never ../../..
    lines.append(f"written: {out} (export.json, the ONNX file(s), tokenizer and config) in {result['seconds']:.1f}s")
    return lines


# ---------------------------------------------------------------------------------------------- cli

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from kdrun.engine.strategies import export_with_strategy

    status = export_with_strategy(argv)  # arguments a stage strategy's exporter owns (StageStrategy.export)
    if status is not None:
        return status
    p = argparse.ArgumentParser(
        prog="kdrun-export",
        description="Export a finished run's student as ONNX and/or int8 (dynamic quantisation), checked on the "
                    "dev set against the PyTorch student and timed. A stage strategy's own export (e.g. a "
                    "sub-network): kdrun-export RUN_DIR width=<m_w> depth=<m_d> OUT_DIR.")
    p.add_argument("run_dir", type=Path, help="a finished kdrun run directory (holds results.json and student/)")
    p.add_argument("--format", default="both", choices=FORMATS, help="onnx, int8 or both (default: both)")
    p.add_argument("--out", type=Path, default=None, help="where the files go (default: <run_dir>/export)")
    p.add_argument("--max-rows", type=int, default=None, help="compare on the first N dev rows only (default: all)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="dev batch size for the comparison and the throughput (default: the run's eval_batch_size)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of PyTorch and onnxruntime (default: as a kdrun run chooses them: "
                        "OMP_NUM_THREADS, else the cores divided by the kdrun runs alive on the host)")
    args = p.parse_args(argv)
    from kdrun.runtime.threads import choose_threads, registered_run

    before = torch.get_num_threads()
    try:
        with registered_run():  # counted among the host's live runs while it measures
            torch.set_num_threads(choose_threads(args.threads)[0])
            result = export(args.run_dir, args.format, args.out, args.max_rows, args.batch_size)
    except UserError as e:
        print(f"kdrun-export: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)
    for line in report_lines(result, args.run_dir):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
