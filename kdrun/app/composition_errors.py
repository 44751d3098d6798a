"""Hydra's composition errors as kdrun's one line: what was given, the closest valid choices and
where to list them.

Hydra reports an unknown option with every option and its config search path, an unknown key with
its internal types and a ``+key=value`` suggestion that kdrun's schema would refuse. kdrun reads the
error (its message and cause) and says it in one line; an error it does not recognise is left to
Hydra's own wording.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Iterable

LIST_THEM = "kdrun --help lists the groups and their options"
SHOW_KEYS = "kdrun --cfg job shows every key"
# Groups that --help lists but a command does not choose directly: who includes them.
INCLUDED_GROUPS = {"model": "teacher= and student= (e.g. teacher=bert_base student=bert_L4_H256)",
                   "experiment/base": "experiment= (e.g. experiment=ckd_cola)"}


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
    matches = [f"{group}={o}" for o in _closest(option, options)]
    return f"{group}={option}: no such option of {group}{_did_you_mean(matches)} ({LIST_THEM})"


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
    return f"{key}: no such key in {parent or 'the config'}{_did_you_mean(suggestions)} ({SHOW_KEYS})"


def bad_value(message: str) -> str | None:
    """``Value 'abc' of type 'str' could not be converted to Float`` (full_key: train.lr), or a value
    outside a key's closed set of choices (``Invalid value 'bf17', expected one of [...]``)."""
    choice = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]\s+full_key: (\S+)", message)
    if choice:
        value, listed, key = choice.groups()
        options = [o.strip() for o in listed.split(",")]
        return (f"{key}={value!r}: not one of {', '.join(options)}"
                f"{_did_you_mean([f'{key}={o}' for o in _closest(value, options)])}")
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

    from kdrun.config import compose

    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0] and not o.startswith(("+", "~"))]
    for attempt in (choices, []):
        try:
            node = OmegaConf.select(compose(attempt), parent) if parent else compose(attempt)
        except Exception:  # noqa: BLE001 - a choice that does not compose: try the defaults
            continue
        return list(node.keys()) if isinstance(node, DictConfig) else []
    return []
