"""The Callback base class (re-exported as ``callbacks.Callback``).

It lives in ``trainer/`` because the Trainer calls it and ``trainer`` never imports ``callbacks``
(docs/design.md section 1). Built-in callbacks use exactly this API: they have no powers a user callback
lacks.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from trainer.module import TaskModule
    from trainer.trainer import Trainer


class Callback:
    """Hooks called by the Trainer, on every rank, in list order; the task's own hook of the same name
    runs first. Only side effects (files, console) should be gated to rank 0 (``trainer.is_global_zero``).

    Call order of ``fit`` (Lightning's; a "validation run" is the block below)::

        setup(stage="fit")
        on_fit_start
        [sanity check: on_sanity_check_start, validation run, on_sanity_check_end]
        on_train_start
        for each epoch:
            on_train_epoch_start
            for each optimizer step:
                for each micro-batch:
                    on_train_batch_start
                    on_before_backward, on_after_backward
                    on_train_batch_end           (after the optimizer step on the step's last micro-batch)
                on_before_optimizer_step         (before the last micro-batch's on_train_batch_end)
                on_before_zero_grad              (after optimizer.step, before zero_grad)
                [validation run every val_check_interval steps]
            [validation run at epoch end]
            on_train_epoch_end
        on_train_end
        on_fit_end
        teardown(stage="fit")

    A validation run (fit, sanity check, ``validate``): the task's ``on_validation_model_eval``, then
    ``on_validation_start``, ``on_validation_epoch_start``, per batch ``on_validation_batch_start`` /
    ``on_validation_batch_end``, ``on_validation_epoch_end``, ``on_validation_end``, and the task's
    ``on_validation_model_train``. ``test`` is the same with ``test`` for ``validation``; ``predict`` calls
    ``on_predict_start``, ``on_predict_epoch_start``, ``on_predict_batch_start`` / ``on_predict_batch_end``
    per batch, ``on_predict_epoch_end``, ``on_predict_end``.

    The batch hooks of validation, test and predict get ``dataloader_idx`` (a last positional argument) only
    when the stage has several dataloaders, as in Lightning: a hook written ``(trainer, task, outputs, batch,
    batch_idx)`` works with one loader, one with ``dataloader_idx=0`` with any number. A hook that cannot take
    the call it will get is named in a ``RuntimeError`` before the run starts. Every batch's ``on_*_batch_start``
    comes after the task's (or datamodule's) batch-transfer hooks, which are not callback hooks.

    Precisely, one optimizer step with ``accumulate_grad_batches=k`` calls, per micro-batch,
    ``on_train_batch_start -> on_before_backward -> on_after_backward``, and then for the k-th
    micro-batch ``on_before_optimizer_step -> (optimizer.step) -> on_before_zero_grad -> on_train_batch_end``;
    micro-batches before the k-th call ``on_train_batch_end`` right after their backward.
    ``on_save_checkpoint`` runs while a checkpoint is assembled, ``on_load_checkpoint`` while one is
    restored (before training starts), ``on_exception`` when a loop raises, before ``teardown``.

    Stateful callbacks return a dict from :meth:`state_dict`; it is saved under :attr:`state_key`, which
    must be unique among the Trainer's callbacks.

    Constructor keywords are checked for every subclass (keel's and the user's): an unknown keyword raises
    ``TypeError`` naming the valid ones (and the closest match) instead of Python's bare message.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _checked_keywords(init)  # type: ignore[method-assign]

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint. Override when two instances keep state."""
        return type(self).__qualname__

    # stage hooks
    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None: ...
    def teardown(self, trainer: Trainer, task: TaskModule, stage: str) -> None: ...
    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_fit_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None: ...

    # training
    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None: ...
    def on_before_backward(self, trainer: Trainer, task: TaskModule, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_before_optimizer_step(
        self, trainer: Trainer, task: TaskModule, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_before_zero_grad(self, trainer: Trainer, task: TaskModule, optimizer: torch.optim.Optimizer) -> None: ...

    # evaluation
    def on_sanity_check_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_validation_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_validation_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_validation_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_test_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_test_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_predict_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, task: TaskModule) -> None: ...
    def on_predict_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    # checkpoints and failures
    def on_save_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None: ...
    def on_exception(self, trainer: Trainer, task: TaskModule, exception: BaseException) -> None: ...

    # state
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _checked_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` that first refuses unknown keyword arguments, naming the valid ones (class creation only)."""
    params = inspect.signature(init).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return init
    valid = [n for n, p in params.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(init)
    def checked(self: Callback, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            close = {k: difflib.get_close_matches(k, valid, n=1) for k in unknown}
            hints = "".join(f" (did you mean {c[0]!r} for {k!r}?)" for k, c in close.items() if c)
            raise TypeError(
                f"{type(self).__name__}() got unknown keyword argument(s) {unknown}{hints}; valid keywords: {valid}."
            )
        init(self, *args, **kwargs)

    return checked


def check_callbacks(callbacks: Sequence[Any]) -> list[Callback]:
    """The ``callbacks`` option as a list, checked: every entry a :class:`Callback`, and stateful
    callbacks with distinct ``state_key`` s (their checkpoint entries would collide).

    Raises:
        ValueError: naming the offending entry and the fix.
    """
    keys: dict[str, Callback] = {}
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise ValueError(
                f"Trainer option callbacks contains {cb!r} ({type(cb).__name__}); expected "
                "callbacks.Callback instances."
            )
        if cb.state_dict():
            if cb.state_key in keys:
                raise ValueError(
                    f"Two stateful callbacks share state_key {cb.state_key!r} ({type(keys[cb.state_key]).__name__} "
                    f"and {type(cb).__name__}); give each a distinct state_key."
                )
            keys[cb.state_key] = cb
    return list(callbacks)
