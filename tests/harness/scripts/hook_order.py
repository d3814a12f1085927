"""Record the order of every hook call for a small fit + validate + test; write it as JSON per rank.

Usage: hook_order.py OUT_DIR   (writes OUT_DIR/rank{R}.json, a list of event names)

Each rank sees the same number of batches whatever the world size (the datasets grow with it), so the
lists of a 2-rank run must equal the single-process list (tests/integration/test_hook_order.py).
tests/unit/test_hook_order_one_process.py imports :func:`record` and runs it in-process.

Events: ``task.<hook>`` for the TaskModule's hooks and steps, ``cb.<hook>`` for the callback's,
``optimizer.step`` from a torch optimizer step post-hook; setup/teardown carry their stage.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import Regression, loader, quiet, regression_data

from trainer import Callback, Trainer

TRAIN_BATCHES = 4  # per rank and epoch; with accumulate_grad_batches=2: 2 optimizer steps
VAL_BATCHES = 2  # per rank
BATCH = 2


class RecordingTask(Regression):
    """Regression that appends ``task.<name>`` to ``events`` in every hook and step."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.events.append("optimizer.step"))
        return optimizer

    def training_step(self, batch, batch_idx):
        self.events.append("task.training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.events.append("task.validation_step")
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.events.append("task.test_step")
        return super().test_step(batch, batch_idx)

    def setup(self, stage: str) -> None:
        self.events.append(f"task.setup({stage})")

    def teardown(self, stage: str) -> None:
        self.events.append(f"task.teardown({stage})")

    def on_fit_start(self) -> None:
        self.events.append("task.on_fit_start")

    def on_fit_end(self) -> None:
        self.events.append("task.on_fit_end")

    def on_train_start(self) -> None:
        self.events.append("task.on_train_start")

    def on_train_end(self) -> None:
        self.events.append("task.on_train_end")

    def on_train_epoch_start(self) -> None:
        self.events.append("task.on_train_epoch_start")

    def on_train_epoch_end(self) -> None:
        self.events.append("task.on_train_epoch_end")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.events.append("task.on_train_batch_start")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.events.append("task.on_train_batch_end")

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.events.append("task.on_before_backward")

    def on_after_backward(self) -> None:
        self.events.append("task.on_after_backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("task.on_before_optimizer_step")

    def on_validation_epoch_start(self) -> None:
        self.events.append("task.on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self.events.append("task.on_validation_epoch_end")

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append("task.on_validation_batch_end")

    def on_test_epoch_start(self) -> None:
        self.events.append("task.on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self.events.append("task.on_test_epoch_end")

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append("task.on_test_batch_end")

    def predict_step(self, batch, batch_idx):
        self.events.append("task.predict_step")
        return super().predict_step(batch, batch_idx)

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("task.on_before_zero_grad")

    def on_validation_start(self) -> None:
        self.events.append("task.on_validation_start")

    def on_validation_end(self) -> None:
        self.events.append("task.on_validation_end")

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append("task.on_validation_batch_start")

    def on_validation_model_eval(self) -> None:
        self.events.append("task.on_validation_model_eval")
        super().on_validation_model_eval()

    def on_validation_model_train(self) -> None:
        self.events.append("task.on_validation_model_train")
        super().on_validation_model_train()

    def on_test_start(self) -> None:
        self.events.append("task.on_test_start")

    def on_test_end(self) -> None:
        self.events.append("task.on_test_end")

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append("task.on_test_batch_start")

    def on_test_model_eval(self) -> None:
        self.events.append("task.on_test_model_eval")
        super().on_test_model_eval()

    def on_test_model_train(self) -> None:
        self.events.append("task.on_test_model_train")
        super().on_test_model_train()

    def on_predict_model_eval(self) -> None:
        self.events.append("task.on_predict_model_eval")
        super().on_predict_model_eval()

    def on_predict_start(self) -> None:
        self.events.append("task.on_predict_start")

    def on_predict_end(self) -> None:
        self.events.append("task.on_predict_end")

    def on_predict_epoch_start(self) -> None:
        self.events.append("task.on_predict_epoch_start")

    def on_predict_epoch_end(self) -> None:
        self.events.append("task.on_predict_epoch_end")

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append("task.on_predict_batch_start")

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append("task.on_predict_batch_end")


class RecordingCallback(Callback):
    """Appends ``cb.<hook>`` to ``events`` in every hook of :class:`Callback`."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def setup(self, trainer, task, stage):
        self.events.append(f"cb.setup({stage})")

    def teardown(self, trainer, task, stage):
        self.events.append(f"cb.teardown({stage})")

    def on_fit_start(self, trainer, task):
        self.events.append("cb.on_fit_start")

    def on_fit_end(self, trainer, task):
        self.events.append("cb.on_fit_end")

    def on_train_start(self, trainer, task):
        self.events.append("cb.on_train_start")

    def on_train_end(self, trainer, task):
        self.events.append("cb.on_train_end")

    def on_train_epoch_start(self, trainer, task):
        self.events.append("cb.on_train_epoch_start")

    def on_train_epoch_end(self, trainer, task):
        self.events.append("cb.on_train_epoch_end")

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        self.events.append("cb.on_train_batch_start")

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.events.append("cb.on_train_batch_end")

    def on_before_backward(self, trainer, task, loss):
        self.events.append("cb.on_before_backward")

    def on_after_backward(self, trainer, task):
        self.events.append("cb.on_after_backward")

    def on_before_optimizer_step(self, trainer, task, optimizer):
        self.events.append("cb.on_before_optimizer_step")

    def on_validation_epoch_start(self, trainer, task):
        self.events.append("cb.on_validation_epoch_start")

    def on_validation_epoch_end(self, trainer, task):
        self.events.append("cb.on_validation_epoch_end")

    def on_validation_batch_end(self, trainer, task, outputs, batch, batch_idx, dataloader_idx=0):
        self.events.append("cb.on_validation_batch_end")

    def on_test_epoch_start(self, trainer, task):
        self.events.append("cb.on_test_epoch_start")

    def on_test_epoch_end(self, trainer, task):
        self.events.append("cb.on_test_epoch_end")

    def on_test_batch_end(self, trainer, task, outputs, batch, batch_idx, dataloader_idx=0):
        self.events.append("cb.on_test_batch_end")

    def on_predict_epoch_end(self, trainer, task):
        self.events.append("cb.on_predict_epoch_end")

    def on_before_zero_grad(self, trainer, task, optimizer):
        self.events.append("cb.on_before_zero_grad")

    def on_sanity_check_start(self, trainer, task):
        self.events.append("cb.on_sanity_check_start")

    def on_sanity_check_end(self, trainer, task):
        self.events.append("cb.on_sanity_check_end")

    def on_validation_start(self, trainer, task):
        self.events.append("cb.on_validation_start")

    def on_validation_end(self, trainer, task):
        self.events.append("cb.on_validation_end")

    def on_validation_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self.events.append("cb.on_validation_batch_start")

    def on_test_start(self, trainer, task):
        self.events.append("cb.on_test_start")

    def on_test_end(self, trainer, task):
        self.events.append("cb.on_test_end")

    def on_test_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self.events.append("cb.on_test_batch_start")

    def on_predict_start(self, trainer, task):
        self.events.append("cb.on_predict_start")

    def on_predict_end(self, trainer, task):
        self.events.append("cb.on_predict_end")

    def on_predict_epoch_start(self, trainer, task):
        self.events.append("cb.on_predict_epoch_start")

    def on_predict_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self.events.append("cb.on_predict_batch_start")

    def on_predict_batch_end(self, trainer, task, outputs, batch, batch_idx, dataloader_idx=0):
        self.events.append("cb.on_predict_batch_end")

    def on_save_checkpoint(self, trainer, task, checkpoint):
        self.events.append("cb.on_save_checkpoint")

    def on_load_checkpoint(self, trainer, task, checkpoint):
        self.events.append("cb.on_load_checkpoint")

    def on_exception(self, trainer, task, exception):
        self.events.append("cb.on_exception")


def record() -> list[str]:
    """Fit 2 epochs (accumulate_grad_batches=2, validation each epoch, 1 sanity batch), validate, test, predict."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    events: list[str] = []
    task = RecordingTask(events)
    trainer = Trainer(
        **quiet(
            max_epochs=2,
            accumulate_grad_batches=2,
            num_sanity_val_steps=1,
            log_every_n_steps=1,
            callbacks=[RecordingCallback(events)],
        )
    )
    train = regression_data(TRAIN_BATCHES * BATCH * world_size)
    val = regression_data(VAL_BATCHES * BATCH * world_size, seed=1)
    trainer.fit(task, loader(train, BATCH), loader(val, BATCH))
    trainer.validate(task, loader(val, BATCH))
    trainer.test(task, loader(val, BATCH))
    trainer.predict(task, loader(val, BATCH))
    return events


def main() -> None:
    out = Path(sys.argv[1])
    events = record()
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(events))


if __name__ == "__main__":
    main()
