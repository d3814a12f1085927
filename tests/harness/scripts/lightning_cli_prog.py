"""A LightningCLI program written as a Lightning user writes one, with its imports rewritten for keel.

Changed from the Lightning original: ``import lightning as L`` became ``import callbacks.lightning as L`` and
``from lightning.pytorch.cli import LightningCLI`` became ``from callbacks.lightning.pytorch.cli import LightningCLI``
(marked below); nothing else. tests/integration/test_lightning_cli.py runs it as ``python lightning_cli_prog.py
fit ...`` (and under torchrun); tests/unit/test_lightning_cli_in_process.py builds the same CLI in-process from
:func:`cli_main`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import callbacks.lightning as L  # was: import lightning as L
from callbacks.lightning.pytorch.cli import LightningCLI  # was: from lightning.pytorch.cli import LightningCLI


class PlainModel(L.LightningModule):
    """A small MLP fitted to a noisy linear target, without ``configure_optimizers``: its optimizer comes from
    ``--optimizer`` (and ``--lr_scheduler``).

    Args:
        hidden: Width of the hidden layer.
        lr: The learning rate of :class:`RegressionModel`'s SGD.
    """

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


class RegressionModel(PlainModel):
    """:class:`PlainModel` with its own SGD optimizer."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RegressionData(L.LightningDataModule):
    """Random inputs and a fixed linear target, the same on every run.

    Args:
        batch_size: Samples per batch.
        num_samples: Samples in each split.
    """

    def __init__(self, batch_size: int = 16, num_samples: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_samples = num_samples

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.num_samples, 4, generator=g)
        y = x @ torch.randn(4, 1, generator=g) + 0.1 * torch.randn(self.num_samples, 1, generator=g)
        self.dataset = TensorDataset(x, y)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)


def cli_main(**kwargs) -> LightningCLI:
    """The program's command line: the options of :class:`RegressionModel`, :class:`RegressionData` and the
    Trainer, with the defaults below (``kwargs`` override the LightningCLI arguments)."""
    options = dict(
        model_class=RegressionModel,
        datamodule_class=RegressionData,
        trainer_defaults={"max_epochs": 2, "log_every_n_steps": 1, "enable_progress_bar": False},
        seed_everything_default=1234,
    )
    options.update(kwargs)
    return LightningCLI(**options)


if __name__ == "__main__":
    cli_main()
