"""Ordinary training steps on CUDA under ``torch.cuda.set_sync_debug_mode("error")`` (issue: the GPU
path is sync-free). Run under ``torchrun --nproc-per-node 1`` (nccl) by tests/integration/test_gpu.py:

    python cuda_sync_free.py OUT --strategy ddp|fsdp --precision 32|bf16-mixed|16-mixed [--clip 1.0]

After two warm-up steps (lazy optimizer state, allocator growth, cuBLAS handles) every ordinary step runs
with synchronising CUDA calls turned into errors: the batch copy from the pinned loader, forward,
backward (DDP's all-reduce or FSDP's reduce-scatter), unscale, clipping, the optimizer step, the
scheduler, the non-finite bookkeeping and every hook between them. Logging steps may read the device
(once, for the step metrics): the mode is relaxed from ``on_before_zero_grad`` of such a step to its
``on_train_batch_end``. Writes OUT/result.json with the steps run under "error" mode.

16-mixed uses a fused AdamW: ``GradScaler.step`` reads ``found_inf`` on the host for any other optimizer
(torch's design, one sync per step); a fused optimizer skips an inf step on the device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer

LOG_EVERY = 5
WARMUP = 2


class Blocks(TaskModule):
    """Two blocks in an nn.ModuleList (one FSDP unit each by default) and a head."""

    def __init__(self, fused: bool, items: str | None = None) -> None:
        super().__init__()
        self.items = items  # None: a mean loss; "int" / "tensor": a summed loss with num_items of that kind
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(2)
        )
        self.head = torch.nn.Linear(64, 1)
        self.fused = fused

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.items is not None:  # token-normalised: keel divides by the global count, on the device
            loss = torch.nn.functional.mse_loss(self(x).float(), y, reduction="sum")
            count = len(x) if self.items == "int" else (y == y).sum()  # the tensor count stays on the GPU
            return {"loss": loss, "num_items": count}
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.log("train/loss", loss, prog_bar=True)  # on_step: a device tensor, read on logging steps only
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused or None)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SyncGuard(Callback):
    """Turns synchronising CUDA calls into errors on ordinary steps, after the warm-up."""

    def __init__(self) -> None:
        self.strict_steps: list[int] = []

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        if trainer.global_step >= WARMUP:
            assert batch[0].is_cuda
            self.strict_steps.append(trainer.global_step + 1)

    def on_before_zero_grad(self, trainer, task, optimizer) -> None:
        if (trainer.global_step + 1) % LOG_EVERY == 0:  # a logging step: its metric read may sync once
            torch.cuda.set_sync_debug_mode("default")

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        # From here through the next batch's fetch and copy; the epoch end after the last step reads metrics.
        last = trainer.global_step >= trainer.options.max_steps
        torch.cuda.set_sync_debug_mode("error" if WARMUP <= trainer.global_step and not last else "default")

    def on_train_end(self, trainer, task) -> None:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--items", choices=["int", "tensor"], default=None)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 64, generator=g), torch.randn(512, generator=g))
    guard = SyncGuard()
    trainer = Trainer(
        accelerator="cuda",
        strategy=args.strategy,
        precision=args.precision,
        gradient_clip_val=args.clip,
        max_steps=14,
        log_every_n_steps=LOG_EVERY,
        callbacks=[guard],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    trainer.fit(
        Blocks(fused=args.precision == "16-mixed", items=args.items), DataLoader(data, batch_size=32, pin_memory=True)
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(
        json.dumps(
            {
                "strict_steps": guard.strict_steps,
                "global_step": trainer.global_step,
                "scale": trainer._precision.scaler.get_scale() if trainer._precision.scaler is not None else None,
            }
        )
    )


if __name__ == "__main__":
    main()
