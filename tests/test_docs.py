"""The documentation: the README stays short, the MkDocs site builds with --strict, and every command
in a fenced code block of the README or a docs page still matches the project.

Commands are read from ```bash (or unlabelled, sh, shell, console) fences, with backslash line
continuations joined and ``NAME="..."`` variables of the same block expanded. Checked:

- ``kdrun ...`` (also after ``torchrun ... -m kdrun`` or ``accelerate launch ... -m kdrun``) and
  ``kdrun-augment ...``: the overrides compose with Hydra against kdrun's config (a renamed group,
  option or key fails, naming the page, line and command). A multirun's sweeps (``a=1,2``,
  ``range(...)``) compose value by value; sweeps without values to list (``glob(...)``) are left out.
  Every kdrun command names its teacher (the default teacher needs the hub);
- ``python scripts/NAME.py``: the script exists and has every ``--flag`` used;
- ``kdrun-NAME``: the console script is declared in pyproject.toml and its module has every
  ``--flag`` used; ``python -m MODULE``: the module exists; ``pip install -e ".[extra]"``: the extra
  exists; ``scripts/NAME.sh``: the script exists.

Commands holding a placeholder (``<...>``, ``…``) are skipped with the reason shown.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 300
CONFIG_MODULE = "kdrun.conf"
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
BLOCK_VARIABLE = re.compile(r'([A-Z_][A-Z0-9_]*)="([^"]*)"')
PLACEHOLDER = re.compile(r"<[^<>]+>|…")
TEACHER_KEYS = ("teacher", "teacher.name_or_path", "teacher.checkpoint")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str  # one logical line: continuations joined, block variables expanded

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO).as_posix()}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def fenced_blocks(path: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, text)]) of every fenced code block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, body = m.group(1), m.group(2).lower(), []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append((i + 1, lines[i]))
            i += 1
        blocks.append((lang, body))
        i += 1
    return blocks


def commands(path: Path) -> list[Command]:
    found = []
    for lang, body in fenced_blocks(path):
        if lang not in SHELL_LANGS:
            continue
        variables: dict[str, str] = {}
        pending, start = "", None
        for number, raw in body:
            line = raw.rstrip()
            start = start or number
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text, first, pending, start = (pending + line).strip(), start, "", None
            if not text or text.startswith("#"):
                continue
            if m := BLOCK_VARIABLE.fullmatch(text):
                variables[m.group(1)] = " ".join(m.group(2).split())
                continue
            text = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m, v=variables: v.get(m.group(1), m.group(0)), text)
            found.append(Command(path, first, text))
    return found


ALL_COMMANDS = [c for p in pages() for c in commands(p)]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def module_source(spec: str) -> str:
    """Source text of the module of an entry point ``module:function`` (of the main it wraps: kdrun.app.commands)."""
    module, function = spec.split(":")
    module = getattr(getattr(importlib.import_module(module), function), "target", spec).split(":")[0]
    found = importlib.util.find_spec(module)
    assert found is not None and found.origin, f"module {module} not found"
    return Path(found.origin).read_text(encoding="utf-8")


def flags_missing(args: list[str], source: str) -> list[str]:
    missing = []
    for arg in args:
        if not arg.startswith("--") or arg == "--":
            continue
        flag = arg.split("=", 1)[0]
        if flag in source:
            continue
        if flag.startswith("--no-") and f"--{flag[5:]}" in source and "BooleanOptionalAction" in source:
            continue
        missing.append(flag)
    return missing


@pytest.fixture(scope="module")
def hydra_config():
    """One Hydra initialisation for every command: kdrun's configs registered (by importing the
    module of the ``kdrun`` console script, as the command does) and ``kdrun.conf`` as the primary
    config module."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    importlib.import_module(pyproject()["project"]["scripts"]["kdrun"].split(":")[0])
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        yield


def selects_teacher(overrides: list[str]) -> bool:
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key in TEACHER_KEYS:
            return True
        if key == "experiment" and experiment_selects_teacher(value):
            return True
    return False


def experiment_selects_teacher(name: str) -> bool:
    """Whether conf/experiment/<name>.yaml, or an experiment file its defaults include, picks a teacher."""
    yaml = importlib.resources.files(CONFIG_MODULE) / "experiment" / f"{name}.yaml"
    if not yaml.is_file():
        return False
    text = yaml.read_text()
    included = re.findall(r"^\s*-\s+([\w/]+)\s*$", text, re.M)  # same-group entries (no 'override', no ':')
    return bool(re.search(r"override\s+/teacher\s*:", text)) or any(experiment_selects_teacher(i) for i in included)


def materialized_config_dir(cmd: Command, config_dir: str, tmp_path: Path) -> Path | None:
    """``--config-dir DIR`` of an example: the page's code blocks whose first line is ``# DIR/...``,
    written under tmp_path (None when the page has none)."""
    root, written = tmp_path / "config_dir", 0
    for _, body in fenced_blocks(cmd.page):
        if body and (m := re.fullmatch(rf"#\s*{re.escape(config_dir.rstrip('/'))}/(\S+)", body[0][1].strip())):
            target = root / m.group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("\n".join(text for _, text in body[1:]) + "\n")
            written += 1
    return root if written else None


def composable(cmd: Command, args: list[str], tmp_path: Path) -> tuple[list[str], bool]:
    """kdrun's command-line arguments → (Hydra overrides to compose, multirun)."""
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = get_args_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd}\nkdrun (Hydra) does not accept these arguments")
    overrides = list(parsed.overrides)
    if parsed.config_dir:
        root = materialized_config_dir(cmd, parsed.config_dir, tmp_path)
        if root is None:
            pytest.skip(f"{cmd.where}: --config-dir {parsed.config_dir} is not written out on the page")
        overrides.append(f"hydra.searchpath=[file://{root}]")
    return overrides, bool(parsed.multirun)


def sweep_variants(cmd: Command, overrides: list[str]) -> list[list[str]]:
    """A multirun's overrides as the override lists to compose: every sweep at its first value, then
    each further value of each sweep once (the other sweeps at their first value), so a misspelt
    option anywhere in ``objective=a,b,c`` fails. Sweeps without values to list (glob(...),
    interval(...)) are left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's grammar errors have no common public base
        pytest.fail(f"{cmd}\nthe overrides do not parse: {e}")
    firsts: list[str | None] = []
    others: list[tuple[int, str]] = []
    for i, (override, text) in enumerate(zip(parsed, overrides)):
        if not override.is_sweep_override():
            firsts.append(text)
            continue
        try:
            values = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
        except Exception:  # noqa: BLE001 - glob() and interval() have no values to list here
            firsts.append(None)
            continue
        firsts.append(values[0])
        others += [(i, v) for v in values[1:]]
    base = [o for o in firsts if o is not None]
    variants = [base]
    for i, value in others:
        variant = list(firsts)
        variant[i] = value
        variants.append([o for o in variant if o is not None])
    return variants


def check_composes(cmd: Command, args: list[str], tmp_path: Path, program: str = "kdrun") -> None:
    from hydra import compose
    from omegaconf import OmegaConf

    if program == "kdrun-augment":  # its own flags (--show N); every other argument is an override
        overrides, multirun = [a for a in args if not a.startswith("-") and not a.isdigit()], False
    else:
        overrides, multirun = composable(cmd, args, tmp_path)
    if PLACEHOLDER.search(" ".join(overrides)):
        pytest.skip(f"{cmd.where}: a placeholder stands in an override")
    for variant in sweep_variants(cmd, overrides) if multirun else [overrides]:
        try:
            cfg = compose(config_name="config", overrides=variant)
            OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:  # noqa: BLE001 - any composition or resolution error fails the docs
            pytest.fail(f"{cmd}\ndoes not compose against kdrun's config ({' '.join(variant)}): "
                        f"{type(e).__name__}: {e}")
    assert selects_teacher(overrides), (
        f"{cmd}\nnames no teacher: the default teacher comes from the hub; add teacher=minilm_l6 (offline) "
        "or teacher=bert_base")


@pytest.mark.parametrize("cmd", ALL_COMMANDS, ids=[c.where for c in ALL_COMMANDS])
def test_documented_command(cmd: Command, hydra_config, tmp_path: Path) -> None:
    try:
        tokens = shlex.split(cmd.text, comments=True)
    except ValueError as e:
        pytest.fail(f"{cmd}\nis not a shell command line: {e}")
    while tokens and (ENV_ASSIGNMENT.fullmatch(tokens[0]) or tokens[0] == "sudo"):
        tokens = tokens[1:]
    if not tokens:
        return
    program, args = tokens[0], tokens[1:]
    scripts = pyproject()["project"]["scripts"]

    if program == "kdrun":
        check_composes(cmd, args, tmp_path)
    elif program in ("torchrun", "accelerate") and "kdrun" in args and args[args.index("kdrun") - 1] == "-m":
        check_composes(cmd, args[args.index("kdrun") + 1:], tmp_path)
    elif program.startswith("kdrun-"):
        assert program in scripts, f"{cmd}\n{program} is not a console script in pyproject.toml [project.scripts]"
        missing = flags_missing(args, module_source(scripts[program]))
        assert not missing, f"{cmd}\n{program} ({scripts[program]}) has no option {', '.join(missing)}"
        if program == "kdrun-augment":
            check_composes(cmd, args, tmp_path, program)
    elif program in ("python", "python3") and args and args[0] == "-m":
        assert importlib.util.find_spec(args[1].split(".")[0]) is not None, f"{cmd}\nno module {args[1]}"
        if args[1].startswith("kdrun"):
            assert importlib.util.find_spec(args[1]) is not None, f"{cmd}\nno module {args[1]}"
    elif program in ("python", "python3") and args and args[0].endswith(".py"):
        script = REPO / args[0]
        assert script.is_file(), f"{cmd}\nno script {args[0]}"
        missing = flags_missing(args[1:], script.read_text(encoding="utf-8"))
        assert not missing, f"{cmd}\n{args[0]} has no option {', '.join(missing)}"
    elif program.startswith("scripts/"):
        assert (REPO / program).is_file(), f"{cmd}\nno script {program}"
    elif program == "pip":
        extras = pyproject()["project"].get("optional-dependencies", {})
        for arg in args:
            if m := re.fullmatch(r"\.\[([\w,-]+)\]", arg):
                unknown = [e for e in m.group(1).split(",") if e not in extras]
                assert not unknown, f"{cmd}\npyproject.toml has no extra {', '.join(unknown)}"
        if "-c" in args:
            assert (REPO / args[args.index("-c") + 1]).is_file(), f"{cmd}\nno constraints file"


def test_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move text to docs/"


def test_readme_links_resolve() -> None:
    """The README is not part of the site, so its links into docs/ are checked here (files and anchors,
    with the slugs MkDocs gives the headings)."""
    toc = pytest.importorskip("markdown.extensions.toc")
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        page = (REPO / path) if path else README
        assert page.exists(), f"README.md links to {target}, which does not exist"
        if anchor and page.suffix == ".md":
            headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(encoding="utf-8"), flags=re.M)
            slugs = {toc.slugify(re.sub(r"[`*]", "", h), "-") for h in headings}
            assert anchor in slugs, f"README.md links to {target}: {path or 'README.md'} has no heading #{anchor}"


def test_site_builds_strictly(tmp_path: Path) -> None:
    """mkdocs build --strict: a broken link or anchor, or a page missing from the nav, fails."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
