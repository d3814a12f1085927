"""A fit that checkpoints every step and always starts with ckpt_path="last", under any launcher.

Faults on demand (first attempt only, TORCHELASTIC_RESTART_COUNT == 0 or unset):
  --crash-at S        raise an exception at step S (after that step's checkpoint)
  --kill-at S         SIGKILL rank --kill-rank at step S (before that step's checkpoint)
  --sigterm-at S      SIGTERM to rank --kill-rank at step S (keel saves and exits 75)
  --sigint-at S       Ctrl-C at step S: SIGINT to every rank, twice within a few ms as under torchrun (the
                      terminal's, then the agent's forward); keel saves and exits 130
  --default-check     preemption_check_interval left at its default: under DDP the ranks agree at every step
                      through the gradient all-reduce (not every 2 steps)
  --kill-in-save-at S SIGKILL rank 0 halfway through committing the checkpoint of step S (a torn keel.pt)
  --kill-mid-upload-at S  SIGKILL rank --kill-rank inside its first write of step S's save, its data file half
                      written (on object storage: an upload that never completes)
Writes OUT/rank{R}.pt with the final weights when the fit completes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer
from trainer.checkpoint import store
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


def data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long(), torch.arange(n))  # the index records the data order


class Classifier(TaskModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters() if hasattr(self, "save_hyperparameters") else None
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
        self.lr = lr
        self.seen: dict[int, list[int]] = {}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val/loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Faults(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not args.resumed

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if not (trainer.optimizer_stepped and self.first_attempt):
            return
        step, mine = trainer.global_step, trainer.global_rank == self.args.kill_rank
        if step == self.args.kill_at and mine:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.args.sigterm_at and mine:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.args.sigint_at:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        if step == self.args.kill_in_save_at and mine:

            def torn_finish(job, files):  # rank 0, once every rank's data files are written: keel.pt torn
                with open(job.tmp / "keel.pt", "wb") as handle:
                    handle.write(b"PK\x03\x04" + os.urandom(4096))
                    handle.flush()
                    os.fsync(handle.fileno())
                os.kill(os.getpid(), signal.SIGKILL)

            store._finish = torn_finish
        if step == self.args.kill_mid_upload_at and mine:
            from trainer.checkpoint import files

            def half_write(writer, data):  # the first bytes go out, then the process dies mid-file
                writer.raw.write(bytes(memoryview(data).cast("B")[: max(1, len(data) // 2)]))
                writer.raw.flush()
                os.kill(os.getpid(), signal.SIGKILL)

            files.HashingWriter.write = half_write


class CrashAfterSave(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped and trainer.global_step == self.args.crash_at and not self.args.resumed:
            raise RuntimeError(f"simulated crash at step {trainer.global_step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--sigint-at", type=int, default=-1)
    parser.add_argument(
        "--default-check",
        action="store_true",
        help="preemption_check_interval=None: under DDP the ranks agree at every step (on the gradient all-reduce)",
    )
    parser.add_argument("--kill-in-save-at", type=int, default=-1)
    parser.add_argument("--kill-mid-upload-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--resumed", action="store_true", help="a manual second run: inject no faults")
    parser.add_argument("--strategy", default="auto", help="the Trainer's strategy (auto: DDP on several ranks)")
    parser.add_argument("--save-on-crash-dir", default=None, help="also write the seen samples when crashing")
    args = parser.parse_args()
    checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_top_k=1)
    callbacks = [Faults(args), checkpoint, CrashAfterSave(args)]
    trainer = Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=3,
        preemption_check_interval=None if args.default_check else 2,
        strategy=args.strategy,
        callbacks=callbacks,
        seed=7,
    )
    task = Classifier()
    if args.save_on_crash_dir:
        import atexit

        out_crash = Path(args.save_on_crash_dir)
        atexit.register(
            lambda: (
                out_crash.mkdir(parents=True, exist_ok=True),
                torch.save(task.seen, out_crash / f"seen{trainer.global_rank}.pt"),
            )
        )
    trainer.fit(
        task,
        DataLoader(data(), batch_size=args.batch, shuffle=True),
        DataLoader(data(20, 1), batch_size=5),
        ckpt_path="last",
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "weights": task.state_dict(),
            "step": trainer.global_step,
            "optimizer": trainer.optimizers[0].state_dict()["state"],
            "best": checkpoint.best_model_path,
            "last": checkpoint.last_model_path,
            "seen": task.seen,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
