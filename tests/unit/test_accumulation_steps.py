"""Gradient accumulation in one process: the windows of an epoch (a short last window normalised by its own size,
or dropped), schedules on the step clock, and bad input. The token-weighted equivalence across (accumulation,
ranks, micro-batch) splits is launched: tests/integration/test_accumulation.py."""

from __future__ import annotations

import pytest
import torch
from models import Regression, loader, make_net, quiet, regression_data
from torch.nn import functional as F

from callbacks import GradientAccumulationScheduler
from trainer import Callback, Trainer
from trainer.step.accumulation import AccumulationSchedule


class StepCounter(Callback):
    def __init__(self) -> None:
        self.optimizer_steps = 0
        self.k_per_step: list[int] = []

    def on_before_optimizer_step(self, trainer, task, optimizer) -> None:
        self.optimizer_steps += 1
        self.k_per_step.append(trainer.accumulate_grad_batches)


def test_epoch_of_ten_batches_with_accumulation_four() -> None:
    """Windows of 4, 4, 2: three optimizer steps and three step-interval scheduler steps per epoch; the
    last window is normalised by 2 (checked against batches of 16, 16, 8)."""
    data = regression_data(40, dtype=torch.float64)
    net = make_net(dtype=torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        for x, y in loader(data, 16):
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()

    class Scheduled(Regression):
        def configure_optimizers(self):
            o = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return {
                "optimizer": o,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(o, 2, 0.5), "interval": "step"},
            }

    counter = StepCounter()
    task = Scheduled(dtype=torch.float64)
    trainer = Trainer(**quiet(max_epochs=2, accumulate_grad_batches=4, precision="64", callbacks=[counter]))
    trainer.fit(task, loader(data, 4))
    assert trainer.global_step == counter.optimizer_steps == 6
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6
    for name, value in net.state_dict().items():
        assert torch.allclose(task.net.state_dict()[name], value, atol=1e-12, rtol=0), name


def test_drop_incomplete_accumulation_skips_the_short_window() -> None:
    counter = StepCounter()
    trainer = Trainer(
        **quiet(max_epochs=1, accumulate_grad_batches=4, drop_incomplete_accumulation=True, callbacks=[counter])
    )
    trainer.fit(Regression(), loader(regression_data(40), 4))
    assert trainer.global_step == 2


@pytest.mark.parametrize(
    "scheduling,expected",
    [
        ({0: 1, 1: 2, 2: 5}, [1] * 10 + [2] * 5 + [5] * 2),  # per epoch (10 batches per epoch)
        ({"step": {0: 1, 3: 2, 5: 4}}, [1, 1, 1, 2, 2, 4, 4, 4]),  # per global step
    ],
)
def test_accumulation_schedule_changes_on_step_boundaries(scheduling, expected) -> None:
    counter = StepCounter()
    trainer = Trainer(**quiet(max_epochs=3, callbacks=[counter, GradientAccumulationScheduler(scheduling)]))
    trainer.fit(Regression(), loader(regression_data(40), 4))
    assert counter.k_per_step[: len(expected)] == expected


def test_schedule_is_a_function_of_the_step_clock() -> None:
    schedule = AccumulationSchedule({"step": {2: 3, 10: 8}})
    assert [schedule.k(epoch=0, global_step=s) for s in (0, 1, 2, 9, 10, 99)] == [1, 1, 3, 3, 8, 8]
    assert AccumulationSchedule({1: 4}).k(epoch=0, global_step=50) == 1


@pytest.mark.parametrize(
    "bad,match",
    [
        (0, "accumulate_grad_batches=0"),
        (2.5, "accumulate_grad_batches=2.5"),
        ({2: 1, 1: 2}, "strictly increasing"),
        ({-1: 2}, "key -1"),
        ({0: 0}, "value 0"),
        ({"step": {0: 1.5}}, "value 1.5"),
        ({}, "non-empty"),
    ],
)
def test_bad_accumulation_values_are_named(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        Trainer(accumulate_grad_batches=bad)
    if isinstance(bad, dict) and bad:
        with pytest.raises(ValueError, match=match):
            GradientAccumulationScheduler(bad)


def test_scheduler_and_option_together_are_refused() -> None:
    trainer = Trainer(
        **quiet(max_epochs=1, accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({0: 2})])
    )
    with pytest.raises(ValueError, match="both set accumulation"):
        trainer.fit(Regression(), loader(regression_data(), 8))
