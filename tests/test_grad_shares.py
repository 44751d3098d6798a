"""logger.grad_shares: per-term gradient norms, shares and weighted values (loss-balance diagnostics)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kdrun.app.run import run
from kdrun.engine.trainer import grad_share_logs
from tests.conftest import compose, load_script

# Two stages: one term alone (its share is 1), then three terms pulling on the same student.
STAGES = [
    "objective=logit",
    "objective.stages=[{name: intermediate, epochs: 1, lr: 1e-3, batch_size: 16, select_best: false, "
    "losses: [{name: hidden_mse, weight: 1.0}]}, {name: prediction, epochs: 1, lr: 1e-3, batch_size: 16, "
    "eval_every_steps: 4, losses: [{name: ce, weight: 0.2}, {name: logit_kd, weight: 0.8, "
    "params: {temperature: 2.0}}, {name: hidden_mse, weight: 0.5}]}]",
    "logger.log_every_steps=1",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_logged_norms_match_hand_computed_gradients() -> None:
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    b = torch.tensor([0.5], requires_grad=True)
    unused = torch.tensor([4.0], requires_grad=True)
    c = torch.tensor([0.0, 1.0, 1.0])
    weighted = {
        "a": 2.0 * w.sum(),  # dL/d(w, b, unused) = (2, 2, 2, 0, 0)
        "b": 0.5 * ((w - c) ** 2).sum() + 3.0 * b.sum(),  # (w - c, 3, 0) = (1, -3, 2, 3, 0)
        "const": torch.tensor(0.7),  # depends on no parameter
    }
    logs = grad_share_logs(weighted, [w, b, unused])
    g = {"a": np.array([2.0, 2, 2, 0, 0]), "b": np.array([1.0, -3, 2, 3, 0]), "const": np.zeros(5)}
    total = g["a"] + g["b"]
    norms = {k: float(np.linalg.norm(v)) for k, v in g.items()}
    assert logs["grad_norm/total"] == pytest.approx(np.linalg.norm(total))
    for k in g:
        assert logs[f"grad_norm/{k}"] == pytest.approx(norms[k])
        assert logs[f"grad_share/{k}"] == pytest.approx(norms[k] / sum(norms.values()))
    assert sum(logs[f"grad_share/{k}"] for k in g) == pytest.approx(1.0)
    for k in ("a", "b"):
        expected_cos = g[k] @ total / (norms[k] * np.linalg.norm(total))
        assert logs[f"grad_cos/{k}"] == pytest.approx(expected_cos)
    assert math.isnan(logs["grad_cos/const"])  # no direction to compare
    assert logs["weighted/a"] == pytest.approx(4.0) and logs["weighted/const"] == pytest.approx(0.7)
    assert logs["weighted/b"] == pytest.approx(0.5 * (1 + 9 + 4) + 1.5)
    # .grad untouched, and the graph is still there for the training step's backward
    assert w.grad is None and b.grad is None
    (weighted["a"] + weighted["b"]).backward()
    assert torch.allclose(w.grad, torch.tensor(total[:3], dtype=torch.float32))
    # a loss scale (fp16) is divided out
    w.grad = None
    scaled = grad_share_logs({"a": 2.0 * w.sum()}, [w, b], scale=1024.0)
    assert scaled["grad_norm/a"] == pytest.approx(norms["a"]) and w.grad is None


def test_grad_shares_is_a_typed_logger_key() -> None:
    assert compose([]).logger.grad_shares is False
    assert compose(["logger=none", "logger.grad_shares=true"]).logger.grad_shares is True
    with pytest.raises(Exception, match=r"logger\.grad_shares"):
        compose(["logger.grad_shares=maybe"])


def test_two_scaled_copies_of_a_term_share_by_their_weights(run_cfg, tmp_path: Path) -> None:
    """ce twice, weights 0.25 and 0.75: the same gradient scaled, so norms 1:3, shares 0.25/0.75,
    both cosines 1 and the total norm is the sum; measured only on logged optimizer steps."""
    cfg = run_cfg("objective=finetune", "student=tiny_random", "logger.grad_shares=true",
                  "logger.log_every_steps=3", "train.gradient_accumulation_steps=2",
                  "objective.stages=[{name: ft, epochs: 1, lr: 1e-3, batch_size: 16, "
                  "losses: [{name: ce, weight: 0.25}, {name: ce, weight: 0.75}]}]")
    run(cfg, tmp_path / "run")
    logged = [r for r in _records(tmp_path / "run") if "grad_norm/total" in r]
    assert [r["step"] for r in logged] == [3, 5]  # 160 rows / 16 / 2 = 5 steps; every 3rd and the last
    for r in logged:
        assert r["grad_share/ce_0"] == pytest.approx(0.25, rel=1e-5)
        assert r["grad_share/ce_1"] == pytest.approx(0.75, rel=1e-5)
        assert r["grad_norm/ce_1"] == pytest.approx(3 * r["grad_norm/ce_0"], rel=1e-5)
        assert r["grad_norm/total"] == pytest.approx(r["grad_norm/ce_0"] + r["grad_norm/ce_1"], rel=1e-5)
        assert r["grad_cos/ce_0"] == pytest.approx(1.0, abs=1e-5) and r["grad_cos/ce_1"] == pytest.approx(1.0, abs=1e-5)
        assert r["weighted/ce_1"] == pytest.approx(3 * r["weighted/ce_0"], rel=1e-6)


def test_grad_shares_leave_training_bit_identical_and_plot(run_cfg, tmp_path: Path) -> None:
    plain, measured = tmp_path / "plain", tmp_path / "measured"
    res_plain = run(run_cfg(*STAGES), plain)
    res_measured = run(run_cfg(*STAGES, "logger.grad_shares=true"), measured)
    a = load_file(str(plain / "student" / "model.safetensors"))
    b = load_file(str(measured / "student" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert res_plain["student"]["metrics"] == res_measured["student"]["metrics"]
    rec_plain, rec_measured = _records(plain), _records(measured)
    assert not any(k.startswith("grad_") for r in rec_plain for k in r)
    train = [{k: v for k, v in r.items() if k.startswith("train/") and "_per_s" not in k} for r in rec_plain]
    assert train == [{k: v for k, v in r.items() if k.startswith("train/") and "_per_s" not in k}
                     for r in rec_measured]

    weights = {"intermediate": {"hidden_mse": 1.0},
               "prediction": {"ce": 0.2, "logit_kd": 0.8, "hidden_mse": 0.5}}
    logged = [r for r in rec_measured if "grad_norm/total" in r]
    assert len(logged) == 20  # 160 rows / 16 per step, 1 epoch per stage, every step logged
    for r in logged:
        terms = weights[r["stage"]]
        assert {k.split("/", 1)[1] for k in r if k.startswith("grad_share/")} == set(terms)
        assert sum(r[f"grad_share/{t}"] for t in terms) == pytest.approx(1.0)
        assert r["grad_norm/total"] <= sum(r[f"grad_norm/{t}"] for t in terms) * (1 + 1e-6)
        for t, wt in terms.items():  # one micro-batch per logged step: the same batch as train/<t>
            assert r[f"weighted/{t}"] == pytest.approx(wt * r[f"train/{t}"], rel=1e-5)
            assert r[f"grad_norm/{t}"] > 0 and -1 - 1e-6 <= r[f"grad_cos/{t}"] <= 1 + 1e-6
        if r["stage"] == "intermediate":
            assert r["grad_share/hidden_mse"] == 1.0 and r["grad_cos/hidden_mse"] == pytest.approx(1.0)

    plot = load_script("plots/grad_shares")
    out = plot.main([str(measured), "--out", str(tmp_path / "plots" / "shares.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["shares.png"]  # no temporary file left behind
    assert [s for _, s in plot.stage_starts(plot.load_records(measured / "metrics.jsonl"))] == ["prediction"]
    with pytest.raises(SystemExit, match="logger.grad_shares=true"):
        plot.main([str(plain)])
