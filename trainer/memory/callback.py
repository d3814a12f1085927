"""The memory plan of a run, logged at its first training batch (``Trainer(memory_plan=True)``, off by default).

In ``setup`` (before ``configure_model``) :class:`MemoryPlan` keeps a copy of the task on the meta device: its
structure, no weights. At the first batch it estimates that copy on that batch with the run's strategy settings,
world size, precision and device type (:func:`trainer.memory.estimate.estimate_step`), on fake groups over the
run's ranks (every rank estimates its own part, at the same time), and rank 0 logs the summary and whether it fits
the device's memory. A few seconds of dispatch once per fit, before the first step. A task the estimate cannot run
(a step that reads values on the host, manual optimization) is named in one line and the run goes on. See
docs/memory.md.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainer.callback import Callback
from trainer.memory.estimate import estimate_step, format_size, meta_copy

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


class MemoryPlan(Callback):
    """Logs (rank 0) the memory plan of this run at its first training batch (``Trainer(memory_plan=True)``, or
    this callback added by hand); a plan that cannot be made is a WARNING naming why."""

    is_memory_plan = True

    def __init__(self) -> None:
        self.summary: str | None = None  # the line logged, once made
        self._snapshot: nn.Module | None = None
        self._planned = False

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        if stage != "fit" or self._planned:
            return
        self._planned = True  # once per Trainer: a second fit starts from a task already wrapped
        why = _unplannable(trainer, task)
        if why is None:
            try:
                self._snapshot = meta_copy(task)
            except Exception as exc:  # a task attribute deepcopy cannot copy (a lock, an open file)
                why = f"the task could not be copied to the meta device ({type(exc).__name__}: {exc})"
        if why is not None:
            self._skip(trainer, why)

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None:
        if self._snapshot is None:
            return
        snapshot, self._snapshot = self._snapshot, None
        strategy = trainer.strategy
        devices = [trainer.device] if trainer.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):  # a configure_model that seeds leaves the run's RNG alone
                estimate = estimate_step(
                    lambda: cast("TaskModule", copy.deepcopy(snapshot)),  # on the meta device
                    batch,
                    trainer_class=type(trainer),
                    strategy=type(strategy)(**strategy.settings()),  # the run's settings, not its state
                    world_size=trainer.world_size,
                    precision=trainer.options.precision,
                    device=trainer.device.type,
                )
        except Exception as exc:
            self._skip(trainer, f"{type(exc).__name__}: {exc}")
            return
        if trainer.device.type != "cuda":
            self.summary = f"Memory plan: {estimate.summary()}"
            if trainer.is_global_zero:
                log.info("%s", self.summary)
            return
        total = torch.cuda.get_device_properties(trainer.device).total_memory
        fits = estimate.fits(total)
        verdict = "fits" if fits else "does NOT fit"
        self.summary = f"Memory plan: {estimate.summary()}; {verdict} {format_size(total)} of {trainer.device}"
        if trainer.is_global_zero:
            if fits:
                log.info("%s", self.summary)
            else:
                log.warning(
                    "%s: expect out-of-memory. `python -m trainer.memory` names the cheapest setting that fits "
                    "(docs/memory.md).",
                    self.summary,
                )

    def _skip(self, trainer: Trainer, why: str) -> None:
        self.summary = None
        if trainer.is_global_zero:
            log.warning("Memory plan: not estimated: %s. Trainer(memory_plan=False) turns the plan off.", why)


def _unplannable(trainer: Trainer, task: TaskModule) -> str | None:
    if not task.automatic_optimization:
        return "manual optimization (the estimate runs automatic steps: loss, backward, optimizer step)"
    if any(hasattr(p, "device_mesh") for p in task.parameters()):
        return "the task's parameters are already sharded (a task fitted before)"
    if trainer.strategy.name not in ("single", "ddp", "fsdp"):
        return f"the strategy {type(trainer.strategy).__name__} is not one the estimate knows (single, DDP, FSDP)"
    return None
