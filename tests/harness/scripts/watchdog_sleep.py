"""A 2-rank fit with the Trainer's hang watchdog on; rank 1 stalls inside its training step.

Launched by torchrun (gloo). Usage: ``watchdog_sleep.py OUT_DIR [TIMEOUT_S]``.
``Trainer(watchdog_timeout=...)``, the run directory under OUT_DIR; at global step 3 rank 1 calls
:func:`sleep_inside_training_step`, which sleeps far longer than the test's launch timeout: only the
watchdog can end the job. Rank 1's watchdog must fire after TIMEOUT_S (default 3), dump its stacks to
the run directory and exit 134; torchrun then stops rank 0.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

from models import Regression, quiet, regression_data
from torch.utils.data import DataLoader

from trainer import Trainer
from trainer.distributed import launcher

STALL_STEP = 3


def sleep_inside_training_step() -> None:
    time.sleep(3600)


class Stalls(Regression):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == STALL_STEP:
            sleep_inside_training_step()
        return super().training_step(batch, batch_idx)


def main() -> None:
    out = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rank = launcher.detect_env().rank
    # Rank 0 waits three times longer, so the stalled rank always fires (and is reported) first; with equal
    # timeouts rank 0, blocked in the gradient all-reduce, may fire a poll earlier and torchrun would stop
    # rank 1 before it wrote its stacks.
    trainer = Trainer(
        **quiet(max_epochs=1, watchdog_timeout=timeout if rank == 1 else 3 * timeout, default_root_dir=out)
    )
    trainer.fit(Stalls(), DataLoader(regression_data(64), batch_size=8))
    print(f"rank {rank} finished without the watchdog firing", flush=True)


if __name__ == "__main__":
    main()
