"""Content-addressed cache entries written atomically under a file lock.

An entry is a directory ``<root>/<kind>/<key>/`` that appears only once complete (built in a
sibling temporary directory, then renamed). Concurrent processes asking for the same key wait on
``<key>.lock``; the first builds, the others find the finished entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from filelock import FileLock

COMPLETE_MARKER = ".complete"


def content_hash(obj: Any, length: int = 16) -> str:
    """Stable hash of a JSON-serialisable object (keys sorted)."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """Size and mtime of a file or of every file under a directory (cheap content identity)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    return {str(q.relative_to(p) if p.is_dir() else q.name): [q.stat().st_size, int(q.stat().st_mtime)] for q in files}


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling file and a rename (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str))


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Swap ``tmp_dir`` in as ``final_dir`` (the old one, if any, is removed after the swap)."""
    old = final_dir.with_name(final_dir.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        shutil.rmtree(old)


@contextmanager
def staging_dir(final_dir: Path) -> Iterator[Path]:
    """A temporary sibling directory that becomes ``final_dir`` only if the block succeeds."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{final_dir.name}.tmp-"))
    try:
        yield tmp
        replace_dir(tmp, final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).exists()


def get_or_build(root: str | os.PathLike, kind: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Return (entry dir, was_cached). ``build(tmp_dir)`` fills a fresh directory when missing."""
    entry = Path(root).expanduser() / kind / key
    if is_complete(entry):
        return entry, True
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if is_complete(entry):  # another process built it while we waited
            return entry, True
        if entry.exists():  # left by a crash before the marker: rebuild
            shutil.rmtree(entry)
        with staging_dir(entry) as tmp:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text("ok\n")
    return entry, False
