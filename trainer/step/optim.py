"""Normalise what ``configure_optimizers`` returns into optimizers and scheduler configs.

Accepted forms (Lightning's):

* an optimizer;
* a list/tuple of optimizers;
* ``(optimizers, schedulers)``: two lists (schedulers may be bare schedulers or config dicts);
* ``{"optimizer": o, "lr_scheduler": s_or_config}`` or a list of such dicts;

where a scheduler config is ``{"scheduler": s, "interval": "step" | "epoch", "frequency": n,
"monitor": key, "strict": bool, "name": str}``. Bare schedulers step every epoch, like Lightning.

Also here: stepping the schedulers on the step clock (:func:`step_schedulers`), and what manual
optimization needs (:class:`ManualOptimization`, :class:`ManualOptimizer`). The automatic optimizer
step itself is visible in ``Trainer._optimizer_step`` (docs/design.md section 5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeGuard

import torch

from trainer.distributed import watchdog as wd
from trainer.distributed.strategy import Strategy
from trainer.step.precision import Precision

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


def _is_optimizer(obj: Any) -> TypeGuard[torch.optim.Optimizer]:
    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    return (
        callable(getattr(obj, "step", None)) and callable(getattr(obj, "state_dict", None)) and not _is_optimizer(obj)
    )


def _scheduler_config(item: Any, *, monitor: str | None = None) -> SchedulerConfig:
    if isinstance(item, SchedulerConfig):
        return item
    if isinstance(item, dict):
        unknown = set(item) - _SCHEDULER_KEYS
        if unknown:
            raise ValueError(
                f"configure_optimizers: unknown lr_scheduler key(s) {sorted(unknown)}; valid keys: "
                f"{sorted(_SCHEDULER_KEYS)}."
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
        raise ValueError(
            f"configure_optimizers: lr_scheduler interval={config.interval!r}; expected 'step' or 'epoch'."
        )
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


def step_schedulers(
    configs: Sequence[SchedulerConfig], interval: str, count: int, metrics: Mapping[str, torch.Tensor]
) -> None:
    """Step the schedulers of ``interval`` ("step" or "epoch") whose ``frequency`` divides ``count``;
    a scheduler with ``monitor`` gets that metric (a host read: monitored schedulers only).

    Raises:
        KeyError: a strict scheduler monitors a metric that was not logged.
    """
    for config in configs:
        if config.interval != interval or count % config.frequency != 0:
            continue
        if config.monitor is not None:
            if config.monitor not in metrics:
                if not config.strict:
                    continue
                raise KeyError(
                    f"lr_scheduler monitors {config.monitor!r}, which was not logged; available metrics: "
                    f"{sorted(metrics)}."
                )
            config.scheduler.step(float(metrics[config.monitor]))
        else:
            config.scheduler.step()


class StepHooks(Protocol):
    """The hooks around a manual step, each a tuple of callables taking the hook's own arguments (the task's hook,
    then each callback's with ``(trainer, task)`` bound): :class:`trainer.hooks.TrainHooks` of the epoch."""

    on_before_backward: tuple[Callable[..., Any], ...]
    on_after_backward: tuple[Callable[..., Any], ...]
    on_before_optimizer_step: tuple[Callable[..., Any], ...]


class ManualOptimization:
    """What keel does for a task with ``automatic_optimization = False``: ``training_step`` calls
    ``self.manual_backward(loss)`` and ``opt.step()`` itself; keel keeps the step clock (one training
    iteration is one step), precision (GradScaler), clipping, the hooks and the gradient sync.

    Built by the Trainer once per ``fit``; ``hooks`` gives the hooks in force (the epoch's). On every rank.
    Gradients are averaged over ranks by ``strategy.average_gradients`` in the ``manual_backward`` of
    the last micro-batch of each ``accumulate_grad_batches`` window (like DDP's ``no_sync`` on the others).
    """

    def __init__(
        self,
        *,
        task: torch.nn.Module,
        hooks: Callable[[], StepHooks],
        strategy: Strategy,
        precision: Precision,
        clip_val: float | None,
        clip_algorithm: str,
        beat: Callable[[str], None],
    ) -> None:
        self.task, self.hooks = task, hooks
        self.strategy, self.precision, self.beat = strategy, precision, beat
        self.clip_val, self.clip_algorithm = clip_val, clip_algorithm
        self.sync = True  # manual_backward of this micro-batch averages gradients over ranks

    def training_step(
        self, model: torch.nn.Module, batch: Any, batch_idx: int, *, sync: bool
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Run one micro-batch (the task steps inside); ``(detached outputs, loss or None)``."""
        self.sync = sync
        # A wrapper that reduces inside backward (FSDP) is told whether this micro-batch syncs; DDP's
        # manual path reduces in backward() below instead (average_gradients).
        with self.strategy.gradient_sync(sync), self.precision.autocast():
            output = model(batch, batch_idx)
        if isinstance(output, torch.Tensor):
            output = {"loss": output}
        outputs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in (output or {}).items()}
        loss = outputs.get("loss")
        return outputs, (loss if isinstance(loss, torch.Tensor) else None)

    def backward(self, loss: torch.Tensor) -> None:
        """``TaskModule.manual_backward``: hooks, (scaled) backward, gradient sync on the window's last."""
        hooks = self.hooks()
        for hook in hooks.on_before_backward:
            hook(loss)
        self.beat(wd.PHASE_BACKWARD)
        self.precision.backward(loss)
        if self.sync:
            self.strategy.average_gradients([p for p in self.task.parameters()])
        for hook in hooks.on_after_backward:
            hook()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``opt.step()`` from the task: unscale, hooks, clip, (scaler-aware) step."""
        self.precision.unscale(optimizer)
        for hook in self.hooks().on_before_optimizer_step:
            hook(optimizer)
        self.strategy.clip_gradients(
            [p for group in optimizer.param_groups for p in group["params"]], self.clip_val, self.clip_algorithm
        )
        self.precision.optimizer_step(optimizer)


class ManualOptimizer:
    """An optimizer as seen from ``TaskModule.optimizers()`` under manual optimization.

    ``step()`` runs the task's and callbacks' ``on_before_optimizer_step`` hooks, then the optimizer step
    through the precision plugin (``GradScaler.step`` under 16-mixed). Everything else is the wrapped
    optimizer's own: use ``.optimizer`` for anything not listed here.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, manual: ManualOptimization) -> None:
        self.optimizer = optimizer
        self._manual = manual

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            closure()
        self._manual.optimizer_step(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
