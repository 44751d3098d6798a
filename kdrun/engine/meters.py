"""What a stage measures between log lines: loss values and throughput (kept on the device), and the
non-finite watch that stops a diverged stage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kdrun.engine.checkpoints import checkpoint_dir
from kdrun.engine.objective import StagePlan
from kdrun.errors import UserError
from kdrun.runtime.syncs import host_section


class TrainingDiverged(UserError, RuntimeError):
    """A loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class _Meter:
    """Loss values since the last log line as one device vector (the terms, then ``loss``) summed in
    place: no host read per step, and no step's output kept by reference (under CUDA graphs a region's
    outputs are overwritten at the next replay). Also throughput and gradient shares."""

    keys: list[str] = field(default_factory=list)
    total: torch.Tensor | None = None
    batches: int = 0
    examples: int = 0
    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)
    shares: dict[str, float] = field(default_factory=dict)

    def add(self, values: dict[str, torch.Tensor], loss: torch.Tensor, examples: int, tokens: int) -> None:
        keys = [*values, "loss"]
        vec = torch.stack([*(v.detach().float().reshape(()) for v in values.values()),
                           loss.detach().float().reshape(())])  # a new tensor: nothing of the step's is kept
        if self.total is None:
            self.keys, self.total = keys, vec
        elif keys == self.keys:
            self.total.add_(vec)
        else:  # a step with other terms than the interval's first (not seen with kdrun's own strategies)
            self.sums = {**self.sums, **{k: self.sums.get(k, 0.0) + v for k, v in zip(keys, vec.unbind())}}
        self.batches += 1
        self.examples += examples
        self.tokens += tokens

    @property
    def sums(self) -> dict[str, torch.Tensor]:
        """Each value's sum since the last log line (0-dim device tensors)."""
        return {} if self.total is None else dict(zip(self.keys, self.total.unbind()))

    @sums.setter
    def sums(self, sums: dict[str, torch.Tensor]) -> None:  # a resumed log interval
        self.keys = list(sums)
        self.total = torch.stack([torch.as_tensor(v).float().reshape(()) for v in sums.values()]) if sums else None

    def means(self) -> dict[str, float]:
        """The mean of each value since the last log line: one host read (a logging step)."""
        if self.total is None or not self.batches:
            return {}
        return {k: v / self.batches for k, v in zip(self.keys, self.total.tolist())}


@dataclass
class FiniteWatch:
    """Whether a loss or term became NaN/inf, kept on the device and read at logging, evaluation and
    checkpoint steps (:meth:`check`), so the training step never waits for the host. A checkpoint
    is never written after a non-finite step: the last one kept is the last good one."""

    keys: list[str] = field(default_factory=list)
    # The processes training this model together (1: alone, also a teacher fine-tuned by one rank of
    # a data-parallel run while the others wait: no collective then).
    world_size: int = 1
    bad: torch.Tensor | None = None  # (1 + terms,) bool: ever non-finite since the stage began
    first_step: torch.Tensor | None = None  # step of the first non-finite loss (-1: none)
    first_values: torch.Tensor | None = None  # the loss and terms at that step

    def add(self, loss: torch.Tensor, values: dict[str, torch.Tensor], step: int) -> None:
        vec = torch.stack([loss.detach().float(), *(v.detach().float().reshape(()) for v in values.values())])
        now = ~torch.isfinite(vec)
        if self.bad is None or len(self.keys) != vec.numel():
            self.keys = ["total (weighted sum)", *values]
            self.bad, self.first_values = torch.zeros_like(now), torch.zeros_like(vec)
            self.first_step = torch.full((), -1, dtype=torch.long, device=vec.device)
        new = now.any() & (self.first_step < 0)  # in place, on the device
        self.first_step.masked_fill_(new, step)
        self.first_values.copy_(torch.where(new, vec, self.first_values))
        self.bad.logical_or_(now)

    def check(self, plan: StagePlan, run_dir: Path) -> None:
        """Raise :class:`TrainingDiverged` naming the stage, step and terms (a host read). With several
        processes every rank raises at the same check when any rank saw a non-finite value (the check
        steps are the same on every rank), so none is left waiting in the next all-reduce."""
        with host_section():
            elsewhere = self._agree()
            if elsewhere is not None:
                step, rank = elsewhere
                raise TrainingDiverged(
                    f"stage '{plan.name}': the loss became non-finite at step {step} on process {rank} (its log "
                    f"names the terms); every process stops. The last good checkpoint is kept in "
                    f"{checkpoint_dir(run_dir)}; lower the lr or the term's weight, or check the inputs.")
            if self.bad is None or not bool(self.bad.any()):
                return
            bad = self.bad.tolist()
            terms = [k for k, b in zip(self.keys[1:], bad[1:]) if b] or [self.keys[0]]
            shown = {k: float(v) for k, v in zip(self.keys, self.first_values.tolist())}
            step = int(self.first_step)
        raise TrainingDiverged(
            f"stage '{plan.name}': loss term(s) {', '.join(terms)} became non-finite at step {step} "
            f"(values: {shown}). The last good checkpoint is kept in {checkpoint_dir(run_dir)}; lower the "
            "lr or the term's weight, or check the inputs.")


    def _agree(self) -> tuple[int, int] | None:
        """Several processes: (first step, lowest rank) of a non-finite value seen on another rank while
        this one saw none; None when this rank saw one itself, when none did, or with one process."""
        import torch.distributed as dist

        if self.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        device = self.bad.device if self.bad is not None else (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu"))
        mine = self.bad is not None and bool(self.bad.any())
        none = -float(2**62)
        vec = torch.tensor([-float(self.first_step) if mine else none, -float(dist.get_rank()) if mine else none],
                           dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)  # max of -x: the first step and the lowest rank
        if mine or vec[0].item() == none:
            return None
        return int(-vec[0].item()), int(-vec[1].item())
