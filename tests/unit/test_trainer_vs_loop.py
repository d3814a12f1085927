"""The Trainer equals a hand-written PyTorch loop, bit for bit, on the same seed and data."""

from __future__ import annotations

import pytest
import torch
from models import Regression, loader, make_net, make_optimizer, quiet, regression_data
from torch.nn import functional as F

from trainer import Trainer


def hand_loop(optimizer: str, scheduler: str | None, epochs: int, batch_size: int) -> dict[str, torch.Tensor]:
    net = make_net()
    config = make_optimizer(net, optimizer, 0.05, scheduler)
    opt = config["optimizer"] if isinstance(config, dict) else config
    sched = config["lr_scheduler"]["scheduler"] if isinstance(config, dict) else None
    data = loader(regression_data(), batch_size)
    for _ in range(epochs):
        for x, y in data:
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None and scheduler == "step":
                sched.step()
        if sched is not None and scheduler == "epoch":
            sched.step()
    return net.state_dict()


@pytest.mark.parametrize("optimizer,scheduler", [("sgd", None), ("adamw", "step"), ("adamw", "epoch")])
def test_trainer_equals_hand_written_loop(optimizer: str, scheduler: str | None) -> None:
    expected = hand_loop(optimizer, scheduler, epochs=3, batch_size=10)  # 64 samples: a short last batch
    task = Regression(optimizer=optimizer, scheduler=scheduler)
    trainer = Trainer(**quiet(max_epochs=3))
    trainer.fit(task, train_dataloaders=loader(regression_data(), 10))
    got = task.net.state_dict()
    assert trainer.global_step == 3 * 7
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
