"""The teacher-output store: a frozen teacher's outputs on a training set, computed once and reused.

Every run of a sweep (seeds × objectives × learning rates × λs) that distils from the same frozen
teacher on the same tokenised data needs the same teacher outputs. With ``teacher.store=auto`` (the
default) a stage whose teacher features can be stored reads them from a cache entry (kind
``teacher_outputs``) instead of running the teacher; the first run builds the entry with one pass of
the teacher over the data, in row order.

The key is what determines the outputs, built from identifiers the run already has, never from the
tokens themselves: the task data's content key, the tokenizer's hash, the max length, which data
(original or augmented, with the augmentation's key), a hash of the rows' ``idx`` and lengths (a
subsample is another entry), the teacher's weights hash and its full config (heads, norm eps,
activation...), the collator's settings (a corpus's masked-LM masks depend on its seed and
probability), the training precision, the store's dtype, the features stored and the versions of
torch, transformers, numpy and of kdrun's capture code. The size cap is checked before any of it
is hashed. A run that needs other features (another objective) builds its own entry.

Rows are found by ``idx`` through the entry's ``ids.npy`` (the ``idx`` of row i), never by taking
``idx`` for a position: a subsample keeps its corpus ``idx`` and a plug-in kind may number rows as
it likes (``idx`` must be unique within a training set).

Layout of an entry: ``ids.npy`` (N row ids), ``offsets.npy`` (N+1 token offsets; row i's tokens
are ``[offsets[i], offsets[i+1])``), one ``.npy`` array per stored output — per-token outputs unpadded, token-major
(hidden state ``hidden.<l>`` for l = 0..L, attention projections ``q.<l>``/``k.<l>``/``v.<l>`` for
l = 1..L, QA's start/end ``logits`` (T, 2)), per-example ``logits`` (N, C) — and ``meta.json``.
Arrays are written with ``numpy.lib.format.open_memmap`` into the staging directory, their blocks
allocated up front (``posix_fallocate``: a full disk is the one-line "no space left" error when the
build starts, never a SIGBUS in the middle), after the estimate was checked against the free space;
published atomically behind the cache's manifest, whose checksums are taken once at publishing
(``kdrun-cache verify`` checks them again); a run opening an entry checks the manifest and every
file's size, not the checksums. Runs read the arrays memory-mapped, holding a shared lock on the
manifest so that ``kdrun-cache gc`` does not evict an entry in use. bf16 is kept as its 16-bit
pattern (numpy has no bf16). fp16 stores refuse values beyond fp16's range (the stage then runs the
teacher live, saying which output overflowed: ``teacher.store_dtype=bf16`` or ``fp32`` stores it).

``teacher.store=auto`` decides once per stage, on rank 0, and the other ranks take its decision
(kept in the checkpoint, so a resumed run decides as it did): the teacher's forward time per row
(measured during the build, or on a sample of the rows when the entry was cached) against the
reader's whole path per row (gather from a cold page cache, pinning, the copy to the device and
the cast to fp32), both stated in the log.

Storable needs: ``logits``, ``hidden_states`` (every layer), ``qkv`` and ``attention_scores``
(served from the stored Q and K, like the live teacher's hooks), ``spans`` (read from the batch).
Not stored, the teacher runs live: post-softmax ``attentions``, masked-LM logits (corpus tasks mask
at random every epoch), families that add a relative-position bias to their scores (DeBERTa-v2),
and the stages of a stage strategy that runs the teacher live (``StageStrategy.teacher_live``).

Stored outputs equal the live teacher's to the rounding of the store's dtype; with
``teacher.store_dtype=fp32`` they differ from a live forward only by the last bits that a batch's
padding width changes in the teacher's kernels (the live teacher is not bit-stable across batchings
either): students trained either way agree to ~1e-6 (tests/test_teacher_store.py).

The key and checks are kdrun.engine.store_keys, the build kdrun.engine.store_build, the reader
kdrun.engine.store_read; this module decides, per stage, whether the store serves it. Their public
names are importable from here too.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kdrun.engine.store_build import StoreOverflow, _sync, _Writer, build_store
from kdrun.engine.store_keys import (
    DECISIONS,
    FORMAT_VERSION,
    FP16_MAX,
    KIND,
    STORABLE,
    STORE_DTYPES,
    STORE_MODES,
    RowMap,
    StoreSettings,
    _size,
    build_collator,
    code_versions,
    collator_settings,
    estimate_bytes,
    free_bytes,
    row_ids,
    row_lengths,
    store_key,
    stored_kinds,
    teacher_config,
    weights_hash,
    why_not_storable,
)
from kdrun.engine.store_read import (
    StoreCollator,
    StoreReader,
    as_stored,
    forward_seconds_per_row,
    read_seconds_per_row,
    sample_rows,
    served,
)
from kdrun.errors import UserError
from kdrun.models.features import Features
from kdrun.runtime.cache import (
    get_or_build,
    wait_for_entry,
    wait_for_file,
    write_json_atomic,
)


@dataclass
class _Stage:
    """One stage's store question, as rank 0 answers it."""

    parts: Any
    plan: Any
    ds: Any
    settings: StoreSettings
    teacher: torch.nn.Module
    kinds: list[str]
    say: Callable[..., None]


def _decide(st: _Stage) -> dict[str, Any]:
    """Rank 0's decision for a stage: ``{"use": bool, "key": str|None, "why": str, ...}`` (building the
    entry when it is used and missing)."""
    settings, plan, ds, acc = st.settings, st.plan, st.ds, st.parts.accelerator
    dtype = STORE_DTYPES[settings.dtype]
    lengths = row_lengths(ds)
    labels = getattr(st.teacher.config, "num_labels", 1)
    size = estimate_bytes(st.teacher, st.kinds, int(lengths.sum()), len(lengths), dtype, labels)
    if size > settings.max_gb * 2**30:  # before anything is hashed
        return {"use": False, "key": None, "why": f"it would take {_size(size)}, more than teacher.store_max_gb="
                f"{settings.max_gb}; running the teacher live (raise the cap to store it)"}
    ids = row_ids(ds)
    key = store_key(settings, st.teacher, st.parts.collator, ids, lengths, st.kinds, acc.precision.name,
                    plan.cfg["data"])
    root = Path(settings.cache_dir).expanduser() / KIND
    entry = root / key

    def build(tmp: Path) -> None:
        free = free_bytes(tmp)
        if free < size:
            raise _NoRoom(free)
        st.say(wrapped(f"[kdrun] teacher store: building {'+'.join(st.kinds)} of {len(lengths)} rows "
                       f"({int(lengths.sum())} tokens, {settings.dtype}): {_size(size)} in {entry}"))
        full = False
        try:
            build_store(tmp, st.parts.teacher, ds, lengths, st.parts.collator, plan.teacher_needs,
                        st.parts.train_cfg.eval_batch_size, acc, dtype, ids)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            full = True
        if full:  # raised outside the handler: the message is the whole story
            raise UserError(f"no space left on the device of cache_dir={settings.cache_dir} while building the "
                            f"teacher store ({_size(size)}) for stage '{plan.name}': free space there, "
                            "point cache_dir elsewhere or set teacher.store=off (nothing was published)")

    try:
        entry, cached = get_or_build(settings.cache_dir, KIND, key, build, checksums=False)
    except _NoRoom as e:
        return {"use": False, "key": None, "why": f"it needs {_size(size)} and {root} has {_size(e.free)} free; "
                "running the teacher live (free space or point cache_dir elsewhere)"}
    except StoreOverflow as e:
        return {"use": False, "key": None, "why": f"the teacher's {e.name} reaches {e.peak:.3g}, beyond fp16's range "
                f"(±{FP16_MAX:.0f}); running the teacher live (teacher.store_dtype=bf16 or fp32 stores it)"}
    where = "the cache" if cached else "the entry just built"
    if settings.mode != "auto":
        return {"use": True, "key": key, "why": f"teacher.store=on; from {where}"}
    verdict = _auto_verdict(entry)
    if verdict is not None:  # measured by the entry's first auto run: every later run decides the same
        why = re.sub(r"; from the (cache|entry just built)$", "", verdict["why"])  # as older entries wrote it
        return {"key": key, **verdict, "why": f"{why} (measured when the entry was first used; its {AUTO_VERDICT} "
                f"holds the figures)" + (f"; from {where}" if verdict["use"] else "")}
    out = _measure_auto(st, entry, key, cached)
    try:  # a read-only shared cache keeps no verdict: each run measures again
        write_json_atomic(entry / AUTO_VERDICT, {k: v for k, v in out.items() if k != "key"})
    except OSError:
        pass
    return {**out, "why": out["why"] + (f"; from {where}" if out["use"] else "")}


LINE_WIDTH = 160


def wrapped(text: str) -> str:
    """A printed store line as lines of at most ``LINE_WIDTH`` characters, broken after its clauses
    (``; ``, `` — ``, and a comparison's `` vs ``) where it can, continued under ``[kdrun]``."""
    import textwrap

    indent = "[kdrun]   "
    lines = [""]
    for clause in re.split(r"(?<=; )|(?<= — )|(?<= vs )", text):
        if lines[-1] and len(lines[-1]) + len(clause) > LINE_WIDTH:
            lines.append(indent)
        lines[-1] += clause
    out = [piece for line in lines for piece in textwrap.wrap(line.rstrip(), LINE_WIDTH, subsequent_indent=indent,
                                                            break_long_words=False, break_on_hyphens=False)]
    return "\n".join(out)


AUTO_VERDICT = "auto_decision.json"  # beside the entry's files, outside its manifest


def _auto_verdict(entry: Path) -> dict[str, Any] | None:
    try:
        verdict = json.loads((entry / AUTO_VERDICT).read_text())
        return verdict if isinstance(verdict.get("use"), bool) and isinstance(verdict.get("why"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _measure_auto(st: _Stage, entry: Path, key: str, cached: bool) -> dict[str, Any]:
    """``teacher.store=auto``'s measurement: the reader's full path against the teacher's forward."""
    plan, ds, acc = st.plan, st.ds, st.parts.accelerator
    reader = StoreReader(entry)
    batches = sample_rows(reader, int(plan.cfg["batch_size"]))
    read = read_seconds_per_row(reader, batches, acc.device)
    if cached:
        forward, how = forward_seconds_per_row(st.parts, ds, batches, plan.teacher_needs), "measured now"
    else:
        forward, how = float(reader.meta["forward_seconds_per_row"]), "measured while building"
    figures = (f"reading {read * 1e3:.3f} ms/row (gather from a cold page cache, copy to {acc.device.type}, fp32) "
               f"vs the teacher's forward {forward * 1e3:.3f} ms/row ({how})")
    out = {"read_ms_per_row": read * 1e3, "forward_ms_per_row": forward * 1e3}
    if read >= forward:
        return {"use": False, "key": key, "why": f"teacher.store=auto: {figures}; running the teacher live "
                "(teacher.store=on forces the store)", **out}
    return {"use": True, "key": key, "why": f"teacher.store=auto: {figures}", **out}


class _NoRoom(Exception):
    def __init__(self, free: int):
        super().__init__(free)
        self.free = free


def _shared_decision(st: _Stage) -> dict[str, Any]:
    """Rank 0 decides (and builds); the other ranks read its decision from the shared cache_dir.

    Rank 0 holds ``.decisions/<token>.lock`` from before the token is broadcast until its decision
    is written, so a rank that finds the lock free and no decision knows rank 0 is gone, or that it
    does not see the same cache_dir. No collective waits on the build (it may outlast the process
    group's timeout).
    """
    import torch.distributed as dist
    from filelock import FileLock

    acc, settings = st.parts.accelerator, st.settings
    folder = Path(settings.cache_dir).expanduser() / KIND / DECISIONS
    folder.mkdir(parents=True, exist_ok=True)
    token, lock = [None], None
    if acc.is_main_process:
        token[0] = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{st.plan.index}-{os.urandom(4).hex()}"
        lock = FileLock(str(folder / f"{token[0]}.lock"))
        lock.acquire()
    dist.broadcast_object_list(token, src=0)
    path = folder / f"{token[0]}.json"
    if acc.is_main_process:
        try:
            for old in folder.glob("*"):  # decisions of runs long over
                if time.time() - old.stat().st_mtime > 7 * 86400:
                    old.unlink(missing_ok=True)
            decision = _decide(st)
            write_json_atomic(path, decision)
        finally:
            lock.release()
            Path(lock.lock_file).unlink(missing_ok=True)
        return decision
    wait_for_file(path, folder / f"{token[0]}.lock", settings.cache_dir,
                  f"rank 0's teacher-store decision for stage '{st.plan.name}'", settings.wait_timeout_s,
                  stop=_stop_check(st.parts))
    return json.loads(path.read_text())


def _stop_check(parts: Any) -> Callable[[], int | None]:
    guard = getattr(parts, "guard", None)
    return lambda: guard.received if guard is not None else None


def open_stage_store(parts: Any, plan: Any, ds: Any, strategy: Any = None, state: Any = None) -> StoreReader | None:
    """The stage's store (built now if missing), or None when the teacher runs live (said in one line).

    The decision is rank 0's, taken once per stage and kept in ``state.store_decisions`` (the
    checkpoint), so a resumed run reads as it did."""
    settings: StoreSettings | None = getattr(parts, "store", None)
    if settings is None or not plan.uses_teacher or parts.teacher is None:
        return None
    acc = parts.accelerator
    teacher = acc.unwrap_model(parts.teacher)
    teacher = getattr(teacher, "_orig_mod", teacher)
    say = print if acc.is_main_process else (lambda *a, **k: None)
    reason = _unstorable(plan, teacher, strategy)
    if reason is None:  # live or stored, the stage's teacher outputs are the store's (live_as_stored)
        settings.served[plan.index] = STORE_DTYPES[settings.dtype]
    if settings.mode == "off":
        return None
    if reason:
        say(f"[kdrun] teacher store not used for stage '{plan.name}': {reason}")
        return None
    st = _Stage(parts, plan, ds, settings, teacher, stored_kinds(plan.teacher_needs), say)
    decisions = getattr(state, "store_decisions", None)
    decision = (decisions or {}).get(f"{plan.index}:{plan.name}")
    if decision is not None:
        who = "" if acc.is_main_process else f"rank {acc.process_index}: "
        print(wrapped(f"[kdrun] {who}teacher store for stage '{plan.name}': the checkpoint's decision "
                      f"({'store ' + decision['key'] if decision['use'] else 'live'}: {decision['why']})"), flush=True)
        if not decision["use"]:
            return None
        return _open_decided(st, decision["key"])
    decision = _shared_decision(st) if parts.world_size > 1 else _decide(st)
    if decisions is not None:
        decisions[f"{plan.index}:{plan.name}"] = decision
    if acc.is_main_process:
        if decision["use"]:
            say(wrapped(f"[kdrun] teacher store: stage '{plan.name}' reads the teacher's {'+'.join(st.kinds)} "
                        f"({decision['key']}); the teacher does not run — {decision['why']}"))
        else:
            say(wrapped(f"[kdrun] teacher store not used for stage '{plan.name}': {decision['why']}"))
    else:
        print(f"[kdrun] rank {acc.process_index}: teacher store for stage '{plan.name}': "
              f"{'store ' + decision['key'] if decision['use'] else 'live'} (rank 0's decision)", flush=True)
    return _open_decided(st, decision["key"]) if decision["use"] else None


def _unstorable(plan: Any, teacher: torch.nn.Module, strategy: Any) -> str | None:
    """Why the stage's teacher outputs cannot be stored, or None."""
    reason = why_not_storable(plan.teacher_needs, teacher, strategy)
    if reason is None and plan.teacher_reads_padding:  # the store keeps real tokens only
        reason = "a term reads the teacher's outputs at padded positions (TinyBERT's official reductions)"
    return reason


def live_as_stored(parts: Any, plan: Any, feats: Features) -> Features:
    """The live teacher's features of a stage whose outputs the store can keep, as its store serves
    them (zero past each row's length, rounded to ``teacher.store_dtype``, fp32), so that
    ``teacher.store`` (auto, on, off) changes the speed only; other stages' features unchanged."""
    settings = getattr(parts, "store", None)
    return as_stored(feats, settings.served.get(plan.index) if settings is not None else None)


def logits_as_stored(parts: Any, plan: Any, logits: torch.Tensor) -> torch.Tensor:
    """A logits-only stage's in-run table of the live teacher's logits (N, C), as its store serves them."""
    settings = getattr(parts, "store", None)
    dtype = settings.served.get(plan.index) if settings is not None else None
    return logits if dtype is None else served(logits, dtype)


def _open_decided(st: _Stage, key: str) -> StoreReader:
    """Open the entry a decision names: rank 0 gets (or rebuilds) it, the others wait for it."""
    settings, acc = st.settings, st.parts.accelerator
    for _ in range(3):  # an entry evicted between the lookup and the lock is looked up again
        if st.parts.world_size > 1 and not acc.is_main_process:
            entry = wait_for_entry(settings.cache_dir, KIND, key, timeout_s=settings.wait_timeout_s,
                                   stop=_stop_check(st.parts))
        else:
            def build(tmp: Path) -> None:
                st.say(f"[kdrun] teacher store: rebuilding {key} for stage '{st.plan.name}' (it left the cache)")
                build_store(tmp, st.parts.teacher, st.ds, row_lengths(st.ds), st.parts.collator,
                            st.plan.teacher_needs, st.parts.train_cfg.eval_batch_size, acc,
                            STORE_DTYPES[settings.dtype])

            entry, _ = get_or_build(settings.cache_dir, KIND, key, build, checksums=False)
        reader = StoreReader(entry)
        if reader.hold():
            return reader
    raise UserError(f"the teacher store entry {key} in cache_dir={settings.cache_dir} keeps disappearing "
                    "(is a kdrun-cache gc with a tiny --max-size running?)")


__all__ = [
    "KIND", "STORE_MODES", "STORE_DTYPES", "STORABLE", "FORMAT_VERSION", "DECISIONS", "FP16_MAX", "RowMap",
    "StoreSettings", "StoreOverflow", "StoreReader", "StoreCollator", "weights_hash", "row_lengths", "row_ids",
    "stored_kinds", "why_not_storable", "estimate_bytes", "free_bytes", "teacher_config", "collator_settings",
    "code_versions", "store_key", "build_store", "sample_rows", "read_seconds_per_row", "forward_seconds_per_row",
    "open_stage_store", "live_as_stored", "logits_as_stored", "as_stored", "served", "build_collator",
    "_Writer", "_sync",
]
