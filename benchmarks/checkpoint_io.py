"""Checkpoint save / load time for a ~100M-parameter model on CPU, and how long training is blocked.

    python benchmarks/checkpoint_io.py [--params-millions 100] [--dir /tmp/keel-ckpt-bench]

Builds a task of stacked Linear layers, takes two AdamW steps (so the optimizer state is full size),
then times ``Trainer.save_checkpoint`` (atomic write + fsync; training is blocked for all of it: saves
are synchronous) and ``CheckpointIO.load`` + ``load_state_dict`` (what a resume costs), over repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from trainer import TaskModule, Trainer  # noqa: E402
from trainer.checkpoint import CheckpointIO  # noqa: E402


class Big(TaskModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder for the checkpoint files (default: a temp dir)")
    args = parser.parse_args()
    width = 2048
    depth = max(1, round(args.params_millions * 1e6 / (width * width + width)))
    task = Big(width, depth)
    params = sum(p.numel() for p in task.parameters())
    trainer = Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(task, DataLoader(TensorDataset(torch.randn(4, width)), batch_size=2))
    folder = Path(args.dir or tempfile.mkdtemp(prefix="keel-ckpt-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench.ckpt"
    saves, loads = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = CheckpointIO().load(path)
        task.load_state_dict(state["state_dict"])
        trainer.optimizers[0].load_state_dict(state["optimizer_states"][0])
        loads.append(time.perf_counter() - start)
        del state
    size_gb = os.path.getsize(path) / 2**30
    print(f"model: {params / 1e6:.1f}M parameters ({depth} x Linear({width}, {width})), AdamW state included")
    print(f"checkpoint file: {size_gb:.2f} GiB at {path}")
    print(f"save (training blocked): median {statistics.median(saves):.2f} s  ({size_gb / statistics.median(saves):.2f} GiB/s)"
          f"  runs: {', '.join(f'{t:.2f}' for t in saves)}")
    print(f"load + restore:          median {statistics.median(loads):.2f} s  runs: {', '.join(f'{t:.2f}' for t in loads)}")
    path.unlink()


if __name__ == "__main__":
    main()
