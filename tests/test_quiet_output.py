"""A run's output says what kdrun does: no per-load progress bars of transformers, the teacher's
fine-tuning bar named as the teacher's, and the cost measurement announced while it runs."""

from __future__ import annotations

from pathlib import Path


def test_label_of_bars_and_no_transformers_bars(run_cfg, tmp_path: Path, capsys) -> None:
    from kdrun.app.run import run

    run(run_cfg("objective=logit"), tmp_path / "r")
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Loading weights" not in text and "Writing model shards" not in text
    assert "teacher: finetune" in text and "stage 0:finetune" not in text  # the teacher's own bar
    assert "stage 0:logit_kd" in text  # the student's stage keeps its bar
    measuring = text.index("[kdrun] measuring the student's and the teacher's size, latency and throughput on cpu")
    assert measuring < text.index("outputs: ")
