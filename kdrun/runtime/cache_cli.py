"""``kdrun-cache``: look after a cache directory shared by many runs.

    kdrun-cache list                       # every entry: kind, key, size, last use, making run, state
    kdrun-cache ls --cache-dir DIR         # ls is list; --cache-dir goes before or after the command
    kdrun-cache verify [--fix]             # check every entry against its manifest
    kdrun-cache gc --older-than 7d [--dry-run]
    kdrun-cache gc --max-size 50G          # also evict least recently used entries down to 50 GiB

States: ``ok`` (published, verifies), ``damaged`` (published, fails its manifest: ``verify --fix``
moves it aside so the next run rebuilds it), ``set aside`` (under ``<kind>/.damaged/``, kept for
inspection), ``unfinished`` (a staging or ``.partial`` directory: a build in progress, or one whose
writer stopped and whose key was never asked for again). ``gc`` removes set-aside entries and
unfinished directories whose writer is gone (their lock is free) and that were last changed longer
ago than ``--older-than``, and lock files of the same age that no process holds. With
``--max-size`` it then evicts published entries, least recently used first (an entry's directory
time, which every run that uses it renews), until the cache fits; an entry being built, or read by
a running process (a teacher-output store holds a shared lock on its manifest), is never evicted.
Without ``--max-size`` it never touches a published entry. ``cache_max_gb`` in a run's config runs
this eviction after the run. The cache is ``--cache-dir``, else ``$KDRUN_CACHE_DIR``, else
``~/.cache/kdrun`` (kdrun's own default).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from kdrun.runtime.cache import COMPLETE_MARKER, DAMAGED_DIR, lock_is_free, manifest_problem, quarantine

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
SIZES = {"": 2**30, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
DECISIONS_DIR = ".decisions"  # small per-run decision files (the teacher-output store's)


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


def parse_size(text: str) -> int:
    """'50G', '512M', '1.5T', '200K', '100B' (a bare number is GiB) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"--max-size {text!r}: give a number and a unit (K, M, G, T), e.g. 50G")
    return int(float(m.group(1)) * SIZES[m.group(2)])


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
            if path.name == DECISIONS_DIR:
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


LIST_HEAD = ("kind", "key", "size", "last use", "made by run", "state")
UNKNOWN = "—"  # an entry that does not record the run that made it (built outside a run, or by an older kdrun)


def made_by(entry: Path) -> str:
    """The run directory that built ``entry``, as its manifest records it."""
    import json

    try:
        return json.loads((entry / COMPLETE_MARKER).read_text()).get("made_by") or UNKNOWN
    except (OSError, ValueError, AttributeError):
        return UNKNOWN


def list_row(it: Item) -> tuple[str, ...]:
    """One entry's cells under :data:`LIST_HEAD`."""
    state = f"{it.state} ({it.problem})" if it.problem else it.state
    return (it.kind, it.key, human(it.bytes), f"{age(it.age_s)} ago", made_by(it.path), state)


def print_items(items: list[Item]) -> None:
    """The ``list`` table: a header line, one row per entry (size right-aligned), then the total."""
    rows = [LIST_HEAD, *(list_row(it) for it in items)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(LIST_HEAD))]
    for r in rows:
        cells = [c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(cells).rstrip())
    total = sum(it.bytes for it in items)
    print(f"{len(items)} item(s), {human(total)}")


def writer_gone(item: Item) -> bool:
    """True when no process holds the entry's lock (a staging directory's writer has stopped)."""
    return lock_is_free(item.path.parent / f"{item.key}.lock")  # a missing lock: nobody builds (none is made here)


def in_use(item: Item) -> bool:
    """True when a process reads the entry (a shared lock on its manifest) or builds it (its lock)."""
    if not writer_gone(item):
        return True
    try:
        fd = os.open(item.path / COMPLETE_MARKER, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def evict(item: Item) -> bool:
    """Remove a published entry unless a process uses it: under its lock and an exclusive lock on its
    manifest, renamed away (a run looking it up finds it whole or not at all), then deleted."""
    lock = item.path.parent / f"{item.key}.lock"
    made = not lock.exists()
    try:
        with FileLock(str(lock), timeout=0):
            fd = os.open(item.path / COMPLETE_MARKER, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            else:
                gone = item.path.with_name(f".{item.key}.evicted-{os.getpid()}")
                os.replace(item.path, gone)
            finally:
                os.close(fd)
            if made:  # no lock file piles up for an entry gone
                lock.unlink(missing_ok=True)
    except (Timeout, FileNotFoundError):
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


def stale_locks(root: Path, older_than: float) -> list[Path]:
    """Lock files (and old decision files) that no process holds, last changed before ``older_than``."""
    now, out = time.time(), []
    for kind_dir in (p for p in root.glob("*") if p.is_dir()):
        files = [*kind_dir.glob("*.lock"), *(kind_dir / DECISIONS_DIR).glob("*")]
        for f in files:
            try:
                if now - f.stat().st_mtime < older_than:
                    continue
                with FileLock(str(f), timeout=0) if f.suffix == ".lock" else _nothing():
                    out.append(f)
            except (Timeout, OSError):
                continue
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def gc(items: list[Item], older_than: float, dry_run: bool, max_size: int | None = None,
       root: Path | None = None) -> list[Item]:
    """Remove set-aside entries and abandoned builds older than ``older_than`` (and stale lock files
    under ``root``); with ``max_size`` (bytes) then evict published entries, least recently used
    first, until the cache holds at most that much."""
    doomed = [it for it in items if it.state in ("set aside", "unfinished") and it.age_s >= older_than
              and (it.state == "set aside" or writer_gone(it))]
    for it in doomed:
        print(f"{'would remove' if dry_run else 'removing'} {it.path} ({it.state}, {human(it.bytes)}, "
              f"{age(it.age_s)} old)")
        if not dry_run:
            shutil.rmtree(it.path, ignore_errors=True)
    if root is not None:
        for f in stale_locks(root, older_than):
            if not dry_run:
                f.unlink(missing_ok=True)
    if max_size is not None:
        total = sum(it.bytes for it in items if it not in doomed)
        published = sorted((it for it in items if it.state in ("ok", "damaged", "(not checked)")),
                           key=lambda it: -it.age_s)  # least recently used first
        for it in published:
            if total <= max_size:
                break
            if in_use(it):
                print(f"keeping {it.path} ({human(it.bytes)}): in use by a running process")
                continue
            print(f"{'would evict' if dry_run else 'evicting'} {it.path} ({human(it.bytes)}, last used "
                  f"{age(it.age_s)} ago)")
            if dry_run or evict(it):
                doomed.append(it)
                total -= it.bytes
        if total > max_size:
            print(f"the cache still holds {human(total)}, more than --max-size {human(max_size)} (entries in use)")
    print(f"{'would free' if dry_run else 'freed'} {human(sum(it.bytes for it in doomed))} in {len(doomed)} item(s)")
    return doomed


def evict_to_size(root: str | os.PathLike, max_gb: float) -> list[Item]:
    """``cache_max_gb`` after a run: :func:`gc` with ``--max-size`` (set-aside and abandoned items
    older than 7 days too)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    return gc(scan(root, check=False), parse_age("7d"), False, int(max_gb * 2**30), root)


CACHE_DIR_HELP = "the cache (default: $KDRUN_CACHE_DIR, else ~/.cache/kdrun); before or after the command"


def parser() -> argparse.ArgumentParser:
    """``kdrun-cache``'s arguments; ``--cache-dir`` is taken before or after the command."""
    p = argparse.ArgumentParser(prog="kdrun-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, default=None, help=CACHE_DIR_HELP)
    common = argparse.ArgumentParser(add_help=False)  # after the command; unset there, the value before stays
    common.add_argument("--cache-dir", type=Path, default=argparse.SUPPRESS, help=CACHE_DIR_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", aliases=["ls"], parents=[common],
                   help="every entry: kind, key, size, last use, the run that made it, state (manifests not "
                        "checked: see verify)")
    v = sub.add_parser("verify", parents=[common],
                       help="check every published entry against its manifest (exit 1 if one is damaged)")
    v.add_argument("--fix", action="store_true", help="move damaged entries aside, so the next run rebuilds them")
    g = sub.add_parser("gc", parents=[common], help="remove set-aside entries and abandoned unfinished builds")
    g.add_argument("--older-than", type=parse_age, default=parse_age("7d"), help="e.g. 7d (default), 12h, 30m")
    g.add_argument("--max-size", type=parse_size, default=None,
                   help="evict least recently used entries until the cache holds at most this, e.g. 50G")
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = (args.cache_dir or default_cache_dir()).expanduser()
    if not root.is_dir():
        print(f"kdrun-cache: error: {root} is not a directory (give --cache-dir or set KDRUN_CACHE_DIR)",
              file=sys.stderr)
        return 2
    items = scan(root, check=args.command == "verify")
    if args.command in ("list", "ls"):
        print_items(items)
        return 0
    if args.command == "gc":
        gc(items, args.older_than, args.dry_run, args.max_size, root)
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
