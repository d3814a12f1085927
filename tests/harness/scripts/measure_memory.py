"""Measures the CPU memory a training step of the char GPT takes, for tests/integration/test_memory.py.

Usage: measure_memory.py --n-layer L --n-embd E --n-head H --batch B --block T [--strategy ddp|fsdp]

The memory is the growth of the process's resident-set high-water mark (``VmHWM``) from just before the task is
built to the end of two optimizer steps of ``Trainer.fit``. The allocator must hand large blocks back when they
are freed, or the high-water mark counts memory freed and kept by the allocator: the test runs this script with
``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every block over 64 KiB on its own and unmaps it on free).
A warm-up fit of a tiny model first loads the kernels and thread pools, so they are not counted. Prints one JSON
line on rank 0: ``{"measured": bytes}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root (recipes/)

import torch
from torch.utils.data import DataLoader, TensorDataset

from recipes.charlm import CharGPT
from trainer import Trainer


def high_water() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def fit(task: CharGPT, batch: int, block: int, strategy: str) -> None:
    tokens = torch.randint(0, 128, (2 * batch, block + 1), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(
        max_steps=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch))


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--n-layer", "--n-embd", "--n-head", "--batch", "--block"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fit(CharGPT(block_size=8, n_layer=1, n_head=1, n_embd=8, sample_chars=0), 2, 8, args.strategy)  # warm-up
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    start = high_water()
    task = CharGPT(block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, sample_chars=0)
    fit(task, args.batch, args.block, args.strategy)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"measured": high_water() - start, "params": sum(p.numel() for p in task.parameters())}))


if __name__ == "__main__":
    main()
