"""The "every rank got the same first batch" warning on 2 gloo ranks (trainer/data/loaders.py).

Launched by torchrun. Two fits over a stream keel cannot shard (an IterableDataset): one that yields the same
samples on every rank, one sharded by rank with ``shard_iterable``. Prints, per rank and fit, how many times
the warning was logged: ``rank R same N`` and ``rank R sharded N``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

from models import Regression, quiet, regression_data
from torch.utils.data import DataLoader, IterableDataset

from trainer import Trainer
from trainer.data.loaders import shard_iterable
from trainer.distributed import launcher


class Stream(IterableDataset):
    def __init__(self, sharded: bool, rank: int) -> None:
        self.samples = list(zip(*regression_data(32).tensors))
        self.sharded, self.rank = sharded, rank

    def __iter__(self):
        return iter(shard_iterable(self.samples, rank=self.rank, world_size=2) if self.sharded else self.samples)


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "Every rank got the same first batch" in record.getMessage()


def main() -> None:
    rank = launcher.detect_env().rank
    counter = Count()
    logging.getLogger("trainer.data.loaders").addHandler(counter)
    for name, sharded in (("same", False), ("sharded", True)):
        before = counter.count
        Trainer(**quiet(max_steps=2)).fit(Regression(), DataLoader(Stream(sharded, rank), batch_size=4))
        sys.stdout.write(f"rank {rank} {name} {counter.count - before}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
