"""A model built on the meta device, trained, evaluated, checkpointed and resumed under FSDP, with every tensor
this rank allocates counted: what each phase of the run holds at its peak.

Usage: sharded_fit.py OUT [--build init|configure|init_module|eager] [--strategy fsdp|ddp|auto]
       [--steps S] [--ckpt-dir D] [--resume] [--precision 64|bf16-mixed|32] [--width W] [--depth N]
       [--batch B] [--val V] [--initial-weights PATH]

``--build``: where the blocks are built: ``init`` (the whole task under ``torch.device("meta")``), ``configure``
(``configure_model`` under the meta device), ``init_module`` (``configure_model`` under Lightning's
``trainer.init_module(empty_init=True)``), ``eager`` (plain CPU tensors in ``__init__``).

OUT/rank{R}.pt holds the per-phase peaks of live tensor bytes (``LiveBytes``: every tensor an operator creates on
this rank, counted until its storage is freed), the sizes to judge them by (this rank's shard, the largest unit,
the whole model), the initial and final weights (gathered after the counting stopped), validation metrics,
predictions and the bytes autograd keeps for backward after the first training forward.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint

FEATURES, CLASSES = 16, 4


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage an operator created while the mode is on (a DTensor counts its local shard),
    read again after each operator: FSDP frees a gathered parameter by resizing its storage to zero, so a storage's
    size is read live, not at creation. Keeps the peak of each phase (``phase``)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: weakref.WeakSet = weakref.WeakSet()
        self.now = 0
        self.phase = "init"
        self.peaks: dict[str, int] = {}

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.now = sum(s.nbytes() for s in self.storages)
        self.peaks[phase] = max(self.peaks.get(phase, 0), self.now)

    def _count(self, tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", tensor)
        if local.is_meta or type(local) is not torch.Tensor and not isinstance(local, nn.Parameter):
            return
        self.storages.add(local.untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        self.now = sum(s.nbytes() for s in self.storages)
        if self.now > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.now
        return out


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(TaskModule):
    def __init__(self, build: str, width: int, depth: int) -> None:
        super().__init__()
        self.build, self.width, self.depth = build, width, depth
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList() if build in ("configure", "init_module") else self._blocks()
        self.head = nn.Linear(width, CLASSES)
        self.saved_bytes: list[int] = []

    def _blocks(self) -> nn.ModuleList:
        return nn.ModuleList(Block(self.width) for _ in range(self.depth))

    def configure_model(self) -> None:
        if len(self.blocks):
            return
        building = torch.device("meta") if self.build == "configure" else self.trainer.init_module(empty_init=True)
        with building:
            self.blocks.extend(self._blocks())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.saved_bytes:
            return F.cross_entropy(self(x), y)
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = F.cross_entropy(self(x), y)
        # What autograd keeps for backward once the forward is over (FSDP has freed what it resharded: a
        # gathered parameter saved for backward has a storage of zero bytes until backward gathers it again).
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in saved}
        self.saved_bytes.append(sum(storages.values()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x), y))
        self.log("val/acc", (self(x).argmax(-1) == y).double().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Phases(Callback):
    """Marks the phases of the run on the counter: everything before on_fit_start is initialisation (and, when
    resuming, the load); then training, evaluation and saving."""

    def __init__(self, live: LiveBytes, initial: dict[str, torch.Tensor]) -> None:
        self.live, self.initial = live, initial

    def on_fit_start(self, trainer, task) -> None:
        self.live.enter("train")
        if not self.initial:
            with self.paused():
                self.initial.update(full_weights(task))

    @contextlib.contextmanager
    def paused(self):
        phase = self.live.phase
        self.live.enter("not counted")
        with _disabled(self.live):
            yield
        self.live.enter(phase)

    def on_validation_start(self, trainer, task) -> None:
        self.live.enter("eval")

    def on_validation_end(self, trainer, task) -> None:
        self.live.enter("train")

    def on_save_checkpoint(self, trainer, task, checkpoint) -> None:
        self.live.enter("save")

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        self.live.enter("train")


@contextlib.contextmanager
def _disabled(mode: TorchDispatchMode):
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield


def full_weights(task: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in task.state_dict().items()
    }


def sizes(task: nn.Module) -> dict[str, int]:
    """This rank's bytes of parameters, the largest unit's full parameters, the largest single module's own
    parameters, and the whole model's."""

    def full(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    shard = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in task.parameters())
    blocks = [full(b.parameters()) for b in task.blocks]
    module = max(full(m.parameters(recurse=False)) for m in task.modules())
    return {"shard": shard, "unit": max(blocks), "module": module, "whole": full(task.parameters())}


def data(n: int, seed: int, dtype: torch.dtype) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g, dtype=dtype)
    return TensorDataset(x, (x[:, :CLASSES].sum(-1) * 2).long().clamp(0, CLASSES - 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--build", default="init", choices=["init", "configure", "init_module", "eager"])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--precision", default="64")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="training batch of one rank")
    parser.add_argument("--val", type=int, default=41, help="validation samples (41: uneven batches per rank)")
    parser.add_argument("--initial-weights", default=None, help="Trainer(initial_weights=...)")
    args = parser.parse_args()
    dtype = torch.float64 if args.precision == "64" else torch.float32
    live, initial = LiveBytes(), {}
    phases = Phases(live, initial)
    callbacks: list[Callback] = [phases]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    trainer = Trainer(
        max_steps=args.steps,
        precision=args.precision,
        strategy=args.strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_dir),
        num_sanity_val_steps=1,
        val_check_interval=3,
        log_every_n_steps=3,
        memory_plan=False,
        seed=0,
        callbacks=callbacks,
        initial_weights=args.initial_weights,
    )
    train, val = data(96, 0, dtype), data(args.val, 1, dtype)
    torch.manual_seed(1234)  # what __init__ builds on the CPU does not depend on what ran before it
    with live:
        with torch.device("meta") if args.build == "init" else contextlib.nullcontext():
            task = Net(args.build, args.width, args.depth)
        trainer.fit(
            task,
            DataLoader(train, batch_size=args.batch, shuffle=True),
            DataLoader(val, batch_size=5),
            ckpt_path="last" if args.resume else None,
        )
        live.enter("eval")
        metrics = trainer.validate(task, DataLoader(val, batch_size=5), verbose=False)
        predictions = trainer.predict(task, DataLoader(val, batch_size=3))
        live.enter("done")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "peaks": live.peaks,
            "sizes": sizes(task),
            "initial": initial,
            "weights": full_weights(task),
            "val": metrics,
            "predictions": torch.cat(predictions),
            "saved_bytes": task.saved_bytes,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
