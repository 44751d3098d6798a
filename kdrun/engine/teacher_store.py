"""The teacher-output store: a frozen teacher's outputs on a training set, computed once and reused.

Every run of a sweep (seeds × objectives × learning rates × λs) that distils from the same frozen
teacher on the same tokenised data needs the same teacher outputs. With ``teacher.store=auto`` (the
default) a stage whose teacher features can be stored reads them from a cache entry (kind
``teacher_outputs``) instead of running the teacher; the first run builds the entry with one pass of
the teacher over the data, in row order.

The key is what determines the outputs: a content hash of the teacher's weights, its dtype, the
tokenised data's content (input ids, segment ids, the rows), the training precision, the store's
dtype and the features stored. A run that needs other features (another objective) builds its own
entry; nothing is reused across a changed teacher or tokenisation.

Layout of an entry: ``offsets.npy`` (N+1 token offsets; row i's tokens are ``[offsets[i],
offsets[i+1])``), one ``.npy`` array per stored output — per-token outputs unpadded, token-major
(hidden state ``hidden.<l>`` for l = 0..L, attention projections ``q.<l>``/``k.<l>``/``v.<l>`` for
l = 1..L, QA's start/end ``logits`` (T, 2)), per-example ``logits`` (N, C) — and ``meta.json``.
Arrays are written with ``numpy.lib.format.open_memmap`` into the staging directory and published
atomically behind the cache's manifest (kdrun/runtime/cache.py: checksums, damaged entries moved aside and
rebuilt); runs read them memory-mapped. bf16 is kept as its 16-bit pattern (numpy has no bf16).

Storable needs: ``logits``, ``hidden_states`` (every layer), ``qkv`` and ``attention_scores``
(served from the stored Q and K, like the live teacher's hooks), ``spans`` (read from the batch).
Not stored, the teacher runs live: post-softmax ``attentions``, masked-LM logits (corpus tasks mask
at random every epoch), families that add a relative-position bias to their scores (DeBERTa-v2),
and DynaBERT's adaptive stages.

Stored outputs equal the live teacher's to the rounding of the store's dtype; with
``teacher.store_dtype=fp32`` they differ from a live forward only by the last bits that a batch's
padding width changes in the teacher's kernels (the live teacher is not bit-stable across batchings
either): students trained either way agree to ~1e-6 (tests/test_teacher_store.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdrun.models.features import AttentionInputs, Features, capture_of, extract_features
from kdrun.runtime.cache import content_hash, get_or_build, wait_for_entry
from kdrun.runtime.syncs import host_section

KIND = "teacher_outputs"
STORE_MODES = ("auto", "on", "off")
STORE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
STORABLE = frozenset({"logits", "hidden_states", "qkv", "attention_scores", "spans"})
FORMAT_VERSION = 1


def weights_hash(model: torch.nn.Module) -> str:
    """Content hash of a model's parameters and buffers (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def data_hash(ds: Any) -> str:
    """Content hash of the tokenised rows the teacher reads (every model-input column)."""
    h = hashlib.sha256()
    h.update(f"{len(ds)}".encode())
    for col in ("input_ids", "token_type_ids", "attention_mask", "idx"):
        if col in ds.column_names:
            h.update(col.encode())
            h.update(json.dumps(list(ds[col])).encode())
    return h.hexdigest()[:16]


def stored_kinds(needs: frozenset[str]) -> list[str]:
    """The outputs an entry keeps for a stage's teacher needs."""
    kinds = ["logits"] if "logits" in needs else []
    if "hidden_states" in needs:
        kinds.append("hidden_states")
    if needs & {"qkv", "attention_scores"}:
        kinds.append("qkv")
    return kinds


def why_not_storable(needs: frozenset[str], teacher: torch.nn.Module, adaptive: bool) -> str | None:
    """Why a stage's teacher outputs cannot come from the store, or None when they can."""
    if adaptive:
        return "DynaBERT's adaptive stages run the teacher live"
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


def _to_numpy(x: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    x = x.detach().to("cpu", dtype)
    return (x.view(torch.int16) if dtype == torch.bfloat16 else x).numpy()


class _Writer:
    """Fills memory-mapped arrays in a staging directory, one teacher batch at a time."""

    def __init__(self, tmp: Path, offsets: np.ndarray, dtype: torch.dtype):
        self.tmp, self.offsets, self.dtype = tmp, offsets, dtype
        self.arrays: dict[str, np.ndarray] = {}
        self.per_token: dict[str, bool] = {}

    def _array(self, name: str, per_token: bool, width: int) -> np.ndarray:
        if name not in self.arrays:
            rows = int(self.offsets[-1]) if per_token else len(self.offsets) - 1
            np_dtype = np.int16 if self.dtype == torch.bfloat16 else torch.empty(0, dtype=self.dtype).numpy().dtype
            self.arrays[name] = np.lib.format.open_memmap(self.tmp / f"{name}.npy", mode="w+", dtype=np_dtype,
                                                          shape=(rows, width))
            self.per_token[name] = per_token
        return self.arrays[name]

    def add(self, idx: np.ndarray, mask: torch.Tensor, outputs: dict[str, torch.Tensor]) -> None:
        valid = mask.bool().cpu()
        lengths = valid.sum(1).numpy()
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i] + n) for i, n in zip(idx, lengths)])
        for name, x in outputs.items():
            per_token = x.dim() == 3
            arr = self._array(name, per_token, x.shape[-1])
            arr[rows if per_token else idx] = _to_numpy(x[valid] if per_token else x, self.dtype)

    def close(self) -> dict[str, Any]:
        for arr in self.arrays.values():
            arr.flush()
        return {n: {"per_token": self.per_token[n], "width": int(a.shape[1])} for n, a in self.arrays.items()}


def row_lengths(ds: Any) -> np.ndarray:
    return np.fromiter(map(len, ds["input_ids"]), dtype=np.int64, count=len(ds))


def estimate_bytes(teacher: torch.nn.Module, kinds: list[str], tokens: int, rows: int, dtype: torch.dtype,
                   num_labels: int) -> int:
    """The entry's size before it is built (per token: hidden states of every layer, Q/K/V of every
    transformer layer; per example or token: the logits)."""
    cfg = getattr(teacher, "config", None)
    layers, width = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    per_token = (layers + 1) * width * ("hidden_states" in kinds) + 3 * layers * width * ("qkv" in kinds)
    item = torch.empty(0, dtype=dtype).element_size()
    return item * (tokens * per_token + rows * max(1, num_labels) * 2) + 8 * (rows + 1)


def build_store(tmp: Path, teacher: torch.nn.Module, ds: Any, lengths: np.ndarray, collator: Any,
                needs: frozenset[str], batch_size: int, accelerator: Any, dtype: torch.dtype) -> None:
    """One pass of the frozen teacher over ``ds`` (row order; ``lengths``: its rows' token counts),
    its outputs written unpadded to ``tmp``."""
    from tqdm.auto import tqdm

    from kdrun.tasks.data.pipeline import make_loader

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(tmp / "offsets.npy", offsets)
    writer, kinds = _Writer(tmp, offsets, dtype), stored_kinds(needs)
    loader, _ = make_loader(ds, batch_size, collator, seed=0, train=False)
    teacher_needs = frozenset({*kinds, "logits"})
    t0, batches = time.perf_counter(), 0
    with host_section(), torch.inference_mode():
        for batch in tqdm(loader, desc="teacher store", leave=False, mininterval=2.0, dynamic_ncols=True):
            idx = batch["idx"].numpy()
            batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with accelerator.autocast():
                feats = extract_features(teacher, batch, teacher_needs)
            writer.add(idx, batch["attention_mask"], _outputs(feats, kinds))
            batches += 1
    arrays = writer.close()
    heads, scaling = capture_of(teacher).meta if "qkv" in kinds else (None, None)
    meta = {"version": FORMAT_VERSION, "kinds": kinds, "arrays": arrays, "rows": len(lengths),
            "tokens": int(offsets[-1]), "dtype": str(dtype).removeprefix("torch."), "heads": heads,
            "scaling": scaling, "num_layers": int(teacher.config.num_hidden_layers),
            "forward_seconds_per_row": (time.perf_counter() - t0) / max(1, len(lengths)), "batches": batches}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------------------------- read

class StoreReader:
    """Gathers a batch's rows from an entry (memory-mapped) and pads them to the batch's width.

    Used inside the training loader's collation (:class:`StoreCollator`), so the reads happen on
    the host with the rest of a batch's assembly (in loader workers when there are any). Pickles
    without its arrays: each process maps the files itself.
    """

    def __init__(self, entry: Path):
        self.entry = Path(entry)
        self.meta = json.loads((self.entry / "meta.json").read_text())
        self._arrays: dict[str, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"entry": self.entry, "meta": self.meta, "_arrays": None}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            names = ("offsets", *self.meta["arrays"])
            self._arrays = {n: np.load(self.entry / f"{n}.npy", mmap_mode="r") for n in names}
        return self._arrays

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x))
        return t.view(torch.bfloat16) if self.meta["dtype"] == "bfloat16" else t

    def gather(self, idx: np.ndarray, width: int) -> dict[str, torch.Tensor]:
        """``{"teacher/<name>": tensor}`` for rows ``idx``: per-token arrays as (B, width, w), zero past
        each row's length; per-example arrays as (B, w)."""
        offsets = self.arrays["offsets"]
        starts, lengths = offsets[idx], offsets[idx + 1] - offsets[idx]
        valid = np.arange(width)[None, :] < lengths[:, None]
        flat = (starts[:, None] + np.arange(width)[None, :])[valid]
        mask = torch.from_numpy(valid)
        out = {}
        for name, info in self.meta["arrays"].items():
            arr = self.arrays[name]
            if not info["per_token"]:
                out[f"teacher/{name}"] = self._tensor(arr[idx])
                continue
            rows = self._tensor(arr[flat])
            full = rows.new_zeros((len(idx), width, info["width"]))
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
        batch.update(self.reader.gather(batch["idx"].numpy(), batch["attention_mask"].shape[1]))
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
    key: dict[str, Any] | None = None  # tokenizer hash, max length, teacher dtype, task kind
    _weights: str | None = None
    _data: dict[Any, str] = field(default_factory=dict)

    def weights(self, teacher: torch.nn.Module) -> str:
        if self._weights is None:
            self._weights = weights_hash(teacher)
        return self._weights

    def data(self, ds: Any) -> str:
        """:func:`data_hash`, once per data set of the run (every stage on it asks)."""
        ref = getattr(ds, "_fingerprint", None) or id(ds)
        if ref not in self._data:
            self._data[ref] = data_hash(ds)
        return self._data[ref]


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def store_key(settings: StoreSettings, teacher: torch.nn.Module, ds: Any, kinds: list[str], precision: str) -> str:
    return content_hash({"version": FORMAT_VERSION, "teacher": settings.weights(teacher), "data": settings.data(ds),
                         "kinds": kinds, "dtype": settings.dtype, "precision": precision, **(settings.key or {})})


def read_is_faster(reader: StoreReader, batch_size: int) -> tuple[bool, float, float]:
    """(reading beats the teacher, read seconds per row, the build's forward seconds per row)."""
    rows = reader.meta["rows"]
    idx = np.random.default_rng(0).permutation(rows)[: min(rows, 4 * batch_size)]
    width = int(np.diff(reader.arrays["offsets"]).max())
    t0 = time.perf_counter()
    for chunk in np.array_split(idx, max(1, len(idx) // batch_size)):
        reader.gather(np.sort(chunk), width)
    read = (time.perf_counter() - t0) / max(1, len(idx))
    forward = float(reader.meta["forward_seconds_per_row"])
    return read < forward, read, forward


def open_stage_store(parts: Any, plan: Any, ds: Any, adaptive: bool) -> StoreReader | None:
    """The stage's store (built now if missing), or None when the teacher runs live (said in one line)."""
    settings: StoreSettings | None = getattr(parts, "store", None)
    if settings is None or settings.mode == "off" or not plan.uses_teacher or parts.teacher is None:
        return None
    acc = parts.accelerator
    teacher = acc.unwrap_model(parts.teacher)
    teacher = getattr(teacher, "_orig_mod", teacher)
    say = print if acc.is_main_process else (lambda *a, **k: None)
    reason = why_not_storable(plan.teacher_needs, teacher, adaptive)
    if reason:
        say(f"[kdrun] teacher store not used for stage '{plan.name}': {reason}")
        return None
    dtype, kinds = STORE_DTYPES[settings.dtype], stored_kinds(plan.teacher_needs)
    key = store_key(settings, teacher, ds, kinds, acc.precision.name)
    lengths = row_lengths(ds)
    labels = getattr(teacher.config, "num_labels", 1)
    size = estimate_bytes(teacher, kinds, int(lengths.sum()), len(lengths), dtype, labels)
    if size > settings.max_gb * 2**30:
        say(f"[kdrun] teacher store for stage '{plan.name}' would take {_size(size)}, more than "
            f"teacher.store_max_gb={settings.max_gb}; running the teacher live (raise the cap to store it)")
        return None
    if parts.world_size > 1 and not acc.is_main_process:  # rank 0 builds; the others read its entry
        wait_for_entry(settings.cache_dir, KIND, key)
    root = Path(settings.cache_dir).expanduser() / KIND / key

    def build(tmp: Path) -> None:
        say(f"[kdrun] teacher store: building {'+'.join(kinds)} of {len(lengths)} rows ({int(lengths.sum())} "
            f"tokens, {settings.dtype}): {_size(size)} in {root}")
        build_store(tmp, parts.teacher, ds, lengths, parts.collator, plan.teacher_needs,
                    parts.train_cfg.eval_batch_size, acc, dtype)

    entry, cached = get_or_build(settings.cache_dir, KIND, key, build)
    reader = StoreReader(entry)
    if settings.mode == "auto":
        faster, read, forward = read_is_faster(reader, int(plan.cfg["batch_size"]))
        if not faster:
            say(f"[kdrun] teacher store not used for stage '{plan.name}': reading it ({read * 1e3:.3f} ms/row) is "
                f"slower than running the teacher ({forward * 1e3:.3f} ms/row); teacher.store=on forces it")
            return None
    say(f"[kdrun] teacher store: stage '{plan.name}' reads the teacher's {'+'.join(kinds)} from "
        f"{'the cache' if cached else 'the entry just built'} ({entry.name}); the teacher does not run")
    return reader
