"""Lightning's examples/pytorch/basics/autoencoder.py (LitAutoEncoder + MyDataModule), ported.

Changed: the imports (one line, marked) and MNIST from :mod:`standins`. The example's ``cli_main`` builds a
``LightningCLI``; keel has none (``L.LightningCLI`` says so), so :func:`main` makes the same calls on a Trainer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, random_split

from callbacks.lightning import LightningDataModule, LightningModule, Trainer  # was: from lightning.pytorch import ...
from lightning_ports.standins import MNIST

DATASETS_PATH = "."


class LitAutoEncoder(LightningModule):
    """
    >>> LitAutoEncoder()  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    LitAutoEncoder(
      (encoder): ...
      (decoder): ...
    )
    """

    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    def forward(self, x):
        z = self.encoder(x)
        return self.decoder(z)

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        dataset = MNIST(DATASETS_PATH, train=True, download=True)
        self.mnist_test = MNIST(DATASETS_PATH, train=False, download=True)
        self.mnist_train, self.mnist_val = random_split(
            dataset, [80, 16], generator=torch.Generator().manual_seed(42)  # was [55000, 5000] of real MNIST
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def main(**trainer_options) -> dict:
    """The example's cli_main without LightningCLI: fit, then test and predict from the best checkpoint."""
    model, datamodule = LitAutoEncoder(), MyDataModule(batch_size=8)
    trainer = Trainer(**trainer_options)
    trainer.fit(model, datamodule)  # the DataModule positionally, as Lightning allows
    tested = trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    return {"trainer": trainer, "model": model, "tested": tested, "predictions": predictions}
