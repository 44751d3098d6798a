"""ATen ops dispatched: a counter of the kernels a piece of code asks for.

On a GPU a training step of small models is bound by kernel launches, not by arithmetic: every
ATen op that computes something is (at least) one launch. :class:`OpCounter` (a
``TorchDispatchMode``) counts the ops dispatched below autograd while it is entered, the backward
pass included, and leaves out the ops that only make new metadata for existing data (they launch
nothing):

- views: every op whose schema returns an alias of an input (``OpOverload.is_view``: ``view``,
  ``reshape``'s alias, ``transpose``, ``expand``, ``slice``, ``select``, ``diagonal``,
  ``as_strided``, ``unsqueeze``, ``detach``, ``alias``, ...);
- :data:`METADATA`: ops that are views in effect though their schema does not say so
  (``_unsafe_view``, ``lift_fresh``), allocations that write nothing (``empty``,
  ``empty_strided``) and size / stride queries (``sym_size``, ``sym_stride``, ...).

Everything else counts once per call, whatever its size (a copy, a fill, a reduction, a matmul).
The counter is thread-local as every dispatch mode; the autograd engine carries it into the
backward pass of the thread that entered it.

>>> with OpCounter() as ops:
...     loss = model(x).sum(); loss.backward()
>>> ops.count, ops.by_name.most_common(5)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

METADATA = frozenset({"_unsafe_view", "lift_fresh", "empty", "empty_strided", "sym_size", "sym_stride",
                      "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"})


def op_name(func: Any) -> str:
    """``aten.add.Tensor`` -> ``add``: the op's name without namespace and overload."""
    return func._schema.name.split("::")[-1]


def is_metadata(func: Any) -> bool:
    """Whether an op only makes metadata (a view, a query, an empty allocation): not counted."""
    return bool(getattr(func, "is_view", False)) or op_name(func) in METADATA


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while entered, views and other metadata-only ops left out.

    ``count``: ops counted; ``by_name``: a Counter of their names (``addmm``, ``mul`` ...);
    ``skipped``: metadata-only ops seen (not in ``count``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.skipped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_metadata(func):
            self.skipped += 1
        else:
            self.by_name[op_name(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.by_name.values())

    def __repr__(self) -> str:
        top = ", ".join(f"{n} x{c}" for n, c in self.by_name.most_common(8))
        return f"OpCounter({self.count} ops: {top}{', ...' if len(self.by_name) > 8 else ''})"
