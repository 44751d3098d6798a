"""The repository speaks of kdrun only: no words about how it was developed (the machines it was
developed on, work sessions, tickets) and no path into a folder outside the repository, in code,
configs, messages, scripts, tests or documentation."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

PATTERNS = [
    r"\bthis machine\b", r"\bthese machines\b", r"\blent\b", r"\b(?:this|a|the|next|previous|each|one) session\b",
    r"\bsessions\b", r"\bthe issue\b", r"\bissue'?s\b", r"\bissue \d+", r"\bissue #\d+", r"\.\./shared",
    r"other people'?s jobs", r"\boffline here\b",
]
TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini", "")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    venvs = tuple(f"{cfg.parent.name}/" for cfg in REPO.glob("*/pyvenv.cfg"))  # a user's `python3 -m venv v`
    return [f for f in out if f.endswith(TEXT) and f != "tests/test_hygiene.py" and not f.startswith(venvs)
            and (REPO / f).is_file()]


def test_no_development_text() -> None:
    rx = re.compile("|".join(PATTERNS), re.IGNORECASE)
    hits = []
    for name in tracked_files():
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if rx.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:120]}")
    assert not hits, "text about how kdrun was developed (say it about kdrun instead):\n" + "\n".join(hits)


def test_the_patterns_catch_what_they_are_for() -> None:
    rx = re.compile("|".join(PATTERNS), re.IGNORECASE)
    for bad in ("measured on this machine", "No GPU was lent", "the issue's goal", "see ../shared/data",
                "in this session", "(issue 12)"):
        assert rx.search(bad), bad
    for fine in ("a 2-core CPU", "excellent and silent", "the wandb session id"):
        assert not rx.search(fine), fine
