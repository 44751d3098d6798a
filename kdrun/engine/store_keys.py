"""The teacher-output store's identity and checks: the entry's key (kdrun/engine/teacher_store.py says
what goes into it), the rows' ids and lengths, which outputs a stage's needs keep, why a stage
cannot be served, and the size estimate checked before anything is built."""

from __future__ import annotations

import copy
import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdrun.errors import UserError
from kdrun.runtime.cache import content_hash

KIND = "teacher_outputs"
STORE_MODES = ("auto", "on", "off")
STORE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
STORABLE = frozenset({"logits", "hidden_states", "qkv", "attention_scores", "spans"})
FORMAT_VERSION = 2
DECISIONS = ".decisions"  # rank 0's per-stage decisions for the other ranks (small JSON files)
FP16_MAX = 65504.0


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
    # per stage index: the dtype a store-able stage's live teacher features are rounded to, as its
    # store serves them (teacher_store.live_as_stored); set when the stage opens, whatever the mode
    served: dict[int, torch.dtype] = field(default_factory=dict)
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


def build_collator(collator: Any) -> Any:
    """The collator the build pads its batches with: the run's, with widths never rounded up to
    ``train.pad_to_multiple_of`` (``multiple``, and the ``limit`` that caps the rounding). Stored
    rows are unpadded, so an entry serves every multiple, and its outputs do not depend on the
    run's: the key leaves the multiple out."""
    if not isinstance(getattr(collator, "multiple", None), int) or not collator.multiple:
        return collator
    plain = copy.copy(collator)
    plain.multiple, plain.limit = 0, None
    return plain


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
                         "collator": collator_settings(build_collator(collator)), "data": data,
                         "versions": code_versions(), "kinds": kinds, "dtype": settings.dtype,
                         "precision": precision, **given})
