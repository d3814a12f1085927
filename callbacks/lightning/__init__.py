"""Lightning's names for keel's classes: code written against Lightning ports by rewriting its imports.

Replace ``lightning`` with ``callbacks.lightning`` (and ``pytorch_lightning`` with ``callbacks.lightning``) in
every import line; every import form then resolves for the names keel has::

    import callbacks.lightning as L                       # import lightning as L
    import callbacks.lightning.pytorch as pl              # import lightning.pytorch as pl
    from callbacks.lightning.pytorch.callbacks import ModelCheckpoint, BackboneFinetuning
    from callbacks.lightning.pytorch.callbacks.early_stopping import EarlyStopping
    from callbacks.lightning.loggers import CSVLogger     # from pytorch_lightning.loggers import CSVLogger
    from callbacks.lightning.pytorch.utilities.rank_zero import rank_zero_info

``L.LightningModule`` is ``trainer.TaskModule``, ``L.Callback`` is ``trainer.Callback``, and so on; ``L.Trainer``,
``L.ModelCheckpoint``, ``TensorBoardLogger`` and ``CSVLogger`` are keel's with Lightning's defaults (the
``lightning_logs`` folder, ``lightning.pt`` in each save); ``L.pytorch`` is
``L`` itself and ``L.pytorch.callbacks`` the same module as ``L.callbacks``. Lightning's module tree is laid over
this package by an import hook (``_finder``), from the table in ``_tree``. This top level also holds every name
flat (``from callbacks.lightning import ModelCheckpoint``), as before.

A name or module Lightning has and keel lacks raises at once, saying what to use instead (``AttributeError`` on
attribute access, ``ImportError`` / ``ModuleNotFoundError`` on import); docs/porting.md lists them all.

It lives in ``callbacks/`` because it re-exports the callbacks defined there (``trainer/`` never imports
``callbacks/``, docs/design.md section 1).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from callbacks.early_stopping import EarlyStopping
from callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from callbacks.gradient_accumulation import GradientAccumulationScheduler
from callbacks.lambda_function import LambdaCallback
from callbacks.lightning import _finder
from callbacks.lightning._extras import cli_lightning_logo
from callbacks.lightning._strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from callbacks.lightning._tree import LACKING, LACKING_MODULES
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_summary import ModelSummary
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer
from callbacks.weight_averaging import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from trainer import loggers as _loggers
from trainer import trainer as _trainer
from trainer.callback import Callback
from trainer.checkpoint.model_checkpoint import ModelCheckpoint as _KeelModelCheckpoint
from trainer.distributed.strategy import Strategy
from trainer.lifecycle import seed_everything
from trainer.loggers import Logger, MLFlowLogger, WandbLogger
from trainer.module import DataModule, TaskModule
from trainer.observability.progress import ProgressBar
from trainer.observability.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn


class Trainer(_trainer.Trainer):
    """keel's Trainer; its default logger (``logger=True``) writes to ``<default_root_dir>/lightning_logs``, as
    Lightning's does (keel's own: ``keel_logs``)."""

    default_log_name = "lightning_logs"


class TensorBoardLogger(_loggers.TensorBoardLogger):
    """keel's TensorBoardLogger with Lightning's default experiment name, ``lightning_logs``."""

    def __init__(self, save_dir: Any, name: str | None = "lightning_logs", version: Any = None, **kwargs: Any) -> None:
        super().__init__(save_dir, name, version, **kwargs)


class CSVLogger(_loggers.CSVLogger):
    """keel's CSVLogger with Lightning's default experiment name, ``lightning_logs``."""

    def __init__(self, save_dir: Any, name: str | None = "lightning_logs", version: Any = None, **kwargs: Any) -> None:
        super().__init__(save_dir, name, version, **kwargs)


LightningModule = TaskModule
LightningDataModule = DataModule
TQDMProgressBar = ProgressBar


class _ParallelStrategyType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, Strategy) and obj.name != "single"


class ParallelStrategy(metaclass=_ParallelStrategyType):
    """``isinstance(trainer.strategy, ParallelStrategy)`` is True for keel's multi-rank strategies (DDP,
    FSDP), as Lightning code such as the ImageNet template checks."""


class RichProgressBar(ProgressBar):
    """Lightning's ``RichProgressBar(refresh_rate, leave, theme, console_kwargs)``: keel draws its tqdm bar
    (log lines when not on a terminal); ``leave``, ``theme`` and ``console_kwargs`` are accepted and unused."""

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        theme: Any = None,
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate)


RichModelSummary = ModelSummary  # the same table, printed through logging instead of rich


class ModelCheckpoint(_KeelModelCheckpoint):
    """Lightning's ``ModelCheckpoint``: keel's, with ``lightning_file=True`` by default, so that
    ``best_model_path``, ``last_model_path`` and ``last.ckpt`` name one plain file with Lightning's keys
    (``state_dict``, ``epoch``, ``global_step``, ``hyper_parameters``) that ``torch.load`` reads, committed
    inside each save folder (DDP or one device)."""

    def __init__(self, *args: Any, lightning_file: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, lightning_file=lightning_file, **kwargs)


# `import callbacks.lightning.pytorch as pl` is this package, as `lightning.pytorch` holds what `lightning` does.
pytorch = sys.modules[__name__]
sys.modules[f"{__name__}.pytorch"] = pytorch
_finder.install()

# Lightning's modules that this top level has always offered as attributes (L.callbacks, L.pytorch.loggers, ...);
# the others (L.core, L.profilers, ...) resolve on first use, through __getattr__.
_NAMESPACES = ("callbacks", "cli", "loggers", "strategies", "utilities")

NAMES = sorted(
    name
    for name in list(globals())
    if not name.startswith("_") and name not in {"annotations", "importlib", "sys", "Any", "pytorch"}
)
"""The classes and functions this top level holds (what ``from callbacks.lightning import X`` finds)."""

__all__ = sorted([*NAMES, *_NAMESPACES, "LightningCLI", "pytorch"])


def __getattr__(name: str) -> Any:
    """Lightning's modules (``L.callbacks``, ``L.core``, ...) on first use, ``L.LightningCLI``, and for a name
    keel lacks an AttributeError saying what to use instead (never a bare one)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "LightningCLI":  # imported on first use, like the rest of the command line
        return importlib.import_module("callbacks.lightning_cli").LightningCLI
    module = _finder.submodule("", name)
    if module is not None:
        return module
    raise AttributeError(_finder.not_found("", name, NAMES))
