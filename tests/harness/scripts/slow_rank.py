"""A 2-rank DDP fit in which one cause of slowness is made to happen; dumps what keel's diagnosis said.

Usage: slow_rank.py OUT --cause {data_rank1,data_all,step_rank0,save_every_step,comm_bound,none} [--steps S]
    [--log-every N]

``data_rank1``: the loader of rank 1 sleeps 40 ms a batch; ``data_all``: every rank's loader sleeps 40 ms a batch;
``step_rank0``: rank 0's training_step sleeps 40 ms; ``save_every_step``: a checkpoint is saved after every step
(nothing sleeps); ``comm_bound``: the task holds a parameter of 32 MB that costs almost nothing to compute, so
every step's gradient all-reduce outweighs its compute (nothing sleeps); ``none``: nothing sleeps. Logging every 2
steps unless ``--log-every`` says otherwise. OUT/rank{R}.pt holds the diagnosis' warnings and its verdict on each
logging interval, the perf/ metrics of the last logging step and the steps; OUT/run/version_0 is the run directory
(efficiency.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import Regression, quiet, regression_data
from torch.utils.data import DataLoader, Dataset

from trainer import Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.loggers import CSVLogger

SLEEP = 0.04


class Sleepy(Dataset):
    """regression_data, whose items cost SLEEP / batch seconds each on the ranks that sleep."""

    def __init__(self, sleeps: bool, batch: int) -> None:
        self.data, self.sleeps, self.batch = regression_data(256), sleeps, batch

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if self.sleeps:
            time.sleep(SLEEP / self.batch)
        return self.data[i]


class Task(Regression):
    def __init__(self, sleeps: bool, big: bool = False) -> None:
        super().__init__()
        self.sleeps = sleeps
        # 8M numbers whose gradient is one fill: 32 MB to all-reduce a step for almost no compute.
        self.big = torch.nn.Parameter(torch.zeros(8 << 20)) if big else None

    def training_step(self, batch, batch_idx):
        if self.sleeps:
            time.sleep(SLEEP)
        loss = super().training_step(batch, batch_idx)
        return loss if self.big is None else loss + 0.0 * self.big.sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--cause",
        choices=("data_rank1", "data_all", "step_rank0", "save_every_step", "comm_bound", "none"),
        required=True,
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=2, help="log_every_n_steps: the diagnosis' interval")
    args = parser.parse_args()
    logger = CSVLogger(args.out, name="run", version=0)  # a run directory: efficiency.json goes there
    saves = args.cause == "save_every_step"
    checkpoint = [ModelCheckpoint(dirpath=str(Path(args.out) / "ckpt"), every_n_train_steps=1)] if saves else []
    trainer = Trainer(
        **quiet(
            max_steps=args.steps,
            log_every_n_steps=args.log_every,
            logger=logger,
            enable_checkpointing=saves,
            callbacks=checkpoint,
        )
    )
    rank = trainer.global_rank
    data_sleeps = args.cause == "data_all" or (args.cause == "data_rank1" and rank == 1)
    task = Task(sleeps=args.cause == "step_rank0" and rank == 0, big=args.cause == "comm_bound")
    trainer.fit(task, DataLoader(Sleepy(data_sleeps, 4), batch_size=4))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "warnings": trainer._efficiency.diagnosis.warnings,
            "history": trainer._efficiency.diagnosis.history,  # what each logging interval was judged to be
            "perf": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")},
            "global_step": trainer.global_step,
        },
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    main()
