"""resume_fit.py's fit with ``ModelCheckpoint(async_save=...)`` and faults aimed at the background write.

Always starts with ckpt_path="last". Faults on demand (first attempt only; rank --kill-rank):
  --crash-at S          raise on every rank at step S (after that step's save was submitted)
  --sigterm-at S        SIGTERM at step S (keel saves synchronously and exits 75)
  --block-write-at S    the background write of step S's checkpoint writes half a temporary file, touches
                        OUT/blocked, then blocks forever; at step S + 1 (before that step's save) the rank
                        waits for OUT/blocked and SIGKILLs itself: killed during a background write
  --slow-write SEC      every background write sleeps SEC first (a save is in flight for a while)
Writes OUT/rank{R}.pt with the final weights when the fit completes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import torch
from resume_fit import Classifier, CrashAfterSave, data
from torch.utils.data import DataLoader

from trainer import Callback, Trainer
from trainer.checkpoint.files import CheckpointIO
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


class Faults(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not args.resumed

    def setup(self, trainer, task, stage) -> None:
        args, mine = self.args, trainer.global_rank == self.args.kill_rank
        original = CheckpointIO.save

        def save(io, state, path, *, is_writer):
            if threading.current_thread() is not threading.main_thread():
                if self.first_attempt and mine and f"step={args.block_write_at}." in os.fspath(path):
                    target = Path(path)
                    fd, _ = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
                    with os.fdopen(fd, "wb") as handle:  # half a checkpoint under the temporary name
                        handle.write(b"PK\x03\x04" + os.urandom(4096))
                        handle.flush()
                        os.fsync(handle.fileno())
                    (Path(args.out) / "blocked").touch()
                    threading.Event().wait()  # never returns: the process is SIGKILLed meanwhile
                if args.slow_write:
                    time.sleep(args.slow_write)
            return original(io, state, path, is_writer=is_writer)

        CheckpointIO.save = save

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if not (trainer.optimizer_stepped and self.first_attempt):
            return
        step, mine = trainer.global_step, trainer.global_rank == self.args.kill_rank
        if step == self.args.sigterm_at and mine:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.args.block_write_at > 0 and step == self.args.block_write_at + 1 and mine:
            marker, deadline = Path(self.args.out) / "blocked", time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--sync", action="store_true", help="async_save=False (the reference)")
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--block-write-at", type=int, default=-1)
    parser.add_argument("--slow-write", type=float, default=0.0)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--resumed", action="store_true", help="a manual second run: inject no faults")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_top_k=1, async_save=not args.sync)
    callbacks = [Faults(args), checkpoint, CrashAfterSave(args)]
    trainer = Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=3,
        preemption_check_interval=2,
        callbacks=callbacks,
        seed=7,
    )
    task = Classifier()
    trainer.fit(
        task, DataLoader(data(), batch_size=4, shuffle=True), DataLoader(data(20, 1), batch_size=5), ckpt_path="last"
    )
    assert not checkpoint._checkpointer.in_flight
    torch.save(
        {
            "weights": task.state_dict(),
            "step": trainer.global_step,
            "optimizer": trainer.optimizers[0].state_dict()["state"],
            "best": checkpoint.best_model_path,
            "last": checkpoint.last_model_path,
            "seen": task.seen,
        },
        Path(args.out) / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
