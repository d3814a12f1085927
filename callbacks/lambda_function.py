"""LambdaCallback: a callback built from plain functions, one per hook."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainer.callback import Callback

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

# Every hook of trainer.callback.Callback, in the order of its definition there (tests/test_callbacks.py
# checks that this list matches the class). state_dict / load_state_dict are not hooks.
HOOK_NAMES: tuple[str, ...] = (
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_exception",
)


class LambdaCallback(Callback):
    """Runs the given functions as hooks: ``LambdaCallback(on_train_start=lambda trainer, task: ...)``.

    Each keyword names a hook of :class:`~trainer.callback.Callback` and maps to a callable taking the
    same arguments as that hook (``trainer, task, ...``). Hooks not given do nothing. Each hook is an
    ordinary method that calls its function when one was given (no methods are replaced at run time).

    Args:
        **hooks: hook name -> callable.

    Raises:
        ValueError: a keyword is not a hook name (the message lists the valid names).
        TypeError: a value is not callable.
    """

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        unknown = sorted(name for name in hooks if name not in HOOK_NAMES)
        if unknown:
            raise ValueError(f"LambdaCallback got unknown hook name(s) {unknown}; valid names: {list(HOOK_NAMES)}.")
        for name, fn in hooks.items():
            if not callable(fn):
                raise TypeError(f"LambdaCallback({name}=...) must be callable, got {type(fn).__name__}.")
        self.hooks: dict[str, Callable[..., Any]] = dict(hooks)

    def _call(self, name: str, *args: Any) -> None:
        fn = self.hooks.get(name)
        if fn is not None:
            fn(*args)

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._call("setup", trainer, task, stage)

    def teardown(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._call("teardown", trainer, task, stage)

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_fit_start", trainer, task)

    def on_fit_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_fit_end", trainer, task)

    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_train_start", trainer, task)

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_train_end", trainer, task)

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_train_epoch_start", trainer, task)

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_train_epoch_end", trainer, task)

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None:
        self._call("on_train_batch_start", trainer, task, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        self._call("on_train_batch_end", trainer, task, outputs, batch, batch_idx)

    def on_before_backward(self, trainer: Trainer, task: TaskModule, loss: torch.Tensor) -> None:
        self._call("on_before_backward", trainer, task, loss)

    def on_after_backward(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_after_backward", trainer, task)

    def on_before_optimizer_step(self, trainer: Trainer, task: TaskModule, optimizer: torch.optim.Optimizer) -> None:
        self._call("on_before_optimizer_step", trainer, task, optimizer)

    def on_before_zero_grad(self, trainer: Trainer, task: TaskModule, optimizer: torch.optim.Optimizer) -> None:
        self._call("on_before_zero_grad", trainer, task, optimizer)

    def on_sanity_check_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_sanity_check_start", trainer, task)

    def on_sanity_check_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_sanity_check_end", trainer, task)

    def on_validation_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_validation_start", trainer, task)

    def on_validation_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_validation_end", trainer, task)

    def on_validation_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_validation_epoch_start", trainer, task)

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_validation_epoch_end", trainer, task)

    def on_validation_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._call("on_validation_batch_start", trainer, task, batch, batch_idx, dataloader_idx)

    def on_validation_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._call("on_validation_batch_end", trainer, task, outputs, batch, batch_idx, dataloader_idx)

    def on_test_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_test_start", trainer, task)

    def on_test_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_test_end", trainer, task)

    def on_test_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_test_epoch_start", trainer, task)

    def on_test_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_test_epoch_end", trainer, task)

    def on_test_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._call("on_test_batch_start", trainer, task, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._call("on_test_batch_end", trainer, task, outputs, batch, batch_idx, dataloader_idx)

    def on_predict_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_predict_start", trainer, task)

    def on_predict_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_predict_end", trainer, task)

    def on_predict_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_predict_epoch_start", trainer, task)

    def on_predict_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._call("on_predict_epoch_end", trainer, task)

    def on_predict_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._call("on_predict_batch_start", trainer, task, batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._call("on_predict_batch_end", trainer, task, outputs, batch, batch_idx, dataloader_idx)

    def on_save_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        self._call("on_save_checkpoint", trainer, task, checkpoint)

    def on_load_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        self._call("on_load_checkpoint", trainer, task, checkpoint)

    def on_exception(self, trainer: Trainer, task: TaskModule, exception: BaseException) -> None:
        self._call("on_exception", trainer, task, exception)
