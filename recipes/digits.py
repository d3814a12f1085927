"""The digits recipe: scikit-learn's 8x8 handwritten digits and a small CNN.

The data ships with scikit-learn (``sklearn.datasets.load_digits``, 1797 images), so the recipe runs
offline and a CPU reaches ~98% validation accuracy in well under a minute. Run it with
``python -m recipes.train`` (conf/train.yaml selects ``task: digits`` and ``data: digits``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import DataModule, TaskModule

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class DigitsDataModule(DataModule):
    """sklearn's digits as ``(1, 8, 8)`` float32 images in [0, 1] with int64 labels.

    The split is a permutation drawn from a ``torch.Generator`` seeded with ``split_seed``, so it is the
    same on every rank and every run, whatever the Trainer's ``seed``.

    Args:
        batch_size: Per-rank batch size of every loader.
        num_workers: DataLoader worker processes (0: load in the main process; the data is 115 KB).
        val_fraction: Share of the 1797 images held out for validation.
        test_fraction: Share held out for testing; the rest trains.
        split_seed: Seed of the split permutation.
    """

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        *,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0 or not 0.0 < test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
            raise ValueError(
                f"DigitsDataModule: val_fraction={val_fraction} and test_fraction={test_fraction} must be in (0, 1) "
                "and sum to less than 1."
            )
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        """Builds all three splits once (they are tiny); later stages reuse them."""
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits  # imported here: only this recipe needs scikit-learn

        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # pixels are 0..16
        labels = torch.as_tensor(digits.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(labels) * self.val_fraction)
        n_test = int(len(labels) * self.test_fraction)
        n_train = len(labels) - n_val - n_test
        parts = torch.split(order, [n_train, n_val, n_test])
        self.train_set, self.val_set, self.test_set = (TensorDataset(images[idx], labels[idx]) for idx in parts)
        log.info("digits: %d train / %d val / %d test images (split_seed=%d)", n_train, n_val, n_test, self.split_seed)

    def _loader(self, dataset: TensorDataset | None, *, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("DigitsDataModule: call setup() before asking for a dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


class DigitsCNN(TaskModule):
    """Two 3x3 convolutions, a 2x2 max-pool and a two-layer classifier head (~160k parameters).

    AdamW with a per-step schedule: linear warm-up for ``warmup_steps``, then cosine decay to zero at the
    run's last optimizer step (held at zero after it, so a too-small ``total_steps`` cannot raise).

    Args:
        lr: Peak learning rate.
        weight_decay: AdamW's decoupled weight decay.
        dropout: Dropout before the last layer.
        warmup_steps: Optimizer steps of linear warm-up.
        total_steps: Optimizer steps of the whole run, used when the Trainer does not provide
            ``estimated_stepping_batches``.
    """

    def __init__(
        self,
        lr: float = 3e-3,
        weight_decay: float = 1e-2,
        *,
        dropout: float = 0.25,
        warmup_steps: int = 20,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(N, 10)`` for images of shape ``(N, 1, 8, 8)``."""
        return self.head(self.features(x))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def _evaluate(self, batch: Batch, stage: str) -> None:
        x, y = batch
        logits = self(x)
        # Means over the batch; the Trainer weights them by batch size and reduces them over ranks.
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log(f"{stage}/acc", (logits.argmax(dim=1) == y).float().mean(), prog_bar=True)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _run_steps(self) -> int:
        """Optimizer steps of the whole run: the Trainer's estimate when it has one, else ``total_steps``."""
        estimated = getattr(self.trainer, "estimated_stepping_batches", None)
        if estimated is not None and math.isfinite(estimated):
            return int(estimated)
        if self.total_steps is None:
            raise ValueError(
                "DigitsCNN: the Trainer has no estimated_stepping_batches, so the schedule needs "
                "total_steps=<optimizer steps of the run> (task.total_steps=... on the command line)."
            )
        return int(self.total_steps)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        total = max(1, self._run_steps())
        warmup = min(self.warmup_steps, total - 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
