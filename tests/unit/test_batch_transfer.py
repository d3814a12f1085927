"""Lightning's batch-transfer hooks: ``on_before_batch_transfer``, ``transfer_batch_to_device`` and
``on_after_batch_transfer`` run for every training, validation, test and predict batch, in Lightning's order and
with its arguments; a datamodule's override wins over the task's. A task that overrides none of them costs the loop
nothing (the batch is used as the loader made it on the CPU).

The expected calls are Lightning 2.6.6's, measured with the reference install on the program below (the same task
and loaders as ``lightning.pytorch`` classes, ``Trainer(accelerator="cpu", max_epochs=1, num_sanity_val_steps=1)``,
``fit`` with two validation loaders, ``test`` with one, ``predict`` with two), each call recorded as it is made.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from models import Regression, quiet, regression_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks.lightning as L
from trainer import Trainer
from trainer.data.transfer import BatchCopier
from trainer.hooks import BatchTransfer

CALLS: list[tuple[Any, ...]] = []


def data(n: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        CALLS.append(("task.before", dataloader_idx))
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        CALLS.append(("task.transfer", str(device), dataloader_idx))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        CALLS.append(("task.after", dataloader_idx))
        return batch

    def on_train_batch_start(self, batch, batch_idx):
        CALLS.append(("task.on_train_batch_start", batch_idx))

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        CALLS.append(("task.validation_step", batch_idx, dataloader_idx))

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        CALLS.append(("task.test_step", batch_idx, dataloader_idx))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        CALLS.append(("task.predict_step", batch_idx, dataloader_idx))
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DM(L.LightningDataModule):
    def train_dataloader(self):
        return data()

    def val_dataloader(self):
        return [data(2), data(2)]

    def on_before_batch_transfer(self, batch, dataloader_idx):
        CALLS.append(("dm.before", dataloader_idx))
        return batch


def hooks(who: tuple[str, str, str], idx: int) -> list[tuple[Any, ...]]:
    before, transfer, after = who
    return [(f"{before}.before", idx), (f"{transfer}.transfer", "cpu", idx), (f"{after}.after", idx)]


TASK = ("task", "task", "task")
# Lightning 2.6.6, fit (sanity check: one batch of each validation loader; two training batches; validation), then
# test and predict: the hooks run for every batch before its batch hooks and step, with the loader's index.
LIGHTNING_FIT = [
    *hooks(TASK, 0),
    ("task.validation_step", 0, 0),
    *hooks(TASK, 1),
    ("task.validation_step", 0, 1),
    *hooks(TASK, 0),
    ("task.on_train_batch_start", 0),
    *hooks(TASK, 0),
    ("task.on_train_batch_start", 1),
    *hooks(TASK, 0),
    ("task.validation_step", 0, 0),
    *hooks(TASK, 1),
    ("task.validation_step", 0, 1),
]
LIGHTNING_TEST_PREDICT = [
    *hooks(TASK, 0),
    ("task.test_step", 0, 0),
    *hooks(TASK, 0),
    ("task.predict_step", 0, 0),
    *hooks(TASK, 1),
    ("task.predict_step", 0, 1),
]
# The same fit with DM (which overrides on_before_batch_transfer only): the datamodule's hook wins, the task's other
# two still run, and Lightning warns about each of the three.
DATAMODULE = ("dm", "task", "task")
LIGHTNING_DM_FIT = [
    *hooks(DATAMODULE, 0),
    ("task.validation_step", 0, 0),
    *hooks(DATAMODULE, 1),
    ("task.validation_step", 0, 1),
    *hooks(DATAMODULE, 0),
    ("task.on_train_batch_start", 0),
    *hooks(DATAMODULE, 0),
    ("task.on_train_batch_start", 1),
    *hooks(DATAMODULE, 0),
    ("task.validation_step", 0, 0),
    *hooks(DATAMODULE, 1),
    ("task.validation_step", 0, 1),
]
LIGHTNING_DM_WARNINGS = [
    "You have overridden `on_after_batch_transfer` in `LightningModule` but have passed in a `LightningDataModule`. "
    "It will use the implementation from `LightningModule` instance.",
    "You have overridden `on_before_batch_transfer` in both `LightningModule` and `LightningDataModule`. It will use "
    "the implementation from `LightningDataModule` instance.",
    "You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a `LightningDataModule`. "
    "It will use the implementation from `LightningModule` instance.",
]


def trainer(**kw: Any) -> Trainer:
    return L.Trainer(**quiet(max_epochs=1, num_sanity_val_steps=1, **kw))


def test_the_hooks_run_for_every_batch_of_every_stage_as_in_lightning() -> None:
    CALLS.clear()
    run = trainer()
    run.fit(Task(), data(), [data(2), data(2)])
    assert CALLS == LIGHTNING_FIT
    CALLS.clear()
    run.test(run.lightning_module, data(2), verbose=False)
    run.predict(run.lightning_module, [data(2), data(2)])
    assert CALLS == LIGHTNING_TEST_PREDICT


def test_a_datamodules_hook_wins_with_lightnings_warnings() -> None:
    CALLS.clear()

    class Task2(Task):  # a class of its own: the warnings are given once per pair of classes
        pass

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer().fit(Task2(), datamodule=DM())
    assert CALLS == LIGHTNING_DM_FIT
    assert sorted({str(w.message) for w in record if "overridden" in str(w.message)}) == LIGHTNING_DM_WARNINGS


class Augmenting(Regression):
    """Adds noise to the inputs of each training batch, in ``on_after_batch_transfer`` (``hook=True``) or at the top
    of ``training_step``: the same random numbers in the same order when each hook runs once per batch."""

    def __init__(self, *, hook: bool) -> None:
        super().__init__()
        self.hook, self.augmented = hook, 0

    def augment(self, batch):
        self.augmented += 1
        x, y = batch
        return x + 0.1 * torch.randn_like(x), y

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return self.augment(batch) if self.hook else batch

    def training_step(self, batch, batch_idx):
        return super().training_step(batch if self.hook else self.augment(batch), batch_idx)


def test_augmenting_in_on_after_batch_transfer_runs_once_per_batch_and_trains_the_same() -> None:
    loader = DataLoader(regression_data(256), batch_size=2)  # 128 batches
    in_hook, in_step = Augmenting(hook=True), Augmenting(hook=False)
    for task in (in_hook, in_step):
        Trainer(**quiet(max_epochs=1)).fit(task, loader)
    assert in_hook.augmented == in_step.augmented == 128
    for a, b in zip(in_hook.state_dict().values(), in_step.state_dict().values()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(in_hook.state_dict().values(), Regression().state_dict().values()))


def test_without_an_override_the_loop_copies_as_before() -> None:
    """The hot path: no hook object, and on the CPU the loader's batch itself reaches the step."""
    seen: list[Any] = []

    class Plain(Regression):
        def training_step(self, batch, batch_idx):
            seen.append(batch)
            return super().training_step(batch, batch_idx)

    run = Trainer(**quiet(max_steps=1))
    run.fit(Plain(), DataLoader(regression_data(8), batch_size=8))
    assert isinstance(run._copy_batch, BatchCopier) and run._moves_batches is False
    cpu = torch.device("cpu")
    assert BatchTransfer.resolve(Regression(), L.LightningDataModule(), device=cpu, float_dtype=None, move=id) is None
    assert BatchTransfer.resolve(Regression(), DM(), device=cpu, float_dtype=None, move=id) is not None


def test_a_custom_batch_type_moves_in_transfer_batch_to_device_and_precision_64_converts_first() -> None:
    """Lightning 2.6.6 with ``precision="64-true"``: ``on_before_batch_transfer`` already gets float64 inputs (its
    precision plugin converts them first) and integer tensors unchanged."""

    class Batch:
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

    seen: list[Any] = []

    class Custom(Regression):
        def __init__(self) -> None:
            super().__init__(features=3)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            seen.append((batch[0].dtype, batch[1].dtype))
            return Batch(*batch)

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            assert isinstance(batch, Batch) and device == torch.device("cpu")
            return Batch(batch.x.to(device), batch.y.to(device, torch.float64).unsqueeze(1))

        def training_step(self, batch, batch_idx):
            return super().training_step((batch.x, batch.y), batch_idx)

    loader = DataLoader(TensorDataset(torch.randn(4, 3), torch.arange(4)), batch_size=2)
    Trainer(**quiet(max_epochs=1, precision="64")).fit(Custom(), loader)
    assert seen == [(torch.float64, torch.int64)] * 2


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_an_evaluation_batch_gets_the_transformed_batch(stage: str) -> None:
    """What ``on_after_batch_transfer`` returns is what the step and the batch hooks get."""
    seen: list[Any] = []

    class Doubling(Regression):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch[0] * 2, batch[1]

        def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
            seen.append(batch[0])

        on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    loader = DataLoader(regression_data(4), batch_size=4)
    getattr(Trainer(**quiet()), stage)(Doubling(), loader)
    assert len(seen) == 1 and torch.equal(seen[0], regression_data(4).tensors[0] * 2)
