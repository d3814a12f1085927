"""Built-in callbacks. All of them use only the public :class:`Callback` API.

``Callback``, ``ModelCheckpoint`` and ``ProgressBar`` are defined in ``trainer/`` (the Trainer adds the
last two by default and never imports this package) and re-exported here.
"""

from trainer.callback import Callback
from trainer.model_checkpoint import ModelCheckpoint
from trainer.progress import ProgressBar

from callbacks.gradient_accumulation import GradientAccumulationScheduler

__all__ = ["Callback", "GradientAccumulationScheduler", "ModelCheckpoint", "ProgressBar"]
