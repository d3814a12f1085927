"""Fault scenarios for tests/integration/test_robustness.py, one per --case, under any launcher."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import Regression, quiet, regression_data
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler

from trainer import Callback, Trainer
from trainer.distributed import comm, launcher


class NaNAt(Regression):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_step = step
        self.injected = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step + 1 == self.nan_step and self.global_rank == 1 and not self.injected:
            self.injected = True  # once: with on_nonfinite="skip" the step is retried with the next batch
            loss = loss * float("nan")
        return loss


class Unused(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(3, 3)


class PerRankSampler(Sampler[int]):
    """Rank 0 gets 40 samples, rank 1 gets 24: a loader keel does not shard."""

    def __init__(self, rank: int) -> None:
        self.indices = list(range(40)) if rank == 0 else list(range(24))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class PerRankStream(IterableDataset):
    def __init__(self, rank: int) -> None:
        self.data = regression_data(40 if rank == 0 else 24)

    def __iter__(self):
        return iter(zip(*self.data.tensors))


class Weights(Callback):
    def __init__(self) -> None:
        self.history: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped:
            self.history[trainer.global_step] = task.net[0].weight.detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rank = launcher.detect_env().rank
    data = DataLoader(regression_data(64), batch_size=8)
    if args.case in ("nan-error", "nan-skip"):
        weights = Weights()
        trainer = Trainer(
            **quiet(max_steps=6, log_every_n_steps=1, on_nonfinite=args.case.split("-")[1], callbacks=[weights])
        )
        try:
            trainer.fit(NaNAt(3), data)
        finally:
            torch.save({k: v for k, v in weights.history.items()}, Path(args.out) / f"weights{rank}.pt")
        sys.stdout.write(f"rank {rank} finished at step {trainer.global_step}\n")
    elif args.case == "unused":
        Trainer(**quiet(max_steps=3)).fit(Unused(), data)
    elif args.case in ("uneven-sampler", "uneven-sampler-error"):
        policy = "error" if args.case.endswith("error") else "truncate"
        trainer = Trainer(**quiet(max_epochs=2, uneven_batches=policy))
        trainer.fit(Regression(), DataLoader(regression_data(64), batch_size=8, sampler=PerRankSampler(rank)))
        sys.stdout.write(f"rank {rank} done: {trainer.global_step} steps\n")
    elif args.case == "uneven-stream":
        trainer = Trainer(**quiet(max_epochs=2, accumulate_grad_batches=2))
        trainer.fit(Regression(), DataLoader(PerRankStream(rank), batch_size=8))
        sys.stdout.write(f"rank {rank} done: {trainer.global_step} steps\n")
    elif args.case == "init-timeout":
        t0 = time.monotonic()
        try:
            Trainer(**quiet(max_steps=1, init_timeout=3)).fit(Regression(), data)
        except RuntimeError as exc:
            sys.stdout.write(f"init failed after {time.monotonic() - t0:.1f}s: {exc}\n")
            raise SystemExit(3) from None
    elif args.case == "record":

        @comm.record
        def failing_main() -> None:
            raise ValueError("root cause from failing_main")

        failing_main()


if __name__ == "__main__":
    main()
