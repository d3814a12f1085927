"""A small MLP trained with a weight-averaging callback under any strategy; dumps the final weights per rank.

Usage: weight_avg_fit.py OUT [--strategy auto|ddp|fsdp] [--case swa|ema] [--batch B] [--ckpt-dir D]
       [--kill-at S] [--resume]

The global batch is 8 (B per rank; 8 in one process, 4 on each of 2 ranks); 32 shuffled samples, 4 epochs, in
float64.
It normalises with LayerNorm: BatchNorm's statistics over the global batch need SyncBatchNorm, which runs on GPUs
only (the BatchNorm pass of SWA is compared with Lightning in tests/unit/test_weight_averaging.py). ``--kill-at S``:
SIGKILL this process after step S (saves every 3 steps into ``--ckpt-dir``); ``--resume``: fit(ckpt_path="last").
OUT/rank{R}.pt holds the final weights and buffers (gathered from the shards under FSDP) and the averaged tensors
the callback kept on this rank (its shards under FSDP) with their shapes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from callbacks import EMAWeightAveraging, StochasticWeightAveraging
from trainer import Callback, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


class Net(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.norm(self.inp(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


class Kill(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def data(n: int, seed: int, batch: int, shuffle: bool) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=shuffle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--case", default="swa")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    averaging: Any = (
        StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2, device=None)
        if args.case == "swa"
        else EMAWeightAveraging(decay=0.8, update_every_n_steps=2)
    )
    callbacks: list[Callback] = [averaging]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=3, save_last=True))
    if args.kill_at > 0:
        callbacks.append(Kill(args.kill_at))
    torch.manual_seed(0)
    task = Net()
    trainer = Trainer(
        max_epochs=4,
        strategy=args.strategy,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision="64",  # float64: ranks and one process agree to rounding far below the test's tolerance
        seed=0,
    )
    trainer.fit(
        task,
        data(32, 1, args.batch, shuffle=True),
        data(16, 2, args.batch, shuffle=False),
        ckpt_path="last" if args.resume else None,
    )
    weights = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in task.state_dict().items()
    }
    average = averaging._average
    kept = [] if average is None else [t.detach().cpu().clone() for t in average.tensors]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "weights": weights,
            "kept": kept,
            "sharded": any(hasattr(p, "device_mesh") for p in task.parameters()),
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
