"""LearningRateMonitor: log each optimizer's learning rate (and optionally momentum and weight decay) per
param group, with Lightning 2.6's names, hooks and steps."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainer.callback import Callback
from trainer.observability.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.step.optim import SchedulerConfig
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

LOGGING_INTERVALS = (None, "step", "epoch")


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper that holds it as ``.optimizer`` (Lightning's LightningOptimizer)."""
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def _group_names(name: str, optimizer: Any) -> list[str]:
    """``name`` per param group: ``name/<group's "name">`` when the group has one, else ``name/pg<j>`` (j from 1)
    with several groups, else ``name``."""
    groups = optimizer.param_groups
    labels = [group.get("name", f"pg{j}") for j, group in enumerate(groups, start=1)]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"LearningRateMonitor: {name} has several param groups named {repeated}; give each param group of one "
            "optimizer its own 'name'."
        )
    if len(groups) > 1:
        return [f"{name}/{label}" for label in labels]
    named = groups[0].get("name") if groups else None
    return [f"{name}/{named}" if named else name for _ in groups]


def lr_entries(
    optimizers: Sequence[Any], scheduler_configs: Iterable[SchedulerConfig] = ()
) -> list[tuple[Any, str | None, list[str]]]:
    """``(optimizer, scheduler interval or None, names per param group)`` in Lightning 2.6's order and names.

    First one entry per scheduler config (its optimizer, its ``interval``), named by the config's ``name`` or
    ``lr-<OptimizerClass>``; then the optimizers no scheduler drives (interval None), ``lr-<OptimizerClass>``.
    A class seen again gets ``-<n>`` appended (``lr-SGD``, ``lr-SGD-1``); param groups add ``/<group name>`` or,
    with several groups, ``/pg<j>`` counted from 1 (``lr-Adam/pg1``, ``lr-Adam/pg2``).

    Raises:
        ValueError: two param groups of one optimizer share a ``name``.
    """
    seen_types: dict[type, int] = {}
    seen: list[Any] = []
    entries: list[tuple[Any, str | None, list[str]]] = []

    def add(optimizer: Any, name: str | None, interval: str | None) -> None:
        seen.append(optimizer)
        cls = type(optimizer)
        if name is None:
            seen_types[cls] = seen_types.get(cls, 0) + 1
        base = name if name is not None else f"lr-{cls.__name__}"
        count = seen_types.get(cls, 0)
        entries.append((optimizer, interval, _group_names(base if count <= 1 else f"{base}-{count - 1}", optimizer)))

    for config in scheduler_configs:
        optimizer = getattr(config.scheduler, "optimizer", None)
        if optimizer is not None:
            add(optimizer, config.name, config.interval)
    for optimizer in (_unwrap(o) for o in optimizers):
        if not any(optimizer is s for s in seen):
            add(optimizer, None, None)
    return entries


def lr_metric_names(optimizers: Sequence[Any], scheduler_configs: Iterable[SchedulerConfig] = ()) -> list[list[str]]:
    """The metric names of :func:`lr_entries`, one list per entry (param groups in order)."""
    return [names for _, _, names in lr_entries(optimizers, scheduler_configs)]


class LearningRateMonitor(Callback):
    """Logs the learning rate of every param group of every optimizer through ``trainer.log_metrics``, as
    Lightning 2.6's ``LearningRateMonitor`` does (names: :func:`lr_entries`).

    When (``s`` = ``trainer.global_step``, the number of optimizer steps done):

    * at the start of the batch that begins optimizer step ``s + 1`` when it completes a logging step
      (``(s + 1) % log_every_n_steps == 0``, or ``should_stop`` is set), at step ``s``: the rate that step uses,
      next to that step's metrics (logged at ``s`` too, docs/tracking.md);
    * at the start of every training epoch, at step ``s``.

    ``logging_interval=None`` (the default): optimizers driven by a ``"step"``-interval scheduler are logged at the
    batch starts, those driven by an ``"epoch"``-interval scheduler at the epoch starts, and optimizers without a
    scheduler at both. ``"step"`` / ``"epoch"``: every optimizer at the batch starts only / the epoch starts only.

    Under gradient accumulation the values are logged once per optimizer step, at its first micro-batch
    (Lightning writes the same values again at every micro-batch of the window).

    The values are host floats read from ``optimizer.param_groups`` (no device sync, no collective) and are also
    put in ``trainer.callback_metrics``. Every rank computes them; ``trainer.log_metrics`` writes on rank 0 only.

    Args:
        logging_interval: None, ``"step"`` or ``"epoch"``.
        log_momentum: Also log ``<lr name>-momentum``: ``betas[0]`` for optimizers with ``betas`` (Adam family),
            else the group's ``momentum``, 0 when it has none (with a warning at the start of training).
        log_weight_decay: Also log ``<lr name>-weight_decay``, the group's ``weight_decay`` (0 when it has none).

    Raises:
        ValueError: ``logging_interval`` is not None, ``"step"`` or ``"epoch"``.
    """

    def __init__(
        self,
        logging_interval: Literal["step", "epoch"] | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in LOGGING_INTERVALS:
            raise ValueError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): expected one of {LOGGING_INTERVALS}."
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}  # every logged rate per name (Lightning's attribute)
        self.last_values: dict[str, float] = {}  # the values most recently logged (handy in tests)
        self._batch_logged_at: int | None = None  # global_step of the last batch-start log (one per window)

    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        if not trainer.loggers:
            rank_zero_warn("LearningRateMonitor: the Trainer has no logger; learning rates are not written anywhere.")
        self._batch_logged_at = None
        if self.log_momentum:
            optimizers = [getattr(c.scheduler, "optimizer", None) for c in trainer.lr_scheduler_configs] or [
                _unwrap(o) for o in trainer.optimizers
            ]
            lacks = [type(o).__name__ for o in optimizers if o is not None and not _has_momentum(o)]
            if lacks:
                rank_zero_warn(
                    f"LearningRateMonitor(log_momentum=True): {sorted(set(lacks))} have neither 'momentum' nor "
                    "'betas'; their momentum is logged as 0."
                )
        names = lr_metric_names(trainer.optimizers, trainer.lr_scheduler_configs)
        self.lrs = {name: [] for group_names in names for name in group_names}

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None:
        if self.logging_interval == "epoch":
            return
        step = trainer.global_step
        every = 1 if trainer.fast_dev_run else trainer.log_every_n_steps
        if step == self._batch_logged_at or ((step + 1) % every != 0 and not trainer.should_stop):
            return
        self._batch_logged_at = step
        self._log(trainer, "step" if self.logging_interval is None else "any", step)

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else "any", trainer.global_step)

    def extract(self, trainer: Trainer, interval: str = "any") -> dict[str, float]:
        """The current rates (and momenta / weight decays when asked), keyed by metric name. ``interval``:
        ``"step"`` / ``"epoch"`` keep the optimizers of schedulers with that interval (and those without a
        scheduler); ``"any"`` keeps all."""
        return self._stats(trainer, interval)[0]

    def _stats(self, trainer: Trainer, interval: str) -> tuple[dict[str, float], list[str]]:
        values: dict[str, float] = {}
        lr_names: list[str] = []
        for optimizer, sched_interval, names in lr_entries(trainer.optimizers, trainer.lr_scheduler_configs):
            if sched_interval is not None and interval not in (sched_interval, "any"):
                continue
            betas = "betas" in getattr(optimizer, "defaults", {})
            for group, name in zip(optimizer.param_groups, names):
                values[name] = float(group["lr"])
                lr_names.append(name)
                if self.log_momentum:
                    values[f"{name}-momentum"] = float(group["betas"][0] if betas else group.get("momentum", 0))
                if self.log_weight_decay:
                    values[f"{name}-weight_decay"] = float(group.get("weight_decay", 0))
        return values, lr_names

    def _log(self, trainer: Trainer, interval: str, step: int) -> None:
        values, lr_names = self._stats(trainer, interval)
        if not values:
            return
        for name in lr_names:
            if name not in self.lrs:  # a group added later (lr-Adam became lr-Adam/pg1) keeps its history
                old = name.replace("/pg1", "")
                self.lrs[name] = self.lrs.pop(old) if "/pg1" in name and old in self.lrs else []
            self.lrs[name].append(values[name])
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})
        self.last_values = values
        trainer.log_metrics(values, step=step)


def _has_momentum(optimizer: Any) -> bool:
    defaults = getattr(optimizer, "defaults", {})
    return "momentum" in defaults or "betas" in defaults
