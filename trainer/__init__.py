"""keel: a Lightning-style trainer for PyTorch (DDP and FSDP2), from one GPU to many nodes.

``from trainer import Trainer, TaskModule, DataModule, Callback, seed_everything`` is the user-facing core, with the
strategy objects ``DDPStrategy`` and ``FSDPStrategy`` (``Trainer(strategy=FSDPStrategy(units=["Block"]))``), and
``export_weights`` (a checkpoint as safetensors or one plain weights file, :mod:`trainer.checkpoint.hf`), and the
rank-zero helpers ``rank_zero_only``, ``rank_zero_info``, ``rank_zero_warn`` and ``rank_zero_debug``.

The core sits at the top of this package: ``trainer.py`` (the fit loop, the optimizer step and the loop's
decisions), ``attributes.py`` (the Trainer's Lightning-named attributes), ``module.py`` (TaskModule, DataModule),
``callback.py`` (the Callback base and its hook order), ``options.py`` (every option, validated), ``state.py``
(TrainState), ``evaluation.py`` (validate / test / predict loops), ``metrics.py`` (``self.log``), ``hooks.py``,
``lifecycle.py`` (around every stage), ``compat.py`` (step signatures, ``torch.compile``), ``storage.py`` (local
and object-store paths) and ``doctor.py`` (``python -m trainer.doctor``). The subsystems are packages, each saying
in its docstring what it may import: :mod:`trainer.step`, :mod:`trainer.data`, :mod:`trainer.distributed`,
:mod:`trainer.checkpoint`, :mod:`trainer.loggers`, :mod:`trainer.observability` and :mod:`trainer.memory` (the
memory planner, ``python -m trainer.memory``). None of them imports ``trainer.py`` at run time, except the memory
planner's public face, which builds a Trainer. See docs/design.md.
"""

from trainer.callback import Callback
from trainer.checkpoint.hf import export_weights
from trainer.distributed.fsdp import FSDPStrategy
from trainer.distributed.strategy import DDPStrategy
from trainer.lifecycle import seed_everything
from trainer.module import DataModule, TaskModule
from trainer.observability.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn
from trainer.trainer import Trainer

__all__ = [
    "Callback",
    "DDPStrategy",
    "DataModule",
    "FSDPStrategy",
    "TaskModule",
    "Trainer",
    "export_weights",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "seed_everything",
]
__version__ = "0.1.0"
