"""A fractional ``val_check_interval`` (Lightning's float in (0, 1]) validates after the same training batches as
Lightning 2.6.6: every ``max(1, int(batches_per_epoch * fraction))`` batches of the epoch (after
``limit_train_batches``), counted per epoch, inside an accumulation window too; 1.0 at epoch ends; refused for a
training loader without a length and with ``check_val_every_n_epoch=None``. keel's int ``val_check_interval`` (every
N optimizer steps) is unchanged (tests/unit/test_trainer_api.py, tests/unit/test_lightning_logging.py).

Lightning 2.6.6's numbers were measured with the reference install on the program below written against
``lightning.pytorch`` (``Trainer(accelerator="cpu", max_epochs=2, num_sanity_val_steps=0)`` plus each case's options,
10 training batches of 1 sample, 2 validation batches): for each validation run, the ``(epoch, batch_idx)`` of the
last training batch before it (recorded in ``on_train_batch_end``) and ``global_step`` (in
``on_validation_start``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import quiet
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import callbacks.lightning as L

# case -> (options, the (epoch, batch_idx) after which each validation ran, global_step at each), Lightning 2.6.6.
LIGHTNING: dict[str, tuple[dict[str, Any], list[tuple[int, int]], list[int]]] = {
    "0.3": (dict(val_check_interval=0.3), [(0, 2), (0, 5), (0, 8), (1, 2), (1, 5), (1, 8)], [3, 6, 9, 13, 16, 19]),
    "0.25": (
        dict(val_check_interval=0.25),
        [(0, 1), (0, 3), (0, 5), (0, 7), (0, 9), (1, 1), (1, 3), (1, 5), (1, 7), (1, 9)],
        [2, 4, 6, 8, 10, 12, 14, 16, 18, 20],
    ),
    "1.0": (dict(val_check_interval=1.0), [(0, 9), (1, 9)], [10, 20]),
    "0.05 (less than a batch: every batch)": (
        dict(val_check_interval=0.05),
        [(epoch, i) for epoch in (0, 1) for i in range(10)],
        list(range(1, 21)),
    ),
    # By batch, not by optimizer step: runs fall inside accumulation windows (4 batches a step).
    "0.3, accumulate_grad_batches=4": (
        dict(val_check_interval=0.3, accumulate_grad_batches=4),
        [(0, 2), (0, 5), (0, 8), (1, 2), (1, 5), (1, 8)],
        [0, 1, 2, 3, 4, 5],
    ),
    "0.5, limit_train_batches=7": (
        dict(val_check_interval=0.5, limit_train_batches=7),
        [(0, 2), (0, 5), (1, 2), (1, 5)],
        [3, 6, 10, 13],
    ),
    "0.5, limit_train_batches=0.75": (
        dict(val_check_interval=0.5, limit_train_batches=0.75),
        [(0, 2), (0, 5), (1, 2), (1, 5)],
        [3, 6, 10, 13],
    ),
    "0.5, check_val_every_n_epoch=2": (
        dict(val_check_interval=0.5, check_val_every_n_epoch=2),
        [(1, 4), (1, 9)],
        [15, 20],
    ),
    # max_steps stops after batch 4: no validation at the stop.
    "0.4, max_steps=5": (dict(val_check_interval=0.4, max_steps=5), [(0, 3)], [4]),
}


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.last: tuple[int, int] | None = None
        self.runs: list[tuple[int, int] | None] = []
        self.steps: list[int] = []
        self.due: list[tuple[int, int]] = []  # where trainer.val_check_due said validation follows

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last = (self.current_epoch, batch_idx)
        if self.trainer.val_check_due:
            self.due.append(self.last)

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.runs.append(self.last)
            self.steps.append(self.global_step)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data(n: int = 10) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 3), torch.randn(n, 1)), batch_size=1)


class Stream(IterableDataset):
    """Ten samples and no ``len()``."""

    def __iter__(self):
        for _ in range(10):
            yield torch.randn(3), torch.randn(1)


def fit(train: DataLoader, **options: Any) -> Task:
    task = Task()
    L.Trainer(**quiet(**{"max_epochs": 2, **options})).fit(task, train, data(2))
    return task


@pytest.mark.parametrize("case", sorted(LIGHTNING))
def test_validation_runs_after_the_same_batches_as_lightning(case: str) -> None:
    options, runs, steps = LIGHTNING[case]
    task = fit(data(), **options)
    assert (task.runs, task.steps) == (runs, steps)
    if options["val_check_interval"] < 1.0:
        assert task.due == runs  # ModelCheckpoint(every_n_train_steps, monitor=...) waits for these runs


def test_a_loader_without_length_validates_at_epoch_ends_with_1_0_and_refuses_a_fraction() -> None:
    """Lightning 2.6.6: ``val_check_interval=1.0`` with an IterableDataset validates after batch 9 of each epoch;
    0.5 raises ("When using an IterableDataset for `train_dataloader`, `Trainer(val_check_interval)` must be time
    based, `1.0` or an int.")."""
    task = fit(DataLoader(Stream(), batch_size=1), val_check_interval=1.0)
    assert task.runs == [(0, 9), (1, 9)]
    with pytest.raises(ValueError, match=r"val_check_interval=0\.5\) is a fraction .* has no len\(\)"):
        fit(DataLoader(Stream(), batch_size=1), val_check_interval=0.5)


def test_a_fraction_is_refused_without_check_val_every_n_epoch_and_outside_0_1() -> None:
    """Lightning 2.6.6 refuses a float with ``check_val_every_n_epoch=None`` at construction ("`val_check_interval`
    should be an integer or a time-based duration ... when `check_val_every_n_epoch=None`.")."""
    with pytest.raises(ValueError, match="check_val_every_n_epoch=None counts no epochs"):
        L.Trainer(val_check_interval=0.5, check_val_every_n_epoch=None)
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ValueError, match=r"a float in \(0\.0, 1\.0\]"):
            L.Trainer(val_check_interval=bad)
