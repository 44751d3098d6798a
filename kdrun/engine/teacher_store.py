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
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kdrun.errors import UserError
from kdrun.models.features import AttentionInputs, Features, capture_of, extract_features
from kdrun.runtime.cache import (
    COMPLETE_MARKER,
    content_hash,
    get_or_build,
    wait_for_entry,
    wait_for_file,
    write_json_atomic,
)
from kdrun.runtime.syncs import host_section

KIND = "teacher_outputs"
STORE_MODES = ("auto", "on", "off")
STORE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
STORABLE = frozenset({"logits", "hidden_states", "qkv", "attention_scores", "spans"})
FORMAT_VERSION = 2
DECISIONS = ".decisions"  # rank 0's per-stage decisions for the other ranks (small JSON files)
FP16_MAX = 65504.0


class StoreOverflow(Exception):
    """A teacher output does not fit the store's fp16."""

    def __init__(self, name: str, peak: float):
        super().__init__(name, peak)
        self.name, self.peak = name, peak


def weights_hash(model: torch.nn.Module) -> str:
    """Content hash of a model's parameters and buffers (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _arrow_column(ds: Any, name: str) -> Any:
    """``ds[name]`` as a pyarrow array (selections applied) without building Python lists, or None."""
    try:
        return ds.with_format("arrow")[name]
    except Exception:  # not a datasets.Dataset: fall back to the rows
        return None


def row_lengths(ds: Any) -> np.ndarray:
    """The rows' token counts (int64, row order), read from the Arrow offsets when the data are Arrow."""
    col = _arrow_column(ds, "input_ids")
    if col is not None:
        import pyarrow.compute as pc

        return np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype=np.int64)
    return np.fromiter(map(len, ds["input_ids"]), dtype=np.int64, count=len(ds))


def row_ids(ds: Any) -> np.ndarray:
    """The rows' ``idx`` (int64, row order): what a batch names its rows by."""
    if "idx" not in ds.column_names:
        raise UserError("the teacher store needs an 'idx' column in the training data (a unique id per row); "
                        "the task kind's data has none: add one, or set teacher.store=off")
    col = _arrow_column(ds, "idx")
    return np.asarray(col.to_numpy() if col is not None else ds["idx"], dtype=np.int64).reshape(-1)


class RowMap:
    """``idx`` -> row position in an entry (identity when the ids are 0..N-1)."""

    def __init__(self, ids: np.ndarray):
        self.n = len(ids)
        self.identity = bool(np.array_equal(ids, np.arange(self.n)))
        if not self.identity:
            self.order = np.argsort(ids, kind="stable")
            self.sorted = ids[self.order]
            dup = np.flatnonzero(self.sorted[1:] == self.sorted[:-1])
            if len(dup):
                raise UserError(f"the training data's idx column repeats {int(self.sorted[dup[0]])}; the teacher "
                                "store finds rows by idx, which must be unique (fix the task kind's idx, or "
                                "teacher.store=off)")

    def positions(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if self.identity:
            if len(idx) and (idx.min() < 0 or idx.max() >= self.n):
                raise KeyError(f"row idx {int(idx.max())} is not in the teacher store's {self.n} rows")
            return idx
        pos = np.minimum(np.searchsorted(self.sorted, idx), self.n - 1)
        found = self.sorted[pos] == idx
        if not found.all():
            raise KeyError(f"row idx {int(idx[~found][0])} is not in the teacher store's {self.n} rows")
        return self.order[pos]


def stored_kinds(needs: frozenset[str]) -> list[str]:
    """The outputs an entry keeps for a stage's teacher needs."""
    kinds = ["logits"] if "logits" in needs else []
    if "hidden_states" in needs:
        kinds.append("hidden_states")
    if needs & {"qkv", "attention_scores"}:
        kinds.append("qkv")
    return kinds


def why_not_storable(needs: frozenset[str], teacher: torch.nn.Module, strategy: Any = None) -> str | None:
    """Why a stage's teacher outputs cannot come from the store, or None when they can (``strategy``:
    the stage's strategy, kdrun/engine/strategies.py, or None)."""
    if strategy is not None and strategy.teacher_live:
        return strategy.teacher_live
    extra = sorted(needs - STORABLE)
    if extra:
        return f"the stage reads {', '.join(extra)}, which the store does not keep"
    if needs & {"qkv", "attention_scores"}:
        from kdrun.models.adaptors import Adaptor, get_adaptor

        if type(get_adaptor(teacher)).score_bias is not Adaptor.score_bias:
            return "the teacher's family adds a position bias to its attention scores"
    return None


# ------------------------------------------------------------------------------------------ build

def _outputs(feats: Features, kinds: list[str]) -> dict[str, torch.Tensor]:
    """The named arrays of one batch: per-token (B, n, w) or per-example (B, w) (class logits)."""
    out: dict[str, torch.Tensor] = {}
    if "logits" in kinds and feats.logits is not None:
        out["logits"] = feats.logits
    if "hidden_states" in kinds:
        out.update({f"hidden.{i}": h for i, h in enumerate(feats.hidden_states)})
    if "qkv" in kinds:
        rec = feats.qkv()
        for layer in range(1, rec.num_layers + 1):
            out.update({f"{w}.{layer}": rec.projection(w, layer) for w in ("q", "k", "v")})
    return out


def _to_numpy(x: torch.Tensor, dtype: torch.dtype, name: str = "") -> np.ndarray:
    y = x.detach().to("cpu", dtype)
    if dtype == torch.float16 and not bool(torch.isfinite(y).all()):
        raise StoreOverflow(name, float(x.detach().float().abs().nan_to_num(posinf=float("inf")).max()))
    return (y.view(torch.int16) if dtype == torch.bfloat16 else y).numpy()


def _allocate(path: Path) -> None:
    """Give a (sparse) file all its blocks now, so a full disk fails here with ENOSPC, not later as a
    SIGBUS on a memory-mapped write; file systems without fallocate keep the sparse file."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise
    finally:
        os.close(fd)


class _Writer:
    """Fills memory-mapped arrays in a staging directory, one teacher batch at a time."""

    def __init__(self, tmp: Path, offsets: np.ndarray, rows: RowMap, dtype: torch.dtype):
        self.tmp, self.offsets, self.rows, self.dtype = tmp, offsets, rows, dtype
        self.arrays: dict[str, np.ndarray] = {}
        self.per_token: dict[str, bool] = {}

    def _array(self, name: str, per_token: bool, width: int) -> np.ndarray:
        if name not in self.arrays:
            rows = int(self.offsets[-1]) if per_token else len(self.offsets) - 1
            np_dtype = np.int16 if self.dtype == torch.bfloat16 else torch.empty(0, dtype=self.dtype).numpy().dtype
            path = self.tmp / f"{name}.npy"
            arr = np.lib.format.open_memmap(path, mode="w+", dtype=np_dtype, shape=(rows, width))
            _allocate(path)
            self.arrays[name], self.per_token[name] = arr, per_token
        return self.arrays[name]

    def add(self, idx: np.ndarray, mask: torch.Tensor, outputs: dict[str, torch.Tensor]) -> None:
        """Write a batch's outputs for the rows named ``idx``. The rows must be right-padded (a row's
        tokens first): the per-token outputs are taken at ``mask``'s ones, in order."""
        valid = mask.bool().cpu()
        lengths = valid.sum(1).numpy()
        pos = self.rows.positions(idx)
        want = self.offsets[pos + 1] - self.offsets[pos]
        right = torch.arange(valid.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
        if not np.array_equal(lengths, want) or not torch.equal(right, valid):
            raise RuntimeError("the teacher store reads right-padded batches whose masks count each row's tokens; "
                               "this collator pads otherwise")
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i] + n) for i, n in zip(pos, lengths)])
        for name, x in outputs.items():
            per_token = x.dim() == 3
            arr = self._array(name, per_token, x.shape[-1])
            arr[rows if per_token else pos] = _to_numpy(x[valid] if per_token else x, self.dtype, name)

    def close(self) -> dict[str, Any]:
        for arr in self.arrays.values():
            arr.flush()
        return {n: {"per_token": self.per_token[n], "width": int(a.shape[1])} for n, a in self.arrays.items()}


def estimate_bytes(teacher: torch.nn.Module, kinds: list[str], tokens: int, rows: int, dtype: torch.dtype,
                   num_labels: int) -> int:
    """The entry's size before it is built (per token: hidden states of every layer, Q/K/V of every
    transformer layer; per example or token: the logits)."""
    cfg = getattr(teacher, "config", None)
    layers, width = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    per_token = (layers + 1) * width * ("hidden_states" in kinds) + 3 * layers * width * ("qkv" in kinds)
    item = torch.empty(0, dtype=dtype).element_size()
    return item * (tokens * per_token + rows * max(1, num_labels) * 2) + 8 * (2 * rows + 1)


def free_bytes(path: Path) -> int:
    """Free bytes on ``path``'s file system."""
    return shutil.disk_usage(path).free


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_store(tmp: Path, teacher: torch.nn.Module, ds: Any, lengths: np.ndarray, collator: Any,
                needs: frozenset[str], batch_size: int, accelerator: Any, dtype: torch.dtype,
                ids: np.ndarray | None = None) -> None:
    """One pass of the frozen teacher over ``ds`` (``lengths``: its rows' token counts, ``ids``: their
    ``idx``, row order), its outputs written unpadded to ``tmp``. ``meta.json`` records the teacher's
    own forward time per row (synchronised, without the host copies and writes)."""
    from tqdm.auto import tqdm

    from kdrun.tasks.data.pipeline import make_loader

    ids = row_ids(ds) if ids is None else ids
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "ids.npy", ids)
    writer, kinds = _Writer(tmp, offsets, RowMap(ids), dtype), stored_kinds(needs)
    loader, _ = make_loader(ds, batch_size, collator, seed=0, train=False)
    teacher_needs = frozenset({*kinds, "logits"})
    device = accelerator.device
    t0, forward, batches = time.perf_counter(), 0.0, 0
    with host_section(), torch.inference_mode():
        for batch in tqdm(loader, desc="teacher store", leave=False, mininterval=2.0, dynamic_ncols=True):
            idx = batch["idx"].numpy()
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            _sync(device)
            t = time.perf_counter()
            with accelerator.autocast():
                feats = extract_features(teacher, batch, teacher_needs)
            outputs = _outputs(feats, kinds)
            _sync(device)
            forward += time.perf_counter() - t
            writer.add(idx, batch["attention_mask"], outputs)
            batches += 1
    arrays = writer.close()
    heads, scaling = capture_of(teacher).meta if "qkv" in kinds else (None, None)
    meta = {"version": FORMAT_VERSION, "kinds": kinds, "arrays": arrays, "rows": len(lengths),
            "tokens": int(offsets[-1]), "dtype": str(dtype).removeprefix("torch."), "heads": heads,
            "scaling": scaling, "num_layers": int(teacher.config.num_hidden_layers),
            "forward_seconds_per_row": forward / max(1, len(lengths)),
            "build_seconds": time.perf_counter() - t0, "batches": batches}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------------------------- read

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


# ------------------------------------------------------------------------------------- the stage

@dataclass
class StoreSettings:
    """What the trainer needs to open a stage's store: ``teacher.store``/``store_dtype``/
    ``store_max_gb``, the cache root and the parts of the key the trainer cannot see."""

    mode: str = "off"
    dtype: str = "fp16"
    max_gb: float = 8.0
    cache_dir: str | None = None
    # the data's content key, tokenizer hash, max length, teacher dtype, task kind, augmentation key
    key: dict[str, Any] | None = None
    # how long a rank waits for rank 0's decision (seconds; cache_wait_timeout_s)
    wait_timeout_s: float = 12 * 3600.0
    _weights: str | None = None

    def weights(self, teacher: torch.nn.Module) -> str:
        if self._weights is None:
            self._weights = weights_hash(teacher)
        return self._weights


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def teacher_config(teacher: torch.nn.Module) -> dict[str, Any]:
    """The teacher's full config (every field, defaults included) without where it was loaded from."""
    cfg = getattr(teacher, "config", None)
    if cfg is None:
        return {}
    d = cfg.to_dict()
    for k in ("_name_or_path", "transformers_version"):  # the path is not content; versions are keyed apart
        d.pop(k, None)
    return d


def collator_settings(collator: Any) -> dict[str, Any]:
    """The collator's class and plain settings (a corpus's masking seed and probability, pad id, ...)."""
    plain = (bool, int, float, str, type(None))
    return {"class": f"{type(collator).__module__}.{type(collator).__qualname__}",
            **{k: v for k, v in sorted(vars(collator).items()) if isinstance(v, plain)}}


def code_versions() -> dict[str, str]:
    """The libraries and kdrun code that shape stored outputs: torch, transformers, numpy, and a hash
    of kdrun's feature capture (features, adaptors)."""
    import transformers

    from kdrun.models import adaptors, features

    h = hashlib.sha256()
    for mod in (features, adaptors):
        h.update(Path(mod.__file__).read_bytes())
    return {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
            "capture": h.hexdigest()[:16]}


def _array_hash(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def store_key(settings: StoreSettings, teacher: torch.nn.Module, collator: Any, ids: np.ndarray,
              lengths: np.ndarray, kinds: list[str], precision: str, data: str = "original") -> str:
    """The entry's key (see the module's docstring): no token is read."""
    given = {k: v for k, v in (settings.key or {}).items() if data == "augmented" or k != "augmentation"}
    return content_hash({"version": FORMAT_VERSION, "teacher": settings.weights(teacher),
                         "teacher_config": teacher_config(teacher), "rows": _array_hash(ids, lengths),
                         "collator": collator_settings(collator), "data": data, "versions": code_versions(),
                         "kinds": kinds, "dtype": settings.dtype, "precision": precision, **given})


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
        st.say(f"[kdrun] teacher store: building {'+'.join(st.kinds)} of {len(lengths)} rows ({int(lengths.sum())} "
               f"tokens, {settings.dtype}): {_size(size)} in {entry}")
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
        return {"key": key, **verdict, "why": f"{verdict['why']} (measured when the entry was first used; "
                f"its {AUTO_VERDICT} holds the figures)"}
    out = _measure_auto(st, entry, key, cached, where)
    try:  # a read-only shared cache keeps no verdict: each run measures again
        write_json_atomic(entry / AUTO_VERDICT, {k: v for k, v in out.items() if k != "key"})
    except OSError:
        pass
    return out


AUTO_VERDICT = "auto_decision.json"  # beside the entry's files, outside its manifest


def _auto_verdict(entry: Path) -> dict[str, Any] | None:
    try:
        verdict = json.loads((entry / AUTO_VERDICT).read_text())
        return verdict if isinstance(verdict.get("use"), bool) and isinstance(verdict.get("why"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _measure_auto(st: _Stage, entry: Path, key: str, cached: bool, where: str) -> dict[str, Any]:
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
    return {"use": True, "key": key, "why": f"teacher.store=auto: {figures}; from {where}", **out}


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
    if settings is None or settings.mode == "off" or not plan.uses_teacher or parts.teacher is None:
        return None
    acc = parts.accelerator
    teacher = acc.unwrap_model(parts.teacher)
    teacher = getattr(teacher, "_orig_mod", teacher)
    say = print if acc.is_main_process else (lambda *a, **k: None)
    reason = why_not_storable(plan.teacher_needs, teacher, strategy)
    if reason is None and plan.teacher_reads_padding:  # the store keeps real tokens only
        reason = "a term reads the teacher's outputs at padded positions (TinyBERT's official reductions)"
    if reason:
        say(f"[kdrun] teacher store not used for stage '{plan.name}': {reason}")
        return None
    st = _Stage(parts, plan, ds, settings, teacher, stored_kinds(plan.teacher_needs), say)
    decisions = getattr(state, "store_decisions", None)
    decision = (decisions or {}).get(f"{plan.index}:{plan.name}")
    if decision is not None:
        who = "" if acc.is_main_process else f"rank {acc.process_index}: "
        print(f"[kdrun] {who}teacher store for stage '{plan.name}': the checkpoint's decision "
              f"({'store ' + decision['key'] if decision['use'] else 'live'}: {decision['why']})", flush=True)
        if not decision["use"]:
            return None
        return _open_decided(st, decision["key"])
    decision = _shared_decision(st) if parts.world_size > 1 else _decide(st)
    if decisions is not None:
        decisions[f"{plan.index}:{plan.name}"] = decision
    if acc.is_main_process:
        if decision["use"]:
            say(f"[kdrun] teacher store: stage '{plan.name}' reads the teacher's {'+'.join(st.kinds)} "
                f"({decision['key']}); the teacher does not run — {decision['why']}")
        else:
            say(f"[kdrun] teacher store not used for stage '{plan.name}': {decision['why']}")
    else:
        print(f"[kdrun] rank {acc.process_index}: teacher store for stage '{plan.name}': "
              f"{'store ' + decision['key'] if decision['use'] else 'live'} (rank 0's decision)", flush=True)
    return _open_decided(st, decision["key"]) if decision["use"] else None


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
