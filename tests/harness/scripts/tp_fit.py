"""A float64 MLP-block model trained with tensor parallelism composed with FSDP, or in one process; dumps full weights.

Usage: tp_fit.py OUT --strategy {single,fsdp,lightning} [--tp T] [--steps S] [--clip C] [--items]
       [--ckpt-dir D [--save-every N]] [--resume PATH] [--memory-plan]

``fsdp``: keel's ``FSDPStrategy(tensor_parallel_size=T)``; the task's ``configure_model`` applies its plan
(``ColwiseParallel`` up-projection, ``RowwiseParallel`` down-projection) on ``self.device_mesh["tensor_parallel"]``
and keel shards over the data-parallel dimension. ``lightning``: Lightning's ``ModelParallelStrategy`` through
``callbacks.lightning``, whose ``configure_model`` also calls ``fully_shard`` itself, as Lightning's docs do.
``single``: one process, no mesh (the reference). The global batch is 8 (micro-batch 2) at every mesh, so
accumulation is 8 / (2 x data-parallel size). OUT/rank{R}.pt holds the gathered weights, the samples this rank
trained on, this rank's parameter and optimizer-state bytes (and the memory plan's line), the logged epoch sum
of samples, the validation metrics, the predictions and the global step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from fsdp_fit import (
    data,
    full_weights,
)  # the same data and weight gathering as the FSDP script (tests/harness/scripts/)
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from callbacks.lightning.pytorch.strategies import ModelParallelStrategy
from trainer import FSDPStrategy, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.memory import MemoryPlan

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class MLPNet(TaskModule):
    """Input projection and head outside the plan (sharded over the data-parallel dimension only), blocks split.
    Built in float32: precision="64" converts it after configure_model has split it."""

    def __init__(self, *, items: bool = False, shards_itself: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items, self.shards_itself = items, shards_itself
        self.inp = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, 1)
        self.seen: list[
            torch.Tensor
        ] = []  # the indices of each batch (tensors: the memory plan runs this on fake ones)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or hasattr(self.blocks[0].up.weight, "device_mesh"):  # one process, or already applied
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in self.blocks:
            parallelize_module(block, mesh["tensor_parallel"], plan)
        if self.shards_itself:  # Lightning's ModelParallelStrategy: the task shards over data_parallel itself
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen.append(idx.clone())
        self.log("samples", float(len(idx)), on_step=False, on_epoch=True, reduce_fx="sum")
        out = self(x)
        if self.items:  # a SUM over the contributing items; keel divides by the global count
            keep = (idx % 3 != 0).to(x.dtype)
            return {"loss": (((out - y) ** 2) * keep).sum(), "num_items": keep.sum().long()}
        return F.mse_loss(out, y)

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        idx, x, _ = batch
        return torch.stack([idx.to(x.dtype), self(x)], dim=1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)


def held_bytes(task: nn.Module, optimizers: list) -> dict[str, int]:
    """The bytes of this rank's parameters and optimizer state (local shards of DTensors), after training."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    state = [v for o in optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": sum(local(p) for p in task.parameters()), "optimizer": sum(local(v) for v in state)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", choices=("single", "fsdp", "lightning"), default="fsdp")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--replicate", type=int, default=1, help="FSDPStrategy(replicate_size=...): HSDP")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--items", action="store_true")
    parser.add_argument("--ckpt-dir", default=None, help="keep a save every --save-every steps there")
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--resume", default=None, help="ckpt_path: a save's folder, or 'last'")
    parser.add_argument("--memory-plan", action="store_true", help="Trainer(memory_plan=True): its line is dumped")
    args = parser.parse_args()
    strategy: object = "auto"
    if args.strategy == "fsdp":
        strategy = FSDPStrategy(tensor_parallel_size=args.tp, replicate_size=args.replicate)
    elif args.strategy == "lightning":
        strategy = ModelParallelStrategy(tensor_parallel_size=args.tp)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1))
    trainer = Trainer(
        max_epochs=1,
        max_steps=args.steps,
        precision="64",
        strategy=strategy,
        global_batch_size=8,
        gradient_clip_val=args.clip,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_dir),
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=callbacks,
        memory_plan=args.memory_plan,
    )
    task = MLPNet(items=args.items, shards_itself=args.strategy == "lightning")
    train, val = data(48, 0), data(37, 1)
    trainer.fit(
        task,
        DataLoader(train, batch_size=2, shuffle=True),
        DataLoader(val, batch_size=5),
        ckpt_path=args.resume,
    )
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    val_metrics = trainer.validate(task, DataLoader(val, batch_size=5))
    predictions = torch.cat(trainer.predict(task, DataLoader(val, batch_size=3)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "weights": full_weights(task),
            "seen": torch.cat(task.seen).tolist() if task.seen else [],
            "held": held_bytes(task, trainer.optimizers),
            "plan": next((cb.summary for cb in trainer.callbacks if isinstance(cb, MemoryPlan)), None),
            "fit_metrics": fit_metrics,
            "val": val_metrics,
            "predictions": predictions,
            "global_step": trainer.global_step,
            "accumulate": trainer.accumulate_grad_batches,
            "mesh": None if task.device_mesh is None else tuple(task.device_mesh.shape),
            "placements": {n: str(getattr(p, "placements", "")) for n, p in task.named_parameters()},
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
