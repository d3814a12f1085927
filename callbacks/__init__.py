"""Built-in callbacks. All of them use only the public :class:`Callback` API.

``Callback``, ``ModelCheckpoint`` and ``ProgressBar`` are defined in ``trainer/`` (the Trainer adds the
last two by default and never imports this package) and re-exported here.

The others live here, one per module: ``EarlyStopping``, ``GradientAccumulationScheduler``,
``LambdaCallback``, ``LearningRateMonitor``, ``ModelSummary``, ``ThroughputMonitor``, ``Timer``, the
fine-tuning callbacks ``BaseFinetuning`` / ``BackboneFinetuning``, the weight averages ``WeightAveraging`` /
``EMAWeightAveraging`` / ``StochasticWeightAveraging`` and ``BasePredictionWriter`` (a base class for writing
predictions). ``callbacks.tuner`` holds Lightning's ``Tuner`` (the learning-rate and batch-size searches, run before
``fit`` on these hooks). ``callbacks.lightning`` (Lightning's names and module paths) and ``callbacks.lightning_cli``
(``LightningCLI`` on jsonargparse) serve ported programs. Every rank runs every hook; only side effects are gated to
rank 0, and a decision that stops training is taken from reduced metrics or broadcast from rank 0 (docs/design.md
section 7).
"""

from callbacks.early_stopping import EarlyStopping
from callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from callbacks.gradient_accumulation import GradientAccumulationScheduler
from callbacks.lambda_function import LambdaCallback
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_summary import ModelSummary
from callbacks.prediction_writer import BasePredictionWriter
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer
from callbacks.weight_averaging import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from trainer.callback import Callback
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.observability.progress import ProgressBar

__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "Callback",
    "EMAWeightAveraging",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "StochasticWeightAveraging",
    "ThroughputMonitor",
    "Timer",
    "WeightAveraging",
]
