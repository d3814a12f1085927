"""What keel's stream tracking costs: steps/s of the streaming charlm recipe with and without it, in one run.

    python benchmarks/streaming.py [--steps 200] [--repeats 3] [--workers 0]

The streaming recipe (recipes/charlm_stream.py: the training split in sharded JSON-lines files read by Hugging Face
``datasets``) trains a small character GPT in one process for ``--steps`` optimizer steps. "tracked" is keel as
shipped: the DataLoader becomes a torchdata ``StatefulDataLoader`` and keel reads its ``state_dict()`` after every
batch, so a checkpoint holds the position after exactly the batches trained. "untracked" is the same loader with
keel's stream adaptation switched off (it is used as-is, as before streams were supported: no position is saved).
No checkpoints are written in either, so the difference is the per-batch tracking. The variants alternate; the
timed part is steps 20..end (the first steps warm up). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(tracked: bool, steps: int, workers: int, shards: Path) -> float:
    import torch

    import trainer.data.loaders as loaders
    from recipes.charlm import CharGPT
    from recipes.charlm_stream import CharStreamDataModule
    from trainer import Callback, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 20 and trainer.optimizer_stepped:
                self.start = time.perf_counter()
            self.end = time.perf_counter()

    original = loaders.adapt_stream
    if not tracked:
        loaders.adapt_stream = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        data = CharStreamDataModule(
            block_size=64, batch_size=16, max_chars=400_000, shards_dir=str(shards), num_workers=workers
        )
        task = CharGPT(vocab_size=data.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=64, sample_chars=0)
        clock = Clock()
        trainer = Trainer(
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[clock],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(task, datamodule=data)
        return (steps - 20) / (clock.end - clock.start)
    finally:
        loaders.adapt_stream = original


def state_dict_cost(shards: Path, batches: int = 200) -> float:
    """Microseconds per ``state_dict()`` of the recipe's tracked loader, what keel adds to each batch."""
    from recipes.charlm_stream import CharStreamDataModule
    from trainer.data.streams import adapt_stream

    data = CharStreamDataModule(block_size=64, batch_size=16, max_chars=400_000, shards_dir=str(shards))
    data.prepare_data()
    stream = adapt_stream(data.train_dataloader(), num_replicas=1, rank=0)
    assert stream is not None
    iterator, spent = iter(stream.loader), 0.0
    for _ in range(batches):
        next(iterator)
        start = time.perf_counter()
        stream.loader.state_dict()  # type: ignore[attr-defined]
        spent += time.perf_counter() - start
    return spent / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    rates: dict[str, list[float]] = {"tracked": [], "untracked": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name in ("untracked", "tracked"):
                rates[name].append(run(name == "tracked", args.steps, args.workers, Path(tmp) / "shards"))
        cost = state_dict_cost(Path(tmp) / "shards")
    med = {name: statistics.median(values) for name, values in rates.items()}
    print(f"steps/s, {args.steps} steps (timed from step 20), {args.repeats} runs each, workers={args.workers}\n")
    print("| variant | steps/s (median) | runs |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {med[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    print(f"\ntracked / untracked: {med['tracked'] / med['untracked']:.3f}")
    print(f"state_dict() of the tracked loader: {cost:.0f} us per batch ({cost / 1e4 * med['tracked']:.1f}% of a step)")


if __name__ == "__main__":
    main()
