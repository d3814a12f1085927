"""A short fit with Trainer(profiler="pytorch") under any launcher; the run directory is argv[1]."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/harness/scripts

import torch
from resume_fit import Classifier, data
from torch.utils.data import DataLoader

from trainer import Trainer


def main() -> None:
    trainer = Trainer(
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        profiler="pytorch",
        default_root_dir=sys.argv[1],
        seed=0,
    )
    torch.manual_seed(0)
    trainer.fit(Classifier(), DataLoader(data(64), batch_size=4))


if __name__ == "__main__":
    main()
