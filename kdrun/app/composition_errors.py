"""Hydra's composition errors as kdrun's one line: what was given, the closest valid choices and
where to list them.

Hydra reports an unknown option with every option and its config search path, an unknown key with
its internal types and a ``+key=value`` suggestion that kdrun's schema would refuse. kdrun reads the
error (its message and cause) and says it in one line; an error it does not recognise is left to
Hydra's own wording.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any, Iterable

LIST_THEM = "kdrun --help lists the groups and their options"
SHOW_KEYS = "kdrun --cfg job shows every key"
# Groups that --help lists but a command does not choose directly: who includes them.
INCLUDED_GROUPS = {"model": "teacher= and student= (e.g. teacher=bert_base student=bert_L4_H256)",
                   "experiment/base": "experiment= (e.g. experiment=ckd_cola)"}
# Options that do not exist but name a setting of one that does: (pattern, what to write) per group.
OPTION_HINTS = {"logger": [(r"wandb[_-]?(offline|disabled)", "logger=wandb logger.mode={0}")]}


def _closest(word: str, choices: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(word, sorted(set(choices)), n=3, cutoff=0.6)


def _did_you_mean(found: list[str]) -> str:
    return f"; did you mean {' or '.join(found)}?" if found else ""


def unknown_option(message: str) -> str | None:
    """``Could not find 'objective/logits'`` (with Hydra's list of the group's options)."""
    found = re.search(r"Could not find '([\w/]+)/([^'/]+)'", message)
    if not found:
        return None
    group, option = found.groups()
    listed = message.split(f"Available options in '{group}':", 1)
    options = re.findall(r"^\t(\S+)$", listed[1], re.M) if len(listed) == 2 else []
    matches = _option_hint(group, option) or [f"{group}={o}" for o in _closest(option, options)]
    if not matches and options:
        return f"{group}={option}: no such option of {group}; its options are {', '.join(options)} ({LIST_THEM})"
    return f"{group}={option}: no such option of {group}{_did_you_mean(matches)} ({LIST_THEM})"


def _option_hint(group: str, option: str) -> list[str]:
    """What an option that names a key's value means (``logger=wandb_offline``), else []."""
    for pattern, meaning in OPTION_HINTS.get(group, ()):
        found = re.fullmatch(pattern, option)
        if found:
            return [meaning.format(*found.groups())]
    return []


def unknown_group(message: str, groups: Iterable[str]) -> str | None:
    """``Could not override 'model'. No match in the defaults list.``: a group kdrun does not choose
    directly, or a misspelt one."""
    found = re.search(r"Could not override '([\w/]+)'\. No match in the defaults list", message)
    if not found:
        return None
    group = found.group(1)
    if group in INCLUDED_GROUPS:
        return f"{group}= is not chosen on its own: its options are chosen through {INCLUDED_GROUPS[group]}"
    matches = [f"{g}=" for g in _closest(group, groups)]
    return f"{group}: no such config group{_did_you_mean(matches)} ({LIST_THEM})"


def unknown_key(message: str, keys_at: Any, groups: Iterable[str] = ()) -> str | None:
    """``Could not override 'task.max_train_sample'`` with the cause ``Key ... not in 'TaskConfig'``
    (a typed node: no ``+`` helps) or ``... is not in struct`` of a plain dict (``+key=`` adds it)."""
    found = re.search(r"Could not override '([^']+)'\.", message)
    if not found:
        return None
    key = found.group(1)
    if re.search(r"Key '[^']+' is not in struct\s+full_key: \S+\s+object_type=dict", message):
        parent = key.rpartition(".")[0]
        return f"{key}: not set in {parent or 'the config'}; add it with +{key}=<value> ({SHOW_KEYS})"
    missing = re.search(r"Key '[^']+' not in '\w+'\s+full_key: (\S+)", message)
    first = missing.group(1) if missing and key.startswith(missing.group(1)) else key
    parent, rest = first.rpartition(".")[0], key[len(first):]
    value = re.search(r"use \+[^=\s]+=(\S+)", message)
    suggestions = []
    for leaf in _closest(first.rpartition(".")[2], keys_at(parent)):  # by the leaf: parents would all match
        k = f"{parent}.{leaf}" if parent else leaf
        group_choice = not parent and not rest and k in set(groups) and value
        suggestions.append(f"{k}={value.group(1)}" if group_choice else k + rest)
    if not suggestions and not parent and not rest:  # optimizer=adam: a key further down
        suggestions = _further_down(first, keys_at, value.group(1) if value else None)
    return f"{key}: no such key in {parent or 'the config'}{_did_you_mean(suggestions)} ({SHOW_KEYS})"


def _further_down(word: str, keys_at: Any, value: str | None) -> list[str]:
    """Keys below the top whose own name is close to ``word`` (``optimizer``: train.optimizer and
    teacher.finetune.optimizer), as ``key.name=value`` where the key is a choice by name."""
    found = []
    for path in _paths(keys_at, "", depth=3):
        if "." in path and _closest(word, [path.rpartition(".")[2]]):
            choice = f"{path}.name" if "name" in keys_at(path) else path
            found.append(f"{choice}={value}" if value is not None else choice)
    return sorted(found, key=lambda k: k.count("."))[:3]


def _paths(keys_at: Any, parent: str, depth: int) -> list[str]:
    """The dotted keys of the config below ``parent``, ``depth`` levels down."""
    if depth == 0:
        return []
    out = []
    for leaf in keys_at(parent):
        path = f"{parent}.{leaf}" if parent else leaf
        out += [path, *_paths(keys_at, path, depth - 1)]
    return out


def bad_value(message: str) -> str | None:
    """``Value 'abc' of type 'str' could not be converted to Float`` (full_key: train.lr), or a value
    outside a key's closed set of choices (``Invalid value 'bf17', expected one of [...]``)."""
    choice = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]\s+full_key: (\S+)", message)
    if choice:
        value, listed, key = choice.groups()
        options = [o.strip() for o in listed.split(",")]
        return (f"{key}={value!r}: not one of {', '.join(options)}"
                f"{_did_you_mean([f'{key}={o}' for o in _closest(value, options)])}")
    boolean = re.search(r"Value '([^']*)' is not a valid bool \(type \w+\)\s+full_key: (\S+)", message)
    if boolean:
        return f"{boolean.group(2)}={boolean.group(1)!r}: expected a boolean: true or false"
    found = re.search(r"Value '([^']*)' of type '\w+' could not be converted to (\w+)\s+full_key: (\S+)", message)
    if not found:
        return None
    value, kind, key = found.groups()
    return f"{key}={value!r}: expected {kind.lower()} ({SHOW_KEYS})"


def one_line(error: BaseException, groups: Iterable[str] = (), keys_at: Any = lambda _p: []) -> str | None:
    """The one-line message (without ``kdrun: error: ``) for a composition error, or None."""
    message = f"{error}\n{error.__cause__ or ''}"
    groups = list(groups)
    return (unknown_option(message) or unknown_group(message, groups) or bad_value(message)
            or unknown_key(message, keys_at, groups))


def plus_key_error(overrides: list[str]) -> str | None:
    """The one-line message (without ``kdrun: error: ``) for the first ``+key=value`` that adds a key
    outside the free-form dictionaries (Hydra would add it and kdrun ignore it), or None."""
    plus = [o for o in overrides if o.startswith("+") and "=" in o]
    if not plus:
        return None
    fixed = [o for o in overrides if not o.startswith(("+", "~", "hydra.")) and "," not in o]
    cfg = composed(tuple(fixed)) or composed(())
    groups = set(config_groups())
    return next((line for o in plus if (line := plus_key(o, cfg, groups))), None) if cfg is not None else None


def plus_key(override: str, cfg: Any, groups: Iterable[str] = ()) -> str | None:
    """What is wrong with ``+key=value`` (``++key=value``: set or add) on the config ``cfg``: a key the
    typed schema lacks (with the closest keys), or one it has (drop the ``+``); None for Hydra's own
    keys, a config group and any key under a free-form dictionary (``train.optimizer.kwargs``)."""
    added, value = override.split("=", 1)
    key = added.lstrip("+")
    if key.split(".")[0] == "hydra" or key in set(groups) or any(c in key for c in "/@["):
        return None
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        if not _typed(node):
            return None
        if part not in node.keys():
            close = [f"{parent}.{k}" if parent else k for k in _closest(part, node.keys())]
            rest = ".".join(parts[i + 1:])
            fixes = [f"{k}.{rest}={value}" if rest else f"{k}={value}" for k in close]
            return (f"{override}: no such key in {parent or 'the config'}, and + adds keys only under free-form "
                    f"dictionaries such as train.optimizer.kwargs{_did_you_mean(fixes)} ({SHOW_KEYS})")
        node = _child(node, part)
    if added.startswith("++"):
        return None
    return f"{override}: {key} is a key of the config already; set it without the +: {key}={value}"


def _typed(node: Any) -> bool:
    """Whether a config node is one of the schema's dataclasses (its keys fixed)."""
    from dataclasses import is_dataclass

    from omegaconf import DictConfig, OmegaConf

    return isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node))


def _child(node: Any, key: str) -> Any:
    """The child node ``key`` of a typed node; a typed child that is null as its schema's defaults."""
    from dataclasses import is_dataclass

    from omegaconf import OmegaConf

    child = node._get_node(key)
    ref = child._metadata.ref_type
    if child._is_none() and is_dataclass(ref):
        return OmegaConf.structured(ref)
    return child


def config_groups() -> list[str]:
    """kdrun's config groups (the packaged conf/ directory's subdirectories, nested ones as a/b)."""
    from importlib.resources import files

    root = files("kdrun.conf")
    found = []
    for entry in root.iterdir():
        if entry.is_dir() and not entry.name.startswith("_"):
            found.append(entry.name)
            found += [f"{entry.name}/{sub.name}" for sub in entry.iterdir() if sub.is_dir()
                      and not sub.name.startswith("_")]
    return sorted(found)


def keys_at(parent: str, overrides: list[str]) -> list[str]:
    """The keys of the composed config at ``parent`` ("" for the top), composed with the command's
    group choices (so ``objective.params`` is the chosen objective's)."""
    from omegaconf import DictConfig, OmegaConf

    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0] and not o.startswith(("+", "~"))]
    cfg = composed(tuple(choices)) or composed(())
    node = (OmegaConf.select(cfg, parent) if parent else cfg) if cfg is not None else None
    return list(node.keys()) if isinstance(node, DictConfig) else []


@functools.lru_cache(maxsize=4)
def composed(overrides: tuple[str, ...]) -> Any:
    """The config of these overrides, or None when they do not compose (composed once per process)."""
    from kdrun.config import compose

    try:
        return compose(list(overrides))
    except Exception:  # noqa: BLE001 - the caller falls back to the defaults
        return None
