"""Rank-zero logging and rank-agreeing callbacks under DDP; tests/integration/test_rank_zero.py reads the output.

Usage: rank_zero_output.py OUT_DIR   (writes OUT_DIR/rank{R}.json; CSV logs under OUT_DIR/logs)

User code logs through ``logging.getLogger("trainer")``, ``rank_zero_info`` and its own module logger
(INFO on every rank: only rank 0's may appear) and warns from rank 1 (must appear, tagged
``[rank 1]``). Metrics are logged on rank 0 only (``only0`` per step, ``val/only0`` per validation);
EarlyStopping monitors ``val/only0`` and must stop both ranks at the same epoch, while Timer,
ThroughputMonitor and LearningRateMonitor run their logging-step collectives on both ranks.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import Regression, loader, quiet, regression_data
from torch.nn import functional as F

from callbacks import EarlyStopping, LearningRateMonitor, ModelSummary, ThroughputMonitor, Timer
from trainer import Trainer
from trainer.loggers import CSVLogger
from trainer.observability.rank_zero import rank_zero_info

user_log = logging.getLogger("user_script")
VAL_SEQUENCE = [5.0, 4.0, 4.5, 4.4, 3.0, 2.0]  # patience 2: stops after epoch 3


class Task(Regression):
    def on_fit_start(self) -> None:
        rank = self.global_rank
        logging.getLogger("trainer").info("user: trainer-logger info from rank %d", rank)
        rank_zero_info("user: rank_zero_info called on rank %d", rank)
        user_log.info("user: module-logger info from rank %d", rank)
        if rank == 1:
            logging.getLogger("trainer").warning("user: warning from rank %d", rank)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 0:
            self.log("only0", float(self.global_step))  # a key only rank 0 logs
        loss = F.mse_loss(self(x), y, reduction="sum")
        return {"loss": loss, "num_items": torch.tensor(len(x))}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))
        if self.global_rank == 0:
            self.log("val/only0", VAL_SEQUENCE[self.current_epoch])


def main() -> None:
    out = Path(sys.argv[1])
    stopper = EarlyStopping("val/only0", patience=2)
    throughput = ThroughputMonitor(window=4)
    timer = Timer(duration=3600)  # never stops; exercises its broadcast at logging steps and epoch ends
    trainer = Trainer(
        **quiet(
            max_epochs=len(VAL_SEQUENCE),
            log_every_n_steps=2,
            logger=CSVLogger(out / "logs"),
            callbacks=[stopper, throughput, timer, LearningRateMonitor(), ModelSummary()],
        )
    )
    # 32 samples, batch 4 per rank: 4 steps per epoch on each of 2 ranks. Validation: 1 batch per rank.
    trainer.fit(Task(), loader(regression_data(32), 4), loader(regression_data(8, seed=1), 4))
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "callback_metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "stopped_epoch": stopper.stopped_epoch,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "throughput_keys": sorted(throughput.last_values),
        "timer_elapsed": timer.time_elapsed(),
        "world_size": trainer.world_size,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
