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

Before a stage starts: :func:`check_task_dataloader_idx` and :func:`check_callback_dataloader_idx` check that the
evaluation hooks take ``dataloader_idx`` as Lightning calls them (with its messages), and
:func:`warn_uncalled_hooks` names each Lightning hook keel never calls, with what to do instead.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
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


# ---------------------------------------------------------------------- dataloader_idx (evaluation and predict)
# Lightning's name for each stage's loaders in its messages ("You provided multiple `val_dataloader`, ...").
_DATALOADER_PREFIX = {"validation": "val", "test": "test", "predict": "predict"}


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``fn``'s parameters (``self`` already bound), or None when Python cannot tell (a builtin)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _names_dataloader_idx(fn: Callable[..., Any]) -> bool:
    """Lightning's ``is_param_in_hook_signature(fn, "dataloader_idx")``: a parameter of that name, or ``*args``."""
    params = _parameters(fn)
    return params is None or any(p.name == "dataloader_idx" or p.kind == p.VAR_POSITIONAL for p in params)


def _requires_dataloader_idx(fn: Callable[..., Any]) -> bool:
    params = _parameters(fn)
    return params is not None and any(p.name == "dataloader_idx" and p.default is p.empty for p in params)


def check_task_dataloader_idx(task: TaskModule, stage: str, names: Iterable[str], *, many: bool) -> None:
    """Lightning's check of the task's step and batch hooks (``names``, those the task overrides) before an
    evaluation or predict run (``stage``: "validation", "test" or "predict"), with Lightning's messages: with
    several loaders each must take ``dataloader_idx``; with one, none may require it.

    Raises:
        RuntimeError: naming the method and the fix, as Lightning 2.6 does.
    """
    prefix = _DATALOADER_PREFIX[stage]
    for name in names:
        fn = getattr(task, name)
        where = f"`{type(task).__name__}.{name}()`"
        if many and not _names_dataloader_idx(fn):
            raise RuntimeError(
                f"You provided multiple `{prefix}_dataloader`, but no `dataloader_idx` argument in {where}. Try "
                "adding `dataloader_idx=0` to its signature."
            )
        if not many and _requires_dataloader_idx(fn):
            raise RuntimeError(
                f"You provided only a single `{prefix}_dataloader`, but have included `dataloader_idx` in {where}. "
                "Either remove the argument or give it a default value i.e. `dataloader_idx=0`."
            )


def check_callback_dataloader_idx(callback: Callback, name: str, stage: str, *, leading: int, many: bool) -> None:
    """Whether ``callback.<name>`` accepts the call Lightning makes: ``(trainer, task, [outputs,] batch,
    batch_idx)`` with one loader, ``dataloader_idx`` as one more positional argument with several
    (``leading``: the positional arguments before ``dataloader_idx``). Lightning itself calls the hook and
    fails with Python's TypeError; keel says so before the run starts, with the fix.

    Raises:
        RuntimeError: naming the callback, the hook and the fix.
    """
    fn = getattr(callback, name)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: let the call tell
        return
    try:
        signature.bind(*range(leading + many))
    except TypeError:
        prefix, where = _DATALOADER_PREFIX[stage], f"{type(callback).__name__}.{name}{signature}"
        if many:
            raise RuntimeError(
                f"You provided multiple `{prefix}_dataloader`: {where} is called with `dataloader_idx` as its last "
                "positional argument (as Lightning does), but does not take it. Add `dataloader_idx=0` to its "
                "signature."
            ) from None
        raise RuntimeError(
            f"You provided only a single `{prefix}_dataloader`: {where} is called without `dataloader_idx` (as "
            "Lightning does), but requires it. Give it a default value, `dataloader_idx=0`."
        ) from None


# ---------------------------------------------------------------------- hooks keel never calls
# Lightning hooks (module or callback) that keel deliberately does not call, with what to do instead.
UNCALLED_HOOKS: dict[str, str] = {
    "configure_callbacks": "pass the callbacks to Trainer(callbacks=[...]).",
    "configure_gradient_clipping": "use Trainer(gradient_clip_val=..., gradient_clip_algorithm=...), or clip "
    "in on_before_optimizer_step.",
    "optimizer_step": "keel steps the optimizers itself; change the step in on_before_optimizer_step, or use "
    "manual optimization (self.automatic_optimization = False).",
    "optimizer_zero_grad": "keel zeroes gradients with set_to_none=True after each step; use "
    "on_before_zero_grad to act just before it.",
    "lr_scheduler_step": "return the scheduler config from configure_optimizers; for a custom schedule use "
    "manual optimization and call sch.step() yourself.",
    "backward": "use on_before_backward / on_after_backward, or manual optimization (self.manual_backward).",
    "on_validation_model_zero_grad": "keel evaluates under torch.no_grad(); gradients are untouched.",
    "configure_sharded_model": "build the model in __init__ (or in configure_model where keel has it).",
}
# The hooks of automatic optimization: under manual optimization (automatic_optimization = False) Lightning 2.6.6
# calls none of them either (of UNCALLED_HOOKS only `backward`, from manual_backward), so a task that defines one
# there loses nothing under keel and is not warned.
AUTOMATIC_OPTIMIZATION_HOOKS = frozenset(
    ("optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping")
)
_UNCALLED_WARNED: set[tuple[type, str]] = set()


def warn_uncalled_hooks(task: TaskModule, callbacks: Iterable[Callback]) -> list[str]:
    """Warn once per class for each Lightning hook in :data:`UNCALLED_HOOKS` that ``task`` or a callback
    defines: keel will never call it (nor the task's :data:`AUTOMATIC_OPTIMIZATION_HOOKS` under manual
    optimization, where Lightning does not call them either). Returns the warnings issued (for tests)."""
    issued = []
    manual = not getattr(task, "automatic_optimization", True)
    for obj in [task, *callbacks]:
        cls = type(obj)
        for name, instead in UNCALLED_HOOKS.items():
            if (cls, name) in _UNCALLED_WARNED or not callable(getattr(obj, name, None)) or _keel_owned(cls, name):
                continue
            if manual and obj is task and name in AUTOMATIC_OPTIMIZATION_HOOKS:
                continue
            _UNCALLED_WARNED.add((cls, name))
            message = f"{cls.__name__}.{name} is a Lightning hook that keel never calls: {instead}"
            warnings.warn(message, UserWarning, stacklevel=3)
            issued.append(message)
    return issued


def _keel_owned(cls: type, name: str) -> bool:
    """True when ``name`` comes from keel's own classes (nn.Module's ``optimizer_step`` does not exist,
    but e.g. a keel base could define one), not from the user's."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass.__module__.split(".")[0] in ("trainer", "callbacks", "torch")
    return True
