"""Printed lines of the report's neighbours: the MDE where seeds agree exactly, the teacher store's
line width."""

from __future__ import annotations

from kdrun.engine.teacher_store import LINE_WIDTH, wrapped
from kdrun.report.results import Cell
from kdrun.report.significance import mde_lines


def test_report_mde_without_spread_is_undefined_not_zero() -> None:
    cells = {("s", "finetune"): {"rte": Cell([0.6, 0.6, 0.6], {}, [], 1)},
             ("s", "ckd"): {"rte": Cell([0.7, 0.7, 0.7], {}, [], 1)}}
    line = "\n".join(mde_lines({}, cells, ["rte"], 100.0, 0.05))
    assert "MDE = 0.00" not in line and "MDE = undefined (no spread" in line, line


def test_report_store_lines_wrap_at_the_width_and_keep_every_word() -> None:
    text = ("[kdrun] teacher store: stage 'logit_kd' reads the teacher's logits (0db126de8265078a); the teacher does "
            "not run — teacher.store=auto: reading 0.004 ms/row (gather from a cold page cache, copy to cpu, fp32) "
            "vs the teacher's forward 0.063 ms/row (measured while building); from the cache")
    lines = wrapped(text).splitlines()
    assert len(text) > LINE_WIDTH and len(lines) > 1 and all(len(x) <= LINE_WIDTH for x in lines)
    assert " ".join(x.removeprefix("[kdrun]   ") if i else x for i, x in enumerate(lines)).split() == text.split()
    assert lines[0].endswith("the teacher does not run —")  # broken after a clause
    assert lines[1].endswith(" vs") and "(measured while building)" in lines[2]  # not inside a parenthesis
