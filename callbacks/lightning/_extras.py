"""Small pieces of Lightning's API that keel provides only under Lightning's names: type aliases, exception and
warning classes, ``grad_norm``, ``is_overridden`` and ``get_torchvision_model``, ``cli_lightning_logo`` (the strategy
classes are in ``_strategies``).

Nothing in keel uses them; they exist so that a Lightning program that imports them runs unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from typing_extensions import NotRequired, Required, TypedDict

from trainer.callback import Callback
from trainer.loggers.logger import DummyExperiment
from trainer.module import DataModule, TaskModule
from trainer.observability.rank_zero import rank_zero_only
from trainer.step.optim import ManualOptimizer

T = TypeVar("T")

# ------------------------------------------------------------------ lightning.pytorch.utilities.types
STEP_OUTPUT = torch.Tensor | Mapping[str, Any] | None
TRAIN_DATALOADERS = Any  # any iterable or collection of iterables
EVAL_DATALOADERS = Any
LRSchedulerTypeUnion = LRScheduler | ReduceLROnPlateau
LRSchedulerType = type[LRScheduler] | type[ReduceLROnPlateau]
LRSchedulerPLType = LRScheduler | ReduceLROnPlateau
MODULE_OPTIMIZERS = Optimizer | ManualOptimizer | list[Optimizer] | list[ManualOptimizer]


class LRSchedulerConfigType(TypedDict, total=False):
    """The ``"lr_scheduler"`` dict of ``configure_optimizers``."""

    scheduler: Required[LRSchedulerTypeUnion]
    name: str | None
    interval: str
    frequency: int
    reduce_on_plateau: bool
    monitor: str | None
    strict: bool


class OptimizerConfig(TypedDict):
    """``configure_optimizers`` returning ``{"optimizer": ...}``."""

    optimizer: Optimizer


class OptimizerLRSchedulerConfig(TypedDict):
    """``configure_optimizers`` returning ``{"optimizer": ..., "lr_scheduler": ...}``."""

    optimizer: Optimizer
    lr_scheduler: LRSchedulerTypeUnion | LRSchedulerConfigType
    monitor: NotRequired[str]


OptimizerLRScheduler = (
    Optimizer
    | Sequence[Optimizer]
    | tuple[Sequence[Optimizer], Sequence[LRSchedulerTypeUnion | LRSchedulerConfigType]]
    | OptimizerConfig
    | OptimizerLRSchedulerConfig
    | Sequence[OptimizerConfig]
    | Sequence[OptimizerLRSchedulerConfig]
    | None
)


# ------------------------------------------------------------------ exceptions and warnings
class MisconfigurationException(Exception):
    """Lightning's exception for misuse, for programs that raise it themselves. keel raises ``ValueError`` /
    ``TypeError`` for a wrong option, never this: ``except MisconfigurationException`` does not catch keel's."""


class PossibleUserWarning(UserWarning):
    """Lightning's category for warnings that may be false positives. keel never emits it; filtering it (as
    Lightning programs do) is harmless."""


# ------------------------------------------------------------------ lightning.pytorch.utilities.grad_norm
def grad_norm(module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Any]:
    """Lightning's ``grad_norm``: each parameter's gradient ``norm_type``-norm, keyed
    ``grad_{norm}_norm{sep}{name}``, and their overall norm ``grad_{norm}_norm_total`` (0-dim tensors, ready
    for ``self.log_dict``). Parameters without a gradient are left out; no gradient at all gives ``{}``."""
    norm = float(norm_type)
    if norm <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm}")
    norms = {
        f"grad_{norm}_norm{group_separator}{name}": p.grad.data.norm(norm)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        norms[f"grad_{norm}_norm_total"] = torch.tensor(list(norms.values())).norm(norm)
    return norms


# ------------------------------------------------------------------ lightning.pytorch.utilities.model_helpers
def is_overridden(method_name: str, instance: object | None = None, parent: type | None = None) -> bool:
    """Lightning's ``is_overridden``: whether ``instance``'s ``method_name`` is another function than ``parent``'s
    (by default ``LightningModule``, ``LightningDataModule`` or ``Callback``, whichever ``instance`` is). It looks
    through ``functools.wraps`` / ``@contextmanager`` wrappers, ``functools.partial`` and ``Mock(wraps=...)``, as
    Lightning does; ``instance=None`` (``self.lightning_module`` before a run) is False.

    Raises:
        ValueError: no ``parent`` and ``instance`` is none of the three, or ``parent`` has no ``method_name``.
    """
    if instance is None:
        return False
    if parent is None:
        parent = next((base for base in (TaskModule, DataModule, Callback) if isinstance(instance, base)), None)
        if parent is None:
            raise ValueError(
                f"is_overridden({method_name!r}): {type(instance).__name__} is not a LightningModule, "
                "LightningDataModule or Callback; pass the class that declares the method as `parent=`."
            )
    method = getattr(instance, method_name, None)
    if method is None:
        return False
    method = getattr(method, "__wrapped__", method)
    mock = sys.modules.get("unittest.mock")  # a Mock exists only where unittest.mock was imported
    if mock is not None and isinstance(method, mock.Mock):
        method = method._mock_wraps
    elif isinstance(method, functools.partial):
        method = method.func
    if method is None:
        return False
    declared = getattr(parent, method_name, None)
    if declared is None:
        raise ValueError(f"is_overridden({method_name!r}): {parent.__name__} has no method {method_name!r}.")
    declared = getattr(declared, "__wrapped__", declared)
    return bool(method.__code__ != declared.__code__)


def get_torchvision_model(model_name: str, **kwargs: Any) -> torch.nn.Module:
    """Lightning's ``get_torchvision_model``: ``torchvision.models.get_model(model_name, **kwargs)`` (``weights=``,
    ``num_classes=``, ...).

    Raises:
        ModuleNotFoundError: torchvision is not installed.
    """
    try:
        from torchvision import models
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"get_torchvision_model({model_name!r}) needs torchvision, which is not installed: pip install torchvision."
        ) from exc
    return models.get_model(model_name, **kwargs)


# ------------------------------------------------------------------ lightning.pytorch.loggers.logger
_on_rank_zero = rank_zero_only(lambda: True)


def rank_zero_experiment(fn: Callable[[Any], T]) -> Callable[[Any], T | DummyExperiment]:
    """Lightning's decorator for a custom logger's ``experiment`` property: the experiment on global rank 0,
    a do-nothing stand-in on the other ranks (keel itself calls loggers on rank 0 only)."""

    @functools.wraps(fn)
    def experiment(self: Any) -> T | DummyExperiment:
        return fn(self) if _on_rank_zero() else DummyExperiment()

    return experiment


# ------------------------------------------------------------------ lightning.pytorch.cli_lightning_logo
BANNER = "keel: a Lightning-style trainer (Lightning's names from callbacks.lightning)"


def cli_lightning_logo() -> None:
    """What Lightning's example scripts call first: keel prints a one-line banner (Lightning prints its logo)."""
    sys.stdout.write(BANNER + "\n")
