"""``kdrun-cache``: look after a cache directory shared by many runs.

    kdrun-cache list                       # every entry: kind, key, size, age, state
    kdrun-cache verify [--fix]             # check every entry against its manifest
    kdrun-cache gc --older-than 7d [--dry-run]

States: ``ok`` (published, verifies), ``damaged`` (published, fails its manifest: ``verify --fix``
moves it aside so the next run rebuilds it), ``set aside`` (under ``<kind>/.damaged/``, kept for
inspection), ``unfinished`` (a staging or ``.partial`` directory: a build in progress, or one whose
writer stopped and whose key was never asked for again). ``gc`` removes set-aside entries and
unfinished directories whose writer is gone (their lock is free) and that were last changed longer
ago than ``--older-than``; it never touches a published entry. The cache is ``--cache-dir``, else
``$KDRUN_CACHE_DIR``, else ``~/.cache/kdrun`` (kdrun's own default).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from kdrun.runtime.cache import DAMAGED_DIR, manifest_problem, quarantine

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass
class Item:
    kind: str
    key: str
    path: Path
    state: str  # ok | damaged | set aside | unfinished | (not checked)
    bytes: int
    age_s: float
    problem: str | None = None


def default_cache_dir() -> Path:
    return Path(os.environ.get("KDRUN_CACHE_DIR") or Path(os.environ.get("HOME", ".")) / ".cache" / "kdrun")


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '90s', '2w' (a bare number is days) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--older-than {text!r}: give a number and a unit (s, m, h, d, w), e.g. 7d")
    return float(m.group(1)) * UNITS[m.group(2) or "d"]


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def last_change(path: Path) -> float:
    times = [p.stat().st_mtime for p in path.rglob("*")] if path.is_dir() else []
    return max([path.stat().st_mtime, *times])


def staging_key(name: str) -> str:
    """The entry key of a staging (``.<key>.tmp-*``) or partial (``.<key>.partial``) directory."""
    name = name[1:]
    return name.rsplit(".tmp-", 1)[0] if ".tmp-" in name else name.removesuffix(".partial")


def scan(root: Path, check: bool) -> list[Item]:
    """Everything under ``root``'s kind directories; ``check``: verify published entries' checksums."""
    now, items = time.time(), []
    for kind_dir in sorted(p for p in root.glob("*") if p.is_dir()):
        for path in sorted(kind_dir.iterdir()):
            if not path.is_dir():
                continue
            if path.name == DAMAGED_DIR:
                items += [Item(kind_dir.name, p.name, p, "set aside", tree_size(p), now - last_change(p))
                          for p in sorted(path.iterdir()) if p.is_dir()]
                continue
            if path.name.startswith("."):
                items.append(Item(kind_dir.name, staging_key(path.name), path, "unfinished", tree_size(path),
                                  now - last_change(path)))
                continue
            problem = manifest_problem(path, check_files=check)
            state = "damaged" if problem else ("ok" if check else "(not checked)")
            items.append(Item(kind_dir.name, path.name, path, state, tree_size(path), now - last_change(path), problem))
    return items


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def age(s: float) -> str:
    return f"{s / 86400:.1f}d" if s >= 86400 else f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m"


def print_items(items: list[Item]) -> None:
    for it in items:
        extra = f"  ({it.problem})" if it.problem else ""
        print(f"{it.kind:16} {it.key:28} {human(it.bytes):>10} {age(it.age_s):>7}  {it.state}{extra}")
    total = sum(it.bytes for it in items)
    print(f"{len(items)} item(s), {human(total)}")


def writer_gone(item: Item) -> bool:
    """True when no process holds the entry's lock (a staging directory's writer has stopped)."""
    lock = item.path.parent / f"{item.key}.lock"
    try:
        with FileLock(str(lock), timeout=0):
            return True
    except Timeout:
        return False


def gc(items: list[Item], older_than: float, dry_run: bool) -> list[Item]:
    doomed = [it for it in items if it.state in ("set aside", "unfinished") and it.age_s >= older_than
              and (it.state == "set aside" or writer_gone(it))]
    for it in doomed:
        print(f"{'would remove' if dry_run else 'removing'} {it.path} ({it.state}, {human(it.bytes)}, "
              f"{age(it.age_s)} old)")
        if not dry_run:
            shutil.rmtree(it.path, ignore_errors=True)
    print(f"{'would free' if dry_run else 'freed'} {human(sum(it.bytes for it in doomed))} in {len(doomed)} item(s)")
    return doomed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kdrun-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $KDRUN_CACHE_DIR or ~/.cache/kdrun")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every entry with its size, age and state (manifests not checked: see verify)")
    v = sub.add_parser("verify", help="check every published entry against its manifest (exit 1 if one is damaged)")
    v.add_argument("--fix", action="store_true", help="move damaged entries aside, so the next run rebuilds them")
    g = sub.add_parser("gc", help="remove set-aside entries and abandoned unfinished builds")
    g.add_argument("--older-than", type=parse_age, default=parse_age("7d"), help="e.g. 7d (default), 12h, 30m")
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    args = p.parse_args(argv)
    root = (args.cache_dir or default_cache_dir()).expanduser()
    if not root.is_dir():
        print(f"kdrun-cache: error: {root} is not a directory (give --cache-dir or set KDRUN_CACHE_DIR)",
              file=sys.stderr)
        return 2
    items = scan(root, check=args.command == "verify")
    if args.command == "list":
        print_items(items)
        return 0
    if args.command == "gc":
        gc(items, args.older_than, args.dry_run)
        return 0
    return verify(items, args.fix)


def verify(items: list[Item], fix: bool) -> int:
    entries = [it for it in items if it.state in ("ok", "damaged")]
    bad = [it for it in entries if it.state == "damaged"]
    for it in bad:
        print(f"damaged: {it.path}: {it.problem}")
        if fix:
            quarantine(it.path, it.problem or "damaged", then="the next run that needs it rebuilds it")
    print(f"{len(entries) - len(bad)}/{len(entries)} entries verify" + (f"; {len(bad)} damaged" if bad else ""))
    return 1 if bad and not fix else 0


if __name__ == "__main__":
    sys.exit(main())
