"""Normalise what ``configure_optimizers`` returns into optimizers and scheduler configs.

Accepted forms (Lightning's):

* an optimizer;
* a list/tuple of optimizers;
* ``(optimizers, schedulers)``: two lists (schedulers may be bare schedulers or config dicts);
* ``{"optimizer": o, "lr_scheduler": s_or_config}`` or a list of such dicts;

where a scheduler config is ``{"scheduler": s, "interval": "step" | "epoch", "frequency": n,
"monitor": key, "strict": bool, "name": str}``. Bare schedulers step every epoch, like Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}
_OPTIMIZER_DICT_KEYS = {"optimizer", "lr_scheduler", "monitor"}


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: Literal["step", "epoch"] = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    return callable(getattr(obj, "step", None)) and callable(getattr(obj, "state_dict", None)) and not _is_optimizer(obj)


def _scheduler_config(item: Any, *, monitor: str | None = None) -> SchedulerConfig:
    if isinstance(item, SchedulerConfig):
        return item
    if isinstance(item, dict):
        unknown = set(item) - _SCHEDULER_KEYS
        if unknown:
            raise ValueError(
                f"configure_optimizers: unknown lr_scheduler key(s) {sorted(unknown)}; valid keys: {sorted(_SCHEDULER_KEYS)}."
            )
        if "scheduler" not in item:
            raise ValueError("configure_optimizers: an lr_scheduler dict needs a 'scheduler' entry.")
        config = SchedulerConfig(
            scheduler=item["scheduler"],
            interval=item.get("interval", "epoch"),
            frequency=item.get("frequency", 1),
            monitor=item.get("monitor", monitor),
            strict=item.get("strict", True),
            name=item.get("name"),
        )
    elif _is_scheduler(item):
        config = SchedulerConfig(scheduler=item, monitor=monitor)
    else:
        raise ValueError(f"configure_optimizers: {type(item).__name__} is not a learning-rate scheduler.")
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"configure_optimizers: lr_scheduler interval={config.interval!r}; expected 'step' or 'epoch'.")
    if isinstance(config.frequency, bool) or not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"configure_optimizers: lr_scheduler frequency={config.frequency!r}; expected an int >= 1.")
    if not _is_scheduler(config.scheduler):
        raise ValueError(f"configure_optimizers: {type(config.scheduler).__name__} is not a learning-rate scheduler.")
    if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and config.monitor is None:
        raise ValueError(
            "configure_optimizers: ReduceLROnPlateau needs a metric; return "
            '{"optimizer": o, "lr_scheduler": {"scheduler": s, "monitor": "val/loss"}}.'
        )
    return config


def _from_dict(item: dict[str, Any]) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    unknown = set(item) - _OPTIMIZER_DICT_KEYS
    if unknown:
        raise ValueError(
            f"configure_optimizers: unknown key(s) {sorted(unknown)}; valid keys: {sorted(_OPTIMIZER_DICT_KEYS)}."
        )
    optimizer = item.get("optimizer")
    if not _is_optimizer(optimizer):
        raise ValueError("configure_optimizers: the dict form needs 'optimizer': a torch.optim.Optimizer.")
    schedulers = []
    if item.get("lr_scheduler") is not None:
        schedulers.append(_scheduler_config(item["lr_scheduler"], monitor=item.get("monitor")))
    return optimizer, schedulers


def parse_optimizers(result: Any) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Turn the return value of ``configure_optimizers`` into ``(optimizers, scheduler configs)``.

    Raises:
        ValueError: naming what was returned and the accepted forms.
    """
    forms = (
        "an optimizer, a list of optimizers, (optimizers, schedulers), "
        '{"optimizer": o, "lr_scheduler": s_or_config}, or a list of such dicts'
    )
    if result is None:
        raise ValueError(f"configure_optimizers returned None; return {forms}.")
    if _is_optimizer(result):
        return [result], []
    if isinstance(result, dict):
        optimizer, schedulers = _from_dict(result)
        return [optimizer], schedulers
    if isinstance(result, (list, tuple)):
        items: Sequence[Any] = result
        if len(items) == 2 and isinstance(items[0], (list, tuple)) and isinstance(items[1], (list, tuple)):
            optimizers = list(items[0])
            if not optimizers or not all(_is_optimizer(o) for o in optimizers):
                raise ValueError(f"configure_optimizers: the first list must hold optimizers; return {forms}.")
            return optimizers, [_scheduler_config(s) for s in items[1]]
        if items and all(_is_optimizer(o) for o in items):
            return list(items), []
        if items and all(isinstance(o, dict) for o in items):
            optimizers, schedulers = [], []
            for entry in items:
                optimizer, entry_schedulers = _from_dict(entry)
                optimizers.append(optimizer)
                schedulers.extend(entry_schedulers)
            return optimizers, schedulers
    raise ValueError(f"configure_optimizers returned {type(result).__name__}; return {forms}.")
