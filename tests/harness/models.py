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


class LlamaLayer(nn.Module):
    """A Llama-style decoder layer: RMSNorm, grouped-query attention, a SwiGLU MLP."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(TaskModule):
    """Llama-3-70B's shape by default (70.55B parameters), for memory plans on the meta device."""

    def __init__(
        self, width: int = 8192, layers: int = 80, heads: int = 64, kv_heads: int = 8, hidden: int = 28672
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(128256, width)
        self.layers = nn.ModuleList(LlamaLayer(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, 128256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)
