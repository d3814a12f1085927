"""Checkpoint save / load time for a ~100M-parameter model on CPU, and how long training is blocked.

    python benchmarks/checkpoint_io.py [--params-millions 100] [--dir /tmp/keel-ckpt-bench] [--every 6]

Builds a task of stacked Linear layers, takes two AdamW steps (so the optimizer state is full size),
then times ``Trainer.save_checkpoint`` (atomic write + fsync; training is blocked for all of it: saves
are synchronous) and ``Strategy.load_checkpoint`` of the whole run state (what a resume costs: the checksum
check of every file, then the load), over repeats.

Then, side by side in one run, the time the training loop is blocked per save by
``ModelCheckpoint(async_save=False)`` and ``ModelCheckpoint(async_save=True)``: two fits of the same task,
a save every ``--every`` steps, ``--repeats`` saves each. Blocked time per save = the time inside
``ModelCheckpoint.save`` (assemble; sync: write + fsync + rename + pointer + pruning; async: wait for a
save still in flight + stage the CPU copy) plus, for async, the commit at a later step boundary (pointer
swap, pruning). The end of fit waits for the last async save: printed apart, as are the background
write's time and each fit's wall time (a background write shares the CPU with the steps).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import load


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


class TimedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that records how long each save and the end-of-fit wait block the loop."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_times: list[float] = []
        self.end_wait = 0.0

    def save(self, trainer, suffix: str = "", *, force: bool = False):
        start = time.perf_counter()
        try:
            return super().save(trainer, suffix, force=force)
        finally:
            self.save_times.append(time.perf_counter() - start)

    def on_train_end(self, trainer, task) -> None:
        start = time.perf_counter()
        super().on_train_end(trainer, task)
        self.end_wait = time.perf_counter() - start


def blocked_per_save(width: int, depth: int, folder: Path, *, async_save: bool, every: int, saves: int) -> dict:
    torch.manual_seed(0)
    task = Big(width, depth)
    cb = TimedCheckpoint(
        dirpath=folder / ("async" if async_save else "sync"),
        every_n_train_steps=every,
        save_top_k=1,
        async_save=async_save,
    )
    trainer = Trainer(
        max_steps=every * saves,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[cb],
        seed=0,
    )
    start = time.perf_counter()
    trainer.fit(task, DataLoader(TensorDataset(torch.randn(4 * every * saves, width)), batch_size=4))
    wall = time.perf_counter() - start
    commits = [t.commit for t in cb._checkpointer.history]
    background = [t.background for t in cb._checkpointer.history]
    blocked = [s + c for s, c in zip(cb.save_times, commits + [0.0] * len(cb.save_times))]
    return {
        "blocked": blocked,
        "save": cb.save_times,
        "commit": commits,
        "background": background,
        "end_wait": cb.end_wait,
        "wall": wall,
        "steps": trainer.global_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder for the checkpoint files (default: a temp dir)")
    parser.add_argument("--every", type=int, default=6, help="sync vs async: a save every N training steps")
    parser.add_argument("--skip-load", action="store_true", help="only the sync vs async comparison")
    args = parser.parse_args()
    width = 2048
    depth = max(1, round(args.params_millions * 1e6 / (width * width + width)))
    folder = Path(args.dir or tempfile.mkdtemp(prefix="keel-ckpt-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    params = depth * (width * width + width)
    print(
        f"model: {params / 1e6:.1f}M parameters ({depth} x Linear({width}, {width})), AdamW state included; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, files in {folder}"
    )
    if not args.skip_load:
        save_and_load(width, depth, folder, args.repeats)
    results = {}
    for async_save in (False, True):
        results[async_save] = r = blocked_per_save(
            width, depth, folder, async_save=async_save, every=args.every, saves=args.repeats
        )
        name = "async" if async_save else "sync "
        print(
            f"{name} ModelCheckpoint: loop blocked per save median {statistics.median(r['blocked']):.3f} s "
            f"(runs: {', '.join(f'{t:.3f}' for t in r['blocked'])})"
            + (
                f"; in save() {statistics.median(r['save']):.3f} s, commit {statistics.median(r['commit']):.4f} s, "
                f"end-of-fit wait {r['end_wait']:.3f} s; background write median "
                f"{statistics.median(r['background']):.2f} s"
                if async_save
                else ""
            )
            + f"; fit of {r['steps']} steps {r['wall']:.1f} s"
        )
    ratio = statistics.median(results[True]["blocked"]) / statistics.median(results[False]["blocked"])
    print(f"async blocks the loop {100 * ratio:.1f}% of the synchronous save's time (goal: < 10%)")


def save_and_load(width: int, depth: int, folder: Path, repeats: int) -> None:
    task = Big(width, depth)
    trainer = Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task, DataLoader(TensorDataset(torch.randn(4, width)), batch_size=2))
    path = folder / "bench.ckpt"
    saves, loads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        load(path, trainer.checkpointer.objects(), on_load=lambda checkpoint: None)
        loads.append(time.perf_counter() - start)
    size_gb = sum(f.stat().st_size for f in path.iterdir()) / 2**30
    print(f"checkpoint folder: {size_gb:.2f} GiB")
    print(
        f"save (training blocked): median {statistics.median(saves):.2f} s  "
        f"({size_gb / statistics.median(saves):.2f} GiB/s)"
        f"  runs: {', '.join(f'{t:.2f}' for t in saves)}"
    )
    print(
        f"load + restore:          median {statistics.median(loads):.2f} s  runs: "
        f"{', '.join(f'{t:.2f}' for t in loads)}"
    )
    shutil.rmtree(path)


if __name__ == "__main__":
    main()
