"""``kdrun-augment``: build (or find in the cache) a task's augmented training set and show some of it.

    kdrun-augment task=sst2 task.data_dir=<GLUE dir>/SST-2 augmentation.n=4 [--show 3]

Takes the same Hydra overrides as ``kdrun`` (``augmentation=tinybert`` is implied when no
augmentation is chosen), loads the task's train split as a run would (same ``task.max_train_samples``
subsample and seed), builds the augmented set under ``cache_dir/augmented/<key>`` or reuses it, and
prints the first originals with their variants and the cache path.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

_USAGE = __doc__


def _fail(message: str) -> NoReturn:
    """A user error: the message alone on stderr, exit status 2 (as ``kdrun``)."""
    print(f"kdrun-augment: error: {message}", file=sys.stderr)
    sys.exit(2)


def _split_args(argv: list[str]) -> tuple[list[str], int]:
    overrides, show = [], 3
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            print(_USAGE)
            sys.exit(0)
        if arg == "--show" or arg.startswith("--show="):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            if not value.isdigit():
                _fail("--show takes a number of source rows")
            show = int(value)
        elif arg.startswith("-"):
            _fail(f"unknown option {arg}; options: --show N, --help; everything else is a Hydra override "
                  "(key=value)")
        else:
            overrides.append(arg)
    if not any(o.lstrip("+~").split("=", 1)[0] == "augmentation" for o in overrides):
        overrides.insert(0, "augmentation=tinybert")
    return overrides, show


def _show(ds: Any, source_rows: int) -> None:
    sides = [c for c in ("text_a", "text_b") if c in ds.column_names]
    shown, i = 0, 0
    n = len(ds)
    while i < n and shown < source_rows:
        src = ds[i]["source_idx"]
        group = []
        while i < n and ds[i]["source_idx"] == src:
            group.append(ds[i])
            i += 1
        shown += 1
        head = group[0]
        print(f"\n[source row {src}, label {head['label']}] {len(group) - 1} variant(s)")
        for side in sides:
            print(f"  original {side}: {head[side]}")
        for v, row in enumerate(group[1:], start=1):
            changed = [s for s in sides if row[s] != head[s]] or sides[:1]
            print(f"  variant {v:>3} {changed[0]}: {row[changed[0]]}")


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    overrides, show = _split_args(sys.argv[1:] if argv is None else argv)

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kdrun.config import compose

    try:
        cfg = compose(overrides)
        aug = cfg.augmentation
        n = aug.n  # resolves the task-dependent default
    except (HydraException, OmegaConfBaseException) as e:
        _fail(str(e))

    from kdrun.errors import UserError
    from kdrun.strategies.augment.build import check_augmentation, get_augmented
    from kdrun.tasks.data.sources import check_task_data, load_task_data

    try:
        check_augmentation(aug)
        check_task_data(cfg.task)
        raw = load_task_data(cfg.task)  # the same subsample a run draws (task.sample_seed)
        train = raw[cfg.task.train_split]
        print(f"[kdrun-augment] {cfg.task.name}: {len(train)} training rows; mlm={aug.mlm}, "
              f"word_vectors={aug.word_vectors}, m={aug.m}, n={n}, p_t={aug.p_t}, seed={aug.seed}")
        ds, info = get_augmented(aug, train, cfg.task.name, cfg.cache_dir, device=cfg.train.device)
    except UserError as e:  # augmentation, data and model errors; others keep their traceback
        _fail(str(e))

    if info["cached"]:
        how = "found in the cache"
    else:
        how = f"built in {info['build_s']:.1f}s ({info['sentences_per_s']} sentences/s on {info['device']})"
    print(f"[kdrun-augment] {info['source_rows']} rows -> {info['rows']} rows ({how}); "
          f"augmented rows' label: {info['label']}")
    _show(ds, show)
    print(f"\ncache: {info['path']}")


if __name__ == "__main__":
    main()
