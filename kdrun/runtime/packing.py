"""``launcher=packed``: the jobs of a sweep as local subprocesses, several at once on one GPU.

submitit's local executor starts every job of an array at once (it has no ``array_parallelism``),
and its processes see only the GPUs that ``gpus_per_node`` names (none by default). The packed
launcher keeps everything else of ``launcher=submitit_local`` (each job a pickled subprocess under
``<sweep dir>/.submitit/``, finished jobs answered from their ``results.json``, interrupted ones
resumed) and changes two things:

* **At most ``jobs_at_once`` jobs run at a time.** A job is started when a running one ends; the
  others wait in the submitting process.
* **Every job sees the devices that the command sees** (``CUDA_VISIBLE_DEVICES`` passed on as it
  is, or left unset), so all of them share the one GPU.

``hydra.launcher.jobs_at_once`` is a positive number, or ``auto``: on a GPU, the first visible
device's free memory divided by ``job_memory_gb`` (an estimate of one job's peak, with its CUDA
context), rounded down and capped by the CPU cores this process may use; without a GPU, 1. It is
never more than the number of jobs to run, and never less than 1.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kdrun.errors import ConfigError

KEY = "hydra.launcher"
# The settings of conf/launcher/packed.yaml; any other key under hydra.launcher is refused.
SETTINGS = {"submitit_folder", "timeout_min", "max_num_timeout", "jobs_at_once", "job_memory_gb",
            "stderr_to_stdout"}
POLL_S = 0.5


class PackingError(ConfigError):
    """A bad packed-launcher setting: kdrun prints it as one line and exits with status 2."""


@dataclass(frozen=True)
class Packing:
    """How many jobs run at once, and why (the line the sweep prints)."""

    jobs: int
    reason: str


def gpu_free_gb() -> float | None:
    """Free memory (GiB) of the first GPU that the jobs will see, or None without a GPU. Asked of
    ``nvidia-smi``; where it is missing, of torch in a short child process (so that this process
    holds no CUDA context for the length of the sweep)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    first = visible.split(",")[0].strip() if visible else "0"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", first]
        return _number_from(query, scale=2**10)  # MiB
    probe = "import torch; print(torch.cuda.mem_get_info(0)[0] if torch.cuda.is_available() else '')"
    return _number_from([sys.executable, "-c", probe], scale=2**30)  # bytes


def _number_from(command: list[str], scale: float) -> float | None:
    """The first number that ``command`` prints, divided by ``scale``; None if it fails or prints none."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120)
        return float(out.stdout.split()[0]) / scale if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, which a cgroup or ``taskset`` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive(name: str, value: Any, whole: bool) -> float:
    """``value`` as a finite number above 0 (a whole one if ``whole``), or PackingError naming the key."""
    try:
        number = float(str(value).strip())
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0 or (whole and not number.is_integer()):
        what = "a whole number above 0 or auto" if whole else "a number above 0 (GiB)"
        raise PackingError(f"{KEY}.{name}={value}: must be {what}")
    return number


def resolve(jobs_at_once: Any, job_memory_gb: Any, num_jobs: int,
            free_gb: Callable[[], float | None] = gpu_free_gb,
            cores: Callable[[], int] = usable_cores) -> Packing:
    """The number of jobs to run at once for ``num_jobs`` jobs (see the module's docstring)."""
    memory = _positive("job_memory_gb", job_memory_gb, whole=False)
    if str(jobs_at_once).strip().lower() != "auto":
        stated = int(_positive("jobs_at_once", jobs_at_once, whole=True))
        return Packing(max(1, min(stated, num_jobs)), f"{KEY}.jobs_at_once={stated}")
    free = free_gb()
    if free is None:
        return Packing(1, "jobs_at_once=auto without a GPU: one at a time; "
                          f"{KEY}.jobs_at_once=N packs N on the CPU")
    by_memory, ncores = int(free // memory), cores()
    jobs = max(1, min(by_memory, ncores, num_jobs))
    return Packing(jobs, f"jobs_at_once=auto: {free:.1f} GiB free on the GPU / job_memory_gb={memory:g} -> "
                         f"{by_memory}, {ncores} CPU cores, {num_jobs} jobs to run")


def visible_devices_setup() -> list[str]:
    """Shell lines run before each job's controller: the jobs see the devices this process sees
    (submitit's local executor would set ``CUDA_VISIBLE_DEVICES`` from ``gpus_per_node``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ["unset CUDA_VISIBLE_DEVICES"]
    return [f"export CUDA_VISIBLE_DEVICES={shlex.quote(visible)}"]


def _packed_executor_class():
    from submitit.local.local import LocalExecutor

    class PackedExecutor(LocalExecutor):
        """submitit's local executor, starting a job only while fewer than ``slots`` run."""

        slots = 1

        def _submit_command(self, command: str):
            started = self.__dict__.setdefault("_started", [])
            while sum(p.poll() is None for p in started) >= self.slots:
                time.sleep(POLL_S)
            job = super()._submit_command(command)
            started.append(job._process)
            names = getattr(self, "names", [])
            name = f" ({names[len(started) - 1]})" if len(started) <= len(names) else ""
            print(f"[kdrun] job {len(started) - 1}{name} started", flush=True)
            return job

    return PackedExecutor


def check_settings(params: dict) -> None:
    """PackingError for a key that launcher=packed does not have, or a bad value."""
    unknown = sorted(set(params) - SETTINGS)
    if unknown:
        raise PackingError(f"{KEY}.{unknown[0]}: not a setting of launcher=packed (its settings: "
                           f"{', '.join(sorted(SETTINGS))})")
    resolve(params.get("jobs_at_once", "auto"), params.get("job_memory_gb", 6), 1, free_gb=lambda: None)


def packed_submit(launcher: Any) -> Callable[[Sequence[Sequence[str]], int], list]:
    """The function that runs ``launcher``'s unfinished jobs packed (the submitit local launcher of
    conf/launcher/packed.yaml); its settings are checked now, before any job starts."""
    params = launcher.params
    settings = (params.get("jobs_at_once", "auto"), params.get("job_memory_gb", 6))
    try:
        check_settings(params)
    except PackingError as e:  # kdrun's one line and status for a setting the user fixes
        print(f"kdrun: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    def submit(job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
        packing = resolve(*settings, len(job_overrides))
        print(f"[kdrun] {packing.jobs} of {len(job_overrides)} jobs at once ({packing.reason}); sweep directory "
              f"{launcher.config.hydra.sweep.dir}", flush=True)
        started = time.perf_counter()
        executor = _executor(launcher, packing.jobs)
        executor.names = job_names(job_overrides)
        jobs = executor.map_array(launcher, *zip(*_job_args(job_overrides, initial_job_idx)))
        results = _follow(jobs, executor.names, time.perf_counter() - started)
        _drop_template_folder(params["submitit_folder"])
        return results

    return submit


def job_names(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each job by the overrides that set it apart from the sweep's others (``seed=2``)."""
    shared = set.intersection(*(set(o) for o in job_overrides)) if len(job_overrides) > 1 else set()
    return [" ".join(x for x in o if x not in shared) or "the sweep's only job" for o in job_overrides]


def _follow(jobs: list, names: list[str], elapsed: float) -> list:
    """Each job's end and result as it finishes (one line each), then a summary; the jobs' returns."""
    started, pending, ok = time.perf_counter() - elapsed, dict(enumerate(jobs)), 0
    while pending:
        for i in [i for i, job in pending.items() if job.done()]:
            ret = pending.pop(i).results()[0]
            done = getattr(ret.status, "name", str(ret.status)) == "COMPLETED"
            ok += done
            value = f"main metric {ret.return_value:.4f}" if done and isinstance(ret.return_value, float) else ""
            why = "" if done else f"failed: {str(getattr(ret, '_return_value', '') or ret.status)[:200]}"
            print(f"[kdrun] job {i} ({names[i]}) ended after {time.perf_counter() - started:.0f} s: "
                  f"{value or why or 'done'}", flush=True)
        if pending:
            time.sleep(POLL_S)
    print(f"[kdrun] launcher=packed: {ok} of {len(jobs)} jobs done, {len(jobs) - ok} failed, in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return [job.results()[0] for job in jobs]


def _drop_template_folder(folder: str) -> None:
    """submitit makes the folder template's own directory (``…/%j``) besides each job's: remove it
    when it is left empty."""
    template = Path(folder)
    if "%j" in template.name and template.is_dir() and not any(template.iterdir()):
        template.rmdir()


def _executor(launcher: Any, slots: int):
    params = launcher.params
    executor = _packed_executor_class()(folder=params["submitit_folder"],
                                        max_num_timeout=int(params.get("max_num_timeout", 3)))
    executor.slots = slots
    executor.update_parameters(timeout_min=params.get("timeout_min", 120), tasks_per_node=1, gpus_per_node=0,
                               stderr_to_stdout=bool(params.get("stderr_to_stdout", False)),
                               setup=visible_devices_setup())
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    return executor


def _job_args(job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[tuple]:
    """What the submitit launcher's ``__call__`` takes for each job (as its own ``launch`` builds)."""
    from hydra.core.singleton import Singleton

    state = Singleton.get_state()
    return [(list(o), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}", state)
            for i, o in enumerate(job_overrides)]
