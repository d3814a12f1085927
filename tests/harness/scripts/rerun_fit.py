"""The same command run again: ``python rerun_fit.py ROOT OUT`` (or under torchrun) fits with ``ckpt_path="last"``
and the default logger under ROOT, and writes each rank's final weights to OUT.rank<N>.pt. Nothing on the command
line says "resume": a first launch that crashes is told so by the environment (``RERUN_CRASH_AT=S``: rank
``RERUN_CRASH_RANK`` raises at step S, every rank when it is -1; ``RERUN_HOLD=SECONDS``: every step sleeps, so another
run can meet this one live; ``RERUN_WAIT_FOR=PATH``: every step waits until PATH exists, at most 120 s).
``--fresh`` passes ``ckpt_path=None``; ``--dirpath D`` saves into D."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import Regression, regression_data
from torch.utils.data import DataLoader

from trainer import Callback, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


class Crash(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        crash_at, rank = int(os.environ.get("RERUN_CRASH_AT", "-1")), int(os.environ.get("RERUN_CRASH_RANK", "0"))
        if trainer.optimizer_stepped and trainer.global_step == crash_at and rank in (-1, trainer.global_rank):
            raise RuntimeError(f"crash at step {crash_at}")
        time.sleep(float(os.environ.get("RERUN_HOLD", "0")))
        wait_for, deadline = os.environ.get("RERUN_WAIT_FOR"), time.monotonic() + 120
        while wait_for and not os.path.exists(wait_for) and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    own = [ModelCheckpoint(dirpath=sys.argv[sys.argv.index("--dirpath") + 1])] if "--dirpath" in sys.argv else []
    trainer = Trainer(
        max_epochs=3,
        default_root_dir=root,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=2,
        callbacks=[Crash(), *own],
    )
    task = Regression()
    data = DataLoader(regression_data(64), batch_size=8, shuffle=True)
    trainer.fit(task, data, ckpt_path=None if "--fresh" in sys.argv else "last")
    torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, f"{out}.rank{trainer.global_rank}.pt")
    print(f"run directory: {trainer.log_dir}", flush=True)


if __name__ == "__main__":
    main()
