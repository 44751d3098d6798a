"""Every command-line flag the README and docs/*.md give a kdrun tool (the ``kdrun-*`` console scripts
of pyproject.toml) is in that tool's ``--help``.

Flags are read from shell code blocks (continuations joined) and from inline code, after the tool's
name (``kdrun-export RUN --format onnx``; after a subcommand, that subcommand's ``--help`` counts
too), and from inline code that is a flag alone (`` `--fix` ``), which belongs to the kdrun tool named
before it in the same paragraph (unless another program was named after it). ``kdrun`` itself is
Hydra's: its commands are composed by tests/test_docs.py.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_docs import SHELL_LANGS, pages, pyproject

FENCE = re.compile(r"\s*(`{3,}|~{3,})\s*([\w+-]*)")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FLAG = re.compile(r"--[A-Za-z][\w-]*")
SEPARATORS = re.compile(r"\s(?:\|\|?|&&|;)\s|\s#.*$")
PROGRAM = re.compile(r"[a-z][\w.+-]*")
PARAGRAPH_START = re.compile(r"\s*$|#|\s*([-*+]|\d+\.)\s|\s*\|")


@dataclass(frozen=True)
class Use:
    page: str
    line: int
    tool: str
    subcommand: str | None  # given after this subcommand (its --help), None: before any
    flag: str
    anywhere: bool = False  # a flag alone: of the tool or any of its subcommands

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.tool}{' ' + self.subcommand if self.subcommand else ''} {self.flag}"


def tools() -> dict[str, str]:
    """kdrun's command-line tools: console script name -> ``module:function``."""
    return {k: v for k, v in pyproject()["project"]["scripts"].items() if k.startswith("kdrun-")}


def help_text(tool: str, *args: str) -> str:
    """What ``tool *args --help`` prints (run in this process: argparse prints and exits)."""
    return _help(tools()[tool], args)


@cache
def _help(spec: str, args: tuple[str, ...]) -> str:
    module, function = spec.split(":")
    main = getattr(importlib.import_module(module), function)
    out, argv = io.StringIO(), sys.argv
    sys.argv = ["prog", *args, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), contextlib.suppress(SystemExit):
            main()
    finally:
        sys.argv = argv
    return out.getvalue()


def subcommands(tool: str) -> list[str]:
    """The subcommands the usage line lists (``{list,ls,verify,gc}``), or none."""
    m = re.search(r"\{([\w,-]+)\}", help_text(tool).split("\n\n")[0])
    return m.group(1).split(",") if m else []


def known_flags(use: Use) -> set[str]:
    """The flags ``use`` may name: those of its subcommand's ``--help``, else of the tool's (of the
    tool's and every subcommand's for a flag alone)."""
    texts = [help_text(use.tool, use.subcommand)] if use.subcommand else [help_text(use.tool)]
    if use.anywhere:
        texts += [help_text(use.tool, s) for s in subcommands(use.tool)]
    return {f for text in texts for f in FLAG.findall(text)}


def segments(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, code) in page order, ``kind`` being ``block`` (a logical line of a shell code
    block), ``span`` (inline code), ``section`` (a heading: ``code`` is its ``#``s) or ``paragraph``
    (a blank line, a list item, a table row or a code block begins)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            out.append((i + 1, "paragraph", ""))
            i = _block(lines, i, m, out)
            continue
        if lines[i].startswith("#") or PARAGRAPH_START.match(lines[i]):
            heading = re.match(r"#+", lines[i])
            out.append((i + 1, "section", heading.group(0)) if heading else (i + 1, "paragraph", ""))
        out += [(i + 1, "span", s) for s in SPAN.findall(lines[i])]
        i += 1
    return out


def _block(lines: list[str], i: int, m: re.Match, out: list) -> int:
    """Append a fenced block's logical lines (shell languages only, comment lines left out); returns
    the index of the line after the block."""
    fence, shell, pending, start = m.group(1), m.group(2).lower() in SHELL_LANGS, "", None
    i += 1
    while i < len(lines) and lines[i].strip() != fence:
        text = lines[i].rstrip()
        if shell and not text.lstrip().startswith("#"):
            start = start or i + 1
            if text.endswith("\\"):
                pending += text[:-1] + " "
            else:
                out.append((start, "block", pending + text))
                pending, start = "", None
        i += 1
    return i + 1


def uses(page: str, text: str) -> list[Use]:
    """Every flag ``text`` (a Markdown page) gives a kdrun tool. A flag alone in inline code belongs
    to the program last named in its paragraph, else in a code block of its section (or of a section
    that holds it)."""
    found, paragraph, blocks, level = [], None, {0: None}, 0  # blocks: heading level -> program named
    for line, kind, code in segments(text):
        if kind in ("section", "paragraph"):
            paragraph = None
            if kind == "section":
                level = len(code)
                blocks = {k: v for k, v in blocks.items() if k < level} | {level: None}
            continue
        words = code.split()
        if words and FLAG.fullmatch(words[0].split("=", 1)[0]):
            owner = paragraph or next((v for _, v in sorted(blocks.items(), reverse=True) if v), None)
            found += [Use(page, line, owner, None, f, True) for f in _flags(words)] if owner in tools() else []
            continue
        for piece in SEPARATORS.split(code):
            program, uses_of = _piece(page, line, piece.split())
            if program and kind == "span":
                paragraph = program
            elif program:
                blocks[level] = program
            found += uses_of
    return found


def _piece(page: str, line: int, words: list[str]) -> tuple[str | None, list[Use]]:
    """(the program a command names, or None; the flags it gives a kdrun tool)."""
    start = next((k for k, w in enumerate(words) if w in tools()), None)
    if start is not None:
        return words[start], _command(page, line, words[start:])
    if len(words) > 1 and PROGRAM.fullmatch(words[0]) and "=" not in words[0]:
        return words[0], []
    return None, []


def _command(page: str, line: int, words: list[str]) -> list[Use]:
    tool, args = words[0], words[1:]
    at = next((k for k, a in enumerate(args) if a in subcommands(tool)), None)  # past option values
    if at is None:
        return [Use(page, line, tool, None, f) for f in _flags(args)]
    return [Use(page, line, tool, None, f) for f in _flags(args[:at])] + \
        [Use(page, line, tool, args[at], f) for f in _flags(args[at + 1:])]


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if FLAG.fullmatch(w.split("=", 1)[0])]


def page_uses(path: Path) -> list[Use]:
    return uses(path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8"))


PAGES = pages()


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_docs_flags_are_in_the_tools_help(page: Path) -> None:
    missing = [u for u in page_uses(page) if u.flag not in known_flags(u)]
    assert not missing, "documented flags that the tool's --help does not have:\n" + "\n".join(map(str, missing))


def test_docs_flags_are_collected_from_blocks_and_inline_code() -> None:
    every = {str(u).split(": ", 1)[1] for p in PAGES for u in page_uses(p)}
    for want in ("kdrun-cache list --cache-dir", "kdrun-cache gc --max-size", "kdrun-cache verify --fix",
                 "kdrun-doctor --out", "kdrun-doctor --quick", "kdrun-export --max-rows", "kdrun-export --threads",
                 "kdrun-report --figure"):
        assert want in every, want


def test_docs_flags_report_the_page_line_and_flag_of_a_wrong_one() -> None:
    text = ("## A section\n\nRun `kdrun-cache verify --fix --colour red`; `--cache-dir DIR` names the cache.\n\n"
            "```bash\nkdrun-cache gc \\\n    --dry-run --older-than 2d | tail   # --not-a-flag in a comment\n"
            "kdrun-cache --cache-dir /c ls --fix\nkdrun-cache verify --dry-run\n```\n\n"
            "### Deeper\n\n`--max-size` is the block's.\n\n"
            "## Another section\n\n`--fix` alone names no tool here.\n"
            "`python scripts/x.py --runs 3` then `--runs 4`\n")
    found = uses("page.md", text)
    assert [str(u) for u in found] == [
        "page.md:3: kdrun-cache verify --fix", "page.md:3: kdrun-cache verify --colour",
        "page.md:3: kdrun-cache --cache-dir", "page.md:6: kdrun-cache gc --dry-run",
        "page.md:6: kdrun-cache gc --older-than", "page.md:8: kdrun-cache --cache-dir",
        "page.md:8: kdrun-cache ls --fix", "page.md:9: kdrun-cache verify --dry-run",
        "page.md:14: kdrun-cache --max-size"]
    wrong = [str(u) for u in found if u.flag not in known_flags(u)]
    # --fix is verify's and --dry-run gc's, not ls's or verify's: each flag is checked where it stands
    assert wrong == ["page.md:3: kdrun-cache verify --colour", "page.md:8: kdrun-cache ls --fix",
                     "page.md:9: kdrun-cache verify --dry-run"]
