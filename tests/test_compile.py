"""train.compile: the student and teacher run under torch.compile with kdrun's feature hooks (Q/K/V
capture) registered once and left in place, and train exactly as uncompiled (the ``eager`` backend
keeps the arithmetic; inductor needs a C++ compiler and is the default for users)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def test_compiled_run_equals_uncompiled(run_cfg, tmp_path: Path) -> None:
    from kdrun.app.run import run

    args = ("objective=minilmv2", "objective.params.relation_heads=4", "student.dropout=0.0", "train.epochs=1")
    plain = run(run_cfg(*args), tmp_path / "plain")
    compiled = run(run_cfg(*args, "train.compile=true", "train.compile_backend=eager"), tmp_path / "compiled")
    assert compiled["student"]["metrics"] == plain["student"]["metrics"]
    a = load_file(str(tmp_path / "plain" / "student" / "model.safetensors"))
    b = load_file(str(tmp_path / "compiled" / "student" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    logs = [json.loads(x) for x in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/minilmv2_qq" in x for x in logs)  # the hooked Q/K/V reached the loss


def test_compiled_model_keeps_one_set_of_hooks() -> None:
    from kdrun.models.features import extract_features
    from tests.test_layer_kd import batch, tiny_bert

    model = tiny_bert()
    compiled = torch.compile(model, backend="eager")
    needs = frozenset({"logits", "qkv"})
    first = extract_features(compiled, batch(), needs)
    second = extract_features(compiled, batch(), needs)
    q = model.bert.encoder.layer[0].attention.self.query
    assert len(q._forward_hooks) == 1
    torch.testing.assert_close(first.qkv().projection("q", 1), second.qkv().projection("q", 1))
    torch.testing.assert_close(first.logits, model(**batch()).logits)
