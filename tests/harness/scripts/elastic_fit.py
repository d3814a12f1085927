"""An elastic fit: a global batch schedule (16, then 32 from step 8), float64, a checkpoint every step,
always ``ckpt_path="last"``.

Runs under a plain ``python`` (the uninterrupted reference) or under torchrun agents started with
``--nnodes 1:2`` (tests/integration/test_elastic.py). Each agent's environment names its node (``KEEL_NODE``).

Membership events on demand (first attempt only):
  --die-at S      the worker on node --die-node SIGKILLs its torchrun agent (under torchrun) and then
                  itself right after optimizer step S, before that step's checkpoint: the node is gone and
                  step S is lost (first attempt: TORCHELASTIC_RESTART_COUNT / SLURM_RESTART_COUNT 0)
  --mark-at S     at world size 1, the worker touches OUT/reached once step S is done (the test then
                  starts a second agent: a node joins) and waits (at most --join-wait seconds) for the
                  SIGTERM with which its agent stops it to admit the new node; keel then saves at step S

Writes OUT/rank{R}.pt when the fit completes: final weights, the step count, the global sample order of
every optimizer step (``order``, carried in the checkpoints so that a resumed run reports the path its
weights took), with the accumulation, the world size and the sum of the weights after each step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.distributed import comm
from trainer.loggers import CSVLogger

ORDER_KEY = "elastic_fit_order"


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = x @ torch.randn(6, 1, generator=g, dtype=torch.float64) + 0.1 * torch.randn(
        n, 1, generator=g, dtype=torch.float64
    )
    return TensorDataset(x, y, torch.arange(n))  # the index records the data order


class Regression(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.local: list[int] = []  # sample ids of the current optimizer step on this rank
        self.micro = 0  # micro-batches of the current optimizer step on this rank
        self.order: list[dict] = []  # per optimizer step: epoch, global sample order, accumulation

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.local.extend(idx.tolist())
        self.micro += 1
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if not self.trainer.optimizer_stepped:
            return
        # Rank r holds the sampler's strided share remaining[r::W], so local position p of rank r is
        # global position p * W + r of this step's window.
        shares = comm.all_gather_object(self.local) if self.trainer.world_size > 1 else [self.local]
        world = len(shares)
        merged = [0] * sum(len(s) for s in shares)
        for rank, share in enumerate(shares):
            merged[rank::world] = share
        self.order.append(
            {
                "step": self.trainer.global_step,
                "epoch": self.trainer.current_epoch,
                "samples": merged,
                "accumulate": self.micro,
                "world_size": world,
                "weights_sum": float(sum(p.detach().sum() for p in self.parameters())),
            }
        )
        self.local, self.micro = [], 0

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint[ORDER_KEY] = list(self.order)

    def on_load_checkpoint(self, checkpoint) -> None:
        self.order = list(checkpoint.get(ORDER_KEY, []))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Membership(Callback):
    """Node loss / join events, on the first attempt of this agent only."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
        self.first = restarts == "0"
        self.terminated = False
        self.wrapped = False

    def on_train_epoch_start(self, trainer, task) -> None:
        # keel's own SIGTERM handler is installed by now: chain in front of it to see the agent's signal.
        if self.wrapped:
            return
        self.wrapped = True
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):
            self.terminated = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, handler)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if not (trainer.optimizer_stepped and self.first):
            return
        args, step, out = self.args, trainer.global_step, Path(self.args.out)
        if step == args.die_at and os.environ.get("KEEL_NODE") == str(args.die_node):
            out.mkdir(parents=True, exist_ok=True)
            (out / "died").write_text(f"{time.time():.6f}\n")  # the moment the node is lost
            if os.environ.get("TORCHELASTIC_RUN_ID"):
                os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent of this node
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.mark_at and trainer.world_size == 1:
            out.mkdir(parents=True, exist_ok=True)
            (out / "reached").write_text(f"{time.time():.6f}\n")
            deadline = time.monotonic() + args.join_wait
            while not self.terminated and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.terminated:
                (out / "stopped").write_text(f"{time.time():.6f}\n")  # the agent admits the new node


def clock(event: str) -> None:
    """``[elastic_fit] <event> at <unix time>`` on stderr: the test reads the resume latency from these."""
    sys.stderr.write(f"[elastic_fit] {event} at {time.time():.6f}\n")


class Clock(Callback):
    """Wall-clock marks of this process: fit started (checkpoint restored), first optimizer step."""

    def __init__(self) -> None:
        self.done = False

    def on_fit_start(self, trainer, task) -> None:
        if trainer.is_global_zero:
            clock(f"restored step {trainer.global_step}")

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped and not self.done:
            self.done = True
            if trainer.is_global_zero:
                clock(f"first step {trainer.global_step} world_size={trainer.world_size}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--grow-at", type=int, default=8, help="global step from which the global batch doubles")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-node", type=int, default=1)
    parser.add_argument("--mark-at", type=int, default=-1)
    parser.add_argument("--join-wait", type=float, default=60.0)
    args = parser.parse_args()
    clock("imported")
    callbacks = [Membership(args), ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_top_k=1), Clock()]
    global_batch = {"step": {0: args.global_batch, args.grow_at: 2 * args.global_batch}}
    logger = CSVLogger(args.log_dir, name=None, version=0) if args.log_dir else False
    trainer = Trainer(
        max_epochs=args.epochs,
        global_batch_size=global_batch,
        precision="64",
        logger=logger,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        preemption_check_interval=1,
        callbacks=callbacks,
        seed=3,
    )
    task = Regression()
    clock("fit called")
    trainer.fit(task, DataLoader(data(args.samples), batch_size=args.batch, shuffle=True), ckpt_path="last")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "weights": task.state_dict(),
            "step": trainer.global_step,
            "order": task.order,
            "world_size": trainer.world_size,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
