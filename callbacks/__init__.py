"""Built-in callbacks. All of them use only the public :class:`Callback` API.

``Callback``, ``ModelCheckpoint`` and ``ProgressBar`` are defined in ``trainer/`` (the Trainer adds the
last two by default and never imports this package) and re-exported here.
"""

from callbacks.early_stopping import EarlyStopping
from callbacks.lambda_function import LambdaCallback
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_summary import ModelSummary
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer
from trainer.callback import Callback
from trainer.model_checkpoint import ModelCheckpoint
from trainer.progress import ProgressBar

__all__ = [
    "Callback",
    "EarlyStopping",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "ThroughputMonitor",
    "Timer",
]
