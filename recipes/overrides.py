"""The command line's overrides outside ``trainer.*`` checked against the composed config, before Hydra runs.

Hydra's own messages point the wrong way for the mistakes users make most: a misspelled key (``ckpt_pth=last``,
``task.hiden=3``) gets "To append to your config use +ckpt_pth=last", which silently adds a key nothing reads; a
misspelled group choice (``logger=tensorbord``) prints the config search path; a value of the wrong type
(``data.batch_size=abc``) is accepted and fails deep inside a DataLoader with a traceback. Each becomes one line
here, naming the override, the key or choice that is closest and the valid ones. ``trainer.*`` keys are checked
against their schema by :func:`recipes.trainer_schema.check_overrides`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from recipes.config_dir import config_dir
from recipes.trainer_schema import override_values

# Keys whose value is free-form in the config (a path, a name, a checkpoint spec): any type goes.
_ANY_TYPE = frozenset({"ckpt_path", "name", "output_dir"})


def _close(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1)
    return f" Did you mean {match[0]}?" if match else ""


def _group_dir(group: str) -> Path | None:
    """``conf/<group>`` when ``group`` (``logger``, ``trainer/strategy``) is one of keel's config groups."""
    path = Path(config_dir()) / group
    return path if path.is_dir() else None


def _choices(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _check_choice(group: str, folder: Path, values: list[Any], text: str) -> str | None:
    choices = _choices(folder)
    for value in values:
        if value is not None and str(value) not in choices:
            return (
                f"Unknown choice {value!r} for the config group {group} in override {text!r}."
                f"{_close(str(value), choices)} Choices ({folder.name}/*.yaml): {', '.join(choices)}."
            )
    return None


def _check_key(cfg: DictConfig, key: str, text: str) -> tuple[str | None, Any]:
    """(an error for a key the config does not have, the value the config has there)."""
    node: Any = cfg
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
            return None, None  # under a list or an unset node: Hydra decides
        if part not in node:
            where = ".".join(walked)
            keys = sorted(str(k) for k in node.keys())
            scope = f"{where}.<key>" if where else "top-level keys"
            hint = _close(part, keys)
            if hint:
                hint = hint.replace("mean ", f"mean {where + '.' if where else ''}")
            return (
                f"Unknown config key {key!r} in override {text!r}.{hint} Valid {scope}: {', '.join(keys)}. "
                f"To add a new key on purpose, write +{text}.",
                None,
            )
        walked.append(part)
        node = node._get_node(part)
    return None, node._value() if hasattr(node, "_value") else node


def _fits(current: Any, value: Any) -> bool:
    """Whether ``value`` can stand where the config holds ``current`` (a number for a number, a bool for a bool)."""
    if value is None or isinstance(value, (dict, list)):
        return True
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _check_type(key: str, current: Any, values: list[Any], text: str) -> str | None:
    """A value whose type cannot be what the config holds there (a word where a number is)."""
    if key.split(".")[-1] in _ANY_TYPE:
        return None
    for value in values:
        if not _fits(current, value):
            kind = "true or false" if isinstance(current, bool) else "a number"
            return f"Invalid value {value!r} for {key} in override {text!r}: it takes {kind} (it is {current!r} now)."
    return None


def check_config_overrides(overrides: list[str]) -> str | None:
    """None when every override outside ``trainer.*`` and ``hydra`` names a key, a group choice and a value type
    the config has; else the one-line message for the first that does not.

    The config is composed with the command line's group choices (``logger=csv``, ``+experiment=charlm``), so a key
    an experiment adds is known. Sweeps (``a=1,2``) are checked value by value; ranges, globs and interpolations,
    ``++key`` (force-add) and ``+key`` (add) are left to Hydra.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None  # not valid override syntax: Hydra reports it with its own message
    choices, values = [], []
    # A user's own config folders (hydra.searchpath) may hold choices keel's conf/ lacks: compose with them.
    searchpath = [o.input_line for o in parsed if o.key_or_group == "hydra.searchpath"]
    for override in parsed:
        path = override.key_or_group
        if path.startswith(("hydra", "trainer.")) or path == "trainer":
            continue
        candidates = override_values(override)
        if candidates is None:
            continue
        folder = _group_dir(path.split("@")[0])
        if folder is not None:
            error = _check_choice(path.split("@")[0], folder, candidates, override.input_line)
            if error and not searchpath:
                return error
            if not override.is_delete():
                choices.append(override.input_line)
        elif not override.is_add() and not override.is_force_add():
            values.append((override, candidates))
    if not values:
        return None
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="keel_check"):
            cfg = compose("train", overrides=[*searchpath, *choices])
    except HydraException:
        return None  # Hydra reports what is wrong with the choices
    for override, candidates in values:
        key, text = override.key_or_group, override.input_line
        error, current = _check_key(cfg, key, text)
        if error is None and not override.is_delete():
            error = _check_type(key, current, candidates, text)
        if error:
            return error
    return None
