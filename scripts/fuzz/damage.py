"""Damage every file of a finished run's cache entries and of an interrupted run's checkpoints, one
at a time, rerun, and count what kdrun did with each.

    python scripts/fuzz/damage.py                     # every file x (truncate, flip, delete)
    python scripts/fuzz/damage.py --fast              # a few files, for the tests

Scenarios (tiny models, so each rerun takes seconds):

* ``task``: the toy task with ``objective=tinybert`` and ``teacher.store=on``: cache entries of kinds
  ``teachers``, ``tokenized`` and ``teacher_outputs``; and an interrupted run (stopped after 4 steps,
  a checkpoint every 3, an evaluation every step of the second stage) whose ``checkpoints/last``
  (step 3) or ``checkpoints/best`` (step 4) is damaged before it is resumed;
* ``partial``: a run killed while it fine-tunes the teacher, in directories whose names hold spaces
  and non-ASCII letters: the teacher entry's ``.partial`` build directory (its checkpoint) is damaged
  before the run is resumed;
* ``augment``: the toy task with TinyBERT's augmentation from a tiny masked LM: ``augmented``;
* ``spans``: MGSKD on the toy task, its chunker trained on a tiny CoNLL-format corpus: ``chunkers`` and
  the tokenised splits with their spans (``tokenized``);
* ``corpus``: task-agnostic distillation on a small text corpus: ``corpus``;
* ``wandb``: the toy task under ``logger=wandb`` (offline), stopped after 4 steps: each file of the
  stopped run's wandb offline directory (``wandb/offline-run-*``: the transaction log, wandb's own
  logs and files) is damaged before the run is resumed.

Each trial copies the scenario's pristine tree, damages one file (cut to half its size, one byte
flipped in place, or deleted) and runs the same command again: a cache file with a fresh run
directory, a checkpoint file by resuming the interrupted run. Every run is forked from a process
that imported kdrun's libraries once (kdrun.runtime.forkrun; ``KDRUN_FORKRUN=0``: a fresh
``python -m kdrun`` each). Outcomes:

* ``rebuilt``: the run finished, printed a one-line ``[kdrun]`` message naming the damage, and its
  student, metrics and metrics log equal the undamaged run's exactly;
* ``refused``: the run stopped with exit status 2 and a ``kdrun: error:`` line naming the damaged
  file or its entry (full path) and what to do;
* ``silently used``: the run finished without a ``[kdrun]`` line about the damaged file or its
  entry (must be 0);
* ``wrong``: the run finished and said so, but its result differs from the undamaged run's;
* ``not read``: a file of wandb's offline directory, which kdrun never opens: the resumed run
  finished identically to the undamaged one, the damaged file's access time shows that nothing read
  it (a deleted one was not needed and not recreated), and the resumed run logged to the same wandb
  run id in a new offline directory whose transaction log reads to its end (what ``wandb sync``
  later does with the damaged file is wandb's; the transaction log's record checksums show a
  damaged record);
* ``unclear failure``: any other exit (a traceback, exit status 1, a message about something else).

Prints one line per trial and the counts, e.g. ``0 silently used``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kdrun.runtime import forkrun, harness

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kill as fk  # noqa: E402  (the run helpers and the exact comparison)

TINY = ["teacher=tiny_random", "student=tiny_random", "logger=none", "train.num_threads=1",
        "train.eval_batch_size=64"]
TOY = ["task=toy", "task.toy.num_train=96", "task.toy.num_validation=32", "teacher.finetune.epochs=1"]
DAMAGES = ("truncate", "flip", "delete")
GOOD = ("rebuilt", "refused", "not read")
MESSAGE_WORDS = ("damaged", "no manifest", "rebuilding", "moved to")
SCENARIOS = ("task", "partial", "augment", "spans", "corpus", "wandb")
TRIAL = "trial run é"  # where each trial reruns: a directory name with a space and a non-ASCII letter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--out", default="outputs/fuzz_damage")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--fast", action="store_true", help="a few (file, damage) pairs per scenario, for the tests")
    p.add_argument("--per-scenario", type=int, default=3, help="with --fast: trials per scenario")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_corpus(path: Path, docs: int = 40, seed: int = 0) -> Path:
    words = "the a river mountain sang bird green sky under over quickly slow light dark city old new".split()
    rng = random.Random(seed)
    lines = []
    for _ in range(docs):
        lines += [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(rng.randint(1, 4))]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_conll(d: Path) -> Path:
    """A tiny chunked corpus in CoNLL-2000's format ('word POS chunk'), for MGSKD's chunker."""
    sents = []
    for det, noun, verb, prep, obj in [(d_, n, v, p, o) for d_ in ("the", "a") for n in ("cat", "dog", "man")
                                       for v in ("sat", "slept") for p in ("on", "near") for o in ("mat", "park")]:
        sents.append([(det, "DT", "B-NP"), (noun, "NN", "I-NP"), (verb, "VBD", "B-VP"), (prep, "IN", "B-PP"),
                      ("the", "DT", "B-NP"), (obj, "NN", "I-NP"), (".", ".", "O")])
    d.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join("\n".join(" ".join(t) for t in s) for s in sents) + "\n"
    for name in ("train.txt", "test.txt"):
        (d / name).write_text(text)
    return d


def make_mlm(out: Path) -> Path:
    if not out.exists():
        maker = Path(__file__).resolve().parents[1] / "setup" / "make_tiny_mlm.py"
        subprocess.run([sys.executable, str(maker), str(out),
                        "--hidden", "32", "--layers", "1", "--intermediate", "64"], env=fk.env(), check=True,
                       stdout=subprocess.DEVNULL)
    return out


def scenario_args(name: str, shared: Path) -> tuple[list[str], list[str]]:
    """(the run's overrides, the cache kinds whose files are damaged)."""
    if name == "task":
        return [*TINY, *TOY, "objective=tinybert", "objective.params.intermediate_epochs=1",
                "objective.params.prediction_epochs=1", "teacher.store=on", "train.checkpoint_every_steps=3",
                "objective.stages.1.eval_every_steps=1"], ["teachers", "tokenized", "teacher_outputs"]
    if name == "partial":  # enough teacher steps for the kill to land in its fine-tuning
        return [*TINY, "task=toy", "task.toy.num_train=160", "task.toy.num_validation=32",
                "teacher.finetune.epochs=4", "objective=logit", "train.epochs=1", "train.checkpoint_every_steps=3"], []
    if name == "augment":
        mlm = make_mlm(shared / "tiny_mlm")
        return [*TINY, *TOY, "objective=two_stage_logit", "train.epochs=1", "augmentation=tinybert",
                f"augmentation.mlm={mlm}", "augmentation.word_vectors=mlm_embeddings", "augmentation.n=2"], \
            ["augmented"]
    if name == "spans":
        conll = write_conll(shared / "conll")
        return [*TINY, *TOY, "objective=mgskd", "objective.params.heads=8", "objective.params.structural_epochs=1",
                "objective.params.prediction_epochs=1", "objective.params.batch_size=16",
                f"spans.corpus_dir={conll}", "+spans.params.epochs=5"], ["chunkers", "tokenized"]
    if name == "corpus":
        corpus = write_corpus(shared / "corpus.txt")
        return [*TINY, "task=text_corpus", f"task.data_files={corpus}", "task.validation_percent=15",
                "task.max_seq_length=24", "objective=distilbert_general", "train.epochs=1",
                "objective.stages.0.batch_size=8"], ["corpus"]
    if name == "wandb":
        return [*[a for a in TINY if a != "logger=none"], "logger=wandb", *TOY, "objective=logit", "train.epochs=2",
                "train.checkpoint_every_steps=3", "logger.log_every_steps=1"], []
    raise SystemExit(f"--scenarios: unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


def kdrun(overrides: list[str], cache: Path, run_dir: Path, log: Path) -> int:
    """``python -m kdrun`` to its end, forked from a process that imported its libraries once
    (kdrun.runtime.forkrun; ``KDRUN_FORKRUN=0``: a fresh process each)."""
    log.unlink(missing_ok=True)
    return forkrun.call(fk.kdrun_args(overrides, cache, run_dir), fk.env(), log)


def entry_files(cache: Path, kinds: list[str]) -> list[Path]:
    """Every file of every published entry of ``kinds`` (not locks, staging or set-aside copies)."""
    out = []
    for kind in kinds:
        for entry in sorted(p for p in (cache / kind).glob("*") if p.is_dir() and not p.name.startswith(".")):
            out += sorted(p for p in entry.rglob("*") if p.is_file())
    return out


def damage(path: Path, how: str) -> bool:
    """Damage ``path`` in place; False when the damage does not apply (an empty file cannot be cut)."""
    size = path.stat().st_size
    if how == "delete":
        path.unlink()
    elif size == 0:
        return False
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    return True


def entry_of(path: Path) -> Path:
    """The directory a damaged file's message names: its cache entry (``<kind>/<key>``, or a build's
    ``.<key>.partial``; a checkpoint inside one: that checkpoint) or its checkpoint directory."""
    parts = path.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] in ("last", "best") and parts[i - 1] == "checkpoints":
            return Path(*parts[:i + 1])
    for i in range(len(parts) - 2, 0, -1):
        if parts[i - 1] == "cache" or parts[i].endswith(".partial"):
            return Path(*parts[:i + 2]) if parts[i - 1] == "cache" else Path(*parts[:i + 1])
    return path.parent


def classify(rc: int, log: str, same: bool, names: tuple[str, ...], unread: bool = False) -> str:
    """The outcome of a rerun by its exit status and what it printed about ``names`` (the damaged
    file's and its entry's full paths): only a line naming one of them counts. ``unread``: the file
    is wandb's, nothing read it and the wandb run went on (see :func:`wandb_untouched`)."""
    lines = log.splitlines()
    if rc == 0:
        said = [line for line in lines if line.startswith("[kdrun]") and any(w in line for w in MESSAGE_WORDS)
                and any(n in line for n in names)]
        if not said:
            return "not read" if unread and same else "silently used"
        return "rebuilt" if same else "wrong"
    errors = [line for line in lines if line.startswith("kdrun: error:")]
    return "refused" if rc == 2 and any(n in line for line in errors for n in names) else "unclear failure"


def mark_unread(path: Path) -> None:
    """Set ``path``'s access time before its modification time: the next read moves it (``relatime``,
    Linux's default, updates an access time older than the modification time)."""
    if path.exists():
        st = path.stat()
        os.utime(path, ns=(st.st_mtime_ns - 60 * 10**9, st.st_mtime_ns))


def was_read(path: Path) -> bool:
    """Whether ``path`` was read since :func:`mark_unread` (a deleted file: whether it is back)."""
    if not path.exists():
        return False
    st = path.stat()
    return st.st_atime_ns >= st.st_mtime_ns


def atime_works(where: Path) -> bool:
    """Whether this file system shows reads in access times (not mounted ``noatime``)."""
    probe = where / ".atime-probe"
    probe.write_bytes(b"x")
    mark_unread(probe)
    probe.read_bytes()
    works = was_read(probe)
    probe.unlink()
    return works


def wandb_untouched(damaged: Path, stopped: Path, run_dir: Path) -> bool:
    """A damaged file of the stopped run's wandb offline directory was not read by the resumed run,
    and the resumed run logged to the same wandb run id in an offline directory of its own, whose
    transaction log reads to its end."""
    if run_dir not in damaged.parents or "wandb" not in damaged.relative_to(run_dir).parts or was_read(damaged):
        return False
    new = [p for p in fk.wandb_logs(run_dir) if not (stopped / p.relative_to(run_dir)).exists()]
    stored = (run_dir / "wandb_id.txt").read_text().strip()
    return len(new) == 1 and fk.wandb_history(new[0])["id"] == stored and fk.wandb_history(new[0])["problem"] is None


def interrupt_teacher(overrides: list[str], cache: Path, run_dir: Path, log: Path) -> Path:
    """Start the run and SIGKILL it once the teacher's fine-tuning has written a checkpoint into its
    entry's ``.partial`` build directory; that directory."""
    with fk.fresh_log(log) as f:
        proc = fk.start(fk.kdrun_command(overrides, cache, run_dir), f)
        while proc.poll() is None:
            found = [p for p in (cache / "teachers").glob(".*.partial")
                     if (p / "checkpoints" / "last" / ".complete").exists()]
            if found:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return found[0]
            time.sleep(0.01)
    raise SystemExit(f"the teacher's fine-tuning ended before a checkpoint could be caught: see {log}")


def prepare(name: str, out: Path) -> dict:
    """The scenario's pristine tree: a finished run (the reference) and, for ``task``, an interrupted
    one; for ``partial``, a run killed while it fine-tunes the teacher."""
    overrides, kinds = scenario_args(name, out)
    base = out / name / ("prístine run ü" if name == "partial" else "pristine")
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    rc = kdrun(overrides, base / "cache", base / "run", base / "reference.log")
    if rc != 0:
        raise SystemExit(f"the undamaged {name} run failed: see {base / 'reference.log'}")
    sc = {"name": name, "overrides": overrides, "kinds": kinds, "base": base,
          "reference": fk.outcome(base / "run")}
    if name in ("task", "wandb"):  # stop after 4 steps: checkpoints/last holds step 3, checkpoints/best step 4
        # made where the trials resume it: cache_dir is part of the run's configuration hash, so a
        # checkpoint moved to another cache path would be refused whatever the damage
        work = out / name / TRIAL
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base / "cache", work / "cache")
        kdrun([*overrides, "train.stop_after_steps=4"], work / "cache", work / "stopped", base / "stopped.log")
        shutil.move(work / "stopped", base / "stopped")
        shutil.rmtree(work)
        for d in ("last", "best")[:2 if name == "task" else 1]:
            if not (base / "stopped" / "checkpoints" / d).exists():
                raise SystemExit(f"the interrupted {name} run left no checkpoints/{d}: see {base / 'stopped.log'}")
    if name == "partial":  # killed where the trials resume it, as the task scenario's stopped run
        work = out / name / TRIAL
        shutil.rmtree(work, ignore_errors=True)
        interrupt_teacher(overrides, work / "killed cache é", work / "killed run é", base / "killed.log")
        for d in ("killed cache é", "killed run é"):
            if (work / d).exists():
                shutil.move(work / d, base / d)
        shutil.rmtree(work)
    return sc


def plain_files(root: Path) -> list[Path]:
    """The files under ``root``, not links nor files reached through one (wandb links its logs)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file()
                  and not any(q.is_symlink() for q in [p, *p.relative_to(root).parents][:-1]))


def targets(sc: dict) -> list[Path]:
    files = entry_files(sc["base"] / "cache", sc["kinds"])
    files += plain_files(sc["base"] / "stopped" / ("wandb" if sc["name"] == "wandb" else "checkpoints"))
    partial = sc["base"] / "killed cache é" / "teachers"
    return files + (sorted(p for d in partial.glob(".*.partial") for p in d.rglob("*") if p.is_file())
                    if partial.exists() else [])


def trial(sc: dict, target: Path, how: str, work: Path) -> tuple[str, str]:
    """Copy the pristine tree, damage one file, rerun; (outcome, the damage line kdrun printed)."""
    if work.exists():
        shutil.rmtree(work)
    top = str(sc["base"])  # the scenario's own logs stay behind (wandb's, deeper down, are copied)
    shutil.copytree(sc["base"], work, ignore=lambda d, names: [n for n in names if d == top and n.endswith(".log")])
    rel = target.relative_to(sc["base"])
    if not damage(work / rel, how):
        return "not applicable", ""
    mark_unread(work / rel)
    if rel.parts[0] == "stopped":  # a checkpoint: resume the interrupted run
        cache, run_dir = work / "cache", work / "stopped"
    elif rel.parts[0] == "killed cache é":  # the teacher's build directory: resume the killed run
        cache, run_dir = work / "killed cache é", work / "killed run é"
    else:
        cache, run_dir = work / "cache", work / "rerun"
    rc = kdrun(sc["overrides"], cache, run_dir, work / "trial.log")
    log = (work / "trial.log").read_text(errors="replace")
    same = rc == 0 and not fk.same(sc["reference"], fk.outcome(run_dir))
    names = (str(work / rel), str(entry_of(work / rel)))
    said = next((line for line in log.splitlines() if (line.startswith("[kdrun]") or line.startswith("kdrun: error"))
                 and any(n in line for n in names)), "")
    unread = rc == 0 and sc["atime"] and wandb_untouched(work / rel, sc["base"] / "stopped", run_dir)
    if unread and rel.suffix == ".wandb" and (work / rel).exists():  # what wandb sync would meet
        said = f"wandb's transaction log: {fk.wandb_records(work / rel)[1] or 'every record checks'}"
    return classify(rc, log, same, names, unread), said


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    rows = []
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    atime = atime_works(out)
    for name in args.scenarios.split(","):
        sc = {**prepare(name, out), "atime": atime}
        pairs = [(t, how) for t in targets(sc) for how in DAMAGES]
        if args.fast:
            pairs = rng.sample(pairs, min(args.per_scenario, len(pairs)))
        for i, (target, how) in enumerate(pairs):
            result, said = trial(sc, target, how, out / name / TRIAL)
            counts[result] = counts.get(result, 0) + 1
            rel = target.relative_to(sc["base"])
            rows.append({"scenario": name, "file": str(rel), "damage": how, "outcome": result, "message": said})
            print(f"[fuzz_damage] {name} {i + 1}/{len(pairs)}: {how} {rel}: {result}"
                  + (f" ({said[:140]})" if said else ""), flush=True)
        shutil.rmtree(out / name / TRIAL, ignore_errors=True)
    total = sum(v for k, v in counts.items() if k != "not applicable")
    print(f"[fuzz_damage] {total} damaged files rerun in {time.perf_counter() - t0:.0f}s: "
          + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("rebuilt", "refused", "not read", "silently used",
                                                           "wrong", "unclear failure")))
    (out / "fuzz_damage.json").write_text(json.dumps({"counts": counts, "trials": rows}, indent=1))
    bad = sum(counts.get(k, 0) for k in ("silently used", "wrong", "unclear failure"))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
