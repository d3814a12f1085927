"""Timer: stop training once a wall-clock budget is spent; the budget survives a resume."""

from __future__ import annotations

import datetime
import logging
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

from trainer.callback import Callback
from trainer.distributed import comm

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

INTERVALS = ("step", "epoch")
_DHMS = re.compile(r"(\d+):(\d+):(\d+):(\d+(?:\.\d*)?)")
_TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def parse_duration(duration: Any) -> float | None:
    """Seconds in ``duration``: None, a number of seconds, ``"DD:HH:MM:SS"``, a ``timedelta``, or a dict
    of ``timedelta`` keywords (``{"days": 1, "hours": 12}``).

    Raises:
        ValueError: anything else, or a negative or non-finite duration; the message names the value.
    """
    if duration is None:
        return None
    if isinstance(duration, datetime.timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, bool):
        raise ValueError(f"Timer(duration={duration!r}): expected seconds, 'DD:HH:MM:SS', a timedelta or a dict.")
    elif isinstance(duration, (int, float)):
        seconds = float(duration)
    elif isinstance(duration, str):
        match = _DHMS.fullmatch(duration.strip())
        if match is None:
            raise ValueError(
                f"Timer(duration={duration!r}): a string duration must be 'DD:HH:MM:SS' (e.g. '00:12:00:00')."
            )
        days, hours, minutes, secs = match.groups()
        seconds = datetime.timedelta(
            days=int(days), hours=int(hours), minutes=int(minutes), seconds=float(secs)
        ).total_seconds()
    elif isinstance(duration, Mapping):
        unknown = sorted(str(k) for k in duration if k not in _TIMEDELTA_KEYS)
        if unknown:
            raise ValueError(
                f"Timer(duration={dict(duration)!r}): unknown keys {unknown}; expected some of {_TIMEDELTA_KEYS}."
            )
        try:
            seconds = datetime.timedelta(**duration).total_seconds()
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"Timer(duration={dict(duration)!r}): {exc}.") from None
    else:
        raise ValueError(
            f"Timer(duration={duration!r}) ({type(duration).__name__}): expected None, seconds, 'DD:HH:MM:SS', a "
            "timedelta or a dict such as {'days': 1, 'hours': 12}."
        )
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"Timer(duration={duration!r}): expected a finite duration >= 0, got {seconds} s.")
    return seconds


class Timer(Callback):
    """Stops ``fit`` at a step (or epoch) boundary once the training time exceeds ``duration``.

    Training time runs from ``on_train_start`` to ``on_train_end`` (validation inside ``fit`` included),
    plus the time already spent before a resume: the elapsed time is saved in checkpoints
    (:meth:`state_dict`), so a resumed run continues the same budget.

    When it checks (docs/design.md sections 7 and 11): rank 0's clock decides, and its elapsed time is sent to
    every rank with ``broadcast_object`` (a collective), so all ranks stop at the same step. It therefore
    checks only at points every rank reaches together and never on every step:

    * ``interval="step"``: at logging steps (``trainer.is_logging_step``; in a single process, where the
      broadcast is free, after every optimizer step) and at every epoch end;
    * ``interval="epoch"``: at epoch ends.

    Args:
        duration: None (no limit), seconds, ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of ``timedelta``
            keywords such as ``{"days": 1, "hours": 12}``.
        interval: ``"step"`` or ``"epoch"``.

    Raises:
        ValueError: an invalid ``duration`` or ``interval``, naming it.
    """

    def __init__(
        self,
        duration: float | str | datetime.timedelta | Mapping[str, float] | None = None,
        interval: Literal["step", "epoch"] = "step",
    ) -> None:
        if interval not in INTERVALS:
            raise ValueError(f"Timer(interval={interval!r}): expected one of {INTERVALS}.")
        self.duration = parse_duration(duration)
        self.interval = interval
        self._offset = 0.0  # training seconds spent before this run (restored from a checkpoint)
        self._start: float | None = None
        self._end: float | None = None

    # ------------------------------------------------------------------ clock
    def start_time(self) -> float | None:
        """``time.monotonic()`` when this run's training started, or None before ``on_train_start``."""
        return self._start

    def time_elapsed(self) -> float:
        """Training seconds so far, including the time restored from a checkpoint (this rank's clock)."""
        if self._start is None:
            return self._offset
        end = self._end if self._end is not None else time.monotonic()
        return self._offset + end - self._start

    def time_remaining(self) -> float | None:
        """Seconds left in the budget (may be negative once exceeded), or None without a duration."""
        return None if self.duration is None else self.duration - self.time_elapsed()

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._start = time.monotonic()
        self._end = None

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._end = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if self.interval != "step" or self.duration is None or not trainer.optimizer_stepped:
            return
        if trainer.world_size == 1 or trainer.is_logging_step:  # same condition on every rank
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if self.duration is not None:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        """Collective: rank 0's elapsed time, broadcast; every rank then takes the same decision."""
        elapsed = float(cast(float, comm.broadcast_object(self.time_elapsed() if trainer.is_global_zero else None)))
        assert self.duration is not None
        if elapsed >= self.duration:
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.info(
                    "Time limit reached: %s elapsed of %s (step %d, epoch %d). Signaling Trainer to stop.",
                    datetime.timedelta(seconds=round(elapsed, 3)),
                    datetime.timedelta(seconds=self.duration),
                    trainer.global_step,
                    trainer.current_epoch,
                )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        # Assembled on every rank; rank 0's copy (its clock decides) is the one written to the checkpoint.
        return {"time_elapsed": self.time_elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the budget from a checkpoint.

        Raises:
            KeyError: ``state`` lacks ``time_elapsed`` or has other keys (both named).
        """
        if set(state) != {"time_elapsed"}:
            raise KeyError(f"Timer.load_state_dict: expected the key ['time_elapsed'], got {sorted(state)}.")
        self._offset = float(state["time_elapsed"])
        self._start = self._end = None
