"""Reading a teacher-output store entry: rows gathered by ``idx`` and padded to the batch (inside the
training loader's collation), and the timings ``teacher.store=auto`` compares."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdrun.engine.store_build import _sync
from kdrun.engine.store_keys import RowMap, row_ids
from kdrun.models.features import AttentionInputs, Features, extract_features
from kdrun.runtime.cache import COMPLETE_MARKER


class StoreReader:
    """Gathers a batch's rows from an entry (memory-mapped) and pads them to the batch's width.

    Used inside the training loader's collation (:class:`StoreCollator`), so the reads happen on
    the host with the rest of a batch's assembly (in loader workers when there are any). Pickles
    without its arrays: each process maps the files itself. The opening process holds a shared
    lock on the entry's manifest while the reader lives (``kdrun-cache gc`` skips entries in use).
    """

    def __init__(self, entry: Path, hold: bool = False):
        self.entry = Path(entry)
        self.meta = json.loads((self.entry / "meta.json").read_text())
        self._arrays: dict[str, np.ndarray] | None = None
        self._rows: RowMap | None = None
        self._hold: int | None = None
        if hold:
            self.hold()

    def __getstate__(self) -> dict[str, Any]:
        return {"entry": self.entry, "meta": self.meta, "_arrays": None, "_rows": None, "_hold": None}

    def hold(self) -> bool:
        """Take a shared lock on the manifest; False when the entry was evicted meanwhile."""
        import fcntl

        fd = os.open(self.entry / COMPLETE_MARKER, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.fstat(fd).st_ino == os.stat(self.entry / COMPLETE_MARKER).st_ino
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return False
        self._hold = fd
        return True

    def __del__(self) -> None:
        if getattr(self, "_hold", None) is not None:
            os.close(self._hold)
            self._hold = None

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            names = ("offsets", *self.meta["arrays"])
            self._arrays = {n: np.load(self.entry / f"{n}.npy", mmap_mode="r") for n in names}
        return self._arrays

    @property
    def rows(self) -> RowMap:
        if self._rows is None:
            ids_file = self.entry / "ids.npy"
            n = len(self.arrays["offsets"]) - 1
            self._rows = RowMap(np.load(ids_file) if ids_file.exists() else np.arange(n))
        return self._rows

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x))
        return t.view(torch.bfloat16) if self.meta["dtype"] == "bfloat16" else t

    def gather(self, idx: np.ndarray, width: int) -> dict[str, torch.Tensor]:
        """``{"teacher/<name>": tensor}`` for the rows named ``idx``: per-token arrays as (B, width, w),
        zero past each row's length (right padding); per-example arrays as (B, w)."""
        offsets = self.arrays["offsets"]
        pos = self.rows.positions(idx)
        starts, lengths = offsets[pos], offsets[pos + 1] - offsets[pos]
        valid = np.arange(width)[None, :] < lengths[:, None]
        flat = (starts[:, None] + np.arange(width)[None, :])[valid]
        mask = torch.from_numpy(valid)
        out = {}
        for name, info in self.meta["arrays"].items():
            arr = self.arrays[name]
            if not info["per_token"]:
                out[f"teacher/{name}"] = self._tensor(arr[pos])
                continue
            rows = self._tensor(arr[flat])
            full = rows.new_zeros((len(pos), width, info["width"]))
            full[mask] = rows
            out[f"teacher/{name}"] = full
        return out

    def features(self, batch: dict[str, Any], needs: frozenset[str]) -> Features:
        """The teacher's features for a batch whose ``teacher/*`` tensors are on the device (fp32)."""
        get = lambda name: batch[f"teacher/{name}"].float()  # noqa: E731
        L = self.meta["num_layers"]
        hidden = tuple(get(f"hidden.{i}") for i in range(L + 1)) if "hidden_states" in needs else None
        extra = {}
        if needs & {"qkv", "attention_scores"}:
            q, k, v = ([get(f"{w}.{i}") for i in range(1, L + 1)] for w in ("q", "k", "v"))
            extra["attention_inputs"] = AttentionInputs(q, k, v, self.meta["heads"], self.meta["scaling"])
        logits = get("logits") if "teacher/logits" in batch else None
        return Features(logits=logits, attention_mask=batch["attention_mask"], hidden_states=hidden,
                        spans=batch.get("spans") if "spans" in needs else None, extra=extra)


def served(x: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` as a store of ``dtype`` serves it, in fp32: a per-token output (B, n, w) zero past each
    row's length (``valid``: (B, n) bool), every value rounded to ``dtype`` as the build writes it.
    fp16 keeps what lies beyond its range as it is: the store refuses such outputs and the stage
    runs live, so every mode gives the same numbers."""
    y = x.to(dtype).float()
    if dtype == torch.float16:
        y = torch.where(torch.isinf(y), x.float(), y)
    return y * valid[..., None] if x.dim() == 3 and valid is not None else y  # masks multiply


def as_stored(feats: Features, dtype: torch.dtype | None) -> Features:
    """The live teacher's features as a store of ``dtype`` gives them (:meth:`StoreReader.features`
    on the same values): the live and the stored paths then differ in speed only. None: unchanged."""
    if dtype is None:
        return feats
    valid = feats.attention_mask.bool()
    keep = lambda x: served(x, dtype, valid)  # noqa: E731
    extra = dict(feats.extra)
    rec = extra.get("attention_inputs")
    if rec is not None:
        layers = range(1, rec.num_layers + 1)
        q, k, v = ([keep(rec.projection(w, i)) for i in layers] for w in ("q", "k", "v"))
        extra["attention_inputs"] = AttentionInputs(q, k, v, rec.heads, rec.scaling)
    hidden = tuple(map(keep, feats.hidden_states)) if feats.hidden_states is not None else None
    logits = keep(feats.logits) if feats.logits is not None else None
    return Features(logits=logits, attention_mask=feats.attention_mask, hidden_states=hidden,
                    spans=feats.spans, extra=extra)


class StoreCollator:
    """The training collator, plus the batch's stored teacher outputs (gathered by ``idx``)."""

    def __init__(self, base: Any, reader: StoreReader):
        self.base, self.reader = base, reader

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base(rows)
        mask = batch["attention_mask"]
        if mask.shape[1] and bool((mask[:, 0] == 0).any()):
            raise RuntimeError("the teacher store reads right-padded batches; this collator pads on the left")
        batch.update(self.reader.gather(batch["idx"].numpy(), mask.shape[1]))
        return batch


def _drop_page_cache(entry: Path) -> bool:
    """Ask the kernel to drop an entry's clean pages (a cold read, as a run's first epoch sees it)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in entry.glob("*.npy"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def sample_rows(reader: StoreReader, batch_size: int) -> list[np.ndarray]:
    """A few batches of random rows (their idx), the same for both sides of :func:`read_is_faster`."""
    ids = np.load(reader.entry / "ids.npy") if (reader.entry / "ids.npy").exists() else np.arange(reader.meta["rows"])
    take = np.random.default_rng(0).permutation(len(ids))[: min(len(ids), 4 * batch_size)]
    return [ids[np.sort(c)] for c in np.array_split(take, max(1, len(take) // batch_size))]


def read_seconds_per_row(reader: StoreReader, batches: list[np.ndarray], device: torch.device) -> float:
    """The reader's whole path per row: gather (cold page cache where the kernel allows), pin (CUDA),
    copy to ``device``, cast to fp32."""
    offsets = reader.arrays["offsets"]
    _drop_page_cache(reader.entry)
    t0, rows = time.perf_counter(), 0
    for idx in batches:
        pos = reader.rows.positions(idx)
        width = int((offsets[pos + 1] - offsets[pos]).max())
        out = reader.gather(idx, width)
        for t in out.values():
            if device.type == "cuda":
                t = t.pin_memory()
            t.to(device, non_blocking=device.type == "cuda").float()
        rows += len(idx)
    _sync(device)
    return (time.perf_counter() - t0) / max(1, rows)


def forward_seconds_per_row(parts: Any, ds: Any, batches: list[np.ndarray], needs: frozenset[str]) -> float:
    """The live teacher's forward time per row on the same rows (as a training step runs it)."""
    ids = row_ids(ds)
    rows = RowMap(ids)
    acc, total, n = parts.accelerator, 0.0, 0
    with torch.no_grad():
        for idx in batches:
            batch = parts.collator([ds[int(i)] for i in rows.positions(idx)])
            batch = {k: v.to(acc.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            _sync(acc.device)
            t = time.perf_counter()
            with acc.autocast():
                extract_features(parts.teacher, batch, needs)
            _sync(acc.device)
            total, n = total + time.perf_counter() - t, n + len(idx)
    return total / max(1, n)
