"""GradientAccumulationScheduler: change ``accumulate_grad_batches`` on the step clock."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.callback import Callback
from trainer.step.accumulation import AccumulationSchedule

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Micro-batches per optimizer step as a schedule.

    Args:
        scheduling: ``{epoch: k}`` (Lightning's form: from epoch ``e`` on, accumulate ``k``) or
            ``{"step": {global_step: k}}``. Before the first key ``k`` is 1. Keys must be
            non-negative ints in increasing order; values ints >= 1.

    The schedule is a pure function of the step clock (epoch, global step), so a resumed run uses the
    same ``k`` as the interrupted one. A change lands on an optimizer-step boundary: the Trainer reads
    ``k`` when a step's first micro-batch starts. Uses only public Trainer API
    (``trainer.accumulation_schedule``), like any user callback could.
    """

    def __init__(self, scheduling: dict[Any, Any]) -> None:
        if isinstance(scheduling, int):
            raise ValueError(
                "GradientAccumulationScheduler(scheduling=...) takes a dict; for a constant k "
                "use Trainer(accumulate_grad_batches=k)."
            )
        self.schedule = AccumulationSchedule(scheduling)

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.options.global_batch_size is not None:
            raise ValueError(
                f"GradientAccumulationScheduler and Trainer(global_batch_size={trainer.options.global_batch_size!r}) "
                "both set accumulation; give the schedule in global-batch terms instead: "
                "global_batch_size={epoch: G} or {'step': {global_step: G}}."
            )
        if trainer.options.accumulate_grad_batches != 1:
            raise ValueError(
                "GradientAccumulationScheduler and Trainer(accumulate_grad_batches="
                f"{trainer.options.accumulate_grad_batches!r}) both set accumulation; use one of them."
            )
        trainer.accumulation_schedule = self.schedule
