"""Tiny tasks and data shared by the tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import TaskModule


def regression_data(n: int = 64, features: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g, dtype=dtype)
    w = torch.randn(features, 1, generator=g, dtype=dtype)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=dtype)
    return TensorDataset(x, y)


def make_net(features: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


class Regression(TaskModule):
    """MSE regression with a configurable optimizer."""

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        scheduler: str | None = None,
        features: int = 8,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.net = make_net(features, seed, dtype)
        self.optimizer, self.lr, self.scheduler = optimizer, lr, scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return make_optimizer(self.net, self.optimizer, self.lr, self.scheduler)


def make_optimizer(net: nn.Module, name: str, lr: float, scheduler: str | None):
    if name == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    if scheduler is None:
        return opt
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": scheduler}}


def quiet(**kwargs):
    """Trainer options for tests: no files, no bar, no sanity pass unless asked."""
    base = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0)
    base.update(kwargs)
    return base


def loader(ds, batch_size: int, shuffle: bool = False, **kw) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, **kw)
