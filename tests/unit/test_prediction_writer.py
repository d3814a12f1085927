"""BasePredictionWriter in one process makes Lightning 2.6.6's calls: ``write_on_batch_end`` with each batch's
dataset indices, ``write_on_epoch_end`` with the run's predictions and per-loader, per-batch indices, for
``write_interval`` "batch" / "epoch" / "batch_and_epoch", and ``return_predictions`` decides only what ``predict``
returns. The 2-rank run is tests/integration/test_prediction_writer_dist.py.

The expected values are Lightning 2.6.6's, measured with the reference install: the writer and task below written
against ``lightning.pytorch`` (``Trainer(accelerator="cpu")``), ``trainer.predict`` over one loader (7 samples, the
numbers 0..6, batch size 3) and over two (the second: 100..103), for each interval and ``return_predictions`` True
and False, each call's arguments recorded. The calls were the same in every case but for which kinds were made
(batch writes for "batch" and "batch_and_epoch", the epoch write for "epoch" and "batch_and_epoch"), and ``predict``
returned the predictions with ``return_predictions=True`` and None otherwise.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks.lightning as L
from callbacks.lightning.pytorch.callbacks import BasePredictionWriter
from callbacks.lightning.pytorch.callbacks.prediction_writer import WriteInterval


def values(p: Any) -> Any:
    return p.flatten().tolist() if isinstance(p, torch.Tensor) else [values(x) for x in p]


class Writer(BasePredictionWriter):
    def __init__(self, interval: str) -> None:
        super().__init__(interval)
        self.batches: list[Any] = []
        self.epochs: list[Any] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((list(batch_indices), batch_idx, dataloader_idx, values(prediction)))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epochs.append((values(predictions), batch_indices))


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(1, 1)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return batch[0] * 10


def data(n: int, offset: int = 0) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(offset, offset + n, dtype=torch.float32).unsqueeze(1)), batch_size=3)


# Lightning 2.6.6: (batch_indices, batch_idx, dataloader_idx, prediction) of each write_on_batch_end, and the
# (predictions, batch_indices) of write_on_epoch_end, with one loader and with two.
ONE_BATCHES = [([0, 1, 2], 0, 0, [0.0, 10.0, 20.0]), ([3, 4, 5], 1, 0, [30.0, 40.0, 50.0]), ([6], 2, 0, [60.0])]
ONE_EPOCH = ([[0.0, 10.0, 20.0], [30.0, 40.0, 50.0], [60.0]], [[[0, 1, 2], [3, 4, 5], [6]]])
TWO_BATCHES = [*ONE_BATCHES, ([0, 1, 2], 0, 1, [1000.0, 1010.0, 1020.0]), ([3], 1, 1, [1030.0])]
TWO_EPOCH = (
    [[[0.0, 10.0, 20.0], [30.0, 40.0, 50.0], [60.0]], [[1000.0, 1010.0, 1020.0], [1030.0]]],
    [[[0, 1, 2], [3, 4, 5], [6]], [[0, 1, 2], [3]]],
)


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
@pytest.mark.parametrize("returned", [True, False])
@pytest.mark.parametrize("two", [False, True], ids=["one loader", "two loaders"])
def test_the_writes_and_the_return_value_are_lightnings(interval: str, returned: bool, two: bool) -> None:
    writer = Writer(interval)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, callbacks=[writer])
    loaders = [data(7), data(4, 100)] if two else data(7)
    out = trainer.predict(Task(), loaders, return_predictions=returned)
    batches, epoch = (TWO_BATCHES, TWO_EPOCH) if two else (ONE_BATCHES, ONE_EPOCH)
    assert writer.batches == (batches if "batch" in interval else [])
    assert writer.epochs == ([epoch] if "epoch" in interval else [])
    assert (None if out is None else values(out)) == (epoch[0] if returned else None)
    # Lightning keeps the outputs after the run only when predict returns them.
    assert (trainer.predict_loop.predictions != []) is returned and trainer.predict_loop.epoch_batch_indices == []


def test_the_write_interval_is_checked_and_has_lightnings_flags() -> None:
    # Lightning 2.6.6: MisconfigurationException("`write_interval` should be one of ['batch', 'epoch',
    # 'batch_and_epoch']."); keel raises ValueError with that text.
    with pytest.raises(ValueError, match=r"`write_interval` should be one of \['batch', 'epoch', 'batch_and_epoch'\]"):
        Writer("step")
    assert [(i.on_batch, i.on_epoch) for i in WriteInterval] == [(True, False), (False, True), (True, True)]
    assert WriteInterval("epoch") == "epoch" and BasePredictionWriter().interval is WriteInterval.BATCH
    with pytest.raises(NotImplementedError, match="implement write_on_batch_end"):
        L.Trainer(logger=False, enable_progress_bar=False, callbacks=[BasePredictionWriter()]).predict(Task(), data(3))


def test_a_loader_keel_uses_as_it_is_gives_empty_indices_with_a_warning() -> None:
    """Lightning 2.6.6 warns "Couldn't infer the batch indices fetched from your dataloader" for a loader it cannot
    wrap, and the writer gets no indices."""

    class Batches:  # an iterable of batches, not a DataLoader
        def __iter__(self):
            return iter([(torch.ones(2, 1),), (torch.ones(1, 1),)])

    writer = Writer("batch_and_epoch")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        L.Trainer(logger=False, enable_progress_bar=False, callbacks=[writer]).predict(Task(), Batches())
    assert any("Couldn't infer the batch indices" in str(w.message) for w in record)
    assert [b[0] for b in writer.batches] == [[], []] and writer.epochs[0][1] == [[]]


def test_without_a_writer_or_return_nothing_is_kept() -> None:
    trainer = L.Trainer(logger=False, enable_progress_bar=False)
    assert trainer.predict(Task(), data(7), return_predictions=False) is None
    assert trainer.predict_loop.predictions == [] and trainer.predict_loop.current_batch_indices == []
