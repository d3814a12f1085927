"""Manual optimization (automatic_optimization = False) with two optimizers, in one process: equals a hand-written
loop, and ``optimizers()`` / ``toggle_optimizer`` give the Trainer's optimizers. 2-rank DDP against one process
with the global batch: tests/integration/test_manual_optimization.py."""

from __future__ import annotations

import torch
from gan import GAN, gan_data, hand_written_gan
from models import quiet
from torch.utils.data import DataLoader

from trainer import Trainer


def test_gan_under_manual_optimization_equals_hand_written_loop() -> None:
    expected = hand_written_gan(batch_size=16, epochs=2)
    task = GAN()
    trainer = Trainer(**quiet(max_epochs=2, precision="64"))
    trainer.fit(task, DataLoader(gan_data(), batch_size=16))
    assert trainer.global_step == 8  # one step per training iteration, not per optimizer call
    got = task.state_dict()
    for name, value in expected.items():
        assert torch.allclose(got[name], value, atol=1e-12, rtol=0), name
    assert trainer.lr_scheduler_configs == [] and task.lr_schedulers() is None


def test_manual_optimizers_and_toggle() -> None:
    task = GAN()
    Trainer(**quiet(max_steps=1, precision="64")).fit(task, DataLoader(gan_data(), batch_size=16))
    opt_g, opt_d = task.optimizers()
    assert opt_g.optimizer is task.trainer.optimizers[0]
    task.toggle_optimizer(opt_d)
    assert not any(p.requires_grad for p in task.gen.parameters()) and all(
        p.requires_grad for p in task.disc.parameters()
    )
    task.untoggle_optimizer(opt_d)
    assert all(p.requires_grad for p in task.parameters())
