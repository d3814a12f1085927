"""Experiment loggers, with Lightning's names and folder layout (``save_dir/name/version_N``).

This ``__init__`` is the public import path of every logger (``trainer.loggers.TensorBoardLogger``, the
``_target_`` paths in ``conf/logger/``); keel's own modules import from the defining module.

* :mod:`~trainer.loggers.logger`: the :class:`Logger` base and the run identity that keeps a run directory across
  restarts.
* :mod:`~trainer.loggers.local`: :class:`CSVLogger`, :class:`TensorBoardLogger` and the default loggers.
* :mod:`~trainer.loggers.wandb`, :mod:`~trainer.loggers.mlflow`: the trackers; ``wandb`` / ``mlflow`` are imported
  on the first write, never at import. :mod:`~trainer.loggers.tracking` and :mod:`~trainer.loggers.wandb_records`
  hold what they share and how a resumed W&B run is read back.

May import: torch, :mod:`trainer.distributed.comm` (one collective: agreeing on the version folder),
:mod:`trainer.distributed.launcher` (the run's identity across restarts), :mod:`trainer.observability.rank_zero`,
:mod:`trainer.storage` (local paths only).
"""

from trainer.loggers.local import CSVLogger, TensorBoardLogger
from trainer.loggers.logger import Logger
from trainer.loggers.mlflow import MLFlowLogger
from trainer.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
