"""The fuzz scripts in their fast modes: a few signals at random moments, every run compared with
the uninterrupted one (README "Reliability in figures" states the full counts)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.conftest import load_script


@pytest.mark.parametrize("sig,runs", [("KILL", 2), ("TERM", 1)])
def test_fuzz_kill_fast(tmp_path: Path, sig: str, runs: int) -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = load_script("fuzz_kill").main(["--fast", "--runs", str(runs), "--signal", sig, "--seed", "1",
                                            "--out", str(tmp_path)])
    res = json.loads((tmp_path / "fuzz_kill.json").read_text())
    assert rc == 0 and res["identical"] == runs, buf.getvalue()
    assert f"{runs}/{runs} identical" in buf.getvalue()


def test_fuzz_kill_comparison_sees_a_difference(tmp_path: Path) -> None:
    """The comparison the count rests on: a changed weight or metric is reported, timings are not."""
    import torch

    fk = load_script("fuzz_kill")
    a = {"weights": {"w": torch.zeros(2)}, "metrics": {"student": 0.5}, "log": [{"train/loss": 1.0}]}
    assert fk.same(a, a) == []
    b = {**a, "weights": {"w": torch.tensor([0.0, 1e-7])}}
    assert fk.same(a, b) == ["student weights"]
    assert fk.same(a, {**a, "log": [{"train/loss": 1.0000001}]}) == ["metrics.jsonl"]
