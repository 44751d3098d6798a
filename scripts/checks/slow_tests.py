"""Regenerate tests/slow.txt, the list of tests the fast loop (`pytest -m "not slow"`) leaves out, from
measured durations instead of by hand.

    python scripts/checks/slow_tests.py                      # runs the whole suite once, then writes tests/slow.txt
    python scripts/checks/slow_tests.py --junit report.xml   # from a finished run's JUnit report
    python scripts/checks/slow_tests.py --junit report.xml --check   # exit 1 if tests/slow.txt differs

A test is slow when its setup, call and teardown take ``--threshold`` seconds or more (2 by default),
summed over its parametrizations, since tests/conftest.py marks a test's every parametrization by
its node id without parameters. The file is replaced atomically; its header says how it was made.
``--junit`` reads a report written by ``python -m pytest --junitxml=report.xml`` (pytest's default
``junit_duration_report = total``: setup, call and teardown); without it the script runs the whole
suite itself with that option. A fixture shared by several tests counts its set-up in the first test
that asks for it, so a test can move in or out of the list when the order of the suite changes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from kdrun.runtime import harness
from kdrun.runtime.cache import write_text_atomic

HEADER = """\
# Tests that take {threshold:g} s or more on a 2-core CPU, summed over their parametrizations (setup,
# call and teardown), written by scripts/checks/slow_tests.py from a run of the whole suite;
# tests/conftest.py marks each of them slow, so `python -m pytest -q -m "not slow"` is the fast inner
# loop, and the suite's workers start them longest first (the seconds after each). A test listed
# here that no longer exists fails tests/test_fast_loop.py.

"""


def node_id(case: ET.Element) -> str | None:
    """``tests/test_x.py::test_name`` of a JUnit testcase (classname ``tests.test_x``, name with its
    parameters), or None for a case that is not a test function of a module under tests/."""
    cls, name = case.get("classname", ""), case.get("name", "")
    if not cls.startswith("tests.") or not name:
        return None
    parts = cls.split(".")
    path = "/".join(parts[:2]) + ".py"
    inner = "::".join(parts[2:] + [name.split("[")[0]])
    return f"{path}::{inner}"


def durations(junit: Path) -> dict[str, float]:
    """Seconds per test node id (parameters summed) from a JUnit report."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        nid = node_id(case)
        if nid is not None:
            out[nid] += float(case.get("time") or 0.0)
    return dict(out)


def slow_ids(times: dict[str, float], threshold: float) -> list[str]:
    return sorted(nid for nid, t in times.items() if t >= threshold)


def render(ids: list[str], threshold: float, times: dict[str, float]) -> str:
    """The file: its header, then one id a line with its measured seconds as a comment (the suite's
    workers start the longest tests first: tests/conftest.py)."""
    return HEADER.format(threshold=threshold) + "".join(f"{nid}  # {times[nid]:.0f} s\n" for nid in ids)


def run_suite(junit: Path) -> None:
    """The whole suite once, writing its JUnit report (failures do not stop the listing)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    print("[slow_tests] $", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=harness.REPO, check=False)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--junit", type=Path, default=None, help="a finished run's JUnit report (default: run the suite)")
    p.add_argument("--threshold", type=float, default=2.0, help="seconds from which a test is slow (default 2)")
    p.add_argument("--out", type=Path, default=harness.REPO / "tests" / "slow.txt")
    p.add_argument("--check", action="store_true", help="only compare with --out; exit 1 where they differ")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        junit = a.junit or Path(tmp) / "report.xml"
        if a.junit is None:
            run_suite(junit)
        try:
            times = durations(junit)
        except (OSError, ET.ParseError) as e:
            p.error(f"--junit {junit}: not a readable JUnit report ({e}); write one with "
                    "`python -m pytest --junitxml=report.xml`, or leave --junit out to run the suite")
    ids = slow_ids(times, a.threshold)
    text = render(ids, a.threshold, times)
    total = sum(times.values())
    fast = sum(t for t in times.values() if t < a.threshold)
    print(f"[slow_tests] {len(times)} tests, {total / 60:.1f} min in all; {len(ids)} of {a.threshold:g} s or "
          f"more ({(total - fast) / 60:.1f} min); the fast loop's tests take {fast / 60:.1f} min")
    if a.check:
        same = a.out.exists() and a.out.read_text() == text
        print(f"[slow_tests] {a.out}: {'up to date' if same else 'differs'}")
        return 0 if same else 1
    write_text_atomic(a.out, text)
    print(f"[slow_tests] wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
