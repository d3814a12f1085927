"""A small float64 block model trained under any launcher and strategy; dumps full weights per rank.

Usage: fsdp_fit.py OUT --strategy {ddp,fsdp,auto} [--accumulate K] [--items] [--clip C] [--manual]
       [--reduce every_micro_batch|last_micro_batch] [--ckpt-dir D] [--steps S] [--kill-at S] [--resume]
       [--configure-model] [--units Block] [--recompute Block] [--replicate R|auto] [--keep-saves]

OUT/rank{R}.pt holds the final weights as one plain state dict (gathered from the shards under FSDP),
validation / test metrics, predictions, ``task(x)`` on a fixed input, the global step and the data order.
``--kill-at S`` SIGKILLs rank 1 (or rank 0 in one process) right after step S on the first attempt
(TORCHELASTIC_RESTART_COUNT 0); every run checkpoints each step and starts with ckpt_path="last".
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

from trainer import Callback, DDPStrategy, FSDPStrategy, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class BlockNet(TaskModule):
    """Embedding-free regression net: input proj, a ModuleList of blocks (the default FSDP units), head."""

    def __init__(self, *, items: bool = False, manual: bool = False, late: bool = False, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items, self.lr, self.late = items, lr, late
        self.inp = nn.Linear(6, 12)
        self.blocks = nn.ModuleList() if late else nn.ModuleList([Block(12) for _ in range(3)])
        self.head = nn.Linear(12, 1)
        self.automatic_optimization = not manual
        self.seen: list[int] = []
        self.saved_bytes: list[int] = []  # per training step: bytes autograd kept for backward in self(x)
        self.recomputed = 0  # modules under activation checkpointing during the first step

    def _kept(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved_bytes[-1] += tensor.numel() * tensor.element_size()
        return tensor

    def configure_model(self) -> None:
        if self.late and not len(self.blocks):
            torch.manual_seed(1)
            self.blocks.extend(Block(12) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen.extend(idx.tolist())
        if not self.saved_bytes:
            self.recomputed = sum("forward" in m.__dict__ for m in self.modules())
        self.saved_bytes.append(0)
        with torch.autograd.graph.saved_tensors_hooks(self._kept, lambda t: t):
            out = self(x)
        if self.items:  # a SUM over the contributing items; keel divides by the global count
            keep = (idx % 3 != 0).to(x.dtype)
            loss = (((out - y) ** 2) * keep).sum()
            return {"loss": loss, "num_items": int(keep.sum().item())}
        loss = F.mse_loss(out, y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("test/mae", (self(x) - y).abs().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = x @ torch.linspace(-1, 1, 6, dtype=torch.float64) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return TensorDataset(torch.arange(n), x, y)


class Kill(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first
            and trainer.optimizer_stepped
            and trainer.global_step == self.step
            and trainer.global_rank == trainer.world_size - 1
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def full_weights(task: TaskModule) -> dict[str, torch.Tensor]:
    """The whole model on every rank, as plain CPU tensors (gathered from DTensor shards under FSDP)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in task.state_dict().items()
    }


class NanInShard(Callback):
    """After step ``step``, before that step's checkpoint: a NaN in rank 1's local shard of the first block."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1:
            weight = next(task.parameters())
            with torch.no_grad():
                (weight.to_local() if hasattr(weight, "to_local") else weight).view(-1)[0] = float("nan")


def _mesh(strategy) -> dict[str, int]:
    """The run's mesh (name -> size) and the mesh the first parameter is sharded over."""
    mesh = getattr(strategy, "device_mesh", None)
    if mesh is None:
        return {}
    out = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    param = next(strategy.task.parameters())
    out["parameter"] = "x".join(f"{n}:{p}" for n, p in zip(param.device_mesh.mesh_dim_names, param.placements))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--items", action="store_true")
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--reduce", default=None)
    parser.add_argument("--units", default=None)
    parser.add_argument("--recompute", default=None, help="activation_checkpointing: module class names")
    parser.add_argument("--configure-model", action="store_true")
    parser.add_argument("--steps", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--precision", default="64")
    parser.add_argument("--replicate", default=None, help="FSDPStrategy(replicate_size=...): hybrid sharding")
    parser.add_argument("--keep-saves", action="store_true", help="keep every step's save (save_top_k=-1)")
    parser.add_argument(
        "--nan-at", type=int, default=-1, help="a NaN in rank 1's shard after step N (on_nonfinite=skip)"
    )
    args = parser.parse_args()
    settings = {}  # FSDPStrategy's, for FSDP runs only
    if args.reduce and args.strategy == "fsdp":
        settings["reduce_grads"] = args.reduce
    if args.units and args.strategy == "fsdp":
        settings["units"] = args.units.split(",")
    if args.replicate and args.strategy == "fsdp":
        settings["replicate_size"] = args.replicate if args.replicate == "auto" else int(args.replicate)
    if args.recompute:
        settings["activation_checkpointing"] = args.recompute.split(",")
    strategy = args.strategy
    if settings:
        strategy = FSDPStrategy(**settings) if args.strategy == "fsdp" else DDPStrategy(**settings)
    extra = {}
    callbacks = [Kill(args.kill_at)] if args.kill_at > 0 else []
    if args.nan_at > 0:
        callbacks.append(NanInShard(args.nan_at))
        extra["on_nonfinite"] = "skip"  # the NaN loss that follows skips steps; the save must still be refused
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                every_n_train_steps=1,
                save_top_k=-1 if args.keep_saves else 1,
                async_save=args.async_save,
            )
        )
    trainer = Trainer(
        max_epochs=args.epochs,
        max_steps=args.steps,
        precision=args.precision,
        strategy=strategy,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_dir),
        num_sanity_val_steps=0,
        log_every_n_steps=2,
        callbacks=callbacks,
        **extra,
    )
    task = BlockNet(items=args.items, manual=args.manual, late=args.configure_model)
    train, val = data(48, 0), data(37, 1)
    if args.precision != "64":  # float32 data for the other precisions
        train, val = (TensorDataset(d.tensors[0], d.tensors[1].float(), d.tensors[2].float()) for d in (train, val))
    try:
        trainer.fit(
            task,
            DataLoader(train, batch_size=args.batch, shuffle=True),
            DataLoader(val, batch_size=5),
            ckpt_path="last" if args.ckpt_dir else None,
        )
    except FloatingPointError:  # --nan-at: the refused checkpoint; where each rank learnt it
        sys.stdout.write(f"rank {trainer.global_rank} raised FloatingPointError at step {trainer.global_step}\n")
        sys.stdout.flush()
        raise
    val_metrics = trainer.validate(task, DataLoader(val, batch_size=5))
    test_metrics = trainer.test(task, DataLoader(val, batch_size=4))
    predictions = trainer.predict(task, DataLoader(val, batch_size=3))
    mixed = torch.autocast("cpu", torch.bfloat16, enabled=args.precision == "bf16-mixed")
    with torch.no_grad(), mixed:
        direct = task(val.tensors[1][:4]).detach().cpu()  # task(x) on the (sharded) task: every rank calls it
    with torch.no_grad():  # outside autocast: FSDP's bf16-mixed task enters it itself, DDP's computes in fp32
        outside = task(val.tensors[1][:4]).detach().cpu()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer.export_weights(out / "export.safetensors")  # every rank calls it; rank 0 writes the gathered weights
    torch.save(
        {
            "weights": full_weights(task),
            "val": val_metrics,
            "test": test_metrics,
            "predictions": torch.cat(predictions),
            "direct": direct,
            "global_step": trainer.global_step,
            "seen": task.seen,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "outside": outside,
            "mesh": _mesh(trainer.strategy),
            "saved_bytes": task.saved_bytes,
            "recomputed": task.recomputed,
            "last": trainer.checkpoint_callback.last_model_path if args.ckpt_dir else None,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
