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

:class:`BatchTransfer` does the same for Lightning's three batch-transfer hooks, once per stage: when neither the
task nor the datamodule overrides one, the loops move batches as they always do and call nothing more.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from trainer.callback import Callback
from trainer.data.transfer import convert_floats
from trainer.module import DataModule, TaskModule

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


BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
_WARNED: set[tuple[type, type, str]] = set()


class BatchTransfer:
    """Moves one stage's batches to the device through the batch-transfer hooks the task or the datamodule
    overrides, as Lightning does: (precision "64": floats converted first) ``on_before_batch_transfer(batch,
    dataloader_idx)``, ``transfer_batch_to_device(batch, device, dataloader_idx)``, ``on_after_batch_transfer(batch,
    dataloader_idx)``, each hook the datamodule's when it overrides it, else the task's. A hook neither overrides is
    not called: keel's own copy (``move``) stands for ``transfer_batch_to_device``.

    Build it with :meth:`resolve`, which returns None when nothing is overridden (the loops then copy batches as
    they would without these hooks).
    """

    __slots__ = ("before", "transfer", "after", "device", "float_dtype", "move")

    def __init__(
        self,
        hooks: Sequence[Callable[..., Any] | None],
        *,
        device: torch.device,
        float_dtype: torch.dtype | None,
        move: Callable[[Any], Any],
    ) -> None:
        self.before, self.transfer, self.after = hooks
        self.device, self.float_dtype, self.move = device, float_dtype, move

    @classmethod
    def resolve(
        cls,
        task: TaskModule,
        datamodule: DataModule | None,
        *,
        device: torch.device,
        float_dtype: torch.dtype | None,
        move: Callable[[Any], Any],
    ) -> BatchTransfer | None:
        """The stage's batch transfer, or None when neither ``task`` nor ``datamodule`` overrides a hook."""
        hooks = [_batch_hook(task, datamodule, name) for name in BATCH_TRANSFER_HOOKS]
        if not any(hooks):
            return None
        return cls(hooks, device=device, float_dtype=float_dtype, move=move)

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        if self.float_dtype is not None:
            batch = convert_floats(batch, self.float_dtype)
        if self.before is not None:
            batch = self.before(batch, dataloader_idx)
        batch = self.move(batch) if self.transfer is None else self.transfer(batch, self.device, dataloader_idx)
        if self.after is not None:
            batch = self.after(batch, dataloader_idx)
        return batch


def _batch_hook(task: TaskModule, datamodule: DataModule | None, name: str) -> Callable[..., Any] | None:
    """The bound hook ``name`` to call, or None: the datamodule's override wins over the task's, with Lightning's
    warning when both, or only the task, override it while a datamodule is given (once per pair of classes)."""
    in_task = overrides(task, TaskModule, name)
    if datamodule is None:
        return getattr(task, name) if in_task else None
    in_datamodule = overrides(datamodule, DataModule, name)
    if in_task and (type(task), type(datamodule), name) not in _WARNED:
        _WARNED.add((type(task), type(datamodule), name))
        warnings.warn(
            f"You have overridden `{name}` in both `LightningModule` and `LightningDataModule`. It will use the "
            "implementation from `LightningDataModule` instance."
            if in_datamodule
            else f"You have overridden `{name}` in `LightningModule` but have passed in a `LightningDataModule`. It "
            "will use the implementation from `LightningModule` instance.",
            UserWarning,
            stacklevel=4,
        )
    if in_datamodule:
        return getattr(datamodule, name)
    return getattr(task, name) if in_task else None
