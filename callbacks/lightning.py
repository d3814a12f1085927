"""Lightning's names for keel's classes: code written against Lightning ports with one line.

``import lightning as L`` / ``import pytorch_lightning as pl`` becomes ``import callbacks.lightning as L`` (or
``as pl``), and ``from lightning.pytorch import X`` / ``from lightning.pytorch.callbacks import X`` becomes
``from callbacks.lightning import X``. Then ``L.LightningModule``, ``L.LightningDataModule``, ``L.Trainer``,
``L.Callback``, ``L.seed_everything``, ``L.pytorch.callbacks.ModelCheckpoint``, ``pl.callbacks.EarlyStopping``,
``L.pytorch.loggers.TensorBoardLogger``, ``L.pytorch.utilities.rank_zero_only`` ... are keel's own classes
(docs/porting.md lists what still differs).

It lives in ``callbacks/`` because it re-exports the callbacks defined there (``trainer/`` never imports
``callbacks/``, docs/design.md section 1). APIs keel deliberately lacks (``LightningCLI``, ``Fabric``, the
tuner, ...) exist here as names that raise, saying what to use instead.
"""

from __future__ import annotations

import sys
import types
from typing import Any, NoReturn

from callbacks.early_stopping import EarlyStopping
from callbacks.gradient_accumulation import GradientAccumulationScheduler
from callbacks.lambda_function import LambdaCallback
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_summary import ModelSummary
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer
from trainer.callback import Callback
from trainer.checkpoint.model_checkpoint import ModelCheckpoint as _KeelModelCheckpoint
from trainer.distributed.strategy import DDPStrategy, SingleDeviceStrategy, Strategy
from trainer.lifecycle import seed_everything
from trainer.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from trainer.module import DataModule, TaskModule
from trainer.observability.progress import ProgressBar
from trainer.observability.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn
from trainer.trainer import Trainer

LightningModule = TaskModule
LightningDataModule = DataModule
TQDMProgressBar = ProgressBar


class _ParallelStrategyType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, Strategy) and obj.name != "single"


class ParallelStrategy(metaclass=_ParallelStrategyType):
    """``isinstance(trainer.strategy, ParallelStrategy)`` is True for keel's multi-rank strategies (DDP,
    FSDP), as Lightning code such as the ImageNet template checks."""


# Lightning APIs keel deliberately does not have, with what to use instead.
LACKING: dict[str, str] = {
    "LightningCLI": "keel's command line is Hydra: run `keel-train task=... data=... trainer.max_epochs=3` "
    "(recipes/train.py, docs/configuration.md), or build Trainer(...) and call fit() yourself.",
    "Fabric": "keel has no Fabric; write the loop with torch and trainer.distributed.comm (collectives), "
    "or use Trainer.",
    "LightningLite": "keel has no Lite/Fabric; write the loop with torch and trainer.distributed.comm, or use Trainer.",
    "Tuner": "keel has no tuner: run learning-rate or batch-size sweeps as separate runs (Hydra --multirun).",
    "StochasticWeightAveraging": "use torch.optim.swa_utils in your task.",
    "BatchSizeFinder": "no tuner: set the batch size in your DataLoader.",
    "LearningRateFinder": "no tuner: sweep the learning rate as separate runs.",
    "DeepSpeedStrategy": "keel runs DDP and FSDP2 (strategy='ddp' / 'fsdp').",
    "XLAStrategy": "keel runs on CPU and CUDA only.",
    "ModelPruning": "use torch.nn.utils.prune in your task's hooks.",
    "BasePredictionWriter": "use the list Trainer.predict returns (in dataset order), "
    "or write in on_predict_batch_end.",
}


def _lacking(name: str) -> type:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"keel has no {name}: {LACKING[name]}")

    return type(name, (), {"__init__": refuse, "__doc__": f"Not in keel: {LACKING[name]}"})


LightningCLI = _lacking("LightningCLI")
Fabric = _lacking("Fabric")
Tuner = _lacking("Tuner")


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


def _namespace(name: str, **members: Any) -> types.ModuleType:
    module = types.ModuleType(f"{__name__}.{name}", f"Lightning's ``{name}`` namespace, keel's classes.")
    module.__dict__.update(members)
    module.__getattr__ = lambda attr: _missing(f"{name}.{attr}", attr, members)  # type: ignore[method-assign]
    return module


def _missing(qualified: str, attr: str, available: dict[str, Any]) -> NoReturn:
    if attr.startswith("__"):
        raise AttributeError(attr)
    if attr in LACKING:
        raise AttributeError(f"keel has no {qualified}: {LACKING[attr]}")
    raise AttributeError(f"keel's Lightning names have no {qualified}; available: {sorted(available)}.")


callbacks = _namespace(
    "callbacks",
    Callback=Callback,
    ModelCheckpoint=ModelCheckpoint,
    EarlyStopping=EarlyStopping,
    LearningRateMonitor=LearningRateMonitor,
    ModelSummary=ModelSummary,
    TQDMProgressBar=TQDMProgressBar,
    ProgressBar=ProgressBar,
    Timer=Timer,
    LambdaCallback=LambdaCallback,
    ThroughputMonitor=ThroughputMonitor,
    GradientAccumulationScheduler=GradientAccumulationScheduler,
    RichProgressBar=RichProgressBar,
    RichModelSummary=RichModelSummary,
)
loggers = _namespace(
    "loggers",
    Logger=Logger,
    CSVLogger=CSVLogger,
    TensorBoardLogger=TensorBoardLogger,
    WandbLogger=WandbLogger,
    MLFlowLogger=MLFlowLogger,
)
strategies = _namespace(
    "strategies",
    Strategy=Strategy,
    SingleDeviceStrategy=SingleDeviceStrategy,
    DDPStrategy=DDPStrategy,
    ParallelStrategy=ParallelStrategy,
)
_rank_zero = dict(
    rank_zero_only=rank_zero_only,
    rank_zero_info=rank_zero_info,
    rank_zero_warn=rank_zero_warn,
    rank_zero_debug=rank_zero_debug,
)
utilities = _namespace("utilities", rank_zero=_namespace("utilities.rank_zero", **_rank_zero), **_rank_zero)
cli = _namespace("cli", LightningCLI=LightningCLI)
tuner = _namespace("tuner", Tuner=Tuner)
pytorch = sys.modules[__name__]  # L.pytorch.X is L.X, as in the `lightning` package

_EXPORTED = {name for name in dir() if not name.startswith("_")} - {"annotations", "sys", "types", "Any", "NoReturn"}


def __getattr__(name: str) -> Any:
    """``L.<a name keel lacks>``: an AttributeError saying what to use instead (never a bare one)."""
    _missing(name, name, {n: None for n in _EXPORTED})


__all__ = sorted(_EXPORTED)
