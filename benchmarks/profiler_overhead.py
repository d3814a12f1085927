"""Per-step cost of the profilers: ``Trainer.fit`` with ``profiler=None`` / ``"simple"`` / ``"pytorch"``.

    python benchmarks/profiler_overhead.py                  # tiny and mlp1m, 5 repeats (about a minute on 2 cores)
    python benchmarks/profiler_overhead.py --models tiny --repeats 3 --steps 300

One process, ``OMP_NUM_THREADS=1`` / ``torch.set_num_threads(1)``; the models and data of
``benchmarks/overhead.py`` (an MLP 32-96-64-10 and one of about 1M parameters, batch 64, SGD). Each repeat
runs the three settings in turn (order reversed every other repeat, so drift hits all of them), timing
``--steps`` optimizer steps after 10 untimed ones, from a callback's ``on_train_batch_end``. Reported: the
median CPU seconds per step (``time.process_time``: the process runs one thread, and other processes on a
shared machine do not inflate it) of each setting and its overhead over ``profiler=None``. ``pytorch`` uses its
default schedule (wait 1, warmup 1, active 3): the cost of recording is paid on 4 steps of a stage, the
rest is the phase clock's ``record_function`` ranges. Traces go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer

MODELS = {"tiny": (32, 96, 64, 10), "mlp1m": (256, 1024, 704, 10)}
SETTINGS = (None, "simple", "pytorch")
WARMUP = 10


class MLP(TaskModule):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock(Callback):
    """CPU time of this (single-threaded) process: other processes on a shared machine do not inflate it."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped and trainer.global_step == WARMUP:
            self.start = time.process_time()
        self.end = time.process_time()


def seconds_per_step(model: str, profiler: str | None, steps: int, root: str) -> float:
    sizes = MODELS[model]
    torch.manual_seed(0)
    n = 64 * (steps + WARMUP)
    data = TensorDataset(torch.randn(n, sizes[0]), torch.randint(0, sizes[-1], (n,)))
    clock = Clock()
    trainer = Trainer(
        max_steps=steps + WARMUP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
        profiler=profiler,
        default_root_dir=root,
    )
    trainer.fit(MLP(sizes), DataLoader(data, batch_size=64))
    assert clock.start is not None
    return (clock.end - clock.start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: 500 tiny, 100 mlp1m)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.INFO)  # no summary tables in the output
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for model in args.models:
            steps = args.steps or (500 if model == "tiny" else 100)
            times: dict[str, list[float]] = {str(s): [] for s in SETTINGS}
            for repeat in range(args.repeats):
                order = SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    times[str(setting)].append(seconds_per_step(model, setting, steps, root))
            base = statistics.median(times["None"])
            row = {
                name: {
                    "median_s_per_step": statistics.median(values),
                    "overhead_pct": 100 * (statistics.median(values) / base - 1),
                }
                for name, values in times.items()
            }
            results[model] = row
            print(
                f"{model}: "
                + ", ".join(
                    f"profiler={name}: {r['median_s_per_step'] * 1e3:.3f} ms/step ({r['overhead_pct']:+.1f}%)"
                    for name, r in row.items()
                ),
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
