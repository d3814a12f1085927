"""2-rank checks of Lightning-style logging (reduce_fx, rank_zero_only and metric objects under DDP) and of
the files Lightning's ModelCheckpoint leaves.

Usage: torchrun --nproc-per-node 2 lightning_port_ddp.py OUT_DIR [checkpoint]
Writes OUT_DIR/rank{R}.json with what every rank saw (tests/integration/test_metrics_objects.py checks it); with
``checkpoint``, OUT_DIR/rank{R}.pt from :func:`lightning_checkpoint` instead (tests/integration/test_lightning_port.py
checks it; tests/unit/test_lightning_porting.py runs the same function in one process).

The duck-typed metrics here do their own all-reduce through ``torch.distributed`` (as torchmetrics does
in ``compute()``); keel must use their result as is, never reduce it again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
import torch.distributed as tdist
from models import Regression, quiet, regression_data
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer
from trainer.options import TrainerOptions, check_lightning_keywords

try:
    from torchmetrics.classification import MulticlassAccuracy
except ImportError:  # torchmetrics is optional
    MulticlassAccuracy = None


class DuckMean:
    """``update`` / ``compute`` / ``reset`` without torchmetrics; ``compute`` all-reduces itself."""

    def __init__(self, *, count_only: bool = False) -> None:
        self.count_only = count_only
        self.compute_calls = 0
        self.reset_calls = 0
        self._clear()

    def _clear(self) -> None:
        self.total = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)

    def update(self, values: torch.Tensor) -> None:
        self.total += values.detach().double().sum()
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        self.compute_calls += 1
        both = torch.stack([self.total, self.count])
        if tdist.is_initialized():
            tdist.all_reduce(both)  # the metric's own sync: the result is global
        return both[1] if self.count_only else both[0] / both[1]

    def reset(self) -> None:
        self.reset_calls += 1
        self._clear()


def forwards_rank_zero_only() -> bool:
    """Whether TaskModule.log passes rank_zero_only on to the collector (the module.py patch)."""
    seen: dict = {}
    probe = TaskModule()
    probe._trainer = SimpleNamespace(_metrics=SimpleNamespace(log=lambda name, value, **kw: seen.update(kw)))
    probe.log("probe", 1.0, rank_zero_only=True)
    return seen.get("rank_zero_only") is True


FORWARDS = forwards_rank_zero_only()


class Task(Regression):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.05, dtype=torch.float64)
        self.train_mean = DuckMean()
        self.val_mean = DuckMean()
        self.val_count = DuckMean(count_only=True)
        self.acc = MulticlassAccuracy(num_classes=2, average="micro") if MulticlassAccuracy is not None else None

    def log_rank_zero(self, name: str, value: float, **kwargs) -> None:
        if FORWARDS:
            self.log(name, value, rank_zero_only=True, **kwargs)
        else:  # until trainer/module.py forwards the keyword: the collector side directly
            self.trainer._metrics.log(
                name,
                value,
                on_step=kwargs.get("on_step"),
                on_epoch=kwargs.get("on_epoch"),
                prog_bar=False,
                logger=True,
                batch_size=None,
                reduce_fx="mean",
                rank_zero_only=True,
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        rank = self.global_rank
        self.log("s_sum", float(rank + 1), reduce_fx="sum")
        self.log("s_max", float(10 * rank + batch_idx), reduce_fx="max")
        self.log("s_min", float(10 * rank + batch_idx), reduce_fx="min")
        self.log("s_mean", float(10 * rank + batch_idx))
        self.log("e_sum", float(rank + 1), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("e_max", float(10 * rank + batch_idx), on_step=False, on_epoch=True, reduce_fx=torch.max)
        self.log("e_min", float(10 * rank + batch_idx), on_step=False, on_epoch=True, reduce_fx="min")
        self.log_rank_zero("r0", float(100 + rank))
        self.log_rank_zero("r0_epoch", float(100 + rank), on_step=False, on_epoch=True)
        self.train_mean.update(y)
        self.log("train_mean", self.train_mean, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mean.update(y)
        self.val_count.update(y)
        self.log("val_mean", self.val_mean)
        self.log("val_count", self.val_count, reduce_fx="sum")  # ignored for objects: never doubled
        if self.acc is not None:
            self.acc.update((self(x) > 0).long().view(-1), (y > 0).long().view(-1))
            self.log("val_acc", self.acc)


class StepRecorder(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.epochs: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.is_logging_step:
            self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_epoch_end(self, trainer, task) -> None:
        self.epochs.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_validation_epoch_end(self, trainer, task) -> None:
        self.validations.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class CkptTask(Regression):
    """Float64 regression whose constructor arguments are its saved hyperparameters; its ``val/loss`` is
    best after epoch 0, so the best save is not the newest."""

    def __init__(self, lr: float = 0.05, note: str = "lightning") -> None:
        super().__init__(optimizer="sgd", lr=lr, dtype=torch.float64)
        self.save_hyperparameters()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", torch.tensor(1.0 if self.current_epoch == 0 else 2.0, dtype=torch.float64))


class AtSave(Callback):
    """(epoch, a copy of the task's weights) at every save, by global step; and the steps this fit trained."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self.trained = 0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.trained += 1

    def on_save_checkpoint(self, trainer, task, checkpoint) -> None:
        weights = {k: v.detach().clone() for k, v in task.state_dict().items()}
        self.saved[trainer.global_step] = (trainer.current_epoch, weights)


def lightning_checkpoint(out: Path, strategy: str = "auto") -> dict:
    """A Lightning program's use of ``callbacks.lightning.ModelCheckpoint``: fit 2 epochs with a monitored
    top-1 save and ``save_last=True``; then ``test(ckpt_path=cb.best_model_path)``, and ``fit`` resumed to
    epoch 3 from ``cb.best_model_path`` and from ``cb.last_model_path``, beside an uninterrupted 3-epoch fit.
    Returns the paths the callback reports and the weights to compare them with (the test reads the files)."""
    import callbacks.lightning as L

    x, y = regression_data(48, dtype=torch.float64).tensors  # one problem: 32 samples to train, 16 to validate
    train, val = TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])

    def fit(epochs: int, callbacks: list, ckpt_path: str | None = None) -> tuple[Trainer, CkptTask, AtSave]:
        record = AtSave()
        trainer = L.Trainer(
            **quiet(strategy=strategy, max_epochs=epochs, precision="64", callbacks=callbacks + [record])
        )
        task = CkptTask(lr=0.05, note="ported")
        trainer.fit(task, DataLoader(train, batch_size=4), DataLoader(val, batch_size=4), ckpt_path=ckpt_path)
        return trainer, task, record

    def test(task: CkptTask, ckpt_path: str | None = None) -> dict[str, float]:
        tester = L.Trainer(**quiet(strategy=strategy, precision="64"))
        return {
            k: float(v) for k, v in tester.test(task, DataLoader(val, batch_size=4), ckpt_path=ckpt_path)[0].items()
        }

    _, reference, whole = fit(3, [])
    cb = L.ModelCheckpoint(dirpath=str(out / "ck"), monitor="val/loss", save_top_k=1, save_last=True)
    trainer, task, record = fit(2, [cb])
    by_hand = CkptTask(lr=0.05, note="ported")
    by_hand.load_state_dict(torch.load(cb.best_model_path, weights_only=True)["state_dict"])
    _, from_best, best_run = fit(3, [], ckpt_path=cb.best_model_path)
    _, from_last, last_run = fit(3, [], ckpt_path=cb.last_model_path)
    return {
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "dirpath": cb.dirpath,
        "best_model_path": cb.best_model_path,
        "last_model_path": cb.last_model_path,
        "global_step": trainer.global_step,
        "hparams": dict(task.hparams),
        "final": {k: v.detach().clone() for k, v in task.state_dict().items()},
        "saved": record.saved,
        "tested_best": test(CkptTask(lr=0.05, note="ported"), ckpt_path=cb.best_model_path),
        "tested_by_hand": test(by_hand),
        "tested_untrained": test(CkptTask(lr=0.05, note="ported")),
        "reference": reference.state_dict(),
        "reference_steps": whole.trained,
        "from_best": from_best.state_dict(),
        "from_best_steps": best_run.trained,
        "from_last": from_last.state_dict(),
        "from_last_steps": last_run.trained,
    }


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["checkpoint"]:
        result = lightning_checkpoint(out, strategy="ddp")
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / f"rank{os.environ.get('RANK', '0')}.pt")
        return
    train = regression_data(32, dtype=torch.float64)
    val = regression_data(37, seed=1, dtype=torch.float64)
    recorder = StepRecorder()
    # Lightning's launch keywords, matching `torchrun --nnodes 1 --nproc-per-node 2`.
    trainer = Trainer(
        **quiet(
            devices=2,
            num_nodes=1,
            strategy="ddp",
            max_epochs=2,
            log_every_n_steps=1,
            precision="64",
            callbacks=[recorder],
        )
    )
    check_lightning_keywords(trainer.options, trainer.env)
    try:
        check_lightning_keywords(TrainerOptions(devices=4), trainer.env)
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    task = Task()
    trainer.fit(task, DataLoader(train, batch_size=4), DataLoader(val, batch_size=5))
    validated = trainer.validate(task, DataLoader(val, batch_size=5))[0]
    x, y = val.tensors
    with torch.no_grad():
        hand_acc = ((task(x) > 0) == (y > 0)).double().mean().item()
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "forwards_rank_zero_only": FORWARDS,
        "mismatch": mismatch,
        "steps": recorder.steps,
        "epochs": recorder.epochs,
        "validations": recorder.validations,
        "validated": validated,
        "train_mean_calls": [task.train_mean.compute_calls, task.train_mean.reset_calls],
        "val_mean_calls": [task.val_mean.compute_calls, task.val_mean.reset_calls],
        "hand": {
            "train_mean": train.tensors[1].mean().item(),
            "val_mean": y.mean().item(),
            "val_count": len(val),
            "val_acc": hand_acc,
        },
        "has_torchmetrics": MulticlassAccuracy is not None,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
