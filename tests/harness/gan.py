"""A small GAN under manual optimization (two optimizers), shared by tests and scripts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from trainer import TaskModule


def gan_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    real = torch.randn(n, 2, generator=g, dtype=torch.float64) * 0.5 + 1.0
    noise = torch.randn(n, 4, generator=g, dtype=torch.float64)  # fixed noise: no RNG in the step
    return TensorDataset(real, noise)


def make_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    disc = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return gen, disc


def d_loss_fn(disc, real, fake):
    ones, zeros = torch.ones(len(real), 1, dtype=real.dtype), torch.zeros(len(real), 1, dtype=real.dtype)
    return F.binary_cross_entropy_with_logits(disc(real), ones) + F.binary_cross_entropy_with_logits(disc(fake), zeros)


def g_loss_fn(disc, fake):
    return F.binary_cross_entropy_with_logits(disc(fake), torch.ones(len(fake), 1, dtype=fake.dtype))


class GAN(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = make_nets()

    def forward(self, noise):
        return self.gen(noise)

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_d)
        d_loss = d_loss_fn(self.disc, real, self.gen(noise).detach())
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = g_loss_fn(self.disc, self.gen(noise))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=0.01), torch.optim.Adam(self.disc.parameters(), lr=0.01)]


def hand_written_gan(batch_size: int, epochs: int) -> dict[str, torch.Tensor]:
    gen, disc = make_nets()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=0.01), torch.optim.Adam(disc.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(gan_data(), batch_size=batch_size)
    for _ in range(epochs):
        for real, noise in data:
            d_loss_fn(disc, real, gen(noise).detach()).backward()
            opt_d.step()
            opt_d.zero_grad()
            for p in disc.parameters():
                p.requires_grad_(False)
            g_loss_fn(disc, gen(noise)).backward()
            opt_g.step()
            opt_g.zero_grad()
            for p in disc.parameters():
                p.requires_grad_(True)
    return {
        **{f"gen.{k}": v for k, v in gen.state_dict().items()},
        **{f"disc.{k}": v for k, v in disc.state_dict().items()},
    }
