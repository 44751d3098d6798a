"""Device→host synchronisations: where they are allowed, and a counter that finds the others.

A training step must not wait for the accelerator: reading a value on the host (``.item()``,
``float(t)``, ``if t:``), or an op whose output shape depends on tensor values (boolean-mask
indexing, ``nonzero``, ``unique``, ``masked_select``) makes the CPU stop until every queued kernel
has run. So does a blocking host→device copy: a tensor made on the CPU (``torch.tensor(...)``, a
weight kept on the CPU) copied to the device every step comes from pageable memory, which CUDA
copies synchronously whatever ``non_blocking`` says, and a copy from pinned memory without
``non_blocking=True`` waits for the stream. Code where such a wait is wanted by design (logging,
evaluation, checkpoints, fetching a batch) runs inside :func:`host_section`; :class:`SyncCounter`
(tests) records every sync-forcing call made outside one. Host→device copies are recorded as
``h2d(pageable)`` / ``h2d(blocking)``; any non-CPU device counts as the device, so CPU tests can
stand ``meta`` in for CUDA.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # kdrun/
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class _Depth(threading.local):
    depth = 0  # per thread: SyncCounter's modes only see the thread that entered them


_STATE = _Depth()


class _HostSection:
    """Re-entrant context: while entered (in this thread), syncs are allowed."""

    __slots__ = ()

    def __enter__(self) -> None:
        _STATE.depth += 1

    def __exit__(self, *exc: Any) -> None:
        _STATE.depth -= 1


_SECTION = _HostSection()


def host_section() -> _HostSection:
    """Mark code where a device→host sync is allowed by design (``with host_section(): ...``);
    costs one counter increment and decrement."""
    return _SECTION


def in_host_section() -> bool:
    """Whether the calling thread is inside :func:`host_section`."""
    return _STATE.depth > 0


# ---------------------------------------------------------------------------- what forces a sync

_ALWAYS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu",
                     "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                     "equal", "allclose", "__repr__", "__str__", "__format__"})


def _has_bool(index: Any) -> bool:
    """Whether an indexing key (tensor, tuple / list of keys) holds a boolean tensor."""
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_has_bool(i) for i in index)
    return False


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call copies a non-CPU tensor to the CPU."""
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None or src.device.type == "cpu":
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


def _device_of(value: Any) -> torch.device | None:
    """The device a ``to``/``copy`` target names (a device, its name, or a tensor), else None."""
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:  # a string that is not a device (a memory format's name, ...)
            return None
    return None


def h2d_kind(src: Any, target: torch.device | None, non_blocking: bool) -> str | None:
    """``h2d(pageable)`` / ``h2d(blocking)`` when copying ``src`` to ``target`` is a host→device copy
    that makes the host wait, else None. Pinned memory copied with ``non_blocking=True`` does not wait."""
    if not isinstance(src, torch.Tensor) or src.device.type != "cpu" or target is None or target.type == "cpu":
        return None
    if not src.is_pinned():
        return "h2d(pageable)"
    return None if non_blocking else "h2d(blocking)"


def _h2d_call(name: str, args: tuple, kwargs: dict) -> str | None:
    """The host→device copy a torch-level call makes the host wait for, or None."""
    if name == "to" and args:
        targets = [_device_of(t) for t in (*args[1:], kwargs.get("device"), kwargs.get("other"))]
        target = next((t for t in targets if t is not None), None)
        blocking = kwargs.get("non_blocking", any(a is True for a in args[1:]))
        return h2d_kind(args[0], target, bool(blocking))
    if name == "cuda" and args:
        return h2d_kind(args[0], torch.device("cuda"), bool(kwargs.get("non_blocking", False)))
    if name == "copy_" and len(args) > 1 and isinstance(args[0], torch.Tensor):
        return h2d_kind(args[1], args[0].device, bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
    if name in ("tensor", "as_tensor", "asarray"):  # Python / CPU data placed on a device
        target = _device_of(kwargs.get("device"))
        data = args[0] if args else None
        if target is None or target.type == "cpu":
            return None
        if isinstance(data, torch.Tensor):
            return h2d_kind(data, target, False)
        return f"{name}(h2d)"
    return None


def _repeats_tensor(args: tuple, kwargs: dict) -> bool:
    """``repeat_interleave`` with tensor repeats and no ``output_size`` (its size is data-dependent)."""
    if kwargs.get("output_size") is not None:
        return False
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
    return isinstance(repeats, torch.Tensor)


def function_sync(func: Callable, args: tuple, kwargs: dict) -> str | None:
    """The name of the sync a torch-level call forces, or None."""
    name = getattr(func, "__name__", "")
    if name in _ALWAYS:
        return name
    if name in ("__getitem__", "__setitem__", "index") and len(args) > 1 and _has_bool(args[1]):
        return f"{name}[bool]"
    if name == "to" and _to_host(args, kwargs):
        return "to(cpu)"
    if name == "repeat_interleave" and _repeats_tensor(args, kwargs):
        return name
    copy = _h2d_call(name, args, kwargs)
    if copy is not None:
        return f"{name}: {copy}"
    return None


_DISPATCH_ALWAYS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "_unique",
                              "_unique2", "unique_dim", "unique_consecutive", "bincount", "equal"})


def dispatch_sync(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name of the sync an aten op forces, or None."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    name = schema.name.split("::")[-1]
    if name in _DISPATCH_ALWAYS:
        return f"aten.{name}"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and _has_bool(args[1]):
        return f"aten.{name}[bool]"
    if name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
        return f"aten.{name}"
    if name == "_to_copy" and args[0].device.type != "cpu" and kwargs.get("device") is not None \
            and torch.device(kwargs["device"]).type == "cpu":
        return "aten._to_copy(cpu)"
    if name == "_to_copy" and kwargs.get("device") is not None:
        copy = h2d_kind(args[0], torch.device(kwargs["device"]), bool(kwargs.get("non_blocking", False)))
        return f"aten._to_copy: {copy}" if copy else None
    if name == "copy_" and len(args) > 1 and isinstance(args[0], torch.Tensor):
        copy = h2d_kind(args[1], args[0].device, bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        return f"aten.copy_: {copy}" if copy else None
    return None


def _location() -> str:
    """``path:line in function`` of the innermost caller frame inside kdrun (else outside torch)."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        where = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        if path != _THIS and path.startswith(_PACKAGE):
            return os.path.relpath(path, os.path.dirname(_PACKAGE.rstrip(os.sep))) + where[len(path):]
        if fallback is None and path != _THIS and not path.startswith(_TORCH):
            fallback = where
        frame = frame.f_back
    return fallback or "?"


# ---------------------------------------------------------------------------------- the counter

class _FunctionWatch(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = None if _STATE.depth else function_sync(func, args, kwargs)
        if name is None:
            return func(*args, **kwargs)
        self.counter._record(name)
        self.counter._inside += 1  # the call's own aten ops are not counted again
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._inside -= 1


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (_STATE.depth or self.counter._inside):
            name = dispatch_sync(func, args, kwargs)
            if name is not None:
                self.counter._record(name)
        return func(*args, **kwargs)


class SyncCounter:
    """Records every sync-forcing call made (in this thread) outside :func:`host_section`, blocking
    host→device copies included.

    ``events``: list of (name, location) — location is the innermost frame inside kdrun
    (``kdrun/losses/ckd.py:120 in ckd_loss``); ``count``: how many. One user call counts once
    (a torch-level event hides the aten ops it runs).

    >>> with SyncCounter() as c:
    ...     loss = term(student, teacher, batch, ctx, params)
    >>> assert c.count == 0, c.events
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self._inside = 0
        self._modes = (_FunctionWatch(self), _DispatchWatch(self))

    def _record(self, name: str) -> None:
        self.events.append((name, _location()))

    @property
    def count(self) -> int:
        return len(self.events)

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def __repr__(self) -> str:
        return f"SyncCounter({self.count} syncs: " + "; ".join(f"{n} at {w}" for n, w in self.events) + ")"
