"""Content-addressed cache entries written atomically under a file lock, verified when loaded.

An entry is a directory ``<root>/<kind>/<key>/`` that appears only once complete (built in a
sibling staging directory ``.<key>.tmp-*``, then renamed). Concurrent processes asking for the same
key wait on ``<key>.lock``; the first builds, the others find the finished entry.

The last file written into an entry is its manifest ``.complete``: the size and SHA-256 of every
other file. :func:`get_or_build` checks it before handing the entry out (sizes, then checksums at
about 1.5 GB/s: a BERT-base teacher costs a quarter of a second), and :func:`load_or_build` also
treats an entry its loader cannot read as damaged. A damaged entry is moved aside to
``<kind>/.damaged/`` with a one-line message and rebuilt. Staging directories whose writer is gone
(its lock is free) are removed when the next entry of that kind is built.

Everything here is created with the process umask's permissions (``tempfile`` alone would make
private 0600/0700 files), so a cache or outputs tree shared by a group works under ``umask 002``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from filelock import FileLock, Timeout

from kdrun.errors import UserError

COMPLETE_MARKER = ".complete"  # the manifest; written last
DAMAGED_DIR = ".damaged"
T = TypeVar("T")


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (no window for other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_as_created(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a file made by ``tempfile`` (0600, or 0700 for a directory) the mode a plain ``open``
    or ``mkdir`` would have given it under the current umask."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def content_hash(obj: Any, length: int = 16) -> str:
    """Stable hash of a JSON-serialisable object (keys sorted)."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """Size and mtime of a file or of every file under a directory (cheap content identity)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    return {str(q.relative_to(p) if p.is_dir() else q.name): [q.stat().st_size, int(q.stat().st_mtime)] for q in files}


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """A file object whose content appears at ``path`` only when the block succeeds (a temporary
    sibling, fsynced, then renamed; never half-written), with the permissions ``open`` would give."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        chmod_as_created(tmp)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str))


def previous_dir(final_dir: Path) -> Path:
    """Where :func:`replace_dir` keeps the replaced ``final_dir`` while it swaps the new one in."""
    return final_dir.with_name(final_dir.name + ".old")


def _discard_dir(path: Path) -> None:
    """Remove ``path`` so that it is either whole or absent at every moment: renamed out of the way
    (one atomic step) first, then deleted. Leftovers of a deletion that was cut short are removed too."""
    if path.exists():
        os.replace(path, path.with_name(f".{path.name}.trash-{os.getpid()}-{time.monotonic_ns()}"))
    for trash in path.parent.glob(f".{path.name}.trash-*"):
        shutil.rmtree(trash, ignore_errors=True)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Swap ``tmp_dir`` in as ``final_dir``; a process killed at any point of the swap leaves a
    whole ``final_dir`` or, between the two renames, a whole ``final_dir.old`` that
    :func:`recover_dir` puts back (the old copy is never deleted while it is the only one)."""
    old = previous_dir(final_dir)
    if final_dir.exists():
        _discard_dir(old)  # final_dir is whole: an older copy is not needed
        os.replace(final_dir, old)
    # (else an earlier swap was cut between its renames: old is the only copy until tmp_dir is in)
    os.replace(tmp_dir, final_dir)
    _discard_dir(old)


def recover_dir(final_dir: Path) -> bool:
    """Put ``final_dir.old`` back as ``final_dir`` when a :func:`replace_dir` was cut between its
    two renames (``final_dir`` missing); True when it did."""
    old = previous_dir(final_dir)
    if final_dir.exists() or not old.exists():
        return False
    os.replace(old, final_dir)
    return True


def _publish(tmp: Path, final_dir: Path) -> None:
    for p in tmp.rglob("*"):  # some writers (safetensors) make private 0600 files whatever the umask
        if not p.is_symlink():
            chmod_as_created(p, directory=p.is_dir())
    replace_dir(tmp, final_dir)


@contextmanager
def staging_dir(final_dir: Path) -> Iterator[Path]:
    """A temporary sibling directory that becomes ``final_dir`` only if the block succeeds."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{final_dir.name}.tmp-"))
    try:
        chmod_as_created(tmp, directory=True)
        yield tmp
        _publish(tmp, final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def partial_dir(final_dir: Path) -> Path:
    """Where a resumable build of ``final_dir`` keeps its work between attempts."""
    return final_dir.with_name(f".{final_dir.name}.partial")


@contextmanager
def resumable_staging_dir(final_dir: Path) -> Iterator[Path]:
    """Like :func:`staging_dir`, but the directory has a fixed name and outlives an interruption
    (a signal, Ctrl-C, ``kill -9``), so the next attempt continues the work in it (the caller
    holds the entry's lock). It is removed when the block fails with an error, and becomes
    ``final_dir`` only when the block succeeds: unfinished work is never published."""
    tmp = partial_dir(final_dir)
    if tmp.exists():
        print(f"[kdrun] continuing the interrupted build of {final_dir.name} in {tmp}", flush=True)
    tmp.mkdir(parents=True, exist_ok=True)
    chmod_as_created(tmp, directory=True)
    try:
        yield tmp
        _publish(tmp, final_dir)
    except (KeyboardInterrupt, SystemExit):  # interrupted: kept for the next attempt
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).exists()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(entry: Path) -> None:
    """Record the size, checksum and modification time of every file of ``entry``; the entry counts
    as complete after."""
    files = {str(p.relative_to(entry)): {"size": p.stat().st_size, "sha256": file_sha256(p),
                                         "mtime_ns": p.stat().st_mtime_ns}
             for p in sorted(entry.rglob("*")) if p.is_file() and p.name != COMPLETE_MARKER}
    from kdrun.runtime.provenance import current_run

    made_by = {"made_by": current_run()} if current_run() else {}  # the run that built it (kdrun-cache list)
    write_json_atomic(entry / COMPLETE_MARKER, {"version": 1, "files": files, **made_by})


def entry_problem(entry: Path, checksums: bool = True) -> str | None:
    """Why a complete entry cannot be used (a file missing, of the wrong size or, with
    ``checksums``, checksum; without, the checksum of a file whose modification time is no longer
    the one recorded at publishing), or None.

    Entries of older kdrun versions carry no manifest (marker text ``ok``) and pass unchecked.
    """
    try:
        text = (entry / COMPLETE_MARKER).read_text()
    except OSError as e:
        return f"manifest unreadable ({e.strerror})"
    except UnicodeDecodeError:  # a damaged byte in the manifest itself
        return "manifest unreadable (not text)"
    if text.strip() == "ok":
        return None
    try:
        files = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        return "manifest unreadable"
    for rel, want in files.items():
        p = entry / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {want['size']}"
    if not checksums:  # a file written to since it was published (its mtime moved) is still checksummed
        changed = [rel for rel, want in files.items()
                   if "mtime_ns" in want and (entry / rel).stat().st_mtime_ns != want["mtime_ns"]]
        return next((f"{rel} does not match its checksum (written to after it was published)"
                     for rel in changed if file_sha256(entry / rel) != files[rel]["sha256"]), None)
    for rel, want in files.items():  # sizes first: a truncated file is found without reading anything
        if file_sha256(entry / rel) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def manifest_problem(entry: Path, check_files: bool = True, checksums: bool = True) -> str | None:
    """Why a directory published behind a manifest (a cache entry, a checkpoint) cannot be trusted:
    its manifest is missing, or (``check_files``) :func:`entry_problem` (sizes only unless
    ``checksums``); None when it verifies."""
    if not (entry / COMPLETE_MARKER).exists():
        return f"{COMPLETE_MARKER} (its manifest) is missing"
    return entry_problem(entry, checksums) if check_files else None


def quarantine(entry: Path, reason: str, then: str = "rebuilding") -> Path:
    """Move a damaged entry to ``<kind>/.damaged/`` (kept for inspection) and say so in one line,
    ending with what happens next."""
    dest = entry.parent / DAMAGED_DIR / f"{entry.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(entry, dest)
    print(f"[kdrun] cache entry {entry} is damaged ({reason}); moved to {dest} and {then}", flush=True)
    return dest


def remove_stale_staging(kind_dir: Path, held_key: str) -> list[Path]:
    """Remove staging directories ``.<key>.tmp-*`` whose writer is gone (``<key>.lock`` is free);
    the caller holds the lock of ``held_key``, so that key's staging directories are all stale."""
    removed = []
    for tmp in kind_dir.glob(".*.tmp-*"):
        key = tmp.name[1:].rsplit(".tmp-", 1)[0]
        if key == held_key:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
            continue
        try:
            with FileLock(str(kind_dir / key) + ".lock", timeout=0):
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
        except Timeout:  # its writer is still at work
            continue
    return removed


def lock_is_free(lock: Path) -> bool:
    """Whether no process holds ``lock`` (a ``FileLock`` file; a missing file is free)."""
    if not lock.exists():
        return True
    try:
        with FileLock(str(lock), timeout=0):
            return True
    except Timeout:
        return False
    except OSError:  # cannot open it (permissions): assume a holder
        return False


def wait_for_file(path: Path, lock: Path, root: str | os.PathLike, what: str, timeout_s: float | None = None,
                  poll_s: float = 1.0, grace_s: float = 300.0, stop: Callable[[], int | None] | None = None) -> Path:
    """Wait until rank 0 has written ``path`` (``what``, in messages) while it holds ``lock``.

    A :class:`UserError` (one line naming ``root``, the cache_dir) when the lock is free and ``path``
    absent after having been held (rank 0 stopped), or never held within ``grace_s`` (rank 0 is
    gone, or this node does not see the same cache_dir), or after ``timeout_s``. ``stop()``
    returning a signal number (a deferred SIGTERM) ends the wait with exit status 128 + it. No
    collective is used, so a build longer than the process group's timeout is fine.
    """
    start, seen_held = time.monotonic(), False
    gone = (f"rank 0 stopped before publishing {what} in cache_dir={root} (see its log); every node of a "
            "multi-node run must share cache_dir")
    while not path.exists():
        signum = stop() if stop is not None else None
        if signum is not None:
            print(f"[kdrun] stopped by signal {signum} while waiting for {what}", flush=True)
            raise SystemExit(128 + int(signum))
        free = lock_is_free(lock)
        if not free:
            seen_held = True
        elif not path.exists() and (seen_held or time.monotonic() - start > grace_s):
            raise UserError(gone)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise UserError(f"waited {timeout_s:.0f} s for {what} in cache_dir={root} (cache_wait_timeout_s); "
                            "rank 0 is still at it or stuck: raise cache_wait_timeout_s or look at rank 0's log")
        time.sleep(poll_s)
    return path


def wait_for_entry(root: str | os.PathLike, kind: str, key: str, poll_s: float = 1.0, timeout_s: float | None = None,
                   grace_s: float = 300.0, stop: Callable[[], int | None] | None = None) -> Path:
    """Wait until another process (rank 0 of a data-parallel run) has published the entry ``key``
    (see :func:`wait_for_file` for the timeout, a dead builder and signals)."""
    entry = Path(root).expanduser() / kind / key
    wait_for_file(entry / COMPLETE_MARKER, Path(str(entry) + ".lock"), root, f"the cache entry {kind}/{key}",
                  timeout_s, poll_s, grace_s, stop)
    return entry


def touch_entry(entry: Path) -> None:
    """Mark an entry as used now (its directory's mtime: what ``kdrun-cache gc --max-size`` evicts by)."""
    try:
        os.utime(entry)
    except OSError:  # a read-only shared cache
        pass


def get_or_build(root: str | os.PathLike, kind: str, key: str, build: Callable[[Path], None],
                 resumable: bool = False, checksums: bool = True) -> tuple[Path, bool]:
    """Return (entry dir, was_cached). ``build(tmp_dir)`` fills a fresh directory when missing.

    A complete entry is verified against its manifest first (with ``checksums=False`` its files'
    presence and sizes only: for large entries whose checksums were taken when they were
    published); a damaged one is moved aside and rebuilt.
    ``resumable``: ``build`` gets the same directory again after an interrupted attempt (see
    :func:`resumable_staging_dir`) and continues from what it finds there.
    """
    entry = Path(root).expanduser() / kind / key
    if manifest_problem(entry, checksums=checksums) is None:
        touch_entry(entry)
        return entry, True
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if is_complete(entry):  # another process built it while we waited, or it is damaged
            problem = entry_problem(entry, checksums)
            if problem is None:
                touch_entry(entry)
                return entry, True
            quarantine(entry, problem)
        elif entry.exists():  # left by a crash before the marker: rebuild
            print(f"[kdrun] cache entry {entry} has no manifest (its writer stopped before finishing); rebuilding",
                  flush=True)
            shutil.rmtree(entry)
        remove_stale_staging(entry.parent, key)
        with (resumable_staging_dir if resumable else staging_dir)(entry) as tmp:
            build(tmp)
            write_manifest(tmp)
    return entry, False


def load_or_build(root: str | os.PathLike, kind: str, key: str, build: Callable[[Path], None],
                  load: Callable[[Path], T], resumable: bool = False) -> tuple[T, Path, bool]:
    """:func:`get_or_build`, then ``load(entry)``; a cached entry the loader cannot read (damaged in a
    way the manifest does not show, or written before manifests) is moved aside and rebuilt once.

    Returns (loaded value, entry dir, was_cached).
    """
    entry, cached = get_or_build(root, kind, key, build, resumable)
    try:
        return load(entry), entry, cached
    except UserError:
        raise
    except Exception as e:
        if not cached:  # freshly built and unreadable: a bug, keep the traceback
            raise
        reason = f"cannot be loaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    marker = entry / COMPLETE_MARKER
    stamp = marker.stat().st_mtime_ns if marker.exists() else None
    with FileLock(str(entry) + ".lock"):
        if marker.exists() and marker.stat().st_mtime_ns == stamp:  # not rebuilt by another process meanwhile
            quarantine(entry, reason[:300])
    entry, cached = get_or_build(root, kind, key, build, resumable)
    return load(entry), entry, cached
