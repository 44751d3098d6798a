"""The teacher's and the student's schemas: each role has only the keys it reads."""

from __future__ import annotations

import dataclasses

import pytest

from kdrun import config as C
from tests.conftest import REPO, compose

TEACHER_ONLY = {"checkpoint", "store", "store_dtype", "store_max_gb", "finetune"}
STUDENT_ONLY = {"source", "num_layers"}


def _fields(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def test_each_role_has_its_own_keys() -> None:
    teacher, student, common = _fields(C.TeacherConfig), _fields(C.StudentConfig), _fields(C.ModelConfig)
    assert teacher - common - {"dtype"} == TEACHER_ONLY
    assert student - common - {"dtype"} == STUDENT_ONLY
    cfg = compose(["task=cola", "objective=ckd"])
    assert not TEACHER_ONLY & set(cfg.student) and not STUDENT_ONLY & set(cfg.teacher)


@pytest.mark.parametrize("override,key", [("student.finetune.epochs=3", "student.finetune"),
                                          ("student.store=off", "student.store"),
                                          ("student.checkpoint=/x", "student.checkpoint"),
                                          ("teacher.num_layers=2", "teacher.num_layers"),
                                          ("teacher.source=teacher", "teacher.source")])
def test_a_key_of_the_other_role_fails_naming_it(override: str, key: str) -> None:
    with pytest.raises(Exception) as e:
        compose([override])
    assert key in str(e.value)


MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("name", MODELS)
def test_teacher_and_student_of_a_name_are_the_same_model(name: str) -> None:
    cfg = compose([f"teacher={name}", f"student={name}"])
    common = _fields(C.ModelConfig)
    assert {k: cfg.teacher[k] for k in common} == {k: cfg.student[k] for k in common}
    assert cfg.teacher.name == name
    for role in ("teacher", "student"):  # each role's option takes its model from conf/model
        assert f"/model/{name}@_here_" in (REPO / "conf" / role / f"{name}.yaml").read_text()
