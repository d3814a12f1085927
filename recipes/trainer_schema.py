"""``conf/trainer`` checked against :class:`~trainer.options.TrainerOptions` when Hydra composes.

The schema is derived from the dataclass itself, so it cannot drift from the Trainer: every option is a
key (no ``+`` needed to set one), an unknown key or a value of the wrong type fails at compose time
naming ``trainer.<key>``, and the Trainer's own checks (ranges, choices) still run in
``TrainerOptions.__post_init__``. OmegaConf 2.3 has no unions, so ``int | float`` options (the
``limit_*_batches``, ``val_check_interval``), ``int | dict`` (``accumulate_grad_batches``, ``global_batch_size``) and
``bool | int`` (``fast_dev_run``) are typed ``Any`` here and left to the Trainer, which refuses a bad value before any
process group starts. ``callbacks`` and ``logger`` are not config keys: the recipe builds them from their own groups.

Importing this module registers the schema as ``trainer/options_schema`` in Hydra's ConfigStore;
``conf/trainer/*.yaml`` name it first in their defaults list.

:func:`check_overrides` runs before Hydra composes (``recipes.train.main``): a ``trainer.<key>=...``
override with an unknown key or a value of the wrong type is refused with the key, the closest valid
name and the list of valid keys, which Hydra's own message does not give.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer import options as trainer_options
from trainer.options import TrainerOptions

SCHEMA_NAME = "options_schema"
NOT_CONFIG_KEYS = ("callbacks", "logger")  # objects, built by the recipe from their own config groups
_SCALARS = (bool, int, float, str)
# Command-line flags of a Hydra app that take a value (the value is not an override).
_FLAGS_WITH_VALUE = frozenset(
    {
        "--config-path",
        "-cp",
        "--config-name",
        "-cn",
        "--config-dir",
        "-cd",
        "--package",
        "-p",
        "--experimental-rerun",
        "--cfg",
        "-c",
        "--info",
        "-i",
    }
)


def _omegaconf_type(hint: Any) -> Any:
    """``X`` or ``Optional[X]`` for a scalar ``X``; ``Any`` for what OmegaConf 2.3 cannot express."""
    if hint in _SCALARS:
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1 and members[0] in _SCALARS and len(typing.get_args(hint)) == 2:
            return Optional[members[0]]  # noqa: UP045 - a run-time typing object for OmegaConf, not an annotation
    return Any


def _build_schema() -> type:
    hints = typing.get_type_hints(TrainerOptions)
    fields = [
        (f.name, _omegaconf_type(hints[f.name]), dataclasses.field(default=f.default))
        for f in dataclasses.fields(TrainerOptions)
        if f.name not in NOT_CONFIG_KEYS
    ]
    return dataclasses.make_dataclass("TrainerOptionsSchema", fields)


TrainerOptionsSchema = _build_schema()

ConfigStore.instance().store(group="trainer", name=SCHEMA_NAME, node=TrainerOptionsSchema)


def config_keys() -> list[str]:
    """The ``trainer.<key>`` names the config accepts, in ``TrainerOptions`` order."""
    return [f.name for f in dataclasses.fields(TrainerOptionsSchema)]


def type_name(key: str) -> str:
    """How the schema types ``trainer.<key>``: ``int``, ``float or null``, ``any`` (checked by the Trainer)."""
    hint = {f.name: f.type for f in dataclasses.fields(TrainerOptionsSchema)}[key]
    if hint is Any:
        return "any"
    members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return f"{members[0].__name__} or null" if members else hint.__name__


def override_args(argv: list[str]) -> list[str]:
    """The ``key=value`` overrides among a Hydra app's command-line arguments."""
    found: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-") and "=" in arg:
            found.append(arg)
    return found


def override_values(override: Any) -> list[Any] | None:
    """The values a parsed override sets: one, or each of a sweep's list (``a=1,2``); None for what only Hydra
    expands (ranges, globs, interpolations)."""
    from hydra.core.override_parser.types import ChoiceSweep

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return list(value.list)
    return None if override.is_sweep_override() else [value]


def check_overrides(argv: list[str]) -> str | None:
    """Checks the command line's ``trainer.<key>=value`` overrides against the schema, before composing.

    Sweep values (``trainer.precision=32,bf16-mixed``) are checked one by one; ranges, globs and
    interpolations are left to Hydra. Deleting (``~trainer.<key>``) and group choices
    (``trainer=default``) are not checked.

    Args:
        argv: The arguments after the program name (``sys.argv[1:]``).

    Returns:
        None when every trainer override is valid, else the error message: the override, the key, the
        closest valid key and every valid key.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    overrides = override_args(argv)
    if not any(arg.lstrip("+~").startswith("trainer.") for arg in overrides):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None  # not valid override syntax: Hydra reports it with its own message
    keys = config_keys()
    schema = OmegaConf.structured(TrainerOptionsSchema)
    for override in parsed:
        path = override.key_or_group
        if not path.startswith("trainer.") or override.is_delete():
            continue
        key = path[len("trainer.") :]
        text = override.input_line
        if key.partition(".")[0] == "strategy" and key != "strategy":
            continue  # a setting of the strategy node (trainer/strategy=fsdp): its class checks it
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" Did you mean trainer.{close[0]}?" if close else ""
            lightning = getattr(trainer_options, "LIGHTNING_UNSUPPORTED", {}).get(key)
            if lightning:
                hint = f" It is a Lightning option keel does not support: {lightning}"
            if key in trainer_options.MOVED_TO_STRATEGY:
                cls, arg = trainer_options.MOVED_TO_STRATEGY[key]
                group = "fsdp" if cls == "FSDPStrategy" else "ddp"
                hint = (
                    f" It is now a setting of the strategy object ({cls}): pass trainer/strategy={group} "
                    f"trainer.strategy.{arg}=..."
                )
            return (
                f"Unknown trainer option {path!r} in override {text!r}.{hint}\n"
                f"Valid trainer options (trainer.<key>): {', '.join(keys)}."
            )
        candidates = override_values(override)
        if candidates is None:
            continue
        for candidate in candidates:
            try:
                schema[key] = candidate
            except OmegaConfBaseException as exc:
                reason = str(exc).splitlines()[0]
                return (
                    f"Invalid value for {path} in override {text!r}: {reason}. {path} takes "
                    f"{type_name(key)} (docs/options.md)."
                )
    return None


def options_table() -> str:
    """The Markdown table of ``trainer.<key>`` config types, grouped by type, that docs/configuration.md
    shows (generated there at build time by docs/hooks/options_page.py; ``tests/unit/test_docs.py`` checks it)."""
    by_type: dict[str, list[str]] = {}
    for key in config_keys():
        by_type.setdefault(type_name(key), []).append(f"`{key}`")
    rows = ["| config type | trainer.<key> |", "|---|---|"]
    rows += [f"| {name} | {', '.join(keys)} |" for name, keys in by_type.items()]
    return "\n".join(rows)
