"""One seeded program for the tuner's tests: the same code runs under Lightning 2.6.6 (to measure what its
``Tuner`` does) and under keel (tests/unit/test_tuner.py and tests/integration/test_tuner_ddp.py compare). Only the
Lightning package differs: the cases take it (``lightning`` or ``callbacks.lightning``) and its ``Tuner`` as
arguments.

Measuring (in an environment with Lightning 2.6.6): ``python tests/harness/tuner_program.py`` prints every case's
results; the tests hold them as constants.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

FAKE_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (a fake: this test's model raises it above a batch size)"


def regression(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def build(L: ModuleType) -> dict[str, type]:
    """The program's classes on ``L``'s ``LightningModule`` / ``LightningDataModule``."""
    return {**_lr_classes(L), **_batch_size_classes(L)}


def _lr_classes(L: ModuleType) -> dict[str, type]:

    class Net(L.LightningModule):
        """Its learning rate in ``hparams.lr`` (or ``self.learning_rate`` with ``attr="learning_rate"``)."""

        def __init__(self, lr: float = 1e-3, attr: str = "hparams") -> None:
            super().__init__()
            if attr == "hparams":
                self.save_hyperparameters()
            else:
                self.learning_rate = lr
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def rate(self) -> float:
            return self.hparams.lr if "lr" in self.hparams else self.learning_rate

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.rate(), momentum=0.9)

    class Data(L.LightningDataModule):
        def __init__(self, batch_size: int = 16, n: int = 512) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.dataset = regression(n)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.dataset, batch_size=self.batch_size)

    return {"Net": Net, "Data": Data}


def _batch_size_classes(L: ModuleType) -> dict[str, type]:
    class Hungry(L.LightningModule):
        """Raises a (fake) CUDA out-of-memory error for a batch larger than ``limit``; records every batch size
        its steps saw. Its batch size is ``self.batch_size``, or ``hparams.batch_size`` with ``hparams=True``, or
        the datamodule's when it has none (``own=False``)."""

        def __init__(self, batch_size: int = 2, limit: int = 48, n: int = 1000, own: bool = True, hparams=False):
            super().__init__()
            if hparams:
                self.save_hyperparameters()
            elif own:
                self.batch_size = batch_size
            self.limit, self.n, self.own, self.seen = limit, n, own or hparams, []
            self.net = nn.Linear(8, 1)

        def size(self) -> int:
            return self.hparams.batch_size if "batch_size" in self.hparams else self.batch_size

        def step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            self.seen.append(len(x))
            if len(x) > self.limit:
                raise RuntimeError(FAKE_OOM)
            return F.mse_loss(self.net(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.step(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class HungryEval(Hungry):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.step(batch)

    class HungryData(L.LightningDataModule):
        """Training data only: a fit trial runs exactly its steps (keel validates when max_steps ends an epoch
        early; Lightning 2.6.6 does not)."""

        def __init__(self, batch_size: int = 16, n: int = 512) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.dataset = regression(n)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.dataset, batch_size=self.batch_size)

    return {"Hungry": Hungry, "HungryEval": HungryEval, "HungryData": HungryData}


def trainer_kwargs(root: str, **kwargs: Any) -> dict[str, Any]:
    base = dict(
        max_epochs=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
    )
    base.update(kwargs)
    return base


def lr_case(
    L: ModuleType,
    Tuner: type,
    root: str,
    *,
    attr: str = "hparams",
    trainer: dict,
    data: dict | None = None,
    **find: Any,
) -> dict:
    classes = build(L)
    L.seed_everything(42, verbose=False)
    model, dm = classes["Net"](attr=attr), classes["Data"](**(data or {}))
    tuner = Tuner(L.Trainer(**trainer_kwargs(root, **trainer)))
    finder = tuner.lr_find(model, datamodule=dm, **find)
    return {
        "lrs": list(finder.results["lr"]),
        "losses": list(finder.results["loss"]),
        "suggestion": finder.suggestion(),
        "index": finder._optimal_idx,
        "model_lr": model.rate(),
    }


def bs_case(L: ModuleType, Tuner: type, root: str, *, model: dict, data: dict | None = None, **scale: Any) -> dict:
    classes = build(L)
    L.seed_everything(42, verbose=False)
    task = classes["HungryEval" if scale.get("method") == "validate" else "Hungry"](**model)
    dm = classes["HungryData"](**data) if data is not None else None
    if dm is None:
        n = task.n
        hook = "val_dataloader" if scale.get("method") == "validate" else "train_dataloader"
        setattr(task, hook, lambda: DataLoader(regression(n), batch_size=task.size()))
    tuner = Tuner(L.Trainer(**trainer_kwargs(root)))
    found = tuner.scale_batch_size(task, datamodule=dm, **scale)
    attribute = task.size() if task.own else dm.batch_size
    return {"found": found, "attribute": attribute, "seen": list(task.seen)}


LR_CASES = {
    "exponential": dict(trainer={}),
    "linear": dict(trainer={}, mode="linear", num_training=50, max_lr=0.5, early_stop_threshold=None),
    "diverging": dict(trainer={}, num_training=60, max_lr=1e6, early_stop_threshold=None),
    "accumulate": dict(
        trainer={"accumulate_grad_batches": 2}, num_training=40, early_stop_threshold=None, attr="learning_rate"
    ),
}
BS_CASES = {
    "power": dict(model={}),
    "binsearch": dict(model={}, mode="binsearch"),
    "hparams_max_trials": dict(model={"hparams": True, "limit": 4096}, max_trials=4, init_val=3),
    "datamodule_small_dataset": dict(model={"own": False, "limit": 4096}, data={"batch_size": 7, "n": 100}, init_val=4),
    "validate_binsearch": dict(model={"limit": 100}, method="validate", mode="binsearch", steps_per_trial=2),
}


def summary(result: dict) -> dict:
    """What the tests compare of an ``lr_case``: the suggestion, the schedule's ends, the number of steps and of
    finite losses, their sum and a few of them (the first three, the eleventh, the middle and the last finite)."""
    losses = result["losses"]
    finite = [x for x in losses if math.isfinite(x)]
    return {
        "steps": len(losses),
        "suggestion": result["suggestion"],
        "index": result["index"],
        "model_lr": result["model_lr"],
        "lr1": result["lrs"][1],
        "lr_last": result["lrs"][-1],
        "finite": len(finite),
        "finite_sum": sum(finite),
        "picks": [losses[i] for i in (0, 1, 2, 10, len(finite) // 2, len(finite) - 1)],
    }


def run(L: ModuleType, Tuner: type, root: str) -> dict[str, dict]:
    results = {f"lr_{name}": lr_case(L, Tuner, root, **case) for name, case in LR_CASES.items()}
    results.update({f"bs_{name}": bs_case(L, Tuner, root, **case) for name, case in BS_CASES.items()})
    return results


if __name__ == "__main__":  # pragma: no cover - the measurement, run where Lightning is installed
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    with tempfile.TemporaryDirectory() as root:
        for name, result in run(L, Tuner, root).items():
            print(f"{name!r}: {summary(result) if 'losses' in result else result},")
    sys.stdout.flush()
    os._exit(0)
