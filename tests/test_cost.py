"""The cost figures beside every score (kdrun/report/cost.py): hand-counted parameters, the weight
bytes of the written safetensors file, warm-up-free medians, the timed inputs, and a run's results.json
and printed table."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import torch

from kdrun.report import cost as C


def tiny_bert(masked_lm: bool = False):
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    config = BertConfig(vocab_size=100, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=32, type_vocab_size=2, num_labels=2)
    torch.manual_seed(0)
    return (BertForMaskedLM if masked_lm else BertForSequenceClassification)(config).eval()


def safetensors_payload(path: Path) -> int:
    """Bytes of the tensors in a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def test_parameters_counted_by_hand() -> None:
    # embeddings: words 100x8, positions 32x8, token types 2x8, LayerNorm 2x8 = 1088
    # layer: Q, K, V, O 4x(8x8+8) = 288, LayerNorm 16, FFN 8x16+16 + 16x8+8 = 280, LayerNorm 16 = 600
    # pooler 8x8+8 = 72, classifier 8x2+2 = 18
    counts = C.count_parameters(tiny_bert())
    assert counts == {"total": 1088 + 600 + 72 + 18, "without_embeddings": 600 + 72 + 18}


def test_tied_weights_are_counted_once() -> None:
    model = tiny_bert(masked_lm=True)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    naive = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert C.count_parameters(model)["total"] == naive


@pytest.mark.parametrize("masked_lm", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_weights_bytes_is_the_safetensors_payload(tmp_path: Path, dtype, masked_lm: bool) -> None:
    model = tiny_bert(masked_lm)
    expected = C.weights_bytes(model, dtype)
    (model if dtype is None else model.to(dtype)).save_pretrained(tmp_path)
    assert expected == safetensors_payload(tmp_path / "model.safetensors")


def test_median_excludes_warmup_and_respects_budget() -> None:
    calls: list[int] = []

    def fn():
        calls.append(1)
        time.sleep(0.05 if len(calls) <= 2 else 0.001)  # the two warm-up calls are slow

    median, n = C.median_seconds(fn, repeats=7, warmup=2, budget_s=10.0)
    assert n == 7 and len(calls) == 9
    assert median < 0.02
    calls.clear()
    _, n = C.median_seconds(fn, repeats=50, warmup=2, budget_s=0.0)  # budget spent: the minimum
    assert n == C.MIN_REPEATS and len(calls) == 2 + C.MIN_REPEATS


def test_inputs_are_the_median_row_and_the_first_batch() -> None:
    rows = [{"input_ids": list(range(10, 10 + n)), "attention_mask": [1] * n, "token_type_ids": [0] * n}
            for n in (5, 9, 3, 7, 9)]
    inputs = C.cost_inputs(rows, batch_size=3, pad_token_id=0)
    assert inputs["length"] == 7  # lengths 3 5 7 9 9: the median
    assert inputs["single"]["input_ids"].tolist() == [list(range(10, 17))]
    batch = inputs["batch"]
    assert inputs["batch_rows"] == 3 and inputs["batch_length"] == 9
    for i, n in enumerate((5, 9, 3)):  # padded as a naive loop would
        assert batch["input_ids"][i].tolist() == list(range(10, 10 + n)) + [0] * (9 - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (9 - n)


def test_run_cost_ratios_and_lines() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    teacher = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4,
                                                       num_attention_heads=2, intermediate_size=64)).eval()
    student = tiny_bert()
    rows = [{"input_ids": [2] * n, "attention_mask": [1] * n} for n in (6, 8, 10)]
    cost = C.run_cost(student, teacher, rows, batch_size=2, pad_token_id=0, device="cpu", budget_s=0.05)
    assert cost["threads"] == torch.get_num_threads() and cost["throughput_batch"] == 2
    r = cost["ratios"]
    assert r["smaller"] == pytest.approx(cost["teacher"]["total"] / cost["student"]["total"])
    assert r["faster"] == pytest.approx(cost["teacher"]["latency_ms"] / cost["student"]["latency_ms"])
    assert cost["student"]["throughput_rows_s"] > 0 and cost["teacher"]["latency_ms"] > 0
    lines = C.cost_lines(cost)
    assert lines[2].startswith("teacher") and lines[3].startswith("student")
    assert f"{r['smaller']:.1f}× smaller (parameters)" in lines[-1]
    assert C.cost_lines(None) == [] and C.cost_lines({"error": "x"}) == ["cost: not measured (x)"]


def test_a_run_records_and_prints_its_cost(run_cfg, tmp_path: Path, capsys) -> None:
    from kdrun.app.run import run

    run(run_cfg("objective=logit", "student=truncated", "student.num_layers=1"), tmp_path / "a")
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    cost = res["cost"]
    assert set(cost) >= {"device", "threads", "latency_length", "throughput_batch", "teacher", "student", "ratios"}
    assert cost["throughput_batch"] == 64  # train.eval_batch_size of the tiny setup, 64 dev rows
    assert cost["student"]["total"] < cost["teacher"]["total"]  # 1 of the teacher's 4 layers
    payload = safetensors_payload(tmp_path / "a" / "student" / "model.safetensors")
    assert cost["student"]["size_mb"] * 1e6 == payload
    assert "student vs teacher:" in out and f"{cost['ratios']['smaller']:.1f}× smaller" in out
    assert cost["seconds"] < 10
    # report.cost=false: no measurement, same run directory name (not part of the run's identity)
    run(run_cfg("objective=logit", "student=truncated", "student.num_layers=1", "report.cost=false"),
        tmp_path / "b")
    other = json.loads((tmp_path / "b" / "results.json").read_text())
    assert "cost" not in other and other["config_hash"] == res["config_hash"]
    assert "student vs teacher" not in capsys.readouterr().out


def test_pareto_front_by_hand() -> None:
    from kdrun.report.plots import pareto_front

    points = [(1.0, 0.5), (2.0, 0.7), (2.0, 0.6), (3.0, 0.65), (4.0, 0.9), (0.5, 0.4), (5.0, 0.9)]
    assert pareto_front(points) == [(0.5, 0.4), (1.0, 0.5), (2.0, 0.7), (4.0, 0.9)]


def test_report_shows_smaller_and_faster_and_plots_the_front(tmp_path: Path, capsys) -> None:
    import csv

    from kdrun.report.cli import report
    from tests.test_report import write_run

    def with_cost(d: Path, smaller: float, latency: float, teacher_latency: float) -> None:
        res = json.loads((d / "results.json").read_text())
        res["teacher"] = {"metrics": {"validation": {"accuracy": 0.9}}}
        res["cost"] = {"student": {"latency_ms": latency}, "teacher": {"latency_ms": teacher_latency},
                       "ratios": {"smaller": smaller, "faster": teacher_latency / latency}}
        (d / "results.json").write_text(json.dumps(res))

    root = tmp_path / "m"
    with_cost(write_run(root, "a1", "rte", "ckd", 1, 0.60), 2.0, 2.0, 8.0)
    with_cost(write_run(root, "a2", "rte", "ckd", 2, 0.64), 3.0, 4.0, 8.0)  # medians: 2.5× smaller, 3.0× faster
    write_run(root, "b1", "rte", "logit", 1, 0.62)  # no cost recorded
    rep = report([root], tmp_path / "out")
    printed = capsys.readouterr().out
    assert rep["header"][-2:] == ["× smaller", "× faster"]
    assert "| bert_L4_H312 | ckd | 62.00 ± 2.83 | 62.00 | 2.5× | 3.0× |" in printed
    assert "| bert_L4_H312 | logit | 62.00 | 62.00 | — | — |" in printed
    rows = {r["objective"]: r for r in csv.DictReader((tmp_path / "out" / "table.csv").open())}
    assert float(rows["ckd"]["x_smaller"]) == 2.5 and float(rows["ckd"]["student_latency_ms"]) == 3.0
    assert rows["logit"]["x_faster"] == ""
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0


def test_ratios_below_one_are_said_the_other_way_round() -> None:
    """A student saved in fp32 beside an fp16 teacher is larger on disk: "1.4× larger", never "0.7× smaller"."""
    from kdrun.report.cost import times

    assert times(2.0, "smaller", "larger") == "2.0× smaller"
    assert times(1.0, "faster", "slower") == "1.0× faster"
    assert times(0.7, "smaller", "larger") == "1.4× larger"
    assert times(0.5, "faster", "slower") == "2.0× slower"


# ------------------------------------------------------------------------------- a busy machine

def _two_models():
    from transformers import BertConfig, BertForSequenceClassification

    teacher = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4,
                                                       num_attention_heads=2, intermediate_size=64)).eval()
    rows = [{"input_ids": [2] * n, "attention_mask": [1] * n} for n in (6, 8, 10)]
    return teacher, tiny_bert(), rows


def _assert_speed_not_published(cost: dict, tmp_path: Path) -> None:
    """The cost says why its speed is unreliable, and neither the printed lines, the card nor the report
    give a speed ratio as a fact."""
    from kdrun.report.card import _cost_rows
    from kdrun.report.cli import report
    from tests.test_report import write_run

    lines = "\n".join(C.cost_lines(cost))
    assert "speed ratios unreliable" in lines and "(latency" not in lines and "the throughput" not in lines
    card = "\n".join(_cost_rows(cost))
    assert "unreliable" in card and "faster" not in card and "slower" not in card and "its throughput" not in card
    d = write_run(tmp_path / "runs", "a", "rte", "ckd", 1, 0.6)
    res = json.loads((d / "results.json").read_text())
    (d / "results.json").write_text(json.dumps({**res, "cost": cost}))
    rep = report([tmp_path / "runs"], tmp_path / "out")
    assert rep["rows"][0][-2:] == [f"{cost['ratios']['smaller']:.1f}×", "unreliable"]
    assert not (tmp_path / "out" / "pareto.png").exists()


def test_cost_on_a_busy_machine_is_flagged(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    teacher, student, rows = _two_models()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)  # the spinners are running
        cost = C.run_cost(student, teacher, rows, batch_size=2, pad_token_id=0, device="cpu", budget_s=0.3)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert cost["machine"]["others_cores"] > 0.5, cost["machine"]  # the spinners' share of the cores
    assert "busy machine" in cost["unreliable"]
    _assert_speed_not_published(cost, tmp_path)


def test_cost_with_a_huge_spread_is_flagged(tmp_path: Path, monkeypatch) -> None:
    """Timings alternating 1 ms and 100 ms: the interquartile range is far over the median."""
    ticks = {"t": 0.0, "calls": 0}

    def clock() -> float:
        ticks["calls"] += 1
        if ticks["calls"] % 2 == 0:  # the end of a timed call
            ticks["t"] += 0.001 if (ticks["calls"] // 2) % 2 else 0.1
        return ticks["t"]

    monkeypatch.setattr(C, "_clock", clock)
    monkeypatch.setattr(C, "busy_reason", lambda machine: None)  # only the spread speaks here
    teacher, student, rows = _two_models()
    cost = C.run_cost(student, teacher, rows, batch_size=2, pad_token_id=0, device="cpu", budget_s=0.5)
    lo, hi = cost["student"]["latency_iqr_ms"]
    assert (hi - lo) / cost["student"]["latency_ms"] > C.UNRELIABLE_SPREAD
    assert "timings spread by" in cost["unreliable"]
    _assert_speed_not_published(cost, tmp_path)


def test_settled_timings_stop_early_and_give_their_quartiles(monkeypatch) -> None:
    ticks = {"t": 0.0, "calls": 0}

    def clock() -> float:  # every call takes 2 ms exactly
        ticks["calls"] += 1
        ticks["t"] += 0.002 if ticks["calls"] % 2 == 0 else 0.0
        return ticks["t"]

    monkeypatch.setattr(C, "_clock", clock)
    t = C.time_calls(lambda: None, repeats=50, warmup=0, budget_s=10.0)
    assert t.n == C.SETTLE_REPEATS and t.median == pytest.approx(0.002) and t.spread == pytest.approx(0.0)
    assert C.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == C.Timing(3.0, 2.0, 4.0, 5)
    machine = {"cores": 2, "threads": 1, "own_cores": 0.6, "others_cores": 1.4, "load_avg_1min": 3.0}
    assert "1.4 of 2 cores" in C.busy_reason(machine)
    assert C.busy_reason({**machine, "others_cores": 0.5}) is None  # most of a core idle
    assert C.busy_reason({**machine, "others_cores": 0.0, "own_cores": 2.0}) is None  # kdrun's own threads only
    assert "load average 3.0" in C.busy_reason({**machine, "others_cores": None})  # no /proc/stat
