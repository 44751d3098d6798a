"""One definition of a step's forward work, run eagerly, compiled, or compiled under CUDA graphs.

:func:`forward_loss` is the region: the student's forward pass (under autocast), the live teacher's
(under ``no_grad``), and the objective's weighted loss (fp32, autocast off). :class:`StepForward`
runs it as the stage asks, chosen once when the stage starts:

- ``eager``: the region as Python runs it (the default);
- ``compiled`` (``train.compile=true``): the region as one ``torch.compile`` graph, so the loss
  terms' elementwise chains fuse with the models' and the backward is one compiled graph too;
- ``graphed`` (``train.cuda_graphs=true``, CUDA only): the compiled region replayed through CUDA
  graphs (``mode="reduce-overhead"``), one graph per batch shape.

Batches are padded to a few widths under compile (``train.pad_to_multiple_of``), so a stage compiles
at most once per width; a batch of another row count (an epoch's last) and a logging step that
measures per-term gradients run the same region eagerly. Objectives whose loss depends on the step
(``mapping=random`` redraws its layer pairs every step) run eagerly, as do stage strategies' steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kdrun.engine.teacher_store import live_as_stored
from kdrun.models.features import (
    PROJECTION_NEEDS,
    Features,
    capture_of,
    count_forward,
    extract_features,
    unwrapped,
)
from kdrun.runtime.precision import exact_fp32_matmul

log = logging.getLogger(__name__)
MODES = ("eager", "compiled", "graphed")


def forward_loss(parts: Any, plan: Any, batch: dict[str, Any], teacher: Features | None, step: int = 0,
                 weighted: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The stage's weighted loss and its terms' values on ``batch``: the student's features, the
    teacher's (``teacher`` when given, e.g. read from the teacher-output store, else its forward
    pass when the stage uses a teacher) and the objective."""
    acc = parts.accelerator
    with acc.autocast():
        s_feats = extract_features(parts.student, batch, plan.student_needs)
    if teacher is None and plan.uses_teacher:
        teacher = live_teacher(parts, plan, batch)
    with torch.autocast(device_type=acc.device.type, enabled=False):
        return parts.objective(plan.index, s_feats, teacher, batch, step=step, weighted=weighted)


def live_teacher(parts: Any, plan: Any, batch: dict[str, Any]) -> Features:
    """The frozen teacher's forward pass on ``batch``: under ``no_grad`` (not inference mode), so its
    features join the student's graph without copies; on a stage whose outputs the teacher-output
    store can keep, served exactly as the store serves them (kdrun.engine.teacher_store.live_as_stored),
    so that ``teacher.store`` changes the speed only."""
    with torch.no_grad():
        with parts.accelerator.autocast():
            feats = extract_features(parts.teacher, batch, plan.teacher_needs)
        return live_as_stored(parts, plan, feats)  # as the teacher-output store would give them


def step_mode(train_cfg: Any, device_type: str, precision: str, world_size: int = 1) -> str:
    """The stage's step mode from ``train.compile`` / ``train.cuda_graphs``; ConfigError naming the
    key where CUDA graphs cannot run: off CUDA, under fp16, with gradient accumulation or several
    processes (a replayed backward's gradients live in the graph's memory, which the next replay
    overwrites before an accumulated or all-reduced gradient is used)."""
    from kdrun.errors import ConfigError

    if not getattr(train_cfg, "cuda_graphs", False):
        return "compiled" if getattr(train_cfg, "compile", False) else "eager"
    if device_type != "cuda":
        raise ConfigError(f"train.cuda_graphs=true needs a CUDA device (this run's is {device_type}); "
                          "use train.compile=true, or drop train.cuda_graphs")
    if precision == "fp16":
        raise ConfigError("train.cuda_graphs=true does not run under fp16: its loss scaler reads the "
                          "gradients on the host every step; use train.precision=bf16, or drop train.cuda_graphs")
    accumulate = int(getattr(train_cfg, "gradient_accumulation_steps", 1) or 1)
    if accumulate > 1 or world_size > 1:
        what = (f"train.gradient_accumulation_steps={accumulate}" if accumulate > 1
                else f"{world_size} processes (DDP)")
        raise ConfigError(f"train.cuda_graphs=true does not run with {what}: a replayed backward's gradients "
                          "are overwritten by the next replay; use train.compile=true instead")
    return "graphed"


def stage_forward(parts: Any, plan: Any, strategy: Any = None) -> StepForward:
    """How the stage's plain steps run their forward region (eager unless train.compile or
    train.cuda_graphs ask otherwise and the stage can compile; a one-line notice when it cannot).
    The region's row count is the stage's batch size (the loader's), so a short batch runs eagerly
    wherever it comes (an epoch's last, the first after a resume)."""
    acc, tcfg = parts.accelerator, parts.train_cfg
    mode = step_mode(tcfg, acc.device.type, acc.precision.name, getattr(parts, "world_size", 1))
    reason = eager_reason(parts, plan, strategy) if mode != "eager" else None
    if reason is not None:
        log.warning("train.compile: stage %r runs eagerly: %s", plan.name, reason)
        mode = "eager"
    return StepForward(parts, plan, mode, getattr(tcfg, "compile_backend", "inductor"),
                       rows=int(plan.cfg["batch_size"]))


def eager_reason(parts: Any, plan: Any, strategy: Any) -> str | None:
    """Why a compiled stage runs eagerly instead (None: it compiles)."""
    if strategy is not None:
        return f"the stage strategy {strategy.key!r} runs its own steps"
    if parts.objective.step_dependent(plan.index):
        return "its layer map redraws its pairs every step (mapping=random)"
    balancer = parts.objective.balancer
    if balancer is not None and balancer.method == "gradnorm" and balancer.balances(plan.index):
        return "objective.balance=gradnorm differentiates each term inside the step (torch.autograd.grad)"
    return None


def prepare(parts: Any, plan: Any) -> None:
    """Register, before tracing, every hook the region's forward passes would otherwise register on
    their first call (a hook registered inside a traced region breaks the graph): kdrun's feature
    captures and the models' own output-capturing hooks (Hugging Face installs them lazily)."""
    roles = [(parts.student, plan.student_needs)]
    if plan.uses_teacher and parts.teacher is not None:
        roles.append((parts.teacher, plan.teacher_needs))
    for model, needs in roles:
        if needs & PROJECTION_NEEDS:
            capture_of(model)
        if "mlm_logits" in needs:
            capture_of(model).hook_mlm(unwrapped(model))
        _install_output_hooks(model)


def _install_output_hooks(model: torch.nn.Module) -> None:
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # an older transformers: hooks are not installed lazily
        return
    for module in model.modules():
        if getattr(module, "_can_record_outputs", None):
            maybe_install_capturing_hooks(module)


class StepForward:
    """The region (:func:`forward_loss`) run in one of :data:`MODES`; ``compilations`` counts the
    graphs compiled for it and ``graph_breaks`` the breaks dynamo met while compiling them.

    Whatever the mode, the step gets the loss and a fresh copy of the terms' values: under CUDA
    graphs a region's outputs live in the graph's memory and the next replay overwrites them, so
    nothing outside the region may keep one across steps (the values are copied out as one stacked
    vector). ``replayed`` (tests only) imitates that on any device: inputs are copied into static
    buffers and the outputs written into the same static tensors at every call."""

    def __init__(self, parts: Any, plan: Any, mode: str = "eager", backend: str = "inductor",
                 rows: int | None = None, widths: int = 64):
        if mode not in (*MODES, "replayed"):
            raise ValueError(f"step mode {mode!r} is not one of {', '.join(MODES)}")
        self.parts, self.plan, self.mode, self.rows = parts, plan, mode, rows
        self.compilations = self.graph_breaks = 0
        self._compiled = None
        self._static: dict[Any, Any] = {}
        main = getattr(getattr(parts, "accelerator", None), "is_main_process", True)
        self._say = _write if main else None
        if mode in ("compiled", "graphed"):
            # A fresh start: every region shares one code object, and dynamo would otherwise check an
            # earlier stage's graphs (guarded on other models and terms) before each call of this one.
            torch._dynamo.reset()
            prepare(parts, plan)
            _allow_recompiles(widths)
            kwargs = {"mode": "reduce-overhead"} if mode == "graphed" else {}
            self._compiled = torch.compile(self._region, backend=backend, dynamic=False, **kwargs)

    def _region(self, batch: dict[str, Any], teacher: Features | None):
        loss, values = forward_loss(self.parts, self.plan, batch, teacher)
        return loss, torch.stack([v.float().reshape(()) for v in values.values()]), tuple(values)

    def compiles(self, batch: dict[str, Any], weighted: Any) -> bool:
        """Whether this call runs the compiled (or replayed) region, else the same region eagerly: a
        logging step measuring per-term gradients, or a batch of another row count than the stage's."""
        if self.mode == "eager" or weighted is not None:
            return False
        rows = int(batch["attention_mask"].shape[0])
        if self.rows is None:  # no batch size given: the first batch's row count
            self.rows = rows
        return rows == self.rows

    def __call__(self, batch: dict[str, Any], teacher: Features | None, step: int,
                 weighted: dict[str, torch.Tensor] | None = None):
        if not self.compiles(batch, weighted):
            return forward_loss(self.parts, self.plan, batch, teacher, step, weighted)
        if self.mode == "replayed":
            return self._replay(batch, teacher)
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        if self.mode == "graphed":
            torch.compiler.cudagraph_mark_step_begin()
        if not self.compilations and self._say is not None:
            self._say(f"[kdrun] train.compile: stage '{self.plan.name}' is compiling its step ({self.mode}; once per "
                      "batch width) ...")
        started = time.perf_counter()
        with self._exact_fp32():
            loss, vec, keys = self._compiled(batch, teacher)
        new = counters["stats"]["unique_graphs"] - before[0]
        self._announce(new, batch, time.perf_counter() - started)
        if teacher is None and self.plan.uses_teacher:  # the live teacher's pass, traced uncounted
            count_forward(self.parts.teacher, int(batch["attention_mask"].shape[0]))
        self.compilations += new
        self.graph_breaks += sum(counters["graph_break"].values()) - before[1]
        if self.mode == "graphed":  # copied out of the graph's memory before the next replay
            vec = vec.clone()
        return loss, dict(zip(keys, vec.unbind()))

    def _announce(self, new: int, batch: dict[str, Any], seconds: float) -> None:
        """One line when the step compiles a graph (the first step's bar would otherwise sit at one
        step for a minute with no word): its shape, the seconds, the stage's count so far."""
        if new <= 0 or self._say is None:
            return
        shape = "x".join(map(str, batch["attention_mask"].shape))
        if torch.is_tensor(batch.get("spans")):
            shape += f" ({batch['spans'].shape[1]} span slots)"
        self._say(f"[kdrun] train.compile: stage '{self.plan.name}' compiled its step for {shape} batches in "
                  f"{seconds:.1f} s ({self.compilations + new} graph(s) so far)")

    def _replay(self, batch: dict[str, Any], teacher: Features | None):
        """CUDA-graph replay semantics, eagerly: static inputs per shape, static outputs overwritten."""
        shapes = tuple((k, tuple(v.shape)) for k, v in batch.items() if torch.is_tensor(v))  # one graph per shapes
        inputs, outs = self._static.setdefault(shapes, ({}, {}))
        for k, v in batch.items():
            if torch.is_tensor(v):
                inputs.setdefault(k, torch.empty_like(v)).copy_(v)
        loss, vec, keys = self._region({**batch, **inputs}, teacher)
        out_vec = outs.setdefault("values", torch.empty_like(vec))
        out_vec.copy_(vec)
        loss = _IntoStatic.apply(loss, outs.setdefault("loss", torch.empty_like(loss)).detach())
        return loss, dict(zip(keys, out_vec.unbind()))

    def _exact_fp32(self):
        """TF32 off around the whole compiled region, in every precision: the relation kernels'
        own switch (kdrun.runtime.precision.exact_fp32_matmul) is not traced, so the Gram matrices
        stay in full fp32 as the eager step keeps them. Under bf16/fp16 the region's fp32 matmuls are
        the objective's (the models run under autocast); under fp32 the models' matmuls lose TF32 too."""
        return exact_fp32_matmul(self.parts.accelerator.device.type)


def _write(text: str) -> None:
    """A line above the stage's progress bar (not inside it)."""
    from tqdm.auto import tqdm

    tqdm.write(text)


class _IntoStatic(torch.autograd.Function):
    """``x`` written into the static tensor ``out`` (a graph's output memory) and returned as it, with
    ``x``'s gradient: a tensor kept from an earlier call changes at the next one, as under replay."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(x)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _allow_recompiles(widths: int) -> None:
    """Let dynamo keep a graph per batch width (its default limit is 8 graphs per function; 512
    tokens in multiples of 32 are 16 widths, and a collator that rounds nothing gives more). The
    limit is ``recompile_limit`` from torch 2.7 on, ``cache_size_limit`` before."""
    import torch._dynamo.config as dc

    need = widths + 2
    for names in (("recompile_limit", "cache_size_limit"),
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = next((n for n in names if hasattr(dc, n)), None)
        if name is not None and getattr(dc, name) < need:
            setattr(dc, name, need)
