"""BasePredictionWriter: Lightning's callback for writing predictions as ``predict`` makes them, each rank its own.

A subclass implements ``write_on_batch_end`` (``write_interval="batch"``), ``write_on_epoch_end`` (``"epoch"``) or
both (``"batch_and_epoch"``). Every rank writes what it predicted itself, with the dataset index of every sample:
nothing is gathered, so a multi-rank predict can write its results without collecting them on one rank (run it with
``trainer.predict(..., return_predictions=False)``). keel shards prediction data contiguously (rank 0 the first
samples, rank 1 the next, ...), so the indices differ from Lightning's interleaved shards, but their union over the
ranks is every sample once, as in Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from trainer.callback import Callback

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer


class WriteInterval(str, Enum):
    """When a :class:`BasePredictionWriter` writes: after every batch, at the end of the run, or both."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Writes predictions as ``predict`` makes them (Lightning's ``BasePredictionWriter``).

    Each rank calls ``write_on_batch_end(trainer, pl_module, prediction, batch_indices, batch, batch_idx,
    dataloader_idx)`` after each of its batches (``prediction``: the step's output, where it was made;
    ``batch_indices``: the batch's dataset indices) and ``write_on_epoch_end(trainer, pl_module, predictions,
    batch_indices)`` once at the end (``predictions``: this rank's outputs on the CPU, one list, or one per loader
    with several; ``batch_indices``: per loader, per batch, the dataset indices). The outputs are kept for the
    epoch-end write also under ``return_predictions=False``, and ``predict`` then still returns None.

    Args:
        write_interval: ``"batch"``, ``"epoch"`` or ``"batch_and_epoch"``.

    Raises:
        ValueError: another ``write_interval``.
    """

    is_prediction_writer = True  # the predict loop keeps outputs and indices for these (trainer/evaluation.py)

    def __init__(self, write_interval: Literal["batch", "epoch", "batch_and_epoch"] = "batch") -> None:
        if write_interval not in [i.value for i in WriteInterval]:
            raise ValueError(
                f"`write_interval` should be one of {[i.value for i in WriteInterval]}, got {write_interval!r}."
            )
        self.interval = WriteInterval(write_interval)

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: TaskModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's prediction: override it for ``write_interval`` "batch" or "batch_and_epoch"."""
        raise NotImplementedError(
            f"{type(self).__name__} writes per batch (write_interval={self.interval.value!r}): implement "
            "write_on_batch_end."
        )

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: TaskModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        """Write all of this rank's predictions: override it for ``write_interval`` "epoch" or "batch_and_epoch"."""
        raise NotImplementedError(
            f"{type(self).__name__} writes at epoch end (write_interval={self.interval.value!r}): implement "
            "write_on_epoch_end."
        )

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.interval.on_batch:
            return
        batch_indices = trainer.predict_loop.current_batch_indices
        self.write_on_batch_end(trainer, pl_module, outputs, batch_indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: TaskModule) -> None:
        if not self.interval.on_epoch:
            return
        record = trainer.predict_loop
        self.write_on_epoch_end(trainer, pl_module, record.predictions, record.epoch_batch_indices)
