"""Shared test setup: offline, no wandb account, caches and outputs under tmp dirs."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kdrun.runtime.threads import usable_cores  # stdlib only: torch is not imported yet

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist (the suite runs with ``-n auto``, see pyproject.toml) every worker and each
    process it starts (a kdrun run, a script) takes its share of the cores, ``cores // workers``, as
    ``OMP_NUM_THREADS``, set here before any test imports torch: without it each worker's torch and
    each run's would start a thread per core and the workers would thrash (kdrun divides the cores
    only among kdrun runs, not among test workers). A user's own OMP_NUM_THREADS is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // workers))


_share_the_cores_among_workers()

REPO = Path(__file__).resolve().parents[1]
# Real data sets (GLUE, SQuAD, CoNLL-2000, Wikipedia text) for the tests that use them, which skip
# when they are absent: $KDRUN_DATA, else a data/ folder beside the repository's parent folder.
DATA = Path(os.environ.get("KDRUN_DATA") or REPO.parent / "shared" / "data")
GLUE = DATA / "glue"

# Tiny models on a small toy task: a whole run takes seconds.
TINY = [
    "teacher=tiny_random",
    "student=tiny_random",
    "logger=none",
    "teacher.finetune.epochs=1",
    "train.eval_batch_size=64",
]
TOY = ["task=toy", "task.toy.num_train=160", "task.toy.num_validation=64"]


def assert_kept_best(res: dict, metric: str = "accuracy", n: int | None = None, split: str = "validation") -> None:
    """The student's reported dev metric is the best evaluation of the last stage in the run's own history
    (best-checkpoint selection kept that student), and with ``n`` dev examples an accuracy counts them."""
    last = res["stages"][-1]["stage"]
    best = max(e["metrics"][split][metric] for e in res["evals"] if e["stage"] == last)
    value = res["student"]["metrics"][split][metric]
    assert value == pytest.approx(best), (value, res["evals"])
    if res["student"]["selected"]["metric"] == metric:
        assert res["student"]["selected"]["value"] == pytest.approx(best)
    if n is not None:
        assert value * n == pytest.approx(round(value * n)), f"{metric}={value} is no count out of {n}"


def task_objectives() -> list[str]:
    """The shipped objectives for labelled tasks: all but DynaBERT's (4 to 12 sub-networks per batch;
    tests/test_dynabert.py) and the label-free general-distillation ones (corpus tasks only;
    tests/test_general.py)."""
    names = sorted(p.stem for p in (REPO / "conf" / "objective").glob("*.yaml"))
    return [o for o in names if not o.startswith("dynabert") and not o.endswith("_general") and o != "mlm_ckd"]


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` (``name`` e.g. ``bench/store``; the scripts directory is no
    package) to test its functions."""
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compose(overrides: list[str]):
    """The config `kdrun <overrides>` would run, composed with Hydra's API."""
    from kdrun.config import compose as compose_config

    return compose_config(overrides)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def run_cfg(cache_dir: Path):
    """compose() with the tiny setup and a private cache dir."""

    def make(*extra: str, toy: bool = True):
        return compose([*TINY, *(TOY if toy else []), f"cache_dir={cache_dir}", *extra])

    return make


@pytest.fixture
def conll_chunkers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``chunkers`` folder of a kdrun cache that every test of the run (every worker) shares: the POS
    tagger and chunker trained on the real CoNLL-2000 (some 15 s on a 2-core CPU) are trained there
    once, under the cache's own lock, and read by the other tests that need them. A test points its
    cache's ``chunkers`` at it with :func:`share_chunkers`."""
    base = tmp_path_factory.getbasetemp()  # a worker's: popen-gwN in the run's folder, their common parent
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-chunkers"
    shared.mkdir(exist_ok=True)
    return shared


def share_chunkers(cache: Path, chunkers: Path) -> Path:
    """``cache`` (made), with its ``chunkers`` folder the shared one; returns ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "chunkers").symlink_to(chunkers, target_is_directory=True)
    return cache


@pytest.fixture
def no_leftover_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every process the test starts inherits ``KDRUN_TEST_TMP=<tmp_path>`` (tests/procs.py); after the
    test none may be left: they get 30 s to end (wandb's service ends a moment after its run), then
    what is left is killed and the test fails, naming them."""
    from tests import procs

    monkeypatch.setenv(procs.TAG, str(tmp_path))
    yield
    left = procs.wait_gone(lambda: procs.processes_of(tmp_path), timeout=30)
    procs.kill_all(left)
    assert not left, f"processes still running after the test: {left}"


def pytest_configure(config) -> None:
    """kdrun's and the scripts' modules compiled to bytecode once, before the workers start, where
    Python would not write it itself (``PYTHONDONTWRITEBYTECODE`` set, as in some CI images): without
    it each of the several hundred processes the suite starts (kdrun runs, scripts) compiles the ~70
    modules a run imports anew, about 0.25 s of a tiny run's 7.3 s on a 2-core CPU (docs/index.md).
    The setting stops writing, not reading; a bytecode file whose source changed since is not used,
    so what runs is the source; a checkout it cannot write to is left as it is."""
    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return
    import compileall

    for folder in ("kdrun", "scripts"):
        compileall.compile_dir(REPO / folder, quiet=2)


SLOW_TXT = Path(__file__).parent / "slow.txt"
SHARED_SCOPES = ("module", "class", "package")  # fixture scopes whose set-up several tests share


def slow_test_ids() -> frozenset[str]:
    """tests/slow.txt: the node ids (without parameters) of the tests the fast loop leaves out."""
    return frozenset(slow_test_seconds())


def slow_test_seconds(path: Path = SLOW_TXT) -> dict[str, float]:
    """Node id (without parameters) -> the seconds tests/slow.txt gives it (0 where it gives none)."""
    out = {}
    for line in path.read_text().splitlines():
        nid, _, note = (part.strip() for part in line.partition("#"))
        if nid:
            out[nid] = float(note.split()[0]) if note[:1].isdigit() else 0.0
    return out


def shared_setups(item) -> set[tuple[str, str]]:
    """(module, fixture name) of each fixture the test uses that is set up once per module or class."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.items() if info else ()
    return {(item.module.__name__, name) for name, d in defs if d and d[-1].scope in SHARED_SCOPES}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests of tests/slow.txt slow (`python -m pytest -m "not slow"`: the fast loop), and
    with them every test sharing a module-scoped set-up with one: a report times such a set-up in the
    first test that asks for it, which may be another test in another run (another worker, another
    order), and the fast loop must not pay for it through a test left in."""
    slow = slow_test_ids()
    listed = [item for item in items if item.nodeid.split("[")[0] in slow]
    setups = set().union(*map(shared_setups, listed))
    for item in items:
        if item in listed or shared_setups(item) & setups:
            item.add_marker(pytest.mark.slow)


@functools.cache
def makes_shared_setups(module: Path) -> bool:
    """Whether a test module defines a fixture made once per module, class or package (its source
    read, not imported)."""
    if module.suffix != ".py" or not module.is_file():
        return False
    calls = (n for n in ast.walk(ast.parse(module.read_text(encoding="utf-8"))) if isinstance(n, ast.Call))
    return any(getattr(c.func, "attr", getattr(c.func, "id", None)) == "fixture" and any(
        k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in SHARED_SCOPES
        for k in c.keywords) for c in calls)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The suite's distribution over pytest-xdist's workers (``-n auto``, whose default ``--dist load``
    it replaces; another ``--dist`` is left to pytest-xdist). Two changes to sending tests singly:

    * the tests of a module that defines a module- or class-scoped fixture go to one worker together,
      in order, so its set-up is made once: sent singly, a worker that runs another module's test in
      between tears the set-up down and makes it again, and the SLURM tests' cluster, started by one
      worker, could be stopped under a test of the other;
    * the units start longest first by tests/slow.txt's seconds (ties: the unit of more tests first,
      pytest-xdist's own order), so a long test does not start last and leave a worker idle at the end."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    seconds = slow_test_seconds()

    class SharedSetupsLongestFirst(LoadScopeScheduling):
        ordered = False  # the work queue sorted longest first (on the first assignment, when it is whole)

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if makes_shared_setups(config.rootpath / module) else nodeid

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:
                def unit_seconds(unit) -> float:
                    return sum(seconds.get(base, 0.0) for base in {nodeid.split("[")[0] for nodeid in unit[1]})

                units = sorted(self.workqueue.items(), key=unit_seconds, reverse=True)  # stable
                self.workqueue.clear()
                self.workqueue.update(units)
                self.ordered = True
            super()._assign_work_unit(node)

    return SharedSetupsLongestFirst(config, log)
