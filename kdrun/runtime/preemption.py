"""Graceful stop on preemption and time limits: checkpoint at the next optimizer step, then exit.

SLURM signals a job before killing it (``USR2`` ``signal_delay_s`` before the time limit with
submitit; ``TERM`` on preemption or ``scancel``). Stopping in the middle of an optimizer step would
leave a checkpoint that does not match the data position, so the handler only records the signal;
the trainer checks :meth:`PreemptionGuard.pending` after every optimizer step, writes a checkpoint
and calls :meth:`PreemptionGuard.stop`. Under submitit the previous handler (which requeues the
job) then runs; otherwise the process exits with 128 + the signal number, as if killed, and
rerunning the same command resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class Interrupted(SystemExit):
    """The run stopped before its end, leaving a checkpoint a rerun resumes from."""


class Preempted(Interrupted):
    """Stopped by a signal (preemption, time limit, kill); exit status 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} after writing a checkpoint; "
                "rerun the same command to resume")


def _signals() -> list[signal.Signals]:
    return [s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGUSR2", "SIGUSR1", "SIGINT")) if s]


class PreemptionGuard:
    """Context manager deferring termination signals to the next safe point (main thread only)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in _signals():
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the step to finish
        self.received = signum

    @property
    def pending(self) -> bool:
        return self.received is not None

    def stop(self) -> None:
        """Hand the signal to whoever handled it before us (submitit requeues), else exit."""
        signum = self.received
        assert signum is not None
        previous = self._previous.get(signum)
        self._restore()
        if callable(previous) and previous is not signal.default_int_handler:
            print(f"[kdrun] stopped by {signal.Signals(signum).name} after writing a checkpoint; handing over to "
                  "the job's own handler (submitit requeues the job, which resumes from it)", flush=True)
            previous(signum, None)  # submitit's handler: requeue the job, then exit
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Preempted(signum)
