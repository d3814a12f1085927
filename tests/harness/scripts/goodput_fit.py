"""A 2-rank DDP fit that rank 1 SIGKILLs at one step of its first attempt; torchrun restarts it from the last save.

Usage: goodput_fit.py OUT [--kill-at S] [--steps N] [--save-every K]

Saves every K steps (ModelCheckpoint, ``last``), logs every step, resumes with ``ckpt_path="last"``. What the
script itself saw, for the test to compare with keel's goodput account: OUT/attempts.jsonl (rank 0, one line an
attempt: when the process started running this file, the step it resumed at), OUT/killed.json (when rank 1 killed
itself, at which step), OUT/done (rank 0, after fit). OUT/run/version_0 is the run directory.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: as close to the process start as Python gets

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

from models import Regression, quiet, regression_data  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from trainer import Callback, Trainer  # noqa: E402
from trainer.checkpoint.model_checkpoint import ModelCheckpoint  # noqa: E402
from trainer.loggers import CSVLogger  # noqa: E402


class Record(Callback):
    def __init__(self, out: Path, kill_at: int) -> None:
        self.out, self.kill_at = out, kill_at
        self.first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def on_train_start(self, trainer, task) -> None:
        if trainer.is_global_zero:
            with open(self.out / "attempts.jsonl", "a") as f:
                f.write(json.dumps({"started": STARTED, "resumed_at": trainer.global_step}) + "\n")

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if self.first and trainer.global_rank == 1 and trainer.global_step == self.kill_at:
            (self.out / "killed.json").write_text(json.dumps({"time": time.time(), "step": trainer.global_step}))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=args.save_every, save_last=True)
    trainer = Trainer(
        **quiet(
            max_steps=args.steps,
            log_every_n_steps=1,
            logger=CSVLogger(str(out), name="run", version=0),
            enable_checkpointing=True,
            callbacks=[Record(out, args.kill_at), checkpoint],
        )
    )
    trainer.fit(Regression(), DataLoader(regression_data(256), batch_size=4), ckpt_path="last")
    if trainer.is_global_zero:
        (out / "done").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
