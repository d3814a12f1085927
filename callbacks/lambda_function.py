"""LambdaCallback: a callback built from plain functions, one per hook."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainer.callback import Callback

log = logging.getLogger(__name__)

# Every hook of trainer.callback.Callback, in the order of its definition there (tests/unit/test_callbacks.py
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
    same arguments as that hook (``trainer, task, ...``). The callable becomes that hook of this instance
    (an instance attribute, as in Lightning); hooks not given stay ``Callback``'s do-nothing methods, so the
    per-batch hook table the Trainer builds each epoch (trainer/hooks.py) holds only the given ones: a
    LambdaCallback with just ``on_train_batch_end`` costs one call per batch, at that hook point only.

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
        for name, fn in hooks.items():
            setattr(self, name, fn)
