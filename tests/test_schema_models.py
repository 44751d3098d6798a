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


@pytest.mark.parametrize("override,key,choices", [
    ("train.precision=fp8", "train.precision", "auto, no, fp32, bf16, fp16"),
    ("train.device=tpu", "train.device", "auto, cpu, cuda"),
    ("objective.balance=equal", "objective.balance", "fixed, gradnorm, uncertainty"),
    ("teacher.dtype=int8", "teacher.dtype", "auto, fp32, bf16, fp16"),
    ("student.dtype=int8", "student.dtype", "auto, fp32, bf16, fp16"),
    ("teacher.store=sometimes", "teacher.store", "auto, on, off"),
    ("teacher.store_dtype=int8", "teacher.store_dtype", "fp16, bf16, fp32"),
    ("student.kind=distilled", "student.kind", "pretrained, truncated, random"),
    ("mapping.buckets=some", "mapping.buckets", "all, no, po"),
    ("mapping.init=first", "mapping.init", "uniform, last"),
])
def test_a_value_outside_a_closed_set_fails_naming_key_and_choices(override: str, key: str, choices: str) -> None:
    with pytest.raises(Exception) as e:
        compose([override])
    message = f"{e.value} {e.value.__cause__}"  # Hydra's line and OmegaConf's reason, as kdrun prints them
    assert key in message and f"expected one of [{choices}]" in message


def test_choices_keep_their_spellings() -> None:
    """on / off / no as the command line gives them, each equal to (and printed as) its string."""
    cfg = compose(["teacher.store=off", "mapping.buckets=no", "train.precision=no", "student.dtype=bf16"])
    assert (cfg.teacher.store, cfg.mapping.buckets, cfg.train.precision) == ("off", "no", "no")
    assert f"{cfg.student.dtype}" == str(cfg.student.dtype) == "bf16"
    assert {"bf16": 1}[cfg.student.dtype] == 1


def test_choices_match_the_code_that_reads_them() -> None:
    from kdrun.engine.balance import BALANCE_METHODS
    from kdrun.engine.teacher_store import STORE_DTYPES, STORE_MODES
    from kdrun.models.mapping import BUCKETS, INITS
    from kdrun.runtime.precision import PRECISION_VALUES

    values = lambda enum: {m.value for m in enum}  # noqa: E731
    assert values(C.StoreMode) == set(STORE_MODES) and values(C.StoreDtype) == set(STORE_DTYPES)
    assert values(C.Balance) == set(BALANCE_METHODS) and values(C.Precision) == set(PRECISION_VALUES)
    assert values(C.Buckets) == set(BUCKETS) and values(C.MapInit) == set(INITS)
