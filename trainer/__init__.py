"""keel: a Lightning-style trainer for PyTorch DistributedDataParallel.

``from trainer import Trainer, TaskModule`` is the whole user-facing core; see README.md.
"""

from trainer.callback import Callback
from trainer.lifecycle import seed_everything
from trainer.module import DataModule, TaskModule
from trainer.trainer import Trainer

__all__ = ["Callback", "DataModule", "TaskModule", "Trainer", "seed_everything"]
__version__ = "0.1.0"
