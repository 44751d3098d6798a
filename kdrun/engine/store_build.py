"""Building a teacher-output store entry: one pass of the frozen teacher over the training rows, its
outputs written unpadded into memory-mapped arrays whose blocks are allocated up front."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdrun.engine.store_keys import FORMAT_VERSION, RowMap, build_collator, row_ids, stored_kinds
from kdrun.models.features import Features, capture_of, extract_features
from kdrun.runtime.syncs import host_section


class StoreOverflow(Exception):
    """A teacher output does not fit the store's fp16."""

    def __init__(self, name: str, peak: float):
        super().__init__(name, peak)
        self.name, self.peak = name, peak


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

    from kdrun.tasks.data.batches import make_loader

    ids = row_ids(ds) if ids is None else ids
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "ids.npy", ids)
    writer, kinds = _Writer(tmp, offsets, RowMap(ids), dtype), stored_kinds(needs)
    loader, _ = make_loader(ds, batch_size, build_collator(collator), seed=0, train=False)
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
