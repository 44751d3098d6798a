"""docs/architecture.md lists every package of kdrun and its modules, as they are."""

from __future__ import annotations

import re

from tests.conftest import REPO


def layout() -> str:
    """One table row per package: its path and its modules (``__init__`` left out)."""
    root = REPO / "kdrun"
    dirs = sorted([root] + [p for p in root.rglob("*") if p.is_dir() and any(p.glob("*.py"))])
    lines = ["| package | modules |", "|---|---|"]
    for d in dirs:
        mods = sorted(p.stem for p in d.glob("*.py") if p.stem != "__init__")
        lines.append(f"| `{d.relative_to(REPO)}/` | {', '.join(f'`{m}`' for m in mods) or '—'} |")
    return "\n".join(lines)


def test_architecture_page_lists_the_package_as_it_is() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layout:start -->\n\n(.*?)\n\n<!-- layout:end -->", page, re.S)
    assert block, "docs/architecture.md lost its layout block"
    assert block.group(1) == layout(), f"docs/architecture.md's package list is stale; it is now:\n{layout()}"


def test_every_layer_of_the_import_test_is_on_the_page() -> None:
    from tests.test_import_structure import LAYERS

    page = (REPO / "docs" / "architecture.md").read_text()
    for name, _ in LAYERS:
        assert f"| {name} |" in page, name
