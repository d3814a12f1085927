"""A Lightning-style prediction writer on every rank: each rank writes its own predictions with their dataset indices.

Usage: torchrun --nproc-per-node N prediction_writer.py OUT_DIR
Each rank writes OUT_DIR/rank{R}/batch-{dataloader_idx}-{batch_idx}.pt (``write_on_batch_end``: the batch's dataset
indices and predictions) and OUT_DIR/rank{R}/epoch.pt (``write_on_epoch_end``: this rank's predictions and batch
indices, and what ``predict`` returned). tests/integration/test_prediction_writer_dist.py runs :func:`predict_and_write`
in one process too and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks.lightning as L
from callbacks.lightning.pytorch.callbacks import BasePredictionWriter

SIZES = (11, 5)  # samples of the two predict loaders (uneven shards on 2 ranks)
BATCH = 4


def dataset(loader_idx: int) -> TensorDataset:
    """Sample i of loader d is the number 100 * d + i: a prediction names the sample it was made from."""
    return TensorDataset(torch.arange(SIZES[loader_idx], dtype=torch.float32).unsqueeze(1) + 100 * loader_idx)


class Writer(BasePredictionWriter):
    def __init__(self, out: Path) -> None:
        super().__init__("batch_and_epoch")
        self.out = out

    def folder(self, trainer: Any) -> Path:
        path = self.out / f"rank{trainer.global_rank}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        record = {"indices": list(batch_indices), "prediction": prediction.cpu()}
        torch.save(record, self.folder(trainer) / f"batch-{dataloader_idx}-{batch_idx}.pt")

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save({"predictions": predictions, "indices": batch_indices}, self.folder(trainer) / "epoch.pt")


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(10.0))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return batch[0].squeeze(1) * self.scale


def predict_and_write(out: Path) -> Any:
    """``trainer.predict(return_predictions=False)`` over both loaders with a writer; returns what predict returned."""
    writer = Writer(out)
    trainer = L.Trainer(
        logger=False, enable_progress_bar=False, enable_checkpointing=False, accelerator="cpu", callbacks=[writer]
    )
    loaders = [DataLoader(dataset(d), batch_size=BATCH) for d in range(len(SIZES))]
    returned = trainer.predict(Task(), loaders, return_predictions=False)
    epoch = writer.folder(trainer) / "epoch.pt"
    torch.save({**torch.load(epoch), "returned": returned}, epoch)
    return returned


if __name__ == "__main__":
    predict_and_write(Path(sys.argv[1]))
