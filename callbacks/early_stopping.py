"""EarlyStopping: stop training when a monitored metric stops improving."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Literal

from trainer.callback import Callback
from trainer.distributed import comm

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

MODES = ("min", "max")
_STATE_KEYS = ("wait_count", "stopped_epoch", "best_score")


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` when ``monitor`` has not improved for ``patience`` checks.

    Where it checks: after each validation run of ``fit`` (``on_validation_epoch_end``; never during the
    sanity check, nor in ``Trainer.validate``), or at ``on_train_epoch_end`` when
    ``check_on_train_epoch_end=True``. With the default ``None`` it checks at the train epoch end only while
    no validation, sanity check included, has run in this fit: a fit without validation data monitors a
    training metric. (A fit whose first validation comes after the first epoch and that has no sanity
    check cannot be told apart from one without validation: pass ``check_on_train_epoch_end=False``.)

    Rank rule (docs/design.md section 7): the value is read from ``trainer.callback_metrics``; in a multi-rank
    run it is rank 0's (see below), so every rank reaches the same decision and stops at the same step.

    A check counts as an improvement when the value beats the best so far by more than ``min_delta``
    (``value < best - min_delta`` for ``"min"``, ``value > best + min_delta`` for ``"max"``); otherwise the
    wait count grows, and training stops when it reaches ``patience``. With ``check_finite`` a NaN or
    infinite value stops training at once, with a log line naming the metric and the value.

    The arguments come in Lightning's positional order, with Lightning's meaning.

    Args:
        monitor: Key of ``trainer.callback_metrics`` (a name passed to ``self.log``, e.g. ``"val/loss"``).
        min_delta: Smallest change (>= 0) that counts as an improvement.
        patience: Checks without improvement before stopping (>= 1).
        verbose: Log each improvement (and the stop) at INFO.
        mode: ``"min"`` (lower is better) or ``"max"``.
        strict: Raise when ``monitor`` is missing from ``trainer.callback_metrics`` at a check; otherwise
            log a warning once and skip the check.
        check_finite: Stop when the monitored value is NaN or infinite.
        stopping_threshold: Stop as soon as the value is better than this (below it for ``"min"``).
        divergence_threshold: Stop as soon as the value is worse than this (above it for ``"min"``).
        check_on_train_epoch_end: True: check at train epoch ends; False: after validation; None: see above.
        log_rank_zero_only: Log the decision on rank 0 only (default: every rank logs it, tagged with its rank).

    In a multi-rank run the checked value is rank 0's (one small broadcast per check), so every rank
    decides the same even for a training metric logged per step (not reduced over ranks).

    Raises:
        ValueError: an invalid ``mode``, ``patience`` or ``min_delta``.
    """

    is_early_stopping = True

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: Literal["min", "max"] = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping(monitor={monitor!r}): expected a metric name.")
        if mode not in MODES:
            raise ValueError(f"EarlyStopping(mode={mode!r}): expected one of {MODES}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}): expected an integer >= 1.")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}): expected a number >= 0.")
        for name, threshold in (
            ("stopping_threshold", stopping_threshold),
            ("divergence_threshold", divergence_threshold),
        ):
            if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
                raise ValueError(f"EarlyStopping({name}={threshold!r}): expected a number or None.")
        for name, flag in (
            ("verbose", verbose),
            ("strict", strict),
            ("check_finite", check_finite),
            ("log_rank_zero_only", log_rank_zero_only),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"EarlyStopping({name}={flag!r}): expected True or False.")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.strict = strict
        self.verbose = verbose
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self.stopped_epoch = -1  # epoch at which this callback stopped training, -1 if it did not
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopping_reason: str | None = None
        self._validated_this_fit = False
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:  # before the sanity check
        self._validated_this_fit = False
        self.stopping_reason = None

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if trainer.state_stage != "fit":  # Trainer.validate(): not part of training
            return
        self._validated_this_fit = True  # the sanity check counts: this fit has validation data
        if trainer.sanity_checking or self.check_on_train_epoch_end:
            return
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if self.check_on_train_epoch_end is False:
            return
        if self.check_on_train_epoch_end is None and self._validated_this_fit:
            return
        self._check(trainer)

    # ------------------------------------------------------------------ decision
    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best_score - self.min_delta
        return value > self.best_score + self.min_delta

    def _check(self, trainer: Trainer) -> None:
        if self.monitor not in trainer.callback_metrics:
            available = sorted(trainer.callback_metrics)
            message = (
                f"EarlyStopping could not find the monitored metric {self.monitor!r} in trainer.callback_metrics; "
                f"available metrics: {available}."
            )
            if self.check_on_train_epoch_end is None and not self._validated_this_fit:
                message += (
                    " It was checked at the end of a training epoch because no validation has run in this "
                    "fit yet; if it is a validation metric, pass check_on_train_epoch_end=False."
                )
            if self.strict:
                raise KeyError(message)
            if not self._warned_missing and trainer.is_global_zero:
                log.warning("%s strict=False: the check is skipped.", message)
            self._warned_missing = True
            return
        # Reduced values are host (CPU) float64 tensors; a per-step training value may be a device tensor
        # of this rank (float() syncs then, at a check only). Rank 0's value decides on every rank.
        value = float(trainer.callback_metrics[self.monitor])
        if trainer.world_size > 1:
            value = float(comm.broadcast_object(value))
        reason: str | None = None
        better = (lambda a, b: a < b) if self.mode == "min" else (lambda a, b: a > b)
        if self.check_finite and not math.isfinite(value):
            reason = (
                f"Monitored metric {self.monitor!r} = {value} is not finite. Previous best value was "
                f"{self.best_score:.6g}. Signaling Trainer to stop."
            )
        elif self.stopping_threshold is not None and better(value, self.stopping_threshold):
            reason = (
                f"Stopping threshold reached: {self.monitor!r} = {value:.6g} {'<' if self.mode == 'min' else '>'} "
                f"{self.stopping_threshold}. Signaling Trainer to stop."
            )
        elif self.divergence_threshold is not None and better(self.divergence_threshold, value):
            reason = (
                f"Divergence threshold reached: {self.monitor!r} = {value:.6g} {'>' if self.mode == 'min' else '<'} "
                f"{self.divergence_threshold}. Signaling Trainer to stop."
            )
        elif self._improved(value):
            if self.verbose and (trainer.is_global_zero or not self.log_rank_zero_only):
                log.info("Metric %r improved from %.6g to %.6g.", self.monitor, self.best_score, value)
            self.best_score = value
            self.wait_count = 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                reason = (
                    f"Monitored metric {self.monitor!r} did not improve in the last {self.wait_count} "
                    f"checks. Best score: {self.best_score:.6g}. Signaling Trainer to stop."
                )
        if reason is not None:
            # Every rank sets it: the value came from the reduced callback_metrics, so all ranks agree.
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason = reason
            if trainer.is_global_zero or not self.log_rank_zero_only:
                level = logging.INFO if math.isfinite(value) else logging.WARNING
                log.log(level, "[epoch %d, step %d] %s", trainer.current_epoch, trainer.global_step, reason)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wait count and best score (``patience`` and the other arguments stay as constructed).

        Raises:
            KeyError: ``state`` lacks a key or has an unknown one (both named).
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if missing or unknown:
            raise KeyError(f"EarlyStopping.load_state_dict: missing keys {missing}, unknown keys {unknown}.")
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = float(state["best_score"])
