"""LearningRateMonitor: log each optimizer's learning rate (and optionally momentum) per param group."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainer.callback import Callback
from trainer.observability.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

LOGGING_INTERVALS = ("step", "epoch")


def lr_metric_names(optimizers: list[torch.optim.Optimizer]) -> list[list[str]]:
    """Metric names per optimizer and param group, Lightning's scheme.

    ``lr-<OptimizerClass>`` for an optimizer with one param group, ``lr-<OptimizerClass>/pg<i>`` (i from 0)
    for one with several; a second optimizer of the same class gets ``-<n>`` appended to the class part
    (``lr-SGD``, ``lr-SGD-1``), so names never collide.

    Args:
        optimizers: The Trainer's optimizers, in order.

    Returns:
        ``names[i][j]`` is the name of optimizer ``i``'s param group ``j``.
    """
    seen: dict[str, int] = {}
    names: list[list[str]] = []
    for optimizer in optimizers:
        cls = type(optimizer).__name__
        count = seen.get(cls, 0)
        seen[cls] = count + 1
        base = f"lr-{cls}" if count == 0 else f"lr-{cls}-{count}"
        groups = optimizer.param_groups
        names.append([base] if len(groups) == 1 else [f"{base}/pg{j}" for j in range(len(groups))])
    return names


def _momentum(group: dict) -> float | None:
    """SGD/RMSprop ``momentum``, or ``betas[0]`` for the Adam family; None when the optimizer has neither."""
    if "betas" in group:
        return float(group["betas"][0])
    if "momentum" in group:
        return float(group["momentum"])
    return None


class LearningRateMonitor(Callback):
    """Logs the learning rate of every param group of every optimizer through ``trainer.log_metrics``.

    The values are host floats read from ``optimizer.param_groups`` (no device sync, no collective).
    Every rank computes them; ``trainer.log_metrics`` writes on rank 0 only.

    * ``logging_interval="step"``: in ``on_train_batch_end`` of each logging step
      (``trainer.is_logging_step``), at step ``s = trainer.global_step``.
    * ``logging_interval="epoch"``: in ``on_train_epoch_end``, at the current ``global_step``.

    The value is whatever the optimizer holds at that moment. The Trainer steps step-interval schedulers
    right after ``optimizer.step`` and epoch-interval schedulers before the callbacks'
    ``on_train_epoch_end``, so it is the rate the *next* step (epoch) will use: after ``s`` steps of a
    step-interval ``StepLR`` the value at step ``s`` is ``lr * gamma ** (s // step_size)`` (Lightning logs
    the same value, just before the next step).

    Args:
        logging_interval: ``"step"`` or ``"epoch"``.
        log_momentum: Also log ``<lr name>-momentum``: ``momentum`` (SGD, RMSprop) or ``betas[0]``
            (Adam family). Param groups without either are skipped (with one warning).

    Raises:
        ValueError: ``logging_interval`` is not ``"step"`` or ``"epoch"``.
    """

    def __init__(self, logging_interval: Literal["step", "epoch"] = "step", log_momentum: bool = False) -> None:
        if logging_interval not in LOGGING_INTERVALS:
            raise ValueError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): expected one of {LOGGING_INTERVALS}."
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.last_values: dict[str, float] = {}  # the values most recently logged (handy in tests)
        self._warned_momentum = False

    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        if not trainer.loggers:
            rank_zero_warn("LearningRateMonitor: the Trainer has no logger; learning rates are not written anywhere.")

    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if self.logging_interval == "step" and trainer.is_logging_step:
            self._log(trainer)

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer)

    def extract(self, trainer: Trainer) -> dict[str, float]:
        """The current learning rates (and momenta when ``log_momentum``), keyed by metric name."""
        values: dict[str, float] = {}
        missing_momentum: list[str] = []
        for optimizer, names in zip(trainer.optimizers, lr_metric_names(trainer.optimizers)):
            for group, name in zip(optimizer.param_groups, names):
                values[name] = float(group["lr"])
                if self.log_momentum:
                    momentum = _momentum(group)
                    if momentum is None:
                        missing_momentum.append(name)
                    else:
                        values[f"{name}-momentum"] = momentum
        if missing_momentum and not self._warned_momentum:
            self._warned_momentum = True
            rank_zero_warn(
                f"LearningRateMonitor(log_momentum=True): {missing_momentum} have neither 'momentum' nor 'betas'; "
                "their momentum is not logged."
            )
        return values

    def _log(self, trainer: Trainer) -> None:
        values = self.extract(trainer)
        if values:
            self.last_values = values
            trainer.log_metrics(values)
