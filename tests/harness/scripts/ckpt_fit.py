"""A small float64 fit under any launcher and strategy that records what the checkpoint tests compare.

Usage: ckpt_fit.py OUT [--strategy auto|ddp|fsdp] [--batch B] [--steps S] [--keep-dir D] [--prune-dir D]
       [--async-save] [--weights-dir D] [--resume PATH]

Data: 48 shuffled samples (6 optimizer steps per epoch at a global batch of 8), each carrying its index.
  --keep-dir D    ModelCheckpoint(D, every step, save_top_k=-1): every step's save, to resume from later
  --prune-dir D   two pruning callbacks: D/a = ModelCheckpoint(every_n_train_steps=1) (save_top_k=1) and
                  D/b = ModelCheckpoint(every_n_train_steps=2, save_top_k=2, save_last=True, monitor="age",
                  mode="min"): "age" is the step a batch was trained at, so the top 2 are the two oldest saves
                  and the newest is kept as `last` beside them. Before the fit rank 0 leaves what a killed
                  save leaves in each folder (.x.ckpt.tmp-0123abcd/, .x.ckpt.old-0123abcd/); at every batch
                  start rank 0 records whether those are still there and whether the `last` pointer exists.
  --async-save X  the pruning callbacks named in X (a, b or ab) save asynchronously
  --weights-dir D ModelCheckpoint(D/cb, save_weights_only=True, every 4 steps) and, after the fit,
                  trainer.save_checkpoint(D/final.ckpt, weights_only=True)
  --resume PATH   fit(ckpt_path=PATH)

OUT/rank{R}.pt: the final full weights (gathered under FSDP), the full optimizer state, the weights and
optimizer state at the first batch (after any resume) and after every step, the sample indices this rank
trained on per step, the pruning callbacks' bookkeeping and observations.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint

LEFTOVERS = (".x.ckpt.tmp-0123abcd", ".x.ckpt.old-0123abcd")


class Net(TaskModule):
    """Two blocks (FSDP's default units) and a head; AdamW with a per-step StepLR."""

    def __init__(self, lr: float = 0.03) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.lr = lr
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(10), nn.Linear(10, 10), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(10, 1)
        self.double()
        self.steps: dict[int, list[int]] = {}  # global step after the optimizer step -> sample indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # (N, 1): FSDP warns about a view (squeeze) as a unit's output

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.steps[self.global_step + 1] = idx.tolist()
        self.log("age", torch.tensor(float(self.global_step), dtype=torch.float64))
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    w = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return TensorDataset(torch.arange(n), x, y)


def full(value):
    """A plain CPU tensor (gathered from its shards when it is a DTensor)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def snapshot(trainer: Trainer, task: TaskModule) -> dict:
    """The whole model and optimizer state on every rank (a collective under FSDP: every rank calls it)."""
    weights = {k: full(v) for k, v in task.state_dict().items()}
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in task.named_parameters()}
    state = {names[id(p)]: {k: full(v) for k, v in s.items()} for p, s in opt.state.items()}
    return {
        "weights": weights,
        "optimizer": state,
        "lr": [group["lr"] for group in opt.param_groups],
        "step": trainer.global_step,
    }


class Recorder(Callback):
    """Snapshots at the first batch and after every step; rank 0 watches the pruning folders."""

    def __init__(self, prune_dirs: list[Path]) -> None:
        self.prune_dirs = prune_dirs
        self.start: dict | None = None
        self.after: dict[int, dict] = {}
        self.watch: list[dict] = []

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        if self.start is None:
            self.start = snapshot(trainer, task)
        if trainer.global_rank == 0:
            for d in self.prune_dirs:
                self.watch.append(
                    {
                        "dir": d.name,
                        "step": trainer.global_step,
                        "pointer": (d / "last").exists(),
                        "leftovers": sorted(n for n in LEFTOVERS if os.path.lexists(d / n)),
                    }
                )

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped:
            self.after[trainer.global_step] = snapshot(trainer, task)


def leave_leftovers(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in LEFTOVERS:
        (folder / name).mkdir()
        (folder / name / "__0_0.distcp").write_bytes(b"half a save")


def main(argv: list[str] | None = None) -> None:
    """Also called in the test process (one device, no process group): ``main([OUT, ...])``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--keep-dir", default=None)
    parser.add_argument("--prune-dir", default=None)
    parser.add_argument("--async-save", default="", help="which pruning callbacks save asynchronously: a, b, ab")
    parser.add_argument("--weights-dir", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0")) if args.strategy != "auto" else 0
    callbacks: list[Callback] = []
    prune: dict[str, ModelCheckpoint] = {}
    if args.keep_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.keep_dir, every_n_train_steps=1, save_top_k=-1))
    if args.prune_dir:
        root = Path(args.prune_dir)
        if rank == 0:
            for sub in ("a", "b"):
                leave_leftovers(root / sub)
        prune["a"] = ModelCheckpoint(dirpath=root / "a", every_n_train_steps=1, async_save="a" in args.async_save)
        prune["b"] = ModelCheckpoint(
            dirpath=root / "b",
            every_n_train_steps=2,
            save_top_k=2,
            save_last=True,
            monitor="age",
            mode="min",
            async_save="b" in args.async_save,
        )
        callbacks += list(prune.values())
    weights_cb = None
    if args.weights_dir:
        weights_cb = ModelCheckpoint(
            dirpath=Path(args.weights_dir) / "cb", every_n_train_steps=4, save_top_k=-1, save_weights_only=True
        )
        callbacks.append(weights_cb)
    recorder = Recorder([Path(args.prune_dir) / s for s in ("a", "b")] if args.prune_dir else [])
    callbacks.append(recorder)
    trainer = Trainer(
        max_steps=args.steps,
        strategy=args.strategy,
        precision="64",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.keep_dir or args.prune_dir or args.weights_dir),
        num_sanity_val_steps=0,
        log_every_n_steps=2,
        callbacks=callbacks,
        seed=3,
    )
    task = Net()
    if rank == 0 and args.prune_dir:  # the leftovers are in place before any rank starts the fit
        assert all((Path(args.prune_dir) / s / n).is_dir() for s in ("a", "b") for n in LEFTOVERS)
    trainer.fit(task, DataLoader(data(), batch_size=args.batch, shuffle=True), ckpt_path=args.resume)
    if args.weights_dir:
        trainer.save_checkpoint(Path(args.weights_dir) / "final.ckpt", weights_only=True)
    final = snapshot(trainer, task)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "final": final,
            "start": recorder.start,
            "after": recorder.after,
            "steps": task.steps,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "watch": recorder.watch,
            "prune": {
                k: {"best_k": sorted(cb.best_k_models), "last": cb.last_model_path, "best": cb.best_model_path}
                for k, cb in prune.items()
            },
            "weights_cb": sorted(os.listdir(weights_cb.dirpath)) if weights_cb is not None and rank == 0 else None,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
