"""``conf/trainer`` checked against :class:`~trainer.options.TrainerOptions` when Hydra composes.

The schema is derived from the dataclass itself, so it cannot drift from the Trainer: every option is a
key (no ``+`` needed to set one), an unknown key or a value of the wrong type fails at compose time
naming ``trainer.<key>``, and the Trainer's own checks (ranges, choices) still run in
``TrainerOptions.__post_init__``. OmegaConf 2.3 has no unions, so ``int | float`` options (the
``limit_*_batches``) and ``bool | int`` (``fast_dev_run``) are typed ``Any`` here and left to the Trainer.
``callbacks`` and ``logger`` are not config keys: the recipe builds them from their own groups.

Importing this module registers the schema as ``trainer/options_schema`` in Hydra's ConfigStore;
``conf/trainer/*.yaml`` name it first in their defaults list.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from trainer.options import TrainerOptions

SCHEMA_NAME = "options_schema"
NOT_CONFIG_KEYS = ("callbacks", "logger")  # objects, built by the recipe from their own config groups
_SCALARS = (bool, int, float, str)


def _omegaconf_type(hint: Any) -> Any:
    """``X`` or ``Optional[X]`` for a scalar ``X``; ``Any`` for what OmegaConf 2.3 cannot express."""
    if hint in _SCALARS:
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1 and members[0] in _SCALARS and len(typing.get_args(hint)) == 2:
            return Optional[members[0]]
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
