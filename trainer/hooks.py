"""The per-batch hooks of the training loop, resolved once per epoch to the ones that do something.

Every training micro-batch reaches six hook points (``on_train_batch_start``, ``on_before_backward``,
``on_after_backward``, ``on_before_optimizer_step``, ``on_before_zero_grad``, ``on_train_batch_end``),
each for the task and then for every callback in order. Calling a hook that its class inherits
unchanged from :class:`~trainer.TaskModule` or :class:`~trainer.Callback` does nothing; on a 0.2 ms
step those calls were a measurable part of keel's overhead over a hand-written loop (docs/performance.md).
:class:`TrainHooks` keeps, per hook point, the bound hooks that are overridden (by
the class, or assigned on the instance), in calling order, as callables that take the hook's own
arguments: the task's, then each callback's with ``(trainer, task)`` bound. Nothing else changes: an
overridden hook is called exactly when and in the order it was before.

The table is rebuilt at the start of every training epoch, after ``on_train_epoch_start``, so a
callback added to ``trainer.callbacks`` or a hook assigned before then is seen in that epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from trainer.callback import Callback
from trainer.module import TaskModule

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

TRAIN_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


def overrides(obj: object, base: type, name: str) -> bool:
    """True when ``obj.<name>`` is not the do-nothing hook of ``base``: overridden by a class in between,
    assigned on the instance, or ``obj`` is not a ``base`` at all (a duck-typed callback)."""
    if not isinstance(obj, base) or name in getattr(obj, "__dict__", ()):
        return True
    return getattr(type(obj), name, None) is not getattr(base, name)


class TrainHooks:
    """Per hook point of :data:`TRAIN_BATCH_HOOKS`, a tuple of the callables to run (often empty)."""

    __slots__ = TRAIN_BATCH_HOOKS
    on_train_batch_start: tuple[Callable[..., Any], ...]
    on_before_backward: tuple[Callable[..., Any], ...]
    on_after_backward: tuple[Callable[..., Any], ...]
    on_before_optimizer_step: tuple[Callable[..., Any], ...]
    on_before_zero_grad: tuple[Callable[..., Any], ...]
    on_train_batch_end: tuple[Callable[..., Any], ...]

    def __init__(self, trainer: Trainer, task: TaskModule, callbacks: Sequence[Callback]) -> None:
        for name in TRAIN_BATCH_HOOKS:
            calls: list[Callable[..., Any]] = [getattr(task, name)] if overrides(task, TaskModule, name) else []
            calls += [partial(getattr(cb, name), trainer, task) for cb in callbacks if overrides(cb, Callback, name)]
            setattr(self, name, tuple(calls))
