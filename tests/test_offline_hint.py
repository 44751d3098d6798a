"""The offline error's download hint names a command that the installed huggingface_hub provides."""

from __future__ import annotations

import re
from importlib.metadata import distribution

import pytest


def test_offline_hint_names_a_console_script_of_huggingface_hub(monkeypatch) -> None:
    from kdrun.models.loading import ModelUnavailableError, resolve_reference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = "no-such-org/no-such-model-for-kdrun"
    with pytest.raises(ModelUnavailableError) as err:
        resolve_reference(ref, what="teacher")
    m = re.search(r"\(([\w-]+) download (\S+)\)", str(err.value))
    assert m, str(err.value)
    assert m.group(2) == ref
    scripts = {e.name for e in distribution("huggingface_hub").entry_points if e.group == "console_scripts"}
    assert m.group(1) in scripts, f"'{m.group(1)} download' is not a command of huggingface_hub ({sorted(scripts)})"
