"""Fit / validate / predict a small float64 regression under any launcher; dump results per rank.

Usage: ddp_fit.py OUT_DIR --batch B [--shuffle] [--epochs E] [--n N] [--val-n M] [--accumulate K] [--memory-plan]
Writes OUT_DIR/rank{R}.pt with the final weights, the sample order seen per epoch, validation and
test metrics, predictions and the memory plan's line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import Regression, quiet, regression_data
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer
from trainer.memory import MemoryPlan


class Recording(Regression):
    """Regression whose batches carry the sample index, so the test sees the data order."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.05, dtype=torch.float64)
        self.seen: dict[int, list[torch.Tensor]] = {}  # tensors: the memory plan runs this step on fake ones

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen.setdefault(self.current_epoch, []).append(idx.clone())
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))
        self.log("val/count", float(len(x)), reduce_fx="sum")

    def test_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("test/mae", (self(x) - y).abs().mean())

    def predict_step(self, batch, batch_idx):
        return batch[0]  # the sample indices: their order is the prediction order


def indexed(ds: TensorDataset) -> TensorDataset:
    return TensorDataset(torch.arange(len(ds)), *ds.tensors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--val-n", type=int, default=37)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--memory-plan", action="store_true", help="Trainer(memory_plan=True): its line is dumped")
    args = parser.parse_args()
    train = indexed(regression_data(args.n, dtype=torch.float64))
    val = indexed(regression_data(args.val_n, seed=1, dtype=torch.float64))
    task = Recording()
    accelerator = os.environ.get("KEEL_TEST_ACCELERATOR", "auto")  # tests/integration/test_gpu.py sets "cuda"
    trainer = Trainer(
        **quiet(
            max_epochs=args.epochs,
            precision="64",
            accumulate_grad_batches=args.accumulate,
            accelerator=accelerator,
            memory_plan=args.memory_plan,
        )
    )
    trainer.fit(task, DataLoader(train, batch_size=args.batch, shuffle=args.shuffle), DataLoader(val, batch_size=5))
    val_metrics = trainer.validate(task, DataLoader(val, batch_size=5))
    test_metrics = trainer.test(task, DataLoader(val, batch_size=4))
    predictions = trainer.predict(task, DataLoader(val, batch_size=3))
    # What the other predict_return settings gather: the object collectives each predict makes.
    sent: dict[str, list[str]] = {}
    for name in ("all_gather_object", "gather_object"):
        real = getattr(torch.distributed, name)
        setattr(
            torch.distributed, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1]
        )
    for setting, keep in (("all_ranks", True), ("rank_zero", True), ("all_ranks", False)):
        calls: list[str] = []
        trainer.options.predict_return = setting
        got = trainer.predict(task, DataLoader(val, batch_size=3), return_predictions=keep)
        sent[f"{setting}-{keep}"] = [*calls, "None" if got is None else str(torch.cat(got).tolist() == list(range(37)))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "weights": task.state_dict(),
            "seen": {epoch: torch.cat(batches).tolist() for epoch, batches in task.seen.items()},
            "plan": next((cb.summary for cb in trainer.callbacks if isinstance(cb, MemoryPlan)), None),
            "val": val_metrics,
            "test": test_metrics,
            "predictions": torch.cat(predictions).tolist(),
            "sent": sent,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
