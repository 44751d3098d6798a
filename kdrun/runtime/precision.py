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

Under fp16 the optimizer step is skipped when a gradient is not finite. Fused Adam/AdamW (kdrun's
default) read the scaler's inf flag on the device; any other optimizer (SGD, or
``train.optimizer.kwargs={fused: false}``) makes torch's ``GradScaler.step`` read it on the host
(``found_inf.item()``): one device→host sync per optimizer step, by design of torch's scaler and
marked as such here (:meth:`Precision.step`). bf16 and fp32 have no scaler and no such read.

``train.tf32`` (:func:`resolve_tf32`): TensorFloat-32 for CUDA matmuls in fp32 (``auto``: on for
CUDA, a no-op on CPU; it changes nothing else). Matmuls on Ampere+ tensor cores then round their
fp32 inputs to 10 bits of mantissa. The relation kernels (Gram matrices of CKD, MGSKD) turn TF32 off
around their own matmuls (:func:`exact_fp32_matmul`): distances and angles come from the Gram
identity ||r_i - r_j||^2 = G_ii + G_jj - 2 G_ij, which cancels, and TF32's ~5e-4 relative error
per input would put its noise far above the fp32 threshold those kernels treat as coincident points.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from kdrun.errors import ConfigError
from kdrun.runtime.syncs import host_section

DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_VALUES = ("auto", "fp32", "no", "bf16", "fp16")
TF32_VALUES = ("auto", True, False)


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


def resolve_tf32(value: Any, device_type: str) -> bool:
    """``train.tf32`` (auto / true / false) → whether CUDA matmuls in fp32 may use TF32 on
    ``device_type``; ``auto`` is on for CUDA. Always False off CUDA (TF32 is a CUDA matmul mode)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not (value == "auto" or isinstance(value, bool)):
        raise ConfigError(f"train.tf32={value!r} must be auto, true or false (TensorFloat-32 for CUDA matmuls)")
    return device_type == "cuda" and (value is True or value == "auto")


def tf32_matmul() -> bool:
    """Whether CUDA fp32 matmuls may use TF32 (process-wide), read through torch's ``fp32_precision``
    where it has one (torch >= 2.9: once that API has set the flag, reading the legacy
    ``allow_tf32`` raises), else through ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        value = matmul.fp32_precision
        if value == "none":  # not set for matmuls: the backends' default
            value = getattr(torch.backends, "fp32_precision", "ieee")
        return value == "tf32"
    return bool(matmul.allow_tf32)


def set_tf32_matmul(enabled: bool) -> None:
    """Let CUDA fp32 matmuls use TF32 or not (process-wide), through the API :func:`tf32_matmul` reads."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = bool(enabled)


def apply_tf32(enabled: bool, device_type: str) -> None:
    """Set TF32 for CUDA fp32 matmuls (process-wide); nothing is changed off CUDA."""
    if device_type == "cuda":
        set_tf32_matmul(enabled)


@contextmanager
def exact_fp32_matmul(device_type: str) -> Iterator[None]:
    """CUDA fp32 matmuls in full fp32 inside the block (TF32 off, restored after); a no-op off CUDA
    or where TF32 is already off. For kernels whose results cancel (Gram-matrix relations)."""
    # inside a compiled region the switch is not traced: the compiled step switches TF32 off
    # around the whole region instead (kdrun.engine.compiled.StepForward)
    if device_type != "cuda" or torch.compiler.is_compiling() or not tf32_matmul():
        yield
        return
    set_tf32_matmul(False)
    try:
        yield
    finally:
        set_tf32_matmul(True)


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
        scale is updated. Fused Adam/AdamW read the scaler's inf flag on the device (no host sync);
        another optimizer has torch's scaler read it on the host, a sync allowed here by design
        (see the module docstring)."""
        if self.scaler is None:
            optimizer.step()
            return
        reads_host = not getattr(optimizer, "_step_supports_amp_scaling", False)
        with host_section() if reads_host else nullcontext():
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


def make_kd_accelerator(cpu: bool, precision: str, tf32: Any = "auto", **kwargs: Any):
    """An Accelerate ``Accelerator`` (devices, processes, accumulation, DDP wrapping) whose
    ``autocast()`` is kdrun's :class:`Precision`; Accelerate's own mixed precision stays off so it
    neither wraps forwards nor keeps a scaler of its own. ``tf32``: ``train.tf32``, applied for the
    accelerator's device (``acc.tf32``: whether CUDA matmuls use TF32)."""
    from accelerate import Accelerator

    class KdAccelerator(Accelerator):
        def autocast(self, autocast_handler: Any = None):  # noqa: D102 - same contract as Accelerate's
            return self.precision.autocast()

    acc = KdAccelerator(cpu=cpu, mixed_precision="no", **kwargs)
    acc.precision = Precision(precision, acc.device.type)
    acc.tf32 = resolve_tf32(tf32, acc.device.type)
    apply_tf32(acc.tf32, acc.device.type)
    return acc
