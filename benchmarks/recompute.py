"""Activation checkpointing on the char GPT recipe's model: bytes autograd keeps for backward, and step time.

Method: the recipe's ``CharGPT`` at its defaults (4 blocks, width 128, context 128) and a batch of 32 windows
trains ``--steps`` optimizer steps under ``Trainer(strategy=DDPStrategy())`` (one process: the single-device
strategy) and under ``DDPStrategy(activation_checkpointing=["Block"])``, alternating the two ``--repeats`` times.
Each training step records, through ``torch.autograd.graph.saved_tensors_hooks``, the bytes of the distinct
storages autograd keeps for backward (what a recomputed block would keep is not kept). Step time is the median
over the timed steps (after 2 warm-up steps) of each run, and the ratio is taken per repeat, side by side. The
final weights of the two runs of a repeat must be equal to the bit (dropout 0.1: the recompute replays the RNG).

    python benchmarks/recompute.py            # about a minute on 2 CPU cores
    python benchmarks/recompute.py --steps 4 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.charlm import VOCAB_SIZE, CharGPT
from trainer import Callback, DDPStrategy, Trainer


class Measured(CharGPT):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kept: list[int] = []

    def training_step(self, batch, batch_idx):
        storages: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = super().training_step(batch, batch_idx)
        self.kept.append(sum(storages.values()))
        return out


class StepClock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.start = 0.0

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.start)


def run(recompute: bool, steps: int, batch: int) -> tuple[int, float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    task = Measured(dropout=0.1, warmup_steps=1, sample_chars=0)
    tokens = torch.randint(0, VOCAB_SIZE, (steps * batch, 129), generator=torch.Generator().manual_seed(1))
    clock = StepClock()
    trainer = Trainer(
        max_steps=steps,
        strategy=DDPStrategy(activation_checkpointing=["Block"] if recompute else None),
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(task, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch))
    return max(task.kept), statistics.median(clock.times[2:] or clock.times), task.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ratios, kept = [], {}
    for repeat in range(args.repeats):
        results = {}
        for recompute in (False, True) if repeat % 2 == 0 else (True, False):
            results[recompute] = run(recompute, args.steps, args.batch)
        (plain_kept, plain_s, plain_w), (ac_kept, ac_s, ac_w) = results[False], results[True]
        if not all(torch.equal(plain_w[k], ac_w[k]) for k in plain_w):
            raise SystemExit("activation checkpointing changed the weights")
        kept = {"without": plain_kept, "with": ac_kept}
        ratios.append(ac_s / plain_s)
        print(
            f"repeat {repeat}: kept {plain_kept / 2**20:.1f} MiB -> {ac_kept / 2**20:.1f} MiB, "
            f"step {plain_s * 1e3:.0f} ms -> {ac_s * 1e3:.0f} ms ({ac_s / plain_s:.2f}x)"
        )
    summary = {
        "kept_bytes_without": kept["without"],
        "kept_bytes_with": kept["with"],
        "kept_ratio": kept["with"] / kept["without"],
        "step_time_ratio_median": statistics.median(ratios),
        "step_time_ratios": ratios,
        "weights_equal": True,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
