"""Mixed precision for every device: which autocast dtype, and one gradient scaler for the run.

kdrun drives autocast and the fp16 loss scaler itself rather than through Accelerate's
``mixed_precision``, for two reasons. Accelerate gives no scaler on CPU, so the fp16 path could
never be exercised without a GPU; with kdrun's own :class:`Precision` the same code runs under
``torch.autocast("cpu", torch.float16)`` with ``torch.amp.GradScaler("cpu")`` in the tests and
under CUDA on a cluster. And a scaler registered with every stage's optimizer unscales the
gradients of all of them at each clipping: kdrun owns one scaler for the run and unscales exactly
once per optimizer step (:meth:`Precision.unscale_`), whatever the number of stages.

Resolution of ``train.precision``: ``auto`` is bf16 where the GPU computes it natively (Ampere and
newer; emulated bf16 on V100/T4 is not taken), fp16 with a scaler on older GPUs, fp32 on CPU.
``bf16`` and ``fp16`` are honoured on CPU too (slow; the CPU stand-ins of the GPU paths).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from kdrun.errors import ConfigError

DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_VALUES = ("auto", "fp32", "no", "bf16", "fp16")


def native_bf16() -> bool:
    """Whether the visible CUDA device computes bf16 natively (emulation on pre-Ampere does not count)."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch without the argument: compute capability 8.0+ has native bf16
        return torch.cuda.get_device_capability()[0] >= 8


def resolve_precision(value: str, device_type: str) -> str:
    """``train.precision`` → ``no`` (fp32), ``bf16`` or ``fp16`` for ``device_type`` (cpu/cuda)."""
    if value not in PRECISION_VALUES:
        raise ConfigError(f"train.precision={value!r} is not one of {', '.join(PRECISION_VALUES)}")
    if value == "auto":
        if device_type != "cuda":
            return "no"
        return "bf16" if native_bf16() else "fp16"
    return "no" if value in ("fp32", "no") else value


@dataclass
class Precision:
    """Autocast dtype and the run's gradient scaler (fp16 only)."""

    name: str  # "no" | "bf16" | "fp16"
    device_type: str  # "cpu" | "cuda"
    scaler: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.name not in DTYPES:
            raise ValueError(f"precision {self.name!r} is not one of {list(DTYPES)}")
        if self.name == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device_type)

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, None for fp32."""
        return DTYPES[self.name]

    def fresh(self) -> Precision:
        """The same precision with a new scaler (the teacher's fine-tuning starts its own loss scale)."""
        return Precision(self.name, self.device_type)

    @contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale, once per optimizer step (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step; with a scaler it is skipped when a gradient is not finite, and the
        scale is updated. Fused Adam/AdamW read the scaler's inf flag on the device (no host sync)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def scale_tensor(self, device: torch.device | str) -> torch.Tensor | None:
        """The current loss scale as a tensor on ``device`` without a host read (None without a
        scaler): for gradients measured inside the step (GradNorm), scaled as the backward is."""
        if self.scaler is None:
            return None
        get = getattr(self.scaler, "_get_scale_async", None)
        current = get() if get is not None else getattr(self.scaler, "_scale", None)
        if current is None:  # before the first scaled backward: the initial scale, a host number
            return torch.full((), float(self.scaler.get_scale()), device=device)
        return current

    def loss_scale(self) -> float:
        """The current loss scale (a host read: logging steps only)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def make_kd_accelerator(cpu: bool, precision: str, **kwargs: Any):
    """An Accelerate ``Accelerator`` (devices, processes, accumulation, DDP wrapping) whose
    ``autocast()`` is kdrun's :class:`Precision`; Accelerate's own mixed precision stays off so it
    neither wraps forwards nor keeps a scaler of its own."""
    from accelerate import Accelerator

    class KdAccelerator(Accelerator):
        def autocast(self, autocast_handler: Any = None):  # noqa: D102 - same contract as Accelerate's
            return self.precision.autocast()

    acc = KdAccelerator(cpu=cpu, mixed_precision="no", **kwargs)
    acc.precision = Precision(precision, acc.device.type)
    return acc
